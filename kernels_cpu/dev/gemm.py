"""The GEMM kernel's tuning story, re-run: every version of csrc/gemm.cpp built, checked against
F.linear, and timed on a SmolLM2 decode step's linears (30 layers of qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576, and the lm_head 576->49152: 538 MB of fp32 weights, streamed
from DRAM as in the engine), at decode batch sizes and one 512-token prefill chunk.

    python -m kernels_cpu.dev.gemm                 # build (first time: tens of seconds a version), check, time
    python -m kernels_cpu.dev.gemm --smoke         # tiny shapes, validation only

The versions are one source built with -DVFS_CPU_GEMM_VERSION=N (the .cpp's top comment says
why each step): a decode step's linears read every weight once, so how that stream reaches
memory is the cost. The 512-row chunk shows the same builds on a prefill: there each weight is
read once per block of 96 rows and the arithmetic, not the stream, is the cost.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from kernels_cpu import gemm
from kernels_cpu.dev.common import ColdCaches, arguments, best_times, load_version, print_table

VERSIONS = {
    1: "column panels streamed, a 4-row x 3-vector tile of the output in registers",
    2: "+ each row tile prefetches a share of its thread's next panel: the engine's build",
}
# (in, out) per layer, and the lm_head's: SmolLM2-135M
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LM_HEAD = (576, 49152)
NUM_LAYERS = 30


def load(version: int):
    if version == max(VERSIONS):
        return gemm.load_kernel()
    return load_version("cpu_gemm", gemm.SOURCES, gemm.WHAT, "VFS_CPU_GEMM_VERSION", version)


def make_weights(smoke: bool, seed: int = 0) -> list[torch.Tensor]:
    """A decode step's weights [out, in], scaled so outputs are O(1)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 40), (100, 83)] if smoke else LAYER_SHAPES * NUM_LAYERS + [LM_HEAD]
    return [torch.randn(o, i, generator=g) / i ** 0.5 for i, o in shapes]


def main(argv: list[str] | None = None) -> list[dict]:
    args = arguments(__doc__.split("\n\n")[0], argv)
    modules = {v: load(v) for v in VERSIONS}
    if len({m.panel_width for m in modules.values()}) != 1:
        raise AssertionError("the versions pack panels of different widths: they cannot share the packed weights")
    weights = make_weights(args.smoke)
    checked = weights[:len(LAYER_SHAPES)] + weights[-1:]          # one layer and the lm_head: F.linear's answer
    packed = [gemm.pack_panels(w) for w in weights]
    packed_checked = packed[:len(LAYER_SHAPES)] + packed[-1:]
    del weights                                                    # only the panels are streamed
    flush = ColdCaches(enabled=not args.smoke)
    results = []
    for rows_per_step in ([1, 5, 130] if args.smoke else [1, 8, 32, 64, 512]):
        x = {k: torch.randn(rows_per_step, k) for k in {p.panels.shape[1] for p in packed}}    # [rows, in] per in

        def step(module):                                          # every linear of the step on this build
            return [module.panel_gemm(x[p.panels.shape[1]], p.panels, None, p.out_features, True) for p in packed]
        rows = []
        for version, module in modules.items():
            error = max((module.panel_gemm(x[w.shape[1]], p.panels, None, p.out_features, True)
                         - F.linear(x[w.shape[1]], w)).abs().max().item() for w, p in zip(checked, packed_checked))
            if error > 1e-4:
                raise AssertionError(f"{rows_per_step} rows: v{version} differs from F.linear by {error}")
            rows.append(dict(rows=rows_per_step, version=version, change=VERSIONS[version], max_error=error))
        if not args.smoke:
            times = best_times({v: (lambda m=m: step(m)) for v, m in modules.items()}, flush, args.rounds)
            for row in rows:
                row["ms"] = 1e3 * times[row["version"]]
        weight_mb = sum(p.panels.numel() for p in packed) * 4 / 1e6
        print_table(f"{rows_per_step} rows x {len(packed)} linears ({weight_mb:.0f} MB of panels"
                    f"{', timed cold' if not args.smoke else ''}, {torch.get_num_threads()} threads, "
                    f"{modules[max(VERSIONS)].isa()})", rows)
        results += rows
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
