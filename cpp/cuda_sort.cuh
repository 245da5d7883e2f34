// CUB radix sort of 32-bit (key, value) pairs in a caller-provided workspace, and the binary
// search that turns sorted keys into segment bounds; shared by permute_sorted.cu and scatter.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/cub.cuh>

#include "cuda_common.cuh"

namespace moe::cuda {

// First position in keys[0, n) whose key is not below `key`.
__device__ __forceinline__ int64_t lower_bound(const uint32_t* keys, int64_t n, uint64_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Bits the radix sort looks at for keys up to max_key.
inline int key_bits(uint64_t max_key) {
  int bits = 1;
  while (bits < 32 && (max_key >> bits) != 0) ++bits;
  return bits;
}

// Sorted-key workspace: keys and values in and out, then `extra` int32s, then CUB's storage.
struct SortSpace {
  uint32_t *keys_in, *keys_out, *vals_in, *vals_out;
  int32_t* extra;
  void* cub_temp;
  size_t cub_bytes;
};

inline cudaError_t cub_sort_bytes(int64_t items, int bits, size_t* bytes) {
  return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, static_cast<uint32_t*>(nullptr),
                                         static_cast<uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
                                         static_cast<uint32_t*>(nullptr), static_cast<int>(items), 0, bits);
}

inline cudaError_t sort_space_bytes(int64_t items, int64_t extra, int bits, int64_t* bytes) {
  size_t cub_bytes = 0;
  MOE_CUDA_TRY(cub_sort_bytes(items, bits, &cub_bytes));
  *bytes = 4 * pad256(4 * items) + pad256(4 * extra) + pad256(static_cast<int64_t>(cub_bytes));
  return cudaSuccess;
}

inline SortSpace carve(void* ws, int64_t items, int64_t extra, size_t cub_bytes) {
  char* p = static_cast<char*>(ws);
  SortSpace s;
  uint32_t** arrays[4] = {&s.keys_in, &s.keys_out, &s.vals_in, &s.vals_out};
  for (uint32_t** a : arrays) { *a = reinterpret_cast<uint32_t*>(p); p += pad256(4 * items); }
  s.extra = reinterpret_cast<int32_t*>(p);
  p += pad256(4 * extra);
  s.cub_temp = p;
  s.cub_bytes = cub_bytes;
  return s;
}

inline cudaError_t run_sort(const SortSpace& s, int64_t items, int bits, cudaStream_t stream) {
  if (items == 0) return cudaSuccess;
  if (items > INT32_MAX) return cudaErrorInvalidValue;  // CUB counts items in int
  size_t bytes = s.cub_bytes;
  return cub::DeviceRadixSort::SortPairs(s.cub_temp, bytes, s.keys_in, s.keys_out, s.vals_in, s.vals_out,
                                         static_cast<int>(items), 0, bits, stream);
}

}  // namespace moe::cuda
