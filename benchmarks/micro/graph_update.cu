// Which kernel launches survive cuGraphExecChildGraphNodeSetParams, XLA's update of a custom call
// it traced into a child graph, once the call is captured again on new buffers? (No jax needed.)
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/graph_update benchmarks/micro/graph_update.cu && /tmp/graph_update
#include <cstdio>

#include <cuda_runtime.h>
__global__ void k(float* p, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) p[i] += 1.f; }
__global__ void __cluster_dims__(1, 2, 1) kc(float* p, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) p[i] += 1.f; }
__global__ void kbig(float* p, int n) { extern __shared__ float s[]; int i = blockIdx.x * blockDim.x + threadIdx.x; s[threadIdx.x] = 1.f; __syncthreads(); if (i < n) p[i] += s[threadIdx.x]; }

enum Mode { kPlain, kClusterEx, kClusterStatic, kBigSmem, kMemset, kClusterExPdl };
const char* names[] = {"plain", "cluster attr (cudaLaunchKernelEx)", "__cluster_dims__", "dyn smem 100KB", "memset+plain", "cluster attr + PDL attr"};

void launch(Mode m, float* p, int n, cudaStream_t s) {
  if (m == kPlain) k<<<4, 64, 0, s>>>(p, n);
  if (m == kMemset) { cudaMemsetAsync(p, 0, 16, s); k<<<4, 64, 0, s>>>(p, n); }
  if (m == kClusterStatic) kc<<<dim3(1, 4), 64, 0, s>>>(p, n);
  if (m == kBigSmem) { cudaFuncSetAttribute(kbig, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 << 10); kbig<<<4, 64, 100 << 10, s>>>(p, n); }
  if (m == kClusterEx || m == kClusterExPdl) {
    cudaLaunchConfig_t c = {};
    c.gridDim = dim3(1, 4); c.blockDim = dim3(64); c.stream = s;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x = 1; at[0].val.clusterDim.y = 2; at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[1].val.programmaticStreamSerializationAllowed = 1;
    c.attrs = at; c.numAttrs = m == kClusterExPdl ? 2 : 1;
    cudaLaunchKernelEx(&c, k, p, n);
  }
}

cudaGraph_t trace(Mode m, float* p, cudaStream_t s) {
  cudaGraph_t g;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  launch(m, p, 256, s);
  cudaStreamEndCapture(s, &g);
  return g;
}

int main() {
  cudaFree(0);
  cudaStream_t s; cudaStreamCreate(&s);
  for (int m = 0; m < 6; ++m) {
    float *a, *b; cudaMalloc(&a, 1024); cudaMalloc(&b, 1024);
    cudaGraph_t child = trace(Mode(m), a, s);
    cudaGraph_t parent; cudaGraphCreate(&parent, 0);
    cudaGraphNode_t node; cudaGraphAddChildGraphNode(&node, parent, nullptr, 0, child);
    cudaGraphExec_t exec; cudaError_t e0 = cudaGraphInstantiate(&exec, parent, 0);
    cudaGraph_t child2 = trace(Mode(m), b, s);
    cudaError_t e1 = cudaGraphExecChildGraphNodeSetParams(exec, node, child2);
    cudaError_t e2 = cudaGraphLaunch(exec, s);
    cudaError_t e3 = cudaStreamSynchronize(s);
    printf("%-36s instantiate %s  child update %s  launch %s %s\n", names[m], cudaGetErrorName(e0), cudaGetErrorName(e1), cudaGetErrorName(e2), cudaGetErrorName(e3));
    cudaGetLastError();
  }
}
