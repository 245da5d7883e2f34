// down_backward on sm90a (down_backward.h): g = ct · w_out[g(r)]ᵀ per row in one warp-specialized
// kernel, the activation's backward in its epilogue.
//
// The stage ring of gather_gemm.cu (sm90_stages.cuh): warpgroup 0 produces, one thread loading
// each stage by TMA (A: 128 rows x 64 of ct, rows in order, so the box may run into the next
// group's rows: their products land in rows this tile does not store; B: 256 rows of w_out[g]
// x 64 of H, K-major, read in place), warpgroups 1-2 consume (wgmma m64n256k16, both operands
// K-major, 64 rows each). Block tile 128 x 256 of g, 4 stages, tiles in the row-tile order of
// row_tiles.cuh, block b taking tiles b, b + grid, ...
// Gathered ct (row_token set): row r of ct is row row_token[r] of a [T, H] array (zero where the
// token is outside [0, T)), loaded by cp.async from all 128 producer threads as gather_gemm.cu
// loads x, so that the layer's backward reads the output's cotangent through the routing instead
// of a [M, H] copy of it.
// Epilogue: the products rounded to T in pairs (as the unfused GEMM's output), gate and up (or the
// pre-activation) loaded 16 bytes a lane from L2, where the producer prefetched the tile's rows as
// it started the tile, and transposed within the quad into the accumulator's layout; the
// activation and its derivative in f32, one rounding per output, 16-byte stores after the
// transpose back; the gates' gradient summed over the quad's 256 columns and written once per
// (row, column tile).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda_check.h"
#include "down_backward.h"
#include "gather_gemm.h"  // gather_gemm_gated
#include "row_tiles.cuh"
#include "sm90_stages.cuh"

namespace moe::gemm {
namespace {

using namespace sm90;

constexpr int kTileRows = kRowTileRows;  // A: rows of ct
constexpr int kTileCols = 256;           // B: rows of w_out[g], columns of g
constexpr int kTileK = 64;
constexpr int kMaxExperts = 1024;
constexpr int kTableBytes = 2 * kMaxExperts * 4;
static_assert(kTileRows * kTileK * 2 == kStageABytes && kTileCols * kTileK * 2 == kStageBBytes);

constexpr int kSmemBytes = stage_ring_smem_bytes(kTableBytes);

struct Params {
  const void* ct;                // gathered: [tokens, H], read through row_token
  const int32_t* row_token;      // gathered: [M]
  int64_t tokens;
  const void* gate_up;
  const float* w;  // nullptr: no gates
  const int32_t* group_sizes;
  void* d_gate_up;
  float* d_w;
  void* w_h;
  int64_t rows, hidden, experts, ffn;
  int col_tiles;
  int activation;
  int stagger;  // consumer_stagger()
};


// act(v) and act'(v) in f32, the derivatives jax's own rules give.
template <MlpActivation A>
__device__ __forceinline__ void activate(float v, float& a, float& da) {
  if constexpr (A == MlpActivation::kSwiglu) {  // silu
    const float s = 1.f / (1.f + __expf(-v));
    a = v * s, da = s * (1.f + v * (1.f - s));
  } else if constexpr (A == MlpActivation::kGeglu || A == MlpActivation::kGelu) {  // gelu, erf form
    const float cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
    a = v * cdf, da = cdf + v * 0.39894228040143268f * __expf(-0.5f * v * v);
  } else {  // relu
    a = fmaxf(v, 0.f), da = v > 0.f ? 1.f : 0.f;
  }
}

template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  else return __half22float2(*reinterpret_cast<__half2*>(&v));
}

// Two adjacent columns of a row, each pair packed in T: from gate and up (or the pre-activation;
// up unused) and the product g of the d lhs GEMM, the row's gate wr, the results d gate (or
// d pre), d up and wr * h; dw accumulates g * h for the gates' gradient.
template <class T, bool kGated, MlpActivation A>
__device__ __forceinline__ void backward_pair(uint32_t gate, uint32_t up, uint32_t prod, float wr, float& dw,
                                              uint32_t& d_gate, uint32_t& d_up, uint32_t& w_h) {
  const float2 gv = unpack2<T>(gate), pv = unpack2<T>(prod);
  const float gx[2] = {gv.x, gv.y}, gf[2] = {pv.x, pv.y};
  float ux[2] = {1.f, 1.f};
  if constexpr (kGated) {
    const float2 uv = unpack2<T>(up);
    ux[0] = uv.x, ux[1] = uv.y;
  }
  float dgo[2], duo[2], who[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float a, da;
    activate<A>(gx[e], a, da);
    const float h = a * ux[e], d = wr * gf[e];
    dgo[e] = d * ux[e] * da;  // d gate (or d pre)
    duo[e] = d * a;           // d up
    who[e] = wr * h;
    dw += gf[e] * h;
  }
  d_gate = pack2<T>(dgo[0], dgo[1]);
  d_up = pack2<T>(duo[0], duo[1]);
  w_h = pack2<T>(who[0], who[1]);
}

// Lane q's 16 bytes (8 columns) of a row, from L2 (the producer prefetched the tile's rows there).
__device__ __forceinline__ uint4 load_chunk(const void* src, bool in) {
  if (!in) return make_uint4(0, 0, 0, 0);
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(src)
               : "memory");  // in program order: a row's loads are not hoisted above the other row's work
  return v;
}

// A chunk transposed within the quad: element j is lane q's pair (columns 2q, 2q + 1) of 8-column
// group j of the 32 columns the quad loaded.
__device__ __forceinline__ void to_pairs(const uint4& u, uint32_t (&v)[4]) {
  uint32_t w[4] = {u.x, u.y, u.z, u.w};
  const uint4 t = quad_transpose(w);
  v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
}

// The tile's products rounded to T in pairs, as the unfused composition rounds its GEMM's output:
// 64 registers instead of 128, which leaves room for a row's loads (below).
template <class T>
__device__ __forceinline__ void pack_products(const float (&acc)[128], uint32_t (&g)[64]) {
#pragma unroll
  for (int k = 0; k < 64; ++k) g[k] = pack2<T>(acc[2 * k], acc[2 * k + 1]);
}

// Rows row_in_tile and row_in_tile + 8 of the tile (accumulator layout in sm90_stages.cuh, g[k]
// holding accumulators 2k and 2k + 1). A batch of 32-column blocks' loads is issued before the
// first is used: 8 round trips a tile (gate and up: as many as fit beside the products in 168
// registers) or 2, to L2 (prefetch_epilogue_rows). One round trip per block, from DRAM, measured
// 0.96x of the unfused composition on the layer.
template <class T, bool kGated, MlpActivation A>
__device__ __forceinline__ void epilogue(const Params& p, const RowTile& t, int row_in_tile, const uint32_t (&g)[64]) {
  const int q = threadIdx.x & 3;
  const int64_t width = kGated ? 2 * p.ffn : p.ffn;
  const int f0 = t.col_tile * kTileCols;
  constexpr int kLoadBatch = kGated ? 2 : 8;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = t.row0 + row_in_tile + 8 * half;
    const bool row_in = row < t.row_end;  // the same for the 4 lanes of a row; all of them shuffle
    const T* pre = static_cast<const T*>(p.gate_up) + int64_t(row) * width + f0 + 8 * q;
    const float wr = p.w == nullptr || !row_in ? 1.f : p.w[row];
    T* d_pre = static_cast<T*>(p.d_gate_up) + int64_t(row) * width + f0 + 8 * q;
    T* w_h = static_cast<T*>(p.w_h) + int64_t(row) * p.ffn + f0 + 8 * q;
    float dw = 0.f;
#pragma unroll
    for (int m0 = 0; m0 < 8; m0 += kLoadBatch) {
      uint4 gate_raw[kLoadBatch], up_raw[kLoadBatch] = {};
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {  // F % 64 == 0: whole 32-column blocks are in or out
        const bool in = row_in && f0 + 32 * (m0 + b) < p.ffn;
        gate_raw[b] = load_chunk(pre + 32 * (m0 + b), in);
        if constexpr (kGated) up_raw[b] = load_chunk(pre + p.ffn + 32 * (m0 + b), in);
      }
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        const int m = m0 + b;  // 8-column groups 4 m .. 4 m + 3: columns [f0 + 32 m, f0 + 32 m + 32)
        if (f0 + 32 * m >= p.ffn) break;
        uint32_t gate[4], up[4] = {}, d_gate[4], d_up[4], wh[4];
        to_pairs(gate_raw[b], gate);
        if constexpr (kGated) to_pairs(up_raw[b], up);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          backward_pair<T, kGated, A>(gate[j], up[j], g[2 * (4 * m + j) + half], wr, dw, d_gate[j], d_up[j], wh[j]);
        const uint4 dg = quad_transpose(d_gate), wv = quad_transpose(wh);
        const uint4 du = kGated ? quad_transpose(d_up) : make_uint4(0, 0, 0, 0);
        if (row_in) {
          *reinterpret_cast<uint4*>(d_pre + 32 * m) = dg;
          if constexpr (kGated) *reinterpret_cast<uint4*>(d_pre + p.ffn + 32 * m) = du;
          *reinterpret_cast<uint4*>(w_h + 32 * m) = wv;
        }
      }
    }
    dw += __shfl_xor_sync(0xffffffffu, dw, 1);
    dw += __shfl_xor_sync(0xffffffffu, dw, 2);
    if (row_in && q == 0) p.d_w[int64_t(t.col_tile) * p.rows + row] = dw;
  }
}

// As the producer starts a tile: row i of the tile's gate (and up) columns into L2, a mainloop
// before the epilogue reads them.
template <bool kGated>
__device__ __forceinline__ void prefetch_epilogue_rows(const Params& p, const RowTile& t, int i) {
  const int row = t.row0 + i, f0 = t.col_tile * kTileCols;
  if (row >= t.row_end) return;
  const uint32_t bytes = uint32_t(min(int64_t(kTileCols), p.ffn - f0)) * 2;  // F % 64 == 0: 128-byte multiples
  const char* pre = static_cast<const char*>(p.gate_up) + (int64_t(row) * (kGated ? 2 * p.ffn : p.ffn) + f0) * 2;
  prefetch_l2(pre, bytes);
  if constexpr (kGated) prefetch_l2(pre + p.ffn * 2, bytes);
}

// Rows [covered, M) of every output are zeros; spread over the consumer threads of all blocks.
__device__ void zero_uncovered_rows(const Params& p, int64_t covered, bool gated, int consumer_thread) {
  const int64_t stride = int64_t(gridDim.x) * 256, first = int64_t(blockIdx.x) * 256 + consumer_thread;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int64_t width = gated ? 2 * p.ffn : p.ffn;  // multiples of 64 elements: whole 16-byte chunks
  uint4* d_pre = reinterpret_cast<uint4*>(static_cast<char*>(p.d_gate_up) + covered * width * 2);
  for (int64_t c = first; c < (p.rows - covered) * width / 8; c += stride) d_pre[c] = zero;
  uint4* w_h = reinterpret_cast<uint4*>(static_cast<char*>(p.w_h) + covered * p.ffn * 2);
  for (int64_t c = first; c < (p.rows - covered) * p.ffn / 8; c += stride) w_h[c] = zero;
  for (int64_t c = first; c < (p.rows - covered) * p.col_tiles; c += stride) {
    const int64_t tile = c / (p.rows - covered), row = covered + c % (p.rows - covered);
    p.d_w[tile * p.rows + row] = 0.f;
  }
}

template <class T, bool kGated, bool kGatherCt>
__global__ void __launch_bounds__(kThreads, 1)
    down_backward_kernel(const Params p, const __grid_constant__ CUtensorMap ct_map,
                         const __grid_constant__ CUtensorMap w_map) {
  extern __shared__ uint8_t smem_raw[];
  StageRing ring(smem_raw);
  int32_t* group_end = ring.tables<int32_t>();
  int32_t* row_tile_end = ring.tables<int32_t>(kMaxExperts * 4);
  if (threadIdx.x < 32) scan_row_tiles(p.group_sizes, p.experts, p.rows, group_end, row_tile_end);
  if (threadIdx.x == 32) ring.init_barriers();
  __syncthreads();

  const int experts = int(p.experts);
  // Read again after each warpgroup's setmaxnreg: a value live across it is spilled.
  const auto tile_count = [&] { return row_tile_end[experts - 1] * p.col_tiles; };
  const int k_blocks = int((p.hidden + kTileK - 1) / kTileK);
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ---------------- producer ----------------
    producer_registers();
    const int tiles = tile_count();
    GatheredTileRows ct_rows;  // gathered: ct's rows (row_tiles.cuh)
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const RowTile tl = decode_row_tile(tile, group_end, row_tile_end, experts, p.col_tiles);
      prefetch_epilogue_rows<kGated>(p, tl, threadIdx.x);
      if constexpr (kGatherCt) ct_rows.start(tl, p.row_token, p.tokens);
      for (int kb = 0; kb < k_blocks; ++kb) {
        ring.wait_empty();
        const uint32_t full = ring.full(ring.stage);
        if (threadIdx.x == 0) {
          // Whole boxes always: TMA zero-fills past M, F and H and counts the bytes all the same.
          mbar_arrive_expect_tx(full, kGatherCt ? kStageBBytes : kStageABytes + kStageBBytes);
          if (!kGatherCt) tma_load_2d(ring.a(ring.stage), &ct_map, full, kb * kTileK, tl.row0);
          tma_load_3d(ring.b(ring.stage), &w_map, full, kb * kTileK, tl.col_tile * kTileCols, tl.group);
          if (!kGatherCt) mbar_arrive(full, kFullArrivals - 1);  // the other producer threads' arrivals, in one
        }
        if constexpr (kGatherCt) {  // the expect_tx above and these 128 arrivals: kFullArrivals
          ct_rows.copy(ring.a(ring.stage), static_cast<const T*>(p.ct), p.hidden, kb, p.gate_up);
          cp_async_arrive_noinc(full);
        }
        ring.advance();
      }
    }
    if constexpr (kGatherCt) asm volatile("cp.async.wait_all;" ::: "memory");
  } else {
    // ---------------- consumers ----------------
    consumer_registers();
    const int consumer = warpgroup - 1;  // rows [64 consumer, 64 consumer + 64) of the tile
    const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    const int row_in_tile = 64 * consumer + 16 * warp + lane / 4;
    StageConsumer<Mma64x256<T, Major::K, Major::K>, true> consume(consumer, p.stagger);
    float acc[128];
    const int tiles = tile_count();
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const RowTile tl = decode_row_tile(tile, group_end, row_tile_end, experts, p.col_tiles);
      consume.row_tile(ring, acc, tl.row0 + 64 * consumer < tl.row_end, k_blocks);
      uint32_t g[64];
      pack_products<T>(acc, g);
      with_activation<kGated>(p.activation, [&](auto a) { epilogue<T, kGated, decltype(a)::value>(p, tl, row_in_tile, g); });
    }
    zero_uncovered_rows(p, group_end[experts - 1], kGated, threadIdx.x - 128);
  }
}

template <class T, bool kGated, bool kGatherCt>
cudaError_t launch(const DownBackwardArgs& a, CUtensorMapDataType type, cudaStream_t stream) {
  CUtensorMap ct_map, w_map;
  // ct [M, H] in boxes of 64 columns x 128 rows (not read by TMA where gathered: then a map of one
  // row, never used); w_out [E, F, H] in boxes of 64 x 256 rows (K-major B).
  MOE_CUDA_TRY(encode_boxes(&ct_map, type, kGatherCt ? a.w_out : a.ct, 2, 1, kGatherCt ? 1 : a.rows, a.hidden, kTileRows,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B));
  MOE_CUDA_TRY(encode_boxes(&w_map, type, a.w_out, 3, a.experts, a.ffn, a.hidden, kTileCols,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B));
  Params p;
  p.ct = a.ct, p.row_token = a.row_token, p.tokens = a.tokens;
  p.gate_up = a.gate_up, p.w = a.w, p.group_sizes = a.group_sizes;
  p.d_gate_up = a.d_gate_up, p.d_w = a.d_w, p.w_h = a.w_h;
  p.rows = a.rows, p.hidden = a.hidden, p.experts = a.experts, p.ffn = a.ffn;
  p.col_tiles = int(down_backward_col_tiles(a.ffn));
  p.activation = int(a.activation);
  p.stagger = consumer_stagger();
  // The tile count lives on the device: one block per tile at most (row_tiles_bound).
  const int64_t tiles_bound = row_tiles_bound(a.rows, a.experts) * p.col_tiles;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(moe::cuda::multiprocessors(), tiles_bound));
  auto kernel = down_backward_kernel<T, kGated, kGatherCt>;
  MOE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<dim3(unsigned(blocks)), dim3(kThreads), kSmemBytes, stream>>>(p, ct_map, w_map);
  MOE_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

bool down_backward_fits(int64_t rows, int64_t hidden, int64_t experts, int64_t ffn, int64_t activation) {
  if (activation < 0 || activation > int64_t(MlpActivation::kRelu)) return false;
  if (ffn <= 0 || ffn % 64 != 0 || hidden <= 0 || hidden % 8 != 0 || experts < 1 || experts > kMaxExperts) return false;
  if (rows < 0 || rows >= kRowTileIndexLimit || ffn >= kRowTileIndexLimit || hidden >= kRowTileIndexLimit) return false;
  return row_tiles_bound(rows, experts) * down_backward_col_tiles(ffn) < kRowTileIndexLimit;
}

cudaError_t down_backward(Dtype dtype, const DownBackwardArgs& a, cudaStream_t stream) {
  if (!down_backward_fits(a.rows, a.hidden, a.experts, a.ffn, int64_t(a.activation))) return cudaErrorInvalidValue;
  if (a.row_token != nullptr && (a.tokens < 0 || a.tokens >= (int64_t(1) << 31))) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const bool gated = gather_gemm_gated(a.activation);
  return dispatch_element_gated(dtype, gated, [&](auto element, auto gated_form, CUtensorMapDataType type) {
    using T = decltype(element);
    constexpr bool kGated = decltype(gated_form)::value;
    return a.row_token != nullptr ? launch<T, kGated, true>(a, type, stream) : launch<T, kGated, false>(a, type, stream);
  });
}

}  // namespace moe::gemm
