"""What putting the engine core in its own process costs or saves per step (core_proc.py,
core_client.py): the same LLM.generate in-process and with VLLM_ENABLE_V1_MULTIPROCESSING=1.

    python -m benchmarks.bench_engine_core_ipc            # SmolLM2, ~2 min on 2 cores
    python -m benchmarks.bench_engine_core_ipc --smoke    # tiny random model, seconds

Per configuration (one request alone — the cheapest step, where a fixed cost shows most — and a
batch of 16), greedy, fixed output lengths, the two engines built side by side and timed in
alternation (in-process, split, in-process, ...; the median of --repeats passes each):
  * wall ms per step, in each mode;
  * CPU ms per step: the in-process engine's process; with the split, the front end's process
    and the core's (time.process_time, every thread, torch's included) — their sum minus the
    in-process CPU is what the split costs;
  * the output message: pickled bytes per step and the pickle encode + decode time;
  * each side's torch thread count, and the machine's load average before and after.
Writes benchmarks/results/engine_core_ipc.json.

Read CPU ms per step with the OpenMP wait policy in mind (recorded in the JSON): torch's CPU
build uses GNU OpenMP, whose worker threads spin after each parallel region before they sleep
(OMP_WAIT_POLICY unset), long enough to span the Python between two ops and between two steps.
So a process's CPU time is about its thread count times its wall time, whatever the work, and
it tracks what stretches the wall time (on a shared machine, the neighbours' load). Run with
OMP_WAIT_POLICY=PASSIVE (threads sleep at once: CPU time is the work done) and --name to compare:

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.bench_engine_core_ipc --name engine_core_ipc_passive
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.bench_engine import SMOKE_KV_CACHE_MEMORY, make_workload, tiny_model_dir
from benchmarks.common import RESULTS_DIR, write_result

CONFIGS = {"1 request": dict(num_requests=1, prompt_len=(64, 64), output_len=(48, 48)),
           "16 requests": dict(num_requests=16, prompt_len=(32, 256), output_len=(32, 32))}
SMOKE = {"2 requests": dict(num_requests=2, prompt_len=(8, 24), output_len=(8, 8))}


def _timed_pass(llm, prompts, params, multiprocess: bool) -> dict:
    """One timed LLM.generate from a cold prefix cache: wall and CPU per step, message sizes."""
    import torch

    import mini_vllm.core_client as core_client

    llm.reset_prefix_cache()
    engine = llm.llm_engine
    steps = [0]
    message_bytes, codec_s = [0], [0.0]
    if multiprocess:
        decode = core_client.decode

        def counting_decode(data):
            t0 = time.perf_counter()
            obj = decode(data)
            pickle.dumps(obj, protocol=5)                      # what the core's encode cost (same object)
            codec_s[0] += time.perf_counter() - t0
            message_bytes[0] += len(data)
            return obj
        core_client.decode = counting_decode
        core_before = engine.engine_core.call_utility("cpu_time")
    else:
        step = engine.engine_core.step

        def counting_step():
            steps[0] += 1
            return step()
        engine.engine_core.step = counting_step
    cpu0, t0 = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, front_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    row = dict(mode="core process (ZMQ)" if multiprocess else "in process", wall_s=round(wall, 3),
               output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs))
    if multiprocess:
        core_client.decode = decode
        core_after = engine.engine_core.call_utility("cpu_time")
        row["torch_threads"] = core_after["torch_threads"]
        steps[0] = core_after["steps"] - core_before["steps"]
        core_cpu = core_after["cpu_s"] - core_before["cpu_s"]
        row.update(front_end_cpu_ms_per_step=round(1e3 * front_cpu / steps[0], 3),
                   core_cpu_ms_per_step=round(1e3 * core_cpu / steps[0], 3),
                   cpu_ms_per_step=round(1e3 * (front_cpu + core_cpu) / steps[0], 3),
                   message_bytes_per_step=round(message_bytes[0] / steps[0]),
                   pickle_us_per_step=round(1e6 * codec_s[0] / steps[0], 1))
    else:
        row.update(cpu_ms_per_step=round(1e3 * front_cpu / steps[0], 3), torch_threads=torch.get_num_threads())
    row.update(steps=steps[0], wall_ms_per_step=round(1e3 * wall / steps[0], 3))
    row["output_token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
    if not multiprocess:
        del engine.engine_core.step                                # the class's step again
    return row


def make_llm(model_dir, workload, multiprocess: bool, kv_cache_memory: int | None = None):
    from mini_vllm import LLM

    max_len = max(len(p) + n for p, n in workload) + 8
    return LLM(str(model_dir), max_model_len=max_len, max_num_seqs=64, kv_cache_memory=kv_cache_memory,
               multiprocess_mode=multiprocess)


def run_interleaved(model_dir, workload, repeats: int, kv_cache_memory: int | None = None) -> tuple[dict, dict]:
    """Both engines built side by side, warmed up, then timed passes alternating in-process,
    split, in-process, ... (a shared machine drifts within minutes: neighbours in time compare
    fairly); returns the median of each number per mode."""
    from mini_vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    llms = {mp: make_llm(model_dir, workload, mp, kv_cache_memory) for mp in (False, True)}
    try:
        for llm in llms.values():
            llm.generate(prompts, params, use_tqdm=False)          # warm-up (kernels, allocator)
        reps = {False: [], True: []}
        for _ in range(repeats):
            for mp, llm in llms.items():
                reps[mp].append(_timed_pass(llm, prompts, params, mp))
        out = []
        for mp in (False, True):
            rs = reps[mp]
            row = {k: (statistics.median(r[k] for r in rs) if isinstance(v, (int, float)) and not isinstance(v, bool)
                       else v) for k, v in rs[0].items()}
            row["repeats"] = repeats
            row["wall_ms_per_step_each"] = [r["wall_ms_per_step"] for r in rs]
            out.append(row)
        return out[0], out[1]
    finally:
        for llm in llms.values():
            llm.shutdown()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per mode (the median is kept)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--name", default=None, help="the result's file name (default engine_core_ipc[_smoke])")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from mini_vllm import default_model_path

    tmp = tempfile.TemporaryDirectory()
    model_dir = tiny_model_dir(Path(tmp.name)) if args.smoke else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    load_before = os.getloadavg()
    for name, shape in (SMOKE if args.smoke else CONFIGS).items():
        workload = make_workload(tokenizer, shape["num_requests"], shape["prompt_len"], shape["output_len"])
        repeats = 1 if args.smoke else args.repeats
        # --smoke: bench_engine's small pool (the CPU default, 2 GiB, costs each engine seconds)
        inproc, mp = run_interleaved(model_dir, workload, repeats, SMOKE_KV_CACHE_MEMORY if args.smoke else None)
        same = inproc.pop("output_token_ids") == mp.pop("output_token_ids")
        for row in (inproc, mp):
            row.update(config=name, same_tokens_as_in_process=same)
        mp["split_cpu_ms_per_step"] = round(mp["cpu_ms_per_step"] - inproc["cpu_ms_per_step"], 3)
        mp["split_wall_ms_per_step"] = round(mp["wall_ms_per_step"] - inproc["wall_ms_per_step"], 3)
        for row in (inproc, mp):
            print(row, flush=True)
        rows += [inproc, mp]
    policy = os.environ.get("OMP_WAIT_POLICY")
    command = "python -m benchmarks.bench_engine_core_ipc" + (" --smoke" if args.smoke else "") + \
        (f" --repeats {args.repeats}" if args.repeats != 3 else "") + (f" --name {args.name}" if args.name else "")
    write_result(args.name or ("engine_core_ipc_smoke" if args.smoke else "engine_core_ipc"),
                 dict(model=Path(model_dir).name, dtype="float32", device="cpu", greedy=True, ignore_eos=True,
                      configs=SMOKE if args.smoke else CONFIGS, encoding="pickle protocol 5 over ZMQ PUSH/PULL (ipc://)",
                      omp_wait_policy=policy or "unset (GNU OpenMP's default: spin, then sleep)",
                      load_average_1_5_15_min=dict(before=[round(x, 2) for x in load_before],
                                                   after=[round(x, 2) for x in os.getloadavg()]),
                      command=(f"OMP_WAIT_POLICY={policy} " if policy else "") + command),
                 rows, args.out_dir)
    tmp.cleanup()
    return rows


if __name__ == "__main__":
    main()
