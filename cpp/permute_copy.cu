// permute's copy for the tiled and sorted paths: each token row read once and written to its K
// rows (blocks over (token, chunk of the row)), then the rows no entry holds zeroed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "kernel_args.h"
#include "permute_common.cuh"

namespace moe::cuda {
namespace {

// Each thread moves up to kUnroll vectors of a row, all loads issued before the first store.
constexpr int kCopyThreads = 128, kUnroll = 4;
constexpr int64_t kCopyChunk = int64_t{kCopyThreads} * kUnroll;  // vectors per block-chunk of a row

// Zeroes the rows that hold no entry: each expert block's padding [starts[e] + counts[e],
// starts[e+1]) (fewer than `align` rows) and the tail [starts[L], rows). Blocks stride over
// candidate rows only, so nothing is spent without padding or dropped entries. A row each block
// (kRowPerThread false) or, for rows of one vector, a row each thread.
template <typename V, bool kRowPerThread = false>
__device__ void zero_unused_rows(RowLayout layout, int64_t L, int64_t align, int64_t batch, int64_t rows,
                                 int64_t nvec, V* out) {
  const int64_t first = kRowPerThread ? blockIdx.x * int64_t{blockDim.x} + threadIdx.x : blockIdx.x;
  const int64_t stride = kRowPerThread ? int64_t{gridDim.x} * blockDim.x : gridDim.x;
  const int lane = kRowPerThread ? 0 : threadIdx.x, lanes = kRowPerThread ? 1 : blockDim.x;
  const int64_t per_example = L * (align - 1);
  for (int64_t c = first; c < batch * per_example; c += stride) {
    const int64_t b = c / per_example, e = c % per_example / (align - 1), j = c % per_example % (align - 1);
    const int64_t r = layout.starts[b * (L + 1) + e] + layout.counts[b * L + e] + j;
    if (r < layout.starts[b * (L + 1) + e + 1]) zero_row(out + (b * rows + r) * nvec, nvec, lane, lanes);
  }
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = layout.starts[b * (L + 1) + L] + first; r < rows; r += stride)
      zero_row(out + (b * rows + r) * nvec, nvec, lane, lanes);
}

// Row of the token's k-th entry; i0 = t * K is the token's first entry within example b.
template <bool kFromTiles>
__device__ __forceinline__ int32_t entry_row(const EntryRows& er, int64_t b, int64_t n, int64_t i0, int64_t k,
                                             int32_t L, bool record) {
  int32_t* rm = er.row_map + b * n + i0;
  if constexpr (!kFromTiles) {
    return rm[k];
  } else {
    // Tiles are laid out back to back, so an entry's slot is its flat index within the example.
    const int32_t packed = er.ranked[(b * er.tiles << er.tile_shift) + i0 + k];
    const int32_t e = packed & ((1 << kRankKeyBits) - 1);
    const int32_t tile = static_cast<int32_t>((i0 + k) >> er.tile_shift);
    const int32_t r = e < L ? er.offset[(b * er.tiles + tile) * L + e] + (packed >> kRankKeyBits) : -1;
    if (record) rm[k] = r;
    return r;
  }
}

// Blocks over (token, chunk of the row): the token's row is read once and written to each of
// its K rows. Then the same blocks zero the rows no entry holds. kSkipUnrouted (with an
// expert_map, where many tokens have no local expert): read the row only when some entry of
// the token has a row, at the price of finding the rows first.
template <typename V, bool kSkipUnrouted, bool kFromTiles>
__global__ void __launch_bounds__(kCopyThreads) copy_rows_kernel(
    const char* hidden, int64_t hidden_bstride_bytes, EntryRows er, int64_t tokens, int64_t topk,
    int64_t batch, int64_t rows, int64_t row_bytes, RowLayout layout, int32_t L, int64_t align, char* out) {
  // Rows here are at least two vectors wide (narrower rows, and H = 0, take copy_entries_kernel).
  const int64_t nvec = row_bytes / sizeof(V), chunks = max(int64_t{1}, (nvec + kCopyChunk - 1) / kCopyChunk);
  const int64_t n = tokens * topk;
  for (int64_t u = blockIdx.x; u < batch * tokens * chunks; u += gridDim.x) {
    const int64_t g = u / chunks, b = g / tokens, i0 = (g - b * tokens) * topk;
    const int64_t v0 = (u % chunks) * kCopyChunk + threadIdx.x;
    const bool record = kFromTiles && u % chunks == 0 && threadIdx.x == 0;
    if (kSkipUnrouted) {
      bool routed = false;
      for (int64_t k = 0; k < topk; ++k) routed |= entry_row<kFromTiles>(er, b, n, i0, k, L, record) >= 0;
      if (!routed) continue;
    }
    const V* src = reinterpret_cast<const V*>(hidden + b * hidden_bstride_bytes + (g - b * tokens) * row_bytes);
    V value[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (v0 + j * kCopyThreads < nvec) value[j] = src[v0 + j * kCopyThreads];
    V* dst = reinterpret_cast<V*>(out + b * rows * row_bytes);
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t r = entry_row<kFromTiles>(er, b, n, i0, k, L, record && !kSkipUnrouted);
      if (r < 0) continue;
#pragma unroll
      for (int j = 0; j < kUnroll; ++j)
        if (v0 + j * kCopyThreads < nvec) dst[r * nvec + v0 + j * kCopyThreads] = value[j];
    }
  }
  zero_unused_rows<V>(layout, L, align, batch, rows, nvec, reinterpret_cast<V*>(out));
}

// Rows one access wide or empty (the layer's one-column row index; a row of 1, 2, 4, 8 or 16
// bytes on buffers aligned to it; H = 0, where tiled routing only records the rows): a thread per
// entry. A block per token would leave all but one thread idle and look up the token's K rows one
// after another, each lookup's loads waiting behind the previous entry's stores (22 us for the
// layer's Qwen3 row index at T = 4096 on an H100).
template <typename V, bool kFromTiles>
__global__ void __launch_bounds__(kCopyThreads) copy_entries_kernel(
    const char* hidden, int64_t hidden_bstride_bytes, EntryRows er, int64_t tokens, int64_t topk,
    int64_t batch, int64_t rows, int64_t nvec, RowLayout layout, int32_t L, int64_t align, char* out) {
  const int64_t n = tokens * topk;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < batch * n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / n, t = (i - b * n) / topk, k = i - b * n - t * topk;
    const int32_t r = entry_row<kFromTiles>(er, b, n, t * topk, k, L, true);
    if (r < 0 || nvec == 0) continue;
    const V* src = reinterpret_cast<const V*>(hidden + b * hidden_bstride_bytes) + t;
    reinterpret_cast<V*>(out)[b * rows + r] = *src;
  }
  zero_unused_rows<V, true>(layout, L, align, batch, rows, nvec, reinterpret_cast<V*>(out));
}

}  // namespace

cudaError_t copy_and_zero(const PermuteArgs& a, const EntryRows& er, RowLayout layout, cudaStream_t stream) {
  const int64_t row_bytes = a.hidden_size * a.elem_bytes;
  if (row_bytes == 0 && er.ranked == nullptr) return cudaSuccess;  // tiled routing still records the rows
  return with_access_type(std::max<int64_t>(row_bytes, 1), {a.hidden, a.out}, [&](auto tag) -> cudaError_t {
    using V = typename decltype(tag)::type;
    const int64_t nvec = row_bytes / int64_t{sizeof(V)};
    if (nvec <= 1) {
      auto kernel = er.ranked ? copy_entries_kernel<V, true> : copy_entries_kernel<V, false>;
      const int64_t entries = std::max(a.batch * a.tokens * a.topk, int64_t{kCopyThreads} * multiprocessors());
      kernel<<<blocks_for(entries, kCopyThreads), kCopyThreads, 0, stream>>>(
          static_cast<const char*>(a.hidden), a.hidden_bstride * a.elem_bytes, er, a.tokens, a.topk, a.batch,
          a.rows, nvec, layout, a.num_local, a.align, static_cast<char*>(a.out));
      return cudaGetLastError();
    }
    const int64_t chunks = std::max<int64_t>(1, (row_bytes / int64_t{sizeof(V)} + kCopyChunk - 1) / kCopyChunk);
    const int64_t units = std::max(a.batch * a.tokens * chunks, int64_t{4} * multiprocessors());
    auto kernel = er.ranked ? (a.expert_map ? copy_rows_kernel<V, true, true> : copy_rows_kernel<V, false, true>)
                            : (a.expert_map ? copy_rows_kernel<V, true, false> : copy_rows_kernel<V, false, false>);
    kernel<<<blocks_for(units, 1), kCopyThreads, 0, stream>>>(
        static_cast<const char*>(a.hidden), a.hidden_bstride * a.elem_bytes, er, a.tokens, a.topk, a.batch, a.rows,
        row_bytes, layout, a.num_local, a.align, static_cast<char*>(a.out));
    return cudaGetLastError();
  });
}

}  // namespace moe::cuda
