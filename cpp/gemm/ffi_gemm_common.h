// What the grouped-GEMM family's XLA FFI handlers share: buffer and stream types, the kernels'
// element types, and a CUDA status as an FFI error naming the op.
#pragma once

#include <cuda_runtime.h>

#include <optional>
#include <string>

#include "grouped_gemm.h"  // Dtype
#include "xla/ffi/api/ffi.h"

namespace moe::gemm {

namespace ffi = xla::ffi;
using I32Buffer = ffi::Buffer<ffi::S32>;
using Stream = ffi::PlatformStream<cudaStream_t>;

// The kernels' element type for an FFI dtype: bfloat16 or float16, nothing else.
inline std::optional<Dtype> gemm_dtype(ffi::DataType t) {
  if (t == ffi::DataType::BF16) return Dtype::kBf16;
  if (t == ffi::DataType::F16) return Dtype::kF16;
  return std::nullopt;
}

// Success, or an internal error "jax_moe_permute: <op>: <CUDA's message>".
inline ffi::Error cuda_status(cudaError_t err, const std::string& op) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal("jax_moe_permute: " + op + ": " + cudaGetErrorString(err));
}

}  // namespace moe::gemm
