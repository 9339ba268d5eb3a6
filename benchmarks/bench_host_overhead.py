"""Host time per decode step: how long the engine's own Python takes around a forward pass that
costs next to nothing.

    python -m benchmarks.bench_host_overhead            # batch 1 / 64 / 256 -> results/host_overhead_cpu.json
    python -m benchmarks.bench_host_overhead --smoke    # the code path at CI size

Why: on an H200 a pure decode step at batch 256 took 14.4 ms while the GPU was busy 9.3 ms
(results/engine_gpu_profile.json) — the host phases (schedule, prepare inputs, graph buffer fill,
update_from_output, output processing) run one after another each step and the GPU waits. Host
time is host time: with a tiny random model (2 layers, hidden 64, a small vocabulary) the model's
compute is negligible and what a CPU measures per step is the engine's bookkeeping.

Each phase is timed by wrapping the engine's methods from the outside (time.perf_counter around
the call, accumulated per step), as `profile_decode_step.named_phases` does with
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
import contextlib
import hashlib
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import write_result

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


def _resolve(root, path):
    obj = root
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


@contextlib.contextmanager
def timed_phases(engine, totals: dict[str, float]):
    """Wrap the engine's phase methods so that each call adds its wall time to totals[phase]."""
    patched = []
    for path, method, label in PHASES:
        obj = _resolve(engine, path)
        if obj is None or not hasattr(obj, method):
            continue
        original = getattr(obj, method)

        def wrapped(*args, _original=original, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - t0

        setattr(obj, method, wrapped)
        patched.append((obj, method))
    try:
        yield
    finally:
        for obj, method in patched:
            delattr(obj, method)          # the instance attribute goes; the class method shows again


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


def measure_batch(llm, batch_size: int, context: int, steps: int, warmup: int, vocab_size: int) -> dict:
    """Per-phase host ms per pure decode step of `batch_size` requests (medians over `steps`)."""
    from benchmarks.profile_decode_step import is_full_decode
    from mini_vllm.cuda_graph import DecodeBuffers

    engine = llm.llm_engine
    runner = engine.engine_core.model_runner
    capture_sizes = engine.config.capture_sizes()
    buffers = DecodeBuffers(capture_sizes[-1], runner.max_num_blocks_per_req, torch.device("cpu"))
    buffers.capture_sizes = capture_sizes
    ids = fill_decode(engine, batch_size, context, vocab_size)
    for _ in range(warmup):
        engine.step()
    per_step: dict[str, list[float]] = defaultdict(list)
    digest = hashlib.sha1()
    for _ in range(steps):
        totals: dict[str, float] = defaultdict(float)
        with timed_phases(engine, totals):
            t0 = time.perf_counter()
            outputs = engine.step()
            totals["step"] = time.perf_counter() - t0
        if not is_full_decode(engine, batch_size):
            raise RuntimeError(f"batch {batch_size}: a timed step was not a pure decode")
        totals["graph buffer fill (CPU copy)"] = _graph_fill_seconds(buffers, engine.last_step.model_inputs)
        for out in sorted(outputs, key=lambda o: o.request_id):
            digest.update(f"{out.request_id}:{out.outputs[0].token_ids[-1]};".encode())
        for name, seconds in totals.items():
            per_step[name].append(seconds)
    engine.abort_request(ids)
    phases = {name: round(1000 * statistics.median(v), 4) for name, v in per_step.items()}
    return dict(batch_size=batch_size, context=context, steps=steps, phases_ms=phases,
                step_ms=phases["step"], tokens_sha1=digest.hexdigest())


def make_llm(model_dir: Path, max_num_seqs: int, max_model_len: int):
    from mini_vllm import LLM

    return LLM(str(model_dir), dtype="float32", device="cpu", attention_backend="cpu",
               max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
               kv_cache_memory=64 << 20)


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
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.steps, args.warmup, args.context = [1, 8], 4, 1, 16
    # The phases are single-threaded Python; one intra-op thread keeps the tiny forward from
    # fighting other processes for a shared CPU (spinning OpenMP workers), which is noise here.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        from benchmarks.bench_engine_gpu import make_model_dir
        model_dir = make_model_dir(Path(tmp), TINY, torch.float32)
        llm = make_llm(model_dir, max(args.batch_sizes), args.max_model_len)
        rows = [measure_batch(llm, b, args.context, args.steps, args.warmup, TINY["vocab_size"])
                for b in args.batch_sizes]
        llm.shutdown()
    workload = dict(model="random Qwen3-shaped, tiny: the forward is negligible, the phases are the host's",
                    config=TINY, dtype="float32", attention_backend="cpu", context=args.context,
                    steps=args.steps, max_num_seqs=max(args.batch_sizes), sampling="greedy, detokenize=False",
                    threads=args.threads,
                    load_average=list(os.getloadavg()), git_commit=_git_commit())
    name = args.name or ("host_overhead_cpu_smoke" if args.smoke else "host_overhead_cpu")
    path = write_result(name, workload, rows, args.out_dir)
    for row in rows:
        print(f"batch {row['batch_size']}: " + ", ".join(f"{k.strip()} {v}" for k, v in row["phases_ms"].items()))
    print(f"wrote {path}")
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
