// The gathered grouped GEMM with a fused activation (gather_gemm.cu), the first GEMM of an MoE
// expert MLP without the permute: out[r] = act(x[row_token[r]] · w[g(r)]), rows grouped by expert.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "grouped_gemm.h"    // Dtype
#include "moe_mlp_decode.h"  // MlpActivation

namespace moe::gemm {

// Row r of group g (rows [start_g, start_g + size_g), start_g = min(sum of earlier sizes, M),
// negative sizes count as 0) reads token row_token[r] of x; a token outside [0, T) reads zeros.
// Rows from sum(sizes) on are written as zeros (jax.lax.ragged_dot's contract), in out and pre.
struct GatherGemmArgs {
  int64_t tokens = 0;   // T: rows of x
  int64_t hidden = 0;   // H: columns of x, rows of each w[g]
  int64_t experts = 0;  // E: groups
  int64_t rows = 0;     // M: rows of out (and of row_token)
  int64_t n = 0;        // N: columns of w: 2F for the gated activations ([gate | up]), F otherwise
  MlpActivation activation = MlpActivation::kSwiglu;
  bool save_pre = false;              // also write pre = x · w, [M, N]
  const void* x = nullptr;            // [T, H]
  const int32_t* row_token = nullptr; // [M]
  const int32_t* group_sizes = nullptr;  // [E], on the device
  const void* w = nullptr;            // [E, H, N]
  void* out = nullptr;                // [M, F]
  void* pre = nullptr;                // [M, N] when save_pre
  int* tile_counter = nullptr;        // one int of device scratch (the dynamic tile schedule's)
};

inline bool gather_gemm_gated(MlpActivation a) { return a == MlpActivation::kSwiglu || a == MlpActivation::kGeglu; }

// Whether the kernel covers these shapes (sm90a only; the caller checks the device): F % 128 == 0,
// H % 8 == 0 and H > 0, 1 <= E <= 1024, 0 <= M < 2^31 - 4096, 0 <= T < 2^31, a known activation,
// and fewer than 2^31 - 4096 tiles (bounded by (ceil(M / 128) + min(E, M)) * column tiles).
bool gather_gemm_fits(int64_t tokens, int64_t hidden, int64_t experts, int64_t rows, int64_t n, int64_t activation);

// Launches nothing when M == 0; otherwise (dynamic schedule) a 4-byte memset of tile_counter and the
// kernel. No host synchronisation, allocation or copy: graph-capturable.
cudaError_t gather_gemm(Dtype dtype, const GatherGemmArgs& args, cudaStream_t stream);

}  // namespace moe::gemm
