"""Structured output through the engine (chapter 08 behind chapter 07's seam), on the real SmolLM2.

Oracles nobody here wrote: `jsonschema` validates every JSON document the engine writes, Python's
`re` checks every regex output, and real xgrammar — run as the engine's other backend — must allow
the same tokens, so the two backends' greedy outputs are the same tokens. Composition: n > 1,
speculative decoding (drafts cut by the grammar, every draft position masked), chunked prefill,
prefix caching, preemption, async scheduling, and a mixed batch in which an unconstrained request
is unaffected. Bad specs are refused before anything is queued.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mini_vllm import SamplingParams
from mini_vllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"},
                                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CHOICES = ["positive", "negative", "neutral"]


def chat(tokenizer, text: str) -> dict:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return {"prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)}


def constrained(max_tokens=48, temperature=0.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kw))


CASES = [
    ("json", dict(json=PERSON, disable_any_whitespace=True), "Describe a person who lives in Europe, as JSON."),
    ("regex", dict(regex=DATE), "When did the first person walk on the moon? Give the date."),
    ("choice", dict(choice=CHOICES), "Classify the sentiment: 'I love this movie!'"),
]


def check_output(kind: str, spec: dict, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), spec["json"])
    elif kind == "regex":
        assert re.fullmatch(spec["regex"], text), text
    else:
        assert text in spec["choice"], text


@pytest.fixture(scope="module")
def engines(make_llm, smollm2_dir):
    return {b: make_llm(smollm2_dir, dtype="float32", structured_outputs_config={"backend": b})
            for b in ("from_scratch", "xgrammar")}


def test_each_backend_writes_valid_output_and_both_agree(engines, smollm2_tokenizer):
    prompts = [chat(smollm2_tokenizer, text) for _, _, text in CASES]
    params = [constrained(**spec) for _, spec, _ in CASES]
    results = {}
    for backend, llm in engines.items():
        outs = llm.generate(prompts, params)
        for (kind, spec, _), out in zip(CASES, outs):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop", (backend, kind, completion)
            check_output(kind, spec, completion.text)
        results[backend] = [o.outputs[0].token_ids for o in outs]
    assert results["from_scratch"] == results["xgrammar"]


@pytest.mark.parametrize("case", [0, 1], ids=["json", "regex"])
def test_greedy_equals_hf_generate_with_xgrammars_logits_processor(case, engines, smollm2_hf, smollm2_tokenizer):
    """The oracle nobody here wrote, end to end: HF `generate` masked by xgrammar's own HF logits
    processor writes the same tokens as our engine with this chapter's backend."""
    import torch
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    kind, spec, text = CASES[case]
    prompt = chat(smollm2_tokenizer, text)["prompt_token_ids"]
    ours = engines["from_scratch"].generate([{"prompt_token_ids": prompt}], constrained(**spec))[0].outputs[0]
    eos = smollm2_hf.generation_config.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=smollm2_hf.config.vocab_size,
                                              stop_token_ids=eos if isinstance(eos, list) else [eos])
    compiler = xgr.GrammarCompiler(info)
    compiled = (compiler.compile_json_schema(json.dumps(spec["json"]), any_whitespace=False, separators=(",", ":"))
                if kind == "json"
                else compiler.compile_regex(spec["regex"]))
    with torch.no_grad():
        out = smollm2_hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=48, do_sample=False, logits_processor=[LogitsProcessor(compiled)])
    assert ours.token_ids == out[0, len(prompt):].tolist()


SCHEMAS = [
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["title", "tags"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "where": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 20}]},
                                      "score": {"type": "number"}},
     "required": ["when", "score"]},
    {"type": "object", "properties": {"user": {"$ref": "#/$defs/user"}, "active": {"type": "boolean"}},
     "required": ["user", "active"],
     "$defs": {"user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                         "email": {"type": "string", "format": "email"}},
                        "required": ["id", "email"]}}},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                "required": ["x", "y"]}, "minItems": 2, "maxItems": 2},
]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_corpus_of_schemas_every_finished_output_validates(temperature, engines, smollm2_tokenizer):
    prompts = [chat(smollm2_tokenizer, f"Write a JSON document for this schema: {json.dumps(s)}") for s in SCHEMAS]
    params = [SamplingParams(temperature=temperature, seed=11, max_tokens=96,
                             structured_outputs=StructuredOutputsParams(json=s)) for s in SCHEMAS]
    outs = engines["from_scratch"].generate(prompts, params)
    finished = 0
    for schema, out in zip(SCHEMAS, outs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
            finished += 1
        else:
            assert completion.finish_reason == "length", completion
    assert finished >= len(SCHEMAS) - 1


def test_a_grammar_the_vocabulary_cannot_spell_fails_alone_with_a_reason(engines, smollm2_tokenizer):
    """SmolLM2 has no token for the byte 0x04: the regex can never be written. The request fails with
    the reason (no hang, no unconstrained text); its neighbour in the batch is unaffected."""
    llm = engines["from_scratch"]
    free = chat(smollm2_tokenizer, "Name three colours.")
    plain = SamplingParams(temperature=0, max_tokens=16)
    alone = llm.generate([free], plain)[0].outputs[0].token_ids
    outs = llm.generate([chat(smollm2_tokenizer, "hi"), free], [constrained(regex="\x04[a-z]+"), plain])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "no token of the vocabulary" in outs[0].outputs[0].stop_reason
    assert outs[1].outputs[0].token_ids == alone


def test_an_unconstrained_request_in_the_same_batch_is_unaffected(engines, smollm2_tokenizer):
    llm = engines["from_scratch"]
    free = chat(smollm2_tokenizer, "Name three colours.")
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate([free], plain)[0].outputs[0].token_ids
    kind, spec, text = CASES[0]
    mixed = llm.generate([chat(smollm2_tokenizer, text), free], [constrained(**spec), plain])
    check_output(kind, spec, mixed[0].outputs[0].text)
    assert mixed[1].outputs[0].token_ids == alone


def test_sampled_n_completions_all_follow_the_grammar(engines, smollm2_tokenizer):
    kind, spec, text = CASES[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=64, structured_outputs=StructuredOutputsParams(**spec))
    out = engines["from_scratch"].generate([chat(smollm2_tokenizer, text)], params)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        if completion.finish_reason == "stop":
            check_output(kind, spec, completion.text)
        else:                                   # ran out of tokens: still a prefix of the language
            assert completion.finish_reason == "length"


@pytest.mark.parametrize("config", [
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                             "prompt_lookup_max": 3}),
    dict(speculative_config={"method": "eagle", "num_speculative_tokens": 4, "tree_depth": 3, "tree_top_k": 2}),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4),
    dict(async_scheduling=True),
    dict(num_gpu_blocks_override=12, max_num_seqs=3),          # preemption: 3 requests, room for about 2
], ids=["ngram", "eagle_tree", "chunked", "async", "preemption"])
def test_composes_and_keeps_the_greedy_tokens(config, engines, make_llm, smollm2_dir, smollm2_tokenizer):
    prompts = [chat(smollm2_tokenizer, text) for _, _, text in CASES]
    params = [constrained(**spec) for _, spec, _ in CASES]
    want = [o.outputs[0].token_ids for o in engines["from_scratch"].generate(prompts, params)]
    llm = make_llm(smollm2_dir, dtype="float32", **config)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want


def test_prefix_cache_hit_then_constrained_second_turn(engines, smollm2_tokenizer):
    llm = engines["from_scratch"]
    kind, spec, text = CASES[1]
    prompt = chat(smollm2_tokenizer, text)
    first = llm.generate([prompt], constrained(**spec))[0]
    second = llm.generate([prompt], constrained(**spec))[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("spec, needle", [
    (dict(regex="a(b"), "regex"),
    (dict(json='{"type": "object", "properties": '), "not valid JSON"),
    (dict(json={"type": "object", "patternProperties": {"^x": {"type": "string"}}}), "patternProperties"),
    (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
])
def test_a_bad_spec_is_refused_before_anything_is_queued(engines, smollm2_tokenizer, spec, needle):
    llm = engines["from_scratch"]
    with pytest.raises(ValueError, match=needle):
        llm.generate([chat(smollm2_tokenizer, "hi")], constrained(**spec))
    ok = llm.generate([chat(smollm2_tokenizer, "hi")], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(ok.outputs[0].token_ids) == 4


def test_params_are_checked():
    with pytest.raises(ValueError, match="only use one kind"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="must use one kind"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


@pytest.mark.gpu
def test_on_the_gpu_with_async_scheduling_both_backends_agree(make_llm, smollm2_dir, smollm2_tokenizer):
    """On CUDA (the Triton mask kernel, masks copied to the device, async scheduling on): each output
    is in its language and the two backends write the same tokens."""
    prompts = [chat(smollm2_tokenizer, text) for _, _, text in CASES]
    params = [constrained(**spec) for _, spec, _ in CASES]
    results = {}
    for backend in ("from_scratch", "xgrammar"):
        llm = make_llm(smollm2_dir, dtype="float32", device="cuda", kv_cache_memory=256 << 20, async_scheduling=True,
                       structured_outputs_config={"backend": backend})
        outs = llm.generate(prompts, params)
        for (kind, spec, _), out in zip(CASES, outs):
            assert out.outputs[0].finish_reason == "stop", (backend, kind)
            check_output(kind, spec, out.outputs[0].text)
        results[backend] = [o.outputs[0].token_ids for o in outs]
    assert results["from_scratch"] == results["xgrammar"]
