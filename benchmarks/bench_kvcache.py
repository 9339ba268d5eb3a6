"""The block manager's CPU cost: per-block time of allocate/free, of a prefix hit (removal
from the middle of the free queue) and of a lookup, from 1e3 to 1e6 blocks — and the cost
of a prefix-cache lookup that finds nothing ([v1 prefix caching]: "zero overhead at 0% hit rate").

Side by side in one run:
  * our BlockPool vs the same free queue kept in a `collections.deque`, where a prefix hit
    must `deque.remove(block)` — O(n), the reason vLLM wrote a doubly linked list;
  * our get_computed_blocks on a 4096-token prompt (hashing + probing 256 blocks) vs the
    floor: 256 bare `dict.get` calls on precomputed keys.
Workload: block_size 16, builtin hash unless stated; single Python thread on this machine's
CPU (the block manager runs on the CPU in vLLM too, so these numbers are the real thing,
up to the CPU model). Medians of repeated, interleaved runs.

    .venv/bin/python -m benchmarks.bench_kvcache            # -> benchmarks/results/kvcache_scale.{json,png}
    .venv/bin/python -m benchmarks.bench_kvcache --quick    # 1e3..1e5 only
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

from benchmarks.common import RESULTS_DIR, environment, write_result
from kvcache import BlockPool, KVCacheManager, SimpleRequest, hash_block_tokens, sha256_hash

BLOCK_SIZE = 16


def per_op_ns(fn, ops: int, repeats: int = 5) -> float:
    """Median over `repeats` of (time of fn() / ops), in ns. fn performs `ops` operations."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) / ops * 1e9)
    return statistics.median(samples)


def cached_pool(n: int) -> tuple[BlockPool, list]:
    """A pool of n blocks, all cached (distinct hashes) and free: every block is a possible hit."""
    pool = BlockPool(n)
    blocks = pool.get_new_blocks(n)
    hashes = [hash_block_tokens(None, (i,)) for i in range(n)]
    pool.cache_full_blocks(blocks, hashes, 0, n)
    pool.free_blocks(blocks)
    return pool, hashes


def bench_scale(n: int, k: int = 20_000, seed: int = 0) -> dict:
    rng = random.Random(seed)
    pool, hashes = cached_pool(n)
    batch = min(n, 1000)

    def alloc_free():                       # pop from the head (evicting hashes) and free again
        for _ in range(k // batch):
            pool.free_blocks(pool.get_new_blocks(batch))
    alloc_ns = per_op_ns(alloc_free, (k // batch) * batch * 2)   # 2 ops per block: allocate + free

    pool, hashes = cached_pool(n)
    picks = [pool.blocks[rng.randrange(n)] for _ in range(k)]

    def touch_free():                       # a prefix hit: remove from the middle, then free
        for b in picks:
            pool.touch((b,))
            pool.free_blocks((b,))
    touch_ns = per_op_ns(touch_free, 2 * k)

    probes = [hashes[rng.randrange(n)] for _ in range(k)]
    misses = [hash_block_tokens(None, (-1 - i,)) for i in range(k)]
    hit_ns = per_op_ns(lambda: [pool.get_cached_block(h) for h in probes], k)
    miss_ns = per_op_ns(lambda: [pool.get_cached_block(h) for h in misses], k)
    # Floors that no data structure beats: touching a random block object, and a bare dict.get
    # of a random key. They grow with n too — that growth is the CPU cache, not the algorithm.
    table, keys = pool.cached_block_hash_to_block, [h.hash_value for h in probes]
    touch_floor_ns = per_op_ns(lambda: [b.ref_cnt for b in picks], k)
    dict_floor_ns = per_op_ns(lambda: [table.get(key) for key in keys], k)

    # Peer: the same free queue as a deque; a hit must find and remove the block: O(n).
    dq = collections.deque(pool.blocks)
    dq_ops = max(20, min(k, 2_000_000 // n))
    dq_picks = picks[:dq_ops]

    def deque_touch_free():
        for b in dq_picks:
            dq.remove(b)
            dq.append(b)
    deque_ns = per_op_ns(deque_touch_free, 2 * dq_ops, repeats=3)
    return dict(num_blocks=n, alloc_free_ns_per_block=alloc_ns, touch_free_ns_per_block=touch_ns,
                lookup_hit_ns=hit_ns, lookup_miss_ns=miss_ns, deque_touch_free_ns_per_block=deque_ns,
                deque_vs_ours=deque_ns / touch_ns, random_object_floor_ns=touch_floor_ns,
                dict_get_floor_ns=dict_floor_ns, lookup_hit_vs_dict_get=hit_ns / dict_floor_ns)


def bench_zero_hit_lookup(prompt_len: int = 4096, cached_entries: int = 100_000, iters: int = 30) -> list[dict]:
    """get_computed_blocks on a prompt that shares nothing with a cache of `cached_entries`
    other blocks: the whole cost a miss adds to a request's admission."""
    rows = []
    for hash_name in ("builtin", "sha256"):
        m = KVCacheManager(cached_entries + 512, BLOCK_SIZE, hash_fn=hash_name)
        filler = SimpleRequest("filler", list(range(10**7, 10**7 + cached_entries * BLOCK_SIZE)))
        m.allocate_slots(filler, filler.num_tokens)
        m.cache_blocks(filler, filler.num_tokens)
        m.free(filler)
        reqs = [SimpleRequest(f"q{i}", [i * prompt_len + t for t in range(prompt_len)]) for i in range(iters)]
        samples = []
        for r in reqs:                                   # fresh request each time: includes hashing
            t0 = time.perf_counter()
            hit, n = m.get_computed_blocks(r)
            samples.append(time.perf_counter() - t0)
            assert n == 0
        full_us = statistics.median(samples) * 1e6
        hashes = m.req_to_block_hashes[reqs[0].request_id]
        probe_samples = []
        for _ in range(iters):                           # probing alone (hashes already computed)
            t0 = time.perf_counter()
            for h in hashes:
                if m.block_pool.get_cached_block(h) is None:
                    break
            probe_samples.append(time.perf_counter() - t0)
        # vLLM probes until the first miss (one probe here); [v1 prefix caching] counts all 256 probes:
        # time the worst case too — every block probed, all missing.
        table = m.block_pool.cached_block_hash_to_block
        keys = [h.hash_value for h in hashes]
        all_probe = statistics.median(_time(lambda: [m.block_pool.get_cached_block(h) for h in hashes]) for _ in range(iters))
        floor = statistics.median(_time(lambda: [table.get(k) for k in keys]) for _ in range(iters))
        rows.append(dict(hash_fn=hash_name, prompt_len=prompt_len, num_blocks=len(hashes), cached_entries=cached_entries,
                         get_computed_blocks_us=full_us, hashing_us=full_us - statistics.median(probe_samples) * 1e6,
                         probe_all_blocks_us=all_probe * 1e6, dict_get_floor_us=floor * 1e6,
                         probe_ns_per_block=all_probe / len(hashes) * 1e9, probe_vs_floor=all_probe / floor))
    return rows


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sha256_overhead_ns(iters: int = 20_000) -> float:
    toks = tuple(range(BLOCK_SIZE))
    return per_op_ns(lambda: [sha256_hash((i, toks, None)) for i in range(iters)], iters)


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = [r["num_blocks"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in [("alloc_free_ns_per_block", "allocate + free (pop head, append tail)"),
                       ("touch_free_ns_per_block", "prefix hit: touch (remove from middle) + free"),
                       ("lookup_hit_ns", "lookup, hit"), ("lookup_miss_ns", "lookup, miss"),
                       ("deque_touch_free_ns_per_block", "peer: deque.remove + append"),
                       ("dict_get_floor_ns", "floor: bare dict.get of a random key")]:
        ax.plot(n, [r[key] for r in rows], marker="o", label=label,
                linestyle="--" if "deque" in key else (":" if "floor" in key else "-"))
    ax.set(xscale="log", yscale="log", xlabel="blocks in the pool", ylabel="ns per block operation",
           title="BlockPool: O(1) per block; growth = CPU caches (cf. dict.get)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1e3..1e5 blocks only")
    args = ap.parse_args(argv)
    sizes = [10**3, 10**4, 10**5] + ([] if args.quick else [10**6])
    scale = []
    for n in sizes:
        row = bench_scale(n)
        scale.append(row)
        print(f"N={n:>8}: alloc+free {row['alloc_free_ns_per_block']:6.0f} ns/block, hit {row['touch_free_ns_per_block']:6.0f},"
              f" lookup hit/miss {row['lookup_hit_ns']:4.0f}/{row['lookup_miss_ns']:4.0f} ns,"
              f" deque peer {row['deque_touch_free_ns_per_block']:9.0f} ns/block ({row['deque_vs_ours']:.0f}x ours);"
              f" floors: random object {row['random_object_floor_ns']:4.0f} ns, dict.get {row['dict_get_floor_ns']:4.0f} ns")
    lookup = bench_zero_hit_lookup()
    for r in lookup:
        print(f"0%-hit lookup of a {r['prompt_len']}-token prompt ({r['hash_fn']}): {r['get_computed_blocks_us']:.0f} us total "
              f"(hashing {r['hashing_us']:.0f} us); probing all {r['num_blocks']} blocks {r['probe_all_blocks_us']:.1f} us "
              f"= {r['probe_ns_per_block']:.0f} ns/block, {r['probe_vs_floor']:.1f}x a bare dict.get loop")
    sha = sha256_overhead_ns()
    print(f"sha256 of one block key: {sha:.0f} ns")
    workload = dict(block_size=BLOCK_SIZE, sizes=sizes, note="single Python thread; medians of repeated runs",
                    sha256_ns_per_block=sha)
    path = write_result("kvcache_scale", workload, scale + lookup)
    plot(scale, RESULTS_DIR / "kvcache_scale.png")
    print(f"wrote {path} and {RESULTS_DIR / 'kvcache_scale.png'} ({environment()['device']})")


if __name__ == "__main__":
    main()
