// gather_gemm on sm90a: out[r] = act(x[row_token[r]] · w[g(r)]) in one warp-specialized kernel.
//
// 384 threads per block: warpgroup 0 produces (cp.async gathers the 128 rows of A straight from
// x, 8 threads per row so that each warp request reads whole 128-byte lines; TMA loads B from w),
// warpgroups 1-2 consume (wgmma m64n256k16, 64 rows each) and run the epilogue (activation in
// f32, one rounding, 16-byte stores straight from registers after a transpose within each quad of
// lanes). Block tile 128 x 256 x 64, 4 stages.
// Gated: the 256 accumulator columns are 128 gate columns and the 128 matching up columns, so
// each thread holds gate column c and up column c + 128 and pairs them in registers.
// Persistent grid; each block scans group_sizes itself (no extra launch). Tiles are handed out in
// order by an atomic counter (MOE_GATHER_GEMM_SCHEDULE=static: block b takes tiles b, b + grid,
// ..., an A/B switch): the tiles running at once are then consecutive ones, which share their
// expert's columns of w in L2; with a static schedule, uneven groups make tiles of unequal length,
// the blocks drift apart, and w was read 1.7-1.9x from DRAM (ncu, routed groups).
#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "gather_gemm.h"
#include "row_tiles.cuh"
#include "sm90_stages.cuh"

namespace moe::gemm {
namespace {

using namespace sm90;

constexpr int kTileRows = kRowTileRows;  // A of the stage ring: rows gathered from x
constexpr int kTileCols = 256;  // B: accumulator columns per block tile
constexpr int kTileK = 64;      // one 128-byte swizzle row of bf16/f16
constexpr int kMaxExperts = 1024;
// Tables: group ends, row-tile ends, each stage's tile (dynamic schedule: the producer tells the
// consumers which tile a stage starts) and the producer's next tile (double-buffered).
constexpr int kStageTileOffset = 2 * kMaxExperts * 4;
constexpr int kNextTileOffset = kStageTileOffset + kStages * 4;
constexpr int kSmemBytes = stage_ring_smem_bytes(kNextTileOffset + 2 * 4);
constexpr int kProducerBarrier = kStaggerBarrier + 1;  // named barrier of the producer warpgroup
static_assert(kTileRows * kTileK * 2 == kStageABytes && kTileCols * kTileK * 2 == kStageBBytes);

struct Params {
  const void* x;
  const int32_t* row_token;
  const int32_t* group_sizes;
  const void* w;  // only as a harmless source address of zero-filling cp.async
  void* out;
  void* pre;  // nullptr: not written
  int64_t tokens, hidden, experts, rows, n, ffn;
  int* tile_counter;  // dynamic schedule: tiles handed out so far beyond the first wave, zeroed before the launch
  int activation;
  bool stagger;  // consumer_stagger()
};


__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float gelu_erf(float v) { return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)); }

template <MlpActivation A>
__device__ __forceinline__ float activate(float v) {
  if constexpr (A == MlpActivation::kSwiglu) return silu(v);
  if constexpr (A == MlpActivation::kGeglu || A == MlpActivation::kGelu) return gelu_erf(v);
  if constexpr (A == MlpActivation::kRelu) return fmaxf(v, 0.f);
  return v;
}

// ---- tile schedule: row_tiles.cuh ---------------------------------------------------------------

using Tile = RowTile;

// ---- epilogue ----------------------------------------------------------------------------------
// Rows row_in_tile and row_in_tile + 8 of the tile, from the accumulator (layout in sm90_stages.cuh).

template <class T, bool kGated, MlpActivation A>
__device__ __forceinline__ void store_tile(const Params& p, const Tile& t, int row_in_tile, const float (&acc)[128]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = t.row0 + row_in_tile + 8 * half;
    const bool row_in = row < t.row_end;  // the same for the 4 lanes of a row; all of them shuffle
    if constexpr (kGated) {
      // Gate column c of the tile pairs with up column c + 128: out column c.
      const int64_t col = int64_t(t.col_tile) * 128 + 8 * q;
      T* out = static_cast<T*>(p.out) + int64_t(row) * p.ffn + col;
      T* pre = p.pre == nullptr ? nullptr : static_cast<T*>(p.pre) + int64_t(row) * p.n + col;
#pragma unroll
      for (int m = 0; m < 4; ++m) {  // column groups 4 m .. 4 m + 3: out columns [32 m, 32 m + 32)
        uint32_t h[4], gate[4], up[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * (4 * m + j) + 2 * half;
          const float g0 = acc[i], g1 = acc[i + 1], u0 = acc[i + 64], u1 = acc[i + 65];
          h[j] = pack2<T>(activate<A>(g0) * u0, activate<A>(g1) * u1);
          gate[j] = pack2<T>(g0, g1);
          up[j] = pack2<T>(u0, u1);
        }
        const uint4 hv = quad_transpose(h);
        if (row_in) *reinterpret_cast<uint4*>(out + 32 * m) = hv;
        if (pre != nullptr) {
          const uint4 gv = quad_transpose(gate), uv = quad_transpose(up);
          if (row_in) {
            *reinterpret_cast<uint4*>(pre + 32 * m) = gv;
            *reinterpret_cast<uint4*>(pre + p.ffn + 32 * m) = uv;
          }
        }
      }
    } else {
      const int64_t col = int64_t(t.col_tile) * kTileCols + 8 * q;
      T* out = static_cast<T*>(p.out) + int64_t(row) * p.n + col;
      T* pre = p.pre == nullptr ? nullptr : static_cast<T*>(p.pre) + int64_t(row) * p.n + col;
      // N % 128 == 0: the last column tile holds 128 or 256 columns.
      const bool right_half = int(p.n) - t.col_tile * kTileCols > 128;
#pragma unroll
      for (int m = 0; m < 8; ++m) {  // column groups 4 m .. 4 m + 3: columns [32 m, 32 m + 32)
        if (m >= 4 && !right_half) break;
        uint32_t h[4], raw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * (4 * m + j) + 2 * half;
          h[j] = pack2<T>(activate<A>(acc[i]), activate<A>(acc[i + 1]));
          raw[j] = pack2<T>(acc[i], acc[i + 1]);
        }
        const uint4 hv = quad_transpose(h);
        if (row_in) *reinterpret_cast<uint4*>(out + 32 * m) = hv;
        if (pre != nullptr) {
          const uint4 rv = quad_transpose(raw);
          if (row_in) *reinterpret_cast<uint4*>(pre + 32 * m) = rv;
        }
      }
    }
  }
}

// Rows [sum(sizes), M) of out and pre are zeros; spread over the consumer threads of all blocks.
__device__ void zero_uncovered_rows(const Params& p, int64_t covered, int consumer_thread) {
  const int64_t out_cols = p.ffn;
  const int64_t stride = int64_t(gridDim.x) * 256;
  const int64_t first = int64_t(blockIdx.x) * 256 + consumer_thread;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // Row widths are multiples of 128 elements, so both regions are whole 16-byte chunks.
  const int64_t out_chunks = (p.rows - covered) * out_cols / 8;
  uint4* out = reinterpret_cast<uint4*>(static_cast<char*>(p.out) + covered * out_cols * 2);
  for (int64_t c = first; c < out_chunks; c += stride) out[c] = zero;
  if (p.pre != nullptr) {
    const int64_t pre_chunks = (p.rows - covered) * p.n / 8;
    uint4* pre = reinterpret_cast<uint4*>(static_cast<char*>(p.pre) + covered * p.n * 2);
    for (int64_t c = first; c < pre_chunks; c += stride) pre[c] = zero;
  }
}

// ---- the kernel --------------------------------------------------------------------------------

template <class T, bool kGated, bool kDynamic>
__global__ void __launch_bounds__(kThreads, 1) gather_gemm_kernel(const Params p, const __grid_constant__ CUtensorMap w_map) {
  extern __shared__ uint8_t smem_raw[];
  StageRing ring(smem_raw);
  int32_t* group_end = ring.tables<int32_t>();
  int32_t* row_tile_end = ring.tables<int32_t>(kMaxExperts * 4);
  volatile int32_t* stage_tile = ring.tables<int32_t>(kStageTileOffset);
  volatile int32_t* next_tile = ring.tables<int32_t>(kNextTileOffset);
  if (threadIdx.x < 32) scan_row_tiles(p.group_sizes, p.experts, p.rows, group_end, row_tile_end);
  if (threadIdx.x == 32) ring.init_barriers();
  __syncthreads();

  const int experts = int(p.experts);
  const int col_tiles = int(kGated ? p.ffn / 128 : (p.n + kTileCols - 1) / kTileCols);
  const int tiles = row_tile_end[experts - 1] * col_tiles;
  const int k_blocks = int((p.hidden + kTileK - 1) / kTileK);
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ---------------- producer ----------------
    producer_registers();
    // The 8 threads of a row read its 128-byte k-block slice whole and a warp instruction reads 4
    // full rows (row_tiles.cuh).
    const int t = threadIdx.x;
    GatheredTileRows a_rows;
    const T* x = static_cast<const T*>(p.x);
    int tile = blockIdx.x;
    for (int i = 0; tile < tiles; ++i) {
      // Dynamic: the tile after this one, asked for now (its latency hides under this tile's loads).
      const int next = kDynamic ? (t == 0 ? atomicAdd(p.tile_counter, 1) + int(gridDim.x) : 0) : tile + int(gridDim.x);
      const Tile tl = decode_row_tile(tile, group_end, row_tile_end, experts, col_tiles);
      a_rows.start(tl, p.row_token, p.tokens);  // padding and invalid tokens: zero-filled rows
      // Gated: boxes 0-1 are gate columns [128 j, 128 j + 128), boxes 2-3 the up columns F + 128 j...
      // Non-gated: 256 consecutive columns; boxes wholly past N are not loaded (their
      // accumulator columns are not stored).
      const int col_base = kGated ? tl.col_tile * 128 : tl.col_tile * kTileCols;
      const bool right_half = kGated || int(p.n) - col_base > 128;  // N % 128 == 0: 2 or 4 boxes
      const uint32_t stage_b_bytes = right_half ? 4 * kBoxBytes : 2 * kBoxBytes;
      for (int kb = 0; kb < k_blocks; ++kb) {
        ring.wait_empty();
        const uint32_t full = ring.full(ring.stage);
        if (t == 0) {
          if (kDynamic && kb == 0) stage_tile[ring.stage] = tile;  // published by the arrive below
          mbar_arrive_expect_tx(full, stage_b_bytes);
          const uint32_t b_stage = ring.b(ring.stage);
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const int col = kGated ? (b < 2 ? col_base + b * kBox : int(p.ffn) + col_base + (b - 2) * kBox)
                                   : col_base + b * kBox;
            if (b < 2 || right_half) tma_load_3d(b_stage + b * kBoxBytes, &w_map, full, col, kb * kTileK, tl.group);
          }
        }
        a_rows.copy(ring.a(ring.stage), x, p.hidden, kb, p.w);  // missing rows and the K tail: zeros
        cp_async_arrive_noinc(full);
        ring.advance();
      }
      if constexpr (kDynamic) {
        if (t == 0) next_tile[i & 1] = next;
        named_barrier_sync<kProducerBarrier, 128>();
        tile = next_tile[i & 1];  // rewritten two tiles later, after the next barrier
      } else {
        tile = next;
      }
    }
    if constexpr (kDynamic) {  // a stage that starts no tile: the consumers stop
      ring.wait_empty();
      if (t == 0) stage_tile[ring.stage] = tiles;
      mbar_arrive(ring.full(ring.stage));
      if (t == 0) mbar_arrive(ring.full(ring.stage));  // kFullArrivals = 128 + 1
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {
    // ---------------- consumers ----------------
    consumer_registers();
    const int consumer = warpgroup - 1;  // rows [64 consumer, 64 consumer + 64) of the tile
    const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    const int row_in_tile = 64 * consumer + 16 * warp + lane / 4;
    StageConsumer<Mma64x256<T, Major::K, Major::MN>> consume(consumer, p.stagger);
    float acc[128];
    for (int tile = blockIdx.x;; tile += gridDim.x) {
      if constexpr (kDynamic) {  // the tile the producer started at this stage
        mbar_wait(ring.full(ring.stage), ring.phase);
        tile = stage_tile[ring.stage];
      }
      if (tile >= tiles) break;
      const Tile tl = decode_row_tile(tile, group_end, row_tile_end, experts, col_tiles);
      consume.row_tile(ring, acc, tl.row0 + 64 * consumer < tl.row_end, k_blocks);
      if (!kGated && p.activation == int(MlpActivation::kIdentity)) {
        store_tile<T, false, MlpActivation::kIdentity>(p, tl, row_in_tile, acc);
      } else {
        with_activation<kGated>(p.activation, [&](auto a) { store_tile<T, kGated, decltype(a)::value>(p, tl, row_in_tile, acc); });
      }
    }
    zero_uncovered_rows(p, group_end[experts - 1], threadIdx.x - 128);
  }
}

// ---- host --------------------------------------------------------------------------------------

template <class T, bool kGated>
cudaError_t launch(const GatherGemmArgs& a, CUtensorMapDataType type, cudaStream_t stream) {
  CUtensorMap map;
  // w [E, H, N] in boxes of 64 columns x 64 k of one expert; the tail of H reads zeros.
  MOE_CUDA_TRY(encode_boxes(&map, type, a.w, 3, a.experts, a.hidden, a.n, kTileK, CU_TENSOR_MAP_L2_PROMOTION_L2_256B));
  Params p;
  p.x = a.x, p.row_token = a.row_token, p.group_sizes = a.group_sizes, p.w = a.w;
  p.out = a.out, p.pre = a.save_pre ? a.pre : nullptr;
  p.tokens = a.tokens, p.hidden = a.hidden, p.experts = a.experts, p.rows = a.rows, p.n = a.n;
  p.ffn = kGated ? a.n / 2 : a.n;
  p.activation = int(a.activation);
  p.stagger = consumer_stagger();
  p.tile_counter = a.tile_counter;
  // The tile count lives on the device: one block per tile at most (row_tiles_bound).
  const int64_t col_tiles = kGated ? p.ffn / 128 : (a.n + kTileCols - 1) / kTileCols;
  const int64_t tiles_bound = row_tiles_bound(a.rows, a.experts) * col_tiles;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(moe::cuda::multiprocessors(), tiles_bound));
  const int schedule = env_choice("MOE_GATHER_GEMM_SCHEDULE", {"dynamic", "static"});
  if (schedule < 0) return cudaErrorInvalidValue;
  const bool dynamic = schedule == 0;
  if (dynamic) MOE_CUDA_TRY(cudaMemsetAsync(a.tile_counter, 0, sizeof(int), stream));
  auto kernel = dynamic ? gather_gemm_kernel<T, kGated, true> : gather_gemm_kernel<T, kGated, false>;
  MOE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<dim3(unsigned(blocks)), dim3(kThreads), kSmemBytes, stream>>>(p, map);
  MOE_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

bool gather_gemm_fits(int64_t tokens, int64_t hidden, int64_t experts, int64_t rows, int64_t n, int64_t activation) {
  if (activation < 0 || activation > int64_t(MlpActivation::kIdentity)) return false;
  const int64_t ffn = gather_gemm_gated(MlpActivation(activation)) ? n / 2 : n;
  if (n <= 0 || ffn % 128 != 0 || (gather_gemm_gated(MlpActivation(activation)) && n != 2 * ffn)) return false;
  if (hidden <= 0 || hidden % 8 != 0 || experts < 1 || experts > kMaxExperts) return false;
  if (rows < 0 || rows >= kRowTileIndexLimit || tokens < 0 || tokens >= (int64_t(1) << 31)) return false;
  // TMA coordinates are int32; the kernel counts tiles in int32 (bounded as in the launcher).
  if (n >= (int64_t(1) << 31) || hidden >= (int64_t(1) << 31)) return false;
  const int64_t col_tiles = gather_gemm_gated(MlpActivation(activation)) ? ffn / 128 : (n + 255) / 256;
  return row_tiles_bound(rows, experts) * col_tiles < kRowTileIndexLimit;
}

cudaError_t gather_gemm(Dtype dtype, const GatherGemmArgs& a, cudaStream_t stream) {
  if (!gather_gemm_fits(a.tokens, a.hidden, a.experts, a.rows, a.n, int64_t(a.activation))) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const bool gated = gather_gemm_gated(a.activation);
  return dispatch_element_gated(dtype, gated, [&](auto element, auto gated_form, CUtensorMapDataType type) {
    return launch<decltype(element), decltype(gated_form)::value>(a, type, stream);
  });
}

}  // namespace moe::gemm
