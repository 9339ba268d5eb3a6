"""Penalties and logits processors through the whole engine, token for token against HF
transformers' `generate` with the corresponding logits processors (greedy), all requests of a
model in ONE batch, next to a request that uses none of them:

    repetition_penalty  -> RepetitionPenaltyLogitsProcessor (prompt + output, same definition)
    min_tokens          -> MinNewTokensLengthLogitsProcessor (with the stop ids as EOS ids)
    bad_words           -> NoBadWordsLogitsProcessor (the token ids our Processor derived)
    logit_bias          -> SequenceBiasLogitsProcessor (one-token sequences)
    allowed_token_ids   -> PrefixConstrainedLogitsProcessor
    presence / frequency, and everything at once -> HF generate with an independent NumPy
                           version of vLLM's definitions as its logits processor (sampling_oracle.py)

Each case is built from the model's own plain greedy output so that the constraint bites (the
test checks that the tokens changed): a penalty that is never applied fails the "changed"
check; one applied over the wrong tokens, the wrong row, or at the wrong step fails parity.
Also: speculative decoding with penalties gives the engine's own tokens without speculation
(draft rows see the drafts before them), and bad input fails at add_request, the engine serving on.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mini_vllm import SamplingParams
from sampling_oracle import numpy_vllm_row

MAX_NEW = 12


@torch.inference_mode()
def hf_generate(hf_model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def numpy_processor(params: SamplingParams, prompt_len: int):
    """An HF LogitsProcessor that applies sampling_oracle.numpy_vllm_row to the scores."""
    from transformers import LogitsProcessor

    class NumpyVLLM(LogitsProcessor):
        def __call__(self, input_ids, scores):
            ids = input_ids[0].tolist()
            row = numpy_vllm_row(scores[0].numpy(), params, ids[:prompt_len], ids[prompt_len:])
            return torch.from_numpy(row).to(scores.dtype)[None]
    return NumpyVLLM()


def round_trip_words(tokenizer, tokens: list[int], processor) -> tuple[str, str]:
    """(a one-token word, a two-token word) taken from `tokens` whose spelling our Processor turns
    back into exactly those ids — so banning the word bans what the plain output did."""
    one = two = None
    for i, t in enumerate(tokens):
        text = tokenizer.decode([t])
        if one is None and text.strip() and (t,) in _word_ids(processor, text):
            one = text
        if two is None and i + 1 < len(tokens) and tokens[i] != tokens[i + 1]:
            text2 = tokenizer.decode(tokens[i:i + 2])
            if text2.strip() and tuple(tokens[i:i + 2]) in _word_ids(processor, text2):
                two = text2
    assert one is not None and two is not None, f"no round-tripping words in {tokens}"
    return one, two


def _word_ids(processor, word: str) -> tuple[tuple[int, ...], ...]:
    return processor.prepare_params(SamplingParams(bad_words=[word]))._bad_words_token_ids


def cases(llm, hf_model, prompt: list[int]) -> tuple[list[tuple[str, SamplingParams, dict | None]], list[int]]:
    """([(name, our params, HF generate kwargs or None: the NumPy oracle)], the plain greedy output)."""
    plain = hf_generate(hf_model, prompt, MAX_NEW)
    processor = llm.llm_engine.processor
    one, two = round_trip_words(llm.get_tokenizer(), plain, processor)
    bad = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, bad_words=[one, two])
    bad_ids = [list(w) for w in processor.prepare_params(bad)._bad_words_token_ids]
    assert all(w[0] != prompt[-1] for w in bad_ids if len(w) > 1), "HF would match the prompt's tail"
    allowed = sorted((set(plain) | set(np.random.default_rng(0).integers(100, 49000, 20).tolist())) - {plain[0]})
    g = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    everything = SamplingParams(**g, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.4,
                                logit_bias={plain[0]: -3.0, plain[2]: 2.0}, bad_words=[one])
    return [
        ("plain", SamplingParams(**g), {}),
        # Below 1 the penalty favours what was seen: a random model then surely changes its output.
        ("repetition", SamplingParams(**g, repetition_penalty=0.5), dict(repetition_penalty=0.5)),
        ("min_tokens", SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=5, stop_token_ids=[plain[0]]),
         dict(min_new_tokens=5, eos_token_id=[plain[0], *llm.llm_engine.model_config.eos_token_ids])),
        ("bad_words", bad, dict(bad_words_ids=bad_ids)),
        ("logit_bias", SamplingParams(**g, logit_bias={plain[0]: -5.0, plain[3]: 4.0}),
         dict(sequence_bias={(plain[0],): -5.0, (plain[3],): 4.0})),
        ("allowed", SamplingParams(**g, allowed_token_ids=allowed),
         dict(prefix_allowed_tokens_fn=lambda batch_id, ids: allowed)),
        ("presence_frequency", SamplingParams(**g, presence_penalty=-2.0, frequency_penalty=-0.5), None),
        ("everything", everything, None),
    ], plain


def check_against_hf(llm, hf_model, prompts: list[list[int]]):
    all_cases, expected = [], []
    for prompt in prompts:
        prompt_cases, plain = cases(llm, hf_model, prompt)
        for name, params, hf_kwargs in prompt_cases:
            if hf_kwargs is None:
                hf_kwargs = dict(logits_processor=[numpy_processor(llm.llm_engine.processor.prepare_params(params),
                                                                   len(prompt))])
            all_cases.append((name, prompt, params))
            expected.append((hf_generate(hf_model, prompt, MAX_NEW, **hf_kwargs), plain))
    outputs = llm.generate([{"prompt_token_ids": p} for _, p, _ in all_cases], [c[2] for c in all_cases],
                           use_tqdm=False)
    for (name, prompt, params), out, (ref, plain) in zip(all_cases, outputs, expected):
        ours = out.outputs[0].token_ids
        if name == "min_tokens":
            assert ours == ref and len(ours) > 5 and plain[0] not in ours[:5], (ours, ref)   # plain stops at once
            continue
        assert ours[:len(ref)] == ref, f"{name}: ours {ours} vs HF {ref}"
        assert (ours == plain) == (name == "plain"), f"{name} did not change the greedy output: the test proves nothing"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_match_hf_logits_processors(arch, tiny_engine_models, make_llm):
    model_dir, hf_model = tiny_engine_models[arch]
    llm = make_llm(model_dir, block_size=4)
    tok = llm.get_tokenizer()
    prompts = [tok("The quick brown fox jumps over the lazy dog because").input_ids,
               tok("Paged attention stores the KV cache in blocks").input_ids]
    check_against_hf(llm, hf_model, prompts)


@pytest.mark.model
def test_smollm2_matches_hf_logits_processors(smollm2_dir, smollm2_hf, make_llm):
    llm = make_llm(smollm2_dir)
    tok = llm.get_tokenizer()
    check_against_hf(llm, smollm2_hf, [tok("The history of the Roman Empire begins").input_ids])


def test_speculative_decoding_with_penalties_gives_the_same_tokens(tiny_engine_models, make_llm):
    """Drafts are verified against penalised distributions: the row at draft position j
    must count the first j drafts. Same greedy tokens as the engine without speculation."""
    model_dir = tiny_engine_models["llama"][0]
    rng = np.random.default_rng(3)
    base = rng.integers(100, 49000, 8).tolist()
    prompts = [base * 3, base[:4] * 5, rng.integers(100, 49000, 15).tolist()]
    g = dict(temperature=0, max_tokens=20, ignore_eos=True)
    params = [SamplingParams(**g, frequency_penalty=0.3, repetition_penalty=1.1),
              SamplingParams(**g, presence_penalty=0.5, min_tokens=4, logit_bias={base[1]: 1.0}),
              SamplingParams(**g)]
    ref = [o.outputs[0].token_ids for o in make_llm(model_dir, block_size=4).generate(prompts, params, use_tqdm=False)]
    # The target drafting for itself: its unpenalised greedy drafts are often, not always, what
    # the penalised rows pick — both acceptance and rejection happen.
    spec = make_llm(model_dir, block_size=4, speculative_config={
        "method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3, "adaptive": False})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == ref
    stats = spec.llm_engine.engine_core.spec_decoding_stats.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "drafts all accepted or all rejected: proves little"


@pytest.mark.parametrize("kwargs,message", [
    (dict(logit_bias={49152: 1.0}), r"logit_bias has token ids outside the vocabulary"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias has token ids outside the vocabulary"),
    (dict(allowed_token_ids=[5, 10**6]), r"allowed_token_ids has token ids outside the vocabulary"),
    (dict(allowed_token_ids=[2], min_tokens=3), r"allowed_token_ids leaves nothing to sample"),
])
def test_bad_input_fails_at_add_request_and_the_engine_serves_on(kwargs, message, tiny_engine_models, make_llm):
    llm = make_llm(tiny_engine_models["qwen3"][0])
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=message):
        llm.generate(["a good prompt", "a bad one"], [good, SamplingParams(max_tokens=8, **kwargs)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate("still serving", good, use_tqdm=False)[0].outputs[0].token_ids) == 3
