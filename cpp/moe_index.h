// Index math shared by the CPU and CUDA kernels: which local expert an entry goes to,
// how many rows the permuted buffer has, and how a batch-broadcast operand is strided.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MOE_HD __host__ __device__ __forceinline__
#else
#define MOE_HD inline
#endif

namespace moe {

// The local expert of routing entry `id`, or `num_local` when the entry is dropped
// (id outside [0, E), or mapped to -1 / outside [0, L)).
MOE_HD int32_t local_expert(int32_t id, const int32_t* expert_map, int64_t num_experts,
                            int32_t num_local) {
  if (id < 0 || id >= num_experts) return num_local;
  const int32_t local = expert_map ? expert_map[id] : id;
  return (local < 0 || local >= num_local) ? num_local : local;
}

MOE_HD int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Rows of the permuted buffer: the tight worst case over all routings of n entries
// onto num_local experts with every expert block padded to a multiple of `align`.
MOE_HD int64_t permuted_rows(int64_t n, int64_t num_local, int64_t align) {
  if (align == 1) return n;
  const int64_t busy = n < num_local ? n : num_local;
  return (n + busy * (align - 1)) / align * align;
}

// Every operand carries a leading batch extent that is either the batch size or 1
// (broadcast, as vmap leaves an unbatched operand); its batch stride is 0 then.
MOE_HD int64_t batch_stride(int64_t extent, int64_t per_example) {
  return extent == 1 ? 0 : per_example;
}

}  // namespace moe
