// The micro benchmarks' CUDA error check (print the error and its line, then exit), a launch with
// one launch attribute, and timing.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                \
  do {                                                                       \
    cudaError_t e = (x);                                                     \
    if (e != cudaSuccess) {                                                  \
      printf("CUDA error %s at line %d\n", cudaGetErrorString(e), __LINE__); \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

// The median over `replays` runs (after two untimed ones) of launch() on stream s, in ms, by
// cudaEvents around each run.
template <class Launch>
float median_ms(cudaStream_t s, int replays, Launch&& launch) {
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  std::vector<float> times;
  for (int r = 0; r < replays + 2; ++r) {
    CK(cudaEventRecord(t0, s));
    CK(launch());
    CK(cudaEventRecord(t1, s));
    CK(cudaEventSynchronize(t1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, t0, t1));
    if (r >= 2) times.push_back(ms);
  }
  CK(cudaEventDestroy(t0));
  CK(cudaEventDestroy(t1));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// kernel<<<blocks, threads, 0, s>>>(args...) with `attribute` (null: none), by cudaLaunchKernelEx.
template <class... Params, class... Args>
cudaError_t launch_with(void (*kernel)(Params...), int blocks, int threads, cudaStream_t s,
                        const cudaLaunchAttribute* attribute, const Args&... args) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(blocks);
  c.blockDim = dim3(threads);
  c.stream = s;
  cudaLaunchAttribute a = attribute != nullptr ? *attribute : cudaLaunchAttribute{};
  c.attrs = &a;
  c.numAttrs = attribute != nullptr ? 1 : 0;
  return cudaLaunchKernelEx(&c, kernel, args...);
}
