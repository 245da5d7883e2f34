// permute, small batches (at most kSmallMaxEntries entries per example): routing and copies in
// one launch, by one of three kernels (permute_small picks):
// - permute_tiny_kernel: a token or so (at most 32 entries, no padding), one warp routes;
// - permute_counted_kernel: no padding, a block per (token, chunk), each counts what it writes;
// - permute_small_kernel: otherwise; every block ranks the whole example in shared memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "kernel_args.h"
#include "moe_index.h"
#include "permute_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kSmallThreads = kRankThreads;

// Example b's rows as a small-batch block sees them: chunks of kSmallThreads vectors (at least
// one, so that H = 0 still launches a block).
template <typename V>
struct SmallRows {
  const V* hidden;
  V* out;
  int64_t nvec, chunks;

  __device__ SmallRows(const PermuteArgs& a, int64_t b) {
    const int64_t row_bytes = a.hidden_size * a.elem_bytes;
    nvec = row_bytes / sizeof(V);
    chunks = max(int64_t{1}, (nvec + kSmallThreads - 1) / kSmallThreads);
    hidden = reinterpret_cast<const V*>(static_cast<const char*>(a.hidden) + b * a.hidden_bstride * a.elem_bytes);
    out = reinterpret_cast<V*>(static_cast<char*>(a.out) + b * a.rows * row_bytes);
  }
  // This thread's vector of chunk c of token t's row; V{} past the row.
  __device__ V load(int64_t t, int64_t c) const {
    const int64_t v = c * kSmallThreads + threadIdx.x;
    return v < nvec ? hidden[t * nvec + v] : V{};
  }
};

// The grid zeroes rows [first, rows), a warp per row; rows go round the blocks first, so that a
// few rows spread over as many multiprocessors.
template <typename V>
__device__ void zero_rows_from(int64_t first, int64_t rows, int64_t nvec, V* out) {
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t r = first + blockIdx.x + int64_t{gridDim.x} * (threadIdx.x / 32); r < rows; r += warps)
    zero_row(out + r * nvec, nvec, threadIdx.x % 32, 32);
}

// ---- ranked: any small batch -------------------------------------------------------------------
// Every block routes the whole (small) example in shared memory (rank_by_expert, then one scan
// of the padded counts for the expert blocks). Then the blocks share the copies (read each token
// row once, write its K rows) and the zero rows.
template <int kItems, typename V>
__global__ void __launch_bounds__(kSmallThreads) permute_small_kernel(PermuteArgs a) {
  __shared__ int64_t sums[33];
  __shared__ RankSpace space;
  __shared__ int32_t starts[kMaxRankedLocal + 1];
  __shared__ int32_t pad_before[kMaxRankedLocal + 1];  // padding rows of the experts before e
  __shared__ int32_t row_of[kSmallThreads * kItems];

  const int64_t b = blockIdx.y, n = a.tokens * a.topk;
  const int32_t L = a.num_local;
  const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
  int32_t key[kItems], rank[kItems];
  rank_by_expert<kItems>(a, a.ids + b * a.ids_bstride, map, n, space, key, rank);
  // One scan of (padded rows << 32 | padding rows): expert block starts and padding prefix.
  int64_t carry = 0;
  for (int e0 = 0; e0 < L; e0 += kSmallThreads) {
    const int e = e0 + threadIdx.x;
    const int64_t padded = e < L ? round_up(space.counts[e], a.align) : 0;
    const int64_t both = padded << 32 | (e < L ? padded - space.counts[e] : 0);
    int64_t total;
    const int64_t before = block_exclusive_sum(both, sums, &total) + carry;
    if (e < L) {
      starts[e] = static_cast<int32_t>(before >> 32);
      pad_before[e] = static_cast<int32_t>(before & 0xffffffff);
    }
    carry += total;
  }
  if (threadIdx.x == 0) {
    starts[L] = static_cast<int32_t>(carry >> 32);
    pad_before[L] = static_cast<int32_t>(carry & 0xffffffff);
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kItems; ++c) {
    const int64_t i = ranked_entry<kItems>(c);
    if (i < n) row_of[i] = key[c] < L ? starts[key[c]] + rank[c] : -1;
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int64_t i = threadIdx.x; i < n; i += kSmallThreads) a.row_map[b * n + i] = row_of[i];
    for (int e = threadIdx.x; e < L; e += kSmallThreads) a.group_sizes[b * L + e] = starts[e + 1] - starts[e];
  }

  const SmallRows<V> rows(a, b);
  const int64_t nvec = rows.nvec, chunks = rows.chunks;
  V* out = rows.out;
  for (int64_t u = blockIdx.x; u < a.tokens * chunks; u += gridDim.x) {
    const int64_t t = u / chunks, v = (u % chunks) * kSmallThreads + threadIdx.x;
    bool routed = false;  // shared-memory reads: cheaper than reading a row nobody needs
    for (int64_t k = 0; k < a.topk; ++k) routed |= row_of[t * a.topk + k] >= 0;
    if (v >= nvec || !routed) continue;
    const V value = rows.hidden[t * nvec + v];
    for (int64_t k = 0; k < a.topk; ++k) {
      const int32_t r = row_of[t * a.topk + k];
      if (r >= 0) out[r * nvec + v] = value;
    }
  }
  // Zero fill: unused row q < pad_before[L] is padding, found by a binary search over the
  // padding prefix; the rest is the tail [starts[L], rows). A warp per row, so that the
  // searches of a block's rows overlap; rows go round the blocks first, so that a few rows
  // spread over as many multiprocessors. (Cheaper than walking the L expert blocks per thread,
  // or than zero_unused_rows' three 64-bit divisions per candidate row.)
  const int64_t unused = pad_before[L] + (a.rows - starts[L]);
  const int64_t warps = int64_t{gridDim.x} * (kSmallThreads / 32);
  for (int64_t q = blockIdx.x + int64_t{gridDim.x} * (threadIdx.x / 32); q < unused; q += warps) {
    int64_t r = starts[L] + (q - pad_before[L]);
    if (q < pad_before[L]) {
      int32_t lo = 0, hi = L;  // pad_before[lo] <= q < pad_before[hi]
      while (hi - lo > 1) {
        const int32_t mid = (lo + hi) / 2;
        if (pad_before[mid] <= q) lo = mid; else hi = mid;
      }
      r = starts[lo] + space.counts[lo] + (q - pad_before[lo]);
    }
    zero_row(out + r * nvec, nvec, threadIdx.x % 32, 32);
  }
}

// ---- a token or so (at most 32 entries, no padding): one warp routes ---------------------------
// An entry's row is the number of entries ordered before it by (local expert, index): one warp
// holding all entries finds it with 32 shuffles, without permute_small_kernel's shared-memory
// ranking and scan. Blocks over (entry, chunk of the row), so that the K copies spread over K
// times as many blocks; each block loads its first chunk before routing, which that load does
// not depend on.
constexpr int64_t kTinyMaxEntries = 32;

template <typename V>
__global__ void __launch_bounds__(kSmallThreads) permute_tiny_kernel(PermuteArgs a) {
  __shared__ int32_t key_of[kTinyMaxEntries], row_of[kTinyMaxEntries];
  __shared__ int32_t routed;  // entries with a local expert: rows [routed, rows) stay unused
  const int64_t b = blockIdx.y, n = a.tokens * a.topk;
  const int32_t L = a.num_local;
  const SmallRows<V> rows(a, b);
  const int64_t chunks = rows.chunks;
  const V first = blockIdx.x < n * chunks ? rows.load(blockIdx.x / chunks / a.topk, blockIdx.x % chunks) : V{};
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
    const int32_t key = lane < n ? local_expert(a.ids[b * a.ids_bstride + lane], map, a.num_experts, L) : L;
    int32_t before = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int32_t other = __shfl_sync(0xffffffffu, key, j);
      before += other < key || (other == key && j < lane);
    }
    key_of[lane] = key;
    row_of[lane] = key < L ? before : -1;
    const uint32_t local = __ballot_sync(0xffffffffu, key < L);
    if (lane == 0) routed = __popc(local);
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int64_t i = threadIdx.x; i < n; i += kSmallThreads) a.row_map[b * n + i] = row_of[i];
    for (int64_t e = threadIdx.x; e < L; e += kSmallThreads) {
      int32_t count = 0;
      for (int64_t i = 0; i < n; ++i) count += key_of[i] == e;
      a.group_sizes[b * L + e] = count;
    }
  }
  for (int64_t u = blockIdx.x; u < n * chunks; u += gridDim.x) {
    const int64_t i = u / chunks, v = (u % chunks) * kSmallThreads + threadIdx.x;
    const int32_t r = row_of[i];
    if (v >= rows.nvec || r < 0) continue;
    rows.out[r * rows.nvec + v] = u == blockIdx.x ? first : rows.hidden[i / a.topk * rows.nvec + v];
  }
  zero_rows_from(routed, a.rows, rows.nvec, rows.out);
}

// ---- no padding: each block counts what it writes ----------------------------------------------
// Without padding, an entry's row is the number of entries ordered before it by (local expert,
// index), and an expert's group size the number of entries it holds: counts over all entries.
// So a block need not rank every entry and scan every expert (permute_small_kernel); it answers
// at most 32 queries in one round: the entries with a local expert (where unused rows start),
// the group sizes of a share of the experts, and the rows of its token's K entries. An entry is
// held as one packed key, local expert * kSmallMaxEntries + index, so that every query (entries
// of an expert; entries before (expert, index)) is one range of keys: a subtraction and an
// unsigned comparison per held entry, a warp sum per query, one barrier for the block's sum. It
// loads its chunk of the token row first.
constexpr int kMaxCountQueries = 32;  // one per lane of warp 0, which sets and sums them
constexpr int32_t kKeyStride = kSmallMaxEntries;  // packed key = local expert * kKeyStride + index

template <int kItems, typename V>
__global__ void __launch_bounds__(kSmallThreads) permute_counted_kernel(PermuteArgs a) {
  __shared__ int32_t warp_counts[kSmallThreads / 32][kMaxCountQueries];
  __shared__ int32_t counts[kMaxCountQueries];  // the answers; a token entry's row, or -1
  const int64_t b = blockIdx.y;
  const int32_t n = static_cast<int32_t>(a.tokens * a.topk), L = a.num_local;
  const SmallRows<V> rows(a, b);
  // This block's (token, chunk): the grid has one block per unit (one block when T = 0).
  const int32_t chunks = static_cast<int32_t>(rows.chunks), t = static_cast<int32_t>(blockIdx.x) / chunks;
  const int32_t i0 = t * static_cast<int32_t>(a.topk), c = static_cast<int32_t>(blockIdx.x) - t * chunks;
  const V value = t < a.tokens ? rows.load(t, c) : V{};
  const int32_t* ids = a.ids + b * a.ids_bstride;
  const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
  int32_t key[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int32_t j = i * kSmallThreads + threadIdx.x;
    key[i] = (j < n ? local_expert(ids[j], map, a.num_experts, L) : L) * kKeyStride + j;
  }

  // Lane q sets query q, the keys [first, first + span): 0 counts entries with a local expert;
  // 1..S the group sizes of experts blockIdx.x + m * gridDim.x; S + 1 + k the row of the token's
  // entry k. (S <= 31 keeps L and every key below 2^31.)
  const int32_t S = (L + gridDim.x - 1) / gridDim.x, K = t < a.tokens ? static_cast<int32_t>(a.topk) : 0;
  const int Q = 1 + S + K, lane = threadIdx.x % 32;
  int32_t lo = 0, hi = L, below = 0, entry_key = L;
  if (lane >= 1 && lane <= S) {
    lo = blockIdx.x + (lane - 1) * gridDim.x;
    hi = lo + 1;
  } else if (lane > S && lane < Q) {
    below = i0 + lane - 1 - S;
    entry_key = local_expert(ids[below], map, a.num_experts, L);
    hi = entry_key;
  }
  const int32_t first = lo * kKeyStride, span = hi * kKeyStride + below - first;
  int32_t mine = 0;
  for (int q0 = 0; q0 < Q; q0 += 4) {  // four queries at a time keep four warp sums in flight
    int32_t sum[4];
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      const int32_t qfirst = __shfl_sync(0xffffffffu, first, q0 + d);
      const uint32_t qspan = __shfl_sync(0xffffffffu, span, q0 + d);
      sum[d] = 0;
#pragma unroll
      for (int i = 0; i < kItems; ++i) sum[d] += static_cast<uint32_t>(key[i] - qfirst) < qspan;
    }
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      const int32_t total = __reduce_add_sync(0xffffffffu, sum[d]);
      if (lane == q0 + d) mine = total;
    }
  }
  warp_counts[threadIdx.x / 32][lane] = mine;
  __syncthreads();
  if (threadIdx.x < Q) {
    int32_t total = 0;
#pragma unroll
    for (int w = 0; w < kSmallThreads / 32; ++w) total += warp_counts[w][threadIdx.x];
    if (threadIdx.x > S) {
      total = entry_key < L ? total : -1;
      if (c == 0) a.row_map[b * n + below] = total;
    } else if (threadIdx.x >= 1 && lo < L) {
      a.group_sizes[b * L + lo] = total;
    }
    counts[threadIdx.x] = total;
  }
  __syncthreads();

  const int64_t v = c * kSmallThreads + threadIdx.x;
  if (v < rows.nvec)
    for (int32_t k = 0; k < K; ++k) {
      const int32_t r = counts[S + 1 + k];
      if (r >= 0) rows.out[r * rows.nvec + v] = value;
    }
  zero_rows_from(counts[0], a.rows, rows.nvec, rows.out);
}

}  // namespace

cudaError_t permute_small(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk, row_bytes = a.hidden_size * a.elem_bytes;
  return with_access_type(std::max<int64_t>(row_bytes, 1), {a.hidden, a.out}, [&](auto tag) -> cudaError_t {
    using V = typename decltype(tag)::type;
    const int64_t chunks = std::max<int64_t>(1, (row_bytes / int64_t{sizeof(V)} + kSmallThreads - 1) / kSmallThreads);
    const int64_t units = std::max(a.tokens, a.rows) * chunks;
    // Every block pays for the routing: use about two blocks per multiprocessor, not one per unit.
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(units, 2 * multiprocessors()))),
                    static_cast<unsigned>(a.batch));
    if (n <= kTinyMaxEntries && a.align == 1) {
      const dim3 tiny_grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(n * chunks, 2 * multiprocessors()))),
                           static_cast<unsigned>(a.batch));
      permute_tiny_kernel<V><<<tiny_grid, kSmallThreads, 0, stream>>>(a);
      return cudaGetLastError();
    }
    // Counting pays while each block copies one (token, chunk): with several, each waits for its
    // count before loading, and ranking once per block is faster.
    const dim3 counted_grid(static_cast<unsigned>(std::max<int64_t>(1, a.tokens * chunks)), static_cast<unsigned>(a.batch));
    const int64_t shares = (a.num_local + counted_grid.x - 1) / counted_grid.x;
    if (a.align == 1 && a.tokens * chunks <= 2 * multiprocessors() && 1 + shares + a.topk <= kMaxCountQueries) {
      with_items(n, [&](auto items) { permute_counted_kernel<decltype(items)::value, V><<<counted_grid, kSmallThreads, 0, stream>>>(a); });
      return cudaGetLastError();
    }
    with_items(n, [&](auto items) { permute_small_kernel<decltype(items)::value, V><<<grid, kSmallThreads, 0, stream>>>(a); });
    return cudaGetLastError();
  });
}

}  // namespace moe::cuda
