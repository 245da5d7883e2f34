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

#include "ffi_gemm_common.h"
#include "grouped_gemm.h"
#include "moe_mlp_decode.h"
#include "xla/ffi/api/ffi.h"

namespace moe::gemm {
namespace {


ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument("jax_moe_permute: " + what); }

constexpr std::pair<Tile, const char*> kTileNames[] = {{Tile::k128x256, "128x256"}, {Tile::k64x256, "64x256"}, {Tile::k128x128, "128x128"}};

// The tile of one call. MOE_GROUPED_GEMM_TILE (e.g. "64x256") forces a tile of the row-grouped
// GEMMs, MOE_GROUPED_GEMM_DW_TILE one of the weight gradient, to measure them; nullopt if the
// variable names none. MOE_GROUPED_GEMM_TILE=decode is read when a call is lowered (it picks the
// decode target, gemm_primitives.py): here, where the decode kernel does not apply, it means the
// rule below.
std::optional<Tile> choose_tile(Layout layout, const GroupedGemmArgs& a) {
  const char* variable = layout == Layout::kWeightGrad ? "MOE_GROUPED_GEMM_DW_TILE" : "MOE_GROUPED_GEMM_TILE";
  if (const char* forced = std::getenv(variable); forced != nullptr && (layout == Layout::kWeightGrad ||
                                                                        std::string(forced) != "decode")) {
    for (auto [tile, name] : kTileNames)
      if (std::string(forced) == name) return tile;
    return std::nullopt;
  }
  // Measured on the H200 (docs/grouped-gemm.md). The weight gradient's output rows are the
  // weights' K, always large; its mainloop runs over a group's rows: ping-pong 128 x 128 wins
  // from about 1024 rows per group, the cooperative 128 x 256 below.
  if (layout == Layout::kWeightGrad) return a.rows >= kLongGroupRows * a.groups ? Tile::k128x128 : Tile::k128x256;
  // Measured on the H200 (docs/grouped-gemm.md): 64-row tiles win while the average group fits
  // one (decode), 128-row tiles from 128 rows per group up (training and prefill).
  return a.rows <= 64 * a.groups ? Tile::k64x256 : Tile::k128x256;
}

// Consecutive tiles per cluster and round (run_tile_scheduler.cuh). MOE_GROUPED_GEMM_RUN (the
// row-grouped GEMMs) and MOE_GROUPED_GEMM_DW_RUN (the weight gradient) force a positive count, to
// measure it.
int choose_run(Layout layout, Tile tile, const GroupedGemmArgs& a) {
  const char* variable = layout == Layout::kWeightGrad ? "MOE_GROUPED_GEMM_DW_RUN" : "MOE_GROUPED_GEMM_RUN";
  if (const char* forced = std::getenv(variable); forced != nullptr && std::atoi(forced) > 0) return std::atoi(forced);
  // Measured on the H200 (docs/design-notes.md, "Grouped GEMM tiles"): runs of 8 speed up the
  // weight gradient of short groups (Qwen3 w13 by 5%, w2 by 1-2%; DeepSeek-V3 unchanged).
  (void)a;
  return layout == Layout::kWeightGrad && tile == Tile::k128x256 ? 8 : 1;
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

// The operand pointers, batch strides and workspace of `a` (whose shape fields are set).
ffi::Error bind_operands(GroupedGemmArgs& a, ffi::AnyBuffer& lhs, ffi::AnyBuffer& rhs, I32Buffer& sizes,
                         int64_t lhs_per, int64_t rhs_per, ffi::AnyBuffer& workspace) {
  auto ls = batch_stride(lhs.dimensions()[0], a.batch, lhs_per);
  // A stacked rhs is indexed on the device by its layer, not by the batch.
  auto rs = a.rhs_layer != nullptr ? std::optional<int64_t>(0) : batch_stride(rhs.dimensions()[0], a.batch, rhs_per);
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
  return ffi::Error::Success();
}

ffi::Error gemm_error(cudaError_t err) { return cuda_status(err, "ragged_dot"); }

ffi::Error launch(cudaStream_t stream, Dtype dtype, Layout layout, GroupedGemmArgs& a, ffi::AnyBuffer& lhs,
                  ffi::AnyBuffer& rhs, I32Buffer& sizes, int64_t lhs_per, int64_t rhs_per, ffi::AnyBuffer& workspace) {
  if (auto err = bind_operands(a, lhs, rhs, sizes, lhs_per, rhs_per, workspace); !err.success()) return err;
  if (a.workspace_bytes < ragged_dot_workspace_bytes(int64_t(layout), int64_t(dtype), a.batch * a.groups, a.batch))
    return invalid("ragged_dot: workspace too small");
  const std::optional<Tile> tile = choose_tile(layout, a);
  if (!tile)
    return invalid("ragged_dot: MOE_GROUPED_GEMM_TILE or MOE_GROUPED_GEMM_DW_TILE names no tile (128x256, 64x256, "
                   "128x128, or decode for MOE_GROUPED_GEMM_TILE)");
  a.run = choose_run(layout, *tile, a);
  return gemm_error(dtype == Dtype::kBf16 ? dispatch_layout<Dtype::kBf16>(layout, *tile, a, stream)
                                          : dispatch_layout<Dtype::kF16>(layout, *tile, a, stream));
}

// The shapes of out[b] [M, N] = ragged rows of lhs[b] [M, K] times rhs[b, g] ([K, N], or [N, K]
// when rhs_transposed), checked.
ffi::Error row_grouped_args(ffi::AnyBuffer& lhs, ffi::AnyBuffer& rhs, I32Buffer& sizes, bool rhs_transposed,
                            ffi::AnyBuffer& out, GroupedGemmArgs* a, Dtype* dtype) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), sd = sizes.dimensions(), od = out.dimensions();
  if (ld.size() != 3 || rd.size() != 4 || sd.size() != 2 || od.size() != 3)
    return invalid("ragged_dot: expected lhs [B, M, K], rhs [B, G, K, N], group_sizes [B, G], out [B, M, N]");
  auto d = gemm_dtype(lhs.element_type());
  if (!d || rhs.element_type() != lhs.element_type() || out.element_type() != lhs.element_type())
    return invalid("ragged_dot: lhs, rhs and out must all be bfloat16 or all float16");
  *dtype = *d;
  a->batch = od[0];
  a->rows = od[1];
  a->n = od[2];
  a->k = ld[2];
  a->groups = rd[1];
  const int64_t rk = rhs_transposed ? rd[3] : rd[2], rn = rhs_transposed ? rd[2] : rd[3];
  if (ld[1] != a->rows || rk != a->k || rn != a->n || sd[1] != a->groups)
    return invalid("ragged_dot: operand shapes do not agree");
  a->out = out.untyped_data();
  return ffi::Error::Success();
}

ffi::Error RaggedDot(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, I32Buffer sizes,
                     int64_t rhs_transposed, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  GroupedGemmArgs a;
  Dtype dtype;
  if (auto err = row_grouped_args(lhs, rhs, sizes, rhs_transposed, *out, &a, &dtype); !err.success()) return err;
  return launch(stream, dtype, rhs_transposed ? Layout::kTransposedRhs : Layout::kForward, a, lhs, rhs, sizes,
                a.rows * a.k, a.groups * a.k * a.n, *workspace);
}

// The forward GEMM on a layer of rhs stacked over layers ([L, G, K, N]), the layer read on the
// device by the setup kernel: no XLA slice of the stack (whose dynamic offset XLA would copy to the
// host and wait for). One batch element.
ffi::Error RaggedDotStacked(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, I32Buffer sizes,
                            I32Buffer layer, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  GroupedGemmArgs a;
  Dtype dtype;
  if (auto err = row_grouped_args(lhs, rhs, sizes, false, *out, &a, &dtype); !err.success()) return err;
  if (a.batch != 1 || lhs.dimensions()[0] != 1 || sizes.dimensions()[0] != 1)
    return invalid("ragged_dot stacked: expected one batch element (lhs [1, M, K], group_sizes [1, G])");
  if (layer.element_count() != 1 || rhs.dimensions()[0] < 1) return invalid("ragged_dot stacked: bad layer");
  a.rhs_layer = layer.typed_data(), a.rhs_layers = rhs.dimensions()[0];
  return launch(stream, dtype, Layout::kForward, a, lhs, rhs, sizes, a.rows * a.k, 0, *workspace);
}

// The forward GEMM on the decode kernel (grouped_gemm_decode.cu), chosen at lowering.
ffi::Error RaggedDotDecode(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, I32Buffer sizes,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  GroupedGemmArgs a;
  Dtype dtype;
  if (auto err = row_grouped_args(lhs, rhs, sizes, false, *out, &a, &dtype); !err.success()) return err;
  if (auto err = bind_operands(a, lhs, rhs, sizes, a.rows * a.k, a.groups * a.k * a.n, *workspace); !err.success())
    return err;
  if (!decode_gemm_fits(a)) return invalid("ragged_dot: more than 65535 groups or batch elements for the decode kernel");
  return gemm_error(decode_grouped_gemm(dtype, a, stream));
}

MoeMlpDecodeArgs mlp_decode_args(int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t ffn,
                                 int64_t in_cols, int64_t out_cols, int64_t activation) {
  MoeMlpDecodeArgs a;
  a.tokens = tokens, a.top_k = top_k, a.experts = experts, a.hidden = hidden, a.ffn = ffn;
  a.in_cols = in_cols, a.out_cols = out_cols, a.activation = MlpActivation(activation);
  return a;
}

// The routed experts' MLP of a decode step (moe_mlp_decode.cu), chosen at lowering. With `layer`
// (a device scalar) w_in and w_out are stacks [layers, E, ...] and the kernels read that layer's
// experts: no XLA slice of the stack (whose dynamic offset XLA would copy to the host and wait for).
// With `residual` ([T, H'], x's dtype) the output is residual + the sum (the block's residual add).
ffi::Error mlp_decode(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weights, I32Buffer ids,
                      ffi::AnyBuffer w_in, ffi::AnyBuffer w_out, const I32Buffer* layer,
                      const ffi::AnyBuffer* residual, int64_t activation, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> workspace) {
  auto xd = x.dimensions(), wd = weights.dimensions(), id = ids.dimensions(), ind = w_in.dimensions(),
       outd = w_out.dimensions(), od = out->dimensions();
  const size_t lead = layer != nullptr ? 1 : 0;  // the stack's layer dimension
  if (xd.size() != 2 || wd.size() != 2 || id.size() != 2 || ind.size() != 3 + lead || outd.size() != 3 + lead ||
      od.size() != 2)
    return invalid("moe_mlp decode: expected x [T, H], weights and ids [T, K], w_in [(L,) E, H, C], "
                   "w_out [(L,) E, F, H'], out [T, H']");
  auto dtype = gemm_dtype(x.element_type());
  if (!dtype || w_in.element_type() != x.element_type() || w_out.element_type() != x.element_type() ||
      out->element_type() != x.element_type())
    return invalid("moe_mlp decode: x, w_in, w_out and out must all be bfloat16 or all float16");
  if (activation < 0 || activation > int64_t(MlpActivation::kRelu)) return invalid("moe_mlp decode: bad activation");
  MoeMlpDecodeArgs a = mlp_decode_args(xd[0], wd[1], ind[lead], xd[1], outd[lead + 1], ind[lead + 2],
                                       outd[lead + 2], activation);
  if (wd[0] != a.tokens || id[0] != a.tokens || id[1] != a.top_k || ind[lead + 1] != a.hidden ||
      outd[lead] != a.experts || od[0] != a.tokens || od[1] != a.out_cols)
    return invalid("moe_mlp decode: operand shapes do not agree");
  if (layer != nullptr) {
    if (layer->element_count() != 1) return invalid("moe_mlp decode: layer must be one int32");
    if (ind[0] != outd[0] || ind[0] < 1) return invalid("moe_mlp decode: w_in and w_out must stack one layer count");
    a.layer = layer->typed_data(), a.layers = ind[0];
  }
  if (residual != nullptr) {
    auto rd = residual->dimensions();
    if (residual->element_type() != x.element_type() || rd.size() != 2 || rd[0] != a.tokens || rd[1] != a.out_cols)
      return invalid("moe_mlp decode: residual must be [T, H'] of x's dtype");
    a.residual = residual->untyped_data();
  }
  if (!moe_mlp_decode_fits(a)) return invalid("moe_mlp decode: shapes outside the kernel's range");
  a.x = x.untyped_data(), a.weights = weights.typed_data(), a.ids = ids.typed_data();
  a.w_in = w_in.untyped_data(), a.w_out = w_out.untyped_data(), a.out = out->untyped_data();
  a.workspace = workspace->untyped_data(), a.workspace_bytes = int64_t(workspace->size_bytes());
  if (a.workspace_bytes < moe_mlp_decode_workspace_bytes(a)) return invalid("moe_mlp decode: workspace too small");
  return gemm_error(moe_mlp_decode(*dtype, a, stream));
}

// The operands every decode MLP handler starts with: x [T, H], weights [T, K], ids [T, K],
// w_in [(L,) E, H, C], w_out [(L,) E, F, H'].
auto mlp_decode_operands() {
  return ffi::Ffi::Bind()
      .Ctx<Stream>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<I32Buffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>();
}

// And how each ends, after its own operands: the activation, out [T, H'] and the workspace.
template <class Binding>
auto mlp_decode_results(Binding operands) {
  return std::move(operands)
      .template Attr<int64_t>("activation")
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

ffi::Error MoeMlpDecode(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weights, I32Buffer ids,
                        ffi::AnyBuffer w_in, ffi::AnyBuffer w_out, int64_t activation, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> workspace) {
  return mlp_decode(stream, x, weights, ids, w_in, w_out, nullptr, nullptr, activation, out, workspace);
}

ffi::Error MoeMlpDecodeResidual(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weights, I32Buffer ids,
                                ffi::AnyBuffer w_in, ffi::AnyBuffer w_out, ffi::AnyBuffer residual, int64_t activation,
                                ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  return mlp_decode(stream, x, weights, ids, w_in, w_out, nullptr, &residual, activation, out, workspace);
}

ffi::Error MoeMlpDecodeStacked(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weights, I32Buffer ids,
                               ffi::AnyBuffer w_in, ffi::AnyBuffer w_out, I32Buffer layer, int64_t activation,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  return mlp_decode(stream, x, weights, ids, w_in, w_out, &layer, nullptr, activation, out, workspace);
}

ffi::Error MoeMlpDecodeStackedResidual(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weights,
                                       I32Buffer ids, ffi::AnyBuffer w_in, ffi::AnyBuffer w_out, I32Buffer layer,
                                       ffi::AnyBuffer residual, int64_t activation, ffi::Result<ffi::AnyBuffer> out,
                                       ffi::Result<ffi::AnyBuffer> workspace) {
  return mlp_decode(stream, x, weights, ids, w_in, w_out, &layer, &residual, activation, out, workspace);
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

int64_t ragged_dot_decode_workspace_bytes(int64_t batch, int64_t groups, int64_t rows, int64_t k, int64_t n) {
  GroupedGemmArgs a;
  a.batch = batch;
  a.groups = groups;
  a.rows = rows;
  a.k = k;
  a.n = n;
  return decode_workspace_bytes(a);
}

int64_t moe_mlp_decode_workspace_bytes(int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t ffn,
                                       int64_t in_cols, int64_t out_cols, int64_t activation) {
  return moe_mlp_decode_workspace_bytes(mlp_decode_args(tokens, top_k, experts, hidden, ffn, in_cols, out_cols,
                                                        activation));
}

}  // namespace moe::gemm

// Graph-safe: the setup kernel writes CUTLASS's per-group arguments into the workspace on the
// device; initialize() derives the kernel parameters from the call's buffers and shapes only (no
// host copy, no allocation, no synchronization), so a captured call updated on new buffers runs
// right (tests/test_gpu.py's replay tests; benchmarks/micro/graph_update_cutlass.cu).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRaggedDotCuda, moe::gemm::RaggedDot,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<moe::gemm::I32Buffer>()
                                  .Attr<int64_t>("rhs_transposed")
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
// As RaggedDot, on a stacked rhs and its layer.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRaggedDotStackedCuda, moe::gemm::RaggedDotStacked,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()    // lhs [1, M, K]
                                  .Arg<xla::ffi::AnyBuffer>()    // rhs [L, G, K, N]
                                  .Arg<moe::gemm::I32Buffer>()   // group_sizes [1, G]
                                  .Arg<moe::gemm::I32Buffer>()   // layer []
                                  .Ret<xla::ffi::AnyBuffer>()    // out [1, M, N]
                                  .Ret<xla::ffi::AnyBuffer>(),   // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRaggedDotWeightGradCuda, moe::gemm::RaggedDotWeightGrad,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<moe::gemm::I32Buffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
// Graph-safe: two kernels whose grids and parameters depend on the call's shapes and buffers only
// (the groups are found on the device), no host copy, no allocation, no synchronization.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRaggedDotDecodeCuda, moe::gemm::RaggedDotDecode,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<moe::gemm::I32Buffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
// Graph-safe: two kernels whose grids depend on the shapes only, counters zeroed on the device;
// then the same on stacked weights (the layer read on the device), and both with the block's
// residual added to the output.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeMlpDecodeCuda, moe::gemm::MoeMlpDecode,
                              moe::gemm::mlp_decode_results(moe::gemm::mlp_decode_operands()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeMlpDecodeStackedCuda, moe::gemm::MoeMlpDecodeStacked,
                              moe::gemm::mlp_decode_results(
                                  moe::gemm::mlp_decode_operands().Arg<moe::gemm::I32Buffer>()),  // layer []
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeMlpDecodeResidualCuda, moe::gemm::MoeMlpDecodeResidual,
                              moe::gemm::mlp_decode_results(
                                  moe::gemm::mlp_decode_operands().Arg<xla::ffi::AnyBuffer>()),  // residual
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeMlpDecodeStackedResidualCuda, moe::gemm::MoeMlpDecodeStackedResidual,
                              moe::gemm::mlp_decode_results(moe::gemm::mlp_decode_operands()
                                                                .Arg<moe::gemm::I32Buffer>()     // layer []
                                                                .Arg<xla::ffi::AnyBuffer>()),  // residual
                              {xla::ffi::Traits::kCmdBufferCompatible});
