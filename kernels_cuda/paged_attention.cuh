// Paged decode attention, in the spirit of vLLM's paged_attention_v1 / v2
// (csrc/attention/attention_kernels.cuh, paged_attention_v1.cu, paged_attention_v2.cu).
//
// One query token per sequence (decode). Grid and work split, as in vLLM:
//
//   grid  = (num_heads, num_seqs, num_partitions)    v1: num_partitions = 1
//   block = NUM_THREADS = 128 threads = 4 warps
//
//   * one thread block computes one (head, sequence[, partition]);
//   * its warps take the KV blocks of the sequence round-robin (warp w: blocks w, w+4, ...);
//   * inside a warp, a THREAD GROUP of 32 / BLOCK_SIZE threads owns one token of the block,
//     so one warp iteration covers exactly one KV block; the group's threads split the
//     head dimension and combine their partial q.k with shuffles.
//
// Phases of one thread block:
//   1. q . k for every token of its range -> logits[] in shared memory, running max;
//   2. block-wide max, exp, block-wide sum -> normalised probabilities in logits[];
//   3. probabilities . V: each warp accumulates its blocks' rows in registers, then the
//      warps' partial vectors are summed through shared memory.
// v1 keeps the logits of the WHOLE sequence in shared memory (one thread block per
// (head, seq)); v2 cuts the sequence into PARTITION_SIZE-token partitions, each thread
// block writes its partition's max logit, exp-sum and (normalised) output, and
// paged_attention_v2_reduce_kernel merges them.
//
// Differences from vLLM, on purpose:
//   * the cache layout is the flash layout [num_blocks, block_size, num_kv_heads, head_size]
//     (the layout of this project and of vLLM v1), not V0's split-x K layout: one token's
//     head row is head_size contiguous elements, so the thread group reads it with
//     16-byte-per-group vector loads and V rows are read by lanes sweeping the head dim;
//   * tokens past seq_len in the last block are never loaded (vLLM loads and masks them),
//     so junk or NaN in unused slots cannot leak in;
//   * the v2 partial outputs are kept in fp32, not the input dtype;
//   * a row whose seq_len exceeds its block table, or the v1 logits buffer, gets NaN
//     instead of reading out of bounds; seq_len 0 (a padding row) gets zeros.
#pragma once

#include "paged_attention_common.cuh"

namespace vfs {

// cache_t: scalar_t (a float cache) or uint8_t (an 8-bit cache, read as `kvq` says: int8 or fp8
// bytes, scaled per row or per layer; its strides count bytes).
template <typename scalar_t, typename cache_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__device__ __forceinline__ void paged_attention_kernel(
    float* __restrict__ exp_sums,            // v2: [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ max_logits,          // v2: [num_seqs, num_heads, max_num_partitions]
    scalar_t* __restrict__ out,              // v1: [num_seqs, num_heads, head_size] (contiguous)
    float* __restrict__ tmp_out,             // v2: [num_seqs, num_heads, max_num_partitions, head_size]
    const scalar_t* __restrict__ q,          // [num_seqs, num_heads, head_size]
    const cache_t* __restrict__ k_cache,     // [num_blocks, block_size, num_kv_heads, head_size (+ 4 bytes)]
    const cache_t* __restrict__ v_cache,     // [num_blocks, block_size, num_kv_heads, head_size (+ 4 bytes)]
    const int num_kv_heads, const float scale, const KVQuantArgs kvq,
    const int* __restrict__ block_tables,    // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,        // [num_seqs]
    const int max_num_blocks_per_seq, const int64_t block_tables_stride,
    const int64_t q_seq_stride, const int64_t q_head_stride,
    const int64_t k_block_stride, const int64_t k_token_stride, const int64_t k_head_stride,
    const int64_t v_block_stride, const int64_t v_token_stride, const int64_t v_head_stride,
    const int logits_capacity) {             // floats available in the dynamic shared memory
  constexpr bool USE_PARTITIONING = PARTITION_SIZE > 0;
  constexpr bool QUANT = sizeof(cache_t) == 1;
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  static_assert(NUM_THREADS % WARP_SIZE == 0, "whole warps only");
  static_assert(BLOCK_SIZE <= WARP_SIZE && WARP_SIZE % BLOCK_SIZE == 0, "one warp covers one KV block");
  static_assert(!USE_PARTITIONING || PARTITION_SIZE % BLOCK_SIZE == 0, "partitions are whole blocks");

  const int num_heads = gridDim.x;
  const int head_idx = blockIdx.x;
  const int seq_idx = blockIdx.y;
  const int partition_idx = blockIdx.z;
  const int thread_idx = threadIdx.x;
  const int warp_idx = thread_idx / WARP_SIZE;
  const int lane = thread_idx % WARP_SIZE;
  const int64_t out_row = static_cast<int64_t>(seq_idx) * num_heads + head_idx;

  const int seq_len = seq_lens[seq_idx];
  const bool too_long = seq_len > max_num_blocks_per_seq * BLOCK_SIZE;
  if (USE_PARTITIONING && (too_long || partition_idx * PARTITION_SIZE >= seq_len)) {
    return;  // nothing to do here; the reduce kernel handles empty and too-long rows
  }
  const int num_seq_blocks = divide_round_up(seq_len, BLOCK_SIZE);
  const int num_blocks_per_partition = USE_PARTITIONING ? PARTITION_SIZE / BLOCK_SIZE : num_seq_blocks;
  const int start_block_idx = USE_PARTITIONING ? partition_idx * num_blocks_per_partition : 0;
  const int end_block_idx = min(start_block_idx + num_blocks_per_partition, num_seq_blocks);
  const int start_token_idx = start_block_idx * BLOCK_SIZE;
  const int end_token_idx = min(end_block_idx * BLOCK_SIZE, seq_len);
  const int num_tokens = end_token_idx - start_token_idx;

  if (!USE_PARTITIONING && (too_long || num_tokens == 0 || num_tokens > logits_capacity)) {
    // seq_len 0 is a padding row: output 0. Otherwise reading would overrun the block
    // table row or the logits buffer: output NaN, loud instead of silently wrong.
    const float fill = (num_tokens == 0 && !too_long) ? 0.f : __int_as_float(0x7fc00000);
    for (int i = thread_idx; i < HEAD_SIZE; i += NUM_THREADS) out[out_row * HEAD_SIZE + i] = from_float<scalar_t>(fill);
    return;
  }

  VFS_DYNAMIC_SHARED(float, shared_mem);
  float* logits = shared_mem;                       // [num_tokens] (v1: whole sequence; v2: one partition)
  __shared__ float q_smem[HEAD_SIZE];
  __shared__ float red_smem[NUM_WARPS];
  __shared__ float out_smem[NUM_WARPS * HEAD_SIZE];

  const int kv_head_idx = head_idx / (num_heads / num_kv_heads);   // GQA: query heads share a KV head
  const int* block_table = block_tables + seq_idx * block_tables_stride;

  // ---- load q once (fp32 in shared memory: every thread group reads all of it)
  const scalar_t* q_ptr = q + seq_idx * q_seq_stride + head_idx * q_head_stride;
  for (int i = thread_idx; i < HEAD_SIZE; i += NUM_THREADS) q_smem[i] = to_float(q_ptr[i]);
  __syncthreads();

  // ---- phase 1: logits = scale * q . k for every token of [start_token_idx, end_token_idx)
  // A thread group (THREAD_GROUP_SIZE lanes) owns one token; together it reads that token's
  // head row 16 bytes at a time: lane g of the group takes vectors g, g + G, g + 2G, ...
  constexpr int THREAD_GROUP_SIZE = WARP_SIZE / BLOCK_SIZE;
  constexpr int VEC_SIZE = (16 / (THREAD_GROUP_SIZE * sizeof(scalar_t))) > 0 ? 16 / (THREAD_GROUP_SIZE * sizeof(scalar_t)) : 1;
  constexpr int NUM_VECS_PER_THREAD = HEAD_SIZE / (THREAD_GROUP_SIZE * VEC_SIZE);
  static_assert(HEAD_SIZE % (THREAD_GROUP_SIZE * VEC_SIZE) == 0, "head size must split evenly over a thread group");
  using K_vec = Vec<cache_t, VEC_SIZE>;   // the same lane layout for an 8-bit cache, VEC_SIZE bytes
  const int token_in_block = lane / THREAD_GROUP_SIZE;
  const int lane_in_group = lane % THREAD_GROUP_SIZE;

  // ### BEGIN SOLUTION
  float qk_max = -FLT_MAX;
  for (int block_idx = start_block_idx + warp_idx; block_idx < end_block_idx; block_idx += NUM_WARPS) {
    const int64_t physical_block = block_table[block_idx];
    const int token_idx = block_idx * BLOCK_SIZE + token_in_block;
    const cache_t* k_ptr = k_cache + physical_block * k_block_stride + token_in_block * k_token_stride +
                           kv_head_idx * k_head_stride;
    float qk = 0.f;
    if (token_idx < seq_len) {  // the tail of the last block is never read
      // Unrolled by 8: enough 16-byte loads in flight per thread without spilling registers
      // when one thread owns a whole row (BLOCK_SIZE 32, head size 256).
#pragma unroll 8
      for (int j = 0; j < NUM_VECS_PER_THREAD; ++j) {
        const int offset = (j * THREAD_GROUP_SIZE + lane_in_group) * VEC_SIZE;
        const K_vec k_vec = load_kv<cache_t, VEC_SIZE>(k_ptr + offset);
#pragma unroll
        for (int e = 0; e < VEC_SIZE; ++e) qk += q_smem[offset + e] * kv_to_float(k_vec.val[e], kvq.kind);
      }
    }
    // Combine the group's partial dot products (its lanes differ only in the low bits).
#pragma unroll
    for (int mask = THREAD_GROUP_SIZE / 2; mask >= 1; mask /= 2) qk += __shfl_xor_sync(0xffffffffu, qk, mask);
    if (lane_in_group == 0 && token_idx < end_token_idx) {
      qk *= scale;
      if constexpr (QUANT) {   // q . (s k) = s (q . k): the row's K scale once, after the dot
        qk *= kv_row_scale<HEAD_SIZE>(k_ptr, kvq.per_row, kvq.k_scale);
      }
      logits[token_idx - start_token_idx] = qk;
      qk_max = fmaxf(qk_max, qk);
    }
  }

  // ---- phase 2: softmax over the range (max and sum reduced across the thread block)
  qk_max = block_max<NUM_WARPS>(red_smem, qk_max);   // its barrier also publishes logits[]
  float exp_sum = 0.f;
  for (int i = thread_idx; i < num_tokens; i += NUM_THREADS) {
    const float p = expf(logits[i] - qk_max);
    logits[i] = p;
    exp_sum += p;
  }
  __syncthreads();                                   // red_smem is reused by block_sum
  exp_sum = block_sum<NUM_WARPS>(red_smem, exp_sum); // >= 1: the max logit contributes exp(0)
  const float inv_sum = 1.f / exp_sum;
  for (int i = thread_idx; i < num_tokens; i += NUM_THREADS) logits[i] *= inv_sum;
  if (USE_PARTITIONING && thread_idx == 0) {
    const int64_t idx = out_row * gridDim.z + partition_idx;
    max_logits[idx] = qk_max;
    exp_sums[idx] = exp_sum;
  }
  __syncthreads();

  // ---- phase 3: out = sum over tokens of p * v
  // A token's V row is HEAD_SIZE contiguous elements = NUM_V_VECS 16-byte vectors. LANES_PER_ROW
  // lanes sweep one row; the warp covers ROWS_PER_ITER tokens at once.
  constexpr int V_VEC_SIZE = 16 / sizeof(scalar_t);       // an 8-bit cache: the same lanes, V_VEC_SIZE bytes
  constexpr int NUM_V_VECS = HEAD_SIZE / V_VEC_SIZE;
  constexpr int LANES_PER_ROW = NUM_V_VECS < WARP_SIZE ? NUM_V_VECS : WARP_SIZE;
  constexpr int V_VECS_PER_LANE = NUM_V_VECS / LANES_PER_ROW;
  constexpr int ROWS_PER_ITER = WARP_SIZE / LANES_PER_ROW;
  static_assert(HEAD_SIZE % V_VEC_SIZE == 0 && NUM_V_VECS % LANES_PER_ROW == 0, "head size must split into 16-byte vectors");
  static_assert(BLOCK_SIZE % ROWS_PER_ITER == 0, "a warp's rows must tile the block");
  using V_vec = Vec<cache_t, V_VEC_SIZE>;
  const int row_in_iter = lane / LANES_PER_ROW;
  const int lane_in_row = lane % LANES_PER_ROW;

  float accs[V_VECS_PER_LANE * V_VEC_SIZE];
#pragma unroll
  for (int i = 0; i < V_VECS_PER_LANE * V_VEC_SIZE; ++i) accs[i] = 0.f;

  for (int block_idx = start_block_idx + warp_idx; block_idx < end_block_idx; block_idx += NUM_WARPS) {
    const int64_t physical_block = block_table[block_idx];
    // Rows past seq_len (the unused tail of the last block) are never read: junk * 0 could be NaN.
    const int num_rows = min(BLOCK_SIZE, seq_len - block_idx * BLOCK_SIZE);
#pragma unroll 2
    for (int row = row_in_iter; row < num_rows; row += ROWS_PER_ITER) {
      const cache_t* v_ptr = v_cache + physical_block * v_block_stride + row * v_token_stride + kv_head_idx * v_head_stride;
      float p = logits[block_idx * BLOCK_SIZE + row - start_token_idx];
      if constexpr (QUANT) p *= kv_row_scale<HEAD_SIZE>(v_ptr, kvq.per_row, kvq.v_scale);   // p (s v) = (p s) v
#pragma unroll
      for (int j = 0; j < V_VECS_PER_LANE; ++j) {
        const V_vec v_vec = load_kv<cache_t, V_VEC_SIZE>(v_ptr + (j * LANES_PER_ROW + lane_in_row) * V_VEC_SIZE);
#pragma unroll
        for (int e = 0; e < V_VEC_SIZE; ++e) accs[j * V_VEC_SIZE + e] += p * kv_to_float(v_vec.val[e], kvq.kind);
      }
    }
  }
  // Lanes with the same lane_in_row (same head-dim slice, different tokens) add up ...
#pragma unroll
  for (int i = 0; i < V_VECS_PER_LANE * V_VEC_SIZE; ++i) {
#pragma unroll
    for (int mask = LANES_PER_ROW; mask < WARP_SIZE; mask *= 2) accs[i] += __shfl_xor_sync(0xffffffffu, accs[i], mask);
  }
  // ... then the warps add up through shared memory.
  if (row_in_iter == 0) {
#pragma unroll
    for (int j = 0; j < V_VECS_PER_LANE; ++j) {
#pragma unroll
      for (int e = 0; e < V_VEC_SIZE; ++e) {
        out_smem[warp_idx * HEAD_SIZE + (j * LANES_PER_ROW + lane_in_row) * V_VEC_SIZE + e] = accs[j * V_VEC_SIZE + e];
      }
    }
  }
  __syncthreads();
  for (int i = thread_idx; i < HEAD_SIZE; i += NUM_THREADS) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) sum += out_smem[w * HEAD_SIZE + i];
    if (USE_PARTITIONING) {
      tmp_out[(out_row * gridDim.z + partition_idx) * HEAD_SIZE + i] = sum;
    } else {
      out[out_row * HEAD_SIZE + i] = from_float<scalar_t>(sum);
    }
  }
  // ### END SOLUTION
}

// v1: grid (num_heads, num_seqs); dynamic shared memory holds the sequence's logits.
template <typename scalar_t, typename cache_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS, 1) paged_attention_v1_kernel(
    scalar_t* __restrict__ out, const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int num_kv_heads, const float scale, const KVQuantArgs kvq,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int max_num_blocks_per_seq,
    const int64_t block_tables_stride, const int64_t q_seq_stride, const int64_t q_head_stride,
    const int64_t k_block_stride, const int64_t k_token_stride, const int64_t k_head_stride,
    const int64_t v_block_stride, const int64_t v_token_stride, const int64_t v_head_stride,
    const int logits_capacity) {
  paged_attention_kernel<scalar_t, cache_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, 0>(
      nullptr, nullptr, out, nullptr, q, k_cache, v_cache, num_kv_heads, scale, kvq, block_tables, seq_lens,
      max_num_blocks_per_seq, block_tables_stride, q_seq_stride, q_head_stride, k_block_stride, k_token_stride,
      k_head_stride, v_block_stride, v_token_stride, v_head_stride, logits_capacity);
}

// v2: grid (num_heads, num_seqs, max_num_partitions); one partition per thread block.
template <typename scalar_t, typename cache_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS, 1) paged_attention_v2_kernel(
    float* __restrict__ exp_sums, float* __restrict__ max_logits, float* __restrict__ tmp_out,
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache, const cache_t* __restrict__ v_cache,
    const int num_kv_heads, const float scale, const KVQuantArgs kvq, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int max_num_blocks_per_seq, const int64_t block_tables_stride,
    const int64_t q_seq_stride, const int64_t q_head_stride, const int64_t k_block_stride,
    const int64_t k_token_stride, const int64_t k_head_stride, const int64_t v_block_stride,
    const int64_t v_token_stride, const int64_t v_head_stride) {
  paged_attention_kernel<scalar_t, cache_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, PARTITION_SIZE>(
      exp_sums, max_logits, nullptr, tmp_out, q, k_cache, v_cache, num_kv_heads, scale, kvq, block_tables, seq_lens,
      max_num_blocks_per_seq, block_tables_stride, q_seq_stride, q_head_stride, k_block_stride, k_token_stride,
      k_head_stride, v_block_stride, v_token_stride, v_head_stride, PARTITION_SIZE);
}

// v2 reduce: grid (num_heads, num_seqs). Each partition p produced an output o_p that is
// normalised by its own exp-sum s_p under its own max m_p. Rescaled to the global max M,
// partition p carries weight w_p = s_p * exp(m_p - M), and out = sum_p w_p o_p / sum_p w_p.
// Dynamic shared memory: 2 * max_num_partitions floats.
template <typename scalar_t, int HEAD_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_reduce_kernel(
    scalar_t* __restrict__ out,               // [num_seqs, num_heads, head_size]
    const float* __restrict__ exp_sums,       // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ max_logits,     // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ tmp_out,        // [num_seqs, num_heads, max_num_partitions, head_size]
    const int* __restrict__ seq_lens, const int max_num_partitions, const int max_num_blocks_per_seq,
    const int block_size) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const int num_heads = gridDim.x;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * num_heads + blockIdx.x;
  const int seq_len = seq_lens[blockIdx.y];
  const int num_partitions = divide_round_up(seq_len, PARTITION_SIZE);
  scalar_t* out_ptr = out + row * HEAD_SIZE;

  if (seq_len == 0 || seq_len > max_num_blocks_per_seq * block_size || num_partitions > max_num_partitions) {
    // padding row -> 0; a row the partition kernel refused (or the grid did not cover) -> NaN
    const float fill = seq_len == 0 ? 0.f : __int_as_float(0x7fc00000);
    for (int i = threadIdx.x; i < HEAD_SIZE; i += NUM_THREADS) out_ptr[i] = from_float<scalar_t>(fill);
    return;
  }
  const float* tmp_ptr = tmp_out + row * max_num_partitions * HEAD_SIZE;
  if (num_partitions == 1) {  // nothing to merge
    for (int i = threadIdx.x; i < HEAD_SIZE; i += NUM_THREADS) out_ptr[i] = from_float<scalar_t>(tmp_ptr[i]);
    return;
  }

  VFS_DYNAMIC_SHARED(float, shared_mem);
  float* weights = shared_mem;                        // [num_partitions]
  __shared__ float red_smem[NUM_WARPS];
  const float* row_max = max_logits + row * max_num_partitions;
  const float* row_sum = exp_sums + row * max_num_partitions;

  // ### BEGIN SOLUTION
  float m = -FLT_MAX;
  for (int p = threadIdx.x; p < num_partitions; p += NUM_THREADS) m = fmaxf(m, row_max[p]);
  m = block_max<NUM_WARPS>(red_smem, m);
  float total = 0.f;
  for (int p = threadIdx.x; p < num_partitions; p += NUM_THREADS) {
    const float w = row_sum[p] * expf(row_max[p] - m);
    weights[p] = w;
    total += w;
  }
  __syncthreads();                                    // red_smem reuse; weights[] published
  total = block_sum<NUM_WARPS>(red_smem, total);
  const float inv_total = 1.f / total;
  for (int i = threadIdx.x; i < HEAD_SIZE; i += NUM_THREADS) {
    float acc = 0.f;
    for (int p = 0; p < num_partitions; ++p) acc += tmp_ptr[p * HEAD_SIZE + i] * weights[p];
    out_ptr[i] = from_float<scalar_t>(acc * inv_total);
  }
  // ### END SOLUTION
}

}  // namespace vfs
