// Error checking and device queries for CUDA launchers; host code only, so any .cu unit
// (our kernels or a library's) can include it. Launchers return the first cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// Returns the launch's error from the enclosing launcher (a kernel launch reports none itself).
#define MOE_CHECK_LAUNCH()                                        \
  do {                                                            \
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) \
      return err;                                                 \
  } while (0)

// Returns from the enclosing launcher when `expr` (a cudaError_t) is not cudaSuccess.
#define MOE_CUDA_TRY(expr)                                        \
  do {                                                            \
    if (cudaError_t err = (expr); err != cudaSuccess) return err; \
  } while (0)

namespace moe::cuda {

// Multiprocessors of the current device, read once per device (no synchronisation).
inline int64_t multiprocessors() {
  static int cached[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int count = 0;
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    cached[device] = count > 0 ? count : 132;
  }
  return cached[device];
}

}  // namespace moe::cuda
