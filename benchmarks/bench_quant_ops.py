"""Chapter 10's quantized linears on the CPU: our kernels reading int8 / int4 weights
(kernels_cpu/csrc/quant_gemm.cpp, through quantization/cpu_ops.py's prepared forms, as the engine
calls them) against our fastest fp32 linear (kernels_cpu/gemm.py: panel_linear on pack_panels) and
the torch backend, on SmolLM2-135M's layer shapes, in one run.

    python -m benchmarks.bench_quant_ops              # ~1-2 min on 2 cores
    python -m benchmarks.bench_quant_ops --quick      # o_proj at T = 1, a few calls (tests)

Sides (each checked against quantization.reference_ops -- or F.linear, for fp32 -- before it is timed):
    fp32 panels       kernels_cpu.gemm.panel_linear on pack_panels(W): 4 bytes per weight
    int8 WNA16        int8 weights, per channel, symmetric; x in fp32: 1 byte per weight
    int4 WNA16        int4 weights, group 128 (64 where in = 576, which 128 does not divide), symmetric
    W8A8              int8 weights per channel, x quantized per token, int32 sums
    torch int4 WNA16  ops.wna16_linear(backend="torch") on the int4 weights (dequantizes W every call)
Layers (in -> out): qkv_proj 576 -> 960, o_proj 576 -> 576, gate_up_proj 576 -> 3072, down_proj
1536 -> 576; T = 1 (a decode step of one request), 16, 64 rows.

Weights come from memory, as in a decode step: every side cycles over --copies distinct copies of
each layer (default 30, SmolLM2's layer count), layer by layer, so a weight is read again only after
every other weight of its side has passed through the caches (the torch side, bound by its
arithmetic, over --torch-copies). Each call is timed alone; a side's time per (layer, T) is the
median over copies x --repeats; the sides take turns in every repeat, so they see the same machine.
Ratios: fp32's time / the side's (above 1: faster than fp32). Writes benchmarks/results/quant_ops.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_cpu_gemm import NUM_LAYERS, SHAPES
from benchmarks.common import RESULTS_DIR, write_result

LAYERS = {name: shape for name, shape in SHAPES.items() if name != "lm_head"}    # name -> (in, out)
SIDES = ("fp32 panels", "int8 WNA16", "int4 WNA16", "W8A8", "torch int4 WNA16")


def int4_group(in_features: int) -> int:
    """Group 128 where it divides the input (SmolLM2's hidden 576 = 4.5 x 128: there 64)."""
    return 128 if in_features % 128 == 0 else 64


def schemes(in_features: int):
    from quantization.reference import QuantScheme
    return {"int8": QuantScheme(8, True, None), "int4": QuantScheme(4, True, int4_group(in_features))}


def make_layer(in_features: int, out_features: int, g: torch.Generator, checkpoint: bool) -> dict:
    """One copy of a layer, as each side keeps it: {side: (fn(x) -> y, reference(x) or None)}. The
    float weight is dropped after packing; `checkpoint` keeps the int4 checkpoint tensors (the
    torch side and the correctness checks read them)."""
    from kernels_cpu import gemm as cpu_gemm
    from quantization import cpu_ops, ops, packing, reference_ops
    from quantization.reference import quantize_rtn, w8a8_linear_reference

    w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    s = schemes(in_features)
    q8, q4 = quantize_rtn(w, s["int8"]), quantize_rtn(w, s["int4"])
    packed8, packed4 = packing.pack_int32(q8.q, 8), packing.pack_int32(q4.q, 4)
    panels = cpu_gemm.pack_panels(w)
    prepared8 = cpu_ops.prepare_wna16(packed8, q8.scale, None, s["int8"])
    prepared4 = cpu_ops.prepare_wna16(packed4, q4.scale, None, s["int4"])
    w8a8 = cpu_ops.prepare_w8a8(q8.q, q8.scale)
    layer = {"fp32 panels": (lambda x: cpu_gemm.panel_linear(x, panels, None), lambda x: F.linear(x, w)),
             "int8 WNA16": (lambda x: cpu_ops.wna16_linear_prepared(x, prepared8),
                            lambda x: reference_ops.wna16_linear(x, packed8, q8.scale, None, s["int8"])),
             "int4 WNA16": (lambda x: cpu_ops.wna16_linear_prepared(x, prepared4),
                            lambda x: reference_ops.wna16_linear(x, packed4, q4.scale, None, s["int4"])),
             "W8A8": (lambda x: cpu_ops.w8a8_linear_prepared(x, w8a8),
                      lambda x: w8a8_linear_reference(x, q8.q, q8.scale))}
    if not checkpoint:                                 # only the packed weights stay (the references hold w)
        return {side: (fn, None) for side, (fn, _) in layer.items()}
    layer["torch int4 WNA16"] = (lambda x: ops.wna16_linear(x, packed4, q4.scale, None, s["int4"], backend="torch"),
                                 layer["int4 WNA16"][1])
    return layer


def check(copy: dict, xs: dict) -> None:
    """Every side of one copy against its reference (fp32 summation order: 1e-4)."""
    for name, sides in copy.items():
        for side, (fn, ref) in sides.items():
            torch.testing.assert_close(fn(xs[name]), ref(xs[name]), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, side=side, name=name: f"{side} on {name} disagrees: {m}")


def time_sides(copies: list[dict], torch_copies: int, layers: list[str], T: int, repeats: int) -> dict:
    """Median seconds per (side, layer) of one call at T rows, each side cycling over its copies."""
    xs = {name: torch.randn(T, LAYERS[name][0]) for name in layers}
    check(copies[0], xs)
    samples = {(side, name): [] for side in SIDES for name in layers}
    for _ in range(repeats + 1):                       # the first pass warms up (and is dropped)
        for side in SIDES:
            for copy in copies[:torch_copies] if side.startswith("torch") else copies:
                for name in layers:
                    fn = copy[name][side][0]
                    t0 = time.perf_counter()
                    fn(xs[name])
                    samples[side, name].append(time.perf_counter() - t0)
    skip = {side: torch_copies if side.startswith("torch") else len(copies) for side in SIDES}
    return {key: statistics.median(v[skip[key[0]]:]) for key, v in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--copies", type=int, default=NUM_LAYERS, help="distinct copies of each layer per side")
    ap.add_argument("--torch-copies", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. 'machine shared with other jobs')")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.layers, args.copies, args.torch_copies, args.repeats = [1], ["o_proj"], 2, 1, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from kernels_cpu import gemm as cpu_gemm
    from kernels_cpu import quant_gemm
    from quantization import cpu_ops
    if reason := cpu_ops.unavailable_reason():
        raise SystemExit(f"the quantized CPU kernels do not build here: {reason}")

    g = torch.Generator().manual_seed(0)
    copies = [{name: make_layer(*LAYERS[name], g, checkpoint=i < max(1, args.torch_copies)) for name in args.layers}
              for i in range(max(args.copies, args.torch_copies))]
    rows = []
    for T in args.tokens:
        med = time_sides(copies, args.torch_copies, args.layers, T, args.repeats)
        for name in args.layers:
            in_features, out_features = LAYERS[name]
            row = dict(layer=name, in_features=in_features, out_features=out_features, tokens=T,
                       int4_group=int4_group(in_features))
            row.update({f"{side} us": round(1e6 * med[side, name], 2) for side in SIDES})
            fp32 = med["fp32 panels", name]
            row.update({f"{side} speedup vs fp32": round(fp32 / med[side, name], 2) for side in SIDES[1:]})
            rows.append(row)
            print(row, flush=True)
    module = quant_gemm.load()
    workload = dict(op="y = x @ W^T for SmolLM2-135M's linears, weights streamed from memory",
                    model="SmolLM2-135M", layers={n: list(LAYERS[n]) for n in args.layers}, tokens=args.tokens,
                    isa=module.isa(), vnni=module.vnni(), gemm_isa=cpu_gemm.load_kernel().isa(),
                    threads=torch.get_num_threads(), copies=args.copies, torch_copies=args.torch_copies,
                    repeats=args.repeats, x_dtype="float32",
                    schemes={"int8 WNA16": "int8 symmetric per channel", "int4 WNA16": "int4 symmetric, group 128 "
                             "(64 where in = 576)", "W8A8": "int8 symmetric per channel, x per token (dynamic)"},
                    timing="median of single calls over copies x repeats, sides interleaved per repeat",
                    ratio="fp32 panels' time / the side's (above 1: faster than fp32)", note=args.note)
    path = write_result("quant_ops_quick" if args.quick else "quant_ops", workload, rows, args.out_dir)
    return dict(rows=rows, path=path)


if __name__ == "__main__":
    main()
