// The grouped weight gradient on sm90a: out[g] = lhs[rows of g]ᵀ · rhs[rows of g] in one persistent
// warp-specialized kernel.
//
// Why not CUTLASS's ptr-array kernel: it rewrites its output's TMA descriptor for every group and
// first waits for the previous tile's stores to drain, and with a few hundred rows per group
// (Qwen3-30B-A3B at T = 4096) every SM's next tile belongs to another group, so the stores of one
// tile never overlap the MMA of the next (BENCHMARKS.md, "What bounds the misses"). Here each
// consumer hands its tile to TMA stores one 64 x 64 box at a time through a box buffer in shared
// memory and goes on to the next tile, whose first stages the producer has already loaded.
// Bit-identical to CUTLASS's output; the default where groups average fewer than kLongGroupRows
// rows (grouped_wgrad_preferred). MOE_SM90_WGRAD_EPILOGUE=registers (an A/B switch) stores from
// registers instead (16-byte stores after a transpose within each quad of lanes), 4-7% slower on
// Qwen3's dW (H100). Staging the whole tile costs a stage of the ring, and three stages feed the
// MMA 13% worse than four: measured, and removed (docs/design-notes.md, "Grouped GEMM tiles", item 8).
//
// 384 threads per block: warpgroup 0 produces, warpgroups 1-2 consume (wgmma m64n256k16, both
// operands MN-major: the reduction runs over rows; 64 rows of out[g] each). Tile 128 x 256 of
// out[g], 64 rows per stage, 4 stages. A stage of 64 rows inside the group is loaded by TMA (one
// thread, 2 + 4 boxes); a group's last, partial stage by cp.async from all 128 producer threads,
// zero-filled past the group's end so that nothing of the next group, not even a NaN, enters the
// product (a TMA box would read the next group's rows). Tiles run group by group (the blocks
// running at once share one group's rows in L2); a group without rows stores its zero tiles, so
// there is no zero-fill launch.
//
// Gathered operand (gather_index set): row r of lhs (or of rhs) is row gather_index[r] of a [T, K]
// (or [T, N]) array, zero where that index is outside [0, T): the layer's weight gradients read x
// (first GEMM, lhs) and the output's cotangent (second GEMM, rhs) through the routing's row ->
// token index instead of permuted copies [M, .] of them. That operand then always arrives by
// cp.async (TMA has no row gather), the other by TMA on whole stages as before.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda_check.h"
#include "grouped_wgrad.h"
#include "sm90_stages.cuh"

namespace moe::gemm {
namespace {

using namespace sm90;

constexpr int kTileK = 128;    // rows of out[g] per tile (columns of lhs): A of the stage ring
constexpr int kTileN = 256;    // columns of out[g] per tile (columns of rhs): B
constexpr int kStepRows = 64;  // rows of lhs and rhs reduced per stage
constexpr int kMaxGroups = 1024;
constexpr int kGroupTableBytes = 2 * kMaxGroups * 4;  // each group's first and end row
// Then one 64 x 64 output box per consumer for the TMA epilogue, 1024-aligned (the swizzle's).
constexpr int kOutBoxOffset = (kTablesOffset + kGroupTableBytes + 1023) / 1024 * 1024 - kTablesOffset;
constexpr int kEpilogueBarrier = kStaggerBarrier + 1;  // + consumer: named barriers 2 and 3
static_assert(kTileK * kStepRows * 2 == kStageABytes && kTileN * kStepRows * 2 == kStageBBytes);

// How a tile leaves the consumers: MOE_SM90_WGRAD_EPILOGUE (an A/B switch, read at every launch).
enum class Epilogue {
  kTma,        // "tma" (the default; the order of the variable's values): one box at a time through
               // shared memory, stored by TMA
  kRegisters,  // "registers": 16-byte stores straight from registers
};
template <Epilogue E>
constexpr int kSmemBytes = stage_ring_smem_bytes(E == Epilogue::kTma ? kOutBoxOffset + 2 * kBoxBytes : kGroupTableBytes);
static_assert(kSmemBytes<Epilogue::kTma> <= 227 * 1024);

struct Params {
  const void* lhs;
  const void* rhs;
  const int32_t* group_sizes;
  const int32_t* gather_index;  // gathered operand: its row r is row gather_index[r] of [gather_src_rows, .]
  void* out;
  int64_t rows, k, n, groups, gather_src_rows;
  // Tiles of one group along K and N, and of all groups (run group by group). From the host: the
  // loop bound then stays in the parameter bank (derived on the device, ptxas spilled it).
  int k_tiles, n_tiles, tiles;
  bool stagger;  // consumer_stagger()
};


// Warp 0: each group's first and end row, clamped to M, into shared memory.
__device__ void scan_groups(const Params& p, int32_t* group_start, int32_t* group_end) {
  const int lane = threadIdx.x & 31;
  int64_t rows_before = 0;
  for (int base = 0; base < p.groups; base += 32) {
    const int g = base + lane;
    const int64_t size = g < p.groups ? max(p.group_sizes[g], 0) : 0;
    const int64_t rows_incl = warp_inclusive_sum(size, lane) + rows_before;
    if (g < p.groups) {
      group_start[g] = int32_t(min(rows_incl - size, p.rows));
      group_end[g] = int32_t(min(rows_incl, p.rows));
    }
    rows_before = __shfl_sync(0xffffffffu, rows_incl, 31);
  }
}

struct Tile {
  int group, k0, n0;  // out[group][k0 : k0 + 128, n0 : n0 + 256]
  int row0, row_end;  // the group's rows
  int steps;          // 64-row stages
};

__device__ __forceinline__ Tile decode_tile(int tile, const Params& p, const int32_t* group_start,
                                            const int32_t* group_end) {
  const int per_group = p.k_tiles * p.n_tiles;
  Tile t;
  t.group = tile / per_group;
  const int in_group = tile - t.group * per_group;
  t.k0 = (in_group % p.k_tiles) * kTileK;  // the k tiles of one column block run together: rhs's slice stays in L2
  t.n0 = (in_group / p.k_tiles) * kTileN;
  t.row0 = group_start[t.group];
  t.row_end = group_end[t.group];
  t.steps = (t.row_end - t.row0 + kStepRows - 1) / kStepRows;
  return t;
}

// The tile's 64-column boxes of out[g] (and of rhs) inside N: K, N % 64 == 0, so boxes are whole
// and those past N are neither loaded nor stored.
__device__ __forceinline__ int column_boxes(const Params& p, const Tile& t) {
  return int(min(int64_t(kTileN / kBox), (p.n - t.n0) / kBox));
}

// Rows row_in_tile and row_in_tile + 8 of the tile, from the accumulator (layout in sm90_stages.cuh).
template <class T>
__device__ __forceinline__ void store_tile(const Params& p, const Tile& t, int row_in_tile, const float (&acc)[128]) {
  const int64_t kw = t.k0 + row_in_tile;  // p.k % 64 == 0: a consumer's 64 rows are all in or all out
  if (kw >= p.k) return;
  T* out = static_cast<T*>(p.out) + (int64_t(t.group) * p.k + kw) * p.n + t.n0;
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {  // column groups 4 m .. 4 m + 3: columns [32 m, 32 m + 32)
      const uint4 w = accumulator_chunk<T>(acc, m, half);
      const int col = 32 * m + 8 * q;
      if (t.n0 + col < p.n)  // p.n % 64 == 0: whole 64-column boxes are in or out
        *reinterpret_cast<uint4*>(out + int64_t(8 * half) * p.n + col) = w;
    }
  }
}

// One box of the consumer's 64 rows, columns [64 b, 64 b + 64), rounded to T into `box`: TMA's
// 128-byte swizzle (row r's 16-byte chunk c at r * 128 + ((c ^ r % 8) * 16)). Each 8 x 8 block of
// the accumulator (an 8-column group, one half of a warp's 16 rows) is one stmatrix matrix whose
// rows are 16-byte chunks of the box: 4 stores a thread and box, no shuffles (quad_transpose's
// shuffles and selects were half the epilogue's instructions: 6% on Qwen3's dW).
template <class T>
__device__ __forceinline__ void stage_box(uint32_t box, int b, const float (&acc)[128]) {
  const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
  const int matrix = lane / 8, r = lane % 8;
  // Matrix j of each store: column group c + j / 2, rows 8 (j % 2) + [0, 8) of the warp's 16.
  const uint32_t row = 16 * warp + 8 * (matrix & 1) + r;  // row % 8 == r
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int c = 8 * b + 2 * p;  // column groups c and c + 1: accumulator values 4 c .. 4 c + 7
    const uint32_t chunk = 2 * p + (matrix >> 1);
    stmatrix_x4(box + row * 128 + ((chunk ^ r) << 4), pack2<T>(acc[4 * c], acc[4 * c + 1]),
                pack2<T>(acc[4 * c + 2], acc[4 * c + 3]), pack2<T>(acc[4 * c + 4], acc[4 * c + 5]),
                pack2<T>(acc[4 * c + 6], acc[4 * c + 7]));
  }
}

// kTma: the consumer writes each box of its 64 rows into its box buffer, one thread stores it by
// TMA, and the buffer is written again only once that store has read it; after the last box the
// consumer goes on to the next tile at once, so the stores drain under its MMA. (Staging a whole
// tile instead measured slower: it takes a stage of the ring.)
template <class T, int kConsumer>
__device__ __forceinline__ void store_tile_tma(const Params& p, const Tile& t, const StageRing& ring,
                                               const CUtensorMap* out_map, const float (&acc)[128]) {
  constexpr int barrier = kEpilogueBarrier + kConsumer;
  const int k0 = t.k0 + 64 * kConsumer;  // p.k % 64 == 0: a consumer's 64 rows are all in or all out
  if (k0 >= p.k) return;
  const uint32_t box = ring.base + kTablesOffset + kOutBoxOffset + kConsumer * kBoxBytes;
  const bool leader = (threadIdx.x & 127) == 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) {  // the tile's columns [64 b, 64 b + 64)
    if (t.n0 + 64 * b >= p.n) break;  // p.n % 64 == 0: column_boxes(p, t) boxes
    if (leader) tma_store_wait_read();  // the previous box has left the buffer
    named_barrier_sync<barrier, 128>();
    stage_box<T>(box, b, acc);
    fence_smem_to_tma();
    named_barrier_sync<barrier, 128>();
    if (leader) {
      tma_store_3d(out_map, box, t.n0 + 64 * b, k0, t.group);
      tma_store_commit();
    }
  }
}

// cp.async of BOXES 64-column boxes of rows [row0, row0 + 64) of a [rows, cols] array from column
// col0 into a stage (dst: the stage plus this thread's box_offset): chunk `chunk` of rows row_sub + 16 j.
// Rows from row_end on and columns from cols on are zero-filled.
template <int BOXES, class T>
__device__ __forceinline__ void copy_rows(uint32_t dst, const T* src, int64_t cols, int col0, int row0, int row_end,
                                          int row_sub, int chunk) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = row0 + row_sub + 16 * j;
#pragma unroll
    for (int b = 0; b < BOXES; ++b) {
      const int64_t col = col0 + b * kBox + chunk * 8;
      const bool ok = row < row_end && col < cols;
      cp_async_16_zfill(dst + b * kBoxBytes + j * (16 * 128), ok ? src + int64_t(row) * cols + col : src, ok ? 16 : 0);
    }
  }
}

// The gathered operand's source rows of this thread's stage rows row0 + row_sub + 16 j: index[row],
// -1 from row_end on or outside [0, src_rows).
__device__ __forceinline__ void gathered_rows(int32_t (&src_row)[4], const int32_t* index, int64_t src_rows, int row0,
                                              int row_end, int row_sub) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = row0 + row_sub + 16 * j;
    const int32_t r = row < row_end ? index[row] : -1;
    src_row[j] = r >= 0 && int64_t(r) < src_rows ? r : -1;
  }
}

// copy_rows of the gathered operand: the stage's row row_sub + 16 j from row src_row[j] (-1: zeros).
template <int BOXES, class T>
__device__ __forceinline__ void copy_gathered_rows(uint32_t dst, const T* src, int64_t cols, int col0,
                                                   const int32_t (&src_row)[4], int chunk) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int b = 0; b < BOXES; ++b) {
      const int64_t col = col0 + b * kBox + chunk * 8;
      const bool ok = src_row[j] >= 0 && col < cols;
      cp_async_16_zfill(dst + b * kBoxBytes + j * (16 * 128), ok ? src + int64_t(src_row[j]) * cols + col : src,
                        ok ? 16 : 0);
    }
  }
}

enum class Gather { kNone, kLhs, kRhs };

template <class T, Epilogue E, Gather G>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_wgrad_kernel(const Params p, const __grid_constant__ CUtensorMap lhs_map,
                         const __grid_constant__ CUtensorMap rhs_map, const __grid_constant__ CUtensorMap out_map) {
  extern __shared__ uint8_t smem_raw[];
  StageRing ring(smem_raw);
  int32_t* group_start = ring.tables<int32_t>();
  int32_t* group_end = ring.tables<int32_t>(kMaxGroups * 4);
  if (threadIdx.x < 32) scan_groups(p, group_start, group_end);
  if (threadIdx.x == 32) ring.init_barriers();
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ---------------- producer ----------------
    producer_registers();
    // cp.async: thread t copies 16-byte chunk t % 8 of rows t / 8 + 16 j, j < 4, of each 64-column
    // box. Row r of a box lands at r * 128 + ((chunk ^ (r % 8)) * 16), as TMA's 128-byte swizzle
    // puts it: the MN-major layout wgmma reads (r % 8 == row_sub % 8 for every j).
    const int t = threadIdx.x;
    const int chunk = t & 7, row_sub = t >> 3;
    const uint32_t box_offset = uint32_t(row_sub) * 128 + (uint32_t(chunk ^ (row_sub & 7)) << 4);
    const T* lhs = static_cast<const T*>(p.lhs);
    const T* rhs = static_cast<const T*>(p.rhs);
    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
      const Tile tl = decode_tile(tile, p, group_start, group_end);
      for (int step = 0; step < tl.steps; ++step) {
        const int step_row = tl.row0 + step * kStepRows;
        const bool whole = tl.row_end - step_row >= kStepRows;  // 64 rows of the group
        int32_t src_row[4];  // the gathered operand's: loaded before the wait, which hides their latency
        if constexpr (G != Gather::kNone) gathered_rows(src_row, p.gather_index, p.gather_src_rows, step_row, tl.row_end, row_sub);
        ring.wait_empty();
        const uint32_t full = ring.full(ring.stage), a_stage = ring.a(ring.stage), b_stage = ring.b(ring.stage);
        if (whole) {  // TMA, the gathered operand by cp.async
          if (t == 0) {
            // K, N % 64 == 0: boxes are whole; those past K or N are not loaded (their rows or
            // columns of out are not stored).
            const int a_boxes = G == Gather::kLhs ? 0 : int(min(int64_t(2), (p.k - tl.k0) / kBox));
            const int b_boxes = G == Gather::kRhs ? 0 : column_boxes(p, tl);
            mbar_arrive_expect_tx(full, (a_boxes + b_boxes) * kBoxBytes);
            for (int b = 0; b < a_boxes; ++b) tma_load_2d(a_stage + b * kBoxBytes, &lhs_map, full, tl.k0 + b * kBox, step_row);
            for (int b = 0; b < b_boxes; ++b) tma_load_2d(b_stage + b * kBoxBytes, &rhs_map, full, tl.n0 + b * kBox, step_row);
            if (G == Gather::kNone) mbar_arrive(full, kFullArrivals - 1);  // the other producer threads' arrivals, in one
          }
          if constexpr (G != Gather::kNone) {  // the expect_tx above and these 128 arrivals: kFullArrivals
            if constexpr (G == Gather::kLhs) copy_gathered_rows<2>(a_stage + box_offset, lhs, p.k, tl.k0, src_row, chunk);
            else copy_gathered_rows<4>(b_stage + box_offset, rhs, p.n, tl.n0, src_row, chunk);
            cp_async_arrive_noinc(full);
          }
        } else {  // the group's partial last stage: cp.async, zero-filled past its end
          if constexpr (G == Gather::kLhs) copy_gathered_rows<2>(a_stage + box_offset, lhs, p.k, tl.k0, src_row, chunk);
          else copy_rows<2>(a_stage + box_offset, lhs, p.k, tl.k0, step_row, tl.row_end, row_sub, chunk);
          if constexpr (G == Gather::kRhs) copy_gathered_rows<4>(b_stage + box_offset, rhs, p.n, tl.n0, src_row, chunk);
          else copy_rows<4>(b_stage + box_offset, rhs, p.n, tl.n0, step_row, tl.row_end, row_sub, chunk);
          cp_async_arrive_noinc(full);
          if (t == 0) mbar_arrive(full);
        }
        ring.advance();
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {
    // ---------------- consumers ----------------
    consumer_registers();
    const int consumer = warpgroup - 1;  // rows [64 consumer, 64 consumer + 64) of the tile
    const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    const int row_in_tile = 64 * consumer + 16 * warp + lane / 4;
    StageConsumer<Mma64x256<T, Major::MN, Major::MN>> consume(consumer, p.stagger);
    float acc[128];
    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
      const Tile tl = decode_tile(tile, p, group_start, group_end);
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      // A, MN-major: this consumer's 64 rows of out are one box; +16 rows = 2048 bytes per k16.
      for (int step = 0; step < tl.steps; ++step) {
        // A group's partial last stage: 16-row steps wholly past its end multiply zeros; skipped.
        const int rows = min(kStepRows, tl.row_end - (tl.row0 + step * kStepRows));
        consume.mma(ring, acc, consumer * kBoxBytes, 2048, kBoxBytes, (rows + 15) / 16);
      }
      consume.finish(ring, acc);
      if constexpr (E == Epilogue::kTma) {
        if (consumer == 0) store_tile_tma<T, 0>(p, tl, ring, &out_map, acc);
        else store_tile_tma<T, 1>(p, tl, ring, &out_map, acc);
      } else {
        store_tile<T>(p, tl, row_in_tile, acc);
      }
    }
    if (E == Epilogue::kTma && (threadIdx.x & 127) == 0) tma_store_wait_all();
  }
}

// a [rows, cols] row-major in boxes of 64 columns x 64 rows (the MN-major layout wgmma reads).
cudaError_t make_rows_map(const void* a, int64_t rows, int64_t cols, CUtensorMapDataType type, CUtensorMap* map) {
  return encode_boxes(map, type, a, 2, 1, std::max<int64_t>(rows, 1), cols, kStepRows,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

template <Epilogue E>
using Is = std::integral_constant<Epilogue, E>;

template <class T, Epilogue E, Gather G>
cudaError_t launch_kernel(const Params& p, int64_t blocks, const CUtensorMap& lhs_map, const CUtensorMap& rhs_map,
                          const CUtensorMap& out_map, cudaStream_t stream) {
  auto kernel = grouped_wgrad_kernel<T, E, G>;
  MOE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<E>));
  kernel<<<dim3(unsigned(blocks)), dim3(kThreads), kSmemBytes<E>, stream>>>(p, lhs_map, rhs_map, out_map);
  MOE_CHECK_LAUNCH();
  return cudaSuccess;
}

template <class T>
cudaError_t launch(const GroupedWgradArgs& a, CUtensorMapDataType type, cudaStream_t stream) {
  CUtensorMap lhs_map, rhs_map, out_map;
  // Without rows nothing is loaded; the maps then point at out (any valid address) for one row.
  // A gathered operand is not read by TMA: its map is never used.
  const Gather gather = a.gather_index == nullptr ? Gather::kNone : a.gather_rhs ? Gather::kRhs : Gather::kLhs;
  const bool lhs_by_tma = a.rows > 0 && gather != Gather::kLhs, rhs_by_tma = a.rows > 0 && gather != Gather::kRhs;
  MOE_CUDA_TRY(make_rows_map(lhs_by_tma ? a.lhs : a.out, lhs_by_tma ? a.rows : 1, a.k, type, &lhs_map));
  MOE_CUDA_TRY(make_rows_map(rhs_by_tma ? a.rhs : a.out, rhs_by_tma ? a.rows : 1, a.n, type, &rhs_map));
  // out [G, K, N] in the TMA-store epilogue's boxes: 64 columns x 64 rows of one group.
  MOE_CUDA_TRY(encode_boxes(&out_map, type, a.out, 3, a.groups, a.k, a.n, kBox, CU_TENSOR_MAP_L2_PROMOTION_NONE));
  Params p;
  p.lhs = a.lhs, p.rhs = a.rhs, p.group_sizes = a.group_sizes, p.gather_index = a.gather_index, p.out = a.out;
  p.rows = a.rows, p.k = a.k, p.n = a.n, p.groups = a.groups, p.gather_src_rows = a.gather_src_rows;
  p.stagger = consumer_stagger();
  p.k_tiles = int((a.k + kTileK - 1) / kTileK), p.n_tiles = int((a.n + kTileN - 1) / kTileN);
  const int64_t tiles = a.groups * p.k_tiles * p.n_tiles;  // < 2^31: grouped_wgrad_fits
  p.tiles = int(tiles);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(moe::cuda::multiprocessors(), tiles));
  // MOE_SM90_WGRAD_EPILOGUE (Epilogue's order).
  const int epilogue = env_choice("MOE_SM90_WGRAD_EPILOGUE", {"tma", "registers"});
  if (epilogue < 0) return cudaErrorInvalidValue;
  const Epilogue e = Epilogue(epilogue);
  auto run = [&](auto epilogue) {
    constexpr Epilogue kE = decltype(epilogue)::value;
    return launch_kernel<T, kE, Gather::kNone>(p, blocks, lhs_map, rhs_map, out_map, stream);
  };
  // A gathered operand always stores by TMA (the registers epilogue is an A/B switch of the plain kernel).
  if (gather == Gather::kLhs) return launch_kernel<T, Epilogue::kTma, Gather::kLhs>(p, blocks, lhs_map, rhs_map, out_map, stream);
  if (gather == Gather::kRhs) return launch_kernel<T, Epilogue::kTma, Gather::kRhs>(p, blocks, lhs_map, rhs_map, out_map, stream);
  return e == Epilogue::kTma ? run(Is<Epilogue::kTma>{}) : run(Is<Epilogue::kRegisters>{});
}

}  // namespace

bool grouped_wgrad_fits(int64_t rows, int64_t k, int64_t n, int64_t groups) {
  constexpr int64_t kInt32Limit = (int64_t(1) << 31) - kStepRows;  // row indices are int32, a step past the end
  if (k <= 0 || n <= 0 || k % kBox != 0 || n % kBox != 0) return false;
  if (groups < 1 || groups > kMaxGroups || rows < 0 || rows >= kInt32Limit) return false;
  return groups * ((k + kTileK - 1) / kTileK) * ((n + kTileN - 1) / kTileN) < kInt32Limit;
}

bool grouped_wgrad_preferred(int64_t rows, int64_t k, int64_t n, int64_t groups) {
  return grouped_wgrad_fits(rows, k, n, groups) && rows < kLongGroupRows * groups;
}

cudaError_t grouped_wgrad(Dtype dtype, const GroupedWgradArgs& a, cudaStream_t stream) {
  if (!grouped_wgrad_fits(a.rows, a.k, a.n, a.groups)) return cudaErrorInvalidValue;
  if (a.gather_index != nullptr && (a.gather_src_rows < 0 || a.gather_src_rows >= (int64_t(1) << 31)))
    return cudaErrorInvalidValue;
  return dtype == Dtype::kBf16 ? launch<__nv_bfloat16>(a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream)
                               : launch<__half>(a, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
}

}  // namespace moe::gemm
