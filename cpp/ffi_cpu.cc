// XLA FFI handlers for the CPU platform.
#include "cpu_kernels.h"
#include "ffi_decode.h"
#include "ffi_handlers.h"
#include "moe_index.h"

namespace moe {
namespace {

ffi::Error PermuteCpu(ffi::AnyBuffer hidden, I32Buffer ids, I32Buffer expert_map, int64_t num_experts,
                      int64_t num_local, int64_t align, int64_t has_map, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<I32Buffer> group_sizes, ffi::Result<I32Buffer> row_map,
                      ffi::Result<ffi::AnyBuffer> workspace) {
  PermuteArgs a;
  if (auto err = decode_permute(hidden, ids, expert_map, num_experts, num_local, align, has_map, *out,
                                *group_sizes, *row_map, *workspace, &a);
      !err.success())
    return err;
  if (a.workspace_bytes < cpu::permute_workspace_bytes(num_local)) return invalid("permute: workspace too small");
  cpu::permute(a);
  return ffi::Error::Success();
}

ffi::Error UnpermuteCpu(ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights, int64_t has_weights,
                        ffi::Result<ffi::AnyBuffer> out) {
  UnpermuteArgs a;
  if (auto err = decode_unpermute(x, row_map, weights, has_weights, *out, &a); !err.success()) return err;
  cpu::unpermute(a);
  return ffi::Error::Success();
}

ffi::Error ScatterCpu(ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights, int64_t has_weights,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  ScatterArgs a;
  if (auto err = decode_scatter(x, row_map, weights, has_weights, *out, *workspace, &a); !err.success())
    return err;
  if (a.workspace_bytes < cpu::scatter_workspace_bytes(a.tokens * a.topk, a.rows))
    return invalid("scatter: workspace too small");
  cpu::scatter(a);
  return ffi::Error::Success();
}

ffi::Error WeightGradCpu(ffi::AnyBuffer ct, ffi::AnyBuffer x, I32Buffer row_map,
                         ffi::Result<ffi::AnyBuffer> out) {
  WeightGradArgs a;
  if (auto err = decode_weight_grad(ct, x, row_map, *out, &a); !err.success()) return err;
  cpu::weight_grad(a);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermuteCpu, moe::PermuteCpu, moe::bind_permute(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteCpu, moe::UnpermuteCpu, moe::bind_unpermute(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeScatterCpu, moe::ScatterCpu, moe::bind_scatter(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeWeightGradCpu, moe::WeightGradCpu,
                              moe::bind_weight_grad(xla::ffi::Ffi::Bind()));
