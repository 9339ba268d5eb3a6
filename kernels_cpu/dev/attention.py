"""The attention kernel's tuning story, re-run: every version of csrc/attention_kernel.cpp built,
checked against plain torch, and timed on SmolLM2's attention (9 query heads, 3 KV heads, head_dim
64, fp32, block 16, shuffled blocks), K/V cold from DRAM as in the engine.

    python -m kernels_cpu.dev.attention            # build (first time: tens of seconds a version), check, time
    python -m kernels_cpu.dev.attention --smoke    # tiny shapes, validation only

The versions are one source built with -DVFS_CPU_ATTENTION_VERSION=N (the kernel's top comment
says why each step): decode streams K/V once per step, so how the loads reach memory is the cost.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from kernels_cpu import attention
from kernels_cpu.dev.common import ColdCaches, arguments, best_times, load_version, print_table

VERSIONS = {
    1: "K/V read by the arithmetic as it goes (no prefetch)",
    2: "+ every item prefetches its next tile while computing this one",
    3: "+ decode items load each tile before computing on it (touch_tile): the engine's build",
}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def load(version: int):
    if version == max(VERSIONS):
        return attention.load()
    return load_version("cpu_attention", attention.SOURCES, attention.WHAT, "VFS_CPU_ATTENTION_VERSION", version)


def make_batch(query_lens: list[int], context_lens: list[int], seed: int = 0):
    """(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc): each request's
    blocks at random places in the cache."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    order = torch.randperm(sum(blocks), generator=g)
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        block_tables[i, :n] = order[start:start + n]
        start += n
    cache_shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(cache_shape, generator=g), torch.randn(cache_shape, generator=g)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=g)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), query_start_loc


def reference(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """Plain torch, request by request: gather its K/V through the block table, causal SDPA with
    the new tokens as the last ones of the sequence."""
    out = torch.empty_like(query)
    group = NUM_HEADS // NUM_KV_HEADS
    for i, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = query_start_loc[i].item(), query_start_loc[i + 1].item()
        rows = block_tables[i, :-(-seq_len // BLOCK_SIZE)].long()
        k = key_cache[rows].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1).transpose(0, 1)   # [H, S, D]
        v = value_cache[rows].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q0:q1].transpose(0, 1)                                                              # [H, Q, D]
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - (q1 - q0), seq_len)[:, None]
        out[q0:q1] = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale).transpose(0, 1)
    return out


def workloads(smoke: bool) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query_lens, context_lens)."""
    if smoke:
        return {"decode 4 x ~40": ([1] * 4, [3, 17, 40, 64]), "prefill 2 x 17 after 9": ([17, 17], [9, 0])}
    return {"decode 64 x 512": ([1] * 64, [511] * 64),
            "decode 8 x 2048": ([1] * 8, [2047] * 8),
            "chunked prefill 4 x 256 after 256": ([256] * 4, [256] * 4)}


def main(argv: list[str] | None = None) -> list[dict]:
    args = arguments(__doc__.split("\n\n")[0], argv)
    modules = {v: load(v) for v in VERSIONS}
    flush = ColdCaches(enabled=not args.smoke)
    results = []
    for name, (query_lens, context_lens) in workloads(args.smoke).items():
        batch = make_batch(query_lens, context_lens)
        scale = HEAD_DIM ** -0.5
        expected = reference(*batch, scale)
        runs = {v: (lambda m=m: attention._run(*batch, scale, None, None, module=m)) for v, m in modules.items()}
        rows = []
        for version, run in runs.items():
            error = (run() - expected).abs().max().item()
            if error > 1e-4:
                raise AssertionError(f"{name}: v{version} differs from the reference by {error}")
            rows.append(dict(workload=name, version=version, change=VERSIONS[version], max_error=error))
        if not args.smoke:
            times = best_times(runs, flush, args.rounds)
            for row in rows:
                row["ms"] = 1e3 * times[row["version"]]
        kv_mb = 2 * batch[1].numel() * 4 / 1e6
        print_table(f"{name} (K/V {kv_mb:.0f} MB{', timed cold' if not args.smoke else ''}, "
                    f"{torch.get_num_threads()} threads, {modules[max(VERSIONS)].isa()})", rows)
        results += rows
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
