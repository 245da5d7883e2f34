// Why XLA cannot update a command buffer holding our CUTLASS grouped GEMM (ffi_grouped_gemm_cuda.cc):
// capture one launch (setup kernel, zero fill, CUTLASS's initialize + run) into a child graph, capture
// it again on new buffers, update the instantiated parent as XLA does
// (cudaGraphExecChildGraphNodeSetParams), and on failure print both captures node by node and
// cudaGraphExecUpdate's verdict. (No jax needed.)
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I cpp -I cpp/gemm \
//     -I $CUTLASS/include -I $CUTLASS/tools/util/include -o /tmp/graph_update_cutlass benchmarks/micro/graph_update_cutlass.cu
#include <cstdio>
#include <vector>

#include "grouped_gemm_cutlass.cuh"
#include "grouped_gemm_setup.cu"

MOE_GROUPED_GEMM_INSTANCE(moe::gemm::Dtype::kBf16, moe::gemm::Layout::kForward, moe::gemm::Tile::k128x256)
MOE_GROUPED_GEMM_INSTANCE(moe::gemm::Dtype::kBf16, moe::gemm::Layout::kForward, moe::gemm::Tile::k64x256)
MOE_GROUPED_GEMM_INSTANCE(moe::gemm::Dtype::kBf16, moe::gemm::Layout::kWeightGrad, moe::gemm::Tile::k128x128)

using namespace moe::gemm;

template <Layout L, Tile TILE>
GroupedGemmArgs make(int64_t groups, int64_t rows, int64_t k, int64_t n) {
  GroupedGemmArgs a;
  a.batch = 1, a.groups = groups, a.rows = rows, a.k = k, a.n = n;
  void *lhs, *rhs, *out, *ws;
  int32_t* sizes;
  cudaMalloc(&lhs, rows * k * 2);
  cudaMalloc(&rhs, (L == Layout::kWeightGrad ? rows : groups * k) * n * 2);
  cudaMalloc(&out, (L == Layout::kWeightGrad ? groups * k : rows) * n * 2);
  cudaMalloc(&sizes, groups * 4);
  std::vector<int32_t> h(groups, int32_t(rows / groups));
  cudaMemcpy(sizes, h.data(), groups * 4, cudaMemcpyHostToDevice);
  a.workspace_bytes = grouped_gemm_workspace_bytes<Dtype::kBf16, L, TILE>(groups, 1);
  cudaMalloc(&ws, a.workspace_bytes + 256);
  a.lhs = lhs, a.rhs = rhs, a.out = out, a.group_sizes = sizes, a.workspace = ws;
  return a;
}

template <Layout L, Tile TILE>
cudaGraph_t capture(const GroupedGemmArgs& a, cudaStream_t s, cudaStreamCaptureMode mode) {
  cudaGraph_t g = nullptr;
  cudaStreamBeginCapture(s, mode);
  cudaError_t e = grouped_gemm<Dtype::kBf16, L, TILE>(a, s);
  cudaError_t e2 = cudaStreamEndCapture(s, &g);
  printf("  capture: launch %s, end %s\n", cudaGetErrorName(e), cudaGetErrorName(e2));
  return g;
}

void dump(const char* name, cudaGraph_t g) {
  size_t count = 0;
  cudaGraphGetNodes(g, nullptr, &count);
  std::vector<cudaGraphNode_t> nodes(count);
  cudaGraphGetNodes(g, nodes.data(), &count);
  printf("  %s: %zu nodes\n", name, count);
  for (auto node : nodes) {
    cudaGraphNodeType t;
    cudaGraphNodeGetType(node, &t);
    if (t == cudaGraphNodeTypeKernel) {
      cudaKernelNodeParams p;
      cudaGraphKernelNodeGetParams(node, &p);
      cudaLaunchAttributeValue cl = {}, pdl = {}, prio = {};
      cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributeClusterDimension, &cl);
      cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributeProgrammaticStreamSerialization, &pdl);
      cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributePriority, &prio);
      printf("    kernel %p grid (%u,%u,%u) block (%u,%u,%u) smem %u cluster (%u,%u,%u) pdl %d prio %d extra %p\n",
             p.func, p.gridDim.x, p.gridDim.y, p.gridDim.z, p.blockDim.x, p.blockDim.y, p.blockDim.z, p.sharedMemBytes,
             cl.clusterDim.x, cl.clusterDim.y, cl.clusterDim.z, int(pdl.programmaticStreamSerializationAllowed),
             prio.priority, p.extra);
    } else if (t == cudaGraphNodeTypeMemset) {
      cudaMemsetParams p;
      cudaGraphMemsetNodeGetParams(node, &p);
      printf("    memset dst %p elem %u width %zu height %zu pitch %zu\n", p.dst, p.elementSize, p.width, p.height,
             p.pitch);
    } else {
      printf("    node type %d\n", int(t));
    }
  }
}

template <Layout L, Tile TILE>
void probe(const char* name, cudaStream_t s) {
  const cudaStreamCaptureMode modes[] = {cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed,
                                         cudaStreamCaptureModeGlobal};
  const char* mode_names[] = {"thread-local", "relaxed", "global"};
  for (int m = 0; m < 3; ++m) {
    for (int same = 0; same < 2; ++same) {
      printf("%s: capture mode %s, second capture on %s buffers\n", name, mode_names[m], same ? "the same" : "new");
      GroupedGemmArgs x = make<L, TILE>(16, 1024, 512, 256), y = same ? x : make<L, TILE>(16, 1024, 512, 256);
      cudaGraph_t g1 = capture<L, TILE>(x, s, modes[m]);
      cudaGraph_t parent;
      cudaGraphCreate(&parent, 0);
      cudaGraphNode_t node;
      cudaGraphAddChildGraphNode(&node, parent, nullptr, 0, g1);
      cudaGraphExec_t exec;
      cudaError_t e0 = cudaGraphInstantiate(&exec, parent, 0);
      cudaError_t e_run0 = cudaGraphLaunch(exec, s);
      cudaStreamSynchronize(s);
      cudaGraph_t g2 = capture<L, TILE>(y, s, modes[m]);
      cudaError_t e1 = cudaGraphExecChildGraphNodeSetParams(exec, node, g2);
      cudaGetLastError();
      cudaError_t e2 = cudaGraphLaunch(exec, s);
      cudaError_t e3 = cudaStreamSynchronize(s);
      printf("  instantiate %s, first launch %s, child update %s, launch %s %s\n", cudaGetErrorName(e0),
             cudaGetErrorName(e_run0), cudaGetErrorName(e1), cudaGetErrorName(e2), cudaGetErrorName(e3));
      cudaGetLastError();
      if (e1 != cudaSuccess) {
        dump("first capture", g1);
        dump("second capture", g2);
        cudaGraphExec_t exec1;
        cudaGraphInstantiate(&exec1, g1, 0);
        cudaGraphExecUpdateResultInfo info = {};
        cudaError_t e4 = cudaGraphExecUpdate(exec1, g2, &info);
        cudaGraphNodeType et = cudaGraphNodeTypeEmpty;
        if (info.errorNode) cudaGraphNodeGetType(info.errorNode, &et);
        printf("  whole-graph update %s: result %d (1 error, 2 topology, 3 node type, 4 function, 5 parameters, "
               "6 not supported, 7 unsupported function, 8 attributes), error node type %d\n",
               cudaGetErrorName(e4), int(info.result), int(et));
        cudaGetLastError();
      }
    }
  }
}

int main() {
  cudaFree(0);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  probe<Layout::kForward, Tile::k128x256>("forward 128x256", s);
  probe<Layout::kForward, Tile::k64x256>("forward 64x256", s);
  probe<Layout::kWeightGrad, Tile::k128x128>("dW 128x128", s);
  return 0;
}
