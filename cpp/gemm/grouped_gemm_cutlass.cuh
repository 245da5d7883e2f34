// The CUTLASS sm90 ptr-array grouped GEMM behind every grouped_gemm_<dtype>_<layout>.cu unit:
// a device-side setup kernel (group sizes -> problem shapes, pointers, strides; no host sync),
// then CUTLASS's persistent grouped kernel reading those arrays from the workspace.
// Include from exactly one translation unit per instantiation (they compile in parallel).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "decode_common.cuh"
#include "grouped_gemm.h"
#include "run_tile_scheduler.cuh"

namespace moe::gemm {

template <Dtype D>
using ElementOf = std::conditional_t<D == Dtype::kBf16, cutlass::bfloat16_t, cutlass::half_t>;

// The operand layouts of each GEMM (JAX arrays are row-major; no operand is transposed in memory).
template <Layout L>
struct OperandLayouts;
template <>
struct OperandLayouts<Layout::kForward> {  // A = lhs rows (K contiguous), B = rhs[g] [K, N] (N contiguous)
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct OperandLayouts<Layout::kTransposedRhs> {  // B = rhs[g] stored [N, K]: K contiguous
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct OperandLayouts<Layout::kWeightGrad> {  // A = lhs_gᵀ (M contiguous), B = rhs_g [rows, N]
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

// One kernel configuration: element type, operand layouts, tile, cluster, schedule (as in
// CUTLASS example 57). The output is row-major, of the input element type, with no source C.
// ProblemShape: (M, N, K) per group; RunProblemShape selects the run tile order (run_tile_scheduler.cuh).
template <Dtype D, Layout L, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          class ProblemShape_ = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>>
struct GroupedGemmConfig {
  using Element = ElementOf<D>;
  using ProblemShape = ProblemShape_;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA accesses

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignment, Element, LayoutD*, kAlignment, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, typename OperandLayouts<L>::A*, kAlignment,
      Element, typename OperandLayouts<L>::B*, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Where each per-problem array lives in the workspace (256-byte aligned pieces).
template <class Config>
struct WorkspaceLayout {
  using Gemm = typename Config::Gemm;
  using Element = typename Config::Element;
  using Shape = typename Config::ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;

  static constexpr int64_t align(int64_t x) { return (x + 255) / 256 * 256; }

  int64_t problems;
  int64_t off_rows = 0, off_shapes, off_a, off_b, off_d, off_sa, off_sb, off_sd, off_cutlass;

  explicit WorkspaceLayout(int64_t problems_) : problems(problems_) {
    off_shapes = off_rows + align(problems * sizeof(int32_t));
    off_a = off_shapes + align(problems * sizeof(Shape));
    off_b = off_a + align(problems * sizeof(void*));
    off_d = off_b + align(problems * sizeof(void*));
    off_sa = off_d + align(problems * sizeof(void*));
    off_sb = off_sa + align(problems * sizeof(StrideA));
    off_sd = off_sb + align(problems * sizeof(StrideB));
    off_cutlass = off_sd + align(problems * sizeof(StrideD));
  }
};

// Per problem (b, g): clamped rows of the group, its shape, operand pointers and strides; the
// group starts come from a block-wide scan of the sizes. Grid (batch, zero_blocks): block (b, 0)
// writes batch element b's problems; in the forward and transposed layouts every block of b also
// zeroes its share of the output rows past the sum of the sizes, which no group writes (one
// launch less than a separate fill: a decode step runs two such GEMMs a layer).
template <Layout L, class Shape, class Element, class StrideA, class StrideB, class StrideD>
__global__ void __launch_bounds__(256) setup_problems(GroupedGemmArgs a, int32_t* group_rows, Shape* shapes,
                                                      const Element** ptr_a, const Element** ptr_b,
                                                      Element** ptr_d, StrideA* stride_a, StrideB* stride_b,
                                                      StrideD* stride_d, StrideA sa, StrideB sb, StrideD sd) {
  const int64_t b = blockIdx.x, G = a.groups, M = a.rows, K = a.k, N = a.n;
  const int32_t* sizes = a.group_sizes + b * a.sizes_batch_stride;
  const int64_t per_thread = (G + blockDim.x - 1) / blockDim.x;
  const int64_t g0 = std::min<int64_t>(G, threadIdx.x * per_thread), g1 = std::min<int64_t>(G, g0 + per_thread);
  int64_t local = 0;
  for (int64_t g = g0; g < g1; ++g) local += std::max(sizes[g], 0);

  __shared__ int64_t scan[256];  // inclusive Hillis-Steele scan of the per-thread sums
  scan[threadIdx.x] = local;
  __syncthreads();
  for (unsigned step = 1; step < blockDim.x; step *= 2) {
    int64_t add = threadIdx.x >= step ? scan[threadIdx.x - step] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  Element* out = static_cast<Element*>(a.out);
  if constexpr (L != Layout::kWeightGrad) {
    // Rows [min(sum, M), M) of out[b], 16 bytes a store (rows are multiples of 16 bytes).
    const int64_t row_vecs = N * int64_t(sizeof(Element)) / 16;
    uint4* base = reinterpret_cast<uint4*>(out + b * M * N);
    for (int64_t i = std::min(scan[blockDim.x - 1], M) * row_vecs + blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
         i < M * row_vecs; i += int64_t(gridDim.y) * blockDim.x)
      base[i] = make_uint4(0, 0, 0, 0);
  }
  if (blockIdx.y != 0) return;

  int64_t start = scan[threadIdx.x] - local;
  const Element* lhs = static_cast<const Element*>(a.lhs) + b * a.lhs_batch_stride;
  const Element* rhs = static_cast<const Element*>(a.rhs) + b * a.rhs_batch_stride;
  if (L != Layout::kWeightGrad && a.rhs_layer != nullptr)
    rhs += decode::stacked_layer(a.rhs_layer, a.rhs_layers) * G * K * N;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t s = std::min(start, M);
    const int64_t rows = std::min<int64_t>(std::max(sizes[g], 0), M - s);
    start += std::max(sizes[g], 0);
    const int64_t p = b * G + g;
    group_rows[p] = static_cast<int32_t>(rows);
    ptr_a[p] = lhs + s * K;
    if constexpr (L == Layout::kWeightGrad) {
      // (M', N', K') = (K, N, rows); a group without rows is skipped here and zeroed by zero_empty_groups.
      shapes[p] = rows > 0 ? Shape{int(K), int(N), int(rows)} : Shape{0, int(N), 0};
      ptr_b[p] = rhs + s * N;
      ptr_d[p] = out + p * K * N;
    } else {
      shapes[p] = Shape{int(rows), int(N), int(K)};
      ptr_b[p] = rhs + g * K * N;
      ptr_d[p] = out + (b * M + s) * N;
    }
    stride_a[p] = sa;
    stride_b[p] = sb;
    stride_d[p] = sd;
  }
}

template <class Config>
typename Config::Gemm::Arguments make_arguments(const GroupedGemmArgs& a, char* ws, const WorkspaceLayout<Config>& w) {
  using W = WorkspaceLayout<Config>;
  using Gemm = typename Config::Gemm;
  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count();
  using E = typename Config::Element;
  typename Config::ProblemShape shapes;
  shapes.num_groups = int(w.problems);
  shapes.problem_shapes = reinterpret_cast<typename W::Shape*>(ws + w.off_shapes);
  if constexpr (std::is_same_v<typename Config::ProblemShape, RunProblemShape>) shapes.run = std::max(1, a.run);
  args = typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      shapes,
      {reinterpret_cast<const E**>(ws + w.off_a), reinterpret_cast<typename W::StrideA*>(ws + w.off_sa),
       reinterpret_cast<const E**>(ws + w.off_b), reinterpret_cast<typename W::StrideB*>(ws + w.off_sb)},
      {fusion, nullptr, nullptr, reinterpret_cast<E**>(ws + w.off_d),
       reinterpret_cast<typename W::StrideD*>(ws + w.off_sd)},
      hw};
  return args;
}

template <class Config>
int64_t workspace_bytes(int64_t problems) {
  WorkspaceLayout<Config> w(problems);
  GroupedGemmArgs dummy;
  auto args = make_arguments<Config>(dummy, nullptr, w);
  return w.off_cutlass + int64_t(Config::Gemm::get_workspace_size(args));
}

template <Dtype D, Layout L, class Config>
cudaError_t run_grouped_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  using W = WorkspaceLayout<Config>;
  const int64_t problems = a.batch * a.groups;
  if (a.batch == 0) return cudaSuccess;
  W w(problems);
  if (a.workspace_bytes < workspace_bytes<Config>(problems)) return cudaErrorInvalidValue;
  char* ws = static_cast<char*>(a.workspace);
  auto* group_rows = reinterpret_cast<int32_t*>(ws + w.off_rows);
  using E = typename Config::Element;

  // The strides do not depend on a group's row count (every operand is packed along its rows).
  const int M1 = 1;
  typename W::StrideA sa;
  typename W::StrideB sb;
  typename W::StrideD sd;
  if constexpr (L == Layout::kWeightGrad) {
    sa = cutlass::make_cute_packed_stride(typename W::StrideA{}, {int(a.k), M1, 1});  // A' [K, rows]
    sb = cutlass::make_cute_packed_stride(typename W::StrideB{}, {int(a.n), M1, 1});  // B' (N, rows)
  } else {
    sa = cutlass::make_cute_packed_stride(typename W::StrideA{}, {M1, int(a.k), 1});
    sb = cutlass::make_cute_packed_stride(typename W::StrideB{}, {int(a.n), int(a.k), 1});
  }
  sd = cutlass::make_cute_packed_stride(typename W::StrideD{}, {L == Layout::kWeightGrad ? int(a.k) : M1, int(a.n), 1});

  if (problems > 0) {
    // The forward layouts' setup also zeroes the rows past the sum of the sizes (zero_fill_blocks:
    // as many blocks as that fill needs, at most four waves' worth).
    const int64_t fill_vecs = L == Layout::kWeightGrad ? 0 : a.rows * a.n * int64_t(sizeof(E)) / 16;
    const dim3 grid(unsigned(a.batch), unsigned(zero_fill_blocks(fill_vecs)));
    setup_problems<L><<<grid, 256, 0, stream>>>(
        a, group_rows, reinterpret_cast<typename W::Shape*>(ws + w.off_shapes),
        reinterpret_cast<const E**>(ws + w.off_a), reinterpret_cast<const E**>(ws + w.off_b),
        reinterpret_cast<E**>(ws + w.off_d), reinterpret_cast<typename W::StrideA*>(ws + w.off_sa),
        reinterpret_cast<typename W::StrideB*>(ws + w.off_sb), reinterpret_cast<typename W::StrideD*>(ws + w.off_sd),
        sa, sb, sd);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  if (L == Layout::kWeightGrad || problems == 0) {
    if (cudaError_t err = zero_uncovered(a, L, sizeof(E), problems > 0 ? group_rows : nullptr, stream);
        err != cudaSuccess)
      return err;
  }
  if (problems == 0 || a.rows == 0 || a.k == 0 || a.n == 0) return cudaSuccess;  // nothing to multiply

  typename Config::Gemm gemm;
  auto args = make_arguments<Config>(a, ws, w);
  // initialize() builds the kernel parameters on the host and clears CUTLASS's workspace on `stream`;
  // it neither allocates nor synchronizes.
  if (gemm.initialize(args, ws + w.off_cutlass, stream) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

// The configuration of each tile (CUTLASS example 57's building blocks, with JAX's layouts).
template <Dtype D, Layout L, Tile T>
struct TileConfig;
template <Dtype D, Layout L>
struct TileConfig<D, L, Tile::k128x256> {
  using type = GroupedGemmConfig<D, L, cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, RunProblemShape>;
};
template <Dtype D, Layout L>
struct TileConfig<D, L, Tile::k64x256> {
  using type = GroupedGemmConfig<D, L, cute::Shape<cute::_64, cute::_256, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
};

template <Dtype D, Layout L>
struct TileConfig<D, L, Tile::k128x128> {
  using type = GroupedGemmConfig<D, L, cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
};

// Defines the two entry points of one instantiation (use once per translation unit; CMake
// generates one unit per instantiation so that they compile in parallel).
#define MOE_GROUPED_GEMM_INSTANCE(DTYPE, LAYOUT, TILE)                                                \
  namespace moe::gemm {                                                                                 \
  template <>                                                                                           \
  int64_t grouped_gemm_workspace_bytes<DTYPE, LAYOUT, TILE>(int64_t problems, int64_t /*batch*/) {    \
    return workspace_bytes<typename TileConfig<DTYPE, LAYOUT, TILE>::type>(problems);                   \
  }                                                                                                     \
  template <>                                                                                           \
  cudaError_t grouped_gemm<DTYPE, LAYOUT, TILE>(const GroupedGemmArgs& args, cudaStream_t stream) {   \
    return run_grouped_gemm<DTYPE, LAYOUT, typename TileConfig<DTYPE, LAYOUT, TILE>::type>(args, stream); \
  }                                                                                                     \
  }

}  // namespace moe::gemm
