"""The first measurement of Triton decode launch configs on a GPU (H200, 2026-11-28): chapter 01's
v1 decode kernel (`triton_ops._paged_decode_kernel`, `version="v1"`) launched with every (tile,
num_warps, num_stages[, num_kv_splits]) of a grid, against PyTorch SDPA on contiguous K/V and the
CUDA v1/v2 kernels, bf16, Llama-3-8B attention shapes (bench_paged_attention's workload).

    python -m benchmarks.triton_decode_launch_probe [OUT.json] [SECONDS]   # GPU only

(The run itself, before `paged_decode_attention` took num_warps / num_stages, passed them to the
same kernel by wrapping its launcher.) It set the decode defaults that exist now (chapter 01 DECODE_NUM_STAGES, chapter 05's pure-decode
DECODE_TILE_N / DECODE_NUM_STAGES) and wrote benchmarks/results/triton_decode_sweep_h200.json.
Kept as that file's reproducer; `python -m benchmarks.bench_paged_attention --sweep` is its
successor (it also sweeps the v2 rung, times in CUDA graphs, and compiles in parallel).
Stops after the shape during which SECONDS (default 100) ran out.
"""
from __future__ import annotations

import itertools
import json
import sys
import time

import torch

from benchmarks.bench_paged_attention import HEAD_DIM, make_workload, sdpa_decode
from benchmarks.common import RESULTS_DIR, environment, time_fn

SHAPES = [(32, 2048), (256, 1024), (128, 8192), (1, 32768), (8, 8192), (128, 2048)]   # (batch, context)


def launch_grid(batch: int) -> list[tuple]:
    """(tile, num_warps, num_stages, num_kv_splits or None = the wrapper's choice)."""
    grid = list(itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (None,)))
    grid += [(t, 4, s, sp) for t in (32, 64) for s in (2, 3) for sp in ((8, 16, 32, 64, 128) if batch <= 8 else (1, 2))]
    return grid


def main(out_path: str, budget_s: float) -> None:
    from paged_attention import cuda_ops, triton_ops

    scale, rows, t_start = HEAD_DIM ** -0.5, [], time.time()
    for batch, ctx in SHAPES:
        q, kc, vc, bt, sl, kd, vd = make_workload(batch, ctx, torch.bfloat16, "cuda")
        nbytes = 2 * kd.numel() * kd.element_size()
        ref = sdpa_decode(q, kd, vd, scale)
        t = time_fn(lambda: sdpa_decode(q, kd, vd, scale), warmup=2, iters=5)
        rows.append(dict(batch=batch, ctx=ctx, impl="sdpa", ms=t * 1e3, gbps=nbytes / t / 1e9))
        for version in ("v1", "v2"):
            if version == "v1" and ctx > cuda_ops.V1_MAX_SEQ_LEN:
                continue
            try:
                f = lambda: cuda_ops.paged_decode_attention(q, kc, vc, bt, sl, scale, False, max_seq_len=ctx,
                                                            version=version)
                torch.testing.assert_close(f(), ref, atol=3e-2, rtol=3e-2)
                t = time_fn(f, warmup=2, iters=5)
                rows.append(dict(batch=batch, ctx=ctx, impl=f"cuda {version}", ms=t * 1e3, gbps=nbytes / t / 1e9))
            except Exception as e:                     # recorded, never a time
                rows.append(dict(batch=batch, ctx=ctx, impl=f"cuda {version}", error=repr(e)[:300]))
        for tile, warps, stages, split in launch_grid(batch):
            name = f"triton tile{tile} w{warps} s{stages} split{split}"
            try:
                f = lambda: triton_ops.paged_decode_attention(q, kc, vc, bt, sl, scale, False, max_seq_len=ctx,
                                                              version="v1", tile=tile, num_warps=warps,
                                                              num_stages=stages, num_kv_splits=split)
                torch.testing.assert_close(f(), ref, atol=3e-2, rtol=3e-2)
                t = time_fn(f, warmup=1, iters=4)
                rows.append(dict(batch=batch, ctx=ctx, impl=name, tile=tile, warps=warps, stages=stages, split=split,
                                 ms=t * 1e3, gbps=nbytes / t / 1e9))
            except Exception as e:
                rows.append(dict(batch=batch, ctx=ctx, impl=name, error=repr(e)[:200]))
        del q, kc, vc, bt, sl, kd, vd
        torch.cuda.empty_cache()
        print(f"shape {batch}x{ctx} done at {time.time() - t_start:.0f}s", flush=True)
        if time.time() - t_start > budget_s:
            print("time budget reached")
            break
    json.dump(dict(env=environment(), rows=rows), open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(RESULTS_DIR / "triton_decode_sweep_h200.json"),
         float(sys.argv[2]) if len(sys.argv) > 2 else 100.0)
