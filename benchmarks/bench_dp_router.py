"""Data parallelism: a cache-aware router vs round-robin (and least-loaded) on a multi-tenant workload.

    python -m benchmarks.bench_dp_router                 # SmolLM2, 2 replicas, 8 tenants x 6 users
    python -m benchmarks.bench_dp_router --quick         # fewer users (smoke)

The workload (SGLang's router and llm-d motivate cache-aware routing with exactly this shape): T
tenants, each with its own system prompt (a distinct 192-token slice of real text), and U users per
tenant, each asking a 24-48-token question after that system prompt; 8 output tokens, greedy. The
requests of all tenants are interleaved at random and arrive R per round. The same request order goes
through DPEngine (dp_engine.py: replicas stepped in lockstep, a round costs the slowest replica's
step) once per router, on fresh replicas, in one run, after one untimed pass (warm-up). Each replica's KV pool holds about half of the
tenants' system prompts, so where a tenant's requests go decides how often its prompt is recomputed.

    prefix hit rate   prompt tokens served from a replica's prefix cache / all prompt tokens
    TTFT p50 / p99    lockstep clock at a request's first token minus at its arrival (seconds)
    imbalance         max / mean requests per replica

Writes benchmarks/results/dp_router.json.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys

from benchmarks.common import write_result

ROUTER_NAMES = ("round_robin", "least_loaded", "cache_aware")


def real_text_tokens(tokenizer, n: int) -> list[int]:
    import pydoc_data.topics
    text = " ".join(pydoc_data.topics.topics.values())
    return tokenizer(text[: n * 8]).input_ids[:n]


def make_workload(tokenizer, tenants: int, users: int, system_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    pool = real_text_tokens(tokenizer, tenants * system_len + tenants * users * 48)
    systems = [pool[t * system_len:(t + 1) * system_len] for t in range(tenants)]
    rest, requests = pool[tenants * system_len:], []
    for t in range(tenants):
        for u in range(users):
            start, q = rng.randrange(len(rest) - 48), rng.randrange(24, 49)
            requests.append((t, systems[t] + rest[start:start + q]))
    rng.shuffle(requests)
    return requests


def make_tiny_llama() -> str:
    """A random tiny Llama (the tests' shape: 4 heads, 2 KV heads, 2 layers) with SmolLM2's tokenizer."""
    import tempfile

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mini_vllm.default_model import default_model_path
    path = tempfile.mkdtemp(prefix="tiny-llama-")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(path)
    return path


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def warm_up(dp) -> None:
    """A process's first forwards are several times slower (allocator, kernel builds): run one
    short request on each replica, then forget what it cached."""
    from mini_vllm.sampling_params import SamplingParams
    for i, engine in enumerate(dp.replicas):
        engine.add_request(f"warm{i}", {"prompt_token_ids": list(range(100, 164))},
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.engine_core.kv_cache_manager.reset_prefix_cache()


def run_router(name: str, requests, replicas: int, per_round: int, output_len: int, engine_kwargs: dict) -> tuple[dict, dict]:
    from mini_vllm.dp_engine import DPEngine
    from mini_vllm.sampling_params import SamplingParams

    dp = DPEngine.from_config(replicas, name, **engine_kwargs)
    try:
        warm_up(dp)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        pending = list(enumerate(requests))
        arrival, first, cached, tokens, placed = {}, {}, {}, {}, [0] * replicas
        while pending or dp.has_unfinished_requests():
            for i, (_, prompt) in pending[:per_round]:
                placed[dp.add_request(f"q{i}", {"prompt_token_ids": prompt}, params)] += 1
                arrival[f"q{i}"] = dp.clock
            pending = pending[per_round:]
            for out in dp.step():
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = dp.clock
                if out.finished:
                    cached[out.request_id] = out.num_cached_tokens
                    tokens[out.request_id] = out.outputs[0].token_ids
        ttft = [first[r] - arrival[r] for r in arrival]
        prompt_tokens = sum(len(p) for _, p in requests)
        row = {"router": name, "prefix_hit_rate": round(sum(cached.values()) / prompt_tokens, 4),
               "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_p99_s": round(percentile(ttft, 99), 3),
               "total_s": round(dp.clock, 2), "requests_per_replica": placed,
               "imbalance": round(max(placed) / (sum(placed) / replicas), 3)}
        return row, tokens
    finally:
        dp.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 tenants x 3 users, 4 output tokens (smoke)")
    ap.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true",
                    help="a random 2-layer Llama (hidden 64) with SmolLM2's vocabulary instead: routing and hit "
                         "rates are the model's business not at all, and it runs where SmolLM2 would take long")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoTokenizer
    # One thread: the replicas run one after another here, and on a shared machine two OpenMP threads
    # that lose their cores spin on each other; routing, not thread scaling, is what is compared.
    torch.set_num_threads(args.threads)

    from mini_vllm.default_model import default_model_path
    model = make_tiny_llama() if args.tiny else (args.model or str(default_model_path()))
    tenants, users, system_len, output_len, per_round = (4, 3, 64, 4, 2) if args.quick else (8, 6, 192, 8, 2)
    requests = make_workload(AutoTokenizer.from_pretrained(model), tenants, users, system_len)
    # A pool of about half the tenants' system prompts per replica (+ room for the running requests).
    blocks = (tenants // 2) * (system_len // 16) + 8 * 5
    engine_kwargs = dict(model=model, max_model_len=512, num_gpu_blocks_override=blocks, max_num_seqs=8,
                         cpu_kernels="off" if args.quick else "auto")
    # One untimed pass first: the process's first steps at these shapes are slow (kernel builds and
    # loads, the allocator), and whichever router ran first would pay for them.
    run_router("round_robin", requests, args.replicas, per_round, output_len, engine_kwargs)
    rows, reference = [], None
    for name in ROUTER_NAMES:
        row, tokens = run_router(name, requests, args.replicas, per_round, output_len, engine_kwargs)
        reference = tokens if reference is None else reference
        row["same_tokens_as_round_robin"] = tokens == reference
        rows.append(row)
        print(row, flush=True)
    workload = dict(model="tiny random Llama (2 layers, hidden 64)" if args.tiny else model.rsplit("/", 1)[-1], replicas=args.replicas, tenants=tenants, users_per_tenant=users,
                    system_prompt_tokens=system_len, question_tokens="24-48", output_len=output_len,
                    arrivals_per_round=per_round, kv_blocks_per_replica=blocks, block_size=16, torch_threads=args.threads,
                    clock="lockstep rounds: each round costs the slowest replica's step",
                    warm_up="one untimed round_robin pass over the same requests before the timed ones",
                    command="python -m benchmarks.bench_dp_router" + (" --quick" if args.quick else "")
                    + (" --tiny" if args.tiny else ""))
    path = write_result("dp_router", workload, rows, args.out)
    print(f"wrote {path}")
    return {"rows": rows, "path": str(path)}


if __name__ == "__main__":
    main(sys.argv[1:])
