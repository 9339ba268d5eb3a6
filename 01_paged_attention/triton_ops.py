"""Triton kernels for chapter 01, with the same signatures as the reference ops.

* `reshape_and_cache`: one program per new token scatters its K/V row to its slot
  (vLLM: `reshape_and_cache_flash`, csrc/cache_kernels.cu; triton_reshape_and_cache_flash.py).
* `paged_decode_attention`: one program per (request, KV head) walks the request's KV in
  tiles of TILE tokens with an online softmax. All the query heads that share a KV head
  (GQA) are handled by the same program, so each K/V byte is read from memory once.
  Each token's physical row is looked up individually (block_tables[t // B], t % B), so a
  tile is independent of the block size: block sizes 1..256 and non-powers of two all work
  with a tensor-core friendly tile. (vLLM: `kernel_unified_attention_2d`,
  vllm/attention/ops/triton_unified_attention.py.) That is rung v1 (`_paged_decode_kernel`,
  the course kernel). Rung v2 (`_paged_decode_kernel_v2`) walks several whole KV blocks per
  step and loads ONE block id per block (broadcast to its rows), so a step is a bigger load
  with fewer table lookups on its critical path; a block size that is not a power of two is
  padded to one (masked rows). `DecodeConfig` / `choose_decode_config` pick the rung, the tile,
  num_warps and num_stages (the launch's pipelining depth); `benchmarks/bench_paged_attention.py
  --sweep` measures them on a GPU.
* split-KV ("flash-decoding"): with few requests and long contexts, (request, KV head)
  programs are too few to fill the GPU, so each request's KV is also cut into
  NUM_KV_SPLITS ranges processed in parallel; each writes an unnormalised partial result
  plus its running max m and sum l, and `_split_kv_reduce_kernel` merges them:
      out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s.
  (vLLM: `kernel_unified_attention_3d` + `reduce_segments`; CUDA paged_attention_v2.)
* `paged_prefill_attention`: causal FlashAttention over a ragged batch of prompts
  (cu_seqlens), after writing their K/V to the cache.

Numerics: the project's one convention, in `triton_common.py` (log2-unit scores, fp32
state, p rounded to V's dtype and summed as rounded, so V == 1 gives exactly 1); every
kernel here calls its `online_softmax_update`.

Views: every strided input (query, key, value, caches, block_tables) is read through all
its strides, so any view works; 1-D index tensors (slot_mapping, seq_lens,
query_start_loc) are made contiguous BEFORE they are checked (`checks.contiguous_index`),
so the checks validate exactly what the kernel reads.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_attention.checks import check_cache_write_args, check_decode_args, check_prefill_args, contiguous_index
from paged_attention.kv_quant import KVQuant, kernel_scale_args, kv_quant_mode
from paged_attention.triton_common import LOG2E, dot_precision, interpreting, online_softmax_update, round_to, upcast

__all__ = ["DecodeConfig", "choose_decode_config", "choose_num_kv_splits", "interpreting", "paged_decode_attention", "paged_prefill_attention",
           "prefill_attention", "reshape_and_cache"]

# Launch shapes, chosen so that every kernel compiles for sm_90 without register spills
# (tests/01_paged_attention/test_triton_compile.py checks with ptxas). Not tuned on a GPU.
DEFAULT_TILE = 16       # v1's KV tokens per step before launch configs existed (V1_TILE16; choose_decode_config picks now)
PREFILL_BLOCKS = {torch.float16: (64, 16), torch.bfloat16: (64, 16), torch.float32: (32, 16)}   # (BLOCK_M, BLOCK_N)
SPLIT_TARGET_PROGRAMS = 256  # split-KV aims for about this many programs (2 per SM on an H100, 132 SMs)
MIN_TOKENS_PER_SPLIT = 256   # below this a split costs more in the reduce than it saves


def _next_pow2(n: int) -> int:
    """triton.next_power_of_2 without its call overhead (it is a constexpr_function, ~3 us a call
    from Python: the decode wrapper called it 4-8 times per launch, on the host's critical path)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# ----------------------------------------------------------------------------- cache write

@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,   # slot_mapping: contiguous
    stride_k_tok, stride_k_head, stride_k_d, stride_v_tok, stride_v_head, stride_v_d,
    stride_kc_blk, stride_kc_tok, stride_kc_head, stride_kc_d,
    stride_vc_blk, stride_vc_tok, stride_vc_head, stride_vc_d,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    ### BEGIN SOLUTION
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    offs = tl.arange(0, BLOCK_HD)                      # flattened (head, d) of this token's row
    head = offs // HEAD_DIM
    d = offs % HEAD_DIM
    mask = (offs < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)   # slot -1: padding token, write nothing
    k = tl.load(key_ptr + token * stride_k_tok + head * stride_k_head + d * stride_k_d, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + head * stride_v_head + d * stride_v_d, mask=mask)
    tl.store(key_cache_ptr + blk * stride_kc_blk + off * stride_kc_tok + head * stride_kc_head + d * stride_kc_d,
             k, mask=mask)
    tl.store(value_cache_ptr + blk * stride_vc_blk + off * stride_vc_tok + head * stride_vc_head + d * stride_vc_d,
             v, mask=mask)
    ### END SOLUTION


@triton.jit
def fp8e4m3_bits(y):
    """fp32 y (|y| <= 448) -> the fp8 e4m3fn byte, as an int32, rounding to nearest even like
    torch's cast. Done in integer arithmetic because the interpreter's fp8 cast rounds ties away
    from zero; a GPU gets the same bytes (C++: fp8e4m3_from_float in kernels_cpu)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    # below 2^-6, steps of 2^-9: adding then subtracting 2^23 rounds a * 512 to an integer, ties to even
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    b = a.to(tl.int32, bitcast=True)
    b = b + 0x7FFFF + ((b >> 20) & 1)                    # 23 mantissa bits -> 3, ties to even
    normal = (((b >> 23) - 120) << 3) | ((b >> 20) & 7)
    return sign | tl.where(a < 0.015625, sub, normal)


@triton.jit
def _quantize_store(x, dst_ptrs, mask, scale_ptr, tensor_scale,
                    PER_ROW: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr):
    """One K or V row [BLOCK_D] -> the cache (paged_attention/kv_quant.py's bytes): its scale
    (per tensor, or absmax / QMAX stored after the row), then x * (1 / scale) rounded."""
    x = x.to(tl.float32)
    if PER_ROW:
        scale = tl.maximum(tl.max(tl.abs(x), 0) / QMAX, 1e-6)   # masked lanes loaded as 0
        tl.store(scale_ptr, scale)
    else:
        scale = tensor_scale
    y = x * (1.0 / scale)
    if IS_INT8:
        y = tl.minimum(tl.maximum(tl.where(y >= 0, y + 0.5, y - 0.5), -128.0), 127.0)   # half away from 0
        tl.store(dst_ptrs, y.to(tl.int8), mask=mask)                                    # the store truncates
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(dst_ptrs, fp8e4m3_bits(y).to(tl.uint8), mask=mask)                  # an fp8 cache seen as bytes


@triton.jit
def _reshape_and_cache_quant_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,   # fp8 caches passed as uint8
    k_scale_ptr, v_scale_ptr,          # PER_ROW: [num_blocks, block_size, num_kv_heads] fp32 views of the rows
    k_scale, v_scale,                  # per-tensor scales (not PER_ROW)
    stride_k_tok, stride_k_head, stride_k_d, stride_v_tok, stride_v_head, stride_v_d,
    stride_kc_blk, stride_kc_tok, stride_kc_head, stride_kc_d,
    stride_vc_blk, stride_vc_tok, stride_vc_head, stride_vc_d,
    stride_ks_blk, stride_ks_tok, stride_ks_head,
    block_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PER_ROW: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr,
):
    """grid = (num_tokens, num_kv_heads): one row of K and one of V per program."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:                                      # -1: a padding token, write nothing
        blk = slot // block_size
        off = slot % block_size
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        k = tl.load(key_ptr + token * stride_k_tok + head * stride_k_head + d * stride_k_d, mask=mask, other=0.0)
        v = tl.load(value_ptr + token * stride_v_tok + head * stride_v_head + d * stride_v_d, mask=mask, other=0.0)
        scale_off = blk * stride_ks_blk + off * stride_ks_tok + head * stride_ks_head   # (V's view: same strides)
        _quantize_store(k, key_cache_ptr + blk * stride_kc_blk + off * stride_kc_tok + head * stride_kc_head
                        + d * stride_kc_d, mask, k_scale_ptr + scale_off, k_scale, PER_ROW, IS_INT8, QMAX)
        _quantize_store(v, value_cache_ptr + blk * stride_vc_blk + off * stride_vc_tok + head * stride_vc_head
                        + d * stride_vc_d, mask, v_scale_ptr + scale_off, v_scale, PER_ROW, IS_INT8, QMAX)


def _reshape_and_cache_quant(key, value, key_cache, value_cache, slot_mapping, kv_quant: KVQuant) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    k_scales, v_scales, *scale_strides, k_scale, v_scale = kernel_scale_args(key_cache, value_cache, head_dim, kv_quant)
    as_stored = (lambda c: c.view(torch.uint8)) if kv_quant.storage_dtype == torch.float8_e4m3fn else (lambda c: c)
    _reshape_and_cache_quant_kernel[(num_tokens, num_kv_heads)](
        key, value, as_stored(key_cache), as_stored(value_cache), slot_mapping, k_scales, v_scales, k_scale, v_scale,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(), *scale_strides,
        key_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim), PER_ROW=kv_quant.per_token_head,
        IS_INT8=kv_quant.storage_dtype == torch.int8, QMAX=kv_quant.qmax,
    )


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim] (any strides)
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim] (written, any strides)
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
    check_values: bool = True,
    *,
    kv_quant: KVQuant | None = None,   # an 8-bit cache (kv_quant.py): rows quantized as written
) -> None:
    slot_mapping = contiguous_index(slot_mapping)      # the kernel reads storage: check what it reads
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values, kv_quant)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if kv_quant is not None:
        return _reshape_and_cache_quant(key, value, key_cache, value_cache, slot_mapping, kv_quant)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_HD=_next_pow2(num_kv_heads * head_dim),
    )


# ----------------------------------------------------------------------------- decode

@triton.jit
def _scale_8bit_tile(s, v, q, scale_off, t_mask, k_scale_ptr, v_scale_ptr, k_scale, v_scale, KV_QUANT: tl.constexpr):
    """An 8-bit cache's scales on one tile (kv_quant.py): K's multiply the scores after the dot
    (q . (s k) = s (q . k), and an 8-bit number is exact in any float), V's its rows, dequantized
    in the query's dtype as the reference reads them. KV_QUANT 1: the layer's two scales;
    2: one fp32 scale per (token, KV head), at scale_off [TILE] in the rows' scale views."""
    v = v.to(tl.float32)
    if KV_QUANT == 1:
        s = s * k_scale
        v = v * v_scale
    else:
        s = s * tl.load(k_scale_ptr + scale_off, mask=t_mask, other=0.0)[None, :]
        v = v * tl.load(v_scale_ptr + scale_off, mask=t_mask, other=0.0)[:, None]
    return s, v.to(q.dtype)


@triton.jit
def _paged_decode_kernel(
    out_ptr,              # NUM_KV_SPLITS == 1: [num_seqs, num_heads, head_dim]; else fp32 partial acc [num_seqs, num_heads, NUM_KV_SPLITS, head_dim]
    m_ptr, l_ptr,         # NUM_KV_SPLITS > 1: fp32 [num_seqs, num_heads, NUM_KV_SPLITS] running max (log2 units) / sum
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,   # seq_lens: contiguous
    qk_scale,             # softmax scale * log2(e)
    stride_q_seq, stride_q_head, stride_q_d,
    stride_k_blk, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_blk, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_seq, stride_bt_blk,
    stride_o_seq, stride_o_head, stride_o_split,
    num_heads, max_num_blocks, tokens_per_split,
    k_scale_ptr, v_scale_ptr,   # KV_QUANT 2: [num_blocks, block_size, num_kv_heads] fp32 views of the rows' scales
    stride_ks_blk, stride_ks_tok, stride_ks_head,
    k_scale, v_scale,           # KV_QUANT 1: the layer's per-tensor scales
    QUERIES_PER_KV: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr = 0,  # 0: a float cache; 1: 8 bits x per-tensor scales; 2: 8 bits x per-row scales
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)                       # query heads of this KV head (padded to >= 16 for tl.dot)
    g_mask = offs_g < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :] * stride_q_d,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)            # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    # A seq_len the block table cannot hold would make us read the next row's block ids:
    # read nothing and return NaN instead (the host-side check raises before we get here).
    too_long = seq_len > max_num_blocks * BLOCK_SIZE
    start = split * tokens_per_split
    # The last split runs to seq_len whatever tokens_per_split says: a stale max_seq_len
    # hint can then only unbalance the splits, never drop tokens.
    end = tl.where(split == NUM_KV_SPLITS - 1, seq_len, tl.minimum(seq_len, start + tokens_per_split))
    end = tl.where(too_long, start, end)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)   # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_G], tl.float32)                 # running sum of 2^(score - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)        # running sum of 2^(score - m_i) * v
    ### BEGIN SOLUTION
    for tile_start in range(start, end, TILE):
        offs_t = tile_start + tl.arange(0, TILE)          # logical token positions
        t_mask = offs_t < end
        # The paging: logical block t // B -> physical block, then row t % B inside it.
        blk = tl.load(bt_row + (offs_t // BLOCK_SIZE) * stride_bt_blk, mask=t_mask, other=0).to(tl.int64)
        row = offs_t % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + blk[:, None] * stride_k_blk + row[:, None] * stride_k_tok
                    + kv_head * stride_k_head + offs_d[None, :] * stride_k_d, mask=kv_mask, other=0.0)  # [TILE, BLOCK_D]
        v = tl.load(v_cache_ptr + blk[:, None] * stride_v_blk + row[:, None] * stride_v_tok
                    + kv_head * stride_v_head + offs_d[None, :] * stride_v_d, mask=kv_mask, other=0.0)  # [TILE, BLOCK_D]
        if KV_QUANT != 0:
            k = k.to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale                   # [BLOCK_G, TILE]
        if KV_QUANT != 0:
            s, v = _scale_8bit_tile(s, v, q, blk * stride_ks_blk + row * stride_ks_tok + kv_head * stride_ks_head,
                                    t_mask, k_scale_ptr, v_scale_ptr, k_scale, v_scale, KV_QUANT)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, UPCAST, PRECISION)
    ### END SOLUTION

    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_KV_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (a padding row): l = 0, acc = 0 -> 0
        out = tl.where(too_long, float("nan"), out)
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
                 round_to(out, out_ptr.dtype.element_ty, UPCAST), mask=o_mask)
    else:
        # An empty split (past seq_len) leaves m = -inf, l = 0: the reduce gives it weight 0.
        # A too-long row gets m = 0, l = 1, acc = NaN, so the NaN survives the reduce.
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + split * stride_o_split + offs_d[None, :],
                 tl.where(too_long, float("nan"), acc), mask=o_mask)
        ml_offs = (seq * num_heads + heads) * NUM_KV_SPLITS + split
        tl.store(m_ptr + ml_offs, tl.where(too_long, 0.0, m_i), mask=g_mask)
        tl.store(l_ptr + ml_offs, tl.where(too_long, 1.0, l_i), mask=g_mask)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr, acc_ptr, m_ptr, l_ptr,     # out [num_seqs, num_heads, head_dim]; partials as written above
    stride_o_seq, stride_o_head,
    num_heads,
    NUM_KV_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_KV_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = (seq * num_heads + head) * NUM_KV_SPLITS
    ### BEGIN SOLUTION
    m = tl.load(m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))     # [BLOCK_S] log2 units
    l = tl.load(l_ptr + base + offs_s, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)          # [BLOCK_S, BLOCK_D]
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)   # all splits empty (seq_len 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)                # rescale each split to the global max
    num = tl.sum(w[:, None] * acc, 0)                     # [BLOCK_D]
    den = tl.sum(w * l, 0)
    out = num / tl.where(den > 0, den, 1.0)
    ### END SOLUTION
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d,
             round_to(out, out_ptr.dtype.element_ty, UPCAST), mask=d_mask)


@triton.jit
def _paged_decode_kernel_v2(
    out_ptr, m_ptr, l_ptr,   # as in _paged_decode_kernel
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,   # seq_lens: contiguous
    qk_scale,
    stride_q_seq, stride_q_head, stride_q_d,
    stride_k_blk, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_blk, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_seq, stride_bt_blk,
    stride_o_seq, stride_o_head, stride_o_split,
    num_heads, max_num_blocks, tokens_per_split,   # tokens_per_split: a multiple of TILE_TOKENS
    k_scale_ptr, v_scale_ptr, stride_ks_blk, stride_ks_tok, stride_ks_head, k_scale, v_scale,   # as in v1
    num_kv_splits,                  # a runtime value (v1: a constexpr), so changing it never recompiles
    QUERIES_PER_KV: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,       # rows of the tile per block id: next_pow2(BLOCK_SIZE), or TILE_TOKENS when a tile is a slice of one block
    BLOCKS_PER_TILE: tl.constexpr,  # block ids loaded per iteration (a power of two)
    TILE_TOKENS: tl.constexpr,      # KV tokens per iteration: BLOCKS_PER_TILE * min(BLOCK_SIZE, BLOCK_ROWS)
    SPLIT_KV: tl.constexpr,         # num_kv_splits > 1: write fp32 partials for _split_kv_reduce_kernel
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr = 0,     # as in v1
):
    """v2: one block-table load per KV BLOCK, not per token. A tile is BLOCKS_PER_TILE whole
    blocks (or one slice of a block bigger than the tile) laid out as BLOCK_ROWS rows each;
    rows past BLOCK_SIZE (a block size that is not a power of two) are masked padding.
    Everything else (GQA, split-KV, numerics, too-long rows) is v1's."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :] * stride_q_d,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)            # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    too_long = seq_len > max_num_blocks * BLOCK_SIZE
    start = split * tokens_per_split
    end = tl.where(split == num_kv_splits - 1, seq_len, tl.minimum(seq_len, start + tokens_per_split))
    end = tl.where(too_long, start, end)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_k_head     # scalar 64-bit bases: the
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_v_head     # head offset is added once
    ks_head = kv_head.to(tl.int64) * stride_ks_head                 # (an 8-bit cache's scales: likewise)

    # Row i of a tile: block j = i // BLOCK_ROWS of the tile, row r = i % BLOCK_ROWS inside it.
    TILE_ROWS: tl.constexpr = BLOCKS_PER_TILE * BLOCK_ROWS
    offs_i = tl.arange(0, TILE_ROWS)
    tile_blk = offs_i // BLOCK_ROWS
    tile_row = offs_i % BLOCK_ROWS
    row_valid = tile_row < BLOCK_SIZE                     # padding rows of a non-power-of-two block
    offs_j = tl.arange(0, BLOCKS_PER_TILE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(start, end, TILE_TOKENS):
        first_blk = tile_start // BLOCK_SIZE
        in_blk = tile_start % BLOCK_SIZE                  # 0 unless a tile is a slice of one block
        # One load per block id, then each row picks its block's id (a broadcast, no memory).
        j_mask = (first_blk + offs_j) * BLOCK_SIZE < end
        blk_ids = tl.load(bt_row + (first_blk + offs_j) * stride_bt_blk, mask=j_mask, other=0)   # [BLOCKS_PER_TILE]
        blk = tl.reshape(tl.broadcast_to(blk_ids[:, None], [BLOCKS_PER_TILE, BLOCK_ROWS]), [TILE_ROWS])
        blk = blk.to(tl.int64)
        row = in_blk + tile_row
        offs_t = (first_blk + tile_blk) * BLOCK_SIZE + row  # logical token positions
        t_mask = row_valid & (offs_t < end)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + blk[:, None] * stride_k_blk + row[:, None] * stride_k_tok + offs_d[None, :] * stride_k_d,
                    mask=kv_mask, other=0.0)                                   # [TILE_ROWS, BLOCK_D]
        v = tl.load(v_base + blk[:, None] * stride_v_blk + row[:, None] * stride_v_tok + offs_d[None, :] * stride_v_d,
                    mask=kv_mask, other=0.0)
        if KV_QUANT != 0:
            k = k.to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale       # [BLOCK_G, TILE_ROWS]
        if KV_QUANT != 0:
            s, v = _scale_8bit_tile(s, v, q, ks_head + blk * stride_ks_blk + row * stride_ks_tok, t_mask,
                                    k_scale_ptr, v_scale_ptr, k_scale, v_scale, KV_QUANT)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, UPCAST, PRECISION)

    o_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT_KV:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = tl.where(too_long, float("nan"), out)
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
                 round_to(out, out_ptr.dtype.element_ty, UPCAST), mask=o_mask)
    else:
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + split * stride_o_split + offs_d[None, :],
                 tl.where(too_long, float("nan"), acc), mask=o_mask)
        ml_offs = (seq * num_heads + heads) * num_kv_splits + split
        tl.store(m_ptr + ml_offs, tl.where(too_long, 0.0, m_i), mask=g_mask)
        tl.store(l_ptr + ml_offs, tl.where(too_long, 1.0, l_i), mask=g_mask)


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile: int = DEFAULT_TILE) -> int:
    """Split-KV only when (request, KV head) programs alone cannot fill the GPU and the
    contexts are long enough that each split still has real work (flash-decoding's rule)."""
    programs = num_seqs * num_kv_heads
    if programs >= SPLIT_TARGET_PROGRAMS or max_seq_len <= MIN_TOKENS_PER_SPLIT:
        return 1
    by_occupancy = -(-SPLIT_TARGET_PROGRAMS // max(programs, 1))
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, 64))


# ----------------------------------------------------------------------------- decode launch configs

DECODE_VERSIONS = ("v1", "v2")


@dataclass(frozen=True)
class DecodeConfig:
    """How one decode call is launched. Every field is a keyword of `paged_decode_attention`.

    version       "v1": `_paged_decode_kernel`, one block-table load per TOKEN (the course kernel);
                  "v2": `_paged_decode_kernel_v2`, one block-table load per BLOCK, several blocks a tile.
    tile          KV tokens per loop iteration (v1: a power of two >= 16; v2: see `v2_tile_layout`).
    num_warps     warps per program (Triton's launch option).
    num_stages    software-pipelining depth of the KV loop (Triton's launch option: loads of the
                  next num_stages - 1 tiles are in flight while this one is computed).
    num_kv_splits split-KV factor; None: `choose_num_kv_splits` at call time.
    """
    version: str = "v2"
    tile: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_kv_splits: int | None = None


# The launch before this rung existed, kept for the record (benchmark column "triton:v1-tile16").
V1_TILE16 = DecodeConfig(version="v1", tile=16, num_warps=4, num_stages=3)   # Triton's default warps/stages


def v2_tile_layout(tile: int, block_size: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCKS_PER_TILE, TILE_TOKENS) of v2 for `tile` KV tokens a step, or ValueError.

    * tile = block_size * 2^k: 2^k whole blocks a step; each block fills next_pow2(block_size)
      rows (a block of 12 tokens: 16 rows, 4 masked), so any block size works;
    * tile = a power of two dividing block_size: one slice of one block a step (block size 256).
    The tile must have >= 16 rows (tl.dot's minimum)."""
    if tile >= block_size and tile % block_size == 0 and (tile // block_size) & (tile // block_size - 1) == 0:
        rows, blocks = _next_pow2(block_size), tile // block_size
    elif tile < block_size and block_size % tile == 0 and tile & (tile - 1) == 0:
        rows, blocks = tile, 1
    else:
        raise ValueError(f"decode v2 needs tile = block_size * 2^k or a power of two dividing block_size; "
                         f"got tile={tile}, block_size={block_size} (use version='v1' for any power-of-two tile)")
    if rows * blocks < 16:
        raise ValueError(f"decode v2 needs >= 16 rows a tile (tl.dot); tile={tile} with block_size={block_size} "
                         f"has {rows * blocks}")
    return rows, blocks, tile


def v2_tile_for(block_size: int, target_tokens: int) -> int:
    """The v2 tile nearest below `target_tokens` that `v2_tile_layout` accepts for this block size."""
    if block_size >= target_tokens:        # slices of one block (largest power of two dividing block_size)
        tile = min(target_tokens, block_size & -block_size)
        return tile if tile >= 16 else block_size
    blocks = 1 << ((target_tokens // block_size).bit_length() - 1)       # floor to a power of two
    while blocks * _next_pow2(block_size) < 16:
        blocks *= 2
    return blocks * block_size


# Per-iteration KV tile (tokens) by element size: a 64-token tile of K + V at head_dim 128 in
# 16-bit is 32 KiB per program per step (v1's 16 tokens: 8 KiB, too little in flight to hide
# HBM latency, with the block-table lookup on the critical path of every step). fp32 keeps
# 32 tokens (same bytes). Tile, warps and stages: from one H200 measurement of v1
# (benchmarks/results/triton_decode_sweep_h200.json); v2 itself is unmeasured: `--sweep` times its grid.
DECODE_TILE_TOKENS = {2: 64, 4: 32}
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 4       # measured (H200, v1 tile 64, 4 warps): 4 stages 0.91x-1.01x SDPA, 2 stages 0.70x-0.92x


@functools.lru_cache(maxsize=4096)     # called per decode step with few distinct arguments
def choose_decode_config(num_seqs: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                         dtype: torch.dtype, block_size: int = 16) -> DecodeConfig:
    """The launch for one decode call (vLLM: the tile/warps picks in triton_unified_attention).

    Rule (tile / warps / stages measured for v1 on an H200, the rest from reasoning;
    `python -m benchmarks.bench_paged_attention --sweep` on a GPU measures v2's grid and these
    constants are to be reset from it):
      * v2 with `v2_tile_for`'s tile (whole blocks, or slices of a big power-of-two block)
        when the block size is >= 8 and padding it to a power of two wastes <= 1/4 of the rows
        (12 -> 16 yes, 5 -> 8 no) and the tile has at most twice the target's rows (200 -> 256
        no); otherwise v1, whose tile ignores block bounds (block size 1: v2 would load one
        block id per row anyway, with more registers);
      * tile: DECODE_TILE_TOKENS[element size] tokens (head_dim > 128: half, for registers),
        rounded by `v2_tile_for` to what the block size allows. It does not depend on the
        context length, so an engine compiles few variants (a short context wastes masked
        rows, and a split count change is the only per-call recompile: NUM_KV_SPLITS);
      * num_warps DECODE_NUM_WARPS, num_stages DECODE_NUM_STAGES;
      * num_kv_splits: `choose_num_kv_splits` (None: decided at call time from the same inputs).
    """
    target = DECODE_TILE_TOKENS.get(dtype.itemsize, 64)
    if head_dim > 128:
        target //= 2
    splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_seq_len, target)
    stages = DECODE_NUM_STAGES
    tile = v2_tile_for(block_size, target)
    rows, blocks, _ = v2_tile_layout(tile, block_size)
    padded = _next_pow2(block_size)
    if block_size >= 8 and 4 * block_size >= 3 * padded and rows * blocks <= 2 * max(target, 16):
        return DecodeConfig("v2", tile, DECODE_NUM_WARPS, stages, splits)
    # v1's per-row 64-bit addresses cost more registers: half the tile (no spills, even unaligned)
    return DecodeConfig("v1", max(16, target // 2), DECODE_NUM_WARPS, stages, splits)


def quantized_cache_config(config: DecodeConfig, head_dim: int, block_size: int) -> DecodeConfig:
    """The launch for an 8-bit cache: each tile is converted and scaled in registers, which the
    16-bit launch's pipeline stages hold. As chapter 05's kernels do: tiles of at most 32 keys (16
    at head_dim > 64) and one stage (spill-free on sm_90: test_triton_compile.py)."""
    tile = min(config.tile, 32 if head_dim <= 64 else 16)
    if config.version == "v2":
        tile = v2_tile_for(block_size, tile)
    return dataclasses.replace(config, tile=tile, num_stages=1)


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim] (any strides)
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim] (any strides)
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32/int64 (any strides)
    seq_lens: torch.Tensor,      # [num_seqs] int32/int64
    scale: float,
    check_values: bool = True,
    *,
    max_seq_len: int | None = None,    # host-side max of seq_lens (from AttentionMetadata); read from seq_lens if None
    num_kv_splits: int | None = None,  # None: choose_num_kv_splits; 1: one program per (request, KV head)
    tile: int | None = None,           # the launch (DecodeConfig's fields); None: choose_decode_config's
    num_warps: int | None = None,
    num_stages: int | None = None,
    version: str | None = None,        # "v1" | "v2"
    config: DecodeConfig | None = None,  # a whole config (the keywords above override its fields)
    kv_quant: KVQuant | None = None,   # an 8-bit cache (kv_quant.py): rows dequantized in the loop
) -> torch.Tensor:               # [num_seqs, num_heads, head_dim]
    seq_lens = contiguous_index(seq_lens)
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, check_values, max_seq_len, kv_quant)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if config is None:
        config = choose_decode_config(num_seqs, num_kv_heads, max_seq_len, head_dim, query.dtype, block_size)
        if kv_quant is not None:
            config = quantized_cache_config(config, head_dim, block_size)
    version = config.version if version is None else version
    tile = config.tile if tile is None else tile
    num_warps = config.num_warps if num_warps is None else num_warps
    num_stages = config.num_stages if num_stages is None else num_stages
    if num_kv_splits is None:
        num_kv_splits = config.num_kv_splits
    if version not in DECODE_VERSIONS:
        raise ValueError(f"version must be one of {DECODE_VERSIONS}, got {version!r}")
    if version == "v1" and (tile < 16 or tile & (tile - 1)):
        raise ValueError(f"tile must be a power of two >= 16 (tl.dot), got {tile}")
    if version == "v2":
        block_rows, blocks_per_tile, tile = v2_tile_layout(tile, block_size)
    if num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise ValueError(f"num_warps must be a power of two <= 16 and num_stages >= 1, got {num_warps}, {num_stages}")
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_seq_len, tile)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    # Every split gets a whole number of tiles; splits past a request's seq_len are empty.
    tokens_per_split = max(tile, -(-max(max_seq_len, 1) // (num_kv_splits * tile)) * tile)
    group = num_heads // num_kv_heads
    up = upcast(query.dtype)
    constexprs = dict(QUERIES_PER_KV=group, BLOCK_G=max(16, _next_pow2(group)),
                      HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)),
                      BLOCK_SIZE=block_size,
                      UPCAST=up, PRECISION=dot_precision(query.dtype), KV_QUANT=kv_quant_mode(kv_quant),
                      num_warps=num_warps, num_stages=num_stages)
    scales = kernel_scale_args(key_cache, value_cache, head_dim, kv_quant)
    if version == "v1":
        kernel, tail = _paged_decode_kernel, scales
        constexprs.update(TILE=tile, NUM_KV_SPLITS=num_kv_splits)
    else:
        kernel, tail = _paged_decode_kernel_v2, (*scales, num_kv_splits)
        constexprs.update(BLOCK_ROWS=block_rows, BLOCKS_PER_TILE=blocks_per_tile, TILE_TOKENS=tile,
                          SPLIT_KV=num_kv_splits > 1)
    common = (query, key_cache, value_cache, block_tables, seq_lens, scale * LOG2E,
              *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride())
    grid = (num_seqs, num_kv_heads, num_kv_splits)
    if num_kv_splits == 1:
        kernel[grid](out, out, out, *common, out.stride(0), out.stride(1), 0,
                     num_heads, block_tables.shape[1], tokens_per_split, *tail, **constexprs)
        return out
    # One fp32 workspace for the partials (one allocation, not three): acc, then m, then l.
    n = num_seqs * num_heads * num_kv_splits
    work = torch.empty(n * (head_dim + 2), dtype=torch.float32, device=query.device)
    acc = work[:n * head_dim].view(num_seqs, num_heads, num_kv_splits, head_dim)
    m = work[n * head_dim:n * (head_dim + 1)].view(num_seqs, num_heads, num_kv_splits)
    l = work[n * (head_dim + 1):].view(num_seqs, num_heads, num_kv_splits)
    kernel[grid](acc, m, l, *common, acc.stride(0), acc.stride(1), acc.stride(2),
                 num_heads, block_tables.shape[1], tokens_per_split, *tail, **constexprs)
    _split_kv_reduce_kernel[(num_seqs, num_heads)](
        out, acc, m, l, out.stride(0), out.stride(1), num_heads,
        NUM_KV_SPLITS=num_kv_splits, BLOCK_S=_next_pow2(num_kv_splits),
        HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim), UPCAST=up)
    return out


# ----------------------------------------------------------------------------- prefill

@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, query_start_loc_ptr,   # query_start_loc: contiguous
    qk_scale,             # softmax scale * log2(e)
    stride_q_tok, stride_q_head, stride_q_d, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_tok, stride_v_head, stride_v_d, stride_o_tok, stride_o_head,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - tl.load(query_start_loc_ptr + seq)).to(tl.int32)
    kv_head = head // QUERIES_PER_KV

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)     # query positions inside the prompt
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # 64-bit scalar base pointers per sequence, 32-bit offsets inside it (a prompt's rows span
    # < 2**31 elements): 2-D tensors of 64-bit pointers would cost twice the registers.
    q_ptr += start * stride_q_tok + head * stride_q_head
    k_ptr += start * stride_k_tok + kv_head * stride_k_head
    v_ptr += start * stride_v_tok + kv_head * stride_v_head
    out_ptr += start * stride_o_tok + head * stride_o_head
    q = tl.load(q_ptr + offs_m[:, None] * stride_q_tok + offs_d[None, :] * stride_q_d,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)             # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: this tile's last query is at (m_block + 1) * BLOCK_M - 1, so later keys are never needed.
    hi = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
    ### BEGIN SOLUTION
    for n_start in range(0, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offs_n[:, None] * stride_k_tok + offs_d[None, :] * stride_k_d,
                    mask=kv_mask, other=0.0)                                   # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + offs_n[:, None] * stride_v_tok + offs_d[None, :] * stride_v_d, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale       # [BLOCK_M, BLOCK_N]
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None]), s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, UPCAST, PRECISION)
    ### END SOLUTION
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_o_tok + offs_d[None, :],
             round_to(out, out_ptr.dtype.element_ty, UPCAST), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim] (any strides)
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int, CONTIGUOUS (the callers checked it)
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Causal varlen attention of each prompt over itself (no cache involved)."""
    if not query_start_loc.is_contiguous():
        raise ValueError("prefill_attention reads query_start_loc by its storage: pass a contiguous tensor")
    block_m, block_n = PREFILL_BLOCKS[query.dtype]
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        out, query, key, value, query_start_loc, scale * LOG2E,
        *query.stride(), *key.stride(), *value.stride(), out.stride(0), out.stride(1),
        QUERIES_PER_KV=num_heads // key.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=max(16, _next_pow2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=upcast(query.dtype), PRECISION=dot_precision(query.dtype))
    return out


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,      # (written)
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = skip
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,
    kv_quant: KVQuant | None = None,   # an 8-bit cache: the write quantizes (the attention uses fresh K/V)
) -> torch.Tensor:
    slot_mapping, query_start_loc = contiguous_index(slot_mapping), contiguous_index(query_start_loc)
    check_prefill_args(query, key, value, key_cache, value_cache, slot_mapping, query_start_loc, check_values,
                       max_query_len, kv_quant)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=False,  # checked just above
                      kv_quant=kv_quant)
    return prefill_attention(query, key, value, query_start_loc, scale, max_query_len)
