"""Unified paged attention as Triton kernels: one launch for a whole mixed batch.

Mirrors vLLM's `vllm/attention/ops/triton_unified_attention.py`: `unified_attention`
launches `kernel_unified_attention_2d` (one program per (query tile, KV head), used for
every batch with prefill tokens) or, for decode batches too small to fill the GPU,
`kernel_unified_attention_3d` (the same work split along the KV axis into segments) +
`reduce_segments` (merges the segments' partial softmax states). Same signature as the
reference oracle in `attention_reference.py`.

Why a query *tile* packs `BLOCK_Q` positions x the GQA group: the query heads that share
one KV head read the same K/V tiles, so stacking them as rows of one matrix loads each
K/V tile once per group instead of once per head, and turns a decode step (1 query
position) into a [GROUP, head_dim] x [head_dim, TILE_N] matmul that `tl.dot` (tensor
cores) can run. Row r of a tile is (query position r // GROUP, query head
kv_head * GROUP + r % GROUP).

Why no host-side metadata: the grid size is an upper bound from shapes alone
(`num_tokens // BLOCK_Q + num_seqs` tiles, see `_find_seq_idx`), and each program finds
its request by binary search over `query_start_loc` on the device. Nothing is read back
to the CPU, so the launch can be captured in a CUDA graph.

Why keys are addressed one by one through the block table (not block by block): a KV
tile of TILE_N keys may span many small blocks or a fraction of a big one, so any block
size 1..N works with the same tile shape, and tl.dot always sees >= 16-wide tiles.

Numerics: chapter 01's one convention (`paged_attention/triton_common.py`): log2-unit
scores (log2(e) folded into the scale), fp32 online-softmax state, P rounded to V's dtype
for the second matmul and summed as rounded into l — this kernel calls chapter 01's
`online_softmax_update` and `round_to`, it has no softmax of its own. fp32 inputs use
`input_precision="ieee"` (on the GPU fp32 tl.dot would otherwise use TF32 and miss the
fp32 tolerance). Under the Triton interpreter 16-bit dots are upcast to fp32 (UPCAST).

Views: query, caches and block_tables are read through all their strides; seq_lens and
query_start_loc are made contiguous before they are checked (`contiguous_index`), so the
checks validate exactly what the kernel reads.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from paged_attention.checks import SUPPORTED_DTYPES, check_paged_attention_args, contiguous_index
from paged_attention.kv_quant import KVQuant, kernel_scale_args, kv_quant_mode
from paged_attention.triton_common import LOG2E, dot_precision, interpreting, online_softmax_update, round_to, upcast

MAX_HEAD_DIM = 256
TILE_N = 32                 # keys per inner-loop step (tl.dot needs >= 16 on the GPU)
# Pure 16-bit decode: bigger KV tiles and a 4-deep software pipeline. Decode attention only streams
# K/V, so what counts is bytes in flight: on an H200 (2026-11-28, chapter 01's decode kernel, the same
# loop shape, benchmarks/results/triton_decode_sweep_h200.json) 64-key tiles with num_stages=4 read
# 0.91x / 1.01x of SDPA's bandwidth at batch 256 x 1k / 128 x 8k, where 16-key tiles with Triton's
# default launch read 0.55x / 0.60x.
DECODE_TILE_N, DECODE_NUM_STAGES, DECODE_NUM_WARPS = 64, 4, 4
DEFAULT_NUM_SEGMENTS = 16   # split-KV segments for the 3-D kernel (vLLM's default)
SPLIT_KV_MAX_PROGRAMS = 128  # below this many 2-D programs a decode batch underfills an H100 (132 SMs)


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Which request owns global query tile `q_tile_idx`?

    Request i's tiles are numbered from `query_start_loc[i] // BLOCK_Q + i`: the `+ i`
    leaves room for the extra, partial tile each request may need, so numbers never
    collide and the total is at most `num_tokens // BLOCK_Q + num_seqs` — a bound known
    from shapes, without reading query lengths on the host. Binary search for the last
    request whose first tile is <= q_tile_idx.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_kv_range(
    acc, m_i, l_i,                  # running state: [BLOCK_M, HEAD_DIM_PADDED], [BLOCK_M], [BLOCK_M] fp32
    q,                              # [BLOCK_M, HEAD_DIM_PADDED]
    q_abs_pos,                      # [BLOCK_M] absolute position of each row's token (context_len + j)
    row_valid,                      # [BLOCK_M] rows that are real (query position, head) pairs
    key_cache_ptr, value_cache_ptr,
    block_table_row_ptr,            # this request's row of block_tables
    stride_bt_blk,                  # block_tables.stride(1)
    kv_head, kv_start, kv_end,      # attend to keys kv_start <= pos < kv_end of this request
    stride_kc_blk, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_blk, stride_vc_slot, stride_vc_head, stride_vc_dim,
    qk_scale,                       # softmax scale * log2(e)
    k_scale_ptr, v_scale_ptr,       # KV_QUANT 2: [num_blocks, block_size, num_kv_heads] fp32 views of the rows' scales
    stride_ks_blk, stride_ks_slot, stride_ks_head,
    k_scale, v_scale,               # KV_QUANT 1: the layer's per-tensor scales
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,         # 0: a float cache; 1: 8 bits x per-tensor scales; 2: 8 bits x per-row scales
):
    """Online softmax over keys [kv_start, kv_end): the loop both kernels share."""
    ### BEGIN SOLUTION
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    d_mask = offs_d < HEAD_DIM
    for tile_start in range(kv_start, kv_end, TILE_N):
        k_pos = tile_start + offs_n                                       # [TILE_N] logical key positions
        k_in = k_pos < kv_end
        # Logical position -> (physical block, slot): masked so neither the block table
        # nor the cache is read past this request's keys (junk there never enters).
        block = tl.load(block_table_row_ptr + (k_pos // BLOCK_SIZE) * stride_bt_blk, mask=k_in, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k_off = block * stride_kc_blk + slot * stride_kc_slot + kv_head * stride_kc_head     # [TILE_N]
        v_off = block * stride_vc_blk + slot * stride_vc_slot + kv_head * stride_vc_head
        k = tl.load(key_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_kc_dim,
                    mask=d_mask[:, None] & k_in[None, :], other=0.0)        # [HEAD_DIM_PADDED, TILE_N]
        v = tl.load(value_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vc_dim,
                    mask=k_in[:, None] & d_mask[None, :], other=0.0)        # [TILE_N, HEAD_DIM_PADDED]
        if KV_QUANT != 0:
            # An 8-bit number is exact in any 16-bit float: q . (s k) = s (q . k), the scale after the dot.
            k = k.to(q.dtype)
            v = v.to(tl.float32)
        elif UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale             # [BLOCK_M, TILE_N] (log2 units)
        if KV_QUANT == 1:
            s = s * k_scale
            v = (v * v_scale).to(q.dtype)       # V dequantized in the query's dtype, as the reference reads it
        if KV_QUANT == 2:
            scale_off = block * stride_ks_blk + slot * stride_ks_slot + kv_head * stride_ks_head   # [TILE_N]
            s = s * tl.load(k_scale_ptr + scale_off, mask=k_in, other=0.0)[None, :]
            v = (v * tl.load(v_scale_ptr + scale_off, mask=k_in, other=0.0)[:, None]).to(q.dtype)
        # Causal mask offset by the context: row token at q_abs_pos sees keys <= q_abs_pos.
        visible = row_valid[:, None] & k_in[None, :] & (k_pos[None, :] <= q_abs_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, UPCAST, PRECISION)   # chapter 01's step
    ### END SOLUTION
    return acc, m_i, l_i


@triton.jit
def _load_query_tile(
    query_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, q_tile_idx, kv_head,
    stride_q_tok, stride_q_head, stride_q_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, UPCAST: tl.constexpr,
):
    """Locate this program's tile and load it.

    Returns q [BLOCK_M, HEAD_DIM_PADDED]; per row its token index, query head, absolute
    position and validity; the request's index; kv_end, the causal key bound of the
    tile's last row; and whether the tile holds any query at all.
    """
    ### BEGIN SOLUTION
    seq_idx = _find_seq_idx(query_start_loc_ptr, q_tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_tile_local = q_tile_idx - (q_start // BLOCK_Q + seq_idx)
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    q_pos = q_tile_local * BLOCK_Q + offs_m // GROUP                   # [BLOCK_M] position within the request
    head = kv_head * GROUP + offs_m % GROUP                            # [BLOCK_M] query head
    # BLOCK_M need not be a multiple of GROUP (e.g. 16 rows, GROUP 3): the last rows
    # would spill into the next tile's positions, so they are masked off.
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_pos < query_len)
    token = (q_start + q_pos).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + offs_d[None, :] * stride_q_dim,
                mask=row_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Keys any row of this tile may see (causal): up to its last real position.
    last_pos = tl.minimum((q_tile_local + 1) * BLOCK_Q, query_len) - 1
    kv_end = tl.minimum(context_len + last_pos + 1, seq_len)
    has_rows = q_tile_local * BLOCK_Q < query_len
    ### END SOLUTION
    return q, token, head, context_len + q_pos, row_valid, seq_idx, kv_end, has_rows


@triton.jit
def kernel_unified_attention_2d(
    out_ptr,                        # [num_tokens, num_heads, head_dim]
    query_ptr,                      # [num_tokens, num_heads, head_dim]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,               # [num_seqs, max_blocks] (any strides)
    seq_lens_ptr,                   # [num_seqs] contiguous
    query_start_loc_ptr,            # [num_seqs + 1] contiguous
    num_seqs, qk_scale,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_o_tok, stride_o_head, stride_o_dim,
    stride_kc_blk, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_blk, stride_vc_slot, stride_vc_head, stride_vc_dim,
    stride_bt_seq, stride_bt_blk,
    k_scale_ptr, v_scale_ptr, stride_ks_blk, stride_ks_slot, stride_ks_head, k_scale, v_scale,   # an 8-bit cache's
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr,
):
    """grid = (num_tokens // BLOCK_Q + num_seqs, num_kv_heads): one query tile x one KV head."""
    kv_head = tl.program_id(1)
    q, token, head, q_abs_pos, row_valid, seq_idx, kv_end, has_rows = _load_query_tile(
        query_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, tl.program_id(0), kv_head,
        stride_q_tok, stride_q_head, stride_q_dim,
        GROUP, BLOCK_M, BLOCK_Q, HEAD_DIM, HEAD_DIM_PADDED, UPCAST)
    if has_rows:
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _attend_kv_range(
            acc, m_i, l_i, q, q_abs_pos, row_valid, key_cache_ptr, value_cache_ptr,
            block_tables_ptr + seq_idx.to(tl.int64) * stride_bt_seq, stride_bt_blk, kv_head, 0, kv_end,
            stride_kc_blk, stride_kc_slot, stride_kc_head, stride_kc_dim,
            stride_vc_blk, stride_vc_slot, stride_vc_head, stride_vc_dim,
            qk_scale, k_scale_ptr, v_scale_ptr, stride_ks_blk, stride_ks_slot, stride_ks_head, k_scale, v_scale,
            BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PADDED, UPCAST, PRECISION, KV_QUANT)
        l_safe = tl.where(row_valid, l_i, 1.0)         # padding rows: avoid 0/0 (never stored)
        out = acc / l_safe[:, None]
        offs_d = tl.arange(0, HEAD_DIM_PADDED)
        tl.store(out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head
                 + offs_d[None, :] * stride_o_dim,
                 round_to(out, out_ptr.dtype.element_ty, UPCAST),
                 mask=row_valid[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def kernel_unified_attention_3d(
    segm_out_ptr,                   # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32, unnormalised
    segm_max_ptr,                   # [num_tokens, num_heads, NUM_SEGMENTS] fp32 (log2 units)
    segm_expsum_ptr,                # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    query_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, qk_scale,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_kc_blk, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_blk, stride_vc_slot, stride_vc_head, stride_vc_dim,
    stride_bt_seq, stride_bt_blk,
    k_scale_ptr, v_scale_ptr, stride_ks_blk, stride_ks_slot, stride_ks_head, k_scale, v_scale,   # an 8-bit cache's
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr,
):
    """grid = (tiles, num_kv_heads, NUM_SEGMENTS): the 2-D kernel's work split along the keys.

    Why: a decode batch of a few long sequences gives the 2-D grid only
    num_seqs * num_kv_heads programs — a handful of SMs streaming a long KV each. Cutting
    each request's keys into NUM_SEGMENTS ranges multiplies the parallelism; each
    segment writes its partial state (unnormalised acc, max, exp-sum) and
    `reduce_segments` merges them. Every segment writes its state, even an empty one
    (max -inf, sum 0), so the reduce never reads uninitialised memory.
    """
    kv_head = tl.program_id(1)
    segm = tl.program_id(2)
    q, token, head, q_abs_pos, row_valid, seq_idx, kv_end, has_rows = _load_query_tile(
        query_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, tl.program_id(0), kv_head,
        stride_q_tok, stride_q_head, stride_q_dim,
        GROUP, BLOCK_M, BLOCK_Q, HEAD_DIM, HEAD_DIM_PADDED, UPCAST)
    if has_rows:
        seq_len = tl.load(seq_lens_ptr + seq_idx)
        # Segments are whole tiles of the request's full KV (same split for every tile of
        # the request); the causal bound kv_end then trims them per tile.
        tiles_per_segm = tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SEGMENTS)
        kv_start = segm * tiles_per_segm * TILE_N
        kv_stop = tl.minimum(kv_start + tiles_per_segm * TILE_N, kv_end)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _attend_kv_range(
            acc, m_i, l_i, q, q_abs_pos, row_valid, key_cache_ptr, value_cache_ptr,
            block_tables_ptr + seq_idx.to(tl.int64) * stride_bt_seq, stride_bt_blk, kv_head, kv_start, kv_stop,
            stride_kc_blk, stride_kc_slot, stride_kc_head, stride_kc_dim,
            stride_vc_blk, stride_vc_slot, stride_vc_head, stride_vc_dim,
            qk_scale, k_scale_ptr, v_scale_ptr, stride_ks_blk, stride_ks_slot, stride_ks_head, k_scale, v_scale,
            BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PADDED, UPCAST, PRECISION, KV_QUANT)
        state = (token * NUM_HEADS + head) * NUM_SEGMENTS + segm            # [BLOCK_M] row of the state buffers
        offs_d = tl.arange(0, HEAD_DIM_PADDED)
        tl.store(segm_max_ptr + state, m_i, mask=row_valid)
        tl.store(segm_expsum_ptr + state, l_i, mask=row_valid)
        tl.store(segm_out_ptr + state[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc,
                 mask=row_valid[:, None])


@triton.jit
def reduce_segments(
    out_ptr, segm_out_ptr, segm_max_ptr, segm_expsum_ptr,
    stride_o_tok, stride_o_head, stride_o_dim,
    NUM_HEADS: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, UPCAST: tl.constexpr,
):
    """grid = (num_tokens, num_heads): merge the segments' softmax states.

    With segment maxima m_s, exp-sums l_s and unnormalised outputs o_s (all relative to
    their own m_s), the exact softmax is sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s
    with M = max_s m_s. Empty segments carry m_s = -inf and weigh 0.
    """
    ### BEGIN SOLUTION
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    state = (token * NUM_HEADS + head) * NUM_SEGMENTS + offs_s                  # [NUM_SEGMENTS]
    m_s = tl.load(segm_max_ptr + state)
    l_s = tl.load(segm_expsum_ptr + state)
    o_s = tl.load(segm_out_ptr + state[:, None] * HEAD_DIM_PADDED + offs_d[None, :])  # [NUM_SEGMENTS, D]
    m = tl.max(m_s, axis=0)                       # finite: segment 0 always holds key 0
    w = tl.exp2(m_s - m)                          # [NUM_SEGMENTS], 0 for empty segments
    out = tl.sum(o_s * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    ### END SOLUTION
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + offs_d * stride_o_dim,
             round_to(out, out_ptr.dtype.element_ty, UPCAST), mask=offs_d < HEAD_DIM)


def choose_tiles(group: int, max_query_len: int | None, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_Q query positions, TILE_N keys) per program.

    Decode (max_query_len 1) needs only GROUP rows, but tl.dot wants >= 16, so a decode
    tile is 16 rows (like vLLM). Prefill tiles take up to 16 positions x GROUP heads
    (64 rows for GROUP 3): fewer programs re-reading the same K/V. Unknown max_query_len
    (no host sync allowed) counts as prefill: correct either way, just a tile size.
    Row caps come from the Hopper compile check (ptxas): 16-bit tiles of 64 rows fit up
    to head_dim 128, 32 rows at 256; fp32 with input_precision="ieee" runs tl.dot on FMA
    units with its operands in registers, so fp32 keeps 16 rows (and 16 keys at 256).
    """
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        row_cap, tile_n = 16, (16 if d_pad >= 256 else TILE_N)
    elif max_query_len == 1 and d_pad <= 128:
        row_cap, tile_n = 64, DECODE_TILE_N           # pure decode: stream K/V in bigger tiles
    else:
        row_cap, tile_n = (64 if d_pad <= 128 else 32), TILE_N
    positions = 16 if max_query_len is None else min(max_query_len, 16)
    block_m = max(16, triton.next_power_of_2(group), min(row_cap, triton.next_power_of_2(group * positions)))
    return block_m, block_m // group, tile_n


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int | None,
                         max_seq_len: int | None) -> int:
    """1 = the 2-D kernel; > 1 = split-KV (3-D) with that many segments (a power of two).

    Split only when the caller says the batch is pure decode (max_query_len == 1) and the
    2-D grid would leave most SMs idle, as vLLM does; never more segments than there are
    KV tiles in the longest sequence.
    """
    if max_query_len != 1 or num_seqs * num_kv_heads >= SPLIT_KV_MAX_PROGRAMS:
        return 1
    if max_seq_len is None:
        return DEFAULT_NUM_SEGMENTS
    return min(DEFAULT_NUM_SEGMENTS, triton.next_power_of_2(triton.cdiv(max_seq_len, TILE_N)))


class Launch(NamedTuple):
    """One kernel launch, spelled out so tests can compile exactly what would run."""
    kernel: triton.JITFunction
    grid: tuple[int, ...]
    args: tuple                     # runtime arguments, in the kernel's parameter order
    constexprs: dict
    options: dict = {}              # launch options: num_warps, num_stages (Triton's defaults when empty)


def plan_launches(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale: float, out: torch.Tensor,
    *, max_query_len: int | None = None, max_seq_len: int | None = None,
    num_kv_splits: int | None = None, block_m: int | None = None, tile_n: int | None = None,
    kv_quant: KVQuant | None = None,
) -> list[Launch]:
    """Tile sizes, grids and arguments for one call; reads shapes only, never values."""
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the Triton kernel supports {SUPPORTED_DTYPES}, got {query.dtype}")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernel supports head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    auto_block_m, _, auto_tile_n = choose_tiles(group, max_query_len, head_dim, query.dtype)
    if kv_quant is not None:              # an 8-bit cache converts each tile: 32 keys (16 at head_dim > 64) stay
        auto_tile_n = min(auto_tile_n, 32 if head_dim <= 64 else 16)   # spill-free on sm_90 (test_triton_compile.py)
    block_m = block_m or auto_block_m
    tile_n = tile_n or auto_tile_n
    if block_m < group or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= GROUP={group}, got {block_m}")
    if tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two, got {tile_n}")
    block_q = block_m // group
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len)
    elif num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")

    num_q_tiles = num_tokens // block_q + num_seqs        # an upper bound; see _find_seq_idx
    d_pad = max(16, triton.next_power_of_2(head_dim))
    common = dict(
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=d_pad,
        UPCAST=upcast(query.dtype), PRECISION=dot_precision(query.dtype),
        KV_QUANT=kv_quant_mode(kv_quant),
    )
    qk_scale = scale * LOG2E                              # the kernels use exp2
    # The tuned 16-bit decode launch (4 stages of 64-key tiles); an 8-bit cache's conversions need
    # registers those stages hold, so it keeps Triton's default launch (spill-free: test_triton_compile.py).
    options = (dict(num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES)
               if max_query_len == 1 and query.dtype != torch.float32 and kv_quant is None else {})
    metadata = (block_tables, seq_lens, query_start_loc, num_seqs, qk_scale)
    strides = (*key_cache.stride(), *value_cache.stride(), *block_tables.stride(),
               *kernel_scale_args(key_cache, value_cache, head_dim, kv_quant))
    ### BEGIN SOLUTION
    if num_kv_splits == 1:
        return [Launch(kernel_unified_attention_2d, (num_q_tiles, num_kv_heads),
                       (out, query, key_cache, value_cache, *metadata, *query.stride(), *out.stride(), *strides),
                       common, options)]
    segm_out = torch.empty(num_tokens, num_heads, num_kv_splits, d_pad, dtype=torch.float32, device=query.device)
    segm_max = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=query.device)
    segm_expsum = torch.empty_like(segm_max)
    return [
        Launch(kernel_unified_attention_3d, (num_q_tiles, num_kv_heads, num_kv_splits),
               (segm_out, segm_max, segm_expsum, query, key_cache, value_cache, *metadata, *query.stride(), *strides),
               dict(NUM_HEADS=num_heads, NUM_SEGMENTS=num_kv_splits, **common), options),
        Launch(reduce_segments, (num_tokens, num_heads),
               (out, segm_out, segm_max, segm_expsum, *out.stride()),
               dict(NUM_HEADS=num_heads, NUM_SEGMENTS=num_kv_splits, HEAD_DIM=head_dim, HEAD_DIM_PADDED=d_pad,
                    UPCAST=common["UPCAST"])),
    ]
    ### END SOLUTION


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim] (any strides)
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (any strides)
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32 (any strides)
    seq_lens: torch.Tensor,         # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # an upper bound is enough; picks tile sizes / split-KV
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,   # None: choose_num_kv_splits; 1: force 2-D; 2^k: force 3-D
    block_m: int | None = None,         # None: choose_tiles; else rows per tile (a power of two >= GROUP)
    tile_n: int | None = None,          # None: choose_tiles; else keys per inner step (a power of two)
    kv_quant: KVQuant | None = None,    # an 8-bit cache (paged_attention.kv_quant): dequantized in the loop
) -> torch.Tensor:                      # [num_tokens, num_heads, head_dim]
    # The kernels read these two by raw pointer: make them what the checks below read.
    seq_lens, query_start_loc = contiguous_index(seq_lens), contiguous_index(query_start_loc)
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                               check_values=check_values, max_query_len=max_query_len, max_seq_len=max_seq_len,
                               kv_quant=kv_quant)
    if query.device.type != "cuda" and not interpreting():
        raise RuntimeError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           f"imported to run the kernel on the CPU; got tensors on {query.device}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    for launch in plan_launches(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                max_query_len=max_query_len, max_seq_len=max_seq_len,
                                num_kv_splits=num_kv_splits, block_m=block_m, tile_n=tile_n, kv_quant=kv_quant):
        launch.kernel[launch.grid](*launch.args, **launch.constexprs, **launch.options)
    return out
