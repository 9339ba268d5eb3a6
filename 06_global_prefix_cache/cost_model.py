"""When does a remote hit pay? The cost model and decision matrix of [vLLM 2.0 part 2, §7.4.4], as code.

A hit on L tokens saves their prefill and costs moving their K/V:

    transfer(L) = latency * transfers + L * kv_bytes_per_token / bandwidth
    prefill(L)  = L * time_per_token                       (0.5 ms/token there: 70B on an A100)
    local hit   = 0                                        (the K/V is already in this node's cache)

Pooling pays when transfer(L) < prefill(L). Both grow linearly in L, so apart from the fixed
latency the answer does not depend on L at all: it is the ratio

    kv_bytes_per_token / bandwidth   vs   time_per_token

i.e. a link fast enough to move one token's K/V in less time than computing it. The latency
term only matters for tiny hits. Hence the decision matrix: local hit -> use it; local miss
and global hit -> transfer if transfer(L) < prefill(L); both miss -> prefill.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVShape:
    """Bytes of K/V per token = 2 (K and V) * layers * KV heads * head_dim * dtype bytes."""
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int = 16

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


# The config of [vLLM 2.0 part 2, §7.4.4] (32 layers, 32 heads, head_dim 128, fp16, block 16: LLaMA-7B-like).
LLAMA_7B_FP16 = KVShape("LLaMA-7B-like (fp16)", 32, 32, 128, 2, 16)
# The project's default model as the engine runs it on CPU (fp32).
SMOLLM2_135M = KVShape("SmolLM2-135M (fp32)", 30, 3, 64, 4, 16)


@dataclass(frozen=True)
class Link:
    latency_s: float = 5e-6             # [vLLM 2.0 part 2, §7.4.4]: 5 µs RDMA base latency (same room)
    bandwidth_Bps: float = 100e9 / 8    # [vLLM 2.0 part 2, §7.4.4]: 100 GbE RoCEv2


def transfer_seconds(num_tokens: int, shape: KVShape, link: Link, num_transfers: int = 1) -> float:
    """The rdma_transfer_time of [vLLM 2.0 part 2, §7.4.4]: whole blocks only (a partial block is not pooled)."""
    ### BEGIN SOLUTION
    num_blocks = num_tokens // shape.block_size
    return num_transfers * link.latency_s + num_blocks * shape.bytes_per_block / link.bandwidth_Bps
    ### END SOLUTION


def prefill_seconds(num_tokens: int, seconds_per_token: float = 0.5e-3) -> float:
    """The prefill_compute_time of [vLLM 2.0 part 2, §7.4.4]: linear in tokens (0.5 ms/token)."""
    return num_tokens * seconds_per_token


def decide(local_hit: bool, global_hit: bool, transfer_s: float = 0.0, prefill_s: float = math.inf) -> str:
    """The decision matrix: "local", "transfer" or "prefill"."""
    ### BEGIN SOLUTION
    if local_hit:
        return "local"          # already here: costs nothing, always wins
    if global_hit and transfer_s < prefill_s:
        return "transfer"
    return "prefill"            # nothing to reuse, or moving it is slower than computing it
    ### END SOLUTION


def break_even_bandwidth_Bps(shape: KVShape, seconds_per_token: float) -> float:
    """The link bandwidth below which recomputing beats transferring (latency ignored)."""
    return shape.bytes_per_token / seconds_per_token


# The "typical output" table of [vLLM 2.0 part 2, §7.4.4], as printed (ms). Its transfer column does not
# follow from its own formula (see printed_table): the formula gives ~11x more.
PRINTED_TABLE = [  # (scenario, tokens, prefill ms, transfer ms)
    ("short system prompt", 128, 64.0, 0.5),
    ("medium system prompt", 1024, 512.0, 3.7),
    ("long system prompt", 8192, 4096.0, 29.4),
    ("very long context", 32768, 16384.0, 117.5),
]


def printed_table(shape: KVShape = LLAMA_7B_FP16, link: Link = Link(), seconds_per_token: float = 0.5e-3) -> list[dict]:
    """The printed table's four scenarios through this module's formulas, beside its printed numbers."""
    rows = []
    for name, tokens, printed_prefill_ms, printed_transfer_ms in PRINTED_TABLE:
        t, p = transfer_seconds(tokens, shape, link), prefill_seconds(tokens, seconds_per_token)
        rows.append(dict(scenario=name, tokens=tokens, prefill_ms=p * 1e3, transfer_ms=t * 1e3,
                         benefit_ms=(p - t) * 1e3, decision=decide(False, True, t, p),
                         printed_prefill_ms=printed_prefill_ms, printed_transfer_ms=printed_transfer_ms))
    return rows
