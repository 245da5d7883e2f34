// Grouped GEMM instantiation: bfloat16, out = lhs · rhs[g]ᵀ (gradient of lhs).
#include "grouped_gemm_cutlass.cuh"

namespace moe::gemm {
namespace {
using Config = GroupedGemmConfig<Dtype::kBf16, Layout::kTransposedRhs,
                                 cute::Shape<cute::_128, cute::_256, cute::_64>,  // tile (M, N, K)
                                 cute::Shape<cute::_1, cute::_2, cute::_1>,       // cluster: A multicast along N
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
}  // namespace
MOE_GROUPED_GEMM_INSTANCE(Dtype::kBf16, Layout::kTransposedRhs, Config)
}  // namespace moe::gemm
