// XLA FFI handler of the grouped weight gradient on our own kernel (grouped_wgrad.cu): check the
// buffers, fill GroupedWgradArgs, launch on XLA's stream.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi_gemm_common.h"
#include "ffi_grouped_gemm.h"
#include "grouped_wgrad.h"
#include "xla/ffi/api/ffi.h"

namespace moe::gemm {
namespace {

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_moe_permute: ragged_dot weight grad (sm90): " + what);
}

// out [1, G, K, N]: out[0, g] = lhs[0, rows of g]ᵀ · rhs[0, rows of g].
ffi::Error GroupedWgrad(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, I32Buffer sizes,
                        ffi::Result<ffi::AnyBuffer> out) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), sd = sizes.dimensions(), od = out->dimensions();
  if (ld.size() != 3 || rd.size() != 3 || sd.size() != 2 || od.size() != 4)
    return invalid("expected lhs [1, M, K], rhs [1, M, N], group_sizes [1, G], out [1, G, K, N]");
  const auto dtype = gemm_dtype(lhs.element_type());
  if (!dtype || rhs.element_type() != lhs.element_type() || out->element_type() != lhs.element_type())
    return invalid("lhs, rhs and out must all be bfloat16 or all float16");
  GroupedWgradArgs a;
  a.rows = ld[1], a.k = ld[2], a.n = rd[2], a.groups = sd[1];
  if (ld[0] != 1 || rd[0] != 1 || sd[0] != 1 || od[0] != 1) return invalid("the batch extent must be 1");
  if (rd[1] != a.rows || od[1] != a.groups || od[2] != a.k || od[3] != a.n)
    return invalid("operand shapes do not agree");
  if (!grouped_wgrad_fits(a.rows, a.k, a.n, a.groups))
    return invalid("shapes outside the kernel's range (K, N multiples of 64, 1 <= G <= 1024; see grouped_wgrad_fits)");
  a.lhs = lhs.untyped_data(), a.rhs = rhs.untyped_data(), a.group_sizes = sizes.typed_data();
  a.out = out->untyped_data();
  return cuda_status(grouped_wgrad(*dtype, a, stream), "ragged_dot weight grad (sm90)");
}

// out [G, K, N]: out[g] = lhs[rows of g]ᵀ · rhs[rows of g] with one operand's rows read through
// row_token from a [T, .] array (gather_rhs: rhs, else lhs), rows whose token is outside [0, T)
// contributing nothing.
ffi::Error GroupedWgradGathered(cudaStream_t stream, ffi::AnyBuffer lhs, I32Buffer row_token, ffi::AnyBuffer rhs,
                                I32Buffer sizes, ffi::Result<ffi::AnyBuffer> out, int64_t gather_rhs) {
  auto ld = lhs.dimensions(), td = row_token.dimensions(), rd = rhs.dimensions(), sd = sizes.dimensions();
  auto od = out->dimensions();
  if (ld.size() != 2 || td.size() != 1 || rd.size() != 2 || sd.size() != 1 || od.size() != 3)
    return invalid("expected lhs [T or M, K], row_token [M], rhs [M or T, N], group_sizes [G], out [G, K, N]");
  const auto dtype = gemm_dtype(lhs.element_type());
  if (!dtype || rhs.element_type() != lhs.element_type() || out->element_type() != lhs.element_type())
    return invalid("lhs, rhs and out must all be bfloat16 or all float16");
  GroupedWgradArgs a;
  a.rows = td[0], a.k = ld[1], a.n = rd[1], a.groups = sd[0];
  a.gather_rhs = gather_rhs != 0, a.gather_src_rows = a.gather_rhs ? rd[0] : ld[0];
  if ((a.gather_rhs ? ld[0] : rd[0]) != a.rows || od[0] != a.groups || od[1] != a.k || od[2] != a.n)
    return invalid("operand shapes do not agree");
  if (!grouped_wgrad_fits(a.rows, a.k, a.n, a.groups) || a.gather_src_rows >= (int64_t(1) << 31))
    return invalid("shapes outside the kernel's range (K, N multiples of 64, 1 <= G <= 1024, T < 2^31)");
  a.lhs = lhs.untyped_data(), a.gather_index = row_token.typed_data(), a.rhs = rhs.untyped_data();
  a.group_sizes = sizes.typed_data(), a.out = out->untyped_data();
  return cuda_status(grouped_wgrad(*dtype, a, stream), "gathered weight grad (sm90)");
}

}  // namespace
}  // namespace moe::gemm

// Graph-safe: one kernel whose grid and parameters depend on the shapes and buffer addresses only;
// the groups are read on the device; no host copy, allocation or synchronization.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedWgradCuda, moe::gemm::GroupedWgrad,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs [1, M, K]
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs [1, M, N]
                                  .Arg<moe::gemm::I32Buffer>()  // group_sizes [1, G]
                                  .Ret<xla::ffi::AnyBuffer>(),  // out [1, G, K, N]
                              {xla::ffi::Traits::kCmdBufferCompatible});

// Graph-safe as above.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedWgradGatheredCuda, moe::gemm::GroupedWgradGathered,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<moe::gemm::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs [T or M, K]
                                  .Arg<moe::gemm::I32Buffer>()  // row_token [M]
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs [M or T, N]
                                  .Arg<moe::gemm::I32Buffer>()  // group_sizes [G]
                                  .Ret<xla::ffi::AnyBuffer>()   // out [G, K, N]
                                  .Attr<int64_t>("gather_rhs"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
