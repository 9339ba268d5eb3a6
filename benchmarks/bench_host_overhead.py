"""Host time per decode step: how long the engine's own Python takes around a forward pass that
costs next to nothing.

    python -m benchmarks.bench_host_overhead            # batch 1 / 64 / 256 -> results/host_overhead_cpu.json
    python -m benchmarks.bench_host_overhead --smoke    # the code path at CI size
    python -m benchmarks.bench_host_overhead --name base_1 --out-dir /tmp/ab ...   # one run of an A/B
    python -m benchmarks.bench_host_overhead --before /tmp/ab/base_*.json --after /tmp/ab/new_*.json
                                                        # -> results/host_overhead_cpu.json, before vs after
    python -m benchmarks.bench_host_overhead --async-ab # async scheduling off vs on, same workload, same
                                                        # run -> results/host_overhead_async_cpu.json

Why: on an H200 a pure decode step at batch 256 took 14.4 ms while the GPU was busy 9.3 ms
(results/engine_gpu_profile.json) — the host phases (schedule, prepare inputs, graph buffer fill,
update_from_output, output processing) run one after another each step and the GPU waits. Host
time is host time: with a tiny random model (2 layers, hidden 64, a small vocabulary) the model's
compute is negligible and what a CPU measures per step is the engine's bookkeeping.

Each phase is timed by wrapping the engine's methods from the outside (time.perf_counter and the
thread's CPU time, time.thread_time, around the call, accumulated per step; on a shared machine
the CPU time is the steadier of the two: it leaves out the time the thread was descheduled), as `profile_decode_step.named_phases` does with
record_function: the engine carries no timing code. Phases nest (execute_model contains
update_states, prepare_inputs, forward and sample); `step` is the whole LLMEngine.step().
`graph buffer fill` is `DecodeBuffers.fill` — on a GPU it copies each step's inputs into the
CUDA graph's static buffers; on a CPU the engine runs no graphs, so it is timed here on a CPU
copy of the buffers with each step's real inputs (the same Python, the same number of copies).

The greedy tokens of every timed step are hashed (`tokens_sha1`): a change to the engine's host
code must leave them identical.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import write_result
from benchmarks.profile_decode_step import wrapped_phases

# (object path from the LLMEngine, method name, phase name)
PHASES = (
    (("engine_core", "scheduler"), "schedule", "schedule"),
    (("engine_core", "model_executor"), "execute_model", "execute_model"),
    (("engine_core", "model_runner"), "_update_states", "  update_states"),
    (("engine_core", "model_runner", "input_batch"), "prepare_inputs", "  prepare_inputs"),
    (("engine_core", "model_runner"), "_with_attention_plan", "  attention plan"),
    (("engine_core", "model_runner", "model"), "forward", "  forward"),
    (("engine_core", "model_runner"), "_sample", "  sample"),
    (("engine_core", "scheduler"), "update_from_output", "update_from_output"),
    (("output_processor",), "process_outputs", "output processing"),
)

TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def timed_phases(engine, totals: dict[str, float], cpu_totals: dict[str, float] | None = None):
    """Wrap the engine's phase methods so that each call adds its wall time to totals[phase]
    (and this thread's CPU time to cpu_totals[phase]: on a shared, loaded machine the time the
    thread was descheduled inflates the wall clock, not the CPU time)."""
    cpu_totals = defaultdict(float) if cpu_totals is None else cpu_totals

    def wrap(original, label):
        def wrapped(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t0
                cpu_totals[label] += time.thread_time() - c0
        return wrapped
    return wrapped_phases(engine, PHASES, wrap)


def fill_decode(engine, batch_size: int, context: int, vocab_size: int, seed: int = 1) -> list[str]:
    """`batch_size` greedy requests of `context` random tokens, stepped until one step decodes all
    of them (the shape of profile_decode_step.fill_decode_batch, with ids inside a small vocabulary)."""
    import random

    from benchmarks.profile_decode_step import is_full_decode
    from mini_vllm import SamplingParams

    rng = random.Random(seed)
    max_tokens = engine.model_config.max_model_len - context
    ids = [f"host{batch_size}-{i}" for i in range(batch_size)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, vocab_size) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False))
    for _ in range(batch_size * context + 8):
        engine.step()
        if is_full_decode(engine, batch_size):
            return ids
    raise RuntimeError(f"no step decoded all {batch_size} requests at once")


def _graph_fill_seconds(buffers, inputs) -> float:
    """One DecodeBuffers.fill of this step's inputs into a CPU copy of the graph buffers."""
    from mini_vllm.cuda_graph import padded_batch_size

    n = inputs.input_ids.shape[0]
    size = padded_batch_size(n, buffers.capture_sizes)
    t0 = time.perf_counter()
    buffers.fill(inputs, size)
    return time.perf_counter() - t0


def _timed_step(engine, batch_size: int, buffers, trace, per_step: dict, per_step_cpu: dict, digest) -> None:
    """One engine step, its phases timed; the graph buffer fill timed on its inputs."""
    from benchmarks.profile_decode_step import is_full_decode

    totals: dict[str, float] = defaultdict(float)
    cpu_totals: dict[str, float] = defaultdict(float)
    with timed_phases(engine, totals, cpu_totals):
        t0, c0 = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        totals["step"], cpu_totals["step"] = time.perf_counter() - t0, time.thread_time() - c0
    if not is_full_decode(engine, batch_size):
        raise RuntimeError(f"batch {batch_size}: a timed step was not a pure decode")
    c0 = time.thread_time()
    inputs = trace.inputs_of(engine.last_step.scheduler_output)
    totals["graph buffer fill (CPU copy)"] = _graph_fill_seconds(buffers, inputs)
    cpu_totals["graph buffer fill (CPU copy)"] = time.thread_time() - c0
    for out in sorted(outputs, key=lambda o: o.request_id):
        digest.update(f"{out.request_id}:{out.outputs[0].token_ids[-1]};".encode())
    for name in totals:
        per_step[name].append(totals[name])
        per_step_cpu[name].append(cpu_totals[name])


def measure_batch(llm, batch_size: int, context: int, steps: int, warmup: int, vocab_size: int) -> dict:
    """Per-phase host ms per pure decode step of `batch_size` requests (medians over `steps`)."""
    from mini_vllm.cuda_graph import DecodeBuffers
    from mini_vllm.step_trace import ModelInputsTrace

    engine = llm.llm_engine
    runner = engine.engine_core.model_runner
    capture_sizes = engine.config.capture_sizes()
    buffers = DecodeBuffers(capture_sizes[-1], runner.max_num_blocks_per_req, torch.device("cpu"))
    buffers.capture_sizes = capture_sizes
    per_step: dict[str, list[float]] = defaultdict(list)
    per_step_cpu: dict[str, list[float]] = defaultdict(list)
    digest = hashlib.sha1()
    with ModelInputsTrace(engine) as trace:      # from the fill on: async keeps a step in flight
        ids = fill_decode(engine, batch_size, context, vocab_size)
        for _ in range(warmup):
            engine.step()
        for _ in range(steps):
            _timed_step(engine, batch_size, buffers, trace, per_step, per_step_cpu, digest)
    engine.abort_request(ids)
    phases = {name: round(1000 * statistics.median(v), 4) for name, v in per_step.items()}
    phases_cpu = {name: round(1000 * statistics.median(v), 4) for name, v in per_step_cpu.items()}
    return dict(batch_size=batch_size, context=context, steps=steps, phases_ms=phases, phases_cpu_ms=phases_cpu,
                step_ms=phases["step"], tokens_sha1=digest.hexdigest())


def make_llm(model_dir: Path, max_num_seqs: int, max_model_len: int, async_scheduling: bool = False):
    from mini_vllm import LLM

    return LLM(str(model_dir), dtype="float32", device="cpu", attention_backend="cpu",
               max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
               kv_cache_memory=64 << 20, async_scheduling=async_scheduling)


def measure_steps(llm, batch_size: int, context: int, steps: int, warmup: int,
                  vocab_size: int) -> tuple[dict, dict[str, list[int]]]:
    """Wall time of whole LLMEngine.step() calls in pure decode at `batch_size` — no phase wrappers:
    with async scheduling the phases run on two threads at once, so only the step's wall time says
    what the overlap bought. Returns ({step_ms median, tokens/s, process CPU s}, each request's tokens)."""
    engine = llm.llm_engine
    ids = fill_decode(engine, batch_size, context, vocab_size)
    for _ in range(warmup):
        engine.step()
    times, tokens = [], {}
    c0, t_start = time.process_time(), time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        for out in outputs:
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    total, cpu = time.perf_counter() - t_start, time.process_time() - c0
    engine.abort_request(ids)
    return dict(step_ms=round(1000 * statistics.median(times), 4),
                output_tokens_per_s=round(batch_size * steps / total, 1),
                process_cpu_s_per_step=round(cpu / steps, 6)), tokens


def async_ab(args) -> dict:
    """Async scheduling off vs on: two engines of the same tiny model in one process, measured in
    alternating rounds (off, on, on, off, ...) on the same workload; the greedy tokens of the two
    must be identical, request by request."""
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        from benchmarks.bench_engine_gpu import make_model_dir
        model_dir = make_model_dir(Path(tmp), TINY, torch.float32)
        llms = {mode: make_llm(model_dir, max(args.batch_sizes), args.max_model_len, async_scheduling=mode == "async")
                for mode in ("sync", "async")}
        rows = []
        for b in args.batch_sizes:
            runs: dict[str, list[dict]] = {"sync": [], "async": []}
            for r in range(args.rounds):
                order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
                tokens = {}
                for mode in order:
                    row, tokens[mode] = measure_steps(llms[mode], b, args.context, args.steps, args.warmup,
                                                      TINY["vocab_size"])
                    runs[mode].append(row)
                if tokens["sync"] != tokens["async"]:
                    raise RuntimeError(f"batch {b}: async scheduling changed the greedy tokens")
            med = {mode: {key: round(statistics.median(run[key] for run in side), 4) for key in side[0]}
                   for mode, side in runs.items()}
            rows.append(dict(batch_size=b, sync=med["sync"], async_=med["async"],
                             async_over_sync_step_ms=round(med["async"]["step_ms"] / med["sync"]["step_ms"], 3),
                             tokens_identical=True, per_round=runs))
        for llm in llms.values():
            llm.shutdown()
    workload = dict(model="random Qwen3-shaped, tiny (2 layers, hidden 64, vocab 2048)", config=TINY, dtype="float32",
                    attention_backend="cpu", context=args.context, steps=args.steps, warmup=args.warmup,
                    rounds=args.rounds, max_num_seqs=max(args.batch_sizes), sampling="greedy, detokenize=False",
                    threads=args.threads, cpu_count=os.cpu_count(), load_average=list(os.getloadavg()),
                    git_commit=_git_commit(), command="python -m benchmarks.bench_host_overhead " + " ".join(sys.argv[1:]),
                    how="per batch size, the engines run alternately (off, on, on, off, ...); each run is `steps` "
                        "timed LLMEngine.step() calls of a pure decode batch; per mode the median over the rounds")
    name = args.name or ("host_overhead_async_cpu_smoke" if args.smoke else "host_overhead_async_cpu")
    path = write_result(name, workload, rows, args.out_dir)
    for row in rows:
        print(f"batch {row['batch_size']}: step ms sync {row['sync']['step_ms']} async {row['async_']['step_ms']} "
              f"(async / sync {row['async_over_sync_step_ms']})")
    print(f"wrote {path}")
    return dict(workload=workload, rows=rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CI size: batch 1 and 8, a few steps")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--name", default=None, help="result file name (default host_overhead_cpu[_smoke])")
    parser.add_argument("--before", nargs="+", type=Path, help="summarise: result files of the old commit's runs")
    parser.add_argument("--after", nargs="+", type=Path, help="... and of the new commit's (with --before)")
    parser.add_argument("--commits", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="summarise: name the two commits (runs from an exported tree know none)")
    parser.add_argument("--async-ab", action="store_true",
                        help="async scheduling off vs on, same run -> host_overhead_async_cpu.json")
    parser.add_argument("--rounds", type=int, default=5, help="--async-ab: alternating rounds per batch size")
    args = parser.parse_args(argv)
    if args.before or args.after:
        return summarise_ab(args.before, args.after, args.out_dir, args.commits)
    if args.smoke:
        args.batch_sizes, args.steps, args.warmup, args.context, args.rounds = [1, 8], 4, 1, 16, 2
    # The phases are single-threaded Python; one intra-op thread keeps the tiny forward from
    # fighting other processes for a shared CPU (spinning OpenMP workers), which is noise here.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.async_ab:
        return async_ab(args)
    with tempfile.TemporaryDirectory() as tmp:
        from benchmarks.bench_engine_gpu import make_model_dir
        model_dir = make_model_dir(Path(tmp), TINY, torch.float32)
        llm = make_llm(model_dir, max(args.batch_sizes), args.max_model_len)
        rows = [measure_batch(llm, b, args.context, args.steps, args.warmup, TINY["vocab_size"])
                for b in args.batch_sizes]
        llm.shutdown()
    workload = dict(model="random Qwen3-shaped, tiny (2 layers, hidden 64, vocab 2048): forward and sample are "
                          "the only phases that compute; the others are the engine's host bookkeeping",
                    config=TINY, dtype="float32", attention_backend="cpu", context=args.context,
                    steps=args.steps, max_num_seqs=max(args.batch_sizes), sampling="greedy, detokenize=False",
                    threads=args.threads,
                    load_average=list(os.getloadavg()), git_commit=_git_commit())
    name = args.name or ("host_overhead_cpu_smoke" if args.smoke else "host_overhead_cpu")
    path = write_result(name, workload, rows, args.out_dir)
    for row in rows:
        print(f"batch {row['batch_size']} (thread CPU ms): "
              + ", ".join(f"{k.strip()} {v}" for k, v in row["phases_cpu_ms"].items()))
    print(f"wrote {path}")
    return dict(workload=workload, rows=rows)


def summarise_ab(before: list[Path], after: list[Path], out_dir: str | Path | None = None,
                 commits: list[str] | None = None) -> dict:
    """Interleaved before/after runs (one result file per run, from the old and the new commit
    run alternately) -> host_overhead_cpu.json: per batch size and phase, the median over the
    runs of each run's median, both sides, and after / before. The greedy tokens must agree."""
    import json

    def load(paths):
        return [json.loads(Path(p).read_text()) for p in paths]

    runs = {"before": load(before), "after": load(after)}
    digests = {(r["batch_size"], r["tokens_sha1"]) for side in runs.values() for run in side for r in run["rows"]}
    batch_sizes = [r["batch_size"] for r in runs["after"][0]["rows"]]
    if len(digests) != len(batch_sizes):
        raise ValueError(f"the greedy tokens differ between the runs: {sorted(digests)}")
    rows = []
    for i, b in enumerate(batch_sizes):
        row = dict(batch_size=b)
        for key, out_key in (("phases_ms", "wall"), ("phases_cpu_ms", "thread_cpu")):
            phases = {}
            for name in runs["after"][0]["rows"][i][key]:
                med = {side: round(statistics.median(run["rows"][i][key][name] for run in side_runs), 3)
                       for side, side_runs in runs.items()}
                phases[name.strip()] = dict(before_ms=med["before"], after_ms=med["after"],
                                            after_over_before=round(med["after"] / med["before"], 2)
                                            if med["before"] else None)
            row[out_key] = phases
        rows.append(dict(row, tokens_identical=True))
    workload = dict(runs["after"][0]["workload"], rounds=len(runs["after"]),
                    load_average_per_run={side: [run["workload"]["load_average"] for run in side_runs]
                                          for side, side_runs in runs.items()},
                    commits=dict(zip(runs, commits)) if commits else
                    {side: sorted({str(run["workload"]["git_commit"]) for run in side_runs}) for side, side_runs in runs.items()},
                    how="the old and the new commit's benchmark run alternately (before, after, before, ...), "
                        "each run in a fresh process; per phase the median over the runs of each run's median")
    workload.pop("load_average", None)
    write_result("host_overhead_cpu", workload, rows, out_dir)
    return dict(workload=workload, rows=rows)


def _git_commit() -> str | None:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
