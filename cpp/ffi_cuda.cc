// XLA FFI handlers for the CUDA platform: decode, launch on XLA's stream, report errors.
#include <cuda_runtime.h>

#include <string>

#include "cuda_kernels.h"
#include "ffi_decode.h"
#include "ffi_handlers.h"

namespace moe {
namespace {

using Stream = ffi::PlatformStream<cudaStream_t>;

ffi::Error cuda_error(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_moe_permute: ") + op + ": " + cudaGetErrorString(err));
}

ffi::Error PermuteCuda(cudaStream_t stream, ffi::AnyBuffer hidden, I32Buffer ids, I32Buffer expert_map,
                       int64_t num_experts, int64_t num_local, int64_t align, int64_t has_map,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<I32Buffer> group_sizes,
                       ffi::Result<I32Buffer> row_map, ffi::Result<ffi::AnyBuffer> workspace) {
  PermuteArgs a;
  if (auto err = decode_permute(hidden, ids, expert_map, num_experts, num_local, align, has_map, *out,
                                *group_sizes, *row_map, *workspace, &a);
      !err.success())
    return err;
  int64_t needed = 0;
  if (auto err = cuda_error(cuda::permute_workspace_bytes(a.batch, a.tokens * a.topk, num_local, &needed),
                            "permute workspace");
      !err.success())
    return err;
  if (a.workspace_bytes < needed) return invalid("permute: workspace too small");
  return cuda_error(cuda::permute(a, stream), "permute");
}

ffi::Error UnpermuteCuda(cudaStream_t stream, ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights,
                         int64_t has_weights, ffi::Result<ffi::AnyBuffer> out) {
  UnpermuteArgs a;
  if (auto err = decode_unpermute(x, row_map, weights, has_weights, *out, &a); !err.success()) return err;
  return cuda_error(cuda::unpermute(a, stream), "unpermute");
}

ffi::Error UnpermuteAddCuda(cudaStream_t stream, ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights,
                            ffi::AnyBuffer residual, int64_t has_weights, ffi::Result<ffi::AnyBuffer> out) {
  UnpermuteArgs a;
  if (auto err = decode_unpermute_add(x, row_map, weights, residual, has_weights, *out, &a); !err.success()) return err;
  return cuda_error(cuda::unpermute(a, stream), "unpermute_add");
}

ffi::Error ScatterCuda(cudaStream_t stream, ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights,
                       int64_t has_weights, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> workspace) {
  ScatterArgs a;
  if (auto err = decode_scatter(x, row_map, weights, has_weights, *out, *workspace, &a); !err.success())
    return err;
  int64_t needed = 0;
  if (auto err = cuda_error(cuda::scatter_workspace_bytes(a.batch, a.tokens * a.topk, a.rows, &needed),
                            "scatter workspace");
      !err.success())
    return err;
  if (a.workspace_bytes < needed) return invalid("scatter: workspace too small");
  return cuda_error(cuda::scatter(a, stream), "scatter");
}

ffi::Error WeightGradCuda(cudaStream_t stream, ffi::AnyBuffer ct, ffi::AnyBuffer x, I32Buffer row_map,
                          ffi::Result<ffi::AnyBuffer> out) {
  WeightGradArgs a;
  if (auto err = decode_weight_grad(ct, x, row_map, *out, &a); !err.success()) return err;
  return cuda_error(cuda::weight_grad(a, stream), "weight_grad");
}

ffi::Error UnpermuteBwdCuda(cudaStream_t stream, ffi::AnyBuffer ct, ffi::AnyBuffer x, I32Buffer row_map,
                            ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> out_x,
                            ffi::Result<ffi::AnyBuffer> out_w, ffi::Result<ffi::AnyBuffer> workspace) {
  UnpermuteBwdArgs a;
  if (auto err = decode_unpermute_bwd(ct, x, row_map, weights, *out_x, *out_w, *workspace, &a); !err.success())
    return err;
  if (a.workspace_bytes < cuda::unpermute_bwd_workspace_bytes(a.batch, a.rows))
    return invalid("unpermute_bwd: workspace too small");
  return cuda_error(cuda::unpermute_bwd(a, stream), "unpermute_bwd");
}

ffi::Error RouterCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> bias, int64_t top_k,
                      int64_t scoring, int64_t renormalize, int64_t num_groups, int64_t topk_groups, int64_t has_bias,
                      float scale, ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<I32Buffer> ids) {
  RouterArgs a;
  if (auto err = decode_router(logits, bias, top_k, scoring, renormalize, num_groups, topk_groups, has_bias, scale,
                               *weights, *ids, &a);
      !err.success())
    return err;
  return cuda_error(cuda::router(a, stream), "router");
}

// The router's product and the choice; with `layer` (a device scalar) weight is a stack
// [L, H, E] and bias [L, E], that layer read on the device: no XLA slice of the stack (whose
// dynamic offset XLA would copy to the host and wait for).
ffi::Error router_hidden(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> bias,
                         const I32Buffer* layer, int64_t top_k, int64_t scoring, int64_t renormalize,
                         int64_t num_groups, int64_t topk_groups, int64_t has_bias, float scale,
                         ffi::Result<ffi::AnyBuffer> logits, ffi::Result<ffi::Buffer<ffi::F32>> weights,
                         ffi::Result<I32Buffer> ids) {
  RouterHiddenArgs a;
  // A stacked bias is checked below, not as route's [1 or T, E].
  const int64_t routed_bias = layer == nullptr ? has_bias : 0;
  if (auto err = decode_router(*logits, bias, top_k, scoring, renormalize, num_groups, topk_groups, routed_bias,
                               scale, *weights, *ids, &a.route);
      !err.success())
    return err;
  const auto dtype = float_dtype(x.element_type());
  const size_t lead = layer != nullptr ? 1 : 0;
  auto wd = weight.dimensions();
  if (x.dimensions().size() != 2 || wd.size() != 2 + lead || logits->element_type() != ffi::F32)
    return invalid("router_hidden expects x [T,H], weight [(L,) H,E] and float32 logits [T,E]");
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1], E = a.route.experts;
  if (T != a.route.tokens || wd[lead] != H || wd[lead + 1] != E)
    return invalid("router_hidden: x, weight and logits are not [T,H], [(L,) H,E] and [T,E]");
  if (!dtype || (*dtype != Dtype::kBF16 && *dtype != Dtype::kF16) || weight.element_type() != x.element_type())
    return invalid("router_hidden: x and weight must both be bfloat16 or float16");
  if (!cuda::router_hidden_fits(T, H, E, num_groups))
    return invalid("router_hidden: the kernel does not take these sizes (E a multiple of 8 in [8, 256])");
  if (layer != nullptr) {
    if (layer->element_count() != 1 || wd[0] < 1) return invalid("router_hidden: layer must be one int32");
    if (has_bias) {
      auto bd = bias.dimensions();
      if (bd.size() != 2 || bd[0] != wd[0] || bd[1] != E) return invalid("router_hidden: a stacked bias is not [L, E]");
      a.route.bias = bias.typed_data(), a.route.bias_rstride = 0;
    }
    a.layer = layer->typed_data(), a.layers = wd[0];
  }
  a.x = x.untyped_data();
  a.weight = weight.untyped_data();
  a.dtype = *dtype;
  a.hidden = H;
  a.logits = static_cast<float*>(logits->untyped_data());
  return cuda_error(cuda::router_hidden(a, stream), "router_hidden");
}

ffi::Error RouterHiddenCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> bias,
                            int64_t top_k, int64_t scoring, int64_t renormalize, int64_t num_groups,
                            int64_t topk_groups, int64_t has_bias, float scale, ffi::Result<ffi::AnyBuffer> logits,
                            ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<I32Buffer> ids) {
  return router_hidden(stream, x, weight, bias, nullptr, top_k, scoring, renormalize, num_groups, topk_groups,
                       has_bias, scale, logits, weights, ids);
}

ffi::Error RouterHiddenStackedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                                   ffi::Buffer<ffi::F32> bias, I32Buffer layer, int64_t top_k, int64_t scoring,
                                   int64_t renormalize, int64_t num_groups, int64_t topk_groups, int64_t has_bias,
                                   float scale, ffi::Result<ffi::AnyBuffer> logits,
                                   ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<I32Buffer> ids) {
  return router_hidden(stream, x, weight, bias, &layer, top_k, scoring, renormalize, num_groups, topk_groups,
                       has_bias, scale, logits, weights, ids);
}

}  // namespace
}  // namespace moe

// No host synchronisation and no allocation: XLA may capture these in CUDA graphs.
#define MOE_CUDA_BINDING(bind) bind(xla::ffi::Ffi::Bind().Ctx<moe::Stream>())
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermuteCuda, moe::PermuteCuda, MOE_CUDA_BINDING(moe::bind_permute),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteCuda, moe::UnpermuteCuda, MOE_CUDA_BINDING(moe::bind_unpermute),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteAddCuda, moe::UnpermuteAddCuda, MOE_CUDA_BINDING(moe::bind_unpermute_add),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeScatterCuda, moe::ScatterCuda, MOE_CUDA_BINDING(moe::bind_scatter),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeWeightGradCuda, moe::WeightGradCuda, MOE_CUDA_BINDING(moe::bind_weight_grad),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteBwdCuda, moe::UnpermuteBwdCuda, MOE_CUDA_BINDING(moe::bind_unpermute_bwd),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRouterCuda, moe::RouterCuda, MOE_CUDA_BINDING(moe::bind_router),
                              {xla::ffi::Traits::kCmdBufferCompatible});
// The router's attributes and results, shared by the one-router and the stacked handler.
#define MOE_ROUTER_HIDDEN_TAIL(bind)                          \
  bind.Attr<int64_t>("top_k")                                 \
      .Attr<int64_t>("scoring")                               \
      .Attr<int64_t>("renormalize")                           \
      .Attr<int64_t>("num_groups")                            \
      .Attr<int64_t>("topk_groups")                           \
      .Attr<int64_t>("has_bias")                              \
      .Attr<float>("scale")                                   \
      .Ret<xla::ffi::AnyBuffer>()              /* logits */   \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  /* weights */  \
      .Ret<moe::I32Buffer>()                   /* ids */
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRouterHiddenCuda, moe::RouterHiddenCuda,
                              MOE_ROUTER_HIDDEN_TAIL(xla::ffi::Ffi::Bind()
                                                         .Ctx<moe::Stream>()
                                                         .Arg<xla::ffi::AnyBuffer>()               // x
                                                         .Arg<xla::ffi::AnyBuffer>()               // weight
                                                         .Arg<xla::ffi::Buffer<xla::ffi::F32>>()),  // bias
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRouterHiddenStackedCuda, moe::RouterHiddenStackedCuda,
                              MOE_ROUTER_HIDDEN_TAIL(xla::ffi::Ffi::Bind()
                                                         .Ctx<moe::Stream>()
                                                         .Arg<xla::ffi::AnyBuffer>()               // x
                                                         .Arg<xla::ffi::AnyBuffer>()               // weight [L, H, E]
                                                         .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // bias [L, E]
                                                         .Arg<moe::I32Buffer>()),                  // layer
                              {xla::ffi::Traits::kCmdBufferCompatible});
