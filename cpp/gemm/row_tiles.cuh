// Row tiles of grouped rows, shared by the kernels whose output rows are grouped by expert
// (gather_gemm.cu, down_backward.cu): 128-row tiles that never cross a group's end, run group by
// group; within a group the row tiles are fastest, then the column tiles, so blocks running at
// once mostly share one expert's column block of its weights in L2.
#pragma once

#include <cstdint>

#include "sm90_ptx.cuh"  // warp_inclusive_sum

namespace moe::gemm::sm90 {

constexpr int kRowTileRows = 128;

// At most this many row tiles for M rows in E groups (each group's last tile may be partial): the
// host's bound on the tile count, which lives on the device.
inline int64_t row_tiles_bound(int64_t rows, int64_t experts) {
  return (rows + kRowTileRows - 1) / kRowTileRows + (experts < rows ? experts : rows);
}

// Rows and tile indices are int32 in the row-tile kernels, with headroom for a tile's 128 rows and
// the grid stride: their fits rules keep M and the tile count below this.
constexpr int64_t kRowTileIndexLimit = (int64_t(1) << 31) - 4096;

// 32-bit: the kernels' fits rules keep M and the tile count below kRowTileIndexLimit.
struct RowTile {
  int group;
  int row0, row_end;  // rows [row0, min(row0 + 128, row_end)) of out
  int col_tile;
};

__device__ __forceinline__ RowTile decode_row_tile(int tile, const int32_t* group_end, const int32_t* row_tile_end,
                                                   int experts, int col_tiles) {
  // The first group whose tile range ends after `tile` (empty groups end where the previous did).
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (row_tile_end[mid] * col_tiles > tile) hi = mid;
    else lo = mid + 1;
  }
  const int g = lo;
  const int first_row_tile = g == 0 ? 0 : row_tile_end[g - 1];
  const int group_row_tiles = row_tile_end[g] - first_row_tile;
  const int in_group = tile - first_row_tile * col_tiles;
  const int group_start = g == 0 ? 0 : group_end[g - 1];
  RowTile t;
  t.group = g;
  t.col_tile = in_group / group_row_tiles;
  t.row0 = group_start + (in_group - t.col_tile * group_row_tiles) * kRowTileRows;
  t.row_end = group_end[g];
  return t;
}

// Warp 0: group ends (clamped to M = rows) and the running count of 128-row tiles, into shared memory.
__device__ inline void scan_row_tiles(const int32_t* group_sizes, int64_t experts, int64_t rows, int32_t* group_end,
                                      int32_t* row_tile_end) {
  const int lane = threadIdx.x & 31;
  int64_t rows_before = 0;
  int32_t tiles_before = 0;
  for (int base = 0; base < experts; base += 32) {
    const int g = base + lane;
    const int64_t size = g < experts ? max(group_sizes[g], 0) : 0;
    const int64_t rows_incl = warp_inclusive_sum(size, lane) + rows_before;
    const int64_t end = min(rows_incl, rows), start = min(rows_incl - size, rows);
    const int32_t tiles = int32_t((end - start + kRowTileRows - 1) / kRowTileRows);
    const int32_t tiles_incl = warp_inclusive_sum(tiles, lane) + tiles_before;
    if (g < experts) {
      group_end[g] = int32_t(end);
      row_tile_end[g] = tiles_incl;
    }
    rows_before = __shfl_sync(0xffffffffu, rows_incl, 31);
    tiles_before = __shfl_sync(0xffffffffu, tiles_incl, 31);
  }
}

// A row tile's A operand gathered from rows of x [T, H] through row_token (gather_gemm.cu reads x,
// down_backward.cu the output's cotangent), 64 columns a stage by cp.async from the 128 producer
// threads: thread t copies 16-byte chunk t % 8 of the tile's rows t / 8 + 16 j, j < 8, landing at
// row * 128 + ((chunk ^ (row % 8)) * 16), TMA's 128-byte swizzle of a K-major box.
struct GatheredTileRows {
  int32_t token[8];  // this thread's rows' source rows: -1 past the tile's rows or outside [0, T)

  // The tile's source rows, read once a tile.
  __device__ __forceinline__ void start(const RowTile& t, const int32_t* row_token, int64_t tokens) {
    const int row_sub = int(threadIdx.x & 127) >> 3;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int row = t.row0 + row_sub + 16 * j;
      const int32_t tok = row < t.row_end ? row_token[row] : -1;
      token[j] = tok >= 0 && int64_t(tok) < tokens ? tok : -1;
    }
  }

  // Columns [64 kb, 64 kb + 64) of them into a stage's A (a_stage), zero-filled for missing rows and
  // past H (H % 8 == 0: a chunk is wholly in or out); `valid` is any readable address.
  template <class T>
  __device__ __forceinline__ void copy(uint32_t a_stage, const T* x, int64_t hidden, int kb, const void* valid) const {
    const int chunk = threadIdx.x & 7, row_sub = int(threadIdx.x & 127) >> 3;
    const uint32_t offset = uint32_t(row_sub) * 128 + (uint32_t(chunk ^ (row_sub & 7)) << 4);
    const int k = kb * 64 + chunk * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bool in = token[j] >= 0 && k < hidden;
      const void* src = in ? static_cast<const void*>(x + int64_t(token[j]) * hidden + k) : valid;
      cp_async_16_zfill(a_stage + offset + j * (16 * 128), src, in ? 16 : 0);
    }
  }
};

}  // namespace moe::gemm::sm90
