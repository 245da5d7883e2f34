// nanobind module `_cpu`: the CPU FFI targets and their workspace sizes.
#include <nanobind/nanobind.h>

#include "cpu_kernels.h"
#include "ffi_handlers.h"

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["permute"] = capsule(MoePermuteCpu);
    d["unpermute"] = capsule(MoeUnpermuteCpu);
    d["scatter"] = capsule(MoeScatterCpu);
    d["weight_grad"] = capsule(MoeWeightGradCpu);
    return d;
  });
  m.def("permute_workspace_bytes", [](int64_t batch, int64_t entries, int64_t num_local) {
    return moe::cpu::permute_workspace_bytes(num_local);
  });
  m.def("scatter_workspace_bytes", [](int64_t batch, int64_t entries, int64_t rows) {
    return moe::cpu::scatter_workspace_bytes(entries, rows);
  });
}
