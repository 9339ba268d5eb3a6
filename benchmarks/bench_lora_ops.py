"""Multi-LoRA's products (chapter 09's ops.py): every backend of `add_lora_linear` (shrink + expand)
vs the naive per-adapter loop, on SmolLM2-135M's LoRA-wrapped linears, one run.

    python -m benchmarks.bench_lora_ops             # about 10 seconds on a CPU
    python -m benchmarks.bench_lora_ops --quick     # T = 16, the qkv layer, one timing (tests)

Workload: the LoRA part only (y += scale_i (x A_i^T) B_i^T, slice by slice; the base product
x W^T is the same for every side and left out), on
    qkv       in 576, slices q/k/v = 576/192/192 (GQA: 9 query heads, 3 KV heads of 64)
    gate_up   in 576, slices gate/up = 1536/1536
8 adapters loaded (slots), ranks 8 and 16 alternating (zero-padded to max_rank 16), scale
alpha / r; T = 1 (one request, slot 1), 16, 256 tokens, each with a random adapter or none
(-1, one in 9: "mixed"), and at T = 256 also "grouped": the same mix sorted by adapter
(prefill chunks of one request each). Sides:
    naive       for each adapter in the batch: mask its tokens, two matmuls, add (PEFT's
                mixed-batch forward, and what one writes first)
    reference   the per-token loop (reference.py; timed at T <= 16 only: it is the oracle)
    torch       the rule: BGMV up to torch_ops.BGMV_MAX_TOKENS tokens, SGMV above
    torch bgmv / torch sgmv   each method forced (the rule's evidence)
    cpu         the C++ kernels (when they build here)
    triton      on a GPU only (the interpreter's time means nothing)
Every side is checked against the naive loop first. Times are the FASTEST of --iters calls on
the same tensors (y reset by a copy, included in every side's time alike): on a CPU shared with
other jobs the median of one side moved by up to 3x between runs, the minimum far less.
Ratios: each side's time over the torch backend's and over the naive loop's (below 1: faster).
Writes
benchmarks/results/lora_ops.json.
"""
from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, time_fn, write_result

HIDDEN = 576                 # SmolLM2-135M
LAYERS = {"qkv": (576, 192, 192), "gate_up": (1536, 1536)}
NUM_SLOTS = 8
RANKS = (8, 16)
ALPHA = 16.0


def make_inputs(layer: str, T: int, layout: str, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """x, stacked zero-padded adapters, per-slot scales, token_lora, base y for one case."""
    g = torch.Generator().manual_seed(seed)
    sizes = LAYERS[layer]
    max_rank, max_out = max(RANKS), max(sizes)
    lora_a = torch.zeros(NUM_SLOTS, len(sizes), max_rank, HIDDEN)
    lora_b = torch.zeros(NUM_SLOTS, len(sizes), max_out, max_rank)
    ranks = [RANKS[i % len(RANKS)] for i in range(NUM_SLOTS)]
    for i, r in enumerate(ranks):
        lora_a[i, :, :r] = torch.randn(len(sizes), r, HIDDEN, generator=g) / HIDDEN ** 0.5
        for s, size in enumerate(sizes):
            lora_b[i, s, :size, :r] = torch.randn(size, r, generator=g) / r ** 0.5
    token_lora = torch.randint(-1, NUM_SLOTS, (T,), generator=g)
    if T == 1:
        token_lora[0] = 1                            # a decode step of one request, with a rank-16 adapter
    if layout == "grouped":
        token_lora = token_lora.sort().values
    return dict(x=torch.randn(T, HIDDEN, generator=g).to(device, dtype), lora_a=lora_a.to(device, dtype),
                lora_b=lora_b.to(device, dtype), token_lora=token_lora.to(device), sizes=sizes,
                scales=[ALPHA / r for r in ranks], y=torch.randn(T, sum(sizes), generator=g).to(device, dtype))


def naive_lora(y, x, lora_a, lora_b, token_lora, scales, sizes) -> None:
    """The straightforward way: one adapter at a time, its tokens picked out by a mask."""
    offsets = [sum(sizes[:s]) for s in range(len(sizes))]
    for slot in token_lora.unique().tolist():
        if slot < 0:
            continue
        rows = (token_lora == slot).nonzero().flatten()
        xs = x[rows].float()
        for s, (off, size) in enumerate(zip(offsets, sizes)):
            delta = (xs @ lora_a[slot, s].float().T) @ lora_b[slot, s, :size].float().T * scales[slot]
            y[rows, off:off + size] = (y[rows, off:off + size].float() + delta).to(y.dtype)


def torch_method(y, x, lora_a, lora_b, token_lora, scales, sizes, method) -> None:
    from lora import torch_ops
    offsets = [sum(sizes[:s]) for s in range(len(sizes))]
    buffer = torch.empty(len(sizes), x.shape[0], lora_a.shape[2], dtype=torch.float32, device=x.device)
    torch_ops.lora_shrink(x, lora_a, token_lora, scales, buffer, method=method)
    torch_ops.lora_expand(buffer, lora_b, token_lora, y, offsets, sizes, method=method)


def sides(device: str) -> dict:
    """name -> fn(y, x, lora_a, lora_b, token_lora, scales, sizes): every side this machine runs."""
    from lora import cpu_ops, ops

    def backend(name):
        return lambda y, x, a, b, tl, sc, sizes: ops.add_lora_linear(y, x, a, b, tl, sc, sizes, backend=name)

    out = {"naive": naive_lora, "reference": backend("reference"), "torch": backend("torch"),
           "torch bgmv": partial(torch_method, method="bgmv"), "torch sgmv": partial(torch_method, method="sgmv")}
    if device == "cpu" and cpu_ops.is_available():
        out["cpu"] = backend("cpu")
    if device == "cuda":
        out["triton"] = backend("triton")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.layers, args.iters = [16], ["qkv"], 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fns = sides(device)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    rows = []
    for layer in args.layers:
        for T in args.tokens:
            for layout in ["mixed", "grouped"] if T >= 256 else ["mixed"]:
                inp = make_inputs(layer, T, layout, dtype, device)
                expected = inp["y"].clone()
                naive_lora(expected, inp["x"], inp["lora_a"], inp["lora_b"], inp["token_lora"], inp["scales"],
                           inp["sizes"])
                row = dict(layer=layer, tokens=T, layout=layout,
                           adapters_in_batch=int((inp["token_lora"].unique() >= 0).sum()))
                for name, fn in fns.items():
                    if name == "reference" and T > 16:
                        continue
                    y = inp["y"].clone()

                    def run(fn=fn, y=y):
                        y.copy_(inp["y"])
                        fn(y, inp["x"], inp["lora_a"], inp["lora_b"], inp["token_lora"], inp["scales"], inp["sizes"])
                    run()
                    torch.testing.assert_close(y.float(), expected.float(), rtol=tol, atol=tol,
                                               msg=lambda m: f"{name} disagrees with the naive loop: {m}")
                    iters = max(1, args.iters // 10) if name == "reference" else args.iters
                    row[f"{name} us"] = round(1e6 * time_fn(run, warmup=1, iters=iters, reduce=min), 1)
                for name in fns:
                    if f"{name} us" in row and name != "torch":
                        row[f"{name} / torch"] = round(row[f"{name} us"] / row["torch us"], 2)
                for name in fns:
                    if f"{name} us" in row and name != "naive":
                        row[f"{name} / naive"] = round(row[f"{name} us"] / row["naive us"], 2)
                rows.append(row)
                print(row, flush=True)
    from lora import torch_ops
    workload = dict(op="add_lora_linear: y += scale_i (x A_i^T) B_i^T per slice (lora_shrink + lora_expand), "
                       "the base product excluded",
                    model="SmolLM2-135M", hidden=HIDDEN, layers={k: list(v) for k, v in LAYERS.items()},
                    slots=NUM_SLOTS, ranks=list(RANKS), max_rank=max(RANKS), alpha=ALPHA, dtype=args.dtype,
                    device=device, iters=args.iters, threads=torch.get_num_threads(),
                    layouts={"mixed": "each token a random slot or -1 (1 in 9), interleaved",
                             "grouped": "the same mix sorted by slot (prefill-like)"},
                    bgmv_max_tokens=torch_ops.BGMV_MAX_TOKENS,
                    timing="fastest of iters calls (the machine may be shared)",
                    ratio="each side's time / the torch backend's (or / the naive loop's); below 1: faster")
    path = write_result("lora_ops_quick" if args.quick else "lora_ops", workload, rows, args.out_dir)
    return dict(rows=rows, path=path)


if __name__ == "__main__":
    main()
