// Paged decode attention v3: flash-decoding style, one thread block per KV head group.
//
// What limited v1/v2 (paged_attention.cuh): one thread block per QUERY head, so under GQA every
// K/V byte is fetched QUERIES_PER_KV times; all logits of the range go to shared memory and V
// is read in a second, dependent pass (barriers, a big shared-memory footprint, one block per
// SM); few bytes in flight per thread.
//
// v3:
//
//   grid  = (num_kv_heads * head_chunks, num_seqs, num_partitions)   (num_partitions = 1: no split)
//   block = NUM_THREADS = 128 threads = 4 warps
//
//   * one thread block computes the query heads [head0, head0 + n_heads) that share ONE KV head
//     (n_heads <= GROUP_MAX; a group larger than GROUP_MAX is cut into head_chunks), so each
//     K/V byte of the range is read once for all of them;
//   * its warps take the KV blocks of the range round-robin (warp w: blocks w, w+4, ...) and
//     each keeps its OWN online softmax state per head: running max m, running sum l and an
//     fp32 accumulator (flash attention's rescaling, no logits array);
//   * inside a warp, LANES_PER_ROW lanes cover one token's head row with 16-byte loads, so a
//     warp step covers ROWS_PER_STEP tokens; a lane keeps its slice of q (pre-scaled) and of
//     the accumulators for every head of the group in registers;
//   * per KV block: load K rows (BATCH steps in flight) -> scores for all heads -> block max
//     -> rescale (m, l, acc) once -> load V rows -> acc += p * v. The scores of the block pass
//     from the lanes that reduced them to the lanes that need them through a tiny per-warp
//     shared buffer (BLOCK_SIZE x GROUP_MAX floats);
//   * at the end the warps merge (m, l, acc) in shared memory with the rule of the split
//     reduce: M = max m_w, L = sum l_w 2^(m_w - M), o = sum acc_w 2^(m_w - M) / L.
//
//        KV block b of the range -> warp (b - start) % 4
//        warp, h128 bf16: lanes 0..15 = row r, lanes 16..31 = row r+1 (16 B = 8 dims each)
//        lane registers: q[h][8], acc[h][8], m[h], l[h] for h < GROUP_MAX
//
// Scores live in the log2 domain (q is pre-multiplied by scale * log2(e), exp2f is one MUFU
// instruction). Split-KV (tmp_out != nullptr): each partition of PARTITION_SIZE tokens writes
// its output normalised by its own sum, its sum and its max (converted back to natural-log
// units, M * ln 2), i.e. exactly v2's contract, so v2's reduce kernel merges them.
//
// Same edge-case contract as v1/v2: seq_len 0 -> zeros; seq_len past the block table -> NaN
// (nothing read); tokens past seq_len in the last block are never loaded.
#pragma once

#include "paged_attention_common.cuh"

namespace vfs {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Blocks per SM the compiler must leave room for (caps registers per thread at 65536 / (128 *
// MIN_BLOCKS)): with a GQA group of 4 a lane holds q and acc for 4 heads (64 floats) plus BATCH
// steps of loads, ~150-190 registers with no spill (sm_90a, see kernels_cuda/README.md), so 2
// blocks (255 registers); MHA needs ~70-120, so 4 blocks (128). Tighter caps spilled.
// Overridable with -D for register / occupancy experiments on a GPU.
#ifndef VFS_V3_MIN_BLOCKS_G1
#define VFS_V3_MIN_BLOCKS_G1 4
#define VFS_V3_MIN_BLOCKS_G4 2
#endif
template <int GROUP_MAX> constexpr int v3_min_blocks_per_sm() { return GROUP_MAX == 1 ? VFS_V3_MIN_BLOCKS_G1 : VFS_V3_MIN_BLOCKS_G4; }

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE>
struct V3Layout {
  static constexpr int VEC = 16 / sizeof(scalar_t);                  // elements per 16-byte load
  static constexpr int NUM_VECS = HEAD_SIZE / VEC;                   // 16-byte vectors per head row
  static constexpr int LANES_PER_ROW = NUM_VECS < WARP_SIZE ? NUM_VECS : WARP_SIZE;
  static constexpr int VECS_PER_LANE = NUM_VECS / LANES_PER_ROW;
  static constexpr int ELEMS = VECS_PER_LANE * VEC;                  // head dims a lane owns
  static constexpr int ROWS_PER_STEP = WARP_SIZE / LANES_PER_ROW;    // tokens a warp covers per step
  static constexpr int STEPS = BLOCK_SIZE / ROWS_PER_STEP;           // steps per KV block
#ifndef VFS_V3_BATCH
#define VFS_V3_BATCH 4
#endif
  static constexpr int BATCH = STEPS < VFS_V3_BATCH ? STEPS : VFS_V3_BATCH;  // steps whose loads are issued together
  static_assert(HEAD_SIZE % VEC == 0 && NUM_VECS % LANES_PER_ROW == 0, "head size must split into 16-byte vectors");
  static_assert(BLOCK_SIZE % ROWS_PER_STEP == 0 && STEPS % BATCH == 0, "a warp's steps must tile the block");
};

// cache_t: scalar_t (a float cache) or uint8_t (an 8-bit cache, read as `kvq` says; strides in bytes).
// The lane layout is the query dtype's either way (V3Layout<scalar_t>): an 8-bit lane loads VEC bytes.
template <typename scalar_t, typename cache_t, int HEAD_SIZE, int BLOCK_SIZE, int GROUP_MAX, int NUM_THREADS,
          int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS, v3_min_blocks_per_sm<GROUP_MAX>()) paged_attention_v3_kernel(
    scalar_t* __restrict__ out,              // no split: [num_seqs, num_heads, head_size] (contiguous)
    float* __restrict__ exp_sums,            // split: [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ max_logits,          // split: [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ tmp_out,             // split: [num_seqs, num_heads, max_num_partitions, head_size]; nullptr: no split
    const scalar_t* __restrict__ q,          // [num_seqs, num_heads, head_size]
    const cache_t* __restrict__ k_cache,     // [num_blocks, block_size, num_kv_heads, head_size (+ 4 bytes)]
    const cache_t* __restrict__ v_cache,     // [num_blocks, block_size, num_kv_heads, head_size (+ 4 bytes)]
    const int num_heads, const int num_kv_heads, const int heads_per_block, const float scale, const KVQuantArgs kvq,
    const int* __restrict__ block_tables,    // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,        // [num_seqs]
    const int max_num_blocks_per_seq, const int64_t block_tables_stride,
    const int64_t q_seq_stride, const int64_t q_head_stride,
    const int64_t k_block_stride, const int64_t k_token_stride, const int64_t k_head_stride,
    const int64_t v_block_stride, const int64_t v_token_stride, const int64_t v_head_stride) {
  using L = V3Layout<scalar_t, HEAD_SIZE, BLOCK_SIZE>;
  using Vec16 = Vec<cache_t, L::VEC>;      // 16 bytes of a float cache; VEC bytes of an 8-bit one
  constexpr bool QUANT = sizeof(cache_t) == 1;
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  static_assert(NUM_THREADS % WARP_SIZE == 0, "whole warps only");
  static_assert(PARTITION_SIZE % BLOCK_SIZE == 0, "partitions are whole blocks");
  const bool split = tmp_out != nullptr;

  // ---- which heads, which sequence, which token range
  const int head_chunks = gridDim.x / num_kv_heads;
  const int kv_head_idx = blockIdx.x / head_chunks;
  const int group = num_heads / num_kv_heads;
  const int head0 = kv_head_idx * group + (blockIdx.x % head_chunks) * heads_per_block;
  const int n_heads = min(heads_per_block, (kv_head_idx + 1) * group - head0);
  if (n_heads <= 0) return;
  const int seq_idx = blockIdx.y;
  const int partition_idx = blockIdx.z;
  const int thread_idx = threadIdx.x;
  const int warp_idx = thread_idx / WARP_SIZE;
  const int lane = thread_idx % WARP_SIZE;
  const int64_t out_row0 = static_cast<int64_t>(seq_idx) * num_heads + head0;   // row of head0

  const int seq_len = seq_lens[seq_idx];
  const bool too_long = seq_len > max_num_blocks_per_seq * BLOCK_SIZE;
  if (split && (too_long || partition_idx * PARTITION_SIZE >= seq_len)) {
    return;  // v2's reduce kernel handles empty and too-long rows
  }
  if (!split && (too_long || seq_len == 0)) {
    // seq_len 0 is a padding row: 0. A row past its block table: NaN, loud instead of wrong.
    const float fill = too_long ? __int_as_float(0x7fc00000) : 0.f;
    for (int i = thread_idx; i < n_heads * HEAD_SIZE; i += NUM_THREADS) out[out_row0 * HEAD_SIZE + i] = from_float<scalar_t>(fill);
    return;
  }
  const int num_seq_blocks = divide_round_up(seq_len, BLOCK_SIZE);
  constexpr int BLOCKS_PER_PARTITION = PARTITION_SIZE / BLOCK_SIZE;
  const int start_block_idx = split ? partition_idx * BLOCKS_PER_PARTITION : 0;
  const int end_block_idx = split ? min(start_block_idx + BLOCKS_PER_PARTITION, num_seq_blocks) : num_seq_blocks;
  const int* block_table = block_tables + seq_idx * block_tables_stride;

  // A lane owns dims (j * LANES_PER_ROW + lane_in_row) * VEC + e of its step's row.
  const int row_in_step = lane / L::LANES_PER_ROW;
  const int lane_in_row = lane % L::LANES_PER_ROW;

  // ---- q of the group's heads, in registers, pre-scaled into the log2 domain
  float q_reg[GROUP_MAX][L::ELEMS];
  const float q_scale = scale * kLog2e;
#pragma unroll
  for (int h = 0; h < GROUP_MAX; ++h) {
    const scalar_t* q_ptr = q + seq_idx * q_seq_stride + static_cast<int64_t>(head0 + h) * q_head_stride;
#pragma unroll
    for (int j = 0; j < L::VECS_PER_LANE; ++j) {
#pragma unroll
      for (int e = 0; e < L::VEC; ++e) {
        const int dim = (j * L::LANES_PER_ROW + lane_in_row) * L::VEC + e;
        q_reg[h][j * L::VEC + e] = h < n_heads ? to_float(q_ptr[dim]) * q_scale : 0.f;
      }
    }
  }

  __shared__ float s_smem[NUM_WARPS][BLOCK_SIZE][GROUP_MAX];         // one KV block's scores per warp
  __shared__ float m_smem[NUM_WARPS][GROUP_MAX];
  __shared__ float l_smem[NUM_WARPS][GROUP_MAX];
  __shared__ float o_smem[NUM_WARPS][GROUP_MAX][HEAD_SIZE];

  float m[GROUP_MAX], l[GROUP_MAX], acc[GROUP_MAX][L::ELEMS];
#pragma unroll
  for (int h = 0; h < GROUP_MAX; ++h) {
    m[h] = -FLT_MAX;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < L::ELEMS; ++i) acc[h][i] = 0.f;
  }

  // ### BEGIN SOLUTION
  for (int block_idx = start_block_idx + warp_idx; block_idx < end_block_idx; block_idx += NUM_WARPS) {
    const int64_t physical_block = block_table[block_idx];
    // Rows past seq_len (the unused tail of the last block) are never read.
    const int num_rows = min(BLOCK_SIZE, seq_len - block_idx * BLOCK_SIZE);
    const cache_t* k_row0 = k_cache + physical_block * k_block_stride + kv_head_idx * k_head_stride;
    const cache_t* v_row0 = v_cache + physical_block * v_block_stride + kv_head_idx * v_head_stride;
    const cache_t* k_ptr = k_row0 + lane_in_row * L::VEC;
    const cache_t* v_ptr = v_row0 + lane_in_row * L::VEC;

    // -- scores s[row][h] = q_h . k_row (log2 domain), BATCH steps of loads in flight
    float block_max[GROUP_MAX];
#pragma unroll
    for (int h = 0; h < GROUP_MAX; ++h) block_max[h] = -FLT_MAX;
#pragma unroll 1   // only BATCH steps of rows live in registers at a time
    for (int b = 0; b < L::STEPS; b += L::BATCH) {
      Vec16 k_vec[L::BATCH][L::VECS_PER_LANE];
#pragma unroll
      for (int i = 0; i < L::BATCH; ++i) {
        const int row = (b + i) * L::ROWS_PER_STEP + row_in_step;
#pragma unroll
        for (int j = 0; j < L::VECS_PER_LANE; ++j) {
          if (row < num_rows) {
            k_vec[i][j] = load_kv<cache_t, L::VEC>(k_ptr + row * k_token_stride + j * L::LANES_PER_ROW * L::VEC);
          } else {
#pragma unroll
            for (int e = 0; e < L::VEC; ++e) {
              if constexpr (QUANT) k_vec[i][j].val[e] = 0;
              else k_vec[i][j].val[e] = from_float<scalar_t>(0.f);
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < L::BATCH; ++i) {
        const int row = (b + i) * L::ROWS_PER_STEP + row_in_step;
        float s[GROUP_MAX];
#pragma unroll
        for (int h = 0; h < GROUP_MAX; ++h) {
          s[h] = 0.f;
#pragma unroll
          for (int j = 0; j < L::VECS_PER_LANE; ++j) {
#pragma unroll
            for (int e = 0; e < L::VEC; ++e) s[h] += q_reg[h][j * L::VEC + e] * kv_to_float(k_vec[i][j].val[e], kvq.kind);
          }
          // the row's lanes differ only in the low bits of the lane index
#pragma unroll
          for (int mask = L::LANES_PER_ROW / 2; mask >= 1; mask /= 2) s[h] += __shfl_xor_sync(0xffffffffu, s[h], mask);
        }
        if (row < num_rows) {
          float k_scale = 1.f;   // q . (s k) = s (q . k): the row's K scale once, after the dot
          if constexpr (QUANT) k_scale = kv_row_scale<HEAD_SIZE>(k_row0 + row * k_token_stride, kvq.per_row, kvq.k_scale);
#pragma unroll
          for (int h = 0; h < GROUP_MAX; ++h) {
            if constexpr (QUANT) s[h] *= k_scale;
            block_max[h] = fmaxf(block_max[h], s[h]);
            if (lane_in_row == 0) s_smem[warp_idx][row][h] = s[h];
          }
        }
      }
    }

    // -- online softmax: one rescale per KV block
#pragma unroll
    for (int h = 0; h < GROUP_MAX; ++h) {
      const float m_new = fmaxf(m[h], warp_max<L::LANES_PER_ROW>(block_max[h]));   // max over the warp's rows
      const float alpha = exp2f(m[h] - m_new);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int i = 0; i < L::ELEMS; ++i) acc[h][i] *= alpha;
    }
    __syncwarp();   // s_smem of this block is visible to every lane

    // -- acc += p * v, p = 2^(s - m)
#pragma unroll 1   // only BATCH steps of rows live in registers at a time
    for (int b = 0; b < L::STEPS; b += L::BATCH) {
      Vec16 v_vec[L::BATCH][L::VECS_PER_LANE];
#pragma unroll
      for (int i = 0; i < L::BATCH; ++i) {
        const int row = (b + i) * L::ROWS_PER_STEP + row_in_step;
        if (row < num_rows) {
#pragma unroll
          for (int j = 0; j < L::VECS_PER_LANE; ++j)
            v_vec[i][j] = load_kv<cache_t, L::VEC>(v_ptr + row * v_token_stride + j * L::LANES_PER_ROW * L::VEC);
        }
      }
#pragma unroll
      for (int i = 0; i < L::BATCH; ++i) {
        const int row = (b + i) * L::ROWS_PER_STEP + row_in_step;
        if (row < num_rows) {   // junk * 0 could be NaN: rows past seq_len take no part at all
          float v_scale = 1.f;   // p (s v) = (p s) v
          if constexpr (QUANT) v_scale = kv_row_scale<HEAD_SIZE>(v_row0 + row * v_token_stride, kvq.per_row, kvq.v_scale);
#pragma unroll
          for (int h = 0; h < GROUP_MAX; ++h) {
            const float p = exp2f(s_smem[warp_idx][row][h] - m[h]);
            l[h] += p;
            const float pv = QUANT ? p * v_scale : p;
#pragma unroll
            for (int j = 0; j < L::VECS_PER_LANE; ++j) {
#pragma unroll
              for (int e = 0; e < L::VEC; ++e) acc[h][j * L::VEC + e] += pv * kv_to_float(v_vec[i][j].val[e], kvq.kind);
            }
          }
        }
      }
    }
    __syncwarp();   // every lane has read s_smem before the next block overwrites it
  }

  // ---- merge: first the row groups of a warp (same dims, different tokens) ...
#pragma unroll
  for (int h = 0; h < GROUP_MAX; ++h) {
    l[h] = warp_sum<L::LANES_PER_ROW>(l[h]);
#pragma unroll
    for (int i = 0; i < L::ELEMS; ++i) acc[h][i] = warp_sum<L::LANES_PER_ROW>(acc[h][i]);
  }
  // ... then the warps, through shared memory, with the split-reduce rule.
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < GROUP_MAX; ++h) {
      m_smem[warp_idx][h] = m[h];
      l_smem[warp_idx][h] = l[h];
    }
  }
  if (row_in_step == 0) {
#pragma unroll
    for (int h = 0; h < GROUP_MAX; ++h) {
#pragma unroll
      for (int j = 0; j < L::VECS_PER_LANE; ++j) {
#pragma unroll
        for (int e = 0; e < L::VEC; ++e)
          o_smem[warp_idx][h][(j * L::LANES_PER_ROW + lane_in_row) * L::VEC + e] = acc[h][j * L::VEC + e];
      }
    }
  }
  __syncthreads();
  for (int i = thread_idx; i < n_heads * HEAD_SIZE; i += NUM_THREADS) {
    const int h = i / HEAD_SIZE, d = i % HEAD_SIZE;
    float m_all = -FLT_MAX;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) m_all = fmaxf(m_all, m_smem[w][h]);
    float l_all = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float weight = exp2f(m_smem[w][h] - m_all);   // 0 for a warp that saw no block
      l_all += l_smem[w][h] * weight;
      o += o_smem[w][h][d] * weight;
    }
    o /= l_all;                                            // l_all >= 1: the max contributes 2^0
    const int64_t row = out_row0 + h;
    if (split) {
      const int64_t idx = row * gridDim.z + partition_idx;
      tmp_out[idx * HEAD_SIZE + d] = o;
      if (d == 0) {
        max_logits[idx] = m_all * kLn2;                    // natural-log units, as v2's reduce expects
        exp_sums[idx] = l_all;
      }
    } else {
      out[row * HEAD_SIZE + d] = from_float<scalar_t>(o);
    }
  }
  // ### END SOLUTION
}

}  // namespace vfs
