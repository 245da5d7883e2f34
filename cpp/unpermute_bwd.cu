// unpermute's backward, fused: both cotangents from one read of each cotangent row,
// out_x[b,r] = sum of w * ct over the entries that map to r (a scatter) and
// out_w[b,t,k] = <ct[b,t], x[b, row_map[b,t,k]]>. (float8 inputs take scatter.cu and
// weight_grad.cu instead; the lowering chooses.)
// Large batches, three steps:
// 1. owner[b, r] = -1 (a memset). 2. `parts` warps per token (one on large grids, up to a
//    block's 8 on small ones) read its cotangent row once for both cotangents: the dot products
//    with its K expert rows (the weights' cotangent) and w * ct into each entry's row. No
//    barrier when a warp holds the whole token. Each entry also claims its row: owner = the
//    entry, or -2 once a second entry claims it (atomics only tell "one entry" from "several",
//    so results stay deterministic). 3. A warp per 32 rows zeroes the rows nothing maps to and
//    sums the rows of several entries in ascending entry order, one pass over the row map per
//    such row (permute never makes them; a user's row map may), overwriting what step 2 wrote.
// Small batches take one launch instead (unpermute_bwd_small_kernel).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "cuda_kernels.h"
#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cuda {
namespace {

constexpr int kBwdMaxParts = kThreads / 32;

// Step 2. A lane holds kUnroll vectors of the cotangent row and kGroup entries' vectors of their
// rows in flight, with registers for kMinBlocks resident blocks: (8, 1, 2) for K > 2; (2, 1, 4)
// for K <= 2, where (2, 2, 2) leaves too few warps per multiprocessor and is latency-bound. The
// h loop is warp-uniform (lanes past H idle in it) because it shuffles. partial: [kThreads / 32][K]
// floats of dynamic shared memory when parts > 1, to add the dot products of a token's warps in
// a fixed order.
template <typename C, typename X, int V, int kGroup, int kUnroll, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    token_cotangents_kernel(UnpermuteBwdArgs a, int32_t* owner, int parts) {
  extern __shared__ float partial[];
  constexpr int64_t kStep = 32 * V;  // values a warp covers with one vector per lane
  const int64_t H = a.hidden_size, K = a.topk, R = a.rows, n = a.batch * a.tokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per_round = kBwdMaxParts / parts, slot = warp / parts, part = warp % parts;
  for (int64_t g0 = blockIdx.x * int64_t{per_round}; g0 < n; g0 += int64_t(gridDim.x) * per_round) {
    const int64_t g = g0 + slot;  // this warp's token; the block's round ends with a barrier
    if (g < n) {
      const int64_t b = g / a.tokens, t = g - b * a.tokens;
      const C* ct = static_cast<const C*>(a.ct) + b * a.ct_bstride + t * H;
      const X* x = static_cast<const X*>(a.x) + b * a.x_bstride;
      X* dx = static_cast<X*>(a.out_x) + b * R * H;
      for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
        const int64_t j = t * K + k0 + lane;  // lane e < kGroup reads entry k0 + e
        int32_t my_row = -1;
        float my_weight = 0.0f;
        if (lane < kGroup && k0 + lane < K) {
          my_row = a.row_map[b * a.rm_bstride + j];
          if (my_row >= R) my_row = -1;
          my_weight = weight_at(a.weights, a.w_dtype, b * a.w_bstride + j);
        }
        if (my_row >= 0 && part == 0 && atomicCAS(owner + b * R + my_row, -1, static_cast<int32_t>(j)) != -1)
          atomicExch(owner + b * R + my_row, -2);
        int32_t r[kGroup];
        float dot[kGroup];
#pragma unroll
        for (int e = 0; e < kGroup; ++e) {
          r[e] = __shfl_sync(0xffffffffu, my_row, e);
          dot[e] = 0.0f;
        }
        for (int64_t base = part * kStep * kUnroll; base < H; base += parts * kStep * kUnroll) {
          Vec<C, V> c[kUnroll];
          Vec<X, V> raw[kUnroll][kGroup];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t h = base + u * kStep + lane * V;
            if (h >= H) continue;
            c[u] = *reinterpret_cast<const Vec<C, V>*>(ct + h);
#pragma unroll
            for (int e = 0; e < kGroup; ++e)
              if (r[e] >= 0) raw[u][e] = *reinterpret_cast<const Vec<X, V>*>(x + r[e] * H + h);
          }
#pragma unroll
          for (int e = 0; e < kGroup; ++e) {
            const float w = __shfl_sync(0xffffffffu, my_weight, e);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int64_t h = base + u * kStep + lane * V;
              if (h >= H || r[e] < 0) continue;
              float scaled[V];
#pragma unroll
              for (int i = 0; i < V; ++i) {
                const float cf = to_f32(c[u].v[i]);
                dot[e] += cf * to_f32(raw[u][e].v[i]);
                scaled[i] = w * cf;
              }
              store_f32<X, V>(dx + r[e] * H + h, scaled);
            }
          }
        }
#pragma unroll
        for (int e = 0; e < kGroup; ++e)
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) dot[e] += __shfl_xor_sync(0xffffffffu, dot[e], offset);
        // Every lane holds the sums now; lane e keeps entry k0 + e's (a row out of range adds 0).
        float mine = 0.0f;
#pragma unroll
        for (int e = 0; e < kGroup; ++e)
          if (lane == e) mine = dot[e];
        if (lane < kGroup && k0 + lane < K) {
          if (parts == 1) store_weight(a.out_w, a.out_w_dtype, g * K + k0 + lane, mine);
          else partial[warp * K + k0 + lane] = mine;
        }
      }
    }
    if (parts > 1) {
      __syncthreads();
      for (int i = threadIdx.x; i < per_round * K; i += kThreads) {
        const int s = i / K, k = i - s * K;
        if (g0 + s >= n) continue;
        float total = 0.0f;
        for (int p = 0; p < parts; ++p) total += partial[(s * parts + p) * K + k];
        store_weight(a.out_w, a.out_w_dtype, (g0 + s) * K + k, total);
      }
      __syncthreads();  // partial serves the next round
    }
  }
}

// Step 3, by a warp: of rows r0 .. r0 + 31 of example b, zeroes those nothing maps to and sums
// those of several entries in ascending entry order (owner_b: that example's owners, global or
// shared).
template <typename C, typename X, int V>
__device__ void shared_and_empty_rows(const UnpermuteBwdArgs& a, int64_t b, int64_t r0, const int32_t* owner_b) {
  const int64_t H = a.hidden_size, K = a.topk, n = a.tokens * K, R = a.rows, r = r0 + threadIdx.x % 32;
  const int lane = threadIdx.x % 32;
  const int32_t o = r < R ? owner_b[r] : 0;
  uint32_t todo = __ballot_sync(0xffffffffu, r < R && o < 0);
  while (todo) {
    const int src = __ffs(todo) - 1;
    todo &= todo - 1;
    const int64_t row = r0 + src;
    const bool several = __shfl_sync(0xffffffffu, o, src) == -2;
    X* out = static_cast<X*>(a.out_x) + (b * R + row) * H;
    for (int64_t base = 0; base < H; base += 32 * int64_t{V}) {
      const int64_t h = base + lane * int64_t{V};
      float acc[V] = {};
      for (int64_t j0 = 0; several && j0 < n; j0 += 32) {
        const int64_t j = j0 + lane;
        uint32_t hits = __ballot_sync(0xffffffffu, j < n && a.row_map[b * a.rm_bstride + j] == row);
        while (hits) {
          const int64_t e = j0 + __ffs(hits) - 1;  // ascending entry order
          hits &= hits - 1;
          const float w = weight_at(a.weights, a.w_dtype, b * a.w_bstride + e);
          if (h < H) {
            float c[V];
            load_f32<C, V>(static_cast<const C*>(a.ct) + b * a.ct_bstride + (e / K) * H + h, c);
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += w * c[i];
          }
        }
      }
      if (h < H) store_f32<X, V>(out + h, acc);
    }
  }
}

template <typename C, typename X, int V>
__global__ void shared_and_empty_rows_kernel(UnpermuteBwdArgs a, const int32_t* owner) {
  const int64_t per_example = (a.rows + 31) / 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t q = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; q < a.batch * per_example; q += warps) {
    const int64_t b = q / per_example;
    shared_and_empty_rows<C, X, V>(a, b, (q - b * per_example) * 32, owner + b * a.rows);
  }
}

// Small batches in one launch (no memset, no second pass): each block claims its example's
// rows in shared memory itself (the same owners the token pass gives), then takes whole
// entries, a block per entry (its dot product, the 8 warps' sums added in order, and w * ct
// into the row it owns alone), and groups of 32 rows for shared_and_empty_rows. Faster than the
// token pass up to kBwdSmallMaxEntries entries; beyond, every block repeating the claim of all
// entries costs more than it saves.
constexpr int64_t kBwdSmallMaxEntries = 1024, kBwdSmallMaxRows = 8192;  // 32 KiB of owners
constexpr int kBwdSmallUnroll = 2, kBwdSmallBlocksPerSM = 4;  // 64 registers, no spills

template <typename C, typename X, int V>
__global__ void __launch_bounds__(kThreads, kBwdSmallBlocksPerSM) unpermute_bwd_small_kernel(UnpermuteBwdArgs a) {
  extern __shared__ int32_t owner[];  // [rows]
  __shared__ float warp_dots[kThreads / 32];
  const int64_t H = a.hidden_size, K = a.topk, R = a.rows, b = blockIdx.y;
  const int n = static_cast<int>(a.tokens * K);
  const int32_t* rm = a.row_map + b * a.rm_bstride;
  for (int r = threadIdx.x; r < R; r += kThreads) owner[r] = -1;
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const int32_t r = rm[j];
    if (r >= 0 && r < R && atomicCAS(&owner[r], -1, j) != -1) atomicExch(&owner[r], -2);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  for (int j = blockIdx.x; j < n; j += gridDim.x) {
    const int64_t r = rm[j] < R ? rm[j] : -1;
    const float w = weight_at(a.weights, a.w_dtype, b * a.w_bstride + j);
    const bool owned = r >= 0 && owner[r] == j;
    const C* ct = static_cast<const C*>(a.ct) + b * a.ct_bstride + (j / K) * H;
    const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + r * H;
    X* dx = static_cast<X*>(a.out_x) + (b * R + r) * H;
    float dot = 0.0f;
    for (int64_t base = threadIdx.x * int64_t{V}; r >= 0 && base < H; base += kThreads * V * kBwdSmallUnroll) {
      Vec<C, V> c[kBwdSmallUnroll];
      Vec<X, V> raw[kBwdSmallUnroll];
#pragma unroll
      for (int u = 0; u < kBwdSmallUnroll; ++u) {
        const int64_t h = base + u * kThreads * V;
        if (h >= H) continue;
        c[u] = *reinterpret_cast<const Vec<C, V>*>(ct + h);
        raw[u] = *reinterpret_cast<const Vec<X, V>*>(x + h);
      }
#pragma unroll
      for (int u = 0; u < kBwdSmallUnroll; ++u) {
        const int64_t h = base + u * kThreads * V;
        if (h >= H) continue;
        float scaled[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float cf = to_f32(c[u].v[i]);
          dot += cf * to_f32(raw[u].v[i]);
          scaled[i] = w * cf;
        }
        if (owned) store_f32<X, V>(dx + h, scaled);
      }
    }
    dot = group_sum<kThreads>(dot, warp_dots);
    if (threadIdx.x == 0) store_weight(a.out_w, a.out_w_dtype, b * n + j, dot);
  }
  for (int64_t q = blockIdx.x * int64_t{kThreads / 32} + warp; q * 32 < R; q += int64_t(gridDim.x) * (kThreads / 32))
    shared_and_empty_rows<C, X, V>(a, b, q * 32, owner);
}

bool use_small_bwd(const UnpermuteBwdArgs& a) {
  return a.tokens * a.topk <= kBwdSmallMaxEntries && a.rows <= kBwdSmallMaxRows && a.batch <= 65535;
}

template <typename C, typename X, int V>
cudaError_t launch_unpermute_bwd_small(const UnpermuteBwdArgs& a, cudaStream_t stream) {
  // A block per entry, enough for the row groups too, but no more than are resident at once
  // (4 per multiprocessor): every block repeats the claim.
  const int64_t blocks = std::max(a.tokens * a.topk, (a.rows + kThreads - 1) / kThreads);
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, kBwdSmallBlocksPerSM * multiprocessors())),
                  static_cast<unsigned>(a.batch));
  unpermute_bwd_small_kernel<C, X, V><<<grid, kThreads, sizeof(int32_t) * a.rows, stream>>>(a);
  return cudaGetLastError();
}

template <typename C, typename X, int V, int kGroup, int kUnroll, int kMinBlocks>
cudaError_t launch_token_cotangents(const UnpermuteBwdArgs& a, int32_t* owner, cudaStream_t stream) {
  // One warp per token once the tokens alone give every multiprocessor ~24 warps; else more
  // warps per token, as many as the row has warp-wide chunks, up to a block.
  const int64_t n = a.batch * a.tokens, chunks = (a.hidden_size + 32 * V * kUnroll - 1) / (32 * V * kUnroll);
  const size_t partial_bytes = sizeof(float) * kBwdMaxParts * a.topk;
  int parts = 1;
  while (parts < kBwdMaxParts && 2 * parts <= chunks && n * parts < 24 * multiprocessors() &&
         partial_bytes <= 48 * 1024)
    parts *= 2;
  token_cotangents_kernel<C, X, V, kGroup, kUnroll, kMinBlocks>
      <<<blocks_for(n, kBwdMaxParts / parts), kThreads, parts > 1 ? partial_bytes : 0, stream>>>(a, owner, parts);
  return cudaGetLastError();
}

template <typename C, typename X, int V>
cudaError_t launch_unpermute_bwd(const UnpermuteBwdArgs& a, int32_t* owner, cudaStream_t stream) {
  if (a.batch * a.tokens > 0) {
    const cudaError_t err = a.topk <= 2 ? launch_token_cotangents<C, X, V, 2, 1, 4>(a, owner, stream)
                                        : launch_token_cotangents<C, X, V, 8, 1, 2>(a, owner, stream);
    if (err != cudaSuccess) return err;
  }
  if (a.hidden_size > 0)
    shared_and_empty_rows_kernel<C, X, V>
        <<<blocks_for(a.batch * ((a.rows + 31) / 32), kThreads / 32), kThreads, 0, stream>>>(a, owner);
  return cudaGetLastError();
}

}  // namespace

int64_t unpermute_bwd_workspace_bytes(int64_t batch, int64_t rows) {
  return pad256(4 * std::max<int64_t>(1, batch * rows));
}

cudaError_t unpermute_bwd(const UnpermuteBwdArgs& a, cudaStream_t stream) {
  // float8 inputs take scatter + weight_grad (the lowering chooses); the expert rows' cotangent
  // comes in expert_out's dtype.
  auto wide = [](Dtype d) { return d == Dtype::kF32 || d == Dtype::kBF16 || d == Dtype::kF16; };
  if (!wide(a.ct_dtype) || !wide(a.x_dtype) || a.out_x_dtype != a.x_dtype) return cudaErrorInvalidValue;
  if (a.batch == 0) return cudaSuccess;
  const bool small = use_small_bwd(a);
  int32_t* owner = static_cast<int32_t*>(a.workspace);
  // All bytes 0xff: every owner -1.
  if (!small && a.batch * a.rows > 0)
    MOE_CUDA_TRY(cudaMemsetAsync(owner, 0xff, sizeof(int32_t) * a.batch * a.rows, stream));
  cudaError_t result = cudaSuccess;
  visit_output<CudaTypes>(a.ct_dtype, [&](auto ctag) {
    using C = typename decltype(ctag)::type;
    visit_output<CudaTypes>(a.x_dtype, [&](auto xtag) {
      using X = typename decltype(xtag)::type;
      constexpr int kVec = 16 / (sizeof(C) > sizeof(X) ? sizeof(C) : sizeof(X));
      const bool vec = a.hidden_size % kVec == 0 && aligned16(a.ct) && aligned16(a.x) && aligned16(a.out_x);
      if (small)
        result = vec ? launch_unpermute_bwd_small<C, X, kVec>(a, stream) : launch_unpermute_bwd_small<C, X, 1>(a, stream);
      else
        result = vec ? launch_unpermute_bwd<C, X, kVec>(a, owner, stream) : launch_unpermute_bwd<C, X, 1>(a, owner, stream);
    });
  });
  return result;
}

}  // namespace moe::cuda
