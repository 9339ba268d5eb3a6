"""JSON Schema -> regex: how `response_format={"type": "json_schema", ...}` becomes an automaton.

A JSON schema without recursion describes a REGULAR language of JSON texts: each keyword maps to
a piece of regex, nested the way the schema nests. This is the idea of outlines-core's
`build_regex_from_schema` (`src/json_schema/` in outlines-core, which vLLM's outlines backend
calls); written here from the idea, with these conventions (outlines' where it has one):

  * The output is ONE canonical layout: properties appear in the schema's order, and between
    tokens only `whitespace_pattern` may appear (default `[ ]?`: at most one space). A bounded
    pattern matters: with `[ ]*` a model could emit spaces forever and never be wrong.
  * `additionalProperties` absent is treated as false (outlines' default): the model may only
    write the listed keys. Optional properties (not in `required`) may be left out; the comma
    placement for that is the one subtle bit (`_object_body`).
  * Strings: any JSON string character — anything but `"`, `\\` and control characters, or an
    escape (`\\n`, `\\"`, `\\u00e9` ...). `\\u` escapes of surrogates are excluded (write the
    character itself as UTF-8), so min/maxLength count exactly the characters Python decodes.
    `pattern` is matched against the raw text between the quotes (escapes are not decoded) and,
    as in outlines, anchored: it must match the whole string.
  * `anyOf` / `oneOf` become alternation (oneOf's "exactly one" is not enforced); `allOf` is
    accepted with a single subschema; `$ref` to local definitions is inlined, and a recursive
    reference is refused: its language is not regular (use the grammar backend).
  * What a regex cannot express exactly is REFUSED with a ValueError naming the keyword and its
    path, never silently ignored: numeric bounds (minimum, maximum, multipleOf ...), uniqueItems,
    additionalProperties other than false, and any-JSON values (`{}`, an object without
    `properties`, an array without `items`: nesting without a bound needs a grammar).
"""
from __future__ import annotations

import json

WHITESPACE = r"[ ]?"
# One JSON string character: raw (not ", \ or a control char) or an escape (no surrogate \u escapes).
STRING_CHAR = (r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]'
               r'|\\u(?:[0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))')
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"

# Formats (the text between the quotes). Dates are exact: days per month, Feb 29 in leap years only.
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"                      # 0001..9999
# divisible by 4 and not by 100 (the last two digits), or by 400 (the century digits, then 00)
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = ("(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
              "|(?:0[13578]|1[02])-31)")
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
         r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")                                 # RFC 3339 full-time
_HEX = "[0-9a-fA-F]"
_EMAIL_ATOM = r"[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = "[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": rf"{_EMAIL_ATOM}(?:\.{_EMAIL_ATOM})*@(?:{_LABEL}\.)+[a-zA-Z]{{2,63}}",
    # scheme ":" then RFC 3986 characters (the hierarchy's inner structure is not checked)
    "uri": r"[a-zA-Z][a-zA-Z0-9+.\-]*:(?:[a-zA-Z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9a-fA-F]{2})+",
}

ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "examples", "default",
               "deprecated", "readOnly", "writeOnly", "$defs", "definitions"}
TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": set(), "number": set(), "boolean": set(), "null": set(),
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
}
COMBINATORS = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"}
NOT_REGULAR = {                      # keywords refused with the reason
    **dict.fromkeys(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"],
                    "a numeric bound is not expressible exactly as a regex"),
    "uniqueItems": "uniqueness of array items is not a regular language",
}
KNOWN = ANNOTATIONS | COMBINATORS | set().union(*TYPE_KEYWORDS.values())


def regex_escape(text: str) -> str:
    """`text` as a regex matching exactly itself (only the metacharacters are escaped)."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


def json_literal(value) -> str:
    """The regex of one JSON value, written compactly (`const`, `enum`)."""
    return regex_escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def choice_regex(choices: list[str]) -> str:
    """vLLM's `choice=[...]`: the output is exactly one of the strings."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"choice needs a non-empty list of strings, got {choices!r}")
    return "(?:" + "|".join(regex_escape(c) for c in choices) + ")"


# disable_any_whitespace: no whitespace at all, vLLM's layout (its backend_xgrammar.py hands xgrammar
# these separators; json.dumps(..., separators=(",", ":")) writes the same).
COMPACT_SEPARATORS = (",", ":")


def schema_to_regex(schema: str | dict, whitespace_pattern: str | None = None,
                    separators: tuple[str, str] | None = None) -> str:
    """The regex of every JSON text valid under `schema` (a dict or its JSON text), in the
    layout described above. ValueError names any keyword (and its path) it cannot express.
    `separators` (item, key), e.g. COMPACT_SEPARATORS: exactly these between items and after keys,
    and no other whitespace (one spelling per document: what `disable_any_whitespace` asks for)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if separators is not None:
        return _Converter(schema, "", *map(regex_escape, separators)).convert(schema, "#")
    ws = WHITESPACE if whitespace_pattern is None else whitespace_pattern
    return _Converter(schema, ws, f"{ws},{ws}", f"{ws}:{ws}").convert(schema, "#")


def _repeat(lo: int, hi: int | None) -> str:
    return f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"


def _has_type(value, type_: str) -> bool:
    """Is the JSON value `value` of JSON Schema type `type_`? (1 and 1.0 are integers and numbers.)"""
    if isinstance(value, bool):
        return type_ == "boolean"
    if isinstance(value, (int, float)):
        return type_ == "number" or (type_ == "integer" and float(value).is_integer())
    return type_ == {str: "string", type(None): "null", list: "array", dict: "object"}[type(value)]


def _object_body(props: list[tuple[str, bool]], sep: str) -> str:
    """Properties in order, each (regex, required), joined by `sep` (the comma) so that a comma
    appears only BETWEEN present properties. With a required property R, everything before R
    carries its comma after it and everything after R carries its comma before it. With none
    required (the caller makes the whole body optional): choose which property comes first,
    then each later one is optional."""
    required = [i for i, (_, req) in enumerate(props) if req]
    if required:
        first = required[0]
        before = "".join(f"(?:{p}{sep})?" for p, _ in props[:first])
        after = "".join(f"{sep}{p}" if req else f"(?:{sep}{p})?" for p, req in props[first + 1:])
        return before + props[first][0] + after
    starts = [props[i][0] + "".join(f"(?:{sep}{p})?" for p, _ in props[i + 1:]) for i in range(len(props))]
    return "(?:" + "|".join(starts) + ")"


class _Converter:
    def __init__(self, root: dict, ws: str, item_sep: str, key_sep: str):
        # ws: optional whitespace inside brackets; item_sep / key_sep: the regexes of "," and ":"
        self.root, self.ws, self.item_sep, self.key_sep = root, ws, item_sep, key_sep
        self.active_refs: list[str] = []          # the $ref chain being inlined (to catch recursion)

    def convert(self, schema, path: str) -> str:
        if schema is True or schema == {}:
            raise ValueError(f"schema at path {path} allows any JSON value: nesting without a bound is "
                             "not a regular language (use the grammar backend / json_object)")
        if not isinstance(schema, dict):
            raise ValueError(f"schema at path {path} must be an object, got {schema!r}")
        for key in schema:
            if key in NOT_REGULAR:
                raise ValueError(f"unsupported JSON Schema keyword {key!r} at path {path}: {NOT_REGULAR[key]}")
            if key not in KNOWN:
                raise ValueError(f"unsupported JSON Schema keyword {key!r} at path {path}")
        active = set(schema) - ANNOTATIONS
        for combinator in ("$ref", "anyOf", "oneOf", "allOf"):
            if combinator in schema and active != {combinator}:
                raise ValueError(f"{combinator!r} at path {path} with sibling keywords "
                                 f"{sorted(active - {combinator})} is not supported")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path)
        if "anyOf" in schema or "oneOf" in schema:
            key = "anyOf" if "anyOf" in schema else "oneOf"
            options = [self.convert(s, f"{path}/{key}/{i}") for i, s in enumerate(schema[key])]
            return "(?:" + "|".join(options) + ")"
        if "allOf" in schema:
            if len(schema["allOf"]) != 1:
                raise ValueError(f"'allOf' at path {path} with {len(schema['allOf'])} subschemas is not "
                                 "supported (only one: intersections are not computed)")
            return self.convert(schema["allOf"][0], f"{path}/allOf/0")
        types = self.types(schema, path)
        if "const" in schema or "enum" in schema:
            return self.enum(schema, types, path)
        options = [self.typed(t, schema, path) for t in types]
        return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"

    def types(self, schema: dict, path: str) -> list[str]:
        """The schema's types: `type` (a name or a list), else inferred from the keywords used."""
        declared = schema.get("type")
        if declared is not None:
            types = declared if isinstance(declared, list) else [declared]
            for t in types:
                if t not in TYPE_KEYWORDS:
                    raise ValueError(f"unknown JSON Schema type {t!r} at path {path}")
            return types
        if "const" in schema or "enum" in schema:
            return list(TYPE_KEYWORDS)
        inferred = [t for t, keys in TYPE_KEYWORDS.items() if keys & set(schema)]
        if len(inferred) != 1:
            raise ValueError(f"schema at path {path} has no 'type' and its keywords do not name one "
                             "(any JSON value is not a regular language)")
        return inferred

    def enum(self, schema: dict, types: list[str], path: str) -> str:
        """const / enum: the listed values (of the declared types) as literals."""
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        kept = [v for v in values if any(_has_type(v, t) for t in types)]
        if not kept:
            raise ValueError(f"no value of 'const'/'enum' at path {path} has the declared type {types}")
        return "(?:" + "|".join(json_literal(v) for v in kept) + ")"

    def ref(self, ref: str, path: str) -> str:
        if not ref.startswith("#/"):
            if ref == "#":
                raise ValueError(f"recursive $ref '#' at path {path}: a recursive schema is not a regular language")
            raise ValueError(f"$ref {ref!r} at path {path}: only local references ('#/$defs/...') are supported")
        if ref in self.active_refs:
            raise ValueError(f"recursive $ref {ref!r} at path {path}: a recursive schema is not a regular "
                             "language (use the grammar backend)")
        target = self.root
        for part in ref[2:].split("/"):                 # a JSON pointer: ~1 is '/', ~0 is '~'
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"$ref {ref!r} at path {path} does not resolve")
            target = target[part]
        self.active_refs.append(ref)
        try:
            return self.convert(target, ref)
        finally:
            self.active_refs.pop()

    def typed(self, type_: str, schema: dict, path: str) -> str:
        if type_ == "string":
            return self.string(schema, path)
        if type_ == "object":
            return self.object(schema, path)
        if type_ == "array":
            return self.array(schema, path)
        return {"integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}[type_]

    def string(self, schema: dict, path: str) -> str:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if "pattern" in schema or "format" in schema:
            if len({"pattern", "format", "minLength", "maxLength"} & set(schema)) > 1:
                raise ValueError(f"string at path {path}: combining pattern/format/minLength/maxLength is "
                                 "not supported (the intersection is not computed)")
            if "format" in schema:
                if schema["format"] not in FORMATS:
                    raise ValueError(f"unsupported string format {schema['format']!r} at path {path} "
                                     f"(supported: {sorted(FORMATS)})")
                return f'"{FORMATS[schema["format"]]}"'
            return '"(?:' + schema["pattern"].removeprefix("^").removesuffix("$") + ')"'
        return f'"{STRING_CHAR}{_repeat(lo, hi)}"'

    def object(self, schema: dict, path: str) -> str:
        if "properties" not in schema:
            raise ValueError(f"object at path {path} without 'properties' allows any keys and values: "
                             "not a regular language (use the grammar backend / json_object)")
        if schema.get("additionalProperties", False) is not False:
            raise ValueError(f"unsupported JSON Schema keyword 'additionalProperties' at path {path}: "
                             "only false (or absent, read as false) is supported")
        props, required = schema["properties"], schema.get("required", [])
        missing = set(required) - set(props)
        if missing:
            raise ValueError(f"'required' at path {path} names {sorted(missing)}, which are not in 'properties'")
        ws = self.ws
        parts = [(f'{json_literal(name)}{self.key_sep}{self.convert(sub, f"{path}/properties/{name}")}', name in required)
                 for name, sub in props.items()]
        if not parts:
            return rf"\{{{ws}\}}"
        body = ws + _object_body(parts, self.item_sep)
        if not any(req for _, req in parts):
            body = f"(?:{body})?"                       # the empty object: no whitespace twice
        return rf"\{{{body}{ws}\}}"

    def array(self, schema: dict, path: str) -> str:
        if not isinstance(schema.get("items"), dict):
            raise ValueError(f"array at path {path} needs 'items' to be one schema (any items, or a "
                             "tuple of them, is not supported)")
        lo, hi, ws = schema.get("minItems", 0), schema.get("maxItems"), self.ws
        if hi == 0:
            return rf"\[{ws}\]"
        item = self.convert(schema["items"], f"{path}/items")
        elements = f"{item}(?:{self.item_sep}{item}){_repeat(max(lo - 1, 0), None if hi is None else hi - 1)}"
        if lo == 0:
            elements = f"(?:{elements})?"
        return rf"\[{ws}{elements}{ws}\]"
