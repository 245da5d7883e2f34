// The routed experts' MLP of a decode step, fused from the tokens to the weighted sum
// (moe_mlp_decode.cu): out [T, H'] = sum_k weights[t, k] * act(x[t] · w_in[ids[t, k]]) · w_out[ids[t, k]].
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "grouped_gemm.h"  // Dtype, sm_count

namespace moe::gemm {

// layer.ACTIVATIONS; kIdentity (no activation) only for gather_gemm, which is then a plain grouped GEMM.
enum class MlpActivation : int { kSwiglu = 0, kGeglu = 1, kGelu = 2, kRelu = 3, kIdentity = 4 };

struct MoeMlpDecodeArgs {
  int64_t tokens = 0, top_k = 0, experts = 0;
  int64_t hidden = 0;    // H: columns of x, rows of w_in
  int64_t ffn = 0;       // F: rows of w_out
  int64_t in_cols = 0;   // columns of w_in: 2F (gated, [gate | up]) or F
  int64_t out_cols = 0;  // H': columns of w_out and out
  MlpActivation activation = MlpActivation::kSwiglu;
  const void* x = nullptr;         // [T, H]
  const float* weights = nullptr;  // [T, K]
  const int32_t* ids = nullptr;    // [T, K]; outside [0, E): contributes nothing
  const void* w_in = nullptr;      // [E, H, in_cols], or [layers, E, H, in_cols] with `layer`
  const void* w_out = nullptr;     // [E, F, H'], or [layers, E, F, H'] with `layer`
  // Stacked weights: the layer to use, read on the device (a loop counter: no host copy, no
  // XLA slice of the stack), wrapped and clamped as dynamic_slice does. Null: unstacked.
  const int32_t* layer = nullptr;
  int64_t layers = 1;
  // [T, H'] or null: out = residual + the sum, rounded as XLA's add of the two in T (the residual
  // add of a decoder block, without a launch of its own).
  const void* residual = nullptr;
  void* out = nullptr;             // [T, H']
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

bool moe_mlp_decode_fits(const MoeMlpDecodeArgs& args);
int64_t moe_mlp_decode_workspace_bytes(const MoeMlpDecodeArgs& args);
cudaError_t moe_mlp_decode(Dtype dtype, const MoeMlpDecodeArgs& args, cudaStream_t stream);

}  // namespace moe::gemm
