// permute: picks one of three paths by batch size and expert count. Small batches route and copy
// in one launch (permute_small.cu); larger ones rank entries in tiles (permute_tiled.cu), or,
// past kMaxRankedLocal local experts, radix-sort them (permute_sorted.cu); both then copy rows
// with permute_copy.cu.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_kernels.h"
#include "kernel_args.h"
#include "permute_common.cuh"

namespace moe::cuda {
namespace {

bool use_tiles(int64_t num_local) { return num_local <= kMaxRankedLocal; }

}  // namespace

cudaError_t permute_workspace_bytes(int64_t batch, int64_t entries, int64_t num_local, int64_t* bytes) {
  return use_tiles(num_local) ? permute_tiled_workspace_bytes(batch, entries, num_local, bytes)
                              : permute_sorted_workspace_bytes(batch, entries, num_local, bytes);
}

cudaError_t permute(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk;
  if (a.batch == 0) return cudaSuccess;
  if (a.batch > 65535) return cudaErrorInvalidValue;  // grid.y
  if (n <= kSmallMaxEntries && a.num_local <= kMaxRankedLocal) return permute_small(a, stream);
  return use_tiles(a.num_local) ? permute_tiled(a, stream) : permute_sorted(a, stream);
}

}  // namespace moe::cuda
