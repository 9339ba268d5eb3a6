// Unified paged attention for the CPU: C++ + OpenMP + one vector instruction set.
//
// One op for every step of a continuous-batching engine (chapter 05's unified_attention):
// request s brings query_len >= 1 new tokens, the LAST ones of its seq_len; new token i
// sits at position context_len + i (context_len = seq_len - query_len) and attends to KV
// positions 0 .. context_len + i. Decode is query_len 1, prefill context_len 0, a chunk
// of a long prompt or a spec-decode verification both > 0. A step verifying EAGLE-2 draft
// trees (chapter 04) gives a request a mask over its new tokens: token i then sees the context
// and only the new tokens its mask row allows (its ancestors and itself, a subset of the causal
// ones; vLLM's tree attention bias), hidden ones scored -inf. Like vLLM's CPU attention
// (csrc/cpu/cpu_attn_impl.hpp), the work is cut into items planned on the host:
//
//   work item = (request, KV heads, a tile of its new tokens, a range of its KV positions)
//
// * K/V are read IN PLACE through the block table, kTileKV positions at a time: a tile is
//   an array of row pointers, not a copy. Gathering K/V into contiguous tensors first
//   (chapter 05's torch path) writes and re-reads every byte, and decode attention is
//   memory-bound: each step streams the whole KV of the batch once.
// * All query heads of a GQA group are computed together, so a K/V row fetched from memory
//   is reused from L1 by every head that reads it (9 query heads on 3 KV heads in SmolLM2:
//   a third of the traffic of per-head loops).
// * Decode items take ALL the KV heads of their request: a cache block stores the rows of
//   every KV head of a position side by side ([block_size, num_kv_heads, head_dim]), so
//   one item reads each block as one contiguous stretch. Per-KV-head items would read 1/KVH
//   of every row and jump between scattered blocks KVH times as often (memory pages and
//   prefetchers favour contiguous stretches).
// * Online softmax in fp32 per query row (running max m, running sum l, unnormalised
//   output O): one pass over the KV, and no [query, seq_len] score matrix is ever
//   materialised — a tile's scores live in a kTileKV-wide scratch row.
// * Decode items load each tile's K/V rows, one byte per 64-byte line, BEFORE computing on
//   it (touch_tile). A decode row does ~2 FMAs per K/V float, so between two cache lines the
//   out-of-order core has too much arithmetic in its window to keep many misses in flight:
//   the kernel's memory stalls and its arithmetic add up. A tight loop of loads has ~nothing
//   but misses in its window, so they overlap each other, and the arithmetic then reads L1/L2
//   (a 64-position tile of fp32 K and V is 2 x 48 KB in SmolLM2). Prefill items (many rows,
//   K/V just written, in L2/L3) prefetch the next tile while computing instead. `python -m
//   kernels_cpu.dev.attention` times the kernel without and with each step (versions below).
// * Split-KV ("flash-decoding"): a decode batch of a few long requests has fewer items
//   than threads (batch 1 on 2 cores: one core idles). Items that are a large share of
//   the total are cut into KV ranges, each producing a partial (O, m, l); a second
//   parallel pass merges them. Cheap: partials are rows x head_dim floats.
// * Long prefills are tiled over their new tokens (<= kMaxRowsPerItem rows of
//   tokens x heads per item): parallelism within one request, and a causal tile stops
//   at the last position its rows can see.
// * Items run longest first under OpenMP dynamic scheduling: costs differ (seq_len 128
//   next to 2048 in one batch), and longest-first keeps the last item to finish short.
//
// Junk safety: a block-table entry is dereferenced only for a position < the item's KV end
// <= seq_len, so padding ids past ceil(seq_len / block_size) and cache rows past seq_len
// (free slots: possibly NaN) are never read. Causally masked positions inside a tile are
// real, finite rows; their probabilities are exactly 0 (selected, not exp(-inf)).
#include "attention.h"
#include "vec.h"

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <vector>

// The tuning story of the tile loads, each step a build of this file (`python -m
// kernels_cpu.dev.attention` builds, checks and times all three; the engine builds the last):
//   1  K/V read by the arithmetic as it goes (no prefetch, no touch_tile)
//   2  + every item prefetches its next tile while computing this one
//   3  + decode items load each tile before computing on it (touch_tile); prefill items keep 2
#ifndef VFS_CPU_ATTENTION_VERSION
#define VFS_CPU_ATTENTION_VERSION 3
#endif

namespace vfs_cpu {
namespace {

// KV positions per tile: 4 AVX-512 vectors of scores. Per tile the softmax bookkeeping and
// the pointer resolution are spread over kTileKV positions, and a tile still fits L2.
constexpr int kTileKV = 64;
// Items with fewer query rows than this (decode: 1 token x the KV group's heads) do so little
// arithmetic per K/V byte that they load each tile before computing on it (touch_tile).
constexpr int kManyRows = 16;
static_assert(kTileKV % (2 * W) == 0, "a KV tile is a whole number of vectors");
constexpr int kMaxRowsPerItem = 64;    // query rows (new tokens x query heads) per work item
constexpr int kMinSplitKV = 128;       // shortest KV range worth a split of its own
// Work (query rows x KV positions) worth waking another thread for: tens of microseconds of
// arithmetic. A smaller call runs on one thread: a parallel region costs microseconds to start
// and join, and on a busy machine its join waits for the slowest, perhaps descheduled, thread.
constexpr int64_t kMinCostPerThread = 4096;
#if defined(VFS_CPU_AVX512)
constexpr int kVecRegs = 32;
#else
constexpr int kVecRegs = 16;
#endif

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The pointer, hidden from the optimiser (an empty asm that "may change" it): the loads at
// p + c * W then address p's register plus a constant. Without it g++ hoists each chunk's
// byte offset (offset + c * W) * sizeof(T) out of the position loop into a register of its
// own -- 8 of them for head_dim 64 on AVX2, more than x86-64's 16 general registers leave
// free, so the P.V loop reloaded them from the stack on every position (perf annotate).
// `python -m benchmarks.bench_cpu_attention` times the kernel.
template <typename T>
inline const T* opaque(const T* p) {
  asm("" : "+r"(p));
  return p;
}

struct WorkItem {
  int seq;
  int kv_head, num_kv_heads;   // KV heads [kv_head, kv_head + num_kv_heads)
  int q_begin, q_count;        // new tokens [q_begin, q_begin + q_count) of the request
  int kv_begin, kv_end;        // KV positions [kv_begin, kv_end)
  int partial;                 // -1: write the output; else the first partial-result row slot
  int64_t cost;
};

struct Plan {
  int64_t total_cost = 0;
  std::vector<WorkItem> items;
  std::vector<std::vector<int>> merges;   // per split item: its pieces (indices into items)
  int num_partial_rows = 0;
};

// ------------------------------------------------------------------------------- planning

Plan make_plan(const AttentionParams& p) {
  const int group = p.num_heads / p.num_kv_heads;
  const int q_tile = p.q_tile > 0 ? p.q_tile : std::max(1, kMaxRowsPerItem / group);
  std::vector<WorkItem> whole;         // before splitting
  int64_t total = 0;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int seq_len = p.seq_lens[s];
    const int context = seq_len - q_len;
    for (int q0 = 0; q0 < q_len; q0 += q_tile) {
      const int qc = std::min(q_tile, q_len - q0);
      // The tile's last row sees positions <= context + q0 + qc - 1: nothing past that is read.
      const int kv_end = std::max(0, std::min(seq_len, context + q0 + qc));
      // As many KV heads per item as fit kMaxRowsPerItem rows (decode: all of them).
      const int heads = std::max(1, std::min(p.num_kv_heads, kMaxRowsPerItem / (qc * group)));
      for (int h = 0; h < p.num_kv_heads; h += heads) {
        const int nh = std::min(heads, p.num_kv_heads - h);
        const int64_t cost = int64_t(qc) * group * nh * kv_end + 256;   // + a fixed per-item overhead
        whole.push_back({s, h, nh, q0, qc, 0, kv_end, -1, cost});
        total += cost;
      }
    }
  }
  Plan plan;
  plan.total_cost = total;
  // An item worth more than 1/(8 * threads) of the total is split: enough pieces for the
  // dynamic schedule to even out, none shorter than kMinSplitKV positions.
  const int64_t target = std::max<int64_t>(1, total / (8 * std::max(1, p.num_threads)));
  for (const WorkItem& w : whole) {
    int pieces = 1;
    if (p.kv_splits > 0) {
      pieces = std::max(1, std::min(p.kv_splits, ceil_div(w.kv_end, kTileKV)));
    } else if (p.num_threads > 1 && w.cost > target) {
      pieces = int(std::min<int64_t>((w.cost + target - 1) / target, w.kv_end / kMinSplitKV));
      pieces = std::max(1, pieces);
    }
    if (pieces <= 1) {
      plan.items.push_back(w);
      continue;
    }
    // Piece boundaries on whole tiles; recount, as rounding up may need fewer pieces.
    const int chunk = ceil_div(ceil_div(w.kv_end, pieces), kTileKV) * kTileKV;
    pieces = ceil_div(w.kv_end, chunk);
    const int rows = w.q_count * group * w.num_kv_heads;
    std::vector<int> group_items;
    for (int k = 0; k < pieces; ++k) {
      WorkItem piece = w;
      piece.kv_begin = k * chunk;
      piece.kv_end = std::min(w.kv_end, piece.kv_begin + chunk);
      piece.partial = plan.num_partial_rows;
      piece.cost = int64_t(rows) * (piece.kv_end - piece.kv_begin) + 256;
      plan.num_partial_rows += rows;
      group_items.push_back(int(plan.items.size()));
      plan.items.push_back(piece);
    }
    plan.merges.push_back(std::move(group_items));
  }
  return plan;
}

// ------------------------------------------------------------------------------ microkernels

// Per-thread scratch, reused across calls (OpenMP keeps its threads): a few tens of KB.
struct Scratch {
  std::vector<float> q, o, s, m, l;   // q, o: [rows, head_dim]; s: [rows, kTileKV]; m, l: [rows]
  std::vector<int> valid;             // [rows]: positions of the current tile each row sees
  void reserve(int rows, int head_dim) {
    if (int(m.size()) >= rows && int(q.size()) >= rows * head_dim) return;
    q.resize(size_t(rows) * head_dim);
    o.resize(size_t(rows) * head_dim);
    s.resize(size_t(rows) * kTileKV);
    m.resize(rows);
    l.resize(rows);
    valid.resize(rows);
  }
};

Scratch& thread_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}

// The head_dim loop: NC > 0 is head_dim = NC * W known at compile time (unrolled, operands
// in registers); NC = 0 is any head_dim (a multiple of 8) with a masked last vector.
template <int NC>
struct HeadDim {
  int d;
  int chunks() const { return NC > 0 ? NC : ceil_div(d, W); }
  Mask mask(int c) const { return NC > 0 ? first_lanes(W) : first_lanes(d - c * W); }
};

// W scores at once: q . k_w for the W rows k_rows[w] + offset. W accumulators, then one
// transpose-and-add tree turns them into a vector of W dot products.
template <int NC, typename T>
inline V dot_w(const float* q, const T* const* k_rows, int64_t offset, HeadDim<NC> hd) {
  V acc[W];
  if constexpr (NC > 0 && NC + W <= kVecRegs) {       // q stays in registers
    V qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = load(q + c * W, first_lanes(W));
    for (int w = 0; w < W; ++w) {
      const T* k = opaque(k_rows[w] + offset);
      V a = mul(qv[0], load(k, first_lanes(W)));
      for (int c = 1; c < NC; ++c) a = fma(qv[c], load(k + c * W, first_lanes(W)), a);
      acc[w] = a;
    }
  } else {
    for (int w = 0; w < W; ++w) acc[w] = zero();
    for (int c = 0; c < hd.chunks(); ++c) {
      const Mask mask = hd.mask(c);
      const V qv = load(q + c * W, mask);
      for (int w = 0; w < W; ++w) acc[w] = fma(qv, load(k_rows[w] + offset + c * W, mask), acc[w]);
    }
  }
  return reduce_lanes(acc);
}

// o[i] += sum_j p[i][j] * v_j for RC query rows: one load of a V row serves RC rows.
template <int RC, int NC, typename T>
inline void pv_rows(float* o, const float* p, const T* const* v_rows, int64_t offset, int n, HeadDim<NC> hd) {
  const int D = hd.d;
  if constexpr (NC > 0) {                               // all RC x NC accumulators in registers
    V acc[RC][NC];
    for (int i = 0; i < RC; ++i)
      for (int c = 0; c < NC; ++c) acc[i][c] = load(o + i * D + c * W, first_lanes(W));
    for (int j = 0; j < n; ++j) {
      const T* v = opaque(v_rows[j] + offset);
      V vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = load(v + c * W, first_lanes(W));
      for (int i = 0; i < RC; ++i) {
        const V pj = set1(p[i * kTileKV + j]);
        for (int c = 0; c < NC; ++c) acc[i][c] = fma(pj, vv[c], acc[i][c]);
      }
    }
    for (int i = 0; i < RC; ++i)
      for (int c = 0; c < NC; ++c) store(o + i * D + c * W, acc[i][c], first_lanes(W));
  } else {                                              // one vector of head_dim at a time
    for (int c = 0; c < hd.chunks(); ++c) {
      const Mask mask = hd.mask(c);
      V acc[RC];
      for (int i = 0; i < RC; ++i) acc[i] = load(o + i * D + c * W, mask);
      for (int j = 0; j < n; ++j) {
        const V v = load(v_rows[j] + offset + c * W, mask);
        for (int i = 0; i < RC; ++i) acc[i] = fma(set1(p[i * kTileKV + j]), v, acc[i]);
      }
      for (int i = 0; i < RC; ++i) store(o + i * D + c * W, acc[i], mask);
    }
  }
}

// Rows per P @ V block: as many as keep RC x NC accumulators + NC V vectors in registers.
template <int NC>
constexpr int pv_block_rows() {
  return NC == 0 ? 8 : std::max(1, std::min(8, (kVecRegs - NC - 1) / NC));
}

template <int NC, typename T>
void pv_block(int rows, float* o, const float* p, const T* const* v_rows, int64_t offset, int n, HeadDim<NC> hd) {
  constexpr int R = pv_block_rows<NC>();
  switch (std::min(rows, R)) {   // R >= every case label that can be reached
    case 1: return pv_rows<1>(o, p, v_rows, offset, n, hd);
    case 2: return pv_rows<std::min(2, R)>(o, p, v_rows, offset, n, hd);
    case 3: return pv_rows<std::min(3, R)>(o, p, v_rows, offset, n, hd);
    case 4: return pv_rows<std::min(4, R)>(o, p, v_rows, offset, n, hd);
    case 5: return pv_rows<std::min(5, R)>(o, p, v_rows, offset, n, hd);
    case 6: return pv_rows<std::min(6, R)>(o, p, v_rows, offset, n, hd);
    case 7: return pv_rows<std::min(7, R)>(o, p, v_rows, offset, n, hd);
    default: return pv_rows<R>(o, p, v_rows, offset, n, hd);
  }
}

// --------------------------------------------------------------------------------- one item

// Load one byte of every 64-byte line of the n rows' KV heads [kv_head, kv_head + num_kv_heads),
// K and V, and keep nothing: the tile is in L1/L2 when the arithmetic reaches it (see the top
// of the file). Rows < kv_end only, like every other read.
template <typename T>
void touch_tile(const T* const* k_rows, const T* const* v_rows, int n, int kv_head, int num_kv_heads,
                const AttentionParams& p) {
  const int bytes = p.head_dim * int(sizeof(T));
  unsigned sum = 0;
  for (int j = 0; j < n; ++j)
    for (int h = kv_head; h < kv_head + num_kv_heads; ++h) {
      const auto* k = reinterpret_cast<const unsigned char*>(k_rows[j] + h * p.k_stride_head);
      const auto* v = reinterpret_cast<const unsigned char*>(v_rows[j] + h * p.v_stride_head);
      for (int b = 0; b < bytes; b += 64) sum += k[b] + v[b];
      sum += k[bytes - 1] + v[bytes - 1];        // the last line of a row that starts mid-line
    }
  asm volatile("" : : "r"(sum));              // the loads must happen; the sum is never used
}

// The fp32 scale stored after a quantized row's head_dim numbers (inline_scales).
template <typename KT>
inline float row_scale(const KT* row, int head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(float));
  return scale;
}

// T: the query and output dtype; KT: what the caches store (T, or int8 / fp8 with scales).
template <int NC, typename T, typename KT>
void run_item(const AttentionParams& p, const WorkItem& it, float* partial_o, float* partial_m, float* partial_l) {
  const HeadDim<NC> hd{p.head_dim};
  const int D = p.head_dim, group = p.num_heads / p.num_kv_heads;
  const int head_rows = it.q_count * group;            // rows that read one KV head
  const int rows = head_rows * it.num_kv_heads;
  // Row r: KV head it.kv_head + r / head_rows; new token q_begin + (r % head_rows) / group;
  // query head (KV head) * group + r % group. Rows of one KV head are consecutive.
  auto token_of = [&](int r) { return (r % head_rows) / group; };
  auto head_of = [&](int r) { return (it.kv_head + r / head_rows) * group + r % group; };
  Scratch& sc = thread_scratch();
  sc.reserve(rows, D);
  float *qf = sc.q.data(), *o = sc.o.data(), *s = sc.s.data(), *m = sc.m.data(), *l = sc.l.data();
  int* valid = sc.valid.data();
  const int q_len = p.query_start_loc[it.seq + 1] - p.query_start_loc[it.seq];
  const int context = p.seq_lens[it.seq] - q_len;
  const int64_t token0 = p.query_start_loc[it.seq] + it.q_begin;
  // A tree step: this request's mask over its new tokens (nullptr: causal).
  const uint8_t* tree = p.tree_mask && p.tree_mask_start[it.seq] >= 0 ? p.tree_mask + p.tree_mask_start[it.seq]
                                                                       : nullptr;
  const T* query = static_cast<const T*>(p.query);
  const KT* key_cache = static_cast<const KT*>(p.key_cache);
  const KT* value_cache = static_cast<const KT*>(p.value_cache);

  // Query rows in fp32, pre-multiplied by the scale: converted once, read once per KV tile. A
  // per-tensor K scale folds in here too: q . (s k) = (s q) . k.
  const V scale = set1(p.scale * p.k_scale);
  for (int r = 0; r < rows; ++r) {
    const T* src = query + (token0 + token_of(r)) * p.q_stride_token + int64_t(head_of(r)) * p.q_stride_head;
    for (int c = 0; c < hd.chunks(); ++c) {
      const Mask mask = hd.mask(c);
      store(qf + r * D + c * W, mul(load(src + c * W, mask), scale), mask);
      store(o + r * D + c * W, zero(), mask);
    }
    m[r] = kNegInf;
    l[r] = 0.0f;
  }

  const int32_t* block_table = p.block_tables + int64_t(it.seq) * p.bt_stride;
  // Row pointers (of KV head 0; head h is + h * stride_head) of a tile's positions
  // t0 .. t0+n-1, block by block: the paging is resolved here, once per tile, and the data
  // stays where it is.
  auto resolve_tile = [&](int t0, const KT** k_rows, const KT** v_rows) {
    const int n = std::min(kTileKV, it.kv_end - t0);
    int block = t0 / p.block_size, offset = t0 % p.block_size;
    for (int j = 0; j < n; ++j) {
      const int64_t physical = block_table[block];
      k_rows[j] = key_cache + physical * p.k_stride_block + offset * p.k_stride_token;
      v_rows[j] = value_cache + physical * p.v_stride_block + offset * p.v_stride_token;
      if (++offset == p.block_size) offset = 0, ++block;
    }
    // A last vector of scores may reach past n: point those lanes at a real row (their
    // scores are masked out), never at memory past seq_len.
    for (int j = n; j < ceil_div(n, W) * W; ++j) k_rows[j] = k_rows[n - 1];
    return n;
  };
  const KT* row_ptrs[2][2][kTileKV];  // [this tile, next tile][K, V][position]
  int n_next = it.kv_begin < it.kv_end ? resolve_tile(it.kv_begin, row_ptrs[0][0], row_ptrs[0][1]) : 0;
  // Few query rows per K/V byte (decode): load each tile before computing on it; many rows
  // (prefill): prefetch the next tile while computing this one. See the top of the file.
  const bool touch_first = VFS_CPU_ATTENTION_VERSION >= 3 && rows < kManyRows;
  const bool prefetch_next_tile = VFS_CPU_ATTENTION_VERSION >= 2 && !touch_first;
  // ### BEGIN SOLUTION
  for (int t0 = it.kv_begin, cur = 0; t0 < it.kv_end; t0 += kTileKV, cur ^= 1) {
    const int n = n_next;
    const KT* const* k_rows = row_ptrs[cur][0];
    const KT* const* v_rows = row_ptrs[cur][1];
    n_next = t0 + kTileKV < it.kv_end ? resolve_tile(t0 + kTileKV, row_ptrs[cur ^ 1][0], row_ptrs[cur ^ 1][1]) : 0;
    if (touch_first) touch_tile(k_rows, v_rows, n, it.kv_head, it.num_kv_heads, p);
    // Prefetch of the next tile, a few positions per query row below, so the requests
    // overlap this tile's arithmetic (a prefill tile's K/V are usually in L2/L3, just written).
    const KT* const* next_k = row_ptrs[cur ^ 1][0];
    const KT* const* next_v = row_ptrs[cur ^ 1][1];
    const int prefetch_per_row = prefetch_next_tile ? ceil_div(n_next, rows) : 0;
    int prefetched = 0;
    auto prefetch_next = [&] {
      for (int c = 0; c < prefetch_per_row && prefetched < n_next; ++c, ++prefetched)
        for (int h = it.kv_head; h < it.kv_head + it.num_kv_heads; ++h) {
          const char* k = reinterpret_cast<const char*>(next_k[prefetched] + h * p.k_stride_head);
          const char* v = reinterpret_cast<const char*>(next_v[prefetched] + h * p.v_stride_head);
          for (int b = 0; b < D * int(sizeof(KT)); b += 128) {   // the core fetches 128-byte line pairs
            prefetch(k + b);
            prefetch(v + b);
          }
        }
    };

    for (int r = 0; r < rows; ++r) {
      // S = q K^T for row r, then its online-softmax update. Row r may see positions
      // <= context + its token's index (causal with the context offset).
      const int64_t k_offset = int64_t(it.kv_head + r / head_rows) * p.k_stride_head;
      const int nv = std::clamp(context + it.q_begin + token_of(r) - t0 + 1, 0, n);
      valid[r] = nv;
      prefetch_next();
      float* srow = s + r * kTileKV;
      const int vec_end = ceil_div(nv, W) * W;
      for (int j = vec_end; j < n; ++j) srow[j] = 0.0f;    // invisible positions: p = 0
      if (nv == 0) continue;
      V vmax = set1(kNegInf);
      for (int j = 0; j < vec_end; j += W) {
        V dots = dot_w(qf + r * D, k_rows + j, k_offset, hd);
        if (p.inline_scales) {                 // per-row K scales: q . (s_j k_j) = s_j (q . k_j)
          alignas(64) float ks[W];
          for (int w = 0; w < W; ++w) ks[w] = row_scale(k_rows[j + w] + k_offset, D);
          dots = mul(dots, load(ks, first_lanes(W)));
        }
        const V sc = select(first_lanes(nv - j), dots, set1(kNegInf));
        store(srow + j, sc, first_lanes(W));
        vmax = max(vmax, sc);
      }
      float tile_max = reduce_max(vmax);
      if (tree && t0 + nv > context) {
        // Among the new tokens, only those this token's mask row allows (its ancestors and itself).
        const uint8_t* allow = tree + int64_t(it.q_begin + token_of(r)) * q_len;   // [q_len]
        bool hidden = false;
        for (int j = std::max(0, context - t0); j < nv; ++j)
          if (!allow[t0 + j - context]) srow[j] = kNegInf, hidden = true;
        if (hidden) tile_max = *std::max_element(srow, srow + nv);
        if (tile_max == kNegInf) {                            // nothing visible in this tile
          std::fill(srow, srow + vec_end, 0.0f);
          continue;
        }
      }
      const float m_new = std::max(m[r], tile_max);
      const float alpha = std::exp(m[r] - m_new);            // 0 on the first tile (m = -inf)
      V vsum = zero();
      for (int j = 0; j < vec_end; j += W) {
        const V e = select(first_lanes(nv - j), exp(add(load(srow + j, first_lanes(W)), set1(-m_new))), zero());
        store(srow + j, e, first_lanes(W));
        vsum = add(vsum, e);
      }
      l[r] = l[r] * alpha + reduce_add(vsum);
      m[r] = m_new;
      if (p.inline_scales) {                   // per-row V scales: p_j (s_j v_j) = (p_j s_j) v_j
        const int64_t v_offset = int64_t(it.kv_head + r / head_rows) * p.v_stride_head;
        for (int j = 0; j < nv; ++j) srow[j] *= row_scale(v_rows[j] + v_offset, D);
      }
      if (alpha != 1.0f) {
        const V a = set1(alpha);
        for (int c = 0; c < hd.chunks(); ++c) {
          const Mask mask = hd.mask(c);
          store(o + r * D + c * W, mul(load(o + r * D + c * W, mask), a), mask);
        }
      }
    }
    // O += P V per KV head, a block of rows per V load; positions no row of the block
    // sees are skipped.
    constexpr int R = pv_block_rows<NC>();
    for (int h = 0; h < it.num_kv_heads; ++h) {
      const int64_t v_offset = int64_t(it.kv_head + h) * p.v_stride_head;
      for (int r0 = h * head_rows; r0 < (h + 1) * head_rows; r0 += R) {
        const int rc = std::min(R, (h + 1) * head_rows - r0);
        const int nmax = *std::max_element(valid + r0, valid + r0 + rc);
        if (nmax > 0) pv_block(rc, o + r0 * D, s + r0 * kTileKV, v_rows, v_offset, nmax, hd);
      }
    }
  }
  // ### END SOLUTION
  if (p.v_scale != 1.0f) {                // a per-tensor V scale: sum_j p_j (s v_j) = s sum_j p_j v_j
    for (int64_t i = 0; i < int64_t(rows) * D; ++i) o[i] *= p.v_scale;
  }

  if (it.partial >= 0) {                  // a piece of a split item: keep (O, m, l) for the merge
    std::copy(o, o + size_t(rows) * D, partial_o);
    std::copy(m, m + rows, partial_m);
    std::copy(l, l + rows, partial_l);
    return;
  }
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < rows; ++r) {
    T* dst = out + (token0 + token_of(r)) * p.o_stride_token + int64_t(head_of(r)) * p.o_stride_head;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;     // l = 0: the row saw nothing (seq_len 0)
    for (int d = 0; d < D; ++d) from_float(o[r * D + d] * inv, dst + d);
  }
}

// Combine the pieces of one split item:
//   out = sum_k e^(m_k - M) O_k / sum_k e^(m_k - M) l_k,   M = max_k m_k.
template <typename T>
void merge_pieces(const AttentionParams& p, const Plan& plan, const std::vector<int>& pieces,
                  const float* partial_o, const float* partial_m, const float* partial_l, std::vector<float>& acc) {
  const WorkItem& first = plan.items[pieces[0]];
  const int D = p.head_dim, group = p.num_heads / p.num_kv_heads;
  const int head_rows = first.q_count * group;
  const int rows = head_rows * first.num_kv_heads;
  const int64_t token0 = p.query_start_loc[first.seq] + first.q_begin;
  T* out = static_cast<T*>(p.out);
  acc.resize(D);
  // ### BEGIN SOLUTION
  for (int r = 0; r < rows; ++r) {
    float big_m = kNegInf;
    for (int k : pieces) big_m = std::max(big_m, partial_m[plan.items[k].partial + r]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float big_l = 0.0f;
    for (int k : pieces) {
      const int64_t slot = plan.items[k].partial + r;
      if (partial_l[slot] == 0.0f) continue;             // this piece saw nothing of row r
      const float w = std::exp(partial_m[slot] - big_m);
      big_l += w * partial_l[slot];
      const float* po = partial_o + slot * D;
      for (int d = 0; d < D; ++d) acc[d] += w * po[d];
    }
    const float inv = big_l > 0.0f ? 1.0f / big_l : 0.0f;
    const int head = (first.kv_head + r / head_rows) * group + r % group;
    T* dst = out + (token0 + (r % head_rows) / group) * p.o_stride_token + int64_t(head) * p.o_stride_head;
    for (int d = 0; d < D; ++d) from_float(acc[d] * inv, dst + d);
  }
  // ### END SOLUTION
}

// ------------------------------------------------------------------------------- the driver

template <int NC, typename T, typename KT>
void run(const AttentionParams& p) {
  Plan plan = make_plan(p);
  const int64_t num_items = int64_t(plan.items.size());
  if (num_items == 0) return;
  // Longest first (see the top of the file); the merge lists hold indices, so sort an order.
  std::vector<int> order(num_items);
  for (int i = 0; i < num_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return plan.items[a].cost > plan.items[b].cost; });
  const int D = p.head_dim;
  std::vector<float> partial_o(size_t(plan.num_partial_rows) * D);
  std::vector<float> partial_m(plan.num_partial_rows), partial_l(plan.num_partial_rows);
  auto do_item = [&](int64_t i) {
    const WorkItem& it = plan.items[order[i]];
    const int64_t slot = it.partial < 0 ? 0 : it.partial;
    run_item<NC, T, KT>(p, it, partial_o.data() + slot * D, partial_m.data() + slot, partial_l.data() + slot);
  };
  const int64_t num_merges = int64_t(plan.merges.size());
  auto do_merge = [&](int64_t g, std::vector<float>& acc) {
    merge_pieces<T>(p, plan, plan.merges[g], partial_o.data(), partial_m.data(), partial_l.data(), acc);
  };
  const int64_t useful_threads = std::max<int64_t>(1, plan.total_cost / kMinCostPerThread);
  const int threads = int(std::min({int64_t(std::max(1, p.num_threads)), num_items, useful_threads}));
  if (threads == 1) {
    std::vector<float> acc;
    for (int64_t i = 0; i < num_items; ++i) do_item(i);
    for (int64_t g = 0; g < num_merges; ++g) do_merge(g, acc);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) do_item(i);
    // (the implicit barrier above: every piece is done before any merge reads it)
    std::vector<float> acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < num_merges; ++g) do_merge(g, acc);
  }
}

template <typename T, typename KT>
void run_head_dim(const AttentionParams& p) {
  // Compile-time head_dim for the common sizes (32, 64, 128 on AVX-512); others generic.
  if (W > 1 && p.head_dim == 2 * W) return run<2, T, KT>(p);
  if (W > 1 && p.head_dim == 4 * W) return run<4, T, KT>(p);
  if (W > 1 && p.head_dim == 8 * W) return run<8, T, KT>(p);
  return run<0, T, KT>(p);
}

template <typename T>
void run_dtype(const AttentionParams& p) {
  switch (p.kv_dtype) {
    case KVDType::SAME: return run_head_dim<T, T>(p);
    case KVDType::INT8: return run_head_dim<T, int8_t>(p);
    case KVDType::FP8: return run_head_dim<T, fp8e4m3>(p);
  }
}

// ------------------------------------------------------------------- quantized cache write

// fp32 -> fp8 e4m3fn, rounding to nearest even as torch's .to(torch.float8_e4m3fn); |x| <= 448
// (the caller clamps: a cast above it is NaN).
inline uint8_t fp8e4m3_from_float(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = uint8_t(u >> 24 & 0x80);
  const float a = std::fabs(x);
  if (a < 0.015625f)                                   // below 2^-6: subnormal steps of 2^-9 (8 steps = 2^-6)
    return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f)));
  uint32_t b = u & 0x7FFFFFFFu;
  b += 0x7FFFFu + (b >> 20 & 1);                       // 23 mantissa bits -> 3, ties to even (a carry bumps e)
  const int e = int(b >> 23) - 127 + 7;
  return uint8_t(sign | e << 3 | (b >> 20 & 7));
}

// One K or V row of head_dim numbers -> the cache's row: the scale (per-tensor, or absmax / qmax
// stored after the row), then x * (1 / scale) rounded. The bytes are paged_attention/kv_quant.py's.
template <typename T, typename KT>
void quantize_row_t(const T* src, KT* dst, int d, bool inline_scales, float tensor_scale) {
  constexpr bool kInt8 = std::is_same_v<KT, int8_t>;
  constexpr float qmax = kInt8 ? 127.0f : 448.0f;
  float scale = tensor_scale;
  if (inline_scales) {
    float amax = 0.0f;
    for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(to_float(src[i])));
    scale = std::max(amax / qmax, 1e-6f);
    std::memcpy(dst + d, &scale, sizeof(float));
  }
  const float inv = 1.0f / scale;
  for (int i = 0; i < d; ++i) {
    const float y = to_float(src[i]) * inv;
    if constexpr (kInt8) {
      dst[i] = int8_t(std::clamp(y >= 0.0f ? y + 0.5f : y - 0.5f, -128.0f, 127.0f));   // half away from 0
    } else {
      dst[i] = fp8e4m3{fp8e4m3_from_float(std::clamp(y, -448.0f, 448.0f))};
    }
  }
}

template <typename T>
void quantize_row_dtype(const void* src, void* dst, KVDType kv, int d, bool inline_scales, float tensor_scale) {
  if (kv == KVDType::INT8)
    return quantize_row_t(static_cast<const T*>(src), static_cast<int8_t*>(dst), d, inline_scales, tensor_scale);
  quantize_row_t(static_cast<const T*>(src), static_cast<fp8e4m3*>(dst), d, inline_scales, tensor_scale);
}

}  // namespace

void quantize_row(const void* src, DType dtype, void* dst, KVDType kv_dtype, int head_dim, bool inline_scales,
                  float tensor_scale) {
  switch (dtype) {
    case DType::F32: return quantize_row_dtype<float>(src, dst, kv_dtype, head_dim, inline_scales, tensor_scale);
    case DType::BF16: return quantize_row_dtype<bf16>(src, dst, kv_dtype, head_dim, inline_scales, tensor_scale);
    case DType::F16: return quantize_row_dtype<fp16>(src, dst, kv_dtype, head_dim, inline_scales, tensor_scale);
  }
}

void unified_attention(const AttentionParams& p) {
  switch (p.dtype) {
    case DType::F32: return run_dtype<float>(p);
    case DType::BF16: return run_dtype<bf16>(p);
    case DType::F16: return run_dtype<fp16>(p);
  }
}

std::vector<PlannedItem> plan(const AttentionParams& p) {
  std::vector<PlannedItem> items;
  for (const WorkItem& w : make_plan(p).items)
    items.push_back({w.seq, w.kv_head, w.num_kv_heads, w.q_begin, w.q_count, w.kv_begin, w.kv_end, w.partial >= 0});
  return items;
}

const char* isa_name() { return kIsaName; }
int vector_width() { return W; }

}  // namespace vfs_cpu
