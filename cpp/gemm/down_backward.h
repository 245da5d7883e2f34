// The backward of an MoE expert MLP's second half, y = ragged_dot(w * act(gate_up), w_out), from the
// rows' cotangent ct (down_backward.cu; jax_moe_permute/down_backward.py, down_vjp_p): the d lhs
// grouped GEMM g[r] = ct[r] · w_out[g(r)]ᵀ with the activation's backward in its epilogue, so that
// g [M, F] is never written: d gate_up = act'(gate_up)ᵀ (w * g), the gates' gradient Σ_f g * h
// (h = act(gate_up)) and w * h, the lhs of w_out's weight gradient.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "grouped_gemm.h"    // Dtype
#include "moe_mlp_decode.h"  // MlpActivation

namespace moe::gemm {

// Rows grouped by expert as in gather_gemm.h (negative sizes count as 0; rows from sum(sizes) on
// are written as zeros in every output).
struct DownBackwardArgs {
  int64_t rows = 0;     // M
  int64_t hidden = 0;   // H: columns of ct and of each w_out[g]
  int64_t experts = 0;  // E
  int64_t ffn = 0;      // F: rows of each w_out[g]
  MlpActivation activation = MlpActivation::kSwiglu;
  const void* ct = nullptr;              // [M, H], or [tokens, H] read through row_token
  const int32_t* row_token = nullptr;    // gathered ct: [M] on the device, row r of ct is row
                                         // row_token[r] of ct (zero outside [0, tokens))
  int64_t tokens = 0;                    // T, with row_token; < 2^31
  const void* gate_up = nullptr;         // [M, 2F] ([gate | up]) for swiglu / geglu, [M, F] else
  const float* w = nullptr;              // [M] the gates in row order, or nullptr (no gates: 1)
  const void* w_out = nullptr;           // [E, F, H]
  const int32_t* group_sizes = nullptr;  // [E], on the device
  void* d_gate_up = nullptr;             // gate_up's shape
  float* d_w = nullptr;                  // [down_backward_col_tiles(F), M]: per 256 columns, Σ g * h
  void* w_h = nullptr;                   // [M, F]: w * h
};

inline int64_t down_backward_col_tiles(int64_t ffn) { return (ffn + 255) / 256; }

// Whether the kernel covers these shapes (sm90a only; the caller checks the device): F % 64 == 0,
// H % 8 == 0 and H > 0, 1 <= E <= 1024, 0 <= M < 2^31 - 4096, a known activation, fewer than
// 2^31 - 4096 tiles.
bool down_backward_fits(int64_t rows, int64_t hidden, int64_t experts, int64_t ffn, int64_t activation);

// Launches nothing when M == 0; otherwise one kernel. No host synchronisation, allocation or
// copy: graph-capturable.
cudaError_t down_backward(Dtype dtype, const DownBackwardArgs& args, cudaStream_t stream);

}  // namespace moe::gemm
