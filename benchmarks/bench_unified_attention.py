"""Chapter 05: unified (mixed-batch) paged attention, side by side in one run.

    .venv/bin/python -m benchmarks.bench_unified_attention              # CPU: reference / torch / SDPA peers
    .venv/bin/python -m benchmarks.bench_unified_attention --sweep-rows # + kv_rows_per_batch sweep
    python -m benchmarks.bench_unified_attention                        # on a GPU: + the Triton kernel

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64), fp32 on
the CPU (bf16 on a GPU), block_size 16, physical blocks shuffled. Workloads:
  decode  64 requests x 1 new token, contexts uniform in [32, 768] (the engine's batch)
  mixed   60 decodes (contexts 32..768) + a 256-token chunk after 512 cached tokens
          + a fresh 128-token prompt: one chunked-prefill step
  prefill 4 fresh prompts of 256 tokens

Peers, timed in the same run on the same tensors:
  reference     the per-request loop (attention_reference.py)
  sdpa_dense    ONE SDPA call on contiguous K/V padded to [num_seqs, kvh, max_seq_len, d]
                (queries padded to max_query_len, offset-causal + padding mask): what a
                non-paged engine with a static per-request cache does; the K/V are built
                before timing, so it pays no gather
  sdpa_loop     one SDPA call per request on its contiguous K/V (offset-causal mask)
  torch         ours, attention_vectorized.py (backend="torch"), planning its sub-batches in the call
  torch+plan    the same with the step's plan prebuilt (plan=build_plan(...)): what each layer
                pays once the engine builds the plan once per step
  build_plan    the plan alone (paid once per step, not per layer)
  triton        ours, triton_ops.py (backend="triton"; GPU only, the interpreter is no timing)
"Useful GB/s" = K/V bytes a request really owns (sum of seq_lens) / time. Each time is
the best of --rounds medians of --iters calls, implementations interleaved. Per workload
the table ends with the attention cost of one engine step of --layers layers (SmolLM2: 30),
without the plan (every layer plans) and with it (one plan + the per-layer execution).
The paged batches come from chapter 01's synthetic paged K/V (`make_paged_batch`).
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS_DIR, time_fn, write_result
from chunked_prefill import attention_reference, attention_vectorized
from chunked_prefill.ops import unified_attention
from paged_attention.synthetic import make_paged_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def workloads(seed: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query_lens, context_lens)."""
    rng = random.Random(seed)
    decode_ctx = [rng.randint(32, 768) for _ in range(64)]
    return {
        "decode": ([1] * 64, decode_ctx),
        "mixed": ([1] * 60 + [256, 128], decode_ctx[:60] + [512, 0]),
        "prefill": ([256] * 4, [0] * 4),
    }


def build(query_lens, context_lens, dtype, device, seed=0):
    """A paged batch (shuffled blocks) and its dense twin (contiguous per-request K/V):
    chapter 01's synthetic paged K/V, zeros in unused slots."""
    b = make_paged_batch(query_lens, context_lens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, device,
                         seed=seed, junk=0.0, num_spare_blocks=0)
    paged = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc)
    return paged, b.keys, b.values


def offset_causal_mask(q_len: int, seq_len: int, device) -> torch.Tensor:   # [q_len, seq_len] bool
    return torch.arange(seq_len, device=device)[None, :] <= torch.arange(seq_len - q_len, seq_len, device=device)[:, None]


def sdpa_dense_peer(query, query_lens, keys, values, scale):
    """Pad everything into dense tensors once (not timed). Returns (the one-call SDPA to
    time, a function that unpads its output to [num_tokens, h, d] for the check)."""
    n, max_q, max_s = len(keys), max(query_lens), max(k.shape[0] for k in keys)
    dev, dt = query.device, query.dtype
    k_pad = torch.zeros(n, NUM_KV_HEADS, max_s, HEAD_DIM, dtype=dt, device=dev)
    v_pad = torch.zeros_like(k_pad)
    q_pad = torch.zeros(n, NUM_HEADS, max_q, HEAD_DIM, dtype=dt, device=dev)
    mask = torch.zeros(n, 1, max_q, max_s, dtype=torch.bool, device=dev)
    mask[:, :, :, 0] = True                    # padded query rows see key 0 (their output is dropped)
    start = 0
    for i, (k, v, q_len) in enumerate(zip(keys, values, query_lens)):
        s = k.shape[0]
        k_pad[i, :, :s] = k.transpose(0, 1)
        v_pad[i, :, :s] = v.transpose(0, 1)
        q_pad[i, :, :q_len] = query[start:start + q_len].transpose(0, 1)
        mask[i, 0, :q_len, :s] = offset_causal_mask(q_len, s, dev)
        start += q_len

    def unpad(out):                            # [n, h, max_q, d] -> [num_tokens, h, d]
        return torch.cat([out[i, :, :q_len].transpose(0, 1) for i, q_len in enumerate(query_lens)])
    return lambda: F.scaled_dot_product_attention(q_pad, k_pad, v_pad, attn_mask=mask, scale=scale,
                                                  enable_gqa=True), unpad


def sdpa_loop_peer(query, query_lens, keys, values, scale):
    """One SDPA call per request on contiguous [1, kvh, seq_len, d] K/V (built untimed)."""
    calls, start = [], 0
    for q_len, k, v in zip(query_lens, keys, values):
        q = query[start:start + q_len].transpose(0, 1)[None]                # [1, h, q_len, d]
        start += q_len
        s = k.shape[0]
        mask = None if q_len == 1 or q_len == s else offset_causal_mask(q_len, s, query.device)
        calls.append((q, k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(),
                      mask, q_len == s and q_len > 1))

    def run():
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=scale, enable_gqa=True)
                for q, k, v, m, causal in calls]
    return run


def interleaved_times(fns: dict, rounds: int, iters: int) -> dict[str, float]:
    """Best of `rounds` medians, the implementations taking turns within each round, so a
    burst of load on a shared machine hits all of them rather than one."""
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            samples[k].append(time_fn(f, warmup=1, iters=iters))
    return {k: min(v) for k, v in samples.items()}


def bench_workload(name, query_lens, context_lens, dtype, device, backends, rounds, iters, layers):
    paged, keys, values = build(query_lens, context_lens, dtype, device)
    scale = HEAD_DIM ** -0.5
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    meta = dict(max_query_len=max(query_lens), max_seq_len=max(seq_lens), check_values=False)
    expected = attention_reference.unified_attention(*paged, scale).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2

    def check(out):                                       # time only right answers, peers included
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    dense, unpad = sdpa_dense_peer(paged[0], query_lens, keys, values, scale)
    loop = sdpa_loop_peer(paged[0], query_lens, keys, values, scale)
    check(unpad(dense()))
    check(torch.cat([o[0].transpose(0, 1) for o in loop()]))
    fns = {"reference": lambda: attention_reference.unified_attention(*paged, scale, check_values=False),
           "sdpa_dense": dense, "sdpa_loop": loop}
    for backend in backends:
        check(unified_attention(*paged, scale, backend=backend, **meta))
        fns[backend] = lambda b=backend: unified_attention(*paged, scale, backend=b, **meta)
    if "torch" in backends:
        block_tables, seq_lens_t, query_start_loc = paged[3:]
        plan_fn = lambda: attention_vectorized.build_plan(block_tables, seq_lens_t, query_start_loc, BLOCK_SIZE)  # noqa: E731
        plan = plan_fn()
        check(unified_attention(*paged, scale, backend="torch", plan=plan, **meta))
        fns["torch+plan"] = lambda: unified_attention(*paged, scale, backend="torch", plan=plan, **meta)
        fns["build_plan"] = plan_fn
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * paged[1].element_size()
    times = interleaved_times(fns, rounds, iters)
    rows = []
    for impl, t in times.items():
        row = dict(workload=name, impl=impl, ms=round(t * 1e3, 3))
        if impl != "build_plan":
            row.update(useful_gb_s=round(kv_bytes / t / 1e9, 2), speedup_vs_reference=round(times["reference"] / t, 2),
                       ratio_vs_sdpa_dense=round(t / times["sdpa_dense"], 2))
        rows.append(row)
    if "torch" in backends:
        # One engine step: every layer planning for itself vs one plan + per-layer execution.
        rows.append(dict(workload=name, impl=f"torch, {layers} layers, plan per layer",
                         ms=round(layers * times["torch"] * 1e3, 3)))
        rows.append(dict(workload=name, impl=f"torch, {layers} layers, one plan per step",
                         ms=round((times["build_plan"] + layers * times["torch+plan"]) * 1e3, 3),
                         speedup_vs_plan_per_layer=round(layers * times["torch"]
                                                         / (times["build_plan"] + layers * times["torch+plan"]), 2)))
    return rows


def sweep_rows(dtype, device, rounds, iters):
    query_lens, context_lens = workloads()["decode"]
    paged, _, _ = build(query_lens, context_lens, dtype, device)
    fns = {r: (lambda r=r: attention_vectorized.unified_attention(*paged, HEAD_DIM ** -0.5, check_values=False,
                                                                  kv_rows_per_batch=r))
           for r in (256, 1024, 2048, 4096, 8192, 16384, 65536)}
    return [dict(workload="decode", impl=f"torch kv_rows_per_batch={r}", ms=round(t * 1e3, 3))
            for r, t in interleaved_times(fns, rounds, iters).items()]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["workload"] for r in rows if "speedup_vs_reference" in r))
    impls = list(dict.fromkeys(r["impl"] for r in rows if "speedup_vs_reference" in r))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        ms = [next(r["ms"] for r in rows if r["workload"] == w and r["impl"] == impl) for w in names]
        ax.bar([i + j * width for i in range(len(names))], ms, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("ms per call (lower is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("unified attention, SmolLM2 shapes (9/3 heads, d=64)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep-rows", action="store_true", help="also time kv_rows_per_batch choices (decode)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--layers", type=int, default=30, help="layers per engine step for the per-step rows (SmolLM2: 30)")
    ap.add_argument("--workloads", default="decode,mixed,prefill", help="comma-separated subset of the workloads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    backends = ["torch", "triton"] if cuda else ["torch"]
    rows = []
    chosen = args.workloads.split(",")
    for name, (query_lens, context_lens) in workloads().items():
        if name in chosen:
            rows += bench_workload(name, query_lens, context_lens, dtype, device, backends, args.rounds, args.iters,
                                   args.layers)
    if args.sweep_rows:
        rows += sweep_rows(dtype, device, args.rounds, args.iters)
    print(f"{'workload':8} {'impl':38} {'ms':>9} {'useful GB/s':>11} {'x ref':>7} {'/ sdpa_dense':>12} {'x plan/layer':>12}")
    for r in rows:
        print(f"{r['workload']:8} {r['impl']:38} {r['ms']:9.3f} {r.get('useful_gb_s', ''):>11} "
              f"{r.get('speedup_vs_reference', ''):>7} {r.get('ratio_vs_sdpa_dense', ''):>12} "
              f"{r.get('speedup_vs_plan_per_layer', ''):>12}")
    name = "unified_attention_gpu" if cuda else "unified_attention_cpu"
    workload = dict(model="SmolLM2-135M attention shapes", num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                    head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=str(dtype), device=device,
                    workloads={k: dict(query_lens=q, context_lens=c) for k, (q, c) in workloads().items()},
                    threads=torch.get_num_threads(),
                    # other processes on a shared machine distort CPU timings: say how busy it was
                    load_average_1min=dict(before=round(load_before, 2), after=round(os.getloadavg()[0], 2)),
                    command="python -m benchmarks.bench_unified_attention " + " ".join(argv if argv is not None else sys.argv[1:]))
    path = write_result(name, workload, rows)
    plot(rows, RESULTS_DIR / f"{name}.png")
    print(f"wrote {path} and {name}.png")


if __name__ == "__main__":
    main()
