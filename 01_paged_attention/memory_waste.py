"""How much KV-cache memory holds real tokens: contiguous reservation vs paging [Kwon 2025, Fig. 3.2].

A system that stores each request's KV contiguously must reserve the whole chunk up front,
because the output length is unknown. The thesis [Kwon 2025, §3.3, §3.6.1] names three such policies,
after its Orca baselines, and three kinds of waste:

  * reserved:     slots for tokens the request WILL produce but has not yet — idle now;
  * internal:     slots past the request's final length, over-provisioned and never used;
  * (external:    gaps between chunks left by the allocator — not modelled here, so the
                   reservation numbers below are upper bounds on their utilisation).

PagedAttention allocates a block only when the previous one is full: the only waste is the
unfilled tail of each request's last block, < block_size tokens per request.

This module is arithmetic on lengths, no tensors: a snapshot of requests part-way through
decoding, and for each policy how many slots it holds vs how many hold a token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

POLICIES = ("max", "pow2", "oracle", "paged")
POLICY_LABELS = {
    "max": "reserve max length (Orca Max)",
    "pow2": "reserve output to next pow2 (Orca Pow2)",
    "oracle": "reserve exact length (Orca Oracle)",
    "paged": "paging (vLLM)",
}


@dataclass(frozen=True)
class Snapshot:
    prompt_lens: list[int]
    output_lens: list[int]      # final output length of each request
    generated: list[int]        # output tokens produced so far (0 <= generated <= output)

    def __post_init__(self):
        if not (len(self.prompt_lens) == len(self.output_lens) == len(self.generated)):
            raise ValueError("prompt_lens, output_lens and generated need one entry per request")
        for p, o, g in zip(self.prompt_lens, self.output_lens, self.generated):
            if p < 1 or o < 0 or not 0 <= g <= o:
                raise ValueError(f"need prompt >= 1 and 0 <= generated <= output, got ({p}, {o}, {g})")


@dataclass(frozen=True)
class Usage:
    allocated: int    # slots the policy holds
    used: int         # slots holding a token's KV
    reserved: int     # held for tokens still to come
    internal: int     # held beyond the request's final length (or the unfilled tail of a block)

    @property
    def utilization(self) -> float:
        return self.used / self.allocated if self.allocated else 1.0


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def kv_usage(snapshot: Snapshot, policy: str, block_size: int = 16, max_seq_len: int = 2048) -> Usage:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
    allocated = used = reserved = internal = 0
    ### BEGIN SOLUTION
    for p, o, g in zip(snapshot.prompt_lens, snapshot.output_lens, snapshot.generated):
        final, now = p + o, p + g
        if final > max_seq_len:
            raise ValueError(f"a request of {final} tokens exceeds max_seq_len={max_seq_len}")
        if policy == "paged":
            held = math.ceil(now / block_size) * block_size       # blocks allocated on demand
            allocated, used, internal = allocated + held, used + now, internal + held - now
            continue
        held = {"max": max_seq_len, "pow2": p + next_pow2(o), "oracle": final}[policy]
        held = min(held, max_seq_len)
        allocated += held
        used += now
        reserved += final - now                 # will be used, by this request only, later
        internal += held - final                # never used
    ### END SOLUTION
    return Usage(allocated, used, reserved, internal)


def sharegpt_like_snapshot(num_requests: int = 1000, max_seq_len: int = 2048, seed: int = 0) -> Snapshot:
    """A synthetic but realistic workload: log-normal prompt and output lengths with the means
    the vLLM paper [Kwon 2023] reports for ShareGPT (161 prompt / 338 output tokens; 8.4x and 5.8x
    Alpaca's, as [Kwon 2025, §3.6.1] states), each request at a uniformly random point of its decode."""
    g = torch.Generator().manual_seed(seed)

    def lognormal(mean: float, sigma: float) -> torch.Tensor:
        mu = math.log(mean) - sigma ** 2 / 2                  # so that E[X] = mean
        return torch.exp(mu + sigma * torch.randn(num_requests, generator=g))

    prompts = lognormal(161.0, 1.0).round().clamp(1, max_seq_len // 2).long()
    outputs = lognormal(338.0, 0.9).round().clamp(1, None).long()
    outputs = torch.minimum(outputs, max_seq_len - prompts)
    generated = (torch.rand(num_requests, generator=g) * (outputs + 1)).floor().long().clamp(max=outputs)
    return Snapshot(prompts.tolist(), outputs.tolist(), generated.tolist())
