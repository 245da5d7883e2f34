// The grouped weight gradient on sm90a: out[g] = lhs[rows of g]ᵀ · rhs[rows of g] in one persistent
// warp-specialized kernel.
//
// Why not CUTLASS's ptr-array kernel: it rewrites its output's TMA descriptor for every group and
// first waits for the previous tile's stores to drain, and with a few hundred rows per group
// (Qwen3-30B-A3B at T = 4096) every SM's next tile belongs to another group, so the stores of one
// tile never overlap the MMA of the next (BENCHMARKS.md, "What bounds the misses"). Here the
// epilogue stores straight from registers (16-byte stores after a transpose within each quad of
// lanes) and the consumers go on to the next tile, whose first stages the producer has already
// loaded. Bit-identical to CUTLASS's output; 0.97-1.42x its rate on Qwen3's dW (H100), so the
// default where groups average fewer than kLongGroupRows rows (grouped_wgrad_preferred). With the
// register epilogue its tiles take their MMA plus their stores' drain, one after the other; the
// other epilogues (MOE_SM90_WGRAD_EPILOGUE, an A/B switch) stage the whole output tile in shared
// memory so that the drain can run under the next tile's MMA (docs/design-notes.md, "Grouped GEMM
// tiles", item 8).
//
// 384 threads per block: warpgroup 0 produces, warpgroups 1-2 consume (wgmma m64n256k16, both
// operands MN-major: the reduction runs over rows; 64 rows of out[g] each). Tile 128 x 256 of
// out[g], 64 rows per stage, 4 stages (3 with a staged epilogue). A stage of 64 rows inside
// the group is loaded by TMA (one thread, 2 + 4 boxes); a group's last, partial stage by cp.async
// from the producer's loading threads, zero-filled past the group's end so that nothing of the
// next group, not even a NaN, enters the product (a TMA box would read the next group's rows).
// Tiles run group by group (the blocks running at once share one group's rows in L2); a group
// without rows stores its zero tiles, so there is no zero-fill launch.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>
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

// How a tile leaves the consumers: MOE_SM90_WGRAD_EPILOGUE (an A/B switch, read at every launch).
enum class Epilogue {
  kRegisters,   // "registers" (the default): 16-byte stores straight from registers; 4 stages
  kTma,         // "tma": the whole tile staged in shared memory, stored by TMA; 3 stages
  kStoreWarps,  // "warps": the whole tile staged, stored by warps 1-3 of the producer warpgroup; 3 stages
  kTmaPaced,    // "tma-paced": the whole tile staged, stored by TMA one box at a time by a thread of
                // the producer warpgroup's warp 1 (its next box only once the last has been read); 3 stages
  kRegisters3,  // "registers3": kRegisters on 3 stages, the control for the stage count
};
template <Epilogue E>
constexpr bool kStaged = E != Epilogue::kRegisters && E != Epilogue::kRegisters3;
// The staged tile stored by the producer warpgroup, whose warp 0 alone then loads.
template <Epilogue E>
constexpr bool kProducerStores = E == Epilogue::kStoreWarps || E == Epilogue::kTmaPaced;
template <Epilogue E>
using RingOf = StageRingOf<E == Epilogue::kRegisters ? 4 : 3, kProducerStores<E> ? 32 : 128>;

// A staged tile, 128 x 256 (each consumer's 64 rows: four 64 x 64 boxes in TMA's 128-byte
// swizzle), follows the tables and the staged tile's barriers (kProducerStores: each consumer's half
// full, then each half empty), 1024-aligned (the swizzle's). A staging ring gives up a stage for it.
constexpr int kConsumerOutBytes = 4 * kBoxBytes;
constexpr int kOutBarriersOffset = kGroupTableBytes;
constexpr int kStagedTables = RingOf<Epilogue::kTma>::kTablesOffset;  // every staging ring's
constexpr int kOutTileOffset = (kStagedTables + kGroupTableBytes + 4 * 8 + 1023) / 1024 * 1024 - kStagedTables;
template <Epilogue E>
constexpr int kSmemBytes =
    RingOf<E>::smem_bytes(kStaged<E> ? kOutTileOffset + 2 * kConsumerOutBytes : kGroupTableBytes);
constexpr int kEpilogueBarrier = kStaggerBarrier + 1;  // + consumer: named barriers 2 and 3
constexpr int kStoreThreads = 96;                      // kStoreWarps: warps 1-3
// Arrivals on a staged half's empty barrier: each store warp, or the one storing thread.
template <Epilogue E>
constexpr int kStoreArrivals = E == Epilogue::kStoreWarps ? kStoreThreads / 32 : 1;
static_assert(kSmemBytes<Epilogue::kRegisters> <= 227 * 1024 && kSmemBytes<Epilogue::kTma> <= 227 * 1024);
static_assert(RingOf<Epilogue::kStoreWarps>::kTablesOffset == kStagedTables &&
              RingOf<Epilogue::kTmaPaced>::kTablesOffset == kStagedTables);
static_assert(kTileK * kStepRows * 2 == kStageABytes && kTileN * kStepRows * 2 == kStageBBytes);

struct Params {
  const void* lhs;
  const void* rhs;
  const int32_t* group_sizes;
  void* out;
  int64_t rows, k, n, groups;
  // Tiles of one group along K and N, and of all groups (run group by group). From the host: the
  // loop bound then stays in the parameter bank (derived on the device, ptxas spilled it).
  int k_tiles, n_tiles, tiles;
  bool stagger;  // consumer_stagger()
};

template <class T>
struct GmmaOp;
template <>
struct GmmaOp<__nv_bfloat16> {
  using type = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::MN, cute::SM90::GMMA::Major::MN>;
};
template <>
struct GmmaOp<__half> {
  using type = cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<cute::SM90::GMMA::Major::MN, cute::SM90::GMMA::Major::MN>;
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

// A staged tile's half of consumer `consumer`, and its barriers (kProducerStores).
template <class Ring>
__device__ __forceinline__ uint32_t staged_half(const Ring& ring, int consumer) {
  return ring.base + Ring::kTablesOffset + kOutTileOffset + consumer * kConsumerOutBytes;
}
template <class Ring>
__device__ __forceinline__ uint32_t half_full(const Ring& ring, int consumer) {
  return ring.base + Ring::kTablesOffset + kOutBarriersOffset + 8 * consumer;
}
template <class Ring>
__device__ __forceinline__ uint32_t half_empty(const Ring& ring, int consumer) {
  return ring.base + Ring::kTablesOffset + kOutBarriersOffset + 8 * (2 + consumer);
}

// The consumer's 64 rows, columns [0, 64 boxes), rounded to T into its half of the staged tile:
// 64 x 64 boxes in TMA's 128-byte swizzle (row r's 16-byte chunk c at r * 128 + ((c ^ r % 8) * 16)).
template <class T>
__device__ __forceinline__ void stage_rows(uint32_t half, int boxes, const float (&acc)[128]) {
  const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31, q = lane & 3;
#pragma unroll
  for (int b = 0; b < 4; ++b) {  // the tile's columns [64 b, 64 b + 64)
    if (b >= boxes) break;
    const uint32_t box = half + b * kBoxBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * warp + lane / 4 + 8 * h;  // of the consumer's 64; row % 8 == lane / 4
#pragma unroll
      for (int mm = 0; mm < 2; ++mm) {  // column groups 4 m .. 4 m + 3, m = 2 b + mm: 32 columns
        const uint4 w = accumulator_chunk<T>(acc, 2 * b + mm, h);
        const int chunk = 4 * mm + q;  // 16-byte chunk of the box's 128-byte row
        const uint32_t addr = box + row * 128 + (uint32_t(chunk ^ (lane / 4)) << 4);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                     : "memory");
      }
    }
  }
}

// kTma: the consumer stages its rows and one thread stores them by TMA; the consumer goes on to
// the next tile at once, and only the next tile's epilogue waits for the stores to have read the
// buffer. (Measured on an H100: slower than the register epilogue; docs/design-notes.md,
// "Grouped GEMM tiles", item 8.)
template <class T, int kConsumer, class Ring>
__device__ __forceinline__ void store_tile_tma(const Params& p, const Tile& t, const Ring& ring,
                                               const CUtensorMap* out_map, const float (&acc)[128]) {
  constexpr int barrier = kEpilogueBarrier + kConsumer;
  const int k0 = t.k0 + 64 * kConsumer;  // p.k % 64 == 0: a consumer's 64 rows are all in or all out
  if (k0 >= p.k) return;
  const uint32_t half = staged_half(ring, kConsumer);
  const bool leader = (threadIdx.x & 127) == 0;
  const int boxes = column_boxes(p, t);
  if (leader) tma_store_wait_read();  // the previous tile's stores have left the buffer
  named_barrier_sync<barrier, 128>();
  stage_rows<T>(half, boxes, acc);
  fence_smem_to_tma();
  named_barrier_sync<barrier, 128>();
  if (leader) {
    for (int b = 0; b < boxes; ++b) tma_store_3d(out_map, half + b * kBoxBytes, t.n0 + 64 * b, k0, t.group);
    tma_store_commit();
  }
}

// kProducerStores, consumer side: once the producer's stores have emptied its half, the consumer
// stages its rows there and goes on to the next tile. `phase`: its count of staged tiles, mod 2.
template <class T, Epilogue E, class Ring>
__device__ __forceinline__ void stage_tile_for_producer(const Params& p, const Tile& t, const Ring& ring, int consumer,
                                                        uint32_t& phase, const float (&acc)[128]) {
  if (t.k0 + 64 * consumer >= p.k) return;  // the storing threads skip it too
  mbar_wait(half_empty(ring, consumer), phase ^ 1);
  stage_rows<T>(staged_half(ring, consumer), column_boxes(p, t), acc);
  if constexpr (E == Epilogue::kTmaPaced) fence_smem_to_tma();
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(half_full(ring, consumer));
  phase ^= 1;
}

// kProducerStores, store side (warps 1-3 of the producer warpgroup): each staged half to out[g],
// by kStoreWarps' 96 threads with 16-byte stores (8 threads a 128-byte row segment), or by
// kTmaPaced's one thread as TMA stores of one box at a time, each issued once the last one has
// been read out of shared memory (the SM's TMA loads then queue behind at most one box). The
// consumers do not wait for the stores.
template <class T, Epilogue E, class Ring>
__device__ __forceinline__ void store_staged_tiles(const Params& p, const Ring& ring, const CUtensorMap* out_map,
                                                   const int32_t* group_start, const int32_t* group_end) {
  const int t = threadIdx.x - 32;  // 0 .. kStoreThreads - 1
  if (E == Epilogue::kTmaPaced && t != 0) return;
  uint32_t phase[2] = {0, 0};
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const Tile tl = decode_tile(tile, p, group_start, group_end);
    const int boxes = column_boxes(p, tl);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int k0 = tl.k0 + 64 * c;
      if (k0 >= p.k) continue;
      mbar_wait(half_full(ring, c), phase[c]);
      const uint32_t half = staged_half(ring, c);
      if constexpr (E == Epilogue::kTmaPaced) {
        for (int b = 0; b < boxes; ++b) {
          tma_store_3d(out_map, half + b * kBoxBytes, tl.n0 + 64 * b, k0, tl.group);
          tma_store_commit();
          tma_store_wait_read();
        }
        mbar_arrive(half_empty(ring, c));
      } else {
        T* out = static_cast<T*>(p.out) + (int64_t(tl.group) * p.k + k0) * p.n + tl.n0;
        for (int i = t; i < boxes * 512; i += kStoreThreads) {  // 512 chunks a box: 64 rows x 8
          const int b = i >> 9, r = (i >> 3) & 63, chunk = i & 7;
          uint4 v;
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "r"(half + b * kBoxBytes + r * 128 + (uint32_t(chunk ^ (r & 7)) << 4)));
          *reinterpret_cast<uint4*>(out + int64_t(r) * p.n + 64 * b + 8 * chunk) = v;
        }
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(half_empty(ring, c));
      }
      phase[c] ^= 1;
    }
  }
  if constexpr (E == Epilogue::kTmaPaced) tma_store_wait_all();
}

// cp.async of BOXES 64-column boxes of rows [row0, row0 + 64) of a [rows, cols] array from column
// col0 into a stage by kLoaders threads: thread t copies 16-byte chunk t % 8 of rows t / 8 + (kLoaders / 8) j,
// each landing where TMA's 128-byte swizzle puts it (the MN-major layout wgmma reads). Rows from
// row_end on and columns from cols on are zero-filled.
template <int BOXES, int kLoaders, class T>
__device__ __forceinline__ void copy_rows(uint32_t stage, const T* src, int64_t cols, int col0, int row0, int row_end,
                                          int t) {
  constexpr int kRowStep = kLoaders / 8, kUnroll = kLoaders == 128 ? 4 : 1;  // 32 loaders: 56 registers
  const int chunk = t & 7, row_sub = t >> 3;
#pragma unroll kUnroll
  for (int j = 0; j < kStepRows / kRowStep; ++j) {
    const int r = row_sub + kRowStep * j, row = row0 + r;
    const uint32_t dst = stage + r * 128 + (uint32_t(chunk ^ (r & 7)) << 4);
#pragma unroll
    for (int b = 0; b < BOXES; ++b) {
      const int64_t col = col0 + b * kBox + chunk * 8;
      const bool ok = row < row_end && col < cols;
      cp_async_16_zfill(dst + b * kBoxBytes, ok ? src + int64_t(row) * cols + col : src, ok ? 16 : 0);
    }
  }
}

template <class T, Epilogue E>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_wgrad_kernel(const Params p, const __grid_constant__ CUtensorMap lhs_map,
                         const __grid_constant__ CUtensorMap rhs_map, const __grid_constant__ CUtensorMap out_map) {
  using Ring = RingOf<E>;
  constexpr int kLoaders = kProducerStores<E> ? 32 : 128;
  extern __shared__ uint8_t smem_raw[];
  Ring ring(smem_raw);
  int32_t* group_start = ring.template tables<int32_t>();
  int32_t* group_end = ring.template tables<int32_t>(kMaxGroups * 4);
  if (threadIdx.x < 32) scan_groups(p, group_start, group_end);
  if (threadIdx.x == 32) {
    if constexpr (kProducerStores<E>) {
      for (int c = 0; c < 2; ++c) {
        mbar_init(half_full(ring, c), 4);  // the consumer's warps
        mbar_init(half_empty(ring, c), kStoreArrivals<E>);
      }
    }
    ring.init_barriers();  // and the fence that makes every barrier's init visible
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    producer_registers();
    if (kProducerStores<E> && threadIdx.x >= kLoaders) {
      store_staged_tiles<T, E>(p, ring, &out_map, group_start, group_end);
      return;
    }
    // ---------------- producer (the loading threads) ----------------
    const int t = threadIdx.x;
    const T* lhs = static_cast<const T*>(p.lhs);
    const T* rhs = static_cast<const T*>(p.rhs);
    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
      const Tile tl = decode_tile(tile, p, group_start, group_end);
      for (int step = 0; step < tl.steps; ++step) {
        ring.wait_empty();
        const uint32_t full = ring.full(ring.stage), a_stage = ring.a(ring.stage), b_stage = ring.b(ring.stage);
        const int step_row = tl.row0 + step * kStepRows;
        if (tl.row_end - step_row >= kStepRows) {  // 64 rows of the group: TMA
          if (t == 0) {
            // K, N % 64 == 0: boxes are whole; those past K or N are not loaded (their rows or
            // columns of out are not stored).
            const int a_boxes = int(min(int64_t(2), (p.k - tl.k0) / kBox)), b_boxes = column_boxes(p, tl);
            mbar_arrive_expect_tx(full, (a_boxes + b_boxes) * kBoxBytes);
            for (int b = 0; b < a_boxes; ++b) tma_load_2d(a_stage + b * kBoxBytes, &lhs_map, full, tl.k0 + b * kBox, step_row);
            for (int b = 0; b < b_boxes; ++b) tma_load_2d(b_stage + b * kBoxBytes, &rhs_map, full, tl.n0 + b * kBox, step_row);
            mbar_arrive(full, Ring::kFullArrivals - 1);  // the other loading threads' arrivals, in one
          }
        } else {  // the group's partial last stage: cp.async, zero-filled past its end
          copy_rows<2, kLoaders>(a_stage, lhs, p.k, tl.k0, step_row, tl.row_end, t);
          copy_rows<4, kLoaders>(b_stage, rhs, p.n, tl.n0, step_row, tl.row_end, t);
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
    StageConsumer<typename GmmaOp<T>::type> consume(consumer, p.stagger);
    uint32_t staged_phase = 0;  // kProducerStores
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
      } else if constexpr (kProducerStores<E>) {
        stage_tile_for_producer<T, E>(p, tl, ring, consumer, staged_phase, acc);
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

// MOE_SM90_WGRAD_EPILOGUE: registers (default) | registers3 | tma | warps | tma-paced; false for anything else.
bool epilogue_from_env(Epilogue* e) {
  const char* v = std::getenv("MOE_SM90_WGRAD_EPILOGUE");
  const std::string_view s = v == nullptr ? "registers" : v;
  if (s == "registers") *e = Epilogue::kRegisters;
  else if (s == "tma") *e = Epilogue::kTma;
  else if (s == "warps") *e = Epilogue::kStoreWarps;
  else if (s == "tma-paced") *e = Epilogue::kTmaPaced;
  else if (s == "registers3") *e = Epilogue::kRegisters3;
  else return false;
  return true;
}

template <Epilogue E>
using Is = std::integral_constant<Epilogue, E>;

template <class T, Epilogue E>
cudaError_t launch_kernel(const Params& p, int64_t blocks, const CUtensorMap& lhs_map, const CUtensorMap& rhs_map,
                          const CUtensorMap& out_map, cudaStream_t stream) {
  auto kernel = grouped_wgrad_kernel<T, E>;
  MOE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<E>));
  kernel<<<dim3(unsigned(blocks)), dim3(kThreads), kSmemBytes<E>, stream>>>(p, lhs_map, rhs_map, out_map);
  MOE_CHECK_LAUNCH();
  return cudaSuccess;
}

template <class T>
cudaError_t launch(const GroupedWgradArgs& a, CUtensorMapDataType type, cudaStream_t stream) {
  CUtensorMap lhs_map, rhs_map, out_map;
  // Without rows nothing is loaded; the maps then point at out (any valid address) for one row.
  MOE_CUDA_TRY(make_rows_map(a.rows > 0 ? a.lhs : a.out, a.rows, a.k, type, &lhs_map));
  MOE_CUDA_TRY(make_rows_map(a.rows > 0 ? a.rhs : a.out, a.rows, a.n, type, &rhs_map));
  // out [G, K, N] in the TMA-store epilogue's boxes: 64 columns x 64 rows of one group.
  MOE_CUDA_TRY(encode_boxes(&out_map, type, a.out, 3, a.groups, a.k, a.n, kBox, CU_TENSOR_MAP_L2_PROMOTION_NONE));
  Params p;
  p.lhs = a.lhs, p.rhs = a.rhs, p.group_sizes = a.group_sizes, p.out = a.out;
  p.rows = a.rows, p.k = a.k, p.n = a.n, p.groups = a.groups;
  p.stagger = consumer_stagger();
  p.k_tiles = int((a.k + kTileK - 1) / kTileK), p.n_tiles = int((a.n + kTileN - 1) / kTileN);
  const int64_t tiles = a.groups * p.k_tiles * p.n_tiles;  // < 2^31: grouped_wgrad_fits
  p.tiles = int(tiles);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(moe::cuda::multiprocessors(), tiles));
  Epilogue e;
  if (!epilogue_from_env(&e)) return cudaErrorInvalidValue;
  auto run = [&](auto epilogue) {
    return launch_kernel<T, decltype(epilogue)::value>(p, blocks, lhs_map, rhs_map, out_map, stream);
  };
  switch (e) {
    case Epilogue::kTma: return run(Is<Epilogue::kTma>{});
    case Epilogue::kStoreWarps: return run(Is<Epilogue::kStoreWarps>{});
    case Epilogue::kTmaPaced: return run(Is<Epilogue::kTmaPaced>{});
    case Epilogue::kRegisters3: return run(Is<Epilogue::kRegisters3>{});
    default: return run(Is<Epilogue::kRegisters>{});
  }
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
  return dtype == Dtype::kBf16 ? launch<__nv_bfloat16>(a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream)
                               : launch<__half>(a, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
}

}  // namespace moe::gemm
