// CPU implementations of the operations (see kernel_args.h for their contracts), one unit per
// operation: cpu_permute.cc, cpu_unpermute.cc, cpu_scatter.cc, cpu_weight_grad.cc, cpu_router.cc.
#pragma once

#include <cstdint>
#include <functional>

#include "kernel_args.h"

namespace moe::cpu {

// Workspace bytes each operation needs (the FFI handler receives it as an extra result).
int64_t permute_workspace_bytes(int64_t num_local);
int64_t scatter_workspace_bytes(int64_t entries, int64_t rows);

// Runs body(begin, end) over disjoint pieces of [0, n), each about `grain` items or more,
// possibly on several threads, and returns when all are done.
using RangeFn = std::function<void(int64_t, int64_t)>;
using ParallelFor = std::function<void(int64_t n, int64_t grain, const RangeFn& body)>;

void permute(const PermuteArgs& a);
void unpermute(const UnpermuteArgs& a, const ParallelFor& parallel);
void scatter(const ScatterArgs& a, const ParallelFor& parallel);
void weight_grad(const WeightGradArgs& a, const ParallelFor& parallel);
void router(const RouterArgs& a, const ParallelFor& parallel);

}  // namespace moe::cpu
