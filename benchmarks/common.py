"""What every benchmark shares: timing, and results written as JSON with the context
(device, versions, date, workload) that makes a number mean something."""
from __future__ import annotations

import datetime
import json
import pathlib
import platform
import statistics
import time
from typing import Callable

import torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else the machine type: two VMs of the same
    architecture can differ by 1.5x, so a CPU number names the CPU it ran on."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return (f"CPU ({cpu_model()}, {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads)")


def environment() -> dict:
    env = {"device": device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now().isoformat(timespec="seconds")}
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            pass
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
    return env


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], warmup: int = 3, iters: int = 10,
            reduce: Callable[[list[float]], float] = statistics.median) -> float:
    """Median (or `reduce`, e.g. min for a peak rate) wall time of fn() in seconds, after
    warm-up; CUDA-synchronised."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return reduce(samples)


def write_result(name: str, workload: dict, rows: list[dict], out_dir: str | pathlib.Path | None = None,
                 **sections) -> pathlib.Path:
    """benchmarks/results/<name>.json = {environment, workload, rows, **sections} (sections: what a
    benchmark derives from its rows, e.g. bench_serve's medians over repeated runs)."""
    out = pathlib.Path(out_dir or RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), "workload": workload, "rows": rows, **sections},
                               indent=2))
    return path


def try_plot(plot: Callable[..., None], *args) -> bool:
    """plot(*args) if matplotlib is importable. A bare GPU machine may lack it: the JSON holds every
    number, and the plot function can draw it from the JSON on another machine."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed here: no PNG (the JSON holds every number)")
        return False
    plot(*args)
    return True


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two greedy runs give the same token, up to each pair's first difference
    (after a difference the contexts differ): the agreeing prefixes' tokens over all of `a`'s."""
    total = same = 0
    for x, y in zip(a, b):
        total += len(x)
        same += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return same / max(total, 1)


def with_throwaway_engine(build: Callable[[], object], use: Callable[[object], object]):
    """Build an engine only to `use` it, shut it down, and return what `use` returned. In one process
    the first engine built has run slower than later identical ones (benchmarks/HISTORY.md, 2026-12-05;
    the cause is not found), so a benchmark that compares engines builds a throwaway one first: no
    side it times is the process's first."""
    llm = build()
    try:
        return use(llm)
    finally:
        llm.shutdown()
