// Rejection sampling for speculative decoding (device code): one thread block per request.
//
// In the spirit of vLLM's Triton kernels in vllm/v1/sample/rejection_sampler.py
// (rejection_greedy_sample_kernel, rejection_random_sample_kernel,
// sample_recovered_tokens_kernel), fused into one kernel that makes ONE vocab-wide pass per
// request — for the single recovered token that is kept — instead of one per draft.
//
// Inputs and conventions are those of spec_decode/reference.py (the oracle):
//   accept draft d at row r  iff  q(d) > 0 && u_r * q(d) < p(d)      (greedy: d == argmax_r)
//   recovered token           =  argmax_v max(0, p_v - q_v) * inv_exp_v, first index on ties;
//                                the race runs on p when that residual is all zero
//   q == nullptr              :  q one-hot at the draft (n-gram / greedy drafters)
// The random numbers (u, 1/E) are inputs, so this kernel and every other backend emit the
// same tokens. Probabilities are fp32; ids int32. No torch includes (nvcc compiles it on CPU
// machines; the CPU emulator, kernels_cuda/emulator, compiles it with g++).
#pragma once

#include <climits>
#include <cstdint>

namespace vfs {

constexpr int kRejectionPlaceholder = -1;   // vLLM's PLACEHOLDER_TOKEN_ID

// (value, index) argmax with ties to the smaller index: a commutative, associative merge, so
// any reduction order (threads, warps) gives the same answer as torch.argmax.
__device__ __forceinline__ void argmax_merge(float& value, int& index, float other_value, int other_index) {
  if (other_value > value || (other_value == value && other_index < index)) {
    value = other_value;
    index = other_index;
  }
}

// Block-wide argmax; every thread passes its partial (value, index); the result is returned
// to every thread. Warp shuffles, then one partial per warp through shared memory.
template <int NUM_THREADS>
__device__ __forceinline__ int block_argmax(float value, int index) {
  static_assert(NUM_THREADS % 32 == 0 && NUM_THREADS <= 1024, "whole warps, at most 1024 threads");
  constexpr int NUM_WARPS = NUM_THREADS / 32;
  __shared__ float warp_value[NUM_WARPS];
  __shared__ int warp_index[NUM_WARPS];
  __shared__ int result;
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    const float other_value = __shfl_xor_sync(0xffffffffu, value, mask);
    const int other_index = __shfl_xor_sync(0xffffffffu, index, mask);
    argmax_merge(value, index, other_value, other_index);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_value[warp] = value;
    warp_index[warp] = index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < NUM_WARPS; ++w) argmax_merge(value, index, warp_value[w], warp_index[w]);
    result = index;
  }
  __syncthreads();
  return result;
}

template <int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) rejection_sample_kernel(
    int32_t* __restrict__ out,                    // [batch, out_stride]: accepted drafts, token, -1 ...
    const int32_t* __restrict__ cu_num_draft,     // [batch] inclusive cumsum of drafts per request
    const int32_t* __restrict__ draft_ids,        // [T]
    const float* __restrict__ draft_probs,        // [T, vocab] or nullptr (q one-hot at the draft)
    const float* __restrict__ target_probs,       // [T, vocab] or nullptr (every request greedy)
    const int32_t* __restrict__ target_argmax,    // [T] or nullptr (no request greedy)
    const int32_t* __restrict__ bonus_ids,        // [batch]
    const int8_t* __restrict__ is_greedy,         // [batch] or nullptr (all random)
    const float* __restrict__ uniform,            // [T] U[0, 1)
    const float* __restrict__ inv_exp,            // [batch, vocab] 1 / E, E ~ Exp(1)
    const int vocab, const int out_stride) {
  const int req = blockIdx.x;
  const int start = req == 0 ? 0 : cu_num_draft[req - 1];
  const int n = cu_num_draft[req] - start;
  const bool greedy = is_greedy != nullptr && is_greedy[req] != 0;

  // ### BEGIN SOLUTION
  // 1. The accept tests, in order, until the first rejection. Every thread walks them (n is
  // at most max_spec_len, each test is three loads that all threads share), so the result is
  // uniform over the block and the branches below never diverge around __syncthreads.
  int num_accepted = 0;
  for (; num_accepted < n; ++num_accepted) {
    const int64_t row = start + num_accepted;
    const int draft = draft_ids[row];
    bool accept;
    if (greedy) {
      accept = draft == target_argmax[row];
    } else {
      const float p = target_probs[row * vocab + draft];
      const float q = draft_probs != nullptr ? draft_probs[row * vocab + draft] : 1.0f;
      accept = q > 0.0f && uniform[row] * q < p;
    }
    if (!accept) break;
  }

  // 2. The token after the accepted drafts: the bonus, or the recovered token.
  int token = bonus_ids[req];
  if (num_accepted < n) {
    const int64_t row = start + num_accepted;
    if (greedy) {
      token = target_argmax[row];
    } else {
      const int rejected_draft = draft_ids[row];
      const float* p_row = target_probs + row * vocab;
      const float* q_row = draft_probs != nullptr ? draft_probs + row * vocab : nullptr;
      const float* w_row = inv_exp + static_cast<int64_t>(req) * vocab;
      float best = -1.0f, best_p = -1.0f;
      int best_index = INT_MAX, best_p_index = INT_MAX;
      // Strided, so consecutive threads read consecutive floats (coalesced); each thread's
      // candidates come in increasing index order, so strict '>' keeps its first maximum.
      for (int v = threadIdx.x; v < vocab; v += NUM_THREADS) {
        const float p = p_row[v];
        const float w = w_row[v];
        const float residual = q_row != nullptr ? fmaxf(p - q_row[v], 0.0f) : (v == rejected_draft ? 0.0f : p);
        const float score = residual * w;
        const float score_p = p * w;
        if (score > best) { best = score; best_index = v; }
        if (score_p > best_p) { best_p = score_p; best_p_index = v; }
      }
      const int recovered = block_argmax<NUM_THREADS>(best, best_index);
      const int fallback = block_argmax<NUM_THREADS>(best_p, best_p_index);
      // Was the residual race empty? Re-read the winner's score (every thread, same value).
      const float winner_residual =
          q_row != nullptr ? fmaxf(p_row[recovered] - q_row[recovered], 0.0f)
                           : (recovered == rejected_draft ? 0.0f : p_row[recovered]);
      token = winner_residual * w_row[recovered] > 0.0f ? recovered : fallback;
    }
  }

  // 3. The output row.
  int32_t* out_row = out + static_cast<int64_t>(req) * out_stride;
  for (int j = threadIdx.x; j < out_stride; j += NUM_THREADS) {
    out_row[j] = j < num_accepted ? draft_ids[start + j] : (j == num_accepted ? token : kRejectionPlaceholder);
  }
  // ### END SOLUTION
}

}  // namespace vfs
