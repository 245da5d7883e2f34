// Where route_tokens' one-launch router spends a decode layer's 7.4 us (H100, Qwen3-30B-A3B at T = 1)
// when a stand-in launch with the same read takes about 2 (launch_structure.cu). Not part of the
// package: it compiles cpp/router.cu in and times, each as one CUDA graph of L launches on L
// routers of their own (no L2 reuse), cudaEvents, median of the replays, per launch:
//   empty             16 blocks that do nothing: a launch in a chain of dependent launches
//   empty_cluster{8,16}  the same in clusters of 8 / 16 blocks
//   read, read_cluster16  16 blocks read the 2048 x 128 bf16 router (0.5 MB), all loads in flight at once
//   route             the per-token router kernel on float32 logits (softmax, top-8, renormalise)
//   hidden            router_hidden: the product and the route in one cluster (the package's kernel)
// Build with -DMOE_ROUTER_HIDDEN_MAX_CLUSTER=8 for router_hidden on clusters of 8, with
// -DMOE_ROUTER_TRACE for its phases as block 0's SM clock (median of 11 launches).
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -o /tmp/router_latency benchmarks/micro/router_latency.cu && /tmp/router_latency [layers=24] [replays=20]
#include "../../cpp/router.cu"

#include <cstring>
#include <vector>

#include "check.cuh"

constexpr int kBlocks = 16, kThreads = 256;
constexpr int64_t kHidden = 2048, kExperts = 128, kTopK = 8;
constexpr int64_t kRouterBytes = kHidden * kExperts * 2;

__global__ void empty_kernel(unsigned*) {}

// Every load issued before any is used: 16 blocks x 256 threads x 8 x 16 bytes is the router once.
__global__ void read_kernel(const uint4* p, unsigned* sink) {
  constexpr int kLoads = 8;
  const int64_t n = kRouterBytes / 16, threads = int64_t{gridDim.x} * kThreads;
  uint4 v[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int64_t i = (int64_t{blockIdx.x} * kThreads + threadIdx.x) + u * threads;
    v[u] = i < n ? moe::gemm::decode::load_stream(p + i) : uint4{};
  }
  unsigned acc = 0;
#pragma unroll
  for (int u = 0; u < kLoads; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // practically never: keeps the loads
}

// kBlocks blocks of kernel, in clusters of `cluster` (1: no cluster).
template <class... Params, class... Args>
cudaError_t launch_clustered(void (*kernel)(Params...), int cluster, cudaStream_t s, const Args&... args) {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = unsigned(cluster);
  a.val.clusterDim.y = a.val.clusterDim.z = 1;
  if (cluster > 8) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
  }
  return launch_with(kernel, kBlocks, kThreads, s, cluster > 1 ? &a : nullptr, args...);
}

int main(int argc, char** argv) {
  const int L = argc > 1 ? atoi(argv[1]) : 24, replays = argc > 2 ? atoi(argv[2]) : 20;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d layers, %d replays, router_hidden's largest cluster %d\n", prop.name, L, replays,
         moe::cuda::kHiddenMaxCluster);

  // Per layer: the router [H, E] bf16, x [1, H] bf16, logits [1, E] f32, weights and ids [1, K].
  const int64_t stride = kRouterBytes + kHidden * 2 + kExperts * 4 + kTopK * 8;
  char* base = nullptr;
  CK(cudaMalloc(&base, stride * L));
  std::vector<uint16_t> host(size_t(stride * L / 2));
  for (size_t i = 0; i < host.size(); ++i) host[i] = uint16_t(0x3c00 + (i * 2654435761u >> 20) % 512);  // bf16 ~1-4
  CK(cudaMemcpy(base, host.data(), stride * L, cudaMemcpyHostToDevice));
  unsigned* sink = nullptr;
  CK(cudaMalloc(&sink, 4096 * sizeof(unsigned)));
  auto args_for = [&](int l) {
    char* p = base + l * stride;
    moe::RouterHiddenArgs a;
    a.weight = p;
    a.x = p + kRouterBytes;
    a.dtype = moe::Dtype::kBF16;
    a.hidden = kHidden;
    a.logits = reinterpret_cast<float*>(p + kRouterBytes + kHidden * 2);
    moe::RouterArgs& r = a.route;
    r.logits = a.logits;
    r.logits_dtype = moe::Dtype::kF32;
    r.bias = nullptr;
    r.bias_rstride = 0;
    r.tokens = 1, r.experts = kExperts, r.topk = kTopK;
    r.scoring = moe::Scoring::kSoftmax;
    r.renormalize = true;
    r.num_groups = 0, r.topk_groups = 0;
    r.scale = 1.0f;
    r.weights = reinterpret_cast<float*>(a.logits + kExperts);
    r.ids = reinterpret_cast<int32_t*>(r.weights + kTopK);
    return a;
  };
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  auto record = [&](const char* name) -> cudaError_t {
    for (int l = 0; l < L; ++l) {
      const moe::RouterHiddenArgs a = args_for(l);
      const uint4* router = static_cast<const uint4*>(a.weight);
      cudaError_t e;
      if (!strcmp(name, "empty")) e = launch_clustered(empty_kernel, 1, s, sink);
      else if (!strcmp(name, "empty_cluster8")) e = launch_clustered(empty_kernel, 8, s, sink);
      else if (!strcmp(name, "empty_cluster16")) e = launch_clustered(empty_kernel, 16, s, sink);
      else if (!strcmp(name, "read")) e = launch_clustered(read_kernel, 1, s, router, sink);
      else if (!strcmp(name, "read_cluster16")) e = launch_clustered(read_kernel, 16, s, router, sink);
      else if (!strcmp(name, "route")) e = moe::cuda::router(a.route, s);
      else e = moe::cuda::router_hidden(a, s);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };

  // The logits the route variant reads: one untimed run of the product.
  CK(record("hidden"));
  CK(cudaStreamSynchronize(s));
  for (const char* name : {"empty", "empty_cluster8", "empty_cluster16", "read", "read_cluster16", "route", "hidden"}) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    const cudaError_t recorded = record(name);
    CK(cudaStreamEndCapture(s, &graph));
    CK(recorded);
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms = median_ms(s, replays, [&] { return cudaGraphLaunch(exec, s); });
    printf("%-16s %6.2f us a launch\n", name, 1e3 * ms / L);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  }
#ifdef MOE_ROUTER_TRACE
  const char* phases[] = {"stage x", "weights in", "block sum", "cluster wait", "cluster sum", "route", "exit wait"};
  int khz = 0;
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  std::vector<std::vector<long long>> deltas(7);
  for (int r = 0; r < 11; ++r) {
    CK(moe::cuda::router_hidden(args_for(r % L), s));
    CK(cudaStreamSynchronize(s));
    long long mark[8];
    CK(cudaMemcpyFromSymbol(mark, moe::cuda::router_trace, sizeof(mark)));
    for (int i = 0; i < 7; ++i) deltas[i].push_back(mark[i + 1] - mark[i]);
  }
  printf("router_hidden phases, block 0 (cycles, us at %.2f GHz):", khz / 1e6);
  for (int i = 0; i < 7; ++i) {
    std::sort(deltas[i].begin(), deltas[i].end());
    printf("  %s %lld (%.2f)", phases[i], deltas[i][5], deltas[i][5] / (khz * 1e-3));
  }
  printf("\n");
#endif
  return 0;
}
