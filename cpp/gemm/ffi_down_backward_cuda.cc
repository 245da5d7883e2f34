// XLA FFI handler of down_backward (down_backward.cu): check the buffers, fill DownBackwardArgs,
// launch on XLA's stream.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "down_backward.h"
#include "ffi_gemm_common.h"
#include "ffi_grouped_gemm.h"
#include "gather_gemm.h"  // gather_gemm_gated
#include "xla/ffi/api/ffi.h"

namespace moe::gemm {
namespace {

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_moe_permute: down_backward: " + what);
}

// From ct [M, H] (gathered: [T, H], read through row_token [M]), gate_up [M, 2F or F], w [M, 1]
// float32 (or any, unweighted), w_out [E, F, H]: d_gate_up (gate_up's shape), d_w [ceil(F / 256), M]
// float32 partial sums, w_h [M, F].
ffi::Error DownBackward(cudaStream_t stream, ffi::AnyBuffer ct, I32Buffer row_token, ffi::AnyBuffer gate_up,
                        ffi::Buffer<ffi::F32> w, ffi::AnyBuffer w_out, I32Buffer group_sizes, int64_t activation,
                        int64_t weighted, int64_t gathered, ffi::Result<ffi::AnyBuffer> d_gate_up,
                        ffi::Result<ffi::Buffer<ffi::F32>> d_w, ffi::Result<ffi::AnyBuffer> w_h) {
  auto cd = ct.dimensions(), td = row_token.dimensions(), gd = gate_up.dimensions(), wd = w.dimensions(),
       od = w_out.dimensions(), sd = group_sizes.dimensions();
  if (cd.size() != 2) return invalid("ct must be [M, H] ([T, H] when gathered)");
  if (gathered != 0 && gathered != 1) return invalid("gathered must be 0 or 1");
  if (gd.size() != 2) return invalid("gate_up must be [M, 2F] or [M, F]");
  if (od.size() != 3) return invalid("w_out must be [E, F, H]");
  if (sd.size() != 1) return invalid("group_sizes must be [E]");
  if (activation < 0 || activation > int64_t(MlpActivation::kRelu))
    return invalid("activation must be 0 (swiglu), 1 (geglu), 2 (gelu) or 3 (relu)");
  if (weighted != 0 && weighted != 1) return invalid("weighted must be 0 or 1");
  auto dtype = gemm_dtype(ct.element_type());
  if (!dtype) return invalid("ct must be bfloat16 or float16");
  for (auto t : {gate_up.element_type(), w_out.element_type(), d_gate_up->element_type(), w_h->element_type()})
    if (t != ct.element_type()) return invalid("gate_up, w_out, d_gate_up and w_h must have ct's dtype");

  DownBackwardArgs a;
  a.rows = gd.size() == 2 ? gd[0] : 0, a.hidden = cd[1], a.experts = od[0], a.ffn = od[1];
  if (gathered ? td.size() != 1 || td[0] != a.rows || cd[0] >= (int64_t(1) << 31) : cd[0] != a.rows)
    return invalid("ct must be [M, H], or [T, H] with row_token [M] when gathered (T < 2^31)");
  a.activation = MlpActivation(activation);
  const int64_t width = gather_gemm_gated(a.activation) ? 2 * a.ffn : a.ffn;
  if (od[2] != a.hidden) return invalid("w_out must be [E, F, H] with ct's H");
  if (sd[0] != a.experts) return invalid("group_sizes must have w_out's E entries");
  if (gd[0] != a.rows || gd[1] != width) return invalid("gate_up must be [M, 2F] (swiglu / geglu) or [M, F]");
  if (weighted && (wd.size() != 2 || wd[0] != a.rows || wd[1] != 1)) return invalid("w must be [M, 1] when weighted");
  auto dgd = d_gate_up->dimensions(), dwd = d_w->dimensions(), whd = w_h->dimensions();
  if (dgd.size() != 2 || dgd[0] != a.rows || dgd[1] != width) return invalid("d_gate_up must have gate_up's shape");
  if (dwd.size() != 2 || dwd[0] != down_backward_col_tiles(a.ffn) || dwd[1] != a.rows)
    return invalid("d_w must be [ceil(F / 256), M]");
  if (whd.size() != 2 || whd[0] != a.rows || whd[1] != a.ffn) return invalid("w_h must be [M, F]");
  if (!down_backward_fits(a.rows, a.hidden, a.experts, a.ffn, activation))
    return invalid("shapes outside the kernel's range (F % 64, H % 8, 1 <= E <= 1024, M < 2^31; see down_backward_fits)");

  if (gathered) a.row_token = row_token.typed_data(), a.tokens = cd[0];
  a.ct = ct.untyped_data(), a.gate_up = gate_up.untyped_data(), a.w = weighted ? w.typed_data() : nullptr;
  a.w_out = w_out.untyped_data(), a.group_sizes = group_sizes.typed_data();
  a.d_gate_up = d_gate_up->untyped_data(), a.d_w = d_w->typed_data(), a.w_h = w_h->untyped_data();
  return cuda_status(down_backward(*dtype, a, stream), "down_backward");
}

}  // namespace
}  // namespace moe::gemm

// Graph-safe: one kernel whose grid and parameters (the tensor maps included) depend on the shapes
// and buffer addresses only; the groups are read on the device; no host copy, allocation or
// synchronization.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeDownBackwardCuda, moe::gemm::DownBackward,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()                 // ct [M, H] or [T, H]
                                  .Arg<moe::gemm::I32Buffer>()                // row_token [M], or [0]
                                  .Arg<xla::ffi::AnyBuffer>()                 // gate_up [M, 2F or F]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()     // w [M, 1] or a placeholder
                                  .Arg<xla::ffi::AnyBuffer>()                 // w_out [E, F, H]
                                  .Arg<moe::gemm::I32Buffer>()                // group_sizes [E]
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("weighted")
                                  .Attr<int64_t>("gathered")
                                  .Ret<xla::ffi::AnyBuffer>()                 // d_gate_up
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()     // d_w [ceil(F / 256), M]
                                  .Ret<xla::ffi::AnyBuffer>(),                // w_h [M, F]
                              {xla::ffi::Traits::kCmdBufferCompatible});
