// What a decode layer's launch structure costs at T = 1, before building a one-launch layer
// (docs/design-notes.md, "Decode step at T = 1"). Not part of the package: stand-in kernels with
// a Qwen3-30B-A3B layer's memory traffic (router 0.5 MB read by 16 blocks, routed experts 75.5 MB
// read by the whole GPU, the slice sum's 393 KB of partials read by 32 blocks, the residual add),
// over L layers with their own buffers (no L2 reuse), each configuration captured as one CUDA graph
// and timed with cudaEvents:
//   read      the expert read alone, one launch a layer (the floor)
//   launches  the four stand-ins as four launches a layer (today's structure)
//   pdl       the same, launches 2-4 programmatic dependent launches (they wait at their start)
//   one       one cooperative launch a layer, the four phases behind three grid-wide waits
//   one_nowait  the same without the waits (wrong results, the waits' cost by difference)
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/launch_structure benchmarks/micro/launch_structure.cu
//   /tmp/launch_structure [layers=24] [replays=20]
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../cpp/gemm/decode_common.cuh"  // load_stream
#include "check.cuh"

namespace cg = cooperative_groups;


constexpr int kThreads = 256, kUnroll = 8;
constexpr int64_t kRouterBytes = 2048 * 128 * 2, kExpertBytes = 8LL * 3 * 2048 * 768 * 2;
constexpr int64_t kPartialBytes = 8LL * 6 * 2048 * 4, kAddBytes = 2048 * 2 * 2;
constexpr int kRouterBlocks = 16, kSumBlocks = 32, kAddBlocks = 2;

struct Layer {
  const uint4 *router, *experts, *partials, *x;
};

__device__ __forceinline__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Blocks [0, blocks) of the grid read `bytes` at p, kUnroll 16-byte loads in flight a thread; one
// word a block goes to sink so that nothing is optimised away.
__device__ void read_range(const uint4* p, int64_t bytes, int block, int blocks, unsigned* sink) {
  if (block >= blocks) return;
  const int64_t n = bytes / 16, stride = int64_t{blocks} * kThreads * kUnroll;
  unsigned acc = 0;
  for (int64_t i = int64_t{block} * kThreads * kUnroll + threadIdx.x; i < n; i += stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = i + u * kThreads < n ? moe::gemm::decode::load_stream(p + i + u * kThreads) : uint4{};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) sink[block] = acc;  // practically never: keeps the loads
}

__global__ void __launch_bounds__(kThreads) read_kernel(const uint4* p, int64_t bytes, bool dependent,
                                                        unsigned* sink) {
  if (dependent) wait_for_previous_grid();
  read_range(p, bytes, blockIdx.x, gridDim.x, sink);
}

// The layer's four phases in one launch, `waits`: a grid-wide wait between phases.
__global__ void __launch_bounds__(kThreads) layer_kernel(Layer layer, bool waits, unsigned* sink) {
  cg::grid_group grid = cg::this_grid();
  const int b = blockIdx.x, n = gridDim.x;
  read_range(layer.router, kRouterBytes, b, kRouterBlocks, sink);
  if (waits) grid.sync();
  read_range(layer.experts, kExpertBytes, b, n, sink);
  if (waits) grid.sync();
  read_range(layer.partials, kPartialBytes, b, kSumBlocks, sink);
  if (waits) grid.sync();
  read_range(layer.x, kAddBytes, b, kAddBlocks, sink);
}

// One launch of kernel, `on`: with programmatic serialization (PDL) or as a cooperative grid.
template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), int blocks, cudaLaunchAttributeID id, bool on, cudaStream_t s,
                   const Args&... args) {
  cudaLaunchAttribute a = {};
  a.id = id;
  if (id == cudaLaunchAttributeCooperative) a.val.cooperative = 1;
  else a.val.programmaticStreamSerializationAllowed = 1;
  return launch_with(kernel, blocks, kThreads, s, on ? &a : nullptr, args...);
}

cudaError_t read_launch(int blocks, bool dependent, cudaStream_t s, const uint4* p, int64_t bytes, unsigned* sink) {
  return launch(read_kernel, blocks, cudaLaunchAttributeProgrammaticStreamSerialization, dependent, s, p, bytes,
                dependent, sink);
}

int main(int argc, char** argv) {
  const int L = argc > 1 ? atoi(argv[1]) : 24, replays = argc > 2 ? atoi(argv[2]) : 20;
  int device = 0, sms = 0, per_sm = 0;
  CK(cudaGetDevice(&device));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, layer_kernel, kThreads, 0));
  const int grid = sms * std::min(per_sm, 2);  // co-resident: the cooperative launch's limit
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device));
  printf("%s, %d SMs, %d blocks (co-resident %d a SM), %d layers, %d replays\n", prop.name, sms, grid, per_sm, L,
         replays);

  const int64_t layer_bytes = kRouterBytes + kExpertBytes + kPartialBytes + kAddBytes;
  char* base = nullptr;
  CK(cudaMalloc(&base, layer_bytes * L));
  CK(cudaMemset(base, 0x5a, layer_bytes * L));
  unsigned* sink = nullptr;
  CK(cudaMalloc(&sink, 4096 * sizeof(unsigned)));
  std::vector<Layer> layers(L);
  for (int l = 0; l < L; ++l) {
    char* p = base + l * layer_bytes;
    layers[l] = {reinterpret_cast<const uint4*>(p), reinterpret_cast<const uint4*>(p + kRouterBytes),
                 reinterpret_cast<const uint4*>(p + kRouterBytes + kExpertBytes),
                 reinterpret_cast<const uint4*>(p + kRouterBytes + kExpertBytes + kPartialBytes)};
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  auto record = [&](const char* name) -> cudaError_t {
    for (const Layer& y : layers) {
      cudaError_t e = cudaSuccess;
      if (!strcmp(name, "read")) {
        e = read_launch(grid, false, s, y.experts, kExpertBytes, sink);
      } else if (!strcmp(name, "launches") || !strcmp(name, "pdl")) {
        const bool pdl = !strcmp(name, "pdl");
        if (e == cudaSuccess) e = read_launch(kRouterBlocks, false, s, y.router, kRouterBytes, sink);
        if (e == cudaSuccess) e = read_launch(grid, pdl, s, y.experts, kExpertBytes, sink);
        if (e == cudaSuccess) e = read_launch(kSumBlocks, pdl, s, y.partials, kPartialBytes, sink);
        if (e == cudaSuccess) e = read_launch(kAddBlocks, pdl, s, y.x, kAddBytes, sink);
      } else {
        e = launch(layer_kernel, grid, cudaLaunchAttributeCooperative, true, s, y, bool(!strcmp(name, "one")), sink);
      }
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };

  double read_us = 0;
  for (const char* name : {"read", "launches", "pdl", "one", "one_nowait"}) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    bool graphed = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess;
    cudaError_t e = record(name);
    if (graphed) {
      const cudaError_t end = cudaStreamEndCapture(s, &graph);
      graphed = e == cudaSuccess && end == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    }
    if (!graphed) {  // launched from the host each replay instead
      (void)cudaGetLastError();
      printf("%-11s not captured (%s): timed as host launches\n", name, cudaGetErrorString(e));
    }
    const float ms = median_ms(s, replays, [&] { return graphed ? cudaGraphLaunch(exec, s) : record(name); });
    const double us = 1e3 * ms / L;
    if (!strcmp(name, "read")) read_us = us;
    printf("%-11s %8.2f us a layer  %5.2fx read  (experts at %.2f TB/s)\n", name, us, us / read_us,
           kExpertBytes / us / 1e6);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
