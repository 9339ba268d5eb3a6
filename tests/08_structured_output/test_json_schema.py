"""JSON Schema -> regex (structured_output.json_schema), against oracles written elsewhere:
`jsonschema` (is a sampled document valid?), `json.loads`, Python's `datetime` / `urllib` for the
formats jsonschema does not check, and outlines-core's `build_regex_from_schema` (same language?)."""
import datetime
import json
import random
import re
import urllib.parse

import jsonschema
import pytest
from outlines_core.json_schema import build_regex_from_schema as outlines_regex

from structured_output.json_schema import FORMATS, choice_regex, schema_to_regex
from structured_output.regex_dfa import compile_regex, sample_match

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
}
NESTED = {
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                        "required": ["x", "y"]}},
    "type": "object",
    "properties": {
        "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
        "label": {"anyOf": [{"type": "string", "pattern": "^[A-Z][a-z]{0,3}$"}, {"type": "null"}]},
        "kind": {"const": "shape"},
        "meta": {"type": "object", "properties": {"id": {"type": ["integer", "null"]}}},
    },
    "required": ["points"],
}
FORMATTED = {
    "type": "object",
    "properties": {f.replace("-", "_"): {"type": "string", "format": f} for f in FORMATS},
    "required": [f.replace("-", "_") for f in FORMATS],
}
SCHEMAS = {
    "person": PERSON, "nested": NESTED, "formats": FORMATTED,
    "all_optional": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"},
                                                      "c": {"type": "boolean"}}},
    "one_of": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}, {"type": "array",
               "items": {"type": "number"}, "maxItems": 2}]},
    "definitions": {"definitions": {"t": {"type": "string", "enum": ["x", "y"]}},
                    "allOf": [{"type": "array", "items": {"$ref": "#/definitions/t"}, "minItems": 2}]},
}

_FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER      # checks date, email, uuid


def _check_formats(doc: dict) -> None:
    """The formats jsonschema leaves unchecked, checked with the standard library."""
    datetime.time.fromisoformat(doc["time"])
    datetime.datetime.fromisoformat(doc["date_time"])
    assert urllib.parse.urlsplit(doc["uri"]).scheme


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_documents_are_valid(name):
    schema = SCHEMAS[name]
    dfa, rng = compile_regex(schema_to_regex(schema)), random.Random(name)
    for _ in range(25):
        doc = json.loads(sample_match(dfa, rng, max_len=60).decode("utf-8"))
        jsonschema.validate(doc, schema, format_checker=_FORMAT_CHECKER)
        if name == "formats":
            _check_formats(doc)


INVALID = {
    "person": ['{"name":"","age":1}', '{"name":"abcdefghi","age":1}', '{"age":1}', '{"name":"a","age":1.5}',
               '{"name":"a","age":1,"tags":["a","b","a","b"]}', '{"name":"a","age":1,"tags":["c"]}',
               '{"name":"a","age":1,"extra":1}', '{"name":"a","age":01}', '{"name":"a\x01","age":1}'],
    "nested": ['{"points":[]}', '{"points":[{"x":1}]}', '{"points":[{"x":1,"y":2}],"label":"abc"}',
               '{"points":[{"x":1,"y":2}],"kind":"circle"}', '{"points":[{"x":1,"y":2}],"meta":{"id":"7"}}',
               '{"points":[{"x":1,"y":2},{"x":1,"y":2},{"x":1,"y":2}]}'],
    "all_optional": ['{"a":"1"}', '{"d":1}', '[]', 'null'],
    "one_of": ['"abc"', '[1,2,3]', '[true]', '1.5'],
    "definitions": ['["x"]', '["x","z"]', '"x"'],
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_documents_are_rejected(name):
    dfa = compile_regex(schema_to_regex(SCHEMAS[name]))
    # additionalProperties absent is read as false (json_schema's convention): say so to jsonschema
    strict = {**SCHEMAS[name], "additionalProperties": False} if "properties" in SCHEMAS[name] else SCHEMAS[name]
    for text in INVALID[name]:
        with pytest.raises((ValueError, jsonschema.ValidationError)):   # the data: not JSON ...
            jsonschema.validate(json.loads(text), strict)  # ... or not valid under the schema
        assert not dfa.accepts(text.encode()), text


def test_layout_conventions():
    """Optional properties may be omitted (commas only between present ones), order is the
    schema's, and whitespace is bounded by the default `[ ]?`."""
    dfa = compile_regex(schema_to_regex(SCHEMAS["all_optional"]))
    for ok in ['{}', '{"a":1}', '{"b":null}', '{"a":1,"c":true}', '{ "a" : 1 , "b" : null }', '{"c":false}']:
        assert dfa.accepts(ok.encode()), ok
    for bad in ['{,"b":null}', '{"a":1,}', '{"b":null,"a":1}', '{  "a":1}', '{"a":1"b":null}']:
        assert not dfa.accepts(bad.encode()), bad
    compact = compile_regex(schema_to_regex(SCHEMAS["all_optional"], whitespace_pattern=""))
    assert compact.accepts(b'{"a":1}') and not compact.accepts(b'{ "a":1}')


def test_string_escapes_and_lengths():
    dfa = compile_regex(schema_to_regex({"type": "string", "minLength": 2, "maxLength": 2}))
    for ok in [r'"\u00e9x"', r'"\n\""', '"日本"', '"😀a"']:
        assert dfa.accepts(ok.encode()) and len(json.loads(ok)) == 2, ok
    for bad in [r'"\ud83d\ude00"', r'"\x41a"', '"a"', '"abc"', '"a\nb"']:
        assert not dfa.accepts(bad.encode()), bad


# Schemas where our language and outlines-core's are the same. Strings and numbers differ by
# design (outlines: no \u escapes, no U+007F..U+009F, an exponent needs its sign; arrays allow
# whitespace only after the comma), so those are compared by sampling below.
SAME_LANGUAGE = [SCHEMAS["all_optional"], {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
                 {"anyOf": [{"type": "integer"}, {"type": "null"}]}, {"enum": ["a", 1, None, 'x"y']},
                 {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                                                   "c": {"type": "integer"}}, "required": ["b"]},
                 {"type": "array", "items": {"type": "boolean"}, "maxItems": 0}]


@pytest.mark.parametrize("schema", SAME_LANGUAGE, ids=range(len(SAME_LANGUAGE)))
def test_same_language_as_outlines_core(schema):
    """Minimal DFAs are canonical (regex_dfa): equal DFAs = equal languages, exactly."""
    for ws in ("", None):
        if ws is None and schema.get("type") == "array":
            continue                                  # arrays: outlines has no whitespace before ','
        theirs = outlines_regex(json.dumps(schema), ws)
        assert compile_regex(schema_to_regex(schema, ws)) == compile_regex(theirs)


def _outlines_excludes(text: str) -> bool:
    """The documented differences: what outlines-core's regex does not allow but JSON does."""
    return ("\\u" in text or any(0x7F <= ord(c) <= 0x9F for c in text)
            or re.search(r"[0-9][eE][0-9]", text) is not None)


@pytest.mark.parametrize("name", ["person", "nested", "all_optional", "one_of"])
def test_agrees_with_outlines_core_on_samples(name):
    schema, rng = SCHEMAS[name], random.Random(name)
    ours, theirs = schema_to_regex(schema, ""), outlines_regex(json.dumps(schema), "")
    ours_dfa, theirs_dfa = compile_regex(ours), compile_regex(theirs)
    for _ in range(20):
        doc = sample_match(theirs_dfa, rng, 50).decode()         # theirs is a subset of ours
        assert re.fullmatch(ours, doc) and re.fullmatch(theirs, doc), doc
        doc = sample_match(ours_dfa, rng, 50).decode()
        assert bool(re.fullmatch(theirs, doc)) != _outlines_excludes(doc), doc
        mutated = doc[:-1] if rng.random() < 0.5 else doc.replace(":", "", 1)
        assert bool(re.fullmatch(ours, mutated)) == bool(re.fullmatch(theirs, mutated)), mutated


def test_choice_regex():
    choices = ["a.b", "(x)", "日本", "a|b", "\\", "[1-2]{3}", ""]
    dfa = compile_regex(choice_regex(choices))
    assert all(dfa.accepts(c.encode()) for c in choices)
    for bad in ["axb", "x", "a", "1", "[1-2]{3}x", "b"]:
        assert not dfa.accepts(bad.encode()), bad
    with pytest.raises(ValueError, match="non-empty list"):
        choice_regex([])


@pytest.mark.parametrize("schema,message", [
    ({"type": "integer", "minimum": 0}, "keyword 'minimum' at path #"),
    ({"type": "number", "exclusiveMaximum": 3}, "keyword 'exclusiveMaximum' at path #"),
    ({"type": "object", "properties": {"a": {"type": "string", "foo": 1}}}, "keyword 'foo' at path #/properties/a"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "keyword 'uniqueItems' at path #"),
    ({"type": "object", "properties": {}, "additionalProperties": True}, "keyword 'additionalProperties' at path #"),
    ({"type": "object", "properties": {}, "patternProperties": {}}, "keyword 'patternProperties' at path #"),
    ({"not": {"type": "null"}}, "keyword 'not' at path #"),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "keyword 'prefixItems' at path #"),
    ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"}, "recursive $ref"),
    ({"allOf": [{"type": "integer"}, {"type": "number"}]}, "'allOf' at path # with 2 subschemas"),
    ({"type": "object"}, "without 'properties'"),
    ({}, "allows any JSON value"),
    ({"type": "string", "format": "hostname"}, "unsupported string format 'hostname'"),
    ({"type": "string", "format": "date", "maxLength": 3}, "not supported"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "'required' at path #"),
    ({"type": "integer", "enum": ["a"]}, "declared type"),
    ({"$ref": "http://example.com/s.json"}, "only local references"),
])
def test_unsupported_schemas_raise_naming_the_keyword(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(schema)
