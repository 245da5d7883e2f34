// unpermute: out[b,t] = sum_k w[b,t,k] * x[b, row_map[b,t,k]], accumulated in float32 in
// ascending k, plus an optional residual[b,t] (UnpermuteArgs). Grids that fill the GPU take
// unpermute_kernel (grid-stride over tokens, rows loaded in batches of kBatch); small,
// latency-bound grids take unpermute_few_kernel.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "cuda_kernels.h"
#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cuda {
namespace {

// acc += w * raw, widened to float32.
template <typename X, int V>
__device__ __forceinline__ void add_weighted(const Vec<X, V>& raw, float w, float (&acc)[V]) {
  if constexpr (std::is_same_v<X, __nv_bfloat16> && V % 2 == 0) {
    // bf16 is the high half of a float32: widen two per 32-bit word with integer ops.
    const uint32_t* words = reinterpret_cast<const uint32_t*>(raw.v);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      acc[2 * i] += w * __uint_as_float(words[i] << 16);
      acc[2 * i + 1] += w * __uint_as_float(words[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] += w * to_f32(raw.v[i]);
  }
}

// out = residual + the sum (rounded to O first, as an add after the op would see it), where the
// call has a residual; `at` is the output element's offset within its batch element.
template <typename O, int V>
__device__ __forceinline__ void add_residual(const UnpermuteArgs& a, int64_t b, int64_t at, float (&acc)[V]) {
  if (a.residual == nullptr) return;
  const Vec<O, V> r = *reinterpret_cast<const Vec<O, V>*>(static_cast<const O*>(a.residual) + b * a.res_bstride + at);
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = to_f32(from_f32<O>(acc[i])) + to_f32(r.v[i]);
}

// ---- grids that fill the GPU ---------------------------------------------------------------------
// Blocks over (token, chunk of H): each thread owns V consecutive features (one 16-byte access
// where rows are aligned). It reads kBatch row indices, issues kBatch raw row loads, and only
// then converts and accumulates in float32, in ascending k. Raw staging keeps the register count
// low enough for many resident blocks per multiprocessor (benchmarks/micro/variants.cu compares
// the variants): kBatch = 2 when K <= 2, 4 for larger K, 8 when the grid is too small to fill
// the GPU (latency-bound).

// Resident blocks per multiprocessor to ask of the compiler for 16-bit inputs (register caps of
// 32 and 48, no spills); other inputs and kBatch 8 (small grids, latency-bound) are left alone.
constexpr int gather_min_blocks(size_t elem_bytes, int batch) {
  return elem_bytes != 2 ? 1 : batch == 2 ? 16 : batch == 4 ? 10 : 1;
}

template <typename X, typename O, int V, int kBatch>
__global__ void __launch_bounds__(kGatherThreads, gather_min_blocks(sizeof(X), kBatch)) unpermute_kernel(UnpermuteArgs a) {
  const int64_t H = a.hidden_size, K = a.topk;
  const int64_t h = (blockIdx.y * int64_t(kGatherThreads) + threadIdx.x) * V;
  if (h >= H) return;
  for (int64_t g = blockIdx.x; g < a.batch * a.tokens; g += gridDim.x) {
    const int64_t b = g / a.tokens;
    const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + h;
    const int32_t* rm = a.row_map + b * a.rm_bstride + (g - b * a.tokens) * K;
    const int64_t w0 = b * a.w_bstride + (g - b * a.tokens) * K;
    float acc[V] = {};
    for (int64_t k0 = 0; k0 < K; k0 += kBatch) {
      // Weights are read with the row indices (one round trip for both) except at kBatch 4,
      // whose register cap has no room for them; there they follow the row loads.
      constexpr bool kWeightsFirst = kBatch != 4;
      int32_t r[kBatch];
      float w[kBatch];
      Vec<X, V> raw[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        r[j] = k0 + j < K ? rm[k0 + j] : -1;
        if (kWeightsFirst) w[j] = k0 + j < K ? weight_at(a.weights, a.w_dtype, w0 + k0 + j) : 0.0f;
        if (r[j] >= a.rows) r[j] = -1;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (r[j] >= 0) raw[j] = *reinterpret_cast<const Vec<X, V>*>(x + r[j] * H);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (r[j] < 0) continue;  // skipped, not added as 0: keeps -0.0 and NaN rules
        add_weighted(raw[j], kWeightsFirst ? w[j] : weight_at(a.weights, a.w_dtype, w0 + k0 + j), acc);
      }
    }
    add_residual<O, V>(a, b, (g - b * a.tokens) * H + h, acc);
    store_f32<O, V>(static_cast<O*>(a.out) + g * H + h, acc);
  }
}

// ---- small grids -----------------------------------------------------------------------------
// Small grids (decode: a token or a few per multiprocessor) are latency-bound: one warp per
// scheduler, so every instruction between launch and the last store is on the critical path.
// One block per (chunk, token, example): no grid-stride loop and no 64-bit division; all K <=
// kFewMaxK row indices and weights read at once.
constexpr int kFewMaxK = 8;

// Reads weights in two steps: raw bits by predicated loads of the width their dtype has (no
// branch on the dtype, whose merge would hold back the row loads issued after it), then their
// values once the rows are in flight. Null weights read as 1.
struct WeightReader {
  const char* w;
  bool wide, half;
  __device__ explicit WeightReader(const UnpermuteArgs& a)
      : w(static_cast<const char*>(a.weights)), wide(a.w_dtype == Dtype::kF32), half(a.w_dtype == Dtype::kF16) {}
  __device__ uint32_t bits(int64_t i) const {
    if (w == nullptr) return 0;
    return wide ? *reinterpret_cast<const uint32_t*>(w + i * 4) : uint32_t{*reinterpret_cast<const uint16_t*>(w + i * 2)};
  }
  __device__ float value(uint32_t b) const {
    if (w == nullptr) return 1.0f;
    if (wide) return __uint_as_float(b);
    return half ? __half2float(__ushort_as_half(static_cast<unsigned short>(b))) : __uint_as_float(b << 16);
  }
};

template <typename X, typename O, int V>
__global__ void __launch_bounds__(kGatherThreads) unpermute_few_kernel(UnpermuteArgs a) {
  const int32_t H = static_cast<int32_t>(a.hidden_size), K = static_cast<int32_t>(a.topk);
  const int32_t h = (blockIdx.x * kGatherThreads + threadIdx.x) * V;
  if (h >= H) return;
  const int64_t b = blockIdx.z, g = b * a.tokens + blockIdx.y;
  const int32_t* rm = a.row_map + b * a.rm_bstride + int64_t{blockIdx.y} * K;
  const int64_t w0 = b * a.w_bstride + int64_t{blockIdx.y} * K;
  const WeightReader weights(a);
  int32_t r[kFewMaxK];
  uint32_t w_bits[kFewMaxK];
#pragma unroll
  for (int j = 0; j < kFewMaxK; ++j) {
    r[j] = j < K ? rm[j] : -1;
    w_bits[j] = j < K ? weights.bits(w0 + j) : 0;
    if (r[j] >= a.rows) r[j] = -1;
  }
  const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + h;
  Vec<X, V> raw[kFewMaxK];
#pragma unroll
  for (int j = 0; j < kFewMaxK; ++j)
    if (r[j] >= 0) raw[j] = *reinterpret_cast<const Vec<X, V>*>(x + int64_t{r[j]} * H);
  float w[kFewMaxK];
#pragma unroll
  for (int j = 0; j < kFewMaxK; ++j) w[j] = weights.value(w_bits[j]);
  float acc[V] = {};
#pragma unroll
  for (int j = 0; j < kFewMaxK; ++j)
    if (r[j] >= 0) add_weighted(raw[j], w[j], acc);  // skipped, not added as 0: keeps -0.0 and NaN rules
  add_residual<O, V>(a, b, int64_t{blockIdx.y} * H + h, acc);
  store_f32<O, V>(static_cast<O*>(a.out) + g * H + h, acc);
}

// How many times (1, 2, 4 or 8) to narrow the lean kernel's access of `vec` elements of
// `elem_bytes`, for `items` output rows of `row_bytes`. On grids this small the time follows the
// bytes each block loads and the blocks each multiprocessor runs: halve the access while each
// thread still loads more than 16 bytes over its K rows, the access stays >= 2 bytes and the grid
// stays within half the multiprocessors.
int few_access_split(int64_t items, int64_t row_bytes, int64_t topk, int64_t elem_bytes, int vec) {
  int split = 1;
  while (split < 8 && vec % (2 * split) == 0) {
    const int64_t narrow = elem_bytes * vec / (2 * split), per_block = int64_t{kGatherThreads} * narrow;
    const int64_t blocks = items * ((row_bytes + per_block - 1) / per_block);
    if (narrow < 2 || topk * 2 * narrow <= 16 || 2 * blocks > multiprocessors()) break;
    split *= 2;
  }
  return split;
}

template <typename X, typename O, int V>
cudaError_t launch_unpermute(const UnpermuteArgs& a, cudaStream_t stream) {
  const dim3 grid = gather_grid(a.batch * a.tokens, a.hidden_size, V);
  const bool fills_gpu = int64_t{grid.x} * grid.y >= 4 * multiprocessors();
  if (!fills_gpu && a.topk <= kFewMaxK && a.tokens <= 65535 && a.batch <= 65535 &&
      a.hidden_size < (int64_t{1} << 30)) {
    auto launch = [&](auto width) {
      constexpr int W = decltype(width)::value;  // divides V, so H and the row bases stay aligned to it
      const int64_t per_block = int64_t{kGatherThreads} * W;
      unpermute_few_kernel<X, O, W><<<dim3(static_cast<unsigned>((a.hidden_size + per_block - 1) / per_block),
                                           static_cast<unsigned>(a.tokens), static_cast<unsigned>(a.batch)),
                                      kGatherThreads, 0, stream>>>(a);
      return cudaGetLastError();
    };
    const int split = few_access_split(a.batch * a.tokens, a.hidden_size * int64_t{sizeof(X)}, a.topk, sizeof(X), V);
    if constexpr (V % 8 == 0) if (split == 8) return launch(std::integral_constant<int, V / 8>{});
    if constexpr (V % 4 == 0) if (split == 4) return launch(std::integral_constant<int, V / 4>{});
    if constexpr (V % 2 == 0) if (split == 2) return launch(std::integral_constant<int, V / 2>{});
    return launch(std::integral_constant<int, V>{});
  }
  if (a.topk <= 2) unpermute_kernel<X, O, V, 2><<<grid, kGatherThreads, 0, stream>>>(a);
  else if (fills_gpu) unpermute_kernel<X, O, V, 4><<<grid, kGatherThreads, 0, stream>>>(a);
  else unpermute_kernel<X, O, V, 8><<<grid, kGatherThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t unpermute(const UnpermuteArgs& a, cudaStream_t stream) {
  if (a.batch * a.tokens == 0 || a.hidden_size == 0) return cudaSuccess;
  cudaError_t result = cudaSuccess;
  visit_input<CudaTypes>(a.x_dtype, [&](auto xtag) {
    using X = typename decltype(xtag)::type;
    visit_output<CudaTypes>(a.out_dtype, [&](auto otag) {
      using O = typename decltype(otag)::type;
      constexpr int kVec = kGatherVecBytes / sizeof(X);
      const auto aligned_out = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % (sizeof(O) * kVec) == 0; };
      const bool vec = a.hidden_size % kVec == 0 && aligned16(a.x) && aligned_out(a.out) &&
                       (a.residual == nullptr || aligned_out(a.residual));
      result = vec ? launch_unpermute<X, O, kVec>(a, stream) : launch_unpermute<X, O, 1>(a, stream);
    });
  });
  return result;
}

}  // namespace moe::cuda
