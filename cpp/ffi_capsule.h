// A handler as the PyCapsule that jax.ffi.register_ffi_target takes; shared by the nanobind
// modules (module_cpu.cc, module_cuda.cc).
#pragma once

#include <nanobind/nanobind.h>

#include <type_traits>

#include "xla/ffi/api/c_api.h"

namespace moe {

// Only a function of the XLA FFI handler signature compiles: a capsule of anything else would
// crash XLA at the first call.
template <typename Fn>
nanobind::capsule capsule(Fn* fn) {
  static_assert(std::is_same_v<Fn, XLA_FFI_Error*(XLA_FFI_CallFrame*)>,
                "capsule() takes an XLA FFI handler: XLA_FFI_Error*(XLA_FFI_CallFrame*)");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace moe
