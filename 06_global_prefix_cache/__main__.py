"""`python -m global_prefix_cache demo [--mooncake]`: two node processes on loopback.

1. A shared pool: node A serves a request with a long system prompt and publishes its full
   blocks; node B, another OS process, gets a remote prefix hit on the same system prompt,
   loads those blocks into its own (shuffled) block ids and computes only the rest.
2. Disaggregation: a prefill node computes a prompt and its first token; a decode node
   receives the pushed K/V and continues at num_computed_tokens = L_prompt.

Everything it needs it starts (metadata server or mooncake_master) and stops. Phase 1 has no
model: K/V come from `FakeKVModel`, and a node spends `--ms-per-token` per computed token
as a stand-in for prefill compute (default 0.5 ms: the figure of [vLLM 2.0 part 2, §7.4.4]).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np


def _config(args, address: str, role: str, **extra) -> dict:
    if args.mooncake:
        return {"kv_connector": "MooncakeConnector", "kv_role": role,
                "kv_connector_extra_config": {"master_server": address, "model": "demo",
                                              "global_segment_size": 64 << 20, **extra}}
    return {"kv_connector": "GlobalKVPoolConnector", "kv_role": role,
            "kv_connector_extra_config": {"metadata_server": address, "model": "demo", **extra}}


def _pool(args, server: str, rng: random.Random) -> bool:
    from global_prefix_cache.node import NodeProcess
    kw = dict(num_blocks=args.num_blocks, block_size=args.block_size, max_model_len=args.num_blocks * args.block_size,
              step_delay_s=args.ms_per_token * 1e-3)
    system = [rng.randrange(1000) for _ in range(args.system_tokens)]
    with NodeProcess(kv_transfer_config=_config(args, server, "kv_both"), shuffle_seed=1, node_id="A", **kw) as a, \
         NodeProcess(kv_transfer_config=_config(args, server, "kv_both"), shuffle_seed=2, node_id="B", **kw) as b, \
         NodeProcess(shuffle_seed=3, node_id="alone", **kw) as alone:
        ra = a.run("user-1", system + [11, 12, 13], max_tokens=4)
        rb = b.run("user-2", system + [21, 22, 23, 24], max_tokens=4)
        rc = alone.run("user-2", system + [21, 22, 23, 24], max_tokens=4)    # the same request, no pool
        stats = b.call("stats")["connector"]
    ok = (np.array_equal(rb["kv"], rb["reference_kv"]) and rb["output_token_ids"] == rc["output_token_ids"]
          and np.array_equal(rb["kv"][:, :, :args.system_tokens], ra["kv"][:, :, :args.system_tokens]))
    print(f"[pool] node A published the full blocks of a {args.system_tokens}-token system prompt")
    print(f"[pool] node B: remote hit {rb['external_tokens']} tokens, computed {rb['prompt_len'] - rb['external_tokens']}; "
          f"first steps {rb['trace'][:2]} (status, num_computed_tokens, scheduled)")
    print(f"[pool] loaded {stats['loaded_bytes']} bytes; TTFT with pool {rb['ttft_s'] * 1e3:.1f} ms, "
          f"without {rc['ttft_s'] * 1e3:.1f} ms (compute stand-in: {args.ms_per_token} ms/token)")
    print(f"[pool] K/V byte-identical to computing it, outputs identical: {'OK' if ok else 'MISMATCH'}")
    return ok


def _disagg(args, server: str, rng: random.Random) -> bool:
    from global_prefix_cache.node import NodeProcess
    kw = dict(num_blocks=args.num_blocks, block_size=args.block_size, max_model_len=args.num_blocks * args.block_size,
              step_delay_s=args.ms_per_token * 1e-3)
    prompt = [rng.randrange(1000) for _ in range(args.system_tokens + 5)]
    with NodeProcess(kv_transfer_config=_config(args, server, "kv_producer", save_to_pool=False), shuffle_seed=4,
                     node_id="prefill", **kw) as p, \
         NodeProcess(kv_transfer_config=_config(args, server, "kv_consumer"), shuffle_seed=5, node_id="decode", **kw) as d, \
         NodeProcess(shuffle_seed=6, node_id="both", **kw) as both:
        rp = p.run("req", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        rd = d.run("req", prompt + rp["output_token_ids"], max_tokens=6, kv_transfer_params=rp["kv_transfer_params"])
        rw = both.run("req", prompt, max_tokens=7)
        pushed = p.call("stats")["connector"]["pushed_blocks"]
    ok = (rp["output_token_ids"] + rd["output_token_ids"] == rw["output_token_ids"]
          and np.array_equal(rd["kv"], rd["reference_kv"]))
    print(f"[disagg] prefill node computed {len(prompt)} tokens + the first output token, pushed {pushed} blocks")
    print(f"[disagg] decode node started at {rd['trace'][0]} and continued: {rd['trace'][-1]}")
    print(f"[disagg] tokens {rp['output_token_ids'] + rd['output_token_ids']} == one node doing both: "
          f"{'OK' if ok else 'MISMATCH'}")
    return ok


def demo(args) -> int:
    rng = random.Random(args.seed)
    if args.mooncake:
        from global_prefix_cache.mooncake_layer import MooncakeMaster
        server = MooncakeMaster()
        print(f"layer: Mooncake (TransferEngine P2PHANDSHAKE/tcp + Store), mooncake_master on {server.address}")
    else:
        from global_prefix_cache.metadata import MetadataServerProcess
        server = MetadataServerProcess()
        print(f"layer: from scratch (metadata server process on {server.address}, our transfer engine)")
    t0 = time.perf_counter()
    try:
        ok = _pool(args, server.address, rng) and _disagg(args, server.address, rng)
    finally:
        server.stop()
    print(f"{'all checks passed' if ok else 'A CHECK FAILED'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m global_prefix_cache")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="two node processes on loopback: a shared pool, then disaggregation")
    d.add_argument("--mooncake", action="store_true", help="use the real Mooncake instead of the from-scratch layer")
    d.add_argument("--system-tokens", type=int, default=256)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--num-blocks", type=int, default=64)
    d.add_argument("--ms-per-token", type=float, default=0.5)
    d.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.system_tokens + 40 > args.num_blocks * args.block_size:
        parser.error("--system-tokens too large for --num-blocks x --block-size")
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
