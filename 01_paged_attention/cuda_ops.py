"""The CUDA backend: thin Python wrappers over kernels_cuda/{cache_kernels,paged_attention}.cu.

Mirrors vLLM's `vllm/_custom_ops.py` (`reshape_and_cache_flash`, `paged_attention_v1`,
`paged_attention_v2`) and the v1/v2 choice in `PagedAttention.forward_decode`
(vllm/attention/ops/paged_attn.py). The extensions are built on first use, on a GPU only
(`kernels_cuda.load`); every check that can be done without them is done here first, so a
bad argument fails with the same message on any machine.

Views: the kernels read index tensors through raw pointers and the binding accepts only
what they can read (contiguous seq_lens / slot_mapping, block_tables rows with stride 1,
a unit head_dim stride). So the wrappers first bring every input to such a layout — a copy
only when the view is not one already — and THEN check values: the checks validate
exactly the memory the kernel reads. Caches are written (or read) in place and cannot be
copied: a cache whose head_dim is not contiguous is refused with a clear error.
"""
from __future__ import annotations

import torch

from paged_attention.checks import check_cache_write_args, check_decode_args, check_prefill_args, contiguous_index
from paged_attention.kv_quant import KVQuant

# Compiled template instances (kernels_cuda/paged_attention.cu). Like vLLM, head size and
# block size are template parameters: the loops over them unroll and the per-thread
# arrays have compile-time sizes, which is what keeps them in registers.
SUPPORTED_HEAD_SIZES = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
PARTITION_SIZE = 512        # tokens per v2 partition (vLLM's _PARTITION_SIZE)
V1_MAX_SEQ_LEN = 8192       # v1 keeps all logits of a request in shared memory
V3_GROUP_MAX = 4            # query heads one v3 thread block serves (bigger GQA groups: chunks)
NUM_SMS = 132               # H100 / H200 (SXM)
V3_BLOCKS_PER_SM = 2        # v3 thread blocks resident per SM (__launch_bounds__ min blocks, GQA)


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


def v3_thread_blocks_per_seq(num_heads: int, num_kv_heads: int) -> int:
    """v3 runs one thread block per (KV head, chunk of <= V3_GROUP_MAX query heads) per sequence."""
    group = num_heads // num_kv_heads
    return num_kv_heads * -(-group // V3_GROUP_MAX)


def use_v3_split(max_seq_len: int, num_seqs: int, num_heads: int, num_kv_heads: int) -> bool:
    """Split-KV for v3 (flash-decoding): cut each context into PARTITION_SIZE-token partitions,
    each its own thread block, merged by a reduce kernel — but only when it pays.

    Without a split v3 launches one thread block per (sequence, KV head group); with few
    sequences (batch 1-32) and Llama-like 8 KV heads that is 8-256 blocks, too few to fill
    NUM_SMS SMs x V3_BLOCKS_PER_SM resident blocks, so most of the GPU's bandwidth sits idle
    while a long context streams through a handful of SMs. A split multiplies the blocks by the
    number of partitions at the cost of fp32 partial outputs and a second (small) kernel, so
    split only when (a) there is more than one partition and (b) the unsplit grid would not
    fill the GPU once."""
    if -(-max_seq_len // PARTITION_SIZE) <= 1:
        return False
    return num_seqs * v3_thread_blocks_per_seq(num_heads, num_kv_heads) < NUM_SMS * V3_BLOCKS_PER_SM


def _load(name: str):
    import kernels_cuda
    return kernels_cuda.load(name)


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _int32_index(name: str, t: torch.Tensor) -> torch.Tensor:
    """The CUDA kernels take `const int*`: refuse int64 rather than truncate it silently."""
    if t.dtype != torch.int32:
        raise TypeError(f"backend='cuda' reads {name} as int32, got {t.dtype} (convert it, or use another backend)")
    return t


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """An input the kernel only reads: copy it if its head_dim is not contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _refuse_strided_cache(**caches: torch.Tensor) -> None:
    for name, c in caches.items():
        if c.dim() == 4 and c.stride(-1) != 1:
            raise ValueError(f"backend='cuda': {name}'s head_dim must be contiguous (stride 1), got strides {c.stride()}")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values: bool = True, *,
                      kv_quant: KVQuant | None = None) -> None:
    slot_mapping = contiguous_index(slot_mapping)
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values, kv_quant)
    _refuse_strided_cache(key_cache=key_cache, value_cache=value_cache)
    key, value = _unit_last_stride(key), _unit_last_stride(value)
    if kv_quant is not None:      # an 8-bit cache (kv_quant.py): one warp quantizes each (token, head) row
        _load("cache_kernels").reshape_and_cache_quant(key, value, key_cache, value_cache, slot_mapping,
                                                       kv_quant.per_token_head, kv_quant.k_scale, kv_quant.v_scale,
                                                       _stream())
        return
    _load("cache_kernels").reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, _stream())


def _kv_args(kv_quant: KVQuant | None) -> tuple[int, bool, float, float]:
    """What the decode kernels take for a cache (paged_attention_common.cuh: KVQuantArgs): the kind
    (0 float, 1 int8, 2 fp8 e4m3fn), per-row scales or not, the per-tensor K and V scales."""
    if kv_quant is None:
        return 0, False, 1.0, 1.0
    return (1 if kv_quant.storage_dtype == torch.int8 else 2), kv_quant.per_token_head, kv_quant.k_scale, kv_quant.v_scale


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim (+ 4 bytes: kv_quant.py)]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32
    scale: float,
    check_values: bool = True,
    *,
    max_seq_len: int | None = None, # host-side max of seq_lens; read from seq_lens if None
    version: str | None = None,     # "v1" | "v2" | "v3" | None (vLLM's rule between v1/v2, `use_v1`)
    kv_quant: KVQuant | None = None,   # an 8-bit cache: each kernel dequantizes the rows as it reads them
) -> torch.Tensor:                  # [num_seqs, num_heads, head_dim]
    seq_lens = contiguous_index(seq_lens)
    if block_tables.dim() == 2 and block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()   # the kernel walks a row with stride 1
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, check_values, max_seq_len, kv_quant)
    _int32_index("block_tables", block_tables)
    _int32_index("seq_lens", seq_lens)
    _refuse_strided_cache(key_cache=key_cache, value_cache=value_cache)
    query = _unit_last_stride(query)
    num_seqs, num_heads, head_dim = query.shape
    check_cuda_config(head_dim, key_cache.shape[1])
    kv = _kv_args(kv_quant)
    if version not in (None, "v1", "v2", "v3"):
        raise ValueError(f"version must be 'v1', 'v2', 'v3' or None, got {version!r}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)   # the binding wants it contiguous
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_seq_len = max(max_seq_len, 1)
    if version is None:
        version = "v1" if use_v1(max_seq_len, num_seqs, num_heads) else "v2"
    ext = _load("paged_attention")
    if version == "v1":
        ext.paged_attention_v1(out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, *kv,
                               _stream())
        return out
    if version == "v3":   # flash-decoding rung (kernels_cuda/paged_attention_v3.cuh), split-KV by `use_v3_split`
        if not use_v3_split(max_seq_len, num_seqs, num_heads, key_cache.shape[2]):
            ext.paged_attention_v3(out, None, None, None, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                   max_seq_len, *kv, _stream())
            return out
    max_num_partitions = -(-max_seq_len // PARTITION_SIZE)
    exp_sums = torch.empty(num_seqs, num_heads, max_num_partitions, dtype=torch.float32, device=query.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(num_seqs, num_heads, max_num_partitions, head_dim, dtype=torch.float32, device=query.device)
    split_kernel = ext.paged_attention_v3 if version == "v3" else ext.paged_attention_v2
    split_kernel(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables, seq_lens,
                 scale, max_seq_len, *kv, _stream())
    return out


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = skip
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,
    kv_quant: KVQuant | None = None,   # an 8-bit cache: the write quantizes (the attention uses fresh K/V)
) -> torch.Tensor:
    """vLLM V0's XFormers pairing: the CUDA cache write, then the Triton prefill kernel for
    the attention (there is no CUDA prefill kernel here, as vLLM had none of its own)."""
    from paged_attention import triton_ops
    slot_mapping, query_start_loc = contiguous_index(slot_mapping), contiguous_index(query_start_loc)
    check_prefill_args(query, key, value, key_cache, value_cache, slot_mapping, query_start_loc, check_values,
                       max_query_len, kv_quant)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=False,   # checked just above
                      kv_quant=kv_quant)
    return triton_ops.prefill_attention(query, key, value, query_start_loc, scale, max_query_len)
