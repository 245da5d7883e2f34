// XLA FFI handlers of the grouped GEMM: check the buffers, fill GroupedGemmArgs, dispatch on
// dtype and layout to one CUTLASS instantiation, launch on XLA's stream.
#include "ffi_grouped_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <utility>
#include <type_traits>
#include <string>

#include "grouped_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace moe::gemm {
namespace {

namespace ffi = xla::ffi;
using I32Buffer = ffi::Buffer<ffi::S32>;
using Stream = ffi::PlatformStream<cudaStream_t>;

ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument("jax_moe_permute: " + what); }

std::optional<Dtype> gemm_dtype(ffi::DataType t) {
  if (t == ffi::DataType::BF16) return Dtype::kBf16;
  if (t == ffi::DataType::F16) return Dtype::kF16;
  return std::nullopt;
}

constexpr std::pair<Tile, const char*> kTileNames[] = {{Tile::k128x256, "128x256"}, {Tile::k64x256, "64x256"}, {Tile::k128x128, "128x128"}};

// The tile of one call. MOE_GROUPED_GEMM_TILE (e.g. "64x256") forces a tile of the row-grouped
// GEMMs, MOE_GROUPED_GEMM_DW_TILE one of the weight gradient, to measure them; nullopt if the
// variable names none.
std::optional<Tile> choose_tile(Layout layout, const GroupedGemmArgs& a) {
  if (const char* forced = std::getenv(layout == Layout::kWeightGrad ? "MOE_GROUPED_GEMM_DW_TILE" : "MOE_GROUPED_GEMM_TILE")) {
    for (auto [tile, name] : kTileNames)
      if (std::string(forced) == name) return tile;
    return std::nullopt;
  }
  // Measured on the H200 (docs/grouped-gemm.md). The weight gradient's output rows are the
  // weights' K, always large; its mainloop runs over a group's rows: ping-pong 128 x 128 wins
  // from about 1024 rows per group, the cooperative 128 x 256 below.
  if (layout == Layout::kWeightGrad) return a.rows >= 1024 * a.groups ? Tile::k128x128 : Tile::k128x256;
  // Measured on the H200 (docs/grouped-gemm.md): 64-row tiles win while the average group fits
  // one (decode), 128-row tiles from 128 rows per group up (training and prefill).
  return a.rows <= 64 * a.groups ? Tile::k64x256 : Tile::k128x256;
}

template <Dtype D, Layout L>
cudaError_t dispatch_tile(Tile tile, const GroupedGemmArgs& a, cudaStream_t stream) {
  switch (tile) {
    case Tile::k128x256: return grouped_gemm<D, L, Tile::k128x256>(a, stream);
    case Tile::k64x256: return grouped_gemm<D, L, Tile::k64x256>(a, stream);
    case Tile::k128x128: return grouped_gemm<D, L, Tile::k128x128>(a, stream);
  }
  return cudaErrorInvalidValue;
}

template <Dtype D>
cudaError_t dispatch_layout(Layout layout, Tile tile, const GroupedGemmArgs& a, cudaStream_t stream) {
  switch (layout) {
    case Layout::kForward: return dispatch_tile<D, Layout::kForward>(tile, a, stream);
    case Layout::kTransposedRhs: return dispatch_tile<D, Layout::kTransposedRhs>(tile, a, stream);
    case Layout::kWeightGrad: return dispatch_tile<D, Layout::kWeightGrad>(tile, a, stream);
  }
  return cudaErrorInvalidValue;
}

// Batch stride of an operand whose leading extent is 1 (broadcast) or `batch`.
std::optional<int64_t> batch_stride(int64_t extent, int64_t batch, int64_t per_example) {
  if (extent != 1 && extent != batch) return std::nullopt;
  return extent == 1 ? 0 : per_example;
}

ffi::Error launch(cudaStream_t stream, Dtype dtype, Layout layout, GroupedGemmArgs& a, ffi::AnyBuffer& lhs,
                  ffi::AnyBuffer& rhs, I32Buffer& sizes, int64_t lhs_per, int64_t rhs_per, ffi::AnyBuffer& workspace) {
  auto ls = batch_stride(lhs.dimensions()[0], a.batch, lhs_per);
  auto rs = batch_stride(rhs.dimensions()[0], a.batch, rhs_per);
  auto ss = batch_stride(sizes.dimensions()[0], a.batch, a.groups);
  if (!ls || !rs || !ss) return invalid("ragged_dot: leading batch extents must be 1 or the output's");
  if (a.k % 8 != 0 || a.n % 8 != 0) return invalid("ragged_dot: K and N must be multiples of 8 (16-byte rows)");
  a.lhs_batch_stride = *ls;
  a.rhs_batch_stride = *rs;
  a.sizes_batch_stride = *ss;
  a.lhs = lhs.untyped_data();
  a.rhs = rhs.untyped_data();
  a.group_sizes = sizes.typed_data();
  a.workspace = workspace.untyped_data();
  a.workspace_bytes = int64_t(workspace.size_bytes());
  if (a.workspace_bytes < ragged_dot_workspace_bytes(int64_t(layout), int64_t(dtype), a.batch * a.groups, a.batch))
    return invalid("ragged_dot: workspace too small");
  const std::optional<Tile> tile = choose_tile(layout, a);
  if (!tile) return invalid("ragged_dot: MOE_GROUPED_GEMM_TILE or MOE_GROUPED_GEMM_DW_TILE names no tile (128x256, 64x256 or 128x128)");
  cudaError_t err = dtype == Dtype::kBf16 ? dispatch_layout<Dtype::kBf16>(layout, *tile, a, stream)
                                          : dispatch_layout<Dtype::kF16>(layout, *tile, a, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_moe_permute: ragged_dot: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// out[b] [M, N] = ragged rows of lhs[b] [M, K] times rhs[b, g] ([K, N], or [N, K] when rhs_transposed).
ffi::Error RaggedDot(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, I32Buffer sizes,
                     int64_t rhs_transposed, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), sd = sizes.dimensions(), od = out->dimensions();
  if (ld.size() != 3 || rd.size() != 4 || sd.size() != 2 || od.size() != 3)
    return invalid("ragged_dot: expected lhs [B, M, K], rhs [B, G, K, N], group_sizes [B, G], out [B, M, N]");
  auto dtype = gemm_dtype(lhs.element_type());
  if (!dtype || rhs.element_type() != lhs.element_type() || out->element_type() != lhs.element_type())
    return invalid("ragged_dot: lhs, rhs and out must all be bfloat16 or all float16");
  GroupedGemmArgs a;
  a.batch = od[0];
  a.rows = od[1];
  a.n = od[2];
  a.k = ld[2];
  a.groups = rd[1];
  const int64_t rk = rhs_transposed ? rd[3] : rd[2], rn = rhs_transposed ? rd[2] : rd[3];
  if (ld[1] != a.rows || rk != a.k || rn != a.n || sd[1] != a.groups)
    return invalid("ragged_dot: operand shapes do not agree");
  a.out = out->untyped_data();
  return launch(stream, *dtype, rhs_transposed ? Layout::kTransposedRhs : Layout::kForward, a, lhs, rhs, sizes,
                a.rows * a.k, a.groups * a.k * a.n, *workspace);
}

// out[b, g] [K, N] = lhs[b] rows of g ([rows, K]) transposed times rhs[b] rows of g ([rows, N]).
ffi::Error RaggedDotWeightGrad(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, I32Buffer sizes,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), sd = sizes.dimensions(), od = out->dimensions();
  if (ld.size() != 3 || rd.size() != 3 || sd.size() != 2 || od.size() != 4)
    return invalid("ragged_dot weight grad: expected lhs [B, M, K], rhs [B, M, N], group_sizes [B, G], "
                   "out [B, G, K, N]");
  auto dtype = gemm_dtype(lhs.element_type());
  if (!dtype || rhs.element_type() != lhs.element_type() || out->element_type() != lhs.element_type())
    return invalid("ragged_dot weight grad: lhs, rhs and out must all be bfloat16 or all float16");
  GroupedGemmArgs a;
  a.batch = od[0];
  a.groups = od[1];
  a.k = od[2];
  a.n = od[3];
  a.rows = ld[1];
  if (rd[1] != a.rows || ld[2] != a.k || rd[2] != a.n || sd[1] != a.groups)
    return invalid("ragged_dot weight grad: operand shapes do not agree");
  a.out = out->untyped_data();
  return launch(stream, *dtype, Layout::kWeightGrad, a, lhs, rhs, sizes, a.rows * a.k, a.rows * a.n, *workspace);
}

}  // namespace

// The largest over the tiles a call may choose, so the choice can be made at run time.
int64_t ragged_dot_workspace_bytes(int64_t layout, int64_t dtype, int64_t problems, int64_t batch) {
  auto of = [&](auto d) -> int64_t {
    constexpr Dtype D = decltype(d)::value;
    auto most = [&](auto l) {
      constexpr Layout L = decltype(l)::value;
      return std::max({grouped_gemm_workspace_bytes<D, L, Tile::k128x256>(problems, batch),
                       grouped_gemm_workspace_bytes<D, L, Tile::k64x256>(problems, batch),
                       grouped_gemm_workspace_bytes<D, L, Tile::k128x128>(problems, batch)});
    };
    switch (Layout(layout)) {
      case Layout::kForward: return most(std::integral_constant<Layout, Layout::kForward>{});
      case Layout::kTransposedRhs: return most(std::integral_constant<Layout, Layout::kTransposedRhs>{});
      case Layout::kWeightGrad: return most(std::integral_constant<Layout, Layout::kWeightGrad>{});
    }
    return -1;
  };
  if (Dtype(dtype) == Dtype::kBf16) return of(std::integral_constant<Dtype, Dtype::kBf16>{});
  return of(std::integral_constant<Dtype, Dtype::kF16>{});
}

}  // namespace moe::gemm

// Not marked kCmdBufferCompatible: CUTLASS's initialize() builds kernel parameters on the host
// at each call, which a replayed command buffer would skip.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRaggedDotCuda, moe::gemm::RaggedDot,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<moe::gemm::I32Buffer>()
                                  .Attr<int64_t>("rhs_transposed")
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRaggedDotWeightGradCuda, moe::gemm::RaggedDotWeightGrad,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<moe::gemm::I32Buffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
