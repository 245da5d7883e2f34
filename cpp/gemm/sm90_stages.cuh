// The stage ring of our warp-specialized sm90a wgmma kernels (gather_gemm.cu, grouped_wgrad.cu,
// down_backward.cu).
//
// 384 threads a block: warpgroup 0 produces, warpgroups 1-2 consume. Each of 4 stages holds A,
// 128 x 64 (two 8 KiB boxes of 64 x 64 elements in the 128-byte swizzle), and B, 256 x 64 (four
// boxes), with a full barrier (producer -> consumers) and an empty one (consumers -> producer).
// Each consumer multiplies its 64 rows of A by all of B (wgmma m64n256k16, 16 x 4 k steps a stage)
// into 128 f32 accumulators a thread. A kernel's own tables follow the barriers in shared memory.
//
// The accumulator of thread (warp wi, lane l) of a consumer holds value i at row
// 16 wi + l / 4 + 8 ((i / 2) % 2) and column 8 (i / 4) + 2 (l % 4) + i % 2.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <type_traits>
#include <string_view>
#include <utility>

#include "grouped_gemm.h"     // Dtype
#include "moe_mlp_decode.h"  // MlpActivation
#include "sm90_ptx.cuh"

namespace moe::gemm::sm90 {

constexpr int kThreads = 384;
constexpr int kStages = 4;
constexpr int kBox = 64;                     // elements per 128-byte swizzle row
constexpr int kBoxBytes = kBox * 64 * 2;     // 8 KiB: 64 x 64
constexpr int kStageABytes = 2 * kBoxBytes;  // 128 x 64
constexpr int kStageBBytes = 4 * kBoxBytes;  // 256 x 64
// The ring's layout: A boxes, B boxes, barriers, then the kernel's tables.
constexpr int kBOffset = kStages * kStageABytes;
constexpr int kBarrierOffset = kBOffset + kStages * kStageBBytes;
constexpr int kTablesOffset = kBarrierOffset + 2 * kStages * 8;
constexpr int kConsumerWarps = 8;
// One per producer thread (its cp.async landing; a stage without cp.async: thread 0 arrives for
// all in one) + thread 0's TMA expect-tx.
constexpr int kFullArrivals = 128 + 1;

// Dynamic shared memory of a kernel whose tables take table_bytes (+ slack to align to 1024).
constexpr int stage_ring_smem_bytes(int table_bytes) { return kTablesOffset + table_bytes + 1024; }

// wgmma m64n256k16 with f32 accumulators and both operands of T (bf16 or f16) in shared memory,
// each K-major or MN-major.
template <class T, cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B>
using Mma64x256 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>,
                                     cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<A, B>,
                                     cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<A, B>>;
using cute::SM90::GMMA::Major;

// One thread's view of the ring: addresses, and its position (stage, phase), which producer and
// consumers advance through the same sequence.
struct StageRing {
  uint8_t* smem;  // 1024-aligned: the 128-byte swizzle repeats every 1024 bytes of address
  uint32_t base;
  int stage = 0;
  uint32_t phase = 0;

  __device__ explicit StageRing(uint8_t* raw)
      : smem(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023))),
        base(smem_u32(smem)) {}

  __device__ uint32_t a(int s) const { return base + s * kStageABytes; }
  __device__ uint32_t b(int s) const { return base + kBOffset + s * kStageBBytes; }
  __device__ uint32_t full(int s) const { return base + kBarrierOffset + 8 * s; }
  __device__ uint32_t empty(int s) const { return base + kBarrierOffset + 8 * (kStages + s); }
  template <class U>
  __device__ U* tables(int byte_offset = 0) const {
    return reinterpret_cast<U*>(smem + kTablesOffset + byte_offset);
  }

  // One thread, before the block's first __syncthreads.
  __device__ void init_barriers() const {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), kFullArrivals);
      mbar_init(empty(s), kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to TMA's complete_tx
  }

  // Producer: until the consumers have released the current stage.
  __device__ void wait_empty() const { mbar_wait(empty(stage), phase ^ 1); }
  __device__ void advance() {
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
};

// Columns [32 m + 8 q, 32 m + 8 q + 8) of accumulator row 16 wi + l / 4 + 8 half, rounded to T:
// one 16-byte chunk for lane q = l % 4 (the quad's column groups 4 m .. 4 m + 3 transposed).
// Every lane of the warp must call it.
template <class T>
__device__ __forceinline__ uint4 accumulator_chunk(const float (&acc)[128], int m, int half) {
  uint32_t v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = 4 * (4 * m + j) + 2 * half;
    v[j] = pack2<T>(acc[i], acc[i + 1]);
  }
  return quad_transpose(v);
}

// f(std::integral_constant<MlpActivation, A>{}) for a launch's activation A, gated or not: the
// epilogues' dispatch from the runtime code to their compiled forms.
template <bool kGated, class F>
__device__ __forceinline__ void with_activation(int activation, F&& f) {
  using A = MlpActivation;
  const auto act = A(activation);
  if constexpr (kGated) {
    if (act == A::kSwiglu) f(std::integral_constant<A, A::kSwiglu>{});
    else f(std::integral_constant<A, A::kGeglu>{});
  } else {
    if (act == A::kGelu) f(std::integral_constant<A, A::kGelu>{});
    else f(std::integral_constant<A, A::kRelu>{});
  }
}

// 56 x 128 + 224 x 256 = 168 x 384 registers: the consumers hold the accumulators.
__device__ __forceinline__ void producer_registers() { asm volatile("setmaxnreg.dec.sync.aligned.u32 56;"); }
__device__ __forceinline__ void consumer_registers() { asm volatile("setmaxnreg.inc.sync.aligned.u32 224;"); }

// With both consumers on one tile, both finish its wgmma together and run their epilogues while
// the tensor cores idle. Staggered, consumer 1 issues its first stage only after consumer 0 has
// issued its own, so their tiles end about a stage apart and each one's epilogue runs while the
// other's last wgmma keep the tensor cores busy (the stage ring holds a stage less ahead of
// consumer 0). On unless MOE_SM90_CONSUMER_STAGGER=0 (an A/B switch, read once per process).
inline bool consumer_stagger() {
  static const bool on = [] {
    const char* v = std::getenv("MOE_SM90_CONSUMER_STAGGER");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on;
}

constexpr int kStaggerBarrier = 1;  // named barrier (0 is __syncthreads')

// The A/B switches of these kernels, read at every launch (checked in Python when a call is
// lowered): the index of variable `name`'s value among `values` (0, the default, when unset), or
// -1 for any other value.
inline int env_choice(const char* name, std::initializer_list<std::string_view> values) {
  const char* v = std::getenv(name);
  if (v == nullptr) return 0;
  int i = 0;
  for (std::string_view value : values) {
    if (value == v) return i;
    ++i;
  }
  return -1;
}

// launch(T{}, std::bool_constant<gated>{}, T's tensor-map type) for a call's element type (bf16 or
// f16) and gating: the host's dispatch to a kernel's compiled forms.
template <class Launch>
cudaError_t dispatch_element_gated(Dtype dtype, bool gated, Launch&& launch) {
  const auto with = [&](auto element, CUtensorMapDataType type) {
    return gated ? launch(element, std::true_type{}, type) : launch(element, std::false_type{}, type);
  };
  return dtype == Dtype::kBf16 ? with(__nv_bfloat16{}, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
                               : with(__half{}, CU_TENSOR_MAP_DATA_TYPE_FLOAT16);
}

// A consumer warpgroup's side of the ring: multiplies each full stage into acc, one stage of
// wgmma in flight, and releases a stage once its wgmma are done.
template <class Op, bool kBKMajor = false>
struct StageConsumer {
  int consumer;    // 0 or 1
  bool stagger;    // see consumer_stagger()
  bool started = false;
  int prev = -1;  // the stage whose wgmma may still run

  __device__ StageConsumer(int consumer_, bool stagger_) : consumer(consumer_), stagger(stagger_) {}

  // A: this consumer's 64 rows start a_offset bytes into the stage, a_k16_bytes between k16
  // steps, a_leading_bytes the descriptor's leading byte offset. B MN-major: +16 k rows =
  // 2048 bytes per k16, 64-column boxes 8192 bytes apart (leading), 8-row groups 1024 apart;
  // K-major (kBKMajor): 256 rows of 64 k, laid out as A's rows.
  // Only the first k16_steps (1-4) of the stage's 4 are issued: the caller skips those that
  // would multiply only zero-filled rows (the same result, less tensor-core time).
  template <class Ring>
  __device__ __forceinline__ void mma(Ring& ring, float (&acc)[128], uint32_t a_offset, uint32_t a_k16_bytes,
                                      uint32_t a_leading_bytes, int k16_steps = 4) {
    const bool first = start();
    mbar_wait(ring.full(ring.stage), ring.phase);
    fence_cp_async_to_wgmma();  // stages (or parts) written by cp.async
    const uint32_t a_addr = ring.a(ring.stage) + a_offset, b_addr = ring.b(ring.stage);
    fence_accumulators(acc);
    // A whole, non-empty batch (arrive, wgmma, commit) in each branch: ptxas serialises every
    // wgmma of the kernel when a branch splits a batch or may leave it empty
    // (tests/test_kernel_build.py).
    switch (k16_steps) {
      case 3: issue<3>(acc, a_addr, b_addr, a_k16_bytes, a_leading_bytes); break;
      case 2: issue<2>(acc, a_addr, b_addr, a_k16_bytes, a_leading_bytes); break;
      case 1: issue<1>(acc, a_addr, b_addr, a_k16_bytes, a_leading_bytes); break;
      default: issue<4>(acc, a_addr, b_addr, a_k16_bytes, a_leading_bytes);
    }
    if (first && stagger && consumer == 0) asm volatile("bar.arrive %0, 256;" ::"n"(kStaggerBarrier) : "memory");
    cute::warpgroup_wait<1>();  // the previous stage's wgmma are done: release it
    fence_accumulators(acc);
    release(ring);
    prev = ring.stage;
    ring.advance();
  }

  // A stage whose A rows of this consumer are all padding: waited for and released, no wgmma
  // (a branch to a loop of these, not inside mma: a batch that may be empty makes ptxas
  // serialise every wgmma of the kernel).
  template <class Ring>
  __device__ __forceinline__ void skip(Ring& ring) {
    start();
    mbar_wait(ring.full(ring.stage), ring.phase);
    arrive_empty(ring, ring.stage);
    ring.advance();
  }

  // One row tile of gather_gemm.cu's and down_backward.cu's layout into acc (zeroed first): A
  // K-major, this consumer's 64 rows 64 x 128 bytes into the stage, +32 bytes per k16. Where
  // all of them are padding (rows_in false: a group's last tile with at most 64 rows, consumer
  // 1) its stages are only waited for and released.
  template <class Ring>
  __device__ __forceinline__ void row_tile(Ring& ring, float (&acc)[128], bool rows_in, int k_blocks) {
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    if (rows_in) {
      for (int kb = 0; kb < k_blocks; ++kb) mma(ring, acc, consumer * (64 * 128), 32, 16);
    } else {
      for (int kb = 0; kb < k_blocks; ++kb) skip(ring);
    }
    finish(ring, acc);
  }

  // After a tile's last stage: its wgmma done and its stage released; acc holds the tile.
  template <class Ring>
  __device__ __forceinline__ void finish(const Ring& ring, float (&acc)[128]) {
    cute::warpgroup_wait<0>();
    fence_accumulators(acc);
    release(ring);
    prev = -1;
  }

 private:
  // Before the first stage. Both consumers take the same stages, so consumer 1 waits here
  // exactly when consumer 0 arrives after issuing its first stage (in mma, a skip does not count:
  // consumer 0 never skips, its rows come first).
  __device__ __forceinline__ bool start() {
    const bool first = !started;
    started = true;
    if (first && stagger && consumer == 1) asm volatile("bar.sync %0, 256;" ::"n"(kStaggerBarrier) : "memory");
    return first;
  }

  template <int N>
  __device__ __forceinline__ static void issue(float (&acc)[128], uint32_t a_addr, uint32_t b_addr, uint32_t a_k16_bytes,
                                               uint32_t a_leading_bytes) {
    cute::warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const uint64_t desc_a = gmma_desc(a_addr + k * a_k16_bytes, a_leading_bytes, 1024);
      // B K-major (rows of 128 bytes, as A): +32 bytes per k16 inside the swizzled row.
      const uint64_t desc_b = kBKMajor ? gmma_desc(b_addr + k * 32, 16, 1024) : gmma_desc(b_addr + k * 2048, kBoxBytes, 1024);
      gmma_call<Op>(desc_a, desc_b, acc, std::make_index_sequence<128>{});
    }
    cute::warpgroup_commit_batch();
  }

  template <class Ring>
  __device__ __forceinline__ void release(const Ring& ring) const {
    if (prev >= 0) arrive_empty(ring, prev);
  }

  // One arrival per warp (the empty barrier counts warps).
  template <class Ring>
  __device__ __forceinline__ static void arrive_empty(const Ring& ring, int stage) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(ring.empty(stage));
  }
};

}  // namespace moe::gemm::sm90
