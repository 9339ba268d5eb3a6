"""A global prefix pool between two engines: hit rate, skipped prefill and TTFT, with and without it.

    python -m benchmarks.bench_global_pool            # SmolLM2, both layers, ~3 min on 2 cores -> results/global_pool.json + .png
    python -m benchmarks.bench_global_pool --quick    # one layer, 2 sessions, a tiny random model (CI)

Two SmolLM2 engines (fp32, CPU): engine A in its own process (`kv_producer`) and engine B in
this one (`kv_consumer`), joined by chapter 06's connector through one of the two layers:
  * scratch  — our metadata server process + our transfer engine (GlobalKVPoolConnector);
  * mooncake — `mooncake_master` + Mooncake's TransferEngine and DistributedStore (MooncakeConnector).
Each session has its own long system prompt (~LONG tokens of chat-formatted text, new to both
engines). A's user asks first (A computes the prompt and publishes its full blocks to the pool);
then B's user asks a different question under the same system prompt. B's time to first
token is measured (a) with the pool — B loads the shared full blocks and computes only the rest —
and (b) without it: an identical engine C with no connector computes everything (what a second
engine pays without a global pool; both are greedy and must give the same tokens).
Reported per layer: hit rate (loaded tokens / B's prompt tokens), skipped prefill tokens, TTFT
median with and without the pool, the ratio, and the load time the connector measured.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS_DIR, write_result

SYSTEM = ("You are the reference librarian of a large technical library. You answer questions about "
          "operating systems, compilers, databases, computer networks and machine learning systems. "
          "Cite the relevant chapter of the standard textbook when you can, keep answers under five "
          "sentences, prefer concrete examples over general statements, and say plainly when the "
          "library holds nothing on a topic. ")
QUESTIONS = [("How does a B-tree stay balanced?", "What is a page fault?"),
             ("Why do compilers use SSA form?", "What does TCP slow start do?"),
             ("What is a paged KV cache?", "How does a log-structured merge tree work?"),
             ("What is copy-on-write?", "Explain the two-phase commit protocol."),
             ("What is speculative decoding?", "How does a bloom filter answer queries?")]
ENGINE_KW = dict(max_model_len=1024, kv_cache_memory=96 << 20, max_num_seqs=4)


def chat(tokenizer, system: str, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def layer_config(layer: str, address: str, role: str, model: str) -> dict:
    extra = {"model": Path(model).name, "load_timeout_s": 60.0, "send_capacity_blocks": 64}
    if layer == "scratch":
        return {"kv_connector": "GlobalKVPoolConnector", "kv_role": role,
                "kv_connector_extra_config": {**extra, "metadata_server": address, "pool_capacity_blocks": 256}}
    return {"kv_connector": "MooncakeConnector", "kv_role": role,
            "kv_connector_extra_config": {**extra, "master_server": address, "global_segment_size": 256 << 20,
                                          "local_buffer_size": 64 << 20}}


def run_layer(layer: str, tokenizer, sessions: int, repeat_system: int, max_tokens: int, model: str) -> dict:
    import torch

    from mini_vllm.engine_process import EngineProcess, run_requests
    from mini_vllm.llm_engine import LLMEngine

    if layer == "scratch":
        from global_prefix_cache.metadata import MetadataServerProcess
        server = MetadataServerProcess()
    else:
        from global_prefix_cache.mooncake_layer import MooncakeMaster
        server = MooncakeMaster()
    a = b = None
    try:
        a = EngineProcess(kv_transfer_config=layer_config(layer, server.address, "kv_producer", model),
                          num_threads=torch.get_num_threads(), model=model, **ENGINE_KW)
        b = LLMEngine(kv_transfer_config=layer_config(layer, server.address, "kv_consumer", model), model=model, **ENGINE_KW)
        c = LLMEngine(model=model, **ENGINE_KW)                        # the same engine, no pool
        rows = []
        for i in range(sessions + 1):                                  # session 0 warms both engines up
            system = f"Session {i}. " + SYSTEM * repeat_system
            q_a, q_b = QUESTIONS[i % len(QUESTIONS)]
            prompt_a, prompt_b = chat(tokenizer, system, q_a), chat(tokenizer, system, q_b)
            a.generate([{"request_id": f"a{i}", "prompt_token_ids": prompt_a, "max_tokens": 2}])
            with_pool, = run_requests(b, [{"request_id": f"b{i}", "prompt_token_ids": prompt_b, "max_tokens": max_tokens}])
            without, = run_requests(c, [{"request_id": f"c{i}", "prompt_token_ids": prompt_b, "max_tokens": max_tokens}])
            if i == 0:
                continue
            assert with_pool["token_ids"] == without["token_ids"], "the pool changed the greedy tokens"
            rows.append(dict(session=i, prompt_tokens=len(prompt_b), loaded_tokens=with_pool["external_tokens"],
                             failed_load=with_pool["failed_load"], ttft_with_pool_s=with_pool["ttft_s"],
                             ttft_without_pool_s=without["ttft_s"]))
        load_seconds = b.engine_core.kv_connector_stats()["load_seconds"]
    finally:
        if b is not None:
            b.shutdown()
        if a is not None:
            a.close()
        server.stop()
    with_ttft = statistics.median(r["ttft_with_pool_s"] for r in rows)
    without_ttft = statistics.median(r["ttft_without_pool_s"] for r in rows)
    prompt = sum(r["prompt_tokens"] for r in rows)
    loaded = sum(r["loaded_tokens"] for r in rows)
    return dict(layer=layer, sessions=rows, hit_rate=round(loaded / prompt, 3), skipped_prefill_tokens=loaded,
                prompt_tokens=prompt, ttft_with_pool_s=round(with_ttft, 4), ttft_without_pool_s=round(without_ttft, 4),
                ttft_speedup=round(without_ttft / with_ttft, 2),
                load_seconds_median=round(statistics.median(load_seconds), 4) if load_seconds else None)


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.bench_engine import tiny_model_dir
    from mini_vllm import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", default=["scratch", "mooncake"], choices=["scratch", "mooncake"])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--repeat-system", type=int, default=6, help="copies of the system text (6: ~500 tokens)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--quick", action="store_true",
                    help="scratch layer only, 2 sessions, a shorter system prompt, a tiny random model (tests)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    model = str(default_model_path())
    if args.quick:       # the pool's mechanics are the same whatever the weights: seconds instead of minutes
        args.layers, args.sessions, args.repeat_system = ["scratch"], 2, 2
        model = str(tiny_model_dir(Path(tmp.name)))
    tokenizer = AutoTokenizer.from_pretrained(model)
    layers = [run_layer(layer, tokenizer, args.sessions, args.repeat_system, args.max_tokens, model)
              for layer in args.layers]
    tmp.cleanup()
    for r in layers:
        print({k: v for k, v in r.items() if k != "sessions"})
    workload = dict(model=Path(model).name, dtype="float32",
                    device="cpu (2 cores; engine A in its own process beside this one)",
                    sessions=args.sessions, system_prompt_copies=args.repeat_system, greedy=True,
                    max_tokens=args.max_tokens,
                    command="python -m benchmarks.bench_global_pool" + (" --quick" if args.quick else ""))
    name = "global_pool_quick" if args.quick else "global_pool"
    write_result(name, workload, layers, args.out_dir)
    plot(layers, args.out_dir / f"{name}.png")
    result = {"workload": workload, "rows": layers}
    return result


def plot(layers: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.8))
    x = range(len(layers))
    ax.bar([i - 0.2 for i in x], [r["ttft_without_pool_s"] * 1e3 for r in layers], 0.4, label="without the pool (compute)")
    ax.bar([i + 0.2 for i in x], [r["ttft_with_pool_s"] * 1e3 for r in layers], 0.4, label="with the pool (load)")
    for i, r in zip(x, layers):
        ax.text(i + 0.2, r["ttft_with_pool_s"] * 1e3, f"{r['ttft_speedup']}x\nhit {r['hit_rate']:.0%}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["layer"] for r in layers])
    ax.set_ylabel("TTFT of engine B, ms (median)")
    ax.set_title("SmolLM2 fp32, CPU: a second engine, same system prompt", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
