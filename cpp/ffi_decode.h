// Turns the XLA FFI buffers of each operation into the kernel argument structs, checking
// every shape once; shared by the CPU (ffi_cpu.cc) and CUDA (ffi_cuda.cc) handlers, which
// differ only in the execution context they bind and the kernels they call.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kernel_args.h"
#include "moe_index.h"
#include "xla/ffi/api/ffi.h"

namespace moe {

namespace ffi = xla::ffi;
using I32Buffer = ffi::Buffer<ffi::S32>;

inline std::optional<Dtype> float_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return Dtype::kF32;
    case ffi::DataType::BF16: return Dtype::kBF16;
    case ffi::DataType::F16: return Dtype::kF16;
    case ffi::DataType::F8E4M3FN: return Dtype::kF8E4M3FN;
    case ffi::DataType::F8E5M2: return Dtype::kF8E5M2;
    default: return std::nullopt;
  }
}

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_moe_permute: " + what);
}

// The batch stride of an operand whose leading extent must be 1 or `batch`.
inline std::optional<int64_t> stride_of(ffi::Span<const int64_t> dims, int64_t batch, int64_t per_example) {
  if (dims[0] != 1 && dims[0] != batch) return std::nullopt;
  return dims[0] == 1 ? 0 : per_example;
}

// Fields that several argument structs share, each assigned by name.
template <typename Args>
void set_shape(Args* a, int64_t batch, int64_t tokens, int64_t topk, int64_t hidden_size) {
  a->batch = batch;
  a->tokens = tokens;
  a->topk = topk;
  a->hidden_size = hidden_size;
}

template <typename Args>
void set_x(Args* a, ffi::AnyBuffer x, Dtype dtype, int64_t bstride) {
  a->x = x.untyped_data();
  a->x_dtype = dtype;
  a->x_bstride = bstride;
}

template <typename Args>
void set_row_map(Args* a, I32Buffer row_map, int64_t bstride) {
  a->row_map = row_map.typed_data();
  a->rm_bstride = bstride;
}

template <typename Args>
void set_weights(Args* a, const void* weights, Dtype dtype, int64_t bstride) {
  a->weights = weights;
  a->w_dtype = dtype;
  a->w_bstride = bstride;
}

template <typename Args>
void set_workspace(Args* a, ffi::AnyBuffer workspace) {
  a->workspace = workspace.untyped_data();
  a->workspace_bytes = static_cast<int64_t>(workspace.size_bytes());
}

#define MOE_STRIDE(var, buf, per_example)                               \
  int64_t var;                                                          \
  {                                                                     \
    auto s = stride_of((buf).dimensions(), batch, (per_example));       \
    if (!s) return invalid(#buf " batch extent is neither 1 nor the batch"); \
    var = *s;                                                           \
  }

inline ffi::Error decode_permute(ffi::AnyBuffer hidden, I32Buffer ids, I32Buffer expert_map,
                                 int64_t num_experts, int64_t num_local, int64_t align, int64_t has_map,
                                 ffi::AnyBuffer out, I32Buffer group_sizes, I32Buffer row_map,
                                 ffi::AnyBuffer workspace, PermuteArgs* a) {
  if (hidden.dimensions().size() != 3 || ids.dimensions().size() != 3 ||
      expert_map.dimensions().size() != 2 || out.dimensions().size() != 3)
    return invalid("permute expects hidden [B,T,H], topk_ids [B,T,K], expert_map [B,E]");
  const int64_t batch = out.dimensions()[0], T = ids.dimensions()[1], K = ids.dimensions()[2];
  const int64_t H = hidden.dimensions()[2];
  if (!float_dtype(hidden.element_type()) || out.element_type() != hidden.element_type())
    return invalid("permute: unsupported hidden dtype");
  if (hidden.dimensions()[1] != T) return invalid("permute: hidden and topk_ids disagree on T");
  if (has_map && expert_map.dimensions()[1] != num_experts) return invalid("permute: expert_map is not [E]");
  if (num_experts < 1 || num_local < 1 || align < 1) return invalid("permute: bad static parameters");
  if (out.dimensions()[1] != permuted_rows(T * K, num_local, align) || out.dimensions()[2] != H)
    return invalid("permute: output shape does not match the row-count formula");
  MOE_STRIDE(hidden_stride, hidden, T * H);
  MOE_STRIDE(ids_stride, ids, T * K);
  MOE_STRIDE(map_stride, expert_map, num_experts);
  *a = PermuteArgs{};
  a->hidden = hidden.untyped_data();
  a->hidden_bstride = hidden_stride;
  a->ids = ids.typed_data();
  a->ids_bstride = ids_stride;
  a->expert_map = has_map ? expert_map.typed_data() : nullptr;
  a->map_bstride = map_stride;
  set_shape(a, batch, T, K, H);
  a->elem_bytes = static_cast<int64_t>(ffi::ByteWidth(hidden.element_type()));
  a->num_experts = num_experts;
  a->num_local = static_cast<int32_t>(num_local);
  a->align = align;
  a->rows = out.dimensions()[1];
  a->out = out.untyped_data();
  a->group_sizes = group_sizes.typed_data();
  a->row_map = row_map.typed_data();
  set_workspace(a, workspace);
  return ffi::Error::Success();
}

// Unpermute and scatter are each other's transpose: x [B, ., H] -> out [B, ., H] through
// row_map [B, T, K] and weights [B, T, K], with the R permuted rows on the input side
// (unpermute) or on the output side (scatter). The fields and checks they share.
template <typename Args>
ffi::Error decode_weighted_rows(const char* op, ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights,
                                int64_t has_weights, ffi::AnyBuffer out, bool rows_in, Args* a) {
  const std::string name(op);
  if (x.dimensions().size() != 3 || row_map.dimensions().size() != 3 ||
      weights.dimensions().size() != 3 || out.dimensions().size() != 3)
    return invalid(name + (rows_in ? " expects expert_out [B,R,H]" : " expects x [B,T,H]") +
                   ", row_map [B,T,K], weights [B,T,K]");
  const int64_t batch = out.dimensions()[0], T = row_map.dimensions()[1], K = row_map.dimensions()[2];
  const int64_t H = x.dimensions()[2];
  const int64_t R = rows_in ? x.dimensions()[1] : out.dimensions()[1];
  auto xd = float_dtype(x.element_type()), wd = float_dtype(weights.element_type()),
       od = float_dtype(out.element_type());
  if (!xd || !wd || !od) return invalid(name + ": unsupported dtype");
  const int64_t token_side = rows_in ? out.dimensions()[1] : x.dimensions()[1];
  if (token_side != T || out.dimensions()[2] != H) return invalid(name + ": bad shapes");
  MOE_STRIDE(x_stride, x, (rows_in ? R : T) * H);
  MOE_STRIDE(rm_stride, row_map, T * K);
  MOE_STRIDE(w_stride, weights, T * K);
  *a = Args{};
  set_x(a, x, *xd, x_stride);
  a->rows = R;
  set_row_map(a, row_map, rm_stride);
  set_weights(a, has_weights ? weights.untyped_data() : nullptr, *wd, w_stride);
  set_shape(a, batch, T, K, H);
  a->out = out.untyped_data();
  a->out_dtype = *od;
  return ffi::Error::Success();
}

inline ffi::Error decode_unpermute(ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights,
                                   int64_t has_weights, ffi::AnyBuffer out, UnpermuteArgs* a) {
  return decode_weighted_rows("unpermute", x, row_map, weights, has_weights, out, /*rows_in=*/true, a);
}

// unpermute plus a residual [B or 1, T, H] of out's dtype (UnpermuteArgs::residual).
inline ffi::Error decode_unpermute_add(ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights,
                                       ffi::AnyBuffer residual, int64_t has_weights, ffi::AnyBuffer out,
                                       UnpermuteArgs* a) {
  if (auto err = decode_unpermute(x, row_map, weights, has_weights, out, a); !err.success()) return err;
  const int64_t batch = a->batch, T = a->tokens, H = a->hidden_size;
  if (residual.dimensions().size() != 3 || residual.dimensions()[1] != T || residual.dimensions()[2] != H ||
      residual.element_type() != out.element_type())
    return invalid("unpermute_add: residual must be [B, T, H] of the output's dtype");
  MOE_STRIDE(res_stride, residual, T * H);
  a->residual = residual.untyped_data();
  a->res_bstride = res_stride;
  return ffi::Error::Success();
}

inline ffi::Error decode_scatter(ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights,
                                 int64_t has_weights, ffi::AnyBuffer out, ffi::AnyBuffer workspace,
                                 ScatterArgs* a) {
  if (auto err = decode_weighted_rows("scatter", x, row_map, weights, has_weights, out, /*rows_in=*/false, a);
      !err.success())
    return err;
  set_workspace(a, workspace);
  return ffi::Error::Success();
}

// The backward ops' common arguments: ct [B,T,H] (the layer output's cotangent), x [B,R,H] (the
// expert outputs) and row_map [B,T,K]; `name` heads the error messages.
template <typename Args>
ffi::Error decode_ct_and_rows(const std::string& name, ffi::AnyBuffer ct, ffi::AnyBuffer x, I32Buffer row_map,
                              int64_t batch, Args* a) {
  const int64_t T = row_map.dimensions()[1], K = row_map.dimensions()[2];
  const int64_t R = x.dimensions()[1], H = x.dimensions()[2];
  auto cd = float_dtype(ct.element_type()), xd = float_dtype(x.element_type());
  if (!cd || !xd) return invalid(name + ": unsupported dtype");
  if (ct.dimensions()[1] != T || ct.dimensions()[2] != H) return invalid(name + ": bad shapes");
  MOE_STRIDE(ct_stride, ct, T * H);
  MOE_STRIDE(x_stride, x, R * H);
  MOE_STRIDE(rm_stride, row_map, T * K);
  a->ct = ct.untyped_data();
  a->ct_dtype = *cd;
  a->ct_bstride = ct_stride;
  set_x(a, x, *xd, x_stride);
  a->rows = R;
  set_row_map(a, row_map, rm_stride);
  set_shape(a, batch, T, K, H);
  return ffi::Error::Success();
}

inline ffi::Error decode_weight_grad(ffi::AnyBuffer ct, ffi::AnyBuffer x, I32Buffer row_map,
                                     ffi::AnyBuffer out, WeightGradArgs* a) {
  if (ct.dimensions().size() != 3 || x.dimensions().size() != 3 ||
      row_map.dimensions().size() != 3 || out.dimensions().size() != 3)
    return invalid("weight_grad expects ct [B,T,H], expert_out [B,R,H], row_map [B,T,K]");
  auto od = float_dtype(out.element_type());
  if (!od) return invalid("weight_grad: unsupported dtype");
  *a = WeightGradArgs{};
  if (auto e = decode_ct_and_rows("weight_grad", ct, x, row_map, out.dimensions()[0], a); e.failure()) return e;
  a->out = out.untyped_data();
  a->out_dtype = *od;
  return ffi::Error::Success();
}

inline ffi::Error decode_unpermute_bwd(ffi::AnyBuffer ct, ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights,
                                       ffi::AnyBuffer out_x, ffi::AnyBuffer out_w, ffi::AnyBuffer workspace,
                                       UnpermuteBwdArgs* a) {
  if (ct.dimensions().size() != 3 || x.dimensions().size() != 3 || row_map.dimensions().size() != 3 ||
      weights.dimensions().size() != 3 || out_x.dimensions().size() != 3 || out_w.dimensions().size() != 3)
    return invalid("unpermute_bwd expects ct [B,T,H], expert_out [B,R,H], row_map and weights [B,T,K]");
  const int64_t batch = out_x.dimensions()[0], T = row_map.dimensions()[1], K = row_map.dimensions()[2];
  auto wd = float_dtype(weights.element_type()), oxd = float_dtype(out_x.element_type()),
       owd = float_dtype(out_w.element_type());
  if (!wd || !oxd || !owd) return invalid("unpermute_bwd: unsupported dtype");
  if (out_x.dimensions()[1] != x.dimensions()[1] || out_x.dimensions()[2] != x.dimensions()[2] ||
      out_w.dimensions()[0] != batch || out_w.dimensions()[1] != T || out_w.dimensions()[2] != K)
    return invalid("unpermute_bwd: bad shapes");
  MOE_STRIDE(w_stride, weights, T * K);
  *a = UnpermuteBwdArgs{};
  if (auto e = decode_ct_and_rows("unpermute_bwd", ct, x, row_map, batch, a); e.failure()) return e;
  set_weights(a, weights.untyped_data(), *wd, w_stride);
  a->out_x = out_x.untyped_data();
  a->out_x_dtype = *oxd;
  a->out_w = out_w.untyped_data();
  a->out_w_dtype = *owd;
  set_workspace(a, workspace);
  return ffi::Error::Success();
}

inline ffi::Error decode_router(ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> bias, int64_t top_k, int64_t scoring,
                                int64_t renormalize, int64_t num_groups, int64_t topk_groups, int64_t has_bias,
                                float scale, ffi::Buffer<ffi::F32> weights, I32Buffer ids, RouterArgs* a) {
  if (logits.dimensions().size() != 2 || bias.dimensions().size() != 2 || weights.dimensions().size() != 2 ||
      ids.dimensions().size() != 2)
    return invalid("router expects logits [T,E], bias [1 or T,E], weights and ids [T,K]");
  const int64_t T = logits.dimensions()[0], E = logits.dimensions()[1];
  auto dtype = float_dtype(logits.element_type());
  if (!dtype || *dtype == Dtype::kF8E4M3FN || *dtype == Dtype::kF8E5M2)
    return invalid("router: logits must be float32, bfloat16 or float16");
  if (E < 1 || E > kRouterMaxExperts)
    return invalid("router: the number of experts (" + std::to_string(E) + ") must be in [1, " +
                   std::to_string(kRouterMaxExperts) + "]");
  if (top_k < 1 || top_k > E) return invalid("router: top_k must be in [1, E]");
  if (scoring != static_cast<int64_t>(Scoring::kSoftmax) && scoring != static_cast<int64_t>(Scoring::kSigmoid))
    return invalid("router: unknown scoring");
  if (num_groups != 0 &&
      (num_groups < 1 || E % num_groups != 0 || topk_groups < 1 || topk_groups > num_groups ||
       top_k > topk_groups * (E / num_groups)))
    return invalid("router: num_groups must divide E, 1 <= topk_groups <= num_groups and top_k <= the experts of "
                   "the topk_groups best groups");
  if (has_bias && (bias.dimensions()[1] != E || (bias.dimensions()[0] != 1 && bias.dimensions()[0] != T)))
    return invalid("router: bias is not [1 or T, E]");
  if (weights.dimensions()[0] != T || weights.dimensions()[1] != top_k || ids.dimensions()[0] != T ||
      ids.dimensions()[1] != top_k)
    return invalid("router: weights and ids must be [T, top_k]");
  *a = RouterArgs{};
  a->logits = logits.untyped_data();
  a->logits_dtype = *dtype;
  a->bias = has_bias ? bias.typed_data() : nullptr;
  a->bias_rstride = has_bias && bias.dimensions()[0] != 1 ? E : 0;
  a->tokens = T;
  a->experts = E;
  a->topk = top_k;
  a->scoring = static_cast<Scoring>(scoring);
  a->renormalize = renormalize != 0;
  a->num_groups = num_groups;
  a->topk_groups = topk_groups;
  a->scale = scale;
  a->weights = weights.typed_data();
  a->ids = ids.typed_data();
  return ffi::Error::Success();
}

// The argument lists of the handlers, after any platform context.
template <typename B>
auto bind_permute(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()   // hidden
      .template Arg<I32Buffer>()        // topk_ids
      .template Arg<I32Buffer>()        // expert_map
      .template Attr<int64_t>("num_experts")
      .template Attr<int64_t>("num_local_experts")
      .template Attr<int64_t>("align_size")
      .template Attr<int64_t>("has_map")
      .template Ret<ffi::AnyBuffer>()   // permuted rows
      .template Ret<I32Buffer>()        // group_sizes
      .template Ret<I32Buffer>()        // row_map
      .template Ret<ffi::AnyBuffer>();  // workspace
}

// The operands of the weighted-row ops: rows (expert_out or x), row_map, weights.
template <typename B>
auto bind_weighted_rows(B&& b) {  // by reference: a binding cannot be moved into a parameter
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<I32Buffer>().template Arg<ffi::AnyBuffer>();
}

template <typename B>
auto bind_unpermute(B b) {
  return bind_weighted_rows(std::move(b)).template Attr<int64_t>("has_weights").template Ret<ffi::AnyBuffer>();
}

template <typename B>
auto bind_unpermute_add(B b) {
  return bind_weighted_rows(std::move(b))
      .template Arg<ffi::AnyBuffer>()  // residual
      .template Attr<int64_t>("has_weights")
      .template Ret<ffi::AnyBuffer>();
}

template <typename B>
auto bind_scatter(B b) {
  return bind_weighted_rows(std::move(b))
      .template Attr<int64_t>("has_weights")
      .template Ret<ffi::AnyBuffer>()   // rows
      .template Ret<ffi::AnyBuffer>();  // workspace
}

template <typename B>
auto bind_weight_grad(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // cotangent of the unpermuted output
      .template Arg<ffi::AnyBuffer>()  // expert_out
      .template Arg<I32Buffer>()       // row_map
      .template Ret<ffi::AnyBuffer>();
}

template <typename B>
auto bind_unpermute_bwd(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()   // cotangent of the unpermuted output
      .template Arg<ffi::AnyBuffer>()   // expert_out
      .template Arg<I32Buffer>()        // row_map
      .template Arg<ffi::AnyBuffer>()   // weights
      .template Ret<ffi::AnyBuffer>()   // cotangent of expert_out
      .template Ret<ffi::AnyBuffer>()   // cotangent of the weights
      .template Ret<ffi::AnyBuffer>();  // workspace
}

template <typename B>
auto bind_router(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()           // logits
      .template Arg<ffi::Buffer<ffi::F32>>()    // bias
      .template Attr<int64_t>("top_k")
      .template Attr<int64_t>("scoring")
      .template Attr<int64_t>("renormalize")
      .template Attr<int64_t>("num_groups")
      .template Attr<int64_t>("topk_groups")
      .template Attr<int64_t>("has_bias")
      .template Attr<float>("scale")
      .template Ret<ffi::Buffer<ffi::F32>>()    // weights
      .template Ret<I32Buffer>();               // ids
}

}  // namespace moe
