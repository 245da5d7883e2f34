// weight_grad (unpermute's cotangent in the weights): dw[b,t,k] = <ct[b,t], x[b, row_map[b,t,k]]>
// in float32, 0 for invalid rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "cuda_kernels.h"
#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cuda {
namespace {

// A group of kGroup threads per entry: a warp for short rows when there are entries enough to
// fill the GPU (no block barrier; the K warps of a token read its cotangent row through L1),
// else the whole block. A warp's threads read two vector pairs before they multiply (a block's,
// one: fewer registers, more resident blocks); the group's sum is group_sum's fixed order.
template <typename C, typename X, int V, int kGroup>
__global__ void __launch_bounds__(kThreads) weight_grad_kernel(WeightGradArgs a) {
  constexpr int kGroups = kThreads / kGroup, kWgUnroll = kGroup == 32 ? 2 : 1;
  __shared__ float warp_sums[kThreads / 32];
  const int64_t H = a.hidden_size, K = a.topk, entries = a.batch * a.tokens * K, per_example = a.tokens * K;
  const int lane = threadIdx.x % kGroup;
  for (int64_t g0 = blockIdx.x * int64_t{kGroups}; g0 < entries; g0 += int64_t(gridDim.x) * kGroups) {
    const int64_t g = g0 + threadIdx.x / kGroup;  // g = b * T * K + t * K + k
    float partial = 0.0f;
    const int64_t b = g / per_example, j = g - b * per_example;
    const int64_t r = g < entries ? a.row_map[b * a.rm_bstride + j] : -1;
    if (r >= 0 && r < a.rows) {
      const C* ct = static_cast<const C*>(a.ct) + b * a.ct_bstride + (j / K) * H;
      const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + r * H;
      for (int64_t h0 = lane * int64_t(V); h0 < H; h0 += int64_t{kGroup} * V * kWgUnroll) {
        Vec<C, V> c[kWgUnroll];
        Vec<X, V> f[kWgUnroll];
#pragma unroll
        for (int u = 0; u < kWgUnroll; ++u) {
          const int64_t h = h0 + int64_t{u} * kGroup * V;
          if (h < H) {
            c[u] = *reinterpret_cast<const Vec<C, V>*>(ct + h);
            f[u] = *reinterpret_cast<const Vec<X, V>*>(x + h);
          }
        }
#pragma unroll
        for (int u = 0; u < kWgUnroll; ++u) {
          if (h0 + int64_t{u} * kGroup * V >= H) break;
#pragma unroll
          for (int i = 0; i < V; ++i) partial += to_f32(c[u].v[i]) * to_f32(f[u].v[i]);
        }
      }
    }
    partial = group_sum<kGroup>(partial, warp_sums);
    if (lane == 0 && g < entries) store_weight(a.out, a.out_dtype, g, partial);
  }
}

}  // namespace

cudaError_t weight_grad(const WeightGradArgs& a, cudaStream_t stream) {
  const int64_t entries = a.batch * a.tokens * a.topk;
  if (entries == 0) return cudaSuccess;
  // A warp per entry for short rows (<= 8 vectors per lane) once that gives every
  // multiprocessor two blocks of work; else a block per entry (faster for longer rows).
  const int64_t elem = std::max(dtype_bytes(a.ct_dtype), dtype_bytes(a.x_dtype));
  const bool warps = entries >= int64_t{2} * (kThreads / 32) * multiprocessors() &&
                     a.hidden_size * elem <= 8 * 32 * kGatherVecBytes;
  cudaError_t result = cudaSuccess;
  visit_input<CudaTypes>(a.ct_dtype, [&](auto ctag) {
    using C = typename decltype(ctag)::type;
    visit_input<CudaTypes>(a.x_dtype, [&](auto xtag) {
      using X = typename decltype(xtag)::type;
      constexpr int kVec = 16 / (sizeof(C) > sizeof(X) ? sizeof(C) : sizeof(X));
      const bool vec = a.hidden_size % kVec == 0 && aligned16(a.ct) && aligned16(a.x);
      auto kernel = vec ? (warps ? weight_grad_kernel<C, X, kVec, 32> : weight_grad_kernel<C, X, kVec, kThreads>)
                        : (warps ? weight_grad_kernel<C, X, 1, 32> : weight_grad_kernel<C, X, 1, kThreads>);
      const int64_t per_block = warps ? kThreads / 32 : 1;
      kernel<<<blocks_for(entries, per_block), kThreads, 0, stream>>>(a);
      result = cudaGetLastError();
    });
  });
  return result;
}

}  // namespace moe::cuda
