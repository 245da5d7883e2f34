// permute, more than kMaxRankedLocal local experts (too many to rank in shared memory): a CUB
// radix sort of (example, local expert) keys, the expert blocks from the sorted keys, then the
// copy (permute_copy.cu).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "cuda_sort.cuh"
#include "kernel_args.h"
#include "moe_index.h"
#include "permute_common.cuh"

namespace moe::cuda {
namespace {

// int32s after the sort's arrays: segment bounds [B, L+2], block starts [B, L+1], counts [B, L].
int64_t layout_ints(int64_t batch, int64_t L) { return batch * (L + 2) + batch * (L + 1) + batch * L; }

__global__ void expert_keys_kernel(const int32_t* ids, int64_t ids_bstride, const int32_t* map,
                                   int64_t map_bstride, int64_t entries, int64_t total, int64_t num_experts,
                                   int32_t num_local, uint32_t* keys, uint32_t* vals) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / entries, j = i % entries;
    const int32_t e = local_expert(ids[b * ids_bstride + j], map ? map + b * map_bstride : nullptr,
                                   num_experts, num_local);
    keys[i] = static_cast<uint32_t>(b * (num_local + 1) + e);
    vals[i] = static_cast<uint32_t>(i);
  }
}

// One block per example: expert segment bounds in the sorted keys, then block starts.
// seg: [B, L+2] segment bounds; starts: [B, L+1] first row of each block, then the total.
__global__ void expert_layout_kernel(const uint32_t* sorted_keys, int64_t total, int32_t num_local,
                                     int64_t align, int32_t* seg, int32_t* starts, int32_t* counts,
                                     int32_t* group_sizes) {
  __shared__ int64_t sums[33];
  const int64_t b = blockIdx.x, L = num_local;
  int32_t* my_seg = seg + b * (L + 2);
  for (int64_t e = threadIdx.x; e <= L + 1; e += blockDim.x)
    my_seg[e] = static_cast<int32_t>(lower_bound(sorted_keys, total, uint64_t(b * (L + 1) + e)));
  __syncthreads();
  int64_t carry = 0;
  for (int64_t e0 = 0; e0 < L; e0 += blockDim.x) {
    const int64_t e = e0 + threadIdx.x;
    const int64_t padded = e < L ? round_up(my_seg[e + 1] - my_seg[e], align) : 0;
    int64_t chunk_total;
    const int64_t offset = block_exclusive_sum(padded, sums, &chunk_total) + carry;
    if (e < L) {
      starts[b * (L + 1) + e] = static_cast<int32_t>(offset);
      counts[b * L + e] = my_seg[e + 1] - my_seg[e];
      group_sizes[b * L + e] = static_cast<int32_t>(padded);
    }
    carry += chunk_total;
  }
  if (threadIdx.x == 0) starts[b * (L + 1) + L] = static_cast<int32_t>(carry);
}

__global__ void assign_rows_kernel(const uint32_t* sorted_keys, const uint32_t* sorted_vals, int64_t total,
                                   int32_t num_local, const int32_t* seg, const int32_t* starts,
                                   int32_t* row_map) {
  const int64_t L = num_local;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < total; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t key = sorted_keys[p], b = key / (L + 1), e = key % (L + 1);
    row_map[sorted_vals[p]] = e == L ? -1 : static_cast<int32_t>(starts[b * (L + 1) + e] + (p - seg[b * (L + 2) + e]));
  }
}

}  // namespace

cudaError_t permute_sorted_workspace_bytes(int64_t batch, int64_t entries, int64_t num_local, int64_t* bytes) {
  const int64_t items = batch * entries;
  return sort_space_bytes(items, layout_ints(batch, num_local), key_bits(uint64_t(batch) * (num_local + 1) - 1),
                          bytes);
}

cudaError_t permute_sorted(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk, total = a.batch * n, L = a.num_local;
  const int bits = key_bits(uint64_t(a.batch) * (L + 1) - 1);
  size_t cub_bytes = 0;
  MOE_CUDA_TRY(cub_sort_bytes(total, bits, &cub_bytes));
  SortSpace s = carve(a.workspace, total, layout_ints(a.batch, L), cub_bytes);
  int32_t* seg = s.extra;
  int32_t* starts = seg + a.batch * (L + 2);
  int32_t* counts = starts + a.batch * (L + 1);
  expert_keys_kernel<<<blocks_for(total), kThreads, 0, stream>>>(a.ids, a.ids_bstride, a.expert_map,
                                                                 a.map_bstride, n, total, a.num_experts,
                                                                 a.num_local, s.keys_in, s.vals_in);
  MOE_CHECK_LAUNCH();
  MOE_CUDA_TRY(run_sort(s, total, bits, stream));
  expert_layout_kernel<<<static_cast<int>(a.batch), kThreads, 0, stream>>>(s.keys_out, total, a.num_local, a.align,
                                                                           seg, starts, counts, a.group_sizes);
  MOE_CHECK_LAUNCH();
  assign_rows_kernel<<<blocks_for(total), kThreads, 0, stream>>>(s.keys_out, s.vals_out, total, a.num_local, seg,
                                                                 starts, a.row_map);
  MOE_CHECK_LAUNCH();
  return copy_and_zero(a, EntryRows{a.row_map, nullptr, nullptr, 0, 0}, RowLayout{starts, counts}, stream);
}

}  // namespace moe::cuda
