"""The composition matrix: every pair of the engine's features, through `LLM` and through the server.

    python -m benchmarks.composition_matrix            # every pair, both paths; writes results/composition_matrix.json
    python -m benchmarks.composition_matrix --table    # ... and prints the README's table
    python -m benchmarks.composition_matrix --only LoRA   # the pairs with one feature; the JSON's other rows kept

A feature is a way to build the engine (prefix caching, chunked prefill, preemption by recompute or
swap, an n-gram / draft-model / EAGLE drafter, async scheduling, a KV connector of chapter 06's
pool — from scratch or on Mooncake —, tensor or pipeline parallelism, the engine core in its own
process, data parallelism, LoRA). Each pair of features builds one engine (tiny random Llama, SmolLM2's
tokenizer) and runs the same requests, which bring the request-level features: greedy decoding,
n > 1 (sampled at top_k = 1: vLLM refuses n > 1 with greedy), beam search, penalties with logprobs
and prompt logprobs, and structured output (a regex, chapter 08). The truth kept is the PLAIN engine's answer to the same requests (none of the
features): every pair must give its greedy tokens, its beams and its logprobs (to 1e-4), or be
refused — only where real vLLM 0.32 refuses the same pair, with its reason (`VLLM_REFUSES`, each
message checked against the vLLM check it names). A connector engine runs the greedy requests twice,
the prefix cache reset between: the second time their prompts come from the pool. With LoRA
(chapter 09) every request runs with an adapter PEFT made (`lora_request`, or the adapter's name as
the server's `model`), and the truth is the plain engine on the checkpoint PEFT's `merge_and_unload`
wrote: the base weights with the adapter folded in. With int4 weights (chapter 10) the engine loads the
checkpoint quantized to W4A16 (RTN, groups of 32, compressed-tensors; the lm_head in int8, a config
group of its own), and the truth is the plain engine on the float weights it decompresses to (with LoRA
too: the adapter merged into those). With the
int8 KV cache (chapter 10, kv_cache_dtype="int8_per_token_head") every K/V row is rounded as it is
written, so the truth is the plain engine with that same cache: every other feature must keep its
bytes exactly.

Paths: "llm" is `LLM(...)` (data parallelism has none: vLLM's offline LLM runs one engine); "serve"
is `AsyncLLM` behind the OpenAI server in this process (its core always in a process of its own),
asked over HTTP like any client. This command runs every pair through both; CI
(tests/integration/test_composition_llm.py, test_composition_serve_*.py) runs every feature alone through
both and each pair through one of them (tests/integration/composition_cases.py).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import RESULTS_DIR, write_result

BLOCK = 4
# The plain engine: none of the features (and a pool no workload fills).
PLAIN = dict(block_size=BLOCK, max_model_len=96, max_num_seqs=8, max_num_batched_tokens=96, num_gpu_blocks_override=96,
             enable_prefix_caching=False, enable_chunked_prefill=False, cpu_kernels="off", enforce_eager=True)
SPEC = dict(num_speculative_tokens=3, adaptive=False)


@dataclass
class Feature:
    name: str
    config: dict = field(default_factory=dict)     # EngineConfig fields over PLAIN
    group: str | None = None                       # features of one group are alternatives, never a pair
    llm: bool = True                               # has an LLM path (data parallelism: the server's)
    core_process: bool = False                     # LLM(multiprocess_mode=True)
    data_parallel_size: int = 1                    # the server's replicas
    lora: bool = False                             # every request runs with Context.lora_request()
    quantized: bool = False                        # the engine loads Context.quantized_dir()


FEATURES = [
    Feature("prefix caching", dict(enable_prefix_caching=True)),
    Feature("chunked prefill", dict(enable_chunked_prefill=True, max_num_batched_tokens=8)),
    Feature("preemption (recompute)", dict(num_gpu_blocks_override=14), group="preemption"),
    Feature("preemption (swap)", dict(num_gpu_blocks_override=14, preemption_mode="swap", swap_space=0.001),
            group="preemption"),
    Feature("n-gram drafts", dict(speculative_config={"method": "ngram", "prompt_lookup_max": 3, **SPEC}), group="spec"),
    Feature("draft model", dict(speculative_config={"method": "draft_model", "model": "{model}", **SPEC}), group="spec"),
    Feature("EAGLE", dict(speculative_config={"method": "eagle", "model": "{eagle}", **SPEC}), group="spec"),
    Feature("async scheduling", dict(async_scheduling=True)),
    Feature("KV connector (scratch)", dict(kv_transfer_config="{scratch}"), group="kv"),
    Feature("KV connector (Mooncake)", dict(kv_transfer_config="{mooncake}"), group="kv"),
    Feature("TP=2", dict(tensor_parallel_size=2)),
    Feature("PP=2", dict(pipeline_parallel_size=2)),
    Feature("core process", core_process=True),
    Feature("DP=2", llm=False, data_parallel_size=2),
    Feature("LoRA", dict(enable_lora=True, max_lora_rank=8), lora=True),
    Feature("int4 weights", quantized=True),
    Feature("int8 KV cache", dict(kv_cache_dtype="int8_per_token_head")),
]
BY_NAME = {f.name: f for f in FEATURES}

# Pairs real vLLM 0.32 refuses, with its message and where it checks (our refusals must match).
VLLM_REFUSES = {
    frozenset({"async scheduling", "n-gram drafts"}):
        ("Currently, async scheduling is only supported with EAGLE/MTP/Draft Model/NGram GPU/DSpark/DFlash kind of "
         "speculative decoding", "vllm/config/vllm.py: VllmConfig.__post_init__"),
    frozenset({"async scheduling", "PP=2"}):
        ("Model Runner V1 does not support: pipeline parallelism with async scheduling",
         "vllm/config/vllm.py: VllmConfig._validate_v1_model_runner"),
}


def pairs() -> list[tuple[str, str]]:
    """Every feature alone and every pair of features that are not alternatives of one knob."""
    singles = [(f.name, f.name) for f in FEATURES]
    both = [(a.name, b.name) for a, b in itertools.combinations(FEATURES, 2) if not (a.group and a.group == b.group)]
    return singles + both


# ---------------------------------------------------------------------------- the shared resources
class Context:
    """The tiny checkpoint, an EAGLE head for it, and the pools the connectors join (started on first use)."""

    def __init__(self, model_dir: Path, work_dir: Path):
        self.model_dir, self.work_dir = Path(model_dir), Path(work_dir)
        self._eagle = self._mooncake = self._lora = None
        self._truths: dict[tuple[bool, bool], tuple[dict, dict]] = {}
        self._metadata = []
        self._engines = 0

    def eagle(self) -> str:
        if self._eagle is None:
            import torch
            from transformers import AutoConfig

            from spec_decode import EagleConfig, EagleHead
            torch.manual_seed(0)
            self._eagle = self.work_dir / "eagle"
            EagleHead(EagleConfig.for_target(AutoConfig.from_pretrained(self.model_dir))).save_pretrained(self._eagle)
        return str(self._eagle)

    def lora_request(self):
        """The adapter every request of a LoRA pair runs with: PEFT's, on every linear layer, B not zero."""
        from mini_vllm import LoRARequest
        if self._lora is None:
            self._lora = self._make_lora()
        return LoRARequest("tiny-lora", 1, str(self._lora))

    def merged_dir(self, base: Path | None = None) -> Path:
        """A checkpoint (default: the context's) with the adapter merged into its weights (PEFT's
        merge_and_unload)."""
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self._lora is None:
            self._lora = self._make_lora()
        if base is None:
            return self.work_dir / "merged"
        out = self.work_dir / f"merged-{base.name}"
        if not out.exists():
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            PeftModel.from_pretrained(model, self._lora).merge_and_unload().save_pretrained(out)
            AutoTokenizer.from_pretrained(base).save_pretrained(out)
        return out

    def quantized_dir(self) -> Path:
        """The checkpoint with every decoder linear in int4 (W4A16, groups of 32: a tensor-parallel
        half of the tiny model's 64-wide o_proj input is still whole groups) and the lm_head in int8
        per channel (a config group of its own), chapter 10's writer."""
        out = self.work_dir / "int4"
        if not out.exists():
            from quantization.checkpoint import save_compressed
            from quantization.quantize import quantize_checkpoint_rtn
            from quantization.reference import QuantScheme
            weights = quantize_checkpoint_rtn(self.model_dir, QuantScheme(4, True, 32), lm_head=True,
                                              lm_head_scheme=QuantScheme(8, True, None))
            save_compressed(self.model_dir, out, weights)
        return out

    def dequantized_dir(self) -> Path:
        """The float weights the int4 checkpoint stands for (chapter 10's save_decompressed)."""
        out = self.work_dir / "int4-as-float"
        if not out.exists():
            from quantization.checkpoint import save_decompressed
            save_decompressed(self.quantized_dir(), out)
        return out

    def truth(self, features, plain: tuple[dict, dict]) -> tuple[dict, dict]:
        """What a pair of `features` must answer (LLM's, the server's): the plain engine's `plain`,
        or for an adapter / int4 weights the plain engine on the checkpoint they stand for."""
        kv_cache_dtype = next((f.config["kv_cache_dtype"] for f in features if "kv_cache_dtype" in f.config), None)
        key = (any(f.lora for f in features), any(f.quantized for f in features), kv_cache_dtype)
        if key == (False, False, None):
            return plain
        if key not in self._truths:
            base = self.dequantized_dir() if key[1] else None
            model = self.merged_dir(base) if key[0] else base
            self._truths[key] = plain_results(self, model_dir=model,
                                              kv_cache_dtype=kv_cache_dtype or "auto")
        return self._truths[key]

    def _make_lora(self) -> Path:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        peft_model.save_pretrained(self.work_dir / "lora")           # (the "default" adapter: right there)
        peft_model.merge_and_unload().save_pretrained(self.work_dir / "merged")
        AutoTokenizer.from_pretrained(self.model_dir).save_pretrained(self.work_dir / "merged")
        return self.work_dir / "lora"

    def scratch(self) -> dict:
        """A pool of its own for each engine (a scratch pool holds one model's K/V)."""
        from global_prefix_cache.metadata import MetadataServerProcess
        self._metadata.append(MetadataServerProcess())
        return {"kv_connector": "GlobalKVPoolConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"metadata_server": self._metadata[-1].address, "load_timeout_s": 10.0}}

    def mooncake(self) -> dict:
        if self._mooncake is None:
            from global_prefix_cache.mooncake_layer import MooncakeMaster
            self._mooncake = MooncakeMaster()
        return {"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"master_server": self._mooncake.address, "load_timeout_s": 10.0,
                                              "global_segment_size": 16 << 20, "local_buffer_size": 16 << 20}}

    def engine_kwargs(self, pair: tuple[str, str]) -> dict:
        quantized = any(BY_NAME[n].quantized for n in pair)
        kwargs = dict(PLAIN, model=str(self.quantized_dir() if quantized else self.model_dir))
        for name in dict.fromkeys(pair):
            for key, value in BY_NAME[name].config.items():
                kwargs[key] = self._resolve(value)
        kv = kwargs.get("kv_transfer_config")
        if kv is not None and kv["kv_connector"] == "MooncakeConnector":   # its own namespace in the store
            self._engines += 1
            kv["kv_connector_extra_config"]["model"] = f"tiny-{self._engines}"
        return kwargs

    def _resolve(self, value):
        if value == "{scratch}":
            return self.scratch()
        if value == "{mooncake}":
            return self.mooncake()
        if isinstance(value, dict):
            return {k: (str(self.model_dir) if v == "{model}" else self.eagle() if v == "{eagle}" else v)
                    for k, v in value.items()}
        return value

    def close(self) -> None:
        for server in [*self._metadata, self._mooncake]:
            if server is not None:
                server.stop()


# ---------------------------------------------------------------------------- the requests
PREFIX = [(13 * i) % 4000 + 100 for i in range(10)]
PROMPTS = [PREFIX + [(31 * i + 7 * j) % 4000 + 300 for j in range(3 + 2 * i)] for i in range(3)]
GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
N_BEST = dict(n=2, temperature=1.0, top_k=1, max_tokens=6, ignore_eos=True, seed=3)
PENALTIES = dict(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2,
                 logprobs=2)
BEAM = dict(beam_width=2, max_tokens=4, ignore_eos=True)
# Structured output (chapter 08): greedy inside a regex with branches, so the mask changes every step.
STRUCTURED = dict(temperature=0.0, max_tokens=8)
STRUCTURED_REGEX = r"(yes|no|maybe)(, [a-z]{2,6}){1,3}\."


def run_llm(llm, connector: bool, lora=None) -> dict:
    """The workload through LLM -> {what: comparable result}; lora: every request's LoRARequest."""
    from mini_vllm import BeamSearchParams, SamplingParams
    from mini_vllm.sampling_params import StructuredOutputsParams

    def greedy(from_pool: bool = False):
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY), use_tqdm=False,
                               lora_request=lora)
        if from_pool and not all(o.num_cached_tokens >= BLOCK for o in outputs):
            raise AssertionError(f"the second pass did not load its prompts from the pool: cached tokens "
                                 f"{[o.num_cached_tokens for o in outputs]}")
        return [o.outputs[0].token_ids for o in outputs]
    out = {"greedy": greedy()}
    if connector:                      # again, the prompts' K/V from the pool this time
        llm.reset_prefix_cache()
        out["greedy from the pool"] = greedy(from_pool=True)
    n = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(**N_BEST), use_tqdm=False, lora_request=lora)[0]
    out["n=2"] = [c.token_ids for c in n.outputs]
    beams = llm.beam_search([{"prompt_token_ids": PROMPTS[1]}], BeamSearchParams(**BEAM), lora_request=lora)[0]
    out["beam search"] = [s.tokens for s in beams.sequences]
    pen = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(**PENALTIES, prompt_logprobs=1),
                       use_tqdm=False, lora_request=lora)[0]
    out["penalties + logprobs"] = (pen.outputs[0].token_ids, _logprobs(pen.outputs[0].logprobs))
    out["prompt logprobs"] = [None if e is None else {t: round(lp.logprob, 4) for t, lp in e.items()}
                              for e in pen.prompt_logprobs]
    structured = SamplingParams(**STRUCTURED, structured_outputs=StructuredOutputsParams(regex=STRUCTURED_REGEX))
    out["structured output"] = llm.generate({"prompt_token_ids": PROMPTS[0]}, structured, use_tqdm=False,
                                            lora_request=lora)[0].outputs[0].token_ids
    return out


def _logprobs(entries) -> list[dict[int, float]]:
    return [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in entries]


def run_serve(url: str, connector: bool, model: str = "tiny") -> dict:
    """The workload over HTTP (/v1/completions, token prompts, vLLM's return_token_ids) -> what run_llm
    returns, but the server's logprobs are only the chosen tokens' (its top-k comes as text). model: the
    base model's name, or a LoRA adapter's."""
    import httpx2 as httpx

    def post(**body):
        r = httpx.post(url + "/v1/completions", json={"model": model, "return_token_ids": True, **body}, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
        return r.json()

    def greedy(from_pool: bool = False):
        body = post(prompt=PROMPTS, **GREEDY)
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        if from_pool and cached < BLOCK * len(PROMPTS):
            raise AssertionError(f"the second pass did not load its prompts from the pool: {cached} cached tokens")
        return [c["token_ids"] for c in body["choices"]]
    out = {"greedy": greedy()}
    if connector:
        httpx.post(url + "/reset_prefix_cache", timeout=60)
        out["greedy from the pool"] = greedy(from_pool=True)
    out["n=2"] = [c["token_ids"] for c in post(prompt=PROMPTS[0], **N_BEST)["choices"]]
    beam = post(prompt=PROMPTS[1], use_beam_search=True, n=BEAM["beam_width"], max_tokens=BEAM["max_tokens"],
                ignore_eos=True, temperature=0.0)
    out["beam search"] = [PROMPTS[1] + c["token_ids"] for c in beam["choices"]]
    pen = post(prompt=PROMPTS[2], **PENALTIES)["choices"][0]
    out["penalties + logprobs"] = (pen["token_ids"], [round(x, 4) for x in pen["logprobs"]["token_logprobs"]])
    out["structured output"] = post(prompt=PROMPTS[0], **STRUCTURED,
                                    structured_outputs={"regex": STRUCTURED_REGEX})["choices"][0]["token_ids"]
    return out


def as_served(result: dict) -> dict:
    """An LLM result as the server reports it (the chosen tokens' logprobs only, no prompt logprobs)."""
    out = {k: v for k, v in result.items() if k != "prompt logprobs"}
    tokens, logprobs = result["penalties + logprobs"]
    out["penalties + logprobs"] = (tokens, [entry[t] for t, entry in zip(tokens, logprobs)])
    return out


def compare(got: dict, expect: dict) -> list[str]:
    """What differs (logprobs to 1e-4)."""
    diffs = []
    for key, value in got.items():
        want = expect.get(key, expect["greedy"] if key == "greedy from the pool" else None)
        if not _close(value, want):
            diffs.append(f"{key}: {str(value)[:160]} != {str(want)[:160]}")
    return diffs


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 2e-4             # (both rounded to 4 decimals)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------------- one pair
def check_refusal(error: BaseException, pair: tuple[str, str]) -> str:
    """A refusal is right only where vLLM refuses the same pair, and with its reason."""
    expected = VLLM_REFUSES.get(frozenset(pair))
    if expected is None:
        raise AssertionError(f"{pair}: refused, but vLLM 0.32 composes it: {error}")
    if expected[0] not in str(error):
        raise AssertionError(f"{pair}: refused with {error!r}, not vLLM's reason {expected[0]!r}")
    return f"refused as vLLM ({expected[1]})"


def run_pair_llm(ctx: Context, pair: tuple[str, str], expect: tuple[dict, dict], registry=None) -> str:
    from mini_vllm import LLM

    features = [BY_NAME[n] for n in dict.fromkeys(pair)]
    try:
        llm = LLM(**ctx.engine_kwargs(pair), multiprocess_mode=any(f.core_process for f in features))
    except ValueError as error:
        return check_refusal(error, pair)
    if registry is not None:
        registry.append(llm)
    lora = any(f.lora for f in features)
    try:
        got = run_llm(llm, connector=any(f.group == "kv" for f in features), lora=ctx.lora_request() if lora else None)
    finally:
        if registry is not None:
            registry.remove(llm)
        llm.shutdown()
    return verdict(pair, "LLM", got, ctx.truth(features, expect)[0])


def verdict(pair: tuple[str, str], path: str, got: dict, expect: dict) -> str:
    """'same tokens', or an AssertionError: the pair's answer differs from the plain engine's, or it
    composed where vLLM refuses it (our refusal is missing)."""
    diffs = compare(got, expect)
    if diffs:
        raise AssertionError(f"{pair} through {path} differs from the plain engine: " + "; ".join(diffs))
    if frozenset(pair) in VLLM_REFUSES:
        raise AssertionError(f"{pair}: composed, but vLLM refuses it (our refusal is missing)")
    return "same tokens"


def run_pair_serve(ctx: Context, pair: tuple[str, str], expect: tuple[dict, dict]) -> str:
    from mini_vllm.async_llm import AsyncLLM
    from mini_vllm.engine_config import EngineConfig

    features = [BY_NAME[n] for n in dict.fromkeys(pair)]
    try:
        config = EngineConfig(**ctx.engine_kwargs(pair))
        engine = AsyncLLM(config, served_model_name="tiny", log_stats_interval=None,
                          data_parallel_size=max(f.data_parallel_size for f in features))
    except ValueError as error:
        return check_refusal(error, pair)
    lora = ctx.lora_request() if any(f.lora for f in features) else None
    server = ServerThread(engine, lora)
    try:
        got = run_serve(server.url, connector=any(f.group == "kv" for f in features),
                        model=lora.lora_name if lora else "tiny")
        server.wait_idle()
    finally:
        server.stop()
    return verdict(pair, "the server", got, ctx.truth(features, expect)[1])


class ServerThread:
    """The OpenAI server (api_server.build_app over `engine`) in a thread of this process, on a port the
    OS chose, with one extra route for the matrix: POST /reset_prefix_cache."""

    def __init__(self, engine, lora=None):
        import uvicorn

        from mini_vllm.entrypoints.api_server import build_app
        self.engine = engine
        app = build_app(engine, ["tiny"], lora_modules=[(lora.lora_name, lora.lora_path)] if lora else None)

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            return {"reset": await engine.reset_prefix_cache()}
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    def wait_idle(self, timeout: float = 30) -> None:
        """Every request gone, then every core's check: every KV block free."""
        deadline = time.monotonic() + timeout
        while self.engine.output_processor.has_unfinished_requests() or self.engine.collectors:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests left: {list(self.engine.collectors)}")
            time.sleep(0.02)
        asyncio.run_coroutine_threadsafe(self.engine.check_invariants(), self.loop).result(60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()
        self.sock.close()


def plain_results(ctx: Context, model_dir: Path | None = None, kv_cache_dtype: str = "auto") -> tuple[dict, dict]:
    """The oracle: the plain engine's results, and the same as the server reports them (model_dir: another
    checkpoint than the context's -- the merged one, for the LoRA pairs; kv_cache_dtype: the cache the
    8-bit-KV pairs keep, since its rounding is the feature)."""
    from mini_vllm import LLM

    kwargs = ctx.engine_kwargs(())
    kwargs["kv_cache_dtype"] = kv_cache_dtype
    if model_dir is not None:
        kwargs["model"] = str(model_dir)
    llm = LLM(**kwargs)
    try:
        expect = run_llm(llm, connector=False)
        return expect, as_served(expect)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------- the whole matrix
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--table", action="store_true", help="print the README's markdown table")
    ap.add_argument("--only", choices=list(BY_NAME), help="run only the pairs with this feature (a new one); "
                                                         "the other rows are kept from the existing JSON")
    args = ap.parse_args(argv)
    from benchmarks.bench_engine import tiny_model_dir
    tmp = tempfile.TemporaryDirectory()
    ctx = Context(tiny_model_dir(Path(tmp.name)), Path(tmp.name))
    rows = []
    try:
        expect = plain_results(ctx)
        for pair in pairs():
            if args.only and args.only not in pair:
                continue
            row = {"pair": list(pair)}
            for path, run in (("llm", lambda: run_pair_llm(ctx, pair, expect)),
                              ("serve", lambda: run_pair_serve(ctx, pair, expect))):
                if path == "llm" and not all(BY_NAME[n].llm for n in pair):
                    row[path] = "no LLM path (the server's feature)"
                    continue
                t0 = time.perf_counter()
                try:
                    row[path] = run()
                except AssertionError as e:
                    row[path] = f"FAILED: {e}"
                row[path + "_s"] = round(time.perf_counter() - t0, 2)
            print(row, flush=True)
            rows.append(row)
    finally:
        ctx.close()
        tmp.cleanup()
    if args.only:                      # the other pairs' rows as the last full run left them, in pair order
        kept = {tuple(r["pair"]): r for r in json.loads((args.out_dir / "composition_matrix.json").read_text())["rows"]}
        kept.update((tuple(r["pair"]), r) for r in rows)
        rows = [kept[p] for p in pairs() if p in kept]
    failed = [r for r in rows if any(str(r.get(p, "")).startswith("FAILED") for p in ("llm", "serve"))]
    path = write_result("composition_matrix", dict(model="tiny random Llama (2 layers, GQA 4/2), SmolLM2's tokenizer",
                                                   dtype="float32", device="cpu", plain_engine=PLAIN,
                                                   vllm_refuses={" + ".join(sorted(k)): v for k, v in VLLM_REFUSES.items()},
                                                   failed=len(failed),
                                                   command="python -m benchmarks.composition_matrix",
                                                   **({"rerun": f"--only {args.only}: its pairs from this run, the "
                                                               "others from the last full run"} if args.only else {})),
                        rows, args.out_dir)
    if args.table:
        print(markdown_table(rows))
    return dict(rows=rows, failed=failed, path=path)


def markdown_table(rows: list[dict]) -> str:
    """Features x features: "✓" composes through LLM and the server, "vLLM ✗" refused as vLLM refuses it."""
    names = [f.name for f in FEATURES]
    cell = {}
    for r in rows:
        a, b = r["pair"]
        results = [r.get(p, "") for p in ("llm", "serve")]
        if any(str(x).startswith("FAILED") for x in results):
            mark = "✗"
        elif any(str(x).startswith("refused") for x in results):
            mark = "vLLM ✗"
        else:
            mark = "✓"
        cell[(a, b)] = cell[(b, a)] = mark
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        lines.append(f"| {a} | " + " | ".join(cell.get((a, b), "—") for b in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    result = main()
    sys.exit(1 if result["failed"] else 0)
