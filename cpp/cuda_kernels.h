// CUDA implementations of the operations (see kernel_args.h for their contracts), one unit per
// operation: permute.cu (which picks permute_small.cu, permute_tiled.cu or permute_sorted.cu),
// unpermute.cu, scatter.cu, weight_grad.cu, unpermute_bwd.cu and router.cu. Every launcher enqueues on
// `stream`, never synchronises, and returns the first CUDA error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_args.h"

namespace moe::cuda {

// Workspace bytes each operation needs (the FFI handler receives it as an extra result).
// Both ask CUB for its sort's temporary storage, so they need a visible CUDA device.
cudaError_t permute_workspace_bytes(int64_t batch, int64_t entries, int64_t num_local, int64_t* bytes);
cudaError_t scatter_workspace_bytes(int64_t batch, int64_t entries, int64_t rows, int64_t* bytes);

cudaError_t permute(const PermuteArgs& a, cudaStream_t stream);
cudaError_t unpermute(const UnpermuteArgs& a, cudaStream_t stream);
cudaError_t scatter(const ScatterArgs& a, cudaStream_t stream);
cudaError_t weight_grad(const WeightGradArgs& a, cudaStream_t stream);

// unpermute's two cotangents from one read of each cotangent row. Workspace: a row-owner map.
int64_t unpermute_bwd_workspace_bytes(int64_t batch, int64_t rows);
cudaError_t unpermute_bwd(const UnpermuteBwdArgs& a, cudaStream_t stream);

// route's choice and gates in one launch, a warp per token.
cudaError_t router(const RouterArgs& a, cudaStream_t stream);

// The router's product and route in one launch for a few tokens (sm_90: a thread-block cluster
// splits H and adds its partial logits in distributed shared memory). router_hidden_fits says
// whether the kernel takes these sizes.
bool router_hidden_fits(int64_t tokens, int64_t hidden, int64_t experts, int64_t num_groups);
cudaError_t router_hidden(const RouterHiddenArgs& a, cudaStream_t stream);

}  // namespace moe::cuda
