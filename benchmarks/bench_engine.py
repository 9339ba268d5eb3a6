"""End-to-end throughput on the CPU: our engine vs HF transformers, same weights, same run.

    python -m benchmarks.bench_engine                 # the README's numbers (~15-30 min on 2 cores)
    python -m benchmarks.bench_engine --smoke         # tiny random model, seconds (CI)

Workload (the issue's): SmolLM2-135M-Instruct, fp32, 64 requests, prompt lengths uniform in
[32, 512] tokens cut from real text (the Python language reference that ships with Python:
`pydoc_data.topics`), output lengths uniform in [16, 256], ignore_eos, greedy. All requests
arrive at once (offline batch). Output tokens/s = the requested output tokens / wall time.

Peers, all on the same weights and the same tokens:
  * HF `generate`, static batches: requests in order, `--static-batch-sizes` per batch, left
    padded; each batch generates until its longest request is done (a static batch cannot
    release a finished row), and only each request's own tokens count.
  * HF continuous batching: `model.continuous_batching_context_manager` (what `generate_batch`
    uses), `attn_implementation="sdpa"`, one `add_request(..., max_new_tokens=L_i)` per request.
  * ours: `LLM.generate` with token prompts and per-request SamplingParams; and the same engine
    with `cpu_gemm_backend="torch"` (plain F.linear, as HF) to show what the oneDNN weight
    packing contributes apart from batching and paging.

Every side is warmed up (a small batch) before it is timed. Token agreement with HF static is
reported too (greedy, fp32: it should be ~all requests; padding can flip a near-tie).
Writes benchmarks/results/engine_cpu.json + .png (or engine_cpu_smoke.* with --smoke).
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, environment, write_result


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
def run_ours(llm, workload) -> tuple[float, list[list[int]]]:
    from mini_vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in workload]
    assert llm.reset_prefix_cache(), "requests still hold KV blocks"   # no hits from an earlier run
    t0 = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [o.outputs[0].token_ids for o in outputs]


# ---------------------------------------------------------------------------------- HF static
@torch.inference_mode()
def run_hf_static(model, workload, batch_size: int, pad_id: int) -> tuple[float, list[list[int]]]:
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
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id, eos_token_id=None)
        for i, (_, n) in enumerate(batch):
            outputs.append(out[i, width:width + n].tolist())
    return time.perf_counter() - t0, outputs


# ---------------------------------------------------------------------------------- HF continuous batching
@torch.inference_mode()
def run_hf_cb(model, workload, max_batch_tokens: int, max_requests: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in workload), eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(use_cuda_graph=False, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_requests)
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


# ---------------------------------------------------------------------------------- main
PLAIN = "ours, plain F.linear (no oneDNN packing)"

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
    bars = ax.barh(names, values, color=["tab:green" if n.startswith("ours") else "tab:gray" for n in names])
    for bar, v in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.1f}", va="center")
    ax.set_xlabel("output tokens / s, median over runs (higher is better)")
    fig.suptitle(title, fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--static-batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of ours vs HF static")
    ap.add_argument("--no-cb", action="store_true", help="skip HF continuous batching (slow on CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 6 short requests")
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
    max_model_len = max(args.prompt_len[1] + args.output_len[1], 128)

    engine_args = dict(dtype="float32", max_model_len=max_model_len, max_num_seqs=args.num_requests,
                       max_num_batched_tokens=max(args.max_num_batched_tokens, max_model_len),
                       kv_cache_memory=(64 << 20) if args.smoke else None)      # None: the CPU default, 2 GiB
    llm = LLM(str(model_dir), **engine_args)
    llm_plain = LLM(str(model_dir), cpu_gemm_backend="torch", **engine_args)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    rows, outputs = [], {}

    def record(name: str, seconds: float, tokens: list[list[int]], **extra):
        assert [len(t) for t in tokens] == [n for _, n in workload], f"{name} produced the wrong lengths"
        rows.append(dict(name=name, seconds=round(seconds, 3), output_tokens=total_out,
                         output_tokens_per_s=round(total_out / seconds, 2), **extra))
        outputs.setdefault(name, tokens)
        print(f"{name:<42} {seconds:8.1f} s  {total_out / seconds:8.1f} output tok/s", flush=True)

    run_ours(llm, warmup)
    run_ours(llm_plain, warmup)
    run_hf_static(hf, warmup, 4, pad_id)
    # Interleaved rounds: this machine is shared and its speed drifts by tens of percent over
    # minutes, so each round times every side once, back to back, and ratios are per round.
    for r in range(args.rounds):
        record("ours (mini_vllm)", *run_ours(llm, workload), round=r)
        record(PLAIN, *run_ours(llm_plain, workload), round=r)
        for b in args.static_batch_sizes:
            record(f"HF generate, static batch {b}", *run_hf_static(hf, workload, b, pad_id), batch_size=b, round=r)
    if not args.no_cb:                 # once, after the rounds: it is by far the slowest on a CPU
        run_hf_cb(hf, warmup, args.max_num_batched_tokens, args.num_requests)
        record("HF continuous batching", *run_hf_cb(hf, workload, args.max_num_batched_tokens, args.num_requests))
        record("ours (mini_vllm)", *run_ours(llm, workload), round=args.rounds)

    def speed(name: str, r: int) -> float:
        return next(x["output_tokens_per_s"] for x in rows if x["name"] == name and x.get("round") == r)

    static_names = [f"HF generate, static batch {b}" for b in args.static_batch_sizes]
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
                   agreement_with_best_static=agreement(outputs["ours (mini_vllm)"], outputs[best_static]))
    if not args.no_cb:
        cb = next(x for x in rows if x["name"] == "HF continuous batching")
        ours_next = speed("ours (mini_vllm)", args.rounds)
        summary["hf_continuous_batching_tokens_per_s"] = cb["output_tokens_per_s"]
        summary["ratio_vs_hf_continuous_batching"] = round(ours_next / cb["output_tokens_per_s"], 2)
        summary["agreement_with_hf_continuous_batching"] = agreement(outputs["ours (mini_vllm)"],
                                                                     outputs["HF continuous batching"])
    summary["ratio_vs_better_peer"] = min(summary["ratio_vs_best_static"],
                                          summary.get("ratio_vs_hf_continuous_batching", float("inf")))
    try:
        import os
        summary["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    print(summary)

    name = "engine_cpu_smoke" if args.smoke else "engine_cpu"
    workload_info = dict(model=str(model_dir.name), dtype="float32", device="cpu", num_requests=args.num_requests,
                         prompt_len=list(args.prompt_len), output_len=list(args.output_len), ignore_eos=True,
                         greedy=True, prompt_source="pydoc_data.topics (Python language reference)",
                         total_output_tokens=total_out, total_prompt_tokens=sum(len(p) for p, _ in workload),
                         engine=dict(max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens,
                                     enable_chunked_prefill=True, enable_prefix_caching=True,
                                     cpu_gemm_backend=llm.llm_engine.config.cpu_gemm_backend,
                                     onednn_packed=llm.llm_engine.engine_core.model_runner.model.packed_lm_head
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
