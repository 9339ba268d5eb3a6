"""Where a decode step's time goes: torch.profiler over pure decode steps of a full batch, summed
into one table (GPU kernels by total time, host phases of the engine, launch gaps).

    python -m benchmarks.bench_engine_gpu --profile-batch 256     # the GPU run (writes engine_gpu_profile.json)
    python -m benchmarks.bench_engine_gpu --smoke --profile-batch 4   # the code path on a CPU

Why a summary and not the trace: a Chrome trace of one step is megabytes and shows the same
things the table states with numbers — how long the step took on the wall clock, how much of it
the GPU was busy (the sum of kernel durations on the one stream), which kernels take that busy
time, and how the host's time splits between the engine's phases (schedule, prepare inputs,
forward launch / graph replay, sample, update, output processing). `wall - gpu_busy` is time
the GPU waited for the host: the part CUDA graphs, GPU-side input preparation and sampling
without host syncs attack.

The phases are named by wrapping the engine's methods in `torch.profiler.record_function` here,
from the outside: the engine carries no profiling code.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.common import sync

# (object path from the engine, method name) -> phase name in the table
PHASES = (
    (("engine_core", "scheduler"), "schedule", "schedule"),
    (("engine_core", "model_runner", "input_batch"), "prepare_inputs", "prepare_inputs"),
    (("engine_core", "model_runner"), "_sample", "sample (+ host sync for token ids)"),
    (("engine_core", "model_runner", "model"), "forward", "forward (eager launches)"),
    (("engine_core", "model_runner", "cuda_graph_runner"), "run", "cuda graph fill + replay"),
    (("engine_core", "scheduler"), "update_from_output", "update_from_output"),
    (("output_processor",), "process_outputs", "output processing"),
)


def _resolve(root, path):
    obj = root
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


@contextlib.contextmanager
def wrapped_phases(engine, phases, wrap):
    """For the duration of the block, replace each phase method (path from the engine, method
    name, label) by wrap(original, label) on its instance; the class methods show again after."""
    patched = []
    for path, method, label in phases:
        obj = _resolve(engine, path)
        if obj is None or not hasattr(obj, method):
            continue
        patched.append((obj, method, obj.__dict__.get(method)))
        setattr(obj, method, wrap(getattr(obj, method), label))
    try:
        yield
    finally:
        for obj, method, before in reversed(patched):
            if before is None:
                delattr(obj, method)      # the instance attribute goes; the class method shows again
            else:
                setattr(obj, method, before)   # another wrapper (a trace) was there: it stays


def named_phases(engine):
    """Wrap the engine's phase methods in record_function ranges for the duration of the block."""
    def wrap(original, label):
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(f"phase: {label}"):
                return original(*args, **kwargs)
        return wrapped
    return wrapped_phases(engine, PHASES, wrap)


def _device_time_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def fill_decode_batch(engine, batch_size: int, context: int, seed: int = 1, prefix: str = "prof"):
    """Add `batch_size` requests of `context` random tokens and step until one step is a pure
    decode of all of them. Returns their ids (the caller aborts them)."""
    import random

    from mini_vllm import SamplingParams

    rng = random.Random(seed)
    max_tokens = engine.model_config.max_model_len - context      # never stops by itself: aborted after
    if max_tokens < 8:
        raise ValueError(f"context {context} leaves no room to decode under max_model_len "
                         f"{engine.model_config.max_model_len}")
    ids = [f"{prefix}{batch_size}-{i}" for i in range(batch_size)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(10000) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False))
    for _ in range(batch_size * context + 8):          # bound: one prompt token per step at worst
        engine.step()
        if is_full_decode(engine, batch_size):
            return ids
    engine.abort_request(ids)
    raise RuntimeError(f"no step decoded all {batch_size} requests at once (max_num_seqs "
                       f"{engine.config.max_num_seqs}, KV capacity?): cannot time a pure decode step")


def is_full_decode(engine, batch_size: int) -> bool:
    so = engine.last_step.scheduler_output
    return so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) == batch_size


def profile_decode(llm, batch_size: int, context: int, steps: int = 8) -> dict:
    """Profile `steps` pure decode steps of `batch_size` requests at ~`context` tokens each."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    cuda = torch.cuda.is_available()
    ids = fill_decode_batch(engine, batch_size, context)
    for _ in range(2):                                  # warm: the steps right after prefill are decodes too
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with named_phases(engine), profile(activities=activities) as prof:
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            engine.step()
            sync()
            walls.append(time.perf_counter() - t0)
            if not is_full_decode(engine, batch_size):
                raise RuntimeError("a profiled step was not a pure decode of the whole batch")
    engine.abort_request(ids)

    kernels = defaultdict(lambda: [0.0, 0])             # kernel name -> [device us, calls]
    phases = defaultdict(float)                         # phase -> host us
    for evt in prof.key_averages():
        if evt.key.startswith("phase: "):
            phases[evt.key.removeprefix("phase: ")] += evt.cpu_time_total
    for evt in prof.events():
        # Our record_function ranges also show up on the GPU timeline (as annotations spanning the
        # kernels they launched): they are not kernels, and counting them would count time twice.
        if cuda and getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA \
                and not evt.name.startswith("phase: "):
            kernels[evt.name][0] += _device_time_us(evt) or evt.time_range.elapsed_us()
            kernels[evt.name][1] += 1
    busy_ms = sum(us for us, _ in kernels.values()) / 1000 / steps
    wall_ms = 1000 * statistics.median(walls)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
    return dict(
        batch_size=batch_size, context=context, steps=steps,
        step_wall_ms=round(wall_ms, 3), gpu_busy_ms=round(busy_ms, 3) if cuda else None,
        gpu_idle_ms=round(wall_ms - busy_ms, 3) if cuda else None,
        kernel_launches_per_step=round(sum(n for _, n in kernels.values()) / steps, 1) if cuda else None,
        kernels=[dict(name=name[:120], ms_per_step=round(us / 1000 / steps, 4), calls_per_step=round(n / steps, 1),
                      share_of_busy=round(us / 1000 / steps / busy_ms, 4) if busy_ms else None)
                 for name, (us, n) in top],
        host_phases=[dict(phase=p, ms_per_step=round(us / 1000 / steps, 3))
                     for p, us in sorted(phases.items(), key=lambda kv: -kv[1])],
    )


def drop_annotations(profile: dict) -> dict:
    """A profile summarised before the fix above (GPU-side "phase: ..." annotation ranges counted
    as kernels) with those rows taken out of the kernel table and of the busy time. Exact: the
    annotation rows are separate entries of the same sums."""
    kernels = [k for k in profile["kernels"] if not k["name"].startswith("phase: ")]
    annotated = sum(k["ms_per_step"] for k in profile["kernels"] if k["name"].startswith("phase: "))
    annotated_calls = sum(k["calls_per_step"] for k in profile["kernels"] if k["name"].startswith("phase: "))
    busy = profile["gpu_busy_ms"] - annotated
    return dict(profile, gpu_busy_ms=round(busy, 3), gpu_idle_ms=round(profile["step_wall_ms"] - busy, 3),
                kernel_launches_per_step=round(profile["kernel_launches_per_step"] - annotated_calls, 1),
                kernels=[dict(k, share_of_busy=round(k["ms_per_step"] / busy, 4)) for k in kernels])


def format_table(profile: dict) -> str:
    """The profile as a markdown table (what the README quotes)."""
    lines = [f"decode step, batch {profile['batch_size']}, context ~{profile['context']}: "
             f"wall {profile['step_wall_ms']} ms, GPU busy {profile['gpu_busy_ms']} ms, "
             f"{profile['kernel_launches_per_step']} kernels/step", "",
             "| GPU kernel | ms / step | calls / step | share of busy |", "|---|---:|---:|---:|"]
    lines += [f"| `{k['name'][:70]}` | {k['ms_per_step']} | {k['calls_per_step']} | {k['share_of_busy']} |"
              for k in profile["kernels"]]
    lines += ["", "| host phase | ms / step |", "|---|---:|"]
    lines += [f"| {p['phase']} | {p['ms_per_step']} |" for p in profile["host_phases"]]
    return "\n".join(lines)
