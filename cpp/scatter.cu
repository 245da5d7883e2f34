// scatter (unpermute's transpose in x): out[b,r] = sum over the entries (t,k) that map to r of
// w[b,t,k] * x[b,t], in float32, in ascending t*K+k. Entries are radix-sorted by row; rows of
// exactly one entry are written token-major, the others (none, or several) row by row.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "cuda_kernels.h"
#include "cuda_sort.cuh"
#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cuda {
namespace {

__global__ void row_keys_kernel(const int32_t* row_map, int64_t rm_bstride, int64_t entries, int64_t total,
                                int64_t rows, uint32_t* keys, uint32_t* vals) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / entries, r = row_map[b * rm_bstride + i % entries];
    keys[i] = static_cast<uint32_t>(b * (rows + 1) + ((r < 0 || r >= rows) ? rows : r));
    vals[i] = static_cast<uint32_t>(i);
  }
}

__global__ void segment_bounds_kernel(const uint32_t* sorted_keys, int64_t total, int64_t num_keys, int32_t* seg) {
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q <= num_keys; q += int64_t(gridDim.x) * blockDim.x)
    seg[q] = static_cast<int32_t>(lower_bound(sorted_keys, total, q));
}

// Rows that exactly one entry maps to (all of them for a row map from permute) are written
// token-major, like permute's copy: each token row is read once and its weighted copies go to
// its K rows. Rows with no entry or several are left to multi_entry_rows_kernel.
// seg[b * (R + 1) + r] .. seg[b * (R + 1) + r + 1]: the sorted entries of row r.
// Blocks over (token, chunk of kUnroll * kGatherThreads vectors): kUnroll = 4 keeps enough
// loads in flight on large grids, 1 spreads small grids over more blocks.
template <typename X, typename O, int V, int kUnroll>
__global__ void __launch_bounds__(kGatherThreads) single_entry_rows_kernel(ScatterArgs a, const int32_t* seg) {
  const int64_t H = a.hidden_size, K = a.topk, R = a.rows;
  const int64_t h0 = (blockIdx.y * int64_t{kGatherThreads} * kUnroll + threadIdx.x) * V;
  if (h0 >= H) return;
  for (int64_t g = blockIdx.x; g < a.batch * a.tokens; g += gridDim.x) {
    const int64_t b = g / a.tokens, t = g - b * a.tokens;
    const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + t * H;
    Vec<X, V> raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t h = h0 + int64_t{u} * kGatherThreads * V;
      if (h < H) raw[u] = *reinterpret_cast<const Vec<X, V>*>(x + h);
    }
    const int32_t* rm = a.row_map + b * a.rm_bstride + t * K;
    const int32_t* my_seg = seg + b * (R + 1);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = rm[k];
      if (r < 0 || r >= R || my_seg[r + 1] - my_seg[r] != 1) continue;
      const float w = weight_at(a.weights, a.w_dtype, b * a.w_bstride + t * K + k);
      O* out = static_cast<O*>(a.out) + (b * R + r) * H;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t h = h0 + int64_t{u} * kGatherThreads * V;
        if (h >= H) break;
        float f[V];
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = w * to_f32(raw[u].v[i]);
        store_f32<O, V>(out + h, f);
      }
    }
  }
}

// Rows with no entry or several: zeros, or the weighted sum of their entries in ascending flat
// index (the sorted order), float32. Each warp checks 32 rows at once (one per lane: most rows
// have exactly one entry and are done) and then moves the rows left, one after another.
template <typename X, typename O, int V>
__global__ void multi_entry_rows_kernel(ScatterArgs a, const uint32_t* sorted_vals, const int32_t* seg) {
  const X* xs = static_cast<const X*>(a.x);
  const int64_t H = a.hidden_size, K = a.topk, R = a.rows, n = a.tokens * a.topk;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32), lane = threadIdx.x % 32;
  const int64_t groups = a.batch * ((R + 31) / 32);
  for (int64_t q = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; q < groups; q += warps) {
    const int64_t b = q / ((R + 31) / 32), r_mine = q % ((R + 31) / 32) * 32 + lane;
    const bool todo = r_mine < R && seg[b * (R + 1) + r_mine + 1] - seg[b * (R + 1) + r_mine] != 1;
    for (uint32_t left = __ballot_sync(0xffffffffu, todo); left != 0; left &= left - 1) {
      const int64_t r = r_mine - lane + __ffs(left) - 1;
      const int64_t begin = seg[b * (R + 1) + r], end = seg[b * (R + 1) + r + 1];
      for (int64_t h = lane * int64_t(V); h < H; h += 32 * V) {
        float acc[V] = {};
        for (int64_t p = begin; p < end; ++p) {
          const int64_t j = sorted_vals[p] % n;  // flat t*K+k within the example
          const float w = weight_at(a.weights, a.w_dtype, b * a.w_bstride + j);
          float f[V];
          load_f32<X, V>(xs + b * a.x_bstride + (j / K) * H + h, f);
#pragma unroll
          for (int i = 0; i < V; ++i) acc[i] = p == begin ? w * f[i] : acc[i] + w * f[i];
        }
        store_f32<O, V>(static_cast<O*>(a.out) + (b * R + r) * H + h, acc);
      }
    }
  }
}

template <typename X, typename O, int V>
cudaError_t launch_scatter(const ScatterArgs& a, const uint32_t* sorted_vals, const int32_t* seg,
                           cudaStream_t stream) {
  if (a.batch * a.tokens > 0) {
    const dim3 grid = gather_grid(a.batch * a.tokens, a.hidden_size, V);
    if (int64_t{grid.x} * grid.y >= 16 * multiprocessors()) {
      single_entry_rows_kernel<X, O, V, 4><<<gather_grid(a.batch * a.tokens, a.hidden_size, 4 * V), kGatherThreads, 0,
                                              stream>>>(a, seg);
    } else {
      single_entry_rows_kernel<X, O, V, 1><<<grid, kGatherThreads, 0, stream>>>(a, seg);
    }
    MOE_CHECK_LAUNCH();
  }
  multi_entry_rows_kernel<X, O, V><<<blocks_for(a.batch * ((a.rows + 31) / 32), kThreads / 32), kThreads, 0, stream>>>(
      a, sorted_vals, seg);
  return cudaGetLastError();
}

}  // namespace

cudaError_t scatter_workspace_bytes(int64_t batch, int64_t entries, int64_t rows, int64_t* bytes) {
  const int64_t items = batch * entries;
  return sort_space_bytes(items, batch * (rows + 1) + 1, key_bits(uint64_t(batch) * (rows + 1) - 1), bytes);
}

cudaError_t scatter(const ScatterArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk, total = a.batch * n, R = a.rows;
  if (a.batch * R == 0) return cudaSuccess;
  if (uint64_t(a.batch) * (R + 1) >= (uint64_t(1) << 31)) return cudaErrorInvalidValue;
  const int64_t num_keys = a.batch * (R + 1);
  const int bits = key_bits(uint64_t(num_keys) - 1);
  size_t cub_bytes = 0;
  MOE_CUDA_TRY(cub_sort_bytes(total, bits, &cub_bytes));
  SortSpace s = carve(a.workspace, total, num_keys + 1, cub_bytes);
  if (total > 0) {
    row_keys_kernel<<<blocks_for(total), kThreads, 0, stream>>>(a.row_map, a.rm_bstride, n, total, R, s.keys_in,
                                                                s.vals_in);
    MOE_CHECK_LAUNCH();
    MOE_CUDA_TRY(run_sort(s, total, bits, stream));
  }
  segment_bounds_kernel<<<blocks_for(num_keys + 1), kThreads, 0, stream>>>(s.keys_out, total, num_keys, s.extra);
  MOE_CHECK_LAUNCH();
  if (a.hidden_size == 0) return cudaSuccess;
  cudaError_t result = cudaSuccess;
  visit_input<CudaTypes>(a.x_dtype, [&](auto xtag) {
    using X = typename decltype(xtag)::type;
    visit_output<CudaTypes>(a.out_dtype, [&](auto otag) {
      using O = typename decltype(otag)::type;
      constexpr int kVec = 16 / sizeof(X);
      const bool vec = a.hidden_size % kVec == 0 && aligned16(a.x) &&
                       reinterpret_cast<uintptr_t>(a.out) % (sizeof(O) * kVec) == 0;
      result = vec ? launch_scatter<X, O, kVec>(a, s.vals_out, s.extra, stream)
                   : launch_scatter<X, O, 1>(a, s.vals_out, s.extra, stream);
    });
  });
  return result;
}

}  // namespace moe::cuda
