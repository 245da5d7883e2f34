// Grouped GEMM over ragged row groups (jax.lax.ragged_dot and its two gradients) on sm90:
// the argument struct, the launcher declarations, and the workspace layout they share.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::gemm {

// The three GEMMs of ragged_dot's forward and backward, named by how the second operand is stored.
enum class Layout : int {
  kForward = 0,        // out[b, rows of g, :] = lhs[b, rows of g, :] · rhs[b, g]      rhs [G, K, N]
  kTransposedRhs = 1,  // out[b, rows of g, :] = lhs[b, rows of g, :] · rhs[b, g]ᵀ     rhs [G, N, K]
  kWeightGrad = 2,     // out[b, g] = lhs[b, rows of g, :]ᵀ · rhs[b, rows of g, :]    lhs [M, K], rhs [M, N]
};

enum class Dtype : int { kBf16 = 0, kF16 = 1 };

// CTA tile (rows x columns of the output) and schedule of one instantiation, chosen per call by
// the average rows per group (ffi_grouped_gemm_cuda.cc). All use cluster 1x2 (A multicast along N).
enum class Tile : int {
  // Cooperative: two consumer warpgroups split one tile's rows. Groups of 128 rows and more.
  k128x256 = 0,
  // Ping-pong: each consumer warpgroup owns a tile, so one's epilogue overlaps the other's
  // mainloop. Decode: a few rows per group waste half as much of a 64-row tile.
  k64x256 = 1,
  // Ping-pong, 128 x 128: the weight gradient of long groups (1024 rows and more), where it
  // measured 4-8% faster than 128 x 256; with short groups its twice as many tiles cost more.
  k128x128 = 2,
};

// Groups averaging this many rows or more are "long": the weight gradient then runs on CUTLASS's
// 128 x 128 tile (ffi_grouped_gemm_cuda.cc), below it on our persistent kernel (grouped_wgrad.h).
constexpr int64_t kLongGroupRows = 1024;

// One launch covers batch * groups problems. Offsets are in elements; a batch stride of 0
// broadcasts an operand of leading extent 1. Group g of batch b holds the rows
// [start, start + size) with start = min(sum of earlier sizes, rows), size clamped to [0, rows - start].
struct GroupedGemmArgs {
  int64_t batch = 0, groups = 0;
  int64_t rows = 0;  // M: rows of lhs (and of rhs for kWeightGrad)
  int64_t k = 0;     // columns of lhs
  int64_t n = 0;     // columns of the output (kForward, kTransposedRhs) or of rhs (kWeightGrad)
  const void* lhs = nullptr;
  const void* rhs = nullptr;
  const int32_t* group_sizes = nullptr;
  void* out = nullptr;
  int64_t lhs_batch_stride = 0, rhs_batch_stride = 0, sizes_batch_stride = 0;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  // Consecutive tiles per cluster and round, on the tiles built with the run order
  // (run_tile_scheduler.cuh; the cooperative 128 x 256); 1 is CUTLASS's strided order.
  int run = 1;
  // Forward and transposed layouts: rhs stacked over layers ([layers, G, ., .], batch 1), the
  // layer read on the device by the setup kernel (decode_common.cuh's stacked_layer). Null: none.
  const int32_t* rhs_layer = nullptr;
  int64_t rhs_layers = 1;
};

// Bytes of workspace for `problems` = batch * groups problems: per-problem shapes, pointers and
// strides, and CUTLASS's own workspace (batch: unused by the CUTLASS layouts).
template <Dtype D, Layout L, Tile T>
int64_t grouped_gemm_workspace_bytes(int64_t problems, int64_t batch);

template <Dtype D, Layout L, Tile T>
cudaError_t grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream);

// Zero the weight gradients of groups without rows (kWeightGrad; reads the sizes the setup kernel
// left in the workspace), or, given no groups (group_rows null), the whole forward output. With
// groups, the forward layouts' rows past the sum of the sizes are zeroed by the setup kernel.
cudaError_t zero_uncovered(const GroupedGemmArgs& args, Layout layout, int64_t element_bytes,
                           const int32_t* group_rows, cudaStream_t stream);
// Blocks of 256 threads for a grid-stride fill of `vecs` 16-byte stores (at most four waves).
int64_t zero_fill_blocks(int64_t vecs);

// The decode kernel of the forward layout (grouped_gemm_decode.cu): CUDA cores streaming each
// routed matrix once, split along its rows into decode_splits(args) parts whose float32 partial
// sums (decode_workspace_bytes, 0 when unsplit) a second kernel adds. decode_gemm_fits: whether
// its grid covers the call (at most 65535 slots and batch elements).
bool decode_gemm_fits(const GroupedGemmArgs& args);
int decode_splits(const GroupedGemmArgs& args);
int64_t decode_workspace_bytes(const GroupedGemmArgs& args);
cudaError_t decode_grouped_gemm(Dtype dtype, const GroupedGemmArgs& args, cudaStream_t stream);

// Number of multiprocessors of the current device, queried once per device.
int sm_count();

}  // namespace moe::gemm
