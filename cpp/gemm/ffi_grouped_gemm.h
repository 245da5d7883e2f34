// The XLA FFI handler symbols of the grouped GEMM (ragged_dot) and its workspace size, built only
// with the CUTLASS sm90a units (MOE_HAS_GROUPED_GEMM).
#pragma once

#include <cstdint>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* MoeRaggedDotCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeRaggedDotWeightGradCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeRaggedDotDecodeCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeRaggedDotStackedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeMlpDecodeCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeMlpDecodeStackedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeMlpDecodeResidualCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeMlpDecodeStackedResidualCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeGatherGemmCuda(XLA_FFI_CallFrame* call_frame);    // ffi_gather_gemm_cuda.cc
XLA_FFI_Error* MoeGroupedWgradCuda(XLA_FFI_CallFrame* call_frame);  // ffi_grouped_wgrad_cuda.cc
XLA_FFI_Error* MoeGroupedWgradGatheredCuda(XLA_FFI_CallFrame* call_frame);  // ffi_grouped_wgrad_cuda.cc
XLA_FFI_Error* MoeDownBackwardCuda(XLA_FFI_CallFrame* call_frame);  // ffi_down_backward_cuda.cc
}

namespace moe::gemm {
// Workspace bytes of one call: layout and dtype as in grouped_gemm.h, problems = batch * groups.
int64_t ragged_dot_workspace_bytes(int64_t layout, int64_t dtype, int64_t problems, int64_t batch);
// Workspace bytes of the decode kernel's call (its split partial sums; 0 when unsplit).
int64_t ragged_dot_decode_workspace_bytes(int64_t batch, int64_t groups, int64_t rows, int64_t k, int64_t n);
// Workspace bytes of the fused decode MLP's call (activation as moe_mlp_decode.h's MlpActivation).
int64_t moe_mlp_decode_workspace_bytes(int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t ffn,
                                       int64_t in_cols, int64_t out_cols, int64_t activation);
// Whether gather_gemm (gather_gemm.h) covers the call; activation as MlpActivation, n the columns of w.
bool gather_gemm_fits(int64_t tokens, int64_t hidden, int64_t experts, int64_t rows, int64_t n, int64_t activation);
// Whether down_backward (down_backward.h) covers the call; activation as MlpActivation.
bool down_backward_fits(int64_t rows, int64_t hidden, int64_t experts, int64_t ffn, int64_t activation);
// Whether our own weight-gradient kernel (grouped_wgrad.h) covers the call.
bool grouped_wgrad_fits(int64_t rows, int64_t k, int64_t n, int64_t groups);
// Whether ragged_dot's weight gradient takes that kernel by default (grouped_wgrad.h).
bool grouped_wgrad_preferred(int64_t rows, int64_t k, int64_t n, int64_t groups);
}  // namespace moe::gemm
