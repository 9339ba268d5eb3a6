"""One model forward, ours vs HF transformers, on the same tokens — side by side in one run.

    python -m benchmarks.bench_model_forward                  # from the repo root
    python -m benchmarks.bench_model_forward --quick          # fewer iterations
    python -m benchmarks.bench_model_forward --profile        # + both decode steps' top ops (torch.profiler)

Workloads (SmolLM2-135M-Instruct, fp32, on this machine's CPU or GPU):
  * prefill:  one 256-token prompt.           ours: flat [256] + paged cache.  HF: model(ids[1, 256]).
  * decode:   64 requests, 128 tokens of context each, one new token each.
              ours: flat [64] + paged cache (block size 16, shuffled blocks).
              HF: model(ids[64, 1], past_key_values=DynamicCache of 128), the step generate() runs.
Both sides run under torch.inference_mode() with warm-up, *interleaved* (ours, HF, ours, HF, ...)
so that a noisy shared machine slows both alike; the result is the median wall time per forward
and the speed-up HF/ours. HF's cache is cropped back to 128 tokens after every decode call so
every timed call sees the same context; the crop is inside HF's timing (it is cheap: a slice).
Results go to benchmarks/results/model_forward.json.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch


def paired_medians(ours, theirs, warmup: int, iters: int) -> tuple[float, float]:
    """Median seconds of ours() and theirs(), called alternately after `warmup` calls of each."""
    from benchmarks.common import sync

    for _ in range(warmup):
        ours(), theirs()
    samples = ([], [])
    for _ in range(iters):
        for fn, out in ((ours, samples[0]), (theirs, samples[1])):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
    return statistics.median(samples[0]), statistics.median(samples[1])


def print_op_profiles(fns: dict, steps: int = 4, top: int = 8) -> None:
    """Self CPU time per op (ms per call of fn), each fn profiled alone, `steps` calls interleaved."""
    from collections import Counter

    totals = {name: Counter() for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            with torch.profiler.profile() as prof:
                fn()
            for event in prof.key_averages():
                totals[name][event.key] += event.self_cpu_time_total / 1e3 / steps
    for name, ops in totals.items():
        print(f"{name}: {sum(ops.values()):.1f} ms of ops per decode step")
        for op, ms in ops.most_common(top):
            print(f"    {op:<56} {ms:7.1f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF-format directory (default: the converted SmolLM2)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--attn-backend", default="torch")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="also print both decode steps' top ops (torch.profiler)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    from benchmarks.common import time_fn, write_result
    from chunked_prefill.ops import unified_attention
    from paged_attention.ops import reshape_and_cache
    from mini_vllm.default_model import default_model_path
    from mini_vllm.model_inputs import prepare_inputs
    from mini_vllm.models.loader import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = args.model or default_model_path()
    model, config = load_model(path, dtype="float32", device=device, attn_backend=args.attn_backend)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    warmup, iters = (1, 3) if args.quick else (3, 10)
    block_size, rng = 16, random.Random(0)
    rows = []

    def shuffled_blocks(num_reqs: int, tokens_per_req: int) -> list[list[int]]:
        free = list(range(num_blocks))
        rng.shuffle(free)
        n = -(-tokens_per_req // block_size)
        return [[free.pop() for _ in range(n)] for _ in range(num_reqs)]

    with torch.inference_mode():
        # --- prefill: one 256-token prompt ---------------------------------------------------
        num_blocks = 64
        caches = config.kv_cache_spec(block_size).allocate_per_layer(num_blocks, device)
        ids = torch.randint(0, config.vocab_size, (256,), generator=torch.Generator().manual_seed(0)).tolist()
        inp = prepare_inputs([ids], [0], shuffled_blocks(1, len(ids)), block_size, device)
        hf_ids = torch.tensor([ids], device=device)
        ours, theirs = paired_medians(
            lambda: model.compute_logits(model(inp.input_ids, inp.positions, caches, inp.attn_metadata)[inp.logits_indices]),
            lambda: hf(hf_ids, logits_to_keep=1).logits, warmup, iters)
        rows.append(dict(workload="prefill 1x256", ours_ms=ours * 1e3, hf_ms=theirs * 1e3, speedup=theirs / ours))

        # --- decode: 64 requests x 128 tokens of context, one new token each -------------------
        batch, context = 64, 128
        num_blocks = batch * (context // block_size + 1) + 8
        caches = config.kv_cache_spec(block_size).allocate_per_layer(num_blocks, device)
        prompts = torch.randint(0, config.vocab_size, (batch, context + 1), generator=torch.Generator().manual_seed(1))
        blocks = shuffled_blocks(batch, context + 1)
        pre = prepare_inputs(prompts[:, :context].tolist(), [0] * batch, blocks, block_size, device)
        model(pre.input_ids, pre.positions, caches, pre.attn_metadata)          # fill the cache
        step = prepare_inputs(prompts[:, context:].tolist(), [context] * batch, blocks, block_size, device)
        cache = DynamicCache(config=hf.config)
        hf(prompts[:, :context].to(device), past_key_values=cache, use_cache=True)
        next_ids = prompts[:, context:].to(device)

        def hf_decode():
            hf(next_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)                                                     # back to `context` tokens

        def decode_ours():
            model.compute_logits(model(step.input_ids, step.positions, caches, step.attn_metadata)[step.logits_indices])

        ours, theirs = paired_medians(decode_ours, hf_decode, warmup, iters)
        rows.append(dict(workload=f"decode {batch}x1, context {context}", ours_ms=ours * 1e3, hf_ms=theirs * 1e3,
                         speedup=theirs / ours))

        if args.profile:
            print_op_profiles({"ours": decode_ours, "HF": hf_decode})

        # --- where our decode step goes: the paged-attention ops and the lm_head, timed alone -----
        md = step.attn_metadata
        attn = model.model.layers[0].self_attn.attn
        q = torch.randn(batch, config.num_attention_heads, config.head_dim, device=device)
        kv = torch.randn(batch, config.num_key_value_heads, config.head_dim, device=device)
        hidden = torch.randn(batch, config.hidden_size, device=device)
        # One call per layer, each on that layer's own cache, as in the forward (a single hot cache
        # timed 30 times would fit in L2 and flatter the ops).
        breakdown = {
            "cache write (ch01 reshape_and_cache), all layers": time_fn(lambda: [reshape_and_cache(
                kv, kv, k_cache, v_cache, md.slot_mapping, check_values=False, backend=attn.cache_backend)
                for k_cache, v_cache in caches], warmup, iters),
            "unified attention (ch05), all layers": time_fn(lambda: [unified_attention(
                q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, attn.scale,
                backend=attn.attention_backend, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
                check_values=False) for k_cache, v_cache in caches], warmup, iters),
            "lm_head (compute_logits)": time_fn(lambda: model.compute_logits(hidden), warmup, iters),
        }
        breakdown["everything else (GEMMs, norms, RoPE, ...)"] = ours - sum(breakdown.values())
        for part, seconds in breakdown.items():
            rows.append(dict(workload=f"decode {batch}x1 breakdown: {part}", ours_ms=seconds * 1e3,
                             share=seconds / ours))

    for r in rows:
        if "hf_ms" in r:
            print(f"{r['workload']:<28} ours {r['ours_ms']:8.2f} ms   HF {r['hf_ms']:8.2f} ms   speed-up x{r['speedup']:.2f}")
        else:
            print(f"  {r['workload']:<68} {r['ours_ms']:8.2f} ms  ({r['share']:.0%})")
    out = write_result("model_forward", dict(model=str(path), dtype="float32", device=device,
                                             attn_backend=args.attn_backend, block_size=block_size,
                                             warmup=warmup, iters=iters, threads=torch.get_num_threads(),
                                             load_average_after=os.getloadavg()), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
