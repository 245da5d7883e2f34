// Device helpers of the decode kernels (grouped_gemm_decode.cu, moe_mlp_decode.cu): CUDA cores
// streaming routed weight matrices once, 16 bytes a lane, a warp across 256 columns of a row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace moe::gemm::decode {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kVec = 8;            // elements per 16-byte access (bf16, f16)
constexpr int kStrip = 32 * kVec;  // columns per block: a warp's 16-byte loads across one row
constexpr int kBlocksPerSm = 2;    // resident blocks per multiprocessor (registers)

template <class E>
__device__ __forceinline__ float to_float(E x) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) return __bfloat162float(x);
  else return __half2float(x);
}

template <class E>
__device__ __forceinline__ E from_float(float x) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else return __float2half_rn(x);
}

// x rounded to E and back: a value the unfused path would have stored in E.
template <class E>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<E>(x));
}

template <class E>
__device__ __forceinline__ void to_float8(const uint4& v, float (&f)[kVec]) {
  const auto* p = reinterpret_cast<const E*>(&v);
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] = to_float(p[i]);
}

// A streamed weight vector: read once, so kept out of L1 and fetched with L2 prefetch.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

inline int64_t align256(int64_t x) { return (x + 255) / 256 * 256; }

// The layer of a stack of `layers` that `layer` (on the device) selects, as lax.dynamic_slice
// selects it: a negative index counts from the end once, then clamps to [0, layers).
__device__ __forceinline__ int64_t stacked_layer(const int32_t* layer, int64_t layers) {
  int64_t l = *layer;
  if (l < 0) l += layers;
  return l < 0 ? 0 : (l >= layers ? layers - 1 : l);
}

}  // namespace moe::gemm::decode
