// Hopper (sm90a) building blocks our hand-written wgmma kernels share: mbarriers, cp.async,
// TMA loads and stores, named barriers, proxy fences, wgmma shared-memory descriptors,
// accumulator fences, bf16/f16 packing, the quad transpose behind 16-byte epilogue stores, and
// the tensor maps.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the driver is reached through the runtime
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cute/arch/mma_sm90_gmma.hpp"

namespace moe::gemm::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// `count` arrivals at once.
__device__ __forceinline__ void mbar_arrive(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Arrives on `bar` once all of this thread's earlier cp.async copies have landed (counted in the
// barrier's initial arrival count: .noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// 16 bytes from src, or zeros when src_bytes is 0 (then src is not read).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// Bytes [src, src + bytes) fetched into L2 ahead of their use (16-byte aligned, a multiple of 16).
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// TMA store of one box from shared memory, in the issuing thread's bulk group.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until the shared memory of this thread's committed stores has been read (their writes to global
// memory may still be draining): then the buffer may be written again.
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Until this thread's committed stores are complete.
__device__ __forceinline__ void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// This thread's shared-memory writes made visible to the async proxy, before a TMA store reads them.
__device__ __forceinline__ void fence_smem_to_tma() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The kThreads threads that reach barrier kId (1-15; 0 is __syncthreads') wait for each other.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}

// wgmma smem descriptor, 128-byte swizzle; offsets in bytes.
__device__ __forceinline__ uint64_t gmma_desc(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  uint64_t d = 0;
  d |= uint64_t((smem_addr >> 4) & 0x3FFF);
  d |= uint64_t((leading_bytes >> 4) & 0x3FFF) << 16;
  d |= uint64_t((stride_bytes >> 4) & 0x3FFF) << 32;
  d |= uint64_t(1) << 62;  // layout type SWIZZLE_128B (base offset 0: every stage is 1024-aligned)
  return d;
}

template <class Op, size_t... I>
__device__ __forceinline__ void gmma_call(uint64_t desc_a, uint64_t desc_b, float (&acc)[128], std::index_sequence<I...>) {
  Op::fma(desc_a, desc_b, acc[I]..., cute::SM90::GMMA::ScaleOut::One);
}

// After a barrier wait that saw other threads' cp.async writes land in shared memory: orders them
// before this thread's wgmma reads, which go through the async proxy. The one-way acquire form
// compiles to no instruction on sm90a; the two-way fence.proxy.async is MEMBAR.ALL.CTA +
// FENCE.VIEW.ASYNC.S, and that membar first waits for every global store the thread still has in
// flight: the previous tile's epilogue, which is meant to drain under this tile's MMAs.
__device__ __forceinline__ void fence_cp_async_to_wgmma() {
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 8)
  asm volatile("fence.proxy.async::generic.acquire.sync_restrict::shared::cluster.cluster;" ::: "memory");
#else
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
__device__ __forceinline__ void fence_accumulators(float (&acc)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// A wgmma accumulator row is spread over the 4 lanes of a quad: in each 8-column group, lane q holds
// columns 2q and 2q + 1 (one packed pair). Given the pairs of 4 consecutive groups, v[j] from group
// j, lane q gets back all 4 pairs of group q: 8 consecutive columns, one 16-byte store. A 4 x 4
// transpose over the quad in two butterfly rounds (lanes q ^ 1, then q ^ 2), two shuffles each,
// with no index that depends on the lane at run time. Every lane of the warp must call it.
__device__ __forceinline__ uint4 quad_transpose(uint32_t (&v)[4]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int b = 1; b <= 2; b <<= 1) {
    const bool upper = (q & b) != 0;
#pragma unroll
    for (int j0 = 0; j0 < 4; ++j0) {
      if (j0 & b) continue;
      const int j1 = j0 | b;
      // Each lane keeps the pair whose index bit matches its own and swaps the other.
      const uint32_t recv = __shfl_xor_sync(0xffffffffu, upper ? v[j0] : v[j1], b);
      if (upper) v[j0] = recv;
      else v[j1] = recv;
    }
  }
  return make_uint4(v[0], v[1], v[2], v[3]);
}

// Four 8 x 8 matrices of 16-bit values, each held as wgmma holds its accumulator's 8 x 8 blocks
// (lane l: row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1, one packed pair per register), into
// shared memory, a matrix row per 16 bytes: lane l gives the address of row l % 8 of matrix l / 8.
// The transpose across the quad that quad_transpose does with shuffles, done by the store itself.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(m0), "r"(m1),
               "r"(m2), "r"(m3)
               : "memory");
}

// The sum of v over lanes 0..lane of the warp.
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T v, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const T y = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += y;
  }
  return v;
}

// ---- host -------------------------------------------------------------------------------------

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
inline EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = []() -> EncodeTiledFn {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
        cudaSuccess)
      return nullptr;
#else
    if (cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &status) != cudaSuccess)
      return nullptr;
#endif
    return status == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiledFn>(ptr) : nullptr;
  }();
  return fn;
}

// A row-major [outer, rows, cols] array of 2-byte elements as a tensor map of `rank` 2 (cols,
// rows; outer ignored) or 3 (cols, rows, outer; innermost first) in boxes of 64 columns x box_rows
// rows (x 1), 128-byte swizzle: the MN-major layout wgmma reads, and what our TMA stores write.
// Out-of-range elements read as zeros.
inline cudaError_t encode_boxes(CUtensorMap* map, CUtensorMapDataType type, const void* base, int rank, int64_t outer,
                                int64_t rows, int64_t cols, uint32_t box_rows, CUtensorMapL2promotion promotion) {
  EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr || rank < 2 || rank > 3) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(outer)};
  const cuuint64_t strides[2] = {cuuint64_t(cols) * 2, cuuint64_t(rows) * cuuint64_t(cols) * 2};  // bytes, dims 1-2
  const cuuint32_t box[3] = {64, box_rows, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, type, cuuint32_t(rank), const_cast<void*>(base), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace moe::gemm::sm90
