"""What tensor and pipeline parallelism cost per step on CPU processes over gloo, and the pipeline bubble.

    python -m benchmarks.bench_parallel                 # SmolLM2: TP=1 in-process, TP=1 / TP=3 / PP=2 in worker processes
    python -m benchmarks.bench_parallel --quick         # fewer steps

One workload for every configuration: 8 requests of real-text-sized prompts (96 tokens), greedy,
48 output tokens each; the decode steps after the first 8 are timed one by one (LLMEngine.step),
and after each step every rank's collectives are read and reset (Worker.comm_stats: calls, bytes,
seconds per op, measured inside the worker around each torch.distributed call). Reported per
decode step (medians):

    step_ms              engine step wall time (schedule + the executor's round trip + bookkeeping)
    control_bytes        the pickled (method, SchedulerOutput) the executor writes to each worker's pipe
    tp_all_reduce_calls  / bytes / ms on rank 0: one per row-parallel layer (o_proj, down_proj) + the embedding
    tp_all_gather_*      the logits' gather (vocab-parallel LM head)
    pp_recv_ms           per stage: time blocked receiving the previous stage's activations (stage 1)
    pp_broadcast_ms      time in the logits broadcast from the last stage — for stage 0 that is
                         mostly waiting for stage 1 to finish its layers
    bubble               (PP, lockstep: max_concurrent_batches=1) the fraction of a step a stage is idle:
                         its recv + broadcast wait over the step, averaged over stages. Without
                         micro-batches, stage 0 waits while stage 1 runs and the reverse, so the ideal
                         is (pp - 1) / pp = 0.5 at PP=2.

Then the pipeline without and with micro-batches (`run_pipeline`, the "pipeline" entry of the JSON):
whole runs of the same workload, nothing called on the workers between steps; each stage's bubble is
1 - its compute time / the run's wall time (compute = time in execute_model minus time blocked in the
stage hand-offs), averaged over the stages; their ratio within the one run is the result.

A step's time inside a collective is transfer PLUS waiting for the slowest rank to arrive (ranks
that share too few cores drift apart), so the benchmark also measures the collectives alone
(`collective_latency`): 2 gloo processes, nothing else running in them, all-reduce of [T, 576] fp32
(SmolLM2's hidden size: one decode step at T sequences) and all-gather of [T, 49152 / 2], median of
200 calls after warm-up. One TP=2 decode step of SmolLM2 is 61 all-reduces + 1 all-gather.

These are CPU processes sharing the machine's cores (threads per rank = cores / ranks): the
numbers show what the communication costs relative to a step, not a speed-up — on 2 cores there
is no parallel compute to gain. Writes benchmarks/results/parallel_cpu.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import write_result

CONFIGS = [  # (label, EngineConfig overrides)
    ("tp1_uniproc", dict()),
    ("tp1_mp", dict(distributed_executor_backend="mp")),
    ("tp3_mp", dict(tensor_parallel_size=3)),
    ("pp2_mp", dict(pipeline_parallel_size=2, max_concurrent_batches=1)),     # lockstep: the per-step bubble
]
# The pipeline without and with micro-batches, whole runs, no per-step calls into the workers.
PIPELINE_CONFIGS = [
    ("pp2_lockstep", dict(pipeline_parallel_size=2, max_concurrent_batches=1)),
    ("pp2_micro_batches", dict(pipeline_parallel_size=2)),                  # max_concurrent_batches = 2
]


def median(xs):
    return statistics.median(xs) if xs else 0.0


def run_config(label: str, overrides: dict, num_requests: int, prompt_len: int, output_len: int,
               skip: int) -> tuple[dict, list[list[int]]]:
    from mini_vllm import LLM, SamplingParams
    from mini_vllm.default_model import default_model_path

    llm = LLM(str(default_model_path()), max_model_len=512, num_gpu_blocks_override=256, cpu_kernels="off",
              max_num_seqs=num_requests, **overrides)
    try:
        engine = llm.llm_engine
        executor = engine.engine_core.model_executor
        multiproc = executor.model_runner is None
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        for i in range(num_requests):
            engine.add_request(f"r{i}", [(37 * i + 11 * j) % 40000 + 100 for j in range(prompt_len)], params)
        tokens: dict[str, list[int]] = {}
        steps, per_step = 0, []
        if multiproc:
            executor.collective_rpc("comm_stats", (True,))
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            for o in outs:
                if o.finished:
                    tokens[o.request_id] = o.outputs[0].token_ids
            stats = executor.collective_rpc("comm_stats", (True,)) if multiproc else None
            steps += 1
            if steps > skip and engine.last_step.scheduler_output.total_num_scheduled_tokens == num_requests:
                per_step.append((dt, stats, getattr(executor, "last_message_bytes", 0)))
        # last_message_bytes after comm_stats is that call's; the step's message is measured below
        row = {"config": label, **{k: v for k, v in overrides.items()}, "decode_steps_timed": len(per_step),
               "step_ms": round(1e3 * median([d for d, _, _ in per_step]), 2)}
        if multiproc:
            row.update(summarize(per_step, executor.parallel_config))
        return row, [tokens[f"r{i}"] for i in range(num_requests)]
    finally:
        llm.shutdown()


def summarize(per_step, pc) -> dict:
    """Medians over the timed decode steps of rank 0's TP collectives and each stage's PP waits."""
    def stat(rank, group, op, field):
        return [s[rank][group].get(op, (0, 0, 0.0))[field] for _, s, _ in per_step]
    out = {}
    if pc.tensor_parallel_size > 1:
        for op in ("all_reduce", "all_gather"):
            out[f"tp_{op}_calls"] = median(stat(0, "tp", op, 0))
            out[f"tp_{op}_bytes"] = median(stat(0, "tp", op, 1))
            out[f"tp_{op}_ms"] = round(1e3 * median(stat(0, "tp", op, 2)), 3)
        out["tp_comm_fraction"] = round(median([s[0]["tp"].get("all_reduce", (0, 0, 0))[2]
                                                + s[0]["tp"].get("all_gather", (0, 0, 0))[2]
                                                for _, s, _ in per_step]) / max(median([d for d, _, _ in per_step]),
                                                                               1e-9), 3)
    if pc.pipeline_parallel_size > 1:
        stages = [r * pc.tensor_parallel_size for r in range(pc.pipeline_parallel_size)]
        idle = []
        for stage, rank in enumerate(stages):
            recv = stat(rank, "pp", "recv", 2)
            bcast = stat(rank, "pp", "broadcast", 2)
            out[f"pp_stage{stage}_recv_ms"] = round(1e3 * median(recv), 3)
            out[f"pp_stage{stage}_broadcast_ms"] = round(1e3 * median(bcast), 3)
            out[f"pp_stage{stage}_send_bytes"] = median(stat(rank, "pp", "send", 1))
            idle.append([(r + b) / d for r, b, (d, _, _) in zip(recv, bcast, per_step)])
        out["bubble"] = round(statistics.mean(median(x) for x in idle), 3)
    return out


def run_pipeline(label: str, overrides: dict, num_requests: int, prompt_len: int,
                 output_len: int) -> tuple[dict, list[list[int]]]:
    """One whole run (prefill and decode) at PP=2, the workers left alone between steps. Each
    stage's bubble = 1 - (its compute time) / (the run's wall time), its compute time being its
    time inside execute_model minus the time it was blocked in the pipeline hand-offs (recv, send,
    the logits' broadcast) — Worker.busy_stats. With micro-batches a stage runs one batch while the
    other stage runs the other, so the bubble should shrink; the tokens must not change."""
    from mini_vllm import LLM, SamplingParams
    from mini_vllm.default_model import default_model_path

    llm = LLM(str(default_model_path()), max_model_len=512, num_gpu_blocks_override=256, cpu_kernels="off",
              max_num_seqs=num_requests, **overrides)
    try:
        engine = llm.llm_engine
        core, executor = engine.engine_core, engine.engine_core.model_executor
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        for i in range(num_requests):
            engine.add_request(f"r{i}", [(37 * i + 11 * j) % 40000 + 100 for j in range(prompt_len)], params)
        executor.collective_rpc("busy_stats", (True,))
        tokens, steps, t0 = {}, 0, time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = o.outputs[0].token_ids
            steps += 1
        wall = time.perf_counter() - t0
        stages = [r * executor.parallel_config.tensor_parallel_size
                  for r in range(executor.parallel_config.pipeline_parallel_size)]
        busy = executor.collective_rpc("busy_stats")
        row = {"config": label, **overrides, "max_concurrent_batches": core.batch_queue_size,
               "wall_s": round(wall, 3), "engine_steps": steps, "batches_overlapped": core.num_batches_overlapped,
               "output_tok_per_s": round(num_requests * output_len / wall, 2)}
        idle = []
        for stage, rank in enumerate(stages):
            b = busy[rank]
            compute = b["execute_s"] - b["pp_wait_s"]
            row[f"stage{stage}_execute_calls"] = b["execute_calls"]
            row[f"stage{stage}_compute_s"] = round(compute, 3)
            row[f"stage{stage}_pp_wait_s"] = round(b["pp_wait_s"], 3)
            idle.append(1 - compute / wall)
        row["bubble"] = round(statistics.mean(idle), 3)
        return row, [tokens[f"r{i}"] for i in range(num_requests)]
    finally:
        llm.shutdown()


def _collective_worker(rank: int, world: int, init_method: str, sizes: list[int], iters: int, queue) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, world_size=world, rank=rank)
    rows = []
    for t in sizes:
        # logits are gathered for the sampled rows only (at most max_num_seqs), so no prefill-sized gather
        for op, shape in (("all_reduce", (t, 576)), ("all_gather", (t, 49152 // world)))[:1 if t > 64 else 2]:
            x = torch.randn(*shape)
            parts = [torch.empty_like(x) for _ in range(world)]
            run = (lambda: dist.all_reduce(x)) if op == "all_reduce" else (lambda: dist.all_gather(parts, x))
            for _ in range(20):
                run()
            samples = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
            rows.append({"op": op, "tokens": t, "bytes": x.numel() * 4, "median_us": round(1e6 * median(samples), 1)})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def collective_latency(sizes=(1, 8, 64, 512), iters: int = 200, world: int = 2) -> list[dict]:
    """Median latency of gloo all-reduce / all-gather between `world` otherwise idle processes."""
    import multiprocessing

    from mini_vllm.executor.multiproc_executor import _free_port
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_collective_worker, args=(r, world, init, list(sizes), iters, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return rows


def control_message_bytes(num_requests: int) -> int:
    """Size of one decode step's pickled (method, SchedulerOutput, reply rank) for num_requests requests."""
    import pickle

    from scheduler import CachedRequestData, SchedulerOutput
    ids = [f"r{i}" for i in range(num_requests)]
    so = SchedulerOutput([], CachedRequestData(ids, [False] * num_requests, [[] for _ in ids], [100] * num_requests),
                         dict.fromkeys(ids, 1), num_requests)
    return len(pickle.dumps(("execute_model", (so,), 0)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 output tokens (smoke)")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    num_requests, prompt_len = 8, 96
    output_len, skip = (8, 2) if args.quick else (48, 8)
    latency = collective_latency(iters=50 if args.quick else 200)
    for row in latency:
        print(row, flush=True)
    rows, reference = [], None
    for label, overrides in CONFIGS:
        row, tokens = run_config(label, overrides, num_requests, prompt_len, output_len, skip)
        reference = tokens if reference is None else reference
        row["same_tokens_as_tp1"] = tokens == reference
        rows.append(row)
        print(row, flush=True)
    pipeline = []
    for label, overrides in PIPELINE_CONFIGS:
        row, tokens = run_pipeline(label, overrides, num_requests, prompt_len, output_len)
        row["same_tokens_as_tp1"] = tokens == reference
        pipeline.append(row)
        print(row, flush=True)
    if len(pipeline) == 2:
        lock, micro = pipeline
        pipeline.append({"config": "micro_batches_vs_lockstep", "bubble_ratio": round(micro["bubble"] / lock["bubble"], 3),
                         "wall_ratio": round(micro["wall_s"] / lock["wall_s"], 3)})
        print(pipeline[-1], flush=True)
    workload = dict(model="SmolLM2-135M-Instruct (fp32)", num_requests=num_requests, prompt_len=prompt_len,
                    output_len=output_len, timed="decode steps after the first %d" % skip, cpu_kernels="off",
                    backend="gloo", decode_control_message_bytes=control_message_bytes(num_requests),
                    command="python -m benchmarks.bench_parallel" + (" --quick" if args.quick else ""))
    path = write_result("parallel_cpu", {**workload, "collective_latency": latency, "pipeline": pipeline}, rows, args.out)
    print(f"wrote {path}")
    return {"rows": rows, "path": str(path)}


if __name__ == "__main__":
    main(sys.argv[1:])
