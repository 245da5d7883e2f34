// The grouped weight gradient on our own persistent sm90a kernel (grouped_wgrad.cu):
// out[g] = lhs[rows of g]ᵀ · rhs[rows of g], the d rhs of ragged_dot, one launch, graph-safe.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "grouped_gemm.h"  // Dtype

namespace moe::gemm {

// Group g holds rows [start_g, end_g) with start_g = min(sum of earlier sizes, M) and negative
// sizes counted as 0 (ragged_dot's contract); a group without rows gets a zero gradient.
struct GroupedWgradArgs {
  int64_t rows = 0;    // M: rows of lhs and rhs
  int64_t k = 0;       // columns of lhs: rows of each out[g]
  int64_t n = 0;       // columns of rhs and of each out[g]
  int64_t groups = 0;  // G
  const void* lhs = nullptr;             // [M, K], or [T, K] read through gather_index
  const void* rhs = nullptr;             // [M, N], or [T, N] read through gather_index (gather_rhs)
  const int32_t* gather_index = nullptr; // gathered operand: [M] on the device, its row r is row
                                         // gather_index[r] of the [T, .] array (zero outside [0, T))
  int64_t gather_src_rows = 0;           // T, with gather_index; < 2^31
  bool gather_rhs = false;               // which operand gather_index reads: lhs, or rhs
  const int32_t* group_sizes = nullptr;  // [G], on the device
  void* out = nullptr;                   // [G, K, N]
};

// Whether the kernel covers these shapes: K and N positive multiples of 64, 1 <= G <= 1024,
// M < 2^31 - 64, and fewer than 2^31 tiles of 128 x 256.
bool grouped_wgrad_fits(int64_t rows, int64_t k, int64_t n, int64_t groups);

// Whether ragged_dot's weight gradient takes this kernel by default: where it fits and the groups
// are shorter than kLongGroupRows on average (fine-grained MoEs: 0.97-1.42x CUTLASS's rate on
// Qwen3's shapes); long groups keep CUTLASS's 128 x 128 tile (docs/grouped-gemm.md).
bool grouped_wgrad_preferred(int64_t rows, int64_t k, int64_t n, int64_t groups);

// No host synchronisation, allocation or copy: graph-capturable.
cudaError_t grouped_wgrad(Dtype dtype, const GroupedWgradArgs& args, cudaStream_t stream);

}  // namespace moe::gemm
