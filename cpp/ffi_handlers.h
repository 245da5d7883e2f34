// The exported XLA FFI handler symbols, one per operation and platform.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* MoePermuteCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeUnpermuteCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeScatterCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeWeightGradCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeRouterCpu(XLA_FFI_CallFrame* call_frame);

XLA_FFI_Error* MoePermuteCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeUnpermuteCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeUnpermuteAddCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeScatterCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeWeightGradCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeUnpermuteBwdCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeRouterCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeRouterHiddenCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeRouterHiddenStackedCuda(XLA_FFI_CallFrame* call_frame);
}
