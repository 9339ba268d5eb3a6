"""What the dev commands share: build a version of a kernel, time it with cold caches, print the table."""
from __future__ import annotations

import argparse
import pathlib
import time

import torch

from kernels_cpu import build


def load_version(stem: str, sources: tuple[str, ...], what: str, macro: str, version: int,
                 extra_cflags: tuple[str, ...] = ()):
    """The kernel's source built with -D<macro>=<version> (extension vfs_<stem>_v<version>_<isa>),
    for this CPU's best instruction set; built on first use like the engine's kernels (build.py)."""
    return build.load_extension(f"{stem}_v{version}", sources, f"{what} v{version}", None,
                                (*extra_cflags, f"-D{macro}={version}"))


def l3_bytes() -> int:
    """This CPU's last-level cache (0 when the OS does not say)."""
    try:
        text = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
    except (OSError, ValueError, KeyError):
        return 0


class ColdCaches:
    """Evicts the caches before each timed call by reading 2x the L3 (at least 64 MB, at most
    1 GB): the engine's case, where one layer's K/V and weights are read again only after every
    other layer has gone through the caches."""

    def __init__(self, enabled: bool = True):
        size = min(max(2 * l3_bytes(), 64 << 20), 1 << 30) if enabled else 0
        self.buffer = torch.ones(size // 4)

    def __call__(self) -> None:
        if self.buffer.numel():
            self.buffer.sum()


def best_times(fns: dict, flush: ColdCaches, rounds: int) -> dict:
    """{key: the fastest of `rounds` calls of fns[key]() (seconds)}, each call after a flush; the
    versions take turns in every round, so a busy moment of the machine hits them all alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            flush()
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def arguments(description: str, argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, validation only (no timing): what tests run")
    ap.add_argument("--rounds", type=int, default=7, help="timed calls per version and workload (the fastest counts)")
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def print_table(title: str, rows: list[dict]) -> None:
    """rows: dicts with version, change, max_error and (timed runs) ms; speed-up is vs the first row."""
    print(f"\n{title}")
    print(f"  {'version':<8}{'max error':>11}{'ms':>10}{'speed-up':>10}  change")
    base = rows[0].get("ms")
    for r in rows:
        ms = r.get("ms")
        timed = f"{ms:10.3f}{base / ms:9.2f}x" if ms is not None else f"{'-':>10}{'-':>10}"
        print(f"  v{r['version']:<7}{r['max_error']:11.1e}{timed}  {r['change']}")
