"""How fast could any engine run the `bench_engine` workload on this CPU? A per-step roofline.

    python -m benchmarks.cpu_roofline            # ~3 min on 2 cores (measures, then runs the workload once)
    python -m benchmarks.cpu_roofline --smoke    # tiny random model, seconds (CI)

The physics of one engine step, for the step the scheduler actually made (the same engine
settings and workload as `python -m benchmarks.bench_engine`: SmolLM2-135M fp32, 64 requests,
prompts 32-512 tokens of real text, outputs 16-256, ignore_eos, greedy):

  FLOPs  = 2 * P_linear * T             every scheduled token through every projection and MLP
         + 2 * V * H * S                the LM head, for the S rows that sample
         + 4 * n_heads * d * sum_t ctx_t  QK^T and PV: each new token attends to its context
  bytes  = P_linear * e  (+ V * H * e when S > 0)   every weight read once per step
         + 2 * L * n_kv * d * e * (sum_i ctx_i + T) the K/V each request reads, plus what it writes

  t_min(step) = max(FLOPs / peak FLOP/s, bytes / bandwidth)

`peak FLOP/s` is the best this CPU reaches on fp32 GEMM here (torch.mm on large square
matrices and on the model's own shapes, all threads), `bandwidth` the best read rate of a
tensor much larger than the caches. Activations, softmax, norms and Python are left out, so
the sum of t_min is a lower bound no engine beats on this machine: the limit the issue asks
to state. The engine's measured wall time of the same run is reported beside it, and, when
`engine_cpu.json` in the output directory has the same workload, ours and vLLM's tok/s from there.
Writes benchmarks/results/cpu_roofline.json.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import (MAX_NUM_BATCHED_TOKENS, NUM_REQUESTS, OUTPUT_LEN, PROMPT_LEN,
                                    SMOKE_KV_CACHE_MEMORY, make_workload, tiny_model_dir)
from benchmarks.common import RESULTS_DIR, environment, time_fn


# ---------------------------------------------------------------------------------- the machine
def measure_peak_flops(hidden: int, intermediate: int, repeats: int = 20) -> dict:
    """fp32 GEMM FLOP/s: large squares, and the model's MLP shape at 2048 rows through torch.mm
    and through the engine's own oneDNN packed linear; the best of all is the peak. (This VM's
    speed drifts by tens of percent over minutes: many repeats, the fastest kept.)"""
    from kernels_cpu.gemm import onednn_available, pack_weight, packed_linear

    shapes = {"mm 2048^3": (2048, 2048, 2048), "mm 4096x4096x1024": (4096, 1024, 4096),
              f"mlp 2048x{hidden}->{2 * intermediate}": (2048, hidden, 2 * intermediate)}
    out = {}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k), torch.randn(k, n)
        out[name] = 2 * m * k * n / time_fn(lambda: torch.mm(a, b), warmup=1, iters=repeats, reduce=min)
    if onednn_available():
        m, k, n = 2048, hidden, 2 * intermediate
        x, w = torch.randn(m, k), pack_weight(torch.randn(n, k))
        out[f"packed mlp 2048x{hidden}->{2 * intermediate}"] = 2 * m * k * n / time_fn(
            lambda: packed_linear(x, w, None), warmup=1, iters=repeats, reduce=min)
    out["peak"] = max(out.values())
    return out


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth (bytes/s): summing a 1 GiB fp32 tensor reads every byte once."""
    x = torch.ones(num_bytes // 4)
    return num_bytes / time_fn(lambda: x.sum(), warmup=1, iters=repeats, reduce=min)


# ---------------------------------------------------------------------------------- one step's physics
def step_cost(attn_metadata, num_sampling_rows: int, shape: dict) -> tuple[float, float]:
    """(FLOPs, bytes) of one step from its attention metadata (seq_lens, query_start_loc)."""
    seq_lens = attn_metadata.seq_lens.long()                                   # [R] context after this step
    q_lens = attn_metadata.query_start_loc.long().diff()                       # [R] new tokens
    num_tokens = int(q_lens.sum())
    # The j-th new token of a request (0-based) sees seq_len - q_len + j + 1 positions (causal).
    ctx_sum = int((q_lens * (seq_lens - q_lens) + q_lens * (q_lens + 1) // 2).sum())
    e, s = shape["bytes_per_element"], shape
    flops = (2 * s["linear_params"] * num_tokens + 2 * s["vocab"] * s["hidden"] * num_sampling_rows
             + 4 * s["num_heads"] * s["head_dim"] * ctx_sum * s["num_layers"])
    kv_per_token = 2 * s["num_layers"] * s["num_kv_heads"] * s["head_dim"] * e
    weight_bytes = s["linear_params"] * e + (s["vocab"] * s["hidden"] * e if num_sampling_rows else 0)
    kv_bytes = kv_per_token * (int(seq_lens.sum()) + num_tokens)
    return flops, weight_bytes + kv_bytes


def model_shape(llm) -> dict:
    """Sizes the cost model needs, read from the loaded model."""
    hf = llm.llm_engine.model_config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    # From the config, not from the module: oneDNN packing keeps the weights in its own layout.
    h, q, kv = hf.hidden_size, hf.num_attention_heads * head_dim, hf.num_key_value_heads * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * hf.intermediate_size     # qkv, o, gate_up, down
    linear = per_layer * hf.num_hidden_layers
    return dict(linear_params=linear, vocab=hf.vocab_size, hidden=hf.hidden_size, num_layers=hf.num_hidden_layers,
                num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads, head_dim=head_dim,
                bytes_per_element=4)


def traced_run(llm, workload) -> tuple[float, list[tuple[int, float, float]]]:
    """Run the workload greedily, stepping the engine by hand: (wall seconds, per step
    (num_tokens, FLOPs, bytes)). Reading the metadata costs microseconds per step."""
    from mini_vllm import SamplingParams
    from mini_vllm.step_trace import ModelInputsTrace

    engine, shape = llm.llm_engine, model_shape(llm)
    assert llm.reset_prefix_cache()
    for i, (prompt, n) in enumerate(workload):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                         detokenize=False), prompt_token_ids=prompt)
    steps = []
    t0 = time.perf_counter()
    with ModelInputsTrace(engine) as trace:
        while engine.has_unfinished_requests():
            engine.step()
            inputs = trace.inputs_of(engine.last_step.scheduler_output)
            if inputs is not None:
                flops, nbytes = step_cost(inputs.attn_metadata, len(inputs.logits_indices), shape)
                steps.append((int(inputs.input_ids.shape[0]), flops, nbytes))
    return time.perf_counter() - t0, steps


def engine_cpu_peers(args) -> dict:
    """ours / vLLM tok/s from bench_engine's results in the same --out-dir (so a run kept apart,
    e.g. from another machine, pairs with its own engine run), when they are of this workload."""
    path = args.out_dir / "engine_cpu.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    wl = data.get("workload", {})
    if wl.get("num_requests") != args.num_requests or list(wl.get("prompt_len", [])) != list(args.prompt_len):
        return {}
    return {"source": str(path), "date": data.get("environment", {}).get("date"),
            "greedy_tokens_per_s": {name: r["output_tokens_per_s"] for r in data.get("rows", [])
                                    for name in [r["name"]] if not name.endswith(", sampled")}}


def main(argv: list[str] | None = None) -> dict:
    from mini_vllm import LLM, default_model_path
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=PROMPT_LEN)
    ap.add_argument("--output-len", type=int, nargs=2, default=OUTPUT_LEN)
    ap.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 4 short requests")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            model_dir = tiny_model_dir(Path(tmp))
            args.num_requests, args.prompt_len, args.output_len = 4, (8, 24), (4, 8)
        else:
            model_dir = default_model_path()
        workload = make_workload(AutoTokenizer.from_pretrained(model_dir), args.num_requests, tuple(args.prompt_len),
                                 tuple(args.output_len))
        llm = LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=len(workload),
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory=SMOKE_KV_CACHE_MEMORY if args.smoke else None)      # None: the CPU default
        shape = model_shape(llm)
        flops_peak = measure_peak_flops(shape["hidden"], llm.llm_engine.model_config.hf_config.intermediate_size,
                                        repeats=2 if args.smoke else 20)
        bandwidth = measure_bandwidth(1 << 26 if args.smoke else 1 << 30, repeats=2 if args.smoke else 5)
        seconds, steps = traced_run(llm, workload)
    output_tokens = sum(n for _, n in workload)
    compute_s = sum(f for _, f, _ in steps) / flops_peak["peak"]
    memory_s = sum(b for _, _, b in steps) / bandwidth
    bound_s = sum(max(f / flops_peak["peak"], b / bandwidth) for _, f, b in steps)
    result = {
        "environment": environment(),
        "workload": dict(model="tiny random llama (smoke)" if args.smoke else "SmolLM2-135M-Instruct", dtype="float32",
                         num_requests=args.num_requests, prompt_len=list(args.prompt_len),
                         output_len=list(args.output_len), output_tokens=output_tokens, greedy=True,
                         command="python -m benchmarks.cpu_roofline" + (" --smoke" if args.smoke else "")),
        "machine": dict(gemm_flops_per_s={k: round(v / 1e9, 1) for k, v in flops_peak.items()},
                        gemm_unit="GFLOP/s fp32", read_bandwidth_gb_per_s=round(bandwidth / 1e9, 2)),
        "model_shape": shape,
        "steps": len(steps),
        "total_gflop": round(sum(f for _, f, _ in steps) / 1e9, 1),
        "total_gb_moved": round(sum(b for _, _, b in steps) / 1e9, 1),
        "seconds_if_only_compute": round(compute_s, 4),
        "seconds_if_only_memory": round(memory_s, 4),
        "roofline_seconds": round(bound_s, 4),
        "roofline_output_tokens_per_s": round(output_tokens / bound_s, 1),
        "ours_traced_seconds": round(seconds, 4),
        "ours_traced_output_tokens_per_s": round(output_tokens / seconds, 1),
        "ours_fraction_of_roofline": round(bound_s / seconds, 3),
        "bench_engine_same_workload": engine_cpu_peers(args),
    }
    name = "cpu_roofline_smoke" if args.smoke else "cpu_roofline"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("environment", "model_shape")}, indent=1))
    return result


if __name__ == "__main__":
    main()
