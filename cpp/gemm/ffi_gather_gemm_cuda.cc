// XLA FFI handler of gather_gemm (gather_gemm.cu): check the buffers, fill GatherGemmArgs, launch
// on XLA's stream.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "ffi_gemm_common.h"
#include "ffi_grouped_gemm.h"
#include "gather_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace moe::gemm {
namespace {

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_moe_permute: gather_gemm: " + what);
}

// out [M, F] = act(x[row_token] · w[group]); pre [M, N] = x[row_token] · w[group] when save_pre.
ffi::Error GatherGemm(cudaStream_t stream, ffi::AnyBuffer x, I32Buffer row_token, I32Buffer group_sizes,
                      ffi::AnyBuffer w, int64_t activation, int64_t save_pre, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> pre, ffi::Result<ffi::AnyBuffer> scratch) {
  auto xd = x.dimensions(), td = row_token.dimensions(), sd = group_sizes.dimensions(), wd = w.dimensions(),
       od = out->dimensions(), pd = pre->dimensions();
  if (xd.size() != 2) return invalid("x must be [T, H]");
  if (td.size() != 1) return invalid("row_token must be [M]");
  if (sd.size() != 1) return invalid("group_sizes must be [E]");
  if (wd.size() != 3) return invalid("w must be [E, H, N]");
  if (od.size() != 2) return invalid("out must be [M, F]");
  if (activation < 0 || activation > int64_t(MlpActivation::kIdentity))
    return invalid("activation must be 0 (swiglu), 1 (geglu), 2 (gelu), 3 (relu) or 4 (none)");
  if (save_pre != 0 && save_pre != 1) return invalid("save_pre must be 0 or 1");
  auto dtype = gemm_dtype(x.element_type());
  if (!dtype) return invalid("x must be bfloat16 or float16");
  if (w.element_type() != x.element_type()) return invalid("w must have x's dtype");
  if (out->element_type() != x.element_type()) return invalid("out must have x's dtype");

  GatherGemmArgs a;
  a.tokens = xd[0], a.hidden = xd[1], a.rows = td[0], a.experts = wd[0], a.n = wd[2];
  a.activation = MlpActivation(activation);
  a.save_pre = save_pre == 1;
  const int64_t ffn = gather_gemm_gated(a.activation) ? a.n / 2 : a.n;
  if (wd[1] != a.hidden) return invalid("w's second dimension must be x's H");
  if (sd[0] != a.experts) return invalid("group_sizes must have w's E entries");
  if (gather_gemm_gated(a.activation) && a.n % 2 != 0) return invalid("w's N must be 2F (gate | up) for swiglu / geglu");
  if (od[0] != a.rows || od[1] != ffn) return invalid("out must be [M, F] (M rows of row_token, F of w)");
  if (a.save_pre) {
    if (pd.size() != 2 || pd[0] != a.rows || pd[1] != a.n) return invalid("pre must be [M, N] when save_pre");
    if (pre->element_type() != x.element_type()) return invalid("pre must have x's dtype");
  } else if (pre->element_count() != 0) {
    return invalid("pre must be empty (e.g. [0, N]) without save_pre");
  }
  if (scratch->size_bytes() < sizeof(int)) return invalid("scratch must hold one int32");
  if (!gather_gemm_fits(a.tokens, a.hidden, a.experts, a.rows, a.n, activation))
    return invalid("shapes outside the kernel's range (F % 128, H % 8, 1 <= E <= 1024, M < 2^31; see gather_gemm_fits)");

  a.x = x.untyped_data(), a.row_token = row_token.typed_data(), a.group_sizes = group_sizes.typed_data();
  a.w = w.untyped_data(), a.out = out->untyped_data(), a.pre = a.save_pre ? pre->untyped_data() : nullptr;
  a.tile_counter = static_cast<int*>(scratch->untyped_data());
  return cuda_status(gather_gemm(*dtype, a, stream), "gather_gemm");
}

}  // namespace
}  // namespace moe::gemm

// Graph-safe: a memset and one kernel whose grid and parameters (the tensor map of w included)
// depend on the shapes and buffer addresses only; the groups are read on the device; no host
// copy, allocation or synchronization.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGatherGemmCuda, moe::gemm::GatherGemm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x [T, H]
                                  .Arg<moe::gemm::I32Buffer>()  // row_token [M]
                                  .Arg<moe::gemm::I32Buffer>()  // group_sizes [E]
                                  .Arg<xla::ffi::AnyBuffer>()   // w [E, H, N]
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("save_pre")
                                  .Ret<xla::ffi::AnyBuffer>()   // out [M, F]
                                  .Ret<xla::ffi::AnyBuffer>()   // pre [M, N] or [0]
                                  .Ret<xla::ffi::AnyBuffer>(),  // scratch: int32 [1]
                              {xla::ffi::Traits::kCmdBufferCompatible});
