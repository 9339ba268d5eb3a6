"""CPU layer ops: each decoder layer's small ops as PyTorch runs them (the layers' own forwards,
what HF runs) vs the fused C++ kernels the engine switches to (`kernels_cpu/layer_ops.py`),
on SmolLM2-135M's shapes, in one run.

    python -m benchmarks.bench_cpu_layer_ops            # ~1 min on 2 cores
    python -m benchmarks.bench_cpu_layer_ops --smoke    # two row counts, seconds
    python -m benchmarks.bench_cpu_layer_ops --engine-rounds 2   # + the engine A/B, ~5 min more

Per row count (the tokens of one step: 1-64 in decode, 512-4096 in prefill chunks), the time of
one decoder layer's non-GEMM, non-attention work: two RMSNorms with the residual add, SiLU-and-mul
of the MLP, and the split of qkv into q/k/v with RoPE on q and k; fp32, medians of interleaved
repeats. Both sides are checked to agree first. Writes benchmarks/results/cpu_layer_ops.json.

--engine-rounds N: the same through the engine (SmolLM2 fp32, bench_engine's 64 prompts of real
text): two LLMs, `cpu_layer_ops="auto"` and `"torch"`, timed interleaved N rounds on a prefill-only
run (max_tokens=1) and a decode-heavy one (prompts cut to 32 tokens, 128 outputs), greedy tokens
compared; the ratio per round is what the fused ops buy in the engine.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, write_result

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64          # SmolLM2-135M


def make_layer_ops(fused: bool):
    """One decoder layer's small ops, as the model runs them bound to forward_native / forward_cpu."""
    from paged_attention.model.layers import RMSNorm, SiluAndMul

    g = torch.Generator().manual_seed(1)                 # the same weights on both sides
    norms = [RMSNorm(HIDDEN, 1e-5) for _ in range(2)]
    for norm in norms:
        norm.weight.data = torch.rand(HIDDEN, generator=g) + 0.5
    act = SiluAndMul()
    for module in (*norms, act):
        module.dispatch_forward("cpu" if fused else "native")

    def split_rope(qkv, cos, sin):
        if fused:
            from kernels_cpu import layer_ops as cpu_layer_ops
            return cpu_layer_ops.rope_split_qkv(qkv, cos.view(len(qkv), -1), sin.view(len(qkv), -1),
                                                HEADS, KV_HEADS, HEAD_DIM)
        from paged_attention.model.layers import apply_rotary_emb
        T = qkv.shape[0]
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        return (apply_rotary_emb(q.view(T, HEADS, HEAD_DIM), cos, sin),
                apply_rotary_emb(k.view(T, KV_HEADS, HEAD_DIM), cos, sin), v.reshape(T, KV_HEADS, HEAD_DIM))

    def run(x, residual, qkv, gate_up, cos, sin):
        h, residual = norms[0](x, residual)               # input_layernorm (+ the residual add)
        q, k, v = split_rope(qkv, cos, sin)               # inside the attention block
        h, residual = norms[1](x, residual)               # post_attention_layernorm
        return act(gate_up), q, k, v, h, residual

    return run


def inputs(m: int, seed: int = 0):
    from paged_attention.model.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(HEAD_DIM, 8192, 1e5, None, torch.float32)
    cos, sin = rope.cos_sin(torch.randint(0, 8192, (m,), generator=g))
    return (torch.randn(m, HIDDEN, generator=g), torch.randn(m, HIDDEN, generator=g),
            torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g), torch.randn(m, 2 * INTER, generator=g),
            cos, sin)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--engine-rounds", type=int, default=0, help="also the engine A/B, this many rounds (SmolLM2)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.repeats = [1, 64], 2

    from kernels_cpu import layer_ops as cpu_layer_ops

    if not cpu_layer_ops.is_available():
        raise SystemExit(f"the CPU layer ops cannot be built here: {cpu_layer_ops.unavailable_reason()}")
    sides = {"torch layers": make_layer_ops(fused=False), "fused C++": make_layer_ops(fused=True)}
    rows_out = []
    for m in args.rows:
        x = inputs(m)
        fresh = lambda: [t.clone() for t in x]                # the residual is updated in place
        outs = {name: run(*fresh()) for name, run in sides.items()}
        for a, b in zip(*outs.values()):                     # same numbers first (fp32 rounding)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        samples = {name: [] for name in sides}
        inner = max(1, 256 // max(1, m // 16))
        for _ in range(args.repeats):                         # interleaved: both see the same machine state
            for name, run in sides.items():
                args_ = fresh()
                run(*args_)
                t0 = time.perf_counter()
                for _ in range(inner):
                    run(*args_)
                samples[name].append((time.perf_counter() - t0) / inner)
        med = {name: statistics.median(v) for name, v in samples.items()}
        row = dict(rows=m, **{f"{name} us": round(1e6 * t, 1) for name, t in med.items()},
                   speedup=round(med["torch layers"] / med["fused C++"], 2),
                   per_step_saved_ms_30_layers=round(30 * 1e3 * (med["torch layers"] - med["fused C++"]), 2))
        rows_out.append(row)
        print(row, flush=True)
    workload = dict(model="SmolLM2-135M shapes (hidden 576, intermediate 1536, 9/3 heads of 64)", dtype="float32",
                    ops="2 x RMSNorm with residual add, SiLU-and-mul, qkv split + RoPE on q and k (one layer)",
                    repeats=args.repeats, threads=torch.get_num_threads())
    if args.engine_rounds:
        from benchmarks.bench_engine import engine_ab
        workload["engine_ab"] = engine_ab({"fused": {}, "torch": dict(cpu_layer_ops="torch")}, args.engine_rounds)
    path = write_result("cpu_layer_ops_smoke" if args.smoke else "cpu_layer_ops", workload, rows_out, args.out_dir)
    return dict(rows=rows_out, path=path)


if __name__ == "__main__":
    main()
