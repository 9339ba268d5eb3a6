"""End-to-end throughput on a GPU: our engine vs HF transformers, and the decode step against
the memory-bandwidth limit.

    python -m benchmarks.bench_engine_gpu                      # on a GPU: the README's GPU numbers
    python -m benchmarks.bench_engine_gpu --profile-batch 256  # + where a decode step's time goes
    python -m benchmarks.bench_engine_gpu --smoke              # tiny model on the CPU: the code path only

Workload: nano-vllm's `bench.py` — 256 sequences, prompt lengths uniform in [100, 1024] (random
token ids < 10000), output lengths uniform in [100, 1024], ignore_eos, temperature 0.6 — on a
randomly initialised model shaped like Qwen3-0.6B (28 layers, hidden 1024, 16 query / 8 KV heads,
head_dim 128, tied vocab 151936), bf16. Random weights are fine for speed: the work per token
does not depend on the values.

Peers on the same weights and device, same run, on the first --hf-num-seqs (64) sequences of the
workload (HF static batching needs minutes for all 256; ours is timed on the same subset, and the
ratio compares those two times):
  * HF `generate`, static batches of --hf-batch-size (each batch runs to its longest request);
  * HF continuous batching (`continuous_batching_context_manager`, per-request max_new_tokens).

A benchmark that cannot lie: every contender runs in its own fresh process (the engine's KV pool
cannot starve a peer of memory), a contender that fails is recorded as failed with its error and
never as a throughput, and every timed run asserts the number of output tokens it is credited with.

Then the decode step: pure decode steps at batch sizes 1..256 (prompts of --decode-context tokens)
timed inside our engine, next to the bandwidth limit = (weight bytes + KV bytes read) / the
device-to-device copy bandwidth measured in the same process (not the datasheet's).
Writes benchmarks/results/engine_gpu.json + .png (engine_gpu_smoke.* with --smoke), and with
--profile-batch engine_gpu_profile.json (benchmarks/profile_decode_step.py).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, environment, sync, time_fn, try_plot, write_result

CONTENDERS = ("ours", "ours-async", "hf-static", "hf-cb")

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643,
                  eos_token_id=151645)
SMOKE = dict(QWEN3_0_6B, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2)
def make_model_dir(root: Path, config_kwargs: dict, dtype: torch.dtype) -> Path:
    """A random Qwen3 of the given shape with a synthetic tokenizer (prompts are token ids,
    detokenize=False): nothing is downloaded, so it runs on a GPU machine without network."""
    from benchmarks.synthetic_checkpoint import save_random_checkpoint

    path = root / "qwen3-random"
    save_random_checkpoint(path, "qwen3", config_kwargs, dtype)
    return path


def nano_vllm_workload(num_seqs: int, min_len: int, max_len: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    outputs = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return list(zip(prompts, outputs))


def run_ours(llm, workload, temperature: float) -> float:
    """Seconds for our engine to finish `workload`; asserts every request got exactly its tokens."""
    from mini_vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, detokenize=False)
              for _, n in workload]
    llm.reset_prefix_cache()
    sync()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [n for _, n in workload]:
        raise AssertionError(f"ours produced {sum(got)} tokens, the workload asks for {sum(n for _, n in workload)}")
    return seconds


@torch.inference_mode()
def run_hf_static(model, workload, batch_size: int, temperature: float) -> float:
    """HF generate in static batches (left-padded, each batch runs to its longest request).
    Counts only the tokens each request asked for, as nano-vllm does; asserts HF made them."""
    sync()
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        batch = workload[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(n for _, n in batch)
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n,
                             min_new_tokens=n, do_sample=temperature > 0, temperature=temperature or None,
                             top_p=None, top_k=None, pad_token_id=0, eos_token_id=None)
        if out.shape != (len(batch), width + n):
            raise AssertionError(f"HF generate returned {tuple(out.shape)}, expected {(len(batch), width + n)}")
    sync()
    return time.perf_counter() - t0


def run_hf_cb(model, workload, temperature: float) -> float:
    """HF continuous batching (`continuous_batching_context_manager`), per-request max_new_tokens.
    Not under inference_mode: its worker thread updates tensors this thread created, which
    inference tensors forbid. Asserts every request finished with exactly its tokens."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=temperature > 0, temperature=temperature or None, top_p=None, top_k=None,
                           max_new_tokens=max(n for _, n in workload), eos_token_id=-1, pad_token_id=0)
    wanted = {f"r{i}": n for i, (_, n) in enumerate(workload)}
    got = {}
    sync()
    t0 = time.perf_counter()
    with torch.no_grad(), model.continuous_batching_context_manager(generation_config=gen, block=True,
                                                                      timeout=600) as manager:
        for i, (prompt, n) in enumerate(workload):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(got) < len(workload):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                got[result.request_id] = len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError(f"HF continuous batching stopped after {len(got)} of {len(workload)} requests")
    sync()
    seconds = time.perf_counter() - t0
    if got != wanted:
        bad = {r: (got.get(r), n) for r, n in wanted.items() if got.get(r) != n}
        raise AssertionError(f"HF continuous batching made the wrong number of tokens (got, wanted): "
                             f"{dict(list(bad.items())[:5])}")
    return seconds


def copy_bandwidth(device: str, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes/s a device-to-device copy moves (read + written), measured now: the denominator of
    the decode-step limit (what this device reaches, not its datasheet)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), warmup=3, iters=iters, reduce=min)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def decode_steps(llm, batch_sizes: list[int], context: int, steps: int = 12) -> list[dict]:
    """Median time of pure decode steps at each batch size (prompts of `context` tokens), with the
    bytes such a step must read: all weights once, and every request's KV. The requests are
    filled until one step decodes all of them (with chunked prefill, the first requests of a big
    batch decode while the last ones still prefill), timed for `steps` steps, then aborted."""
    from benchmarks.profile_decode_step import fill_decode_batch, is_full_decode
    from mini_vllm.step_trace import ModelInputsTrace

    engine = llm.llm_engine
    runner = engine.engine_core.model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes_per_token = runner.kv_cache_spec.bytes_per_block // engine.config.block_size
    rows = []
    for b in batch_sizes:
        times, kv_tokens = [], []
        with ModelInputsTrace(engine) as trace:       # before the fill: async has a step in flight after it
            ids = fill_decode_batch(engine, b, context, prefix="dec")
            for _ in range(steps):
                sync()
                t0 = time.perf_counter()
                engine.step()
                sync()
                if not is_full_decode(engine, b):
                    raise RuntimeError(f"batch {b}: a step after the fill was not a pure decode")
                times.append(time.perf_counter() - t0)
                inputs = trace.inputs_of(engine.last_step.scheduler_output)
                kv_tokens.append(int(inputs.attn_metadata.seq_lens.sum()))
        engine.abort_request(ids)
        step_s = statistics.median(times)
        read = weight_bytes + statistics.median(kv_tokens) * kv_bytes_per_token
        rows.append(dict(batch_size=b, context=context, decode_step_ms=round(1000 * step_s, 3),
                         bytes_read=int(read), weight_bytes=weight_bytes, tokens_per_s=round(b / step_s, 1),
                         dtype=str(engine.model_config.dtype)))
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    tp = [r for r in result["throughput"] if r["status"] == "ok"]
    axes[0].barh([f"{r['name']} ({r['num_seqs']} seqs)" for r in tp], [r["output_tokens_per_s"] for r in tp],
                 color=["tab:green" if r["name"].startswith("ours") else "tab:gray" for r in tp])
    axes[0].invert_yaxis()
    axes[0].set_xlabel("output tokens / s")
    axes[0].set_title("nano-vllm workload (256 seqs, 100-1024 in/out)", fontsize=9)
    dec = result["decode"]
    xs = [r["batch_size"] for r in dec]
    axes[1].plot(xs, [r["decode_step_ms"] for r in dec], "o-", label="ours: decode step")
    axes[1].plot(xs, [r["bandwidth_limit_ms"] for r in dec], "k--", label="bandwidth limit (measured copy)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("decode batch size")
    axes[1].set_ylabel("ms / step")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def child_ours(args, model_dir: Path, workload, subset, device: str, dtype: torch.dtype,
               async_scheduling: bool = False) -> dict:
    """Our engine, in its own process: throughput on the workload and on the peers' subset, the
    decode sweep against the bandwidth measured first, and (optionally, synchronous engine only) a
    profiled decode step. `async_scheduling`: the same with step N+1 scheduled while N runs."""
    from mini_vllm import LLM

    bandwidth = args.copy_bandwidth or copy_bandwidth(device)
    llm = LLM(str(model_dir), dtype=str(dtype).removeprefix("torch."), device=device,
              max_model_len=2 * args.max_len + 16, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=16384,
              async_scheduling=async_scheduling, **({} if device == "cuda" else dict(kv_cache_memory=64 << 20)))
    print(llm.llm_engine.kv_cache_report, flush=True)
    run_ours(llm, nano_vllm_workload(4, args.min_len // 2, args.min_len), args.temperature)     # warm-up
    config = llm.llm_engine.config
    out = dict(full=run_ours(llm, workload, args.temperature), subset=run_ours(llm, subset, args.temperature),
               attention_backend=config.resolved_attention_backend,
               cuda_graphs=llm.llm_engine.engine_core.model_runner.cuda_graph_runner is not None,
               copy_bandwidth=bandwidth)
    decode = decode_steps(llm, args.decode_batch_sizes, args.decode_context)
    for row in decode:
        row["bandwidth_limit_ms"] = round(1000 * row["bytes_read"] / bandwidth, 3)
        row["fraction_of_limit"] = round(row["bandwidth_limit_ms"] / row["decode_step_ms"], 3)
    out["decode"] = decode
    if args.profile_batch and not async_scheduling:
        from benchmarks.profile_decode_step import profile_decode
        out["profile"] = profile_decode(llm, args.profile_batch, args.decode_context)
    llm.shutdown()
    return out


def child_hf(args, name: str, model_dir: Path, subset, device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    warm = nano_vllm_workload(4, args.min_len // 2, args.min_len)
    if name == "hf-static":
        run_hf_static(hf, warm, 4, args.temperature)
        return dict(seconds=run_hf_static(hf, subset, args.hf_batch_size, args.temperature))
    if not hasattr(hf, "continuous_batching_context_manager"):
        raise RuntimeError("this transformers version has no continuous batching")
    run_hf_cb(hf, warm, args.temperature)
    return dict(seconds=run_hf_cb(hf, subset, args.temperature))


def run_child(name: str, argv: list[str], result_path: Path, timeout: float) -> dict:
    """Run one contender in a fresh process; its failure is a record with the error, never a number."""
    cmd = [sys.executable, "-m", "benchmarks.bench_engine_gpu", *argv, "--child", name, "--result", str(result_path)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(status="failed", error=f"timed out after {timeout:.0f} s")
    print(proc.stdout[-3000:], end="", flush=True)
    if proc.returncode != 0 or not result_path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return dict(status="failed", error="\n".join(tail) or f"exit status {proc.returncode}",
                    wall_s=round(time.perf_counter() - t0, 1))
    return dict(status="ok", **json.loads(result_path.read_text()))


def throughput_rows(runs: dict, workload, subset, hf_batch_size: int) -> tuple[list[dict], dict]:
    """The result rows from the contenders' runs: ours on the whole workload and on the subset,
    each peer on the subset or FAILED with its error (no number), and ours / peer ratios of the
    peers that ran."""
    total_out, subset_out = sum(n for _, n in workload), sum(n for _, n in subset)

    def row(name, seconds, tokens, num_seqs):
        return dict(name=name, status="ok", num_seqs=num_seqs, seconds=round(seconds, 3), output_tokens=tokens,
                    output_tokens_per_s=round(tokens / seconds, 1))

    ours = runs["ours"]
    rows = [row("ours (mini_vllm)", ours["full"], total_out, len(workload)),
            row("ours (mini_vllm)", ours["subset"], subset_out, len(subset))]
    summary = {}
    if "ours-async" in runs:
        label = "ours (mini_vllm, async scheduling)"
        run = runs["ours-async"]
        if run["status"] == "ok":
            rows.append(row(label, run["full"], total_out, len(workload)))
            summary["async_over_sync_throughput"] = round(ours["full"] / run["full"], 3)
        else:
            rows.append(dict(name=label, status="failed", num_seqs=len(workload), error=run["error"]))
    labels = {"hf-static": f"HF generate, static batch {hf_batch_size}", "hf-cb": "HF continuous batching"}
    for name, run in runs.items():
        if name in ("ours", "ours-async"):
            continue
        if run["status"] == "ok":
            rows.append(row(labels[name], run["seconds"], subset_out, len(subset)))
            summary[f"ratio_vs_{labels[name]}"] = round(run["seconds"] / ours["subset"], 2)
        else:
            rows.append(dict(name=labels[name], status="failed", num_seqs=len(subset), error=run["error"]))
    return rows, summary


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-num-seqs", type=int, default=64,
                    help="the peers run the first N sequences of the workload (ours is timed on them too)")
    ap.add_argument("--no-cb", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-async", action="store_true", help="skip our engine with async scheduling")
    ap.add_argument("--decode-batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--profile-batch", type=int, default=0, help="profile pure decode steps at this batch size")
    ap.add_argument("--copy-bandwidth", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout", type=float, default=600)
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny workload, runs on a CPU")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if args.smoke:
        args.num_seqs, args.min_len, args.max_len, args.hf_batch_size, args.hf_num_seqs = 6, 8, 32, 4, 4
        args.max_num_seqs = 8
        args.decode_batch_sizes, args.decode_context = [1, 4], 16
        args.profile_batch = min(args.profile_batch, 4)
        shape, dtype = SMOKE, (torch.bfloat16 if cuda else torch.float32)
    elif not cuda:
        raise SystemExit("this benchmark needs a GPU (use --smoke to check its code path on a CPU)")
    else:
        shape, dtype = QWEN3_0_6B, torch.bfloat16
    device = "cuda" if cuda else "cpu"
    workload = nano_vllm_workload(args.num_seqs, args.min_len, args.max_len)
    subset = workload[:args.hf_num_seqs]

    if args.child is not None:                         # one contender, in this (fresh) process
        if args.child in ("ours", "ours-async"):
            out = child_ours(args, args.model_dir, workload, subset, device, dtype, args.child == "ours-async")
        else:
            out = child_hf(args, args.child, args.model_dir, subset, device, dtype)
        args.result.write_text(json.dumps(out))
        return out

    tmp = tempfile.TemporaryDirectory()
    model_dir = make_model_dir(Path(tmp.name), shape, dtype)
    child_argv = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--model-dir", str(model_dir)]
    names = ["ours"] + ([] if args.no_async else ["ours-async"]) + ([] if args.no_hf else ["hf-static"] + ([] if args.no_cb else ["hf-cb"]))
    runs = {name: run_child(name, child_argv, Path(tmp.name) / f"{name}.json", args.child_timeout) for name in names}
    ours = runs["ours"]
    if ours["status"] != "ok":
        raise SystemExit(f"our engine failed:\n{ours['error']}")

    throughput, summary = throughput_rows(runs, workload, subset, args.hf_batch_size)
    total_out = sum(n for _, n in workload)
    for r in throughput:
        shown = f"{r['seconds']:8.1f} s {r['output_tokens_per_s']:10.1f} output tok/s" if r["status"] == "ok" \
            else "FAILED: " + r["error"].splitlines()[-1]
        print(f"{r['name']:<34} {r['num_seqs']:4d} seqs {shown}", flush=True)
    decode_async = runs.get("ours-async", {}).get("decode")
    for i, d in enumerate(ours["decode"]):
        print(f"decode batch {d['batch_size']:4d}: {d['decode_step_ms']:8.2f} ms/step, limit "
              f"{d['bandwidth_limit_ms']:.2f} ms ({d['fraction_of_limit']:.0%})"
              + (f"; async scheduling {decode_async[i]['decode_step_ms']:8.2f} ms/step" if decode_async else ""))
    print(summary)
    name = "engine_gpu_smoke" if args.smoke else "engine_gpu"
    workload_info = dict(model="random Qwen3-0.6B-shaped" if not args.smoke else "random tiny Qwen3", dtype=str(dtype),
                         device=environment()["device"], num_seqs=args.num_seqs, peers_num_seqs=len(subset),
                         input_len=[args.min_len, args.max_len], output_len=[args.min_len, args.max_len],
                         temperature=args.temperature, ignore_eos=True, total_output_tokens=total_out,
                         attention_backend=ours["attention_backend"], cuda_graphs=ours["cuda_graphs"],
                         copy_bandwidth=ours["copy_bandwidth"], summary=summary, decode=ours["decode"],
                         decode_async_scheduling=decode_async,
                         command="python -m benchmarks.bench_engine_gpu " + " ".join(argv if argv is not None else sys.argv[1:]))
    path = write_result(name, workload_info, throughput, args.out_dir)
    result = dict(throughput=throughput, decode=ours["decode"], summary=summary)
    try_plot(plot, result, path.with_suffix(".png"))
    if "profile" in ours:
        from benchmarks.profile_decode_step import format_table
        profile = ours["profile"]
        profile_path = write_result(name + "_profile", dict(workload_info, table=format_table(profile)), [profile],
                                    args.out_dir)
        print(format_table(profile))
        result["profile"] = profile
        result["profile_path"] = profile_path
    tmp.cleanup()
    return dict(result, path=path)


if __name__ == "__main__":
    main()
