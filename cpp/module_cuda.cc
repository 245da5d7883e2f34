// nanobind module `_cuda`: the CUDA FFI targets and their workspace sizes.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda_kernels.h"
#include "ffi_capsule.h"
#include "ffi_handlers.h"
#ifdef MOE_HAS_GROUPED_GEMM
#include "gemm/ffi_grouped_gemm.h"  // grouped GEMM (ragged_dot)
#endif

namespace nb = nanobind;

namespace {
template <typename Fn>
int64_t workspace_bytes(Fn fn, int64_t batch, int64_t entries, int64_t extent) {
  int64_t bytes = 0;
  if (cudaError_t err = fn(batch, entries, extent, &bytes); err != cudaSuccess)
    throw std::runtime_error(std::string("jax_moe_permute: ") + cudaGetErrorString(err));
  return bytes;
}
}  // namespace

NB_MODULE(_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["permute"] = moe::capsule(MoePermuteCuda);
    d["unpermute"] = moe::capsule(MoeUnpermuteCuda);
    d["unpermute_add"] = moe::capsule(MoeUnpermuteAddCuda);
    d["scatter"] = moe::capsule(MoeScatterCuda);
    d["weight_grad"] = moe::capsule(MoeWeightGradCuda);
    d["unpermute_bwd"] = moe::capsule(MoeUnpermuteBwdCuda);
    d["router"] = moe::capsule(MoeRouterCuda);
    d["router_hidden"] = moe::capsule(MoeRouterHiddenCuda);
    d["router_hidden_stacked"] = moe::capsule(MoeRouterHiddenStackedCuda);
#ifdef MOE_HAS_GROUPED_GEMM  // grouped GEMM (ragged_dot)
    d["ragged_dot"] = moe::capsule(MoeRaggedDotCuda);
    d["ragged_dot_weight_grad"] = moe::capsule(MoeRaggedDotWeightGradCuda);
    d["ragged_dot_decode"] = moe::capsule(MoeRaggedDotDecodeCuda);
    d["ragged_dot_stacked"] = moe::capsule(MoeRaggedDotStackedCuda);
    d["moe_mlp_decode"] = moe::capsule(MoeMlpDecodeCuda);
    d["moe_mlp_decode_stacked"] = moe::capsule(MoeMlpDecodeStackedCuda);
    d["moe_mlp_decode_residual"] = moe::capsule(MoeMlpDecodeResidualCuda);
    d["moe_mlp_decode_stacked_residual"] = moe::capsule(MoeMlpDecodeStackedResidualCuda);
    d["gather_gemm"] = moe::capsule(MoeGatherGemmCuda);
    d["ragged_dot_wgrad_sm90"] = moe::capsule(MoeGroupedWgradCuda);
    d["gathered_wgrad_sm90"] = moe::capsule(MoeGroupedWgradGatheredCuda);
    d["down_backward"] = moe::capsule(MoeDownBackwardCuda);
#endif
    return d;
  });
  m.def("permute_workspace_bytes", [](int64_t batch, int64_t entries, int64_t num_local) {
    return workspace_bytes(moe::cuda::permute_workspace_bytes, batch, entries, num_local);
  });
  m.def("unpermute_bwd_workspace_bytes", [](int64_t batch, int64_t /*entries*/, int64_t rows) {
    return moe::cuda::unpermute_bwd_workspace_bytes(batch, rows);
  });
  m.def("router_hidden_fits", &moe::cuda::router_hidden_fits);
  m.def("scatter_workspace_bytes", [](int64_t batch, int64_t entries, int64_t rows) {
    return workspace_bytes(moe::cuda::scatter_workspace_bytes, batch, entries, rows);
  });
#ifdef MOE_HAS_GROUPED_GEMM  // grouped GEMM (ragged_dot)
  m.def("ragged_dot_workspace_bytes", &moe::gemm::ragged_dot_workspace_bytes);
  m.def("ragged_dot_decode_workspace_bytes", &moe::gemm::ragged_dot_decode_workspace_bytes);
  m.def("moe_mlp_decode_workspace_bytes", &moe::gemm::moe_mlp_decode_workspace_bytes);
  // gather_gemm_fits(tokens, hidden, experts, rows, n, activation): whether gather_gemm covers the call.
  m.def("gather_gemm_fits", &moe::gemm::gather_gemm_fits);
  // down_backward_fits(rows, hidden, experts, ffn, activation): whether down_backward covers the call.
  m.def("down_backward_fits", &moe::gemm::down_backward_fits);
  // ragged_dot_wgrad_sm90_fits(rows, k, n, groups): whether our weight-gradient kernel covers the call.
  m.def("ragged_dot_wgrad_sm90_fits", &moe::gemm::grouped_wgrad_fits);
  // ragged_dot_wgrad_sm90_preferred(rows, k, n, groups): whether it is the default there.
  m.def("ragged_dot_wgrad_sm90_preferred", &moe::gemm::grouped_wgrad_preferred);
#endif
}
