"""Parity on tiny randomly initialised checkpoints of every supported architecture.

Each case is saved by HF `save_pretrained(safe_serialization=True)` (one sharded), loaded by our
loader, and compared with the same HF model: prefill logits within the fp32 tolerance, and
greedy tokens identical through a paged cache with shuffled blocks and NaN in unwritten slots.
Random weights are never the only proof (test_smollm2_parity.py runs the real model); they cover
the switches SmolLM2 does not exercise: RoPE scaling, biases, QK-norm, untied heads, MQA.
"""
from __future__ import annotations

import json

import pytest
import torch
from tolerances import assert_close, tol

from mini_vllm.config import ModelConfig
from mini_vllm.models.loader import get_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

CASES = {
    # name: (HF model_type, config overrides, max_shard_size)
    "llama": ("llama", {}, None),
    "llama-linear-rope-bias": ("llama", {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                         "attention_bias": True, "mlp_bias": True}, None),
    "llama3-rope-tied": ("llama", {"rope_theta": 5e5, "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}, None),
    "mistral-mqa": ("mistral", {"num_key_value_heads": 1, "sliding_window": None, "head_dim": 16}, None),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}, None),
    "qwen3-sharded": ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}, "60KB"),
}

PROMPTS = {"a": [5, 17, 99, 3, 250, 7, 11], "b": [300, 2, 41, 41, 41, 8, 123, 77, 19, 400, 6]}
MAX_NEW = 16


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tiny_checkpoint):
    model_type, overrides, shard = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_checkpoint(path, model_type, max_shard_size=shard, **overrides)
    config = ModelConfig.from_pretrained(path)
    return request.param, path, hf, config, get_model(config)


def test_config_reads_the_switches(case):
    name, path, hf, config, model = case
    h = hf.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (h.num_attention_heads, h.num_key_value_heads, getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads)
    assert config.tie_word_embeddings == h.tie_word_embeddings
    assert config.rope_theta == h.rope_parameters["rope_theta"]
    assert (config.rope_scaling or {}).get("rope_type", "default") == h.rope_parameters["rope_type"]
    assert model.lm_head.weight is model.model.embed_tokens.weight if config.tie_word_embeddings \
        else model.lm_head.weight is not model.model.embed_tokens.weight
    if name == "qwen3-sharded":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, "the sharded case must really be sharded"


@torch.inference_mode()
def test_prefill_logits_match_hf(case, paged_driver):
    name, path, hf, config, model = case
    driver = paged_driver(model, config, num_blocks=32, block_size=4)
    for r, prompt in PROMPTS.items():
        driver.add(r, prompt)
    # Both prompts in one ragged step; compare every position's logits, not just the last.
    ours = driver.step(list(PROMPTS), all_logits=True)
    ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS.values()]).float()
    assert_close(ours, ref, torch.float32, msg=name)


def test_greedy_matches_hf_generate(case, paged_driver, hf_oracle):
    name, path, hf, config, model = case
    hf_greedy, assert_same_greedy = hf_oracle
    ours = paged_driver(model, config, num_blocks=32, block_size=4, seed=1).greedy(PROMPTS, MAX_NEW)
    for r, prompt in PROMPTS.items():
        assert_same_greedy(ours[r], hf_greedy(hf, prompt, MAX_NEW), MAX_NEW, config.eos_token_ids, f"{name}/{r}")


def test_chunked_prefill_equals_one_shot(case, paged_driver):
    """A prompt computed in chunks of 4, 3 and 4 tokens (context > 0 and query > 1: chunked prefill,
    or a prefix-cache hit) gives every position the logits of the one-shot prefill."""
    name, path, hf, config, model = case
    prompt = PROMPTS["b"]
    one_shot = paged_driver(model, config, num_blocks=16, block_size=4, seed=4)
    one_shot.add("x", prompt)
    expected = one_shot.step(["x"], all_logits=True)
    chunked = paged_driver(model, config, num_blocks=16, block_size=4, seed=8)
    chunked.add("x", [])
    got = []
    for start, end in ((0, 4), (4, 7), (7, 11)):
        chunked.tokens["x"] += prompt[start:end]
        got.append(chunked.step(["x"], all_logits=True))
    assert_close(torch.cat(got), expected, torch.float32, msg=name)


@torch.inference_mode()
def test_bf16_logits_within_bf16_rounding(tmp_path, tiny_checkpoint, paged_driver):
    """In bf16 our kernels and HF's round differently (fused vs separate matmuls, SDPA vs eager
    reduction order), so logits agree to bf16 rounding, not bit for bit. Both are compared with
    the fp32 truth: ours must be no further from it than HF's own bf16 run (x2 margin)."""
    hf = tiny_checkpoint(tmp_path, "llama")
    prompt = PROMPTS["b"]
    truth = hf(torch.tensor([prompt])).logits[0].float()
    hf_bf16 = hf.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    config = ModelConfig.from_pretrained(tmp_path, dtype="bfloat16")
    model = get_model(config)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    driver = paged_driver(model, config, num_blocks=8, block_size=4)
    driver.add("b", prompt)
    ours = driver.step(["b"], all_logits=True)
    ours_err = (ours - truth).abs().max().item()
    hf_err = (hf_bf16 - truth).abs().max().item()
    print(f"max |logit - fp32 truth|: ours bf16 {ours_err:.4f}, HF bf16 {hf_err:.4f}")
    assert ours_err <= 2 * hf_err + tol(torch.bfloat16)["atol"], (ours_err, hf_err)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_greedy_matches_hf_generate_cuda(tmp_path, tiny_checkpoint, paged_driver, hf_oracle, backend):
    """The same parity on CUDA, through each attention backend."""
    hf_greedy, assert_same_greedy = hf_oracle
    hf = tiny_checkpoint(tmp_path, "qwen3", head_dim=32).to("cuda")
    config = ModelConfig.from_pretrained(tmp_path)
    model = get_model(config, device="cuda", attn_backend=backend)
    ours = paged_driver(model, config, num_blocks=32, block_size=4, device="cuda").greedy(PROMPTS, MAX_NEW)
    for r, prompt in PROMPTS.items():
        assert_same_greedy(ours[r], hf_greedy(hf, prompt, MAX_NEW), MAX_NEW, config.eos_token_ids, f"cuda/{backend}/{r}")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_backends_agree(tmp_path, tiny_checkpoint, paged_driver, backend):
    """The same model through another attention backend of chapters 01/05 — the per-request
    reference loop, or the Triton kernels (under the interpreter on CPU) — gives the same logits
    as the default torch backend for a ragged prefill and three decode steps."""
    tiny_checkpoint(tmp_path, "qwen3", head_dim=32)
    config = ModelConfig.from_pretrained(tmp_path)
    drivers = {b: paged_driver(get_model(config, attn_backend=b), config, num_blocks=16, block_size=4, seed=2)
               for b in ("torch", backend)}
    for driver in drivers.values():
        for r, prompt in PROMPTS.items():
            driver.add(r, prompt)
    for step in range(4):
        logits = {b: d.step(list(PROMPTS), all_logits=True) for b, d in drivers.items()}   # every token's logits
        assert_close(logits[backend], logits["torch"], torch.float32, msg=f"step {step}")
        last_rows = [len(PROMPTS["a"]) - 1, -1] if step == 0 else [0, 1]          # each request's last token
        next_ids = logits["torch"][last_rows].argmax(-1).tolist()
        for d in drivers.values():
            for r, t in zip(PROMPTS, next_ids):
                d.tokens[r].append(t)
