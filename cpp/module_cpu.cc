// nanobind module `_cpu`: the CPU FFI targets and their workspace sizes.
#include <nanobind/nanobind.h>

#include <cstdint>

#include "cpu_kernels.h"
#include "ffi_capsule.h"
#include "ffi_handlers.h"

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["permute"] = moe::capsule(MoePermuteCpu);
    d["unpermute"] = moe::capsule(MoeUnpermuteCpu);
    d["scatter"] = moe::capsule(MoeScatterCpu);
    d["weight_grad"] = moe::capsule(MoeWeightGradCpu);
    d["router"] = moe::capsule(MoeRouterCpu);
    return d;
  });
  m.def("permute_workspace_bytes", [](int64_t batch, int64_t entries, int64_t num_local) {
    return moe::cpu::permute_workspace_bytes(num_local);
  });
  m.def("scatter_workspace_bytes", [](int64_t batch, int64_t entries, int64_t rows) {
    return moe::cpu::scatter_workspace_bytes(entries, rows);
  });
}
