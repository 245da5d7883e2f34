// What the permute units share: the paths' launchers (permute.cu picks one), ranking entries by
// local expert in shared memory (permute_small.cu, permute_tiled.cu), the row layout the copy
// kernel reads (permute_copy.cu, called by permute_tiled.cu and permute_sorted.cu), and row
// zeroing and access-width choice.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda_common.cuh"
#include "dtype_dispatch.h"
#include "kernel_args.h"
#include "moe_index.h"

namespace moe::cuda {

// ---- the paths -----------------------------------------------------------------------------
constexpr int64_t kSmallMaxEntries = 2048;   // permute_small: entries of one example
constexpr int64_t kMaxRankedLocal = 1023;    // experts a block ranks in shared memory

// Small batches (at most kSmallMaxEntries entries, kMaxRankedLocal local experts): one launch.
cudaError_t permute_small(const PermuteArgs& a, cudaStream_t stream);
// Up to kMaxRankedLocal local experts: a tiled counting sort, then the copy.
cudaError_t permute_tiled(const PermuteArgs& a, cudaStream_t stream);
cudaError_t permute_tiled_workspace_bytes(int64_t batch, int64_t entries, int64_t num_local, int64_t* bytes);
// More local experts: a CUB radix sort of (example, expert) keys, then the copy.
cudaError_t permute_sorted(const PermuteArgs& a, cudaStream_t stream);
cudaError_t permute_sorted_workspace_bytes(int64_t batch, int64_t entries, int64_t num_local, int64_t* bytes);

// ---- the copy of the tiled and sorted paths ---------------------------------------------------
// Where each example's expert blocks start and how many entries they hold.
struct RowLayout {
  const int32_t* starts;  // [B, L+1] first row of each expert block, then the rows in use
  const int32_t* counts;  // [B, L] entries of each expert
};

// Where the copy kernel finds a token's rows: in the row map, or (tiled routing, ranked not
// null) from each entry's tile: the tile's first row of its expert + its rank, recorded in the
// row map on the way.
struct EntryRows {
  int32_t* row_map;        // [B, n]
  const int32_t* ranked;   // TileSpace::ranked, or null
  const int32_t* offset;   // TileSpace::offset
  int64_t tiles;
  int tile_shift;          // log2 of the tile's entries
};

// Copies each token row to its K rows and zeroes the rows no entry holds.
cudaError_t copy_and_zero(const PermuteArgs& a, const EntryRows& er, RowLayout layout, cudaStream_t stream);

// ---- row access ------------------------------------------------------------------------------
// Threads first, first + stride, ... zero the row (a block, or a warp: first = lane, stride 32).
template <typename V>
__device__ __forceinline__ void zero_row(V* row, int64_t nvec, int first, int stride) {
  for (int64_t v = first; v < nvec; v += stride) row[v] = V{};
}

// The widest access (up to 16 bytes) that divides the row and every base address.
template <typename F>
cudaError_t with_access_type(int64_t row_bytes, std::initializer_list<const void*> ptrs, F&& f) {
  uintptr_t bits = static_cast<uintptr_t>(row_bytes);
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  if (bits % 16 == 0) return f(Tag<uint4>{});
  if (bits % 8 == 0) return f(Tag<uint2>{});
  if (bits % 4 == 0) return f(Tag<uint32_t>{});
  if (bits % 2 == 0) return f(Tag<uint16_t>{});
  return f(Tag<uint8_t>{});
}

// ---- ranking entries by local expert, in shared memory -------------------------------------
// A block of kRankThreads threads ranks up to kRankThreads * kItems entries among equal local
// experts in flat-index order, without sorting (a stable block radix sort takes 1 to 3 passes
// of several barriers each): warp w owns entries [w * 32 * kItems, (w + 1) * 32 * kItems) in
// chunks of 32; a ballot per key bit finds a chunk's equal experts, a per-warp per-expert
// counter carries the rank across chunks, and a prefix over warps across warps.
constexpr int kRankThreads = 256, kRankWarps = kRankThreads / 32;
constexpr int kRankKeyBits = 10;  // local expert (or L when dropped) < 1024
static_assert(kMaxRankedLocal < (1 << kRankKeyBits), "a ranked key fits in kRankKeyBits");

// Calls f(std::integral_constant<int, kItems>{}) with the fewest entries per thread (1, 2, 4 or
// 8) that let a kRankThreads-thread block hold n entries.
template <typename F>
void with_items(int64_t n, F&& f) {
  if (n <= kRankThreads) f(std::integral_constant<int, 1>{});
  else if (n <= 2 * kRankThreads) f(std::integral_constant<int, 2>{});
  else if (n <= 4 * kRankThreads) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

struct RankSpace {
  int32_t counts[kMaxRankedLocal + 1];                 // entries of expert e
  uint16_t earlier[kRankWarps][kMaxRankedLocal + 1];  // entries of expert e in the warps before w
};

// The lanes holding the same key as this one (what __match_any_sync returns), from one ballot
// per key bit: constant time, where match.any takes longer the more distinct keys the warp
// holds. Keys are below 2^bits; every lane must call it.
__device__ __forceinline__ uint32_t lanes_with_key(int32_t key, int bits) {
  uint32_t peers = 0xffffffffu;
#pragma unroll
  for (int bit = 0; bit < kRankKeyBits; ++bit) {
    if (bit >= bits) break;  // uniform over the warp
    const bool one = (key >> bit) & 1;
    const uint32_t ones = __ballot_sync(0xffffffffu, one);
    peers &= one ? ones : ~ones;
  }
  return peers;
}

template <int kItems>
__device__ __forceinline__ int64_t ranked_entry(int c) {
  return (int64_t{threadIdx.x / 32} * kItems + c) * 32 + threadIdx.x % 32;
}

// key[c] = local expert of this thread's c-th entry (L when dropped or past `size`); rank[c] =
// entries of the same expert before it. Fills s.counts. Ends with a barrier.
template <int kItems>
__device__ void rank_by_expert(const PermuteArgs& a, const int32_t* ids, const int32_t* map, int64_t size,
                               RankSpace& s, int32_t (&key)[kItems], int32_t (&rank)[kItems]) {
  const int32_t L = a.num_local;
  const int warp = threadIdx.x / 32;
  const uint32_t lanes_below = (1u << (threadIdx.x % 32)) - 1;
  const int key_bits = 32 - __clz(L);  // keys run to L (dropped)
#pragma unroll
  for (int c = 0; c < kItems; ++c) {
    const int64_t i = ranked_entry<kItems>(c);
    key[c] = i < size ? local_expert(ids[i], map, a.num_experts, L) : L;
  }
  for (int e = threadIdx.x; e < L; e += kRankThreads)
#pragma unroll
    for (int w = 0; w < kRankWarps; ++w) s.earlier[w][e] = 0;
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kItems; ++c) {  // this warp's running count per expert, chunk by chunk
    const uint32_t peers = lanes_with_key(key[c], key_bits);
    const int32_t seen = key[c] < L ? s.earlier[warp][key[c]] : 0;
    rank[c] = seen + __popc(peers & lanes_below);
    __syncwarp();
    if (key[c] < L && (peers & lanes_below) == 0) s.earlier[warp][key[c]] = static_cast<uint16_t>(seen + __popc(peers));
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += kRankThreads) {  // per-warp counts -> prefix over warps
    int32_t total = 0;
#pragma unroll
    for (int w = 0; w < kRankWarps; ++w) {
      const int32_t c = s.earlier[w][e];
      s.earlier[w][e] = static_cast<uint16_t>(total);
      total += c;
    }
    s.counts[e] = total;
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kItems; ++c)
    if (key[c] < L) rank[c] += s.earlier[warp][key[c]];
}

}  // namespace moe::cuda
