"""The CUDA backend: thin Python wrappers over kernels_cuda/{cache_kernels,paged_attention}.cu.

Mirrors vLLM's `vllm/_custom_ops.py` (`reshape_and_cache_flash`, `paged_attention_v1`,
`paged_attention_v2`) and the v1/v2 choice in `PagedAttention.forward_decode`
(vllm/attention/ops/paged_attn.py). The extensions are built on first use, on a GPU only
(`kernels_cuda.load`); every check that can be done without them is done here first, so a
bad argument fails with the same message on any machine.
"""
from __future__ import annotations

import torch

from paged_attention.cache_ops import check_cache_write_args
from paged_attention.checks import check_decode_args

# Compiled template instances (kernels_cuda/paged_attention.cu). Like vLLM, head size and
# block size are template parameters: the loops over them unroll and the per-thread
# arrays have compile-time sizes, which is what keeps them in registers.
SUPPORTED_HEAD_SIZES = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
PARTITION_SIZE = 512        # tokens per v2 partition (vLLM's _PARTITION_SIZE)
V1_MAX_SEQ_LEN = 8192       # v1 keeps all logits of a request in shared memory


def check_cuda_config(head_dim: int, block_size: int) -> None:
    if head_dim not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"the CUDA paged attention kernel is compiled for head sizes {SUPPORTED_HEAD_SIZES}, "
                         f"got {head_dim} (use backend='triton', which takes any head size)")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"the CUDA paged attention kernel is compiled for block sizes {SUPPORTED_BLOCK_SIZES}, "
                         f"got {block_size} (use backend='triton', which takes any block size)")


def use_v1(max_seq_len: int, num_seqs: int, num_heads: int) -> bool:
    """vLLM's rule: v1 (one thread block per (head, seq)) unless the context is long and
    there are too few (head, seq) pairs to fill the GPU — then v2 splits each context into
    512-token partitions processed by separate thread blocks, plus a reduce kernel."""
    max_num_partitions = -(-max_seq_len // PARTITION_SIZE)
    return max_seq_len <= V1_MAX_SEQ_LEN and (max_num_partitions == 1 or num_seqs * num_heads > 512)


def _load(name: str):
    import kernels_cuda
    return kernels_cuda.load(name)


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values: bool = True) -> None:
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values)
    _load("cache_kernels").reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, _stream())


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32
    scale: float,
    check_values: bool = True,
    *,
    version: str | None = None,     # "v1" | "v2" | None (vLLM's rule, `use_v1`)
    max_seq_len: int | None = None, # host-side max of seq_lens; read from seq_lens if None
) -> torch.Tensor:                  # [num_seqs, num_heads, head_dim]
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, check_values)
    num_seqs, num_heads, head_dim = query.shape
    check_cuda_config(head_dim, key_cache.shape[1])
    if version not in (None, "v1", "v2"):
        raise ValueError(f"version must be 'v1', 'v2' or None, got {version!r}")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    elif check_values and int(seq_lens.max()) > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is smaller than the longest seq_len {int(seq_lens.max())}")
    max_seq_len = max(max_seq_len, 1)
    if version is None:
        version = "v1" if use_v1(max_seq_len, num_seqs, num_heads) else "v2"
    ext = _load("paged_attention")
    if version == "v1":
        ext.paged_attention_v1(out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, _stream())
        return out
    max_num_partitions = -(-max_seq_len // PARTITION_SIZE)
    exp_sums = torch.empty(num_seqs, num_heads, max_num_partitions, dtype=torch.float32, device=query.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(num_seqs, num_heads, max_num_partitions, head_dim, dtype=torch.float32, device=query.device)
    ext.paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables, seq_lens,
                           scale, max_seq_len, _stream())
    return out
