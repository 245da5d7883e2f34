// permute, large batches with up to kMaxRankedLocal local experts: a tiled counting sort.
// 1. Each block ranks one tile of entries by local expert and records the tile's per-expert
//    counts and each entry's (expert, rank within the tile).
// 2. One block per example turns counts into padded expert blocks and each tile's first row
//    per expert.
// 3. The copy kernel (permute_copy.cu) finds each entry's row (its tile's first row for the
//    expert + its rank) and writes the row map as it copies.
// Tiles hold 256 to 2048 entries: small tiles keep the ranking short (a chain of kItems
// chunks per warp), large ones keep step 2 short (tiles * L counts to scan).
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

constexpr int kOffsetThreads = 1024;  // >= one thread per local expert (L <= kMaxRankedLocal)

// Entries per thread of a tile: the fewest that keep the tile counts to kMaxShare per thread
// of the offsets block.
constexpr int kMaxShare = 8;
int tile_items(int64_t entries, int64_t L) {
  for (int items = 1; items < 8; items *= 2) {
    const int64_t tile = int64_t{kRankThreads} * items;
    if ((entries + tile - 1) / tile * L <= kMaxShare * kOffsetThreads) return items;
  }
  return 8;
}

struct TileSpace {
  int32_t* ranked;   // [B * tiles * tile_entries] rank within the tile << kRankKeyBits | local expert
  int32_t* hist;     // [B * tiles * L] entries of expert e in the tile
  int32_t* offset;   // [B * tiles * L] row of expert e's first entry of the tile
  int32_t* starts;   // [B * (L + 1)]
  int32_t* counts;   // [B * L]
  int64_t tiles, tile_entries;
  int32_t shares, share_tiles;  // the offsets block: L x shares threads, share_tiles tiles each
};

// Carves the workspace at `ws` (any address when only the size is wanted) and adds up its bytes.
TileSpace carve_tiles(void* ws, int64_t batch, int64_t entries, int64_t L, int64_t* bytes = nullptr) {
  TileSpace t;
  t.tile_entries = int64_t{kRankThreads} * tile_items(entries, L);
  t.tiles = std::max<int64_t>(1, (entries + t.tile_entries - 1) / t.tile_entries);
  t.shares = static_cast<int32_t>(std::min<int64_t>(t.tiles, kOffsetThreads / std::max<int64_t>(L, 1)));
  t.share_tiles = static_cast<int32_t>((t.tiles + t.shares - 1) / t.shares);
  const int64_t slots = batch * t.tiles;
  int64_t used = 0;
  auto take = [&](int64_t count) {
    int32_t* q = reinterpret_cast<int32_t*>(reinterpret_cast<uintptr_t>(ws) + used);
    used += pad256(4 * count);
    return q;
  };
  t.ranked = take(slots * t.tile_entries);
  t.hist = take(slots * L);
  t.offset = take(slots * L);
  t.starts = take(batch * (L + 1));
  t.counts = take(batch * L);
  if (bytes) *bytes = used;
  return t;
}

template <int kItems>
__global__ void __launch_bounds__(kRankThreads) tile_rank_kernel(PermuteArgs a, TileSpace ts) {
  __shared__ RankSpace space;
  const int64_t b = blockIdx.y, slot = b * ts.tiles + blockIdx.x;
  const int64_t n = a.tokens * a.topk, L = a.num_local, first = blockIdx.x * ts.tile_entries;
  const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
  int32_t key[kItems], rank[kItems];
  rank_by_expert<kItems>(a, a.ids + b * a.ids_bstride + first, map, n - first, space, key, rank);
#pragma unroll
  for (int c = 0; c < kItems; ++c)
    ts.ranked[slot * ts.tile_entries + ranked_entry<kItems>(c)] = rank[c] << kRankKeyBits | key[c];
  for (int64_t e = threadIdx.x; e < L; e += kRankThreads) ts.hist[slot * L + e] = space.counts[e];
}

// One block of L x P threads per example: thread (e, p) owns expert e over the p-th contiguous
// share of `share_tiles` tiles (at most kMaxShare with tile_items, counts kept in registers). One
// block scan in expert-major order gives both the experts' totals and each share's first row
// within its expert; with padding, a second scans the padded totals into expert block starts.
// The launch shape spares the thread any division, and 32-bit index math keeps the one block's
// instruction count low (it runs alone on one multiprocessor).
__global__ void __launch_bounds__(kOffsetThreads) tile_offsets_kernel(PermuteArgs a, TileSpace ts) {
  __shared__ int32_t before[kOffsetThreads + 1];  // expert-major exclusive prefix of the shares
  __shared__ int32_t starts[kMaxRankedLocal + 1];
  __shared__ int32_t sums[33];
  const int32_t L = a.num_local, P = blockDim.y, tiles = static_cast<int32_t>(ts.tiles);
  const int32_t e = threadIdx.x, p = threadIdx.y, i = p * L + e;
  const int32_t t0 = min(tiles, p * ts.share_tiles), t1 = min(tiles, t0 + ts.share_tiles);
  const int64_t b = blockIdx.x;
  const int32_t* hist = ts.hist + b * tiles * L;
  int32_t counts[kMaxShare];
  int32_t sum = 0;
#pragma unroll
  for (int c = 0; c < kMaxShare; ++c) counts[c] = t0 + c < t1 ? hist[(t0 + c) * L + e] : 0;
#pragma unroll
  for (int c = 0; c < kMaxShare; ++c) sum += counts[c];
  for (int32_t t = t0 + kMaxShare; t < t1; ++t) sum += hist[t * L + e];
  before[e * P + p] = sum;
  __syncthreads();
  int32_t all;
  const int32_t prefix = block_exclusive_sum(before[i], sums, &all);
  before[i] = prefix;
  if (i == 0) before[L * P] = all;
  __syncthreads();
  const int32_t count = i < L ? before[(i + 1) * P] - before[i * P] : 0;
  int32_t start = i < L ? before[i * P] : 0, total = all;
  if (a.align > 1)  // uniform over the block
    start = block_exclusive_sum(static_cast<int32_t>(round_up(count, a.align)), sums, &total);
  if (i < L) {
    starts[i] = start;
    ts.starts[b * (L + 1) + i] = start;
    ts.counts[b * L + i] = count;
    a.group_sizes[b * L + i] = static_cast<int32_t>(round_up(count, a.align));
  }
  if (i == 0) ts.starts[b * (L + 1) + L] = total;
  __syncthreads();
  int32_t row = starts[e] + before[e * P + p] - before[e * P];
  int32_t* offset = ts.offset + b * tiles * L;
#pragma unroll
  for (int c = 0; c < kMaxShare; ++c) {
    if (t0 + c < t1) offset[(t0 + c) * L + e] = row;
    row += counts[c];
  }
  for (int32_t t = t0 + kMaxShare; t < t1; ++t) {
    offset[t * L + e] = row;
    row += hist[t * L + e];
  }
}

}  // namespace

cudaError_t permute_tiled_workspace_bytes(int64_t batch, int64_t entries, int64_t num_local, int64_t* bytes) {
  carve_tiles(nullptr, batch, entries, num_local, bytes);
  return cudaSuccess;
}

cudaError_t permute_tiled(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk;
  const TileSpace ts = carve_tiles(a.workspace, a.batch, n, a.num_local);
  const dim3 grid(static_cast<unsigned>(ts.tiles), static_cast<unsigned>(a.batch));
  with_items(ts.tile_entries, [&](auto items) { tile_rank_kernel<decltype(items)::value><<<grid, kRankThreads, 0, stream>>>(a, ts); });
  MOE_CHECK_LAUNCH();
  tile_offsets_kernel<<<static_cast<unsigned>(a.batch), dim3(static_cast<unsigned>(a.num_local), ts.shares), 0, stream>>>(
      a, ts);
  MOE_CHECK_LAUNCH();
  int shift = 0;
  while ((int64_t{1} << shift) < ts.tile_entries) ++shift;
  return copy_and_zero(a, EntryRows{a.row_map, ts.ranked, ts.offset, ts.tiles, shift}, RowLayout{ts.starts, ts.counts},
                       stream);
}

}  // namespace moe::cuda
