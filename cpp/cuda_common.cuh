// Device helpers shared by the CUDA kernel units: launch shapes, element conversions, vector
// accesses, weight reads and writes, and block / warp sums.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cuda {

// ---- launch shapes -------------------------------------------------------------------------
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover anything larger

inline int blocks_for(int64_t items, int per_block = kThreads) {
  return static_cast<int>(std::max<int64_t>(1, std::min(kMaxBlocks, (items + per_block - 1) / per_block)));
}

// Workspace pieces start on 256-byte boundaries.
inline int64_t pad256(int64_t b) { return (b + 255) / 256 * 256; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Row gathers (unpermute, scatter): blocks of kGatherThreads threads over (row, chunk of H),
// each thread moving up to kGatherVecBytes per access.
constexpr int kGatherThreads = 128, kGatherVecBytes = 16;

inline dim3 gather_grid(int64_t items, int64_t hidden, int vec) {
  const int64_t per_block = int64_t{kGatherThreads} * vec;
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(kMaxBlocks, items))),
              static_cast<unsigned>((hidden + per_block - 1) / per_block));
}

// ---- element types and conversions -----------------------------------------------------------
struct CudaTypes {
  using f32 = float;
  using bf16 = __nv_bfloat16;
  using f16 = __half;
  using f8e4m3fn = __nv_fp8_e4m3;
  using f8e5m2 = __nv_fp8_e5m2;
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_f32(__nv_fp8_e5m2 x) { return static_cast<float>(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// V consecutive elements moved as one aligned access (V = 16 bytes / element, or 1).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec { T v[V]; };

template <typename T, int V>
__device__ __forceinline__ void load_f32(const T* p, float (&f)[V]) {
  const Vec<T, V> x = *reinterpret_cast<const Vec<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) f[i] = to_f32(x.v[i]);
}
template <typename T, int V>
__device__ __forceinline__ void store_f32(T* p, const float (&f)[V]) {
  Vec<T, V> x;
#pragma unroll
  for (int i = 0; i < V; ++i) x.v[i] = from_f32<T>(f[i]);
  *reinterpret_cast<Vec<T, V>*>(p) = x;
}

// Weight i of dtype d (float32, bfloat16 or float16); null weights read as 1.
__device__ __forceinline__ float weight_at(const void* w, Dtype d, int64_t i) {
  if (w == nullptr) return 1.0f;
  switch (d) {
    case Dtype::kBF16: return to_f32(static_cast<const __nv_bfloat16*>(w)[i]);
    case Dtype::kF16: return to_f32(static_cast<const __half*>(w)[i]);
    default: return static_cast<const float*>(w)[i];
  }
}

// Writes a weight (or weight cotangent) of dtype d: float32, bfloat16 or float16.
__device__ __forceinline__ void store_weight(void* out, Dtype d, int64_t i, float value) {
  float v[1] = {value};
  switch (d) {
    case Dtype::kBF16: return store_f32<__nv_bfloat16, 1>(static_cast<__nv_bfloat16*>(out) + i, v);
    case Dtype::kF16: return store_f32<__half, 1>(static_cast<__half*>(out) + i, v);
    default: return store_f32<float, 1>(static_cast<float*>(out) + i, v);
  }
}

// ---- block and warp sums -------------------------------------------------------------------
// Exclusive prefix sum of v over the block's threads in linear order (blockDim of any shape, at
// most 1024 threads); *total gets the block's sum. A warp-shuffle scan and one warp scanning the
// warp sums: two barriers, where a 1024-thread cub::BlockScan walks the 32 warp sums serially.
// `sums` is shared scratch of 33 values. Ends with a barrier, so `sums` can be reused at once.
template <typename T>
__device__ T block_exclusive_sum(T v, T* sums, T* total) {
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int id = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int lane = id % 32, warp = id / 32, warps = (threads + 31) / 32;
  const int in_warp = min(32, threads - warp * 32);  // the last warp may be partial
  const uint32_t mask = in_warp == 32 ? 0xffffffffu : (1u << in_warp) - 1;
  T x = v;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const T y = __shfl_up_sync(mask, x, d);
    if (lane >= d) x += y;
  }
  if (lane == in_warp - 1) sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const T own = lane < warps ? sums[lane] : T{};
    const uint32_t mask0 = threads >= 32 ? 0xffffffffu : mask;
    T y = own;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const T z = __shfl_up_sync(mask0, y, d);
      if (lane >= d) y += z;
    }
    if (lane < warps) sums[lane] = y - own;
    if (lane == warps - 1) sums[32] = y;
  }
  __syncthreads();
  const T result = sums[warp] + x - v;
  *total = sums[32];
  __syncthreads();
  return result;
}

// The sum of v over a warp (kGroup 32) or the block (kGroup kThreads) in a fixed order: a
// shuffle tree per warp, then the warps' sums in ascending order. Valid in the group's first
// thread. Block groups: every thread calls it; warp_sums holds kThreads / 32 floats of shared
// memory and can be reused as soon as it returns.
template <int kGroup>
__device__ __forceinline__ float group_sum(float v, float* warp_sums) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if constexpr (kGroup > 32) {
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 1; w < kGroup / 32; ++w) v += warp_sums[w];
    __syncthreads();
  }
  return v;
}

}  // namespace moe::cuda
