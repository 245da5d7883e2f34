// CPU implementations of the four operations (see kernel_args.h for their contracts).
#pragma once

#include <cstdint>

#include "kernel_args.h"

namespace moe::cpu {

// Workspace bytes each operation needs (the FFI handler receives it as an extra result).
int64_t permute_workspace_bytes(int64_t num_local);
int64_t scatter_workspace_bytes(int64_t entries, int64_t rows);

void permute(const PermuteArgs& a);
void unpermute(const UnpermuteArgs& a);
void scatter(const ScatterArgs& a);
void weight_grad(const WeightGradArgs& a);

}  // namespace moe::cpu
