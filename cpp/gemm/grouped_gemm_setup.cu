// The grouped GEMM's small helpers: zeroing the weight gradients of empty groups (the forward
// layouts' row tail is zeroed by the setup kernel), and the cached SM count.
#include <algorithm>
#include <atomic>

#include "grouped_gemm.h"

namespace moe::gemm {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kVec = 16;  // bytes per store: rows are multiples of 16 bytes (N % 8 == 0, 2-byte elements)

// out[p] for each problem p whose group has no rows (its weight gradient is zero).
__global__ void __launch_bounds__(kThreads) zero_empty_groups(uint4* out, int64_t matrix_vecs,
                                                             const int32_t* group_rows) {
  const int64_t p = blockIdx.y;
  if (group_rows[p] > 0) return;
  uint4* base = out + p * matrix_vecs;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < matrix_vecs; i += int64_t(gridDim.x) * kThreads)
    base[i] = make_uint4(0, 0, 0, 0);
}

int64_t blocks_for(int64_t vecs, int64_t cap) {
  return std::max<int64_t>(1, std::min<int64_t>(cap, (vecs + kThreads - 1) / kThreads));
}

}  // namespace

int64_t zero_fill_blocks(int64_t vecs) { return blocks_for(vecs, std::max(1, 4 * sm_count())); }

cudaError_t zero_uncovered(const GroupedGemmArgs& a, Layout layout, int64_t element_bytes, const int32_t* group_rows,
                           cudaStream_t stream) {
  if (a.batch == 0 || a.n == 0) return cudaSuccess;
  if (layout == Layout::kWeightGrad) {
    const int64_t vecs = a.k * a.n * element_bytes / kVec, problems = a.batch * a.groups;
    if (vecs == 0 || problems == 0) return cudaSuccess;
    // Blocks of groups that have rows return at once; 32 per group bound that cost for many groups.
    dim3 grid(unsigned(blocks_for(vecs, 32)), unsigned(problems));
    zero_empty_groups<<<grid, kThreads, 0, stream>>>(static_cast<uint4*>(a.out), vecs, group_rows);
    return cudaGetLastError();
  }
  // No groups: every row is past the (empty) sum. With groups the setup kernel zeroes the tail.
  if (group_rows == nullptr && a.rows > 0) return cudaMemsetAsync(a.out, 0, a.batch * a.rows * a.n * element_bytes, stream);
  return cudaSuccess;
}

int sm_count() {
  static std::atomic<int> counts[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  int n = counts[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 132;
    counts[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace moe::gemm
