"""Structured output's token mask: our backends of `apply_token_bitmask_inplace` vs xgrammar's CPU op
(what vLLM calls on a CPU), same logits, same masks, one run.

    python -m benchmarks.bench_token_bitmask            # a few seconds
    python -m benchmarks.bench_token_bitmask --smoke    # batch 1 only, one timing (tests)

Workload: fp32 logits [batch, 49152] (SmolLM2's vocabulary), batch 1, 8, 64, one packed int32
mask row per logits row (1536 words), no indices. Three kinds of mask, as a grammar makes them:
    permissive  98% of tokens allowed (inside a JSON string: almost every word is -1)
    strict      0.2% allowed (after `{"`: almost every word is 0)
    random      50% allowed (no word is all-allowed or all-forbidden: the kernels' slow path)
Sides: "reference" (unpack to bools, a Python loop over rows), "torch" (vectorised), "cpu" (our
C++ kernel), "xgrammar" (xgrammar 0.2.8's C++ CPU kernel); "triton" only on a GPU (the
interpreter's time means nothing). Every side is checked against xgrammar first (same bits).
The op is idempotent (a -inf stays -inf, and the kernels decide from the mask, not the logits),
so each side is timed on the same tensor again and again. Medians of `--iters` calls; the ratio
is each side's time over xgrammar's. Writes benchmarks/results/token_bitmask.json.
"""
from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, time_fn, write_result

VOCAB = 49152            # SmolLM2-135M
ALLOWED_FRACTION = {"permissive": 0.98, "strict": 0.002, "random": 0.5}


def make_inputs(batch: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    from structured_output.reference import pack_bitmask

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, VOCAB, generator=g)
    allowed = torch.rand(batch, VOCAB, generator=g) < ALLOWED_FRACTION[kind]
    return logits, pack_bitmask(allowed)


def sides(device: str) -> dict:
    """name -> (device, fn(logits, bitmask)): every side this machine runs."""
    from functools import partial

    import xgrammar as xgr

    from structured_output import cpu_ops, ops

    out = {name: ("cpu", partial(ops.apply_token_bitmask_inplace, backend=name)) for name in ("reference", "torch")}
    if cpu_ops.is_available():
        out["cpu"] = ("cpu", partial(ops.apply_token_bitmask_inplace, backend="cpu"))
    if device == "cuda":
        out["triton (cuda)"] = ("cuda", partial(ops.apply_token_bitmask_inplace, backend="triton"))
    out["xgrammar"] = ("cpu", partial(xgr.apply_token_bitmask_inplace, backend="cpu"))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--kinds", nargs="+", default=list(ALLOWED_FRACTION), choices=list(ALLOWED_FRACTION))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.iters = [1], 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fns = sides(device)
    rows = []
    for batch in args.batch:
        for kind in args.kinds:
            logits, mask = make_inputs(batch, kind)
            expected = logits.clone()
            fns["xgrammar"][1](expected, mask)
            row = dict(batch=batch, mask=kind)
            for name, (dev, fn) in fns.items():
                lg, mk = logits.to(dev, copy=True), mask.to(dev)
                run = lambda: fn(lg, mk)                  # noqa: E731
                run()
                assert torch.equal(lg.cpu(), expected), f"{name} disagrees with xgrammar ({kind}, batch {batch})"
                iters = max(1, args.iters // 10) if name == "reference" else args.iters
                row[f"{name} us"] = round(1e6 * time_fn(run, warmup=1, iters=iters), 1)
            for name in fns:
                if name != "xgrammar":
                    row[f"{name} / xgrammar"] = round(row[f"{name} us"] / row["xgrammar us"], 2)
            rows.append(row)
            print(row, flush=True)
    workload = dict(op="apply_token_bitmask_inplace (logits[b, t] = -inf where the packed mask forbids t)",
                    vocab=VOCAB, model_vocab="SmolLM2-135M", dtype="float32", device=device, indices=None,
                    masks={k: f"{100 * v:g}% of tokens allowed" for k, v in ALLOWED_FRACTION.items()},
                    iters=args.iters, threads=torch.get_num_threads(),
                    ratio="each side's median time / xgrammar's (below 1: faster than xgrammar)",
                    xgrammar=importlib.metadata.version("xgrammar"))
    path = write_result("token_bitmask_smoke" if args.smoke else "token_bitmask", workload, rows, args.out_dir)
    return dict(rows=rows, path=path)


if __name__ == "__main__":
    main()
