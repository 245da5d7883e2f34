// route's choice and gates (kernel_args.h gives the contract) in one launch: a warp per token,
// kWarps tokens per block, a grid-stride loop over tokens. Lane l holds experts l, l + 32, ...
// (kSlots of them, E <= 32 * kSlots) in registers: softmax's max and sum are warp reductions, and
// the top-k is K rounds of a warp argmax over (order key descending, expert ascending), top_k's
// order, each a max over the keys and a min over the experts holding the top one. Group-limited
// choice stages the row's choice values in shared memory, where lane g scores group g (its two
// best values) and ranks it against the others.
//
// The float32 formulas are the ones XLA runs for the jnp route (softmax as exp(x - max) times the
// reciprocal of the sum, sigmoid as 1 / (1 + exp(-x)), expf as XLA's libdevice exp), so that equal
// logits give equal scores and ties fall to the lower expert as in top_k.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "cuda_kernels.h"
#include "gemm/decode_common.cuh"
#include "kernel_args.h"

namespace moe::cuda {
namespace {

constexpr int kWarps = 4, kRouterThreads = 32 * kWarps;
constexpr uint32_t kFull = 0xffffffffu;
constexpr int32_t kLowestKey = INT32_MIN;

// top_k's order on floats: an integer key that sorts -0.0 below +0.0 and NaNs by their bits.
__device__ __forceinline__ int32_t order_key(float v) {
  const int32_t bits = __float_as_int(v);
  return bits < 0 ? bits ^ 0x7fffffff : bits;
}

// Whether (key a, expert ia) ranks before (key b, expert ib).
__device__ __forceinline__ bool ranks_before(int32_t a, int32_t ia, int32_t b, int32_t ib) {
  return a != b ? a > b : ia < ib;
}

// Scores the topk_groups best groups among num_groups in the warp's staged `choice` row and sets
// the choice of every expert outside them to -inf (in registers).
template <int kSlots>
__device__ void keep_best_groups(const RouterArgs& a, int lane, float* choice_row, float* group_score,
                                 int32_t* kept, float (&choice)[kSlots]) {
  const int32_t E = static_cast<int32_t>(a.experts), G = static_cast<int32_t>(a.num_groups), size = E / G;
#pragma unroll
  for (int j = 0; j < kSlots; ++j)
    if (lane + 32 * j < E) choice_row[lane + 32 * j] = choice[j];
  __syncwarp();
  for (int32_t g = lane; g < G; g += 32) {
    int32_t best = g * size, second = -1;
    int32_t best_key = order_key(choice_row[best]), second_key = kLowestKey;
    for (int32_t e = g * size + 1; e < (g + 1) * size; ++e) {
      const int32_t k = order_key(choice_row[e]);
      if (ranks_before(k, e, best_key, best)) {
        second = best;
        second_key = best_key;
        best = e;
        best_key = k;
      } else if (second < 0 || ranks_before(k, e, second_key, second)) {
        second = e;
        second_key = k;
      }
    }
    group_score[g] = second < 0 ? choice_row[best] : choice_row[best] + choice_row[second];
  }
  __syncwarp();
  for (int32_t g = lane; g < G; g += 32) {
    const int32_t own = order_key(group_score[g]);
    int32_t rank = 0;
    for (int32_t h = 0; h < G; ++h) rank += ranks_before(order_key(group_score[h]), h, own, g);
    kept[g] = rank < a.topk_groups;
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int32_t e = lane + 32 * j;
    if (e < E && !kept[e / size]) choice[j] = -INFINITY;
  }
  __syncwarp();  // the staged row is rewritten by the warp's next token
}

// Sorts a lane's kSlots (key, expert, score) triples into choice order (key descending, then
// expert ascending): a bitonic network, every index static.
template <int kSlots>
__device__ __forceinline__ void sort_slots(int32_t (&key)[kSlots], int32_t (&expert)[kSlots], float (&score)[kSlots]) {
  static_assert((kSlots & (kSlots - 1)) == 0, "a power of two");
#pragma unroll
  for (int size = 2; size <= kSlots; size *= 2)
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2)
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int partner = i ^ stride;
        if (partner <= i) continue;
        // Ascending blocks put the better triple first, descending ones last.
        const bool first_better = ranks_before(key[i], expert[i], key[partner], expert[partner]);
        if (first_better != ((i & size) == 0)) {
          const int32_t k = key[i], e = expert[i];
          const float v = score[i];
          key[i] = key[partner], expert[i] = expert[partner], score[i] = score[partner];
          key[partner] = k, expert[partner] = e, score[partner] = v;
        }
      }
}

// Routes token t from its row of E logits (any float type, global or shared memory); one warp.
// The grouped choice stages the row in choice_row [E] and uses group_score and kept [num_groups].
template <typename L, int kSlots>
__device__ __forceinline__ void route_token(const RouterArgs& a, int lane, int64_t t, const L* row, float* choice_row,
                                            float* group_score, int32_t* kept) {
  const int32_t E = static_cast<int32_t>(a.experts), K = static_cast<int32_t>(a.topk);
  float score[kSlots], choice[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) score[j] = lane + 32 * j < E ? to_f32(row[lane + 32 * j]) : -INFINITY;
  if (a.scoring == Scoring::kSoftmax) {
    float peak = -INFINITY;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) peak = fmaxf(peak, score[j]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) peak = fmaxf(peak, __shfl_xor_sync(kFull, peak, offset));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      score[j] = lane + 32 * j < E ? expf(score[j] - peak) : 0.0f;
      sum += score[j];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFull, sum, offset);
    const float inverse = 1.0f / sum;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) score[j] *= inverse;
  } else {
#pragma unroll
    for (int j = 0; j < kSlots; ++j) score[j] = 1.0f / (1.0f + expf(-score[j]));
  }
  const float* bias = a.bias == nullptr ? nullptr : a.bias + t * a.bias_rstride;
#pragma unroll
  for (int j = 0; j < kSlots; ++j)
    choice[j] = bias != nullptr && lane + 32 * j < E ? score[j] + bias[lane + 32 * j] : score[j];
  if (a.num_groups > 0) keep_best_groups<kSlots>(a, lane, choice_row, group_score, kept, choice);
  // Each lane's experts in choice order (a sorting network over its slots), so that a round's
  // candidate is the lane's first and only the lane that gives it up shifts: K rounds of two warp
  // reductions, not K scans of every slot (one warp's chain of dependent instructions: 1.9 against
  // 3.0 us of route_tokens' Qwen3 router at T = 1). Past E a slot holds (kLowestKey, INT32_MAX).
  int32_t key[kSlots], expert[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const bool in = lane + 32 * j < E;
    key[j] = in ? order_key(choice[j]) : kLowestKey;
    expert[j] = in ? lane + 32 * j : INT32_MAX;
  }
  sort_slots<kSlots>(key, expert, score);

  // Round k's result goes to lane k % 32, slot k / 32.
  float picked_w[kSlots];
  int32_t picked_id[kSlots];
  float sum = 0.0f;
  for (int32_t k = 0; k < K; ++k) {
    // The warp's best: the largest key, then the lowest expert holding it.
    const int32_t top_key = __reduce_max_sync(kFull, key[0]);
    const int32_t best = __reduce_min_sync(kFull, key[0] == top_key ? expert[0] : INT32_MAX);
    const float w = __shfl_sync(kFull, score[0], best % 32);
    if (expert[0] == best) {  // its owner moves on to its next expert
#pragma unroll
      for (int i = 0; i + 1 < kSlots; ++i) key[i] = key[i + 1], expert[i] = expert[i + 1], score[i] = score[i + 1];
      key[kSlots - 1] = kLowestKey, expert[kSlots - 1] = INT32_MAX;
    }
    sum += w;
    if (lane == k % 32) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j)
        if (j == k / 32) {
          picked_w[j] = w;
          picked_id[j] = best;
        }
    }
  }
  // DeepSeek-V3 adds 1e-20 to the sigmoid sum (its scores can all be tiny); softmax ones cannot.
  const float denominator = sum + (a.scoring == Scoring::kSigmoid ? 1e-20f : 0.0f);
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int32_t k = lane + 32 * j;
    if (k < K) {
      a.weights[t * K + k] = (a.renormalize ? picked_w[j] / denominator : picked_w[j]) * a.scale;
      a.ids[t * K + k] = picked_id[j];
    }
  }
}

template <typename L, int kSlots>
__global__ void __launch_bounds__(kRouterThreads) router_kernel(RouterArgs a) {
  extern __shared__ float staging[];  // grouped choice only: per warp E + 2 * num_groups words
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t per_warp = a.experts + 2 * a.num_groups;
  float* choice_row = staging + warp * per_warp;
  float* group_score = choice_row + a.experts;
  int32_t* kept = reinterpret_cast<int32_t*>(group_score + a.num_groups);
  for (int64_t t = int64_t{blockIdx.x} * kWarps + warp; t < a.tokens; t += int64_t{gridDim.x} * kWarps)
    route_token<L, kSlots>(a, lane, t, static_cast<const L*>(a.logits) + t * a.experts, choice_row, group_score, kept);
}

template <typename L, int kSlots>
cudaError_t launch_router(const RouterArgs& a, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((a.tokens + kWarps - 1) / kWarps, kMaxBlocks);
  const size_t shared = a.num_groups > 0 ? sizeof(float) * kWarps * (a.experts + 2 * a.num_groups) : 0;
  router_kernel<L, kSlots><<<static_cast<unsigned>(blocks), kRouterThreads, shared, stream>>>(a);
  return cudaGetLastError();
}

template <typename L>
cudaError_t launch_for_experts(const RouterArgs& a, cudaStream_t stream) {
  const int64_t slots = (a.experts + 31) / 32;
  if (slots <= 1) return launch_router<L, 1>(a, stream);
  if (slots <= 2) return launch_router<L, 2>(a, stream);
  if (slots <= 4) return launch_router<L, 4>(a, stream);
  if (slots <= 8) return launch_router<L, 8>(a, stream);
  if (slots <= 16) return launch_router<L, 16>(a, stream);
  return launch_router<L, 32>(a, stream);
}

// ---- router_hidden: the router's product and route in one launch ------------------------------
// For a few tokens the product x [T, H] · weight [H, E] is a weight read of H x E elements, too
// small for a GEMM and, as an XLA dot, several microseconds of launches. One thread-block cluster
// per group of kTokens tokens splits H into one row range per block. A thread streams 16 bytes of
// a row (8 experts) and keeps kTokens x 8 float32 sums; the block adds its threads' sums in a fixed
// order. Then, with no global round trip, block t of the cluster adds token t's partials from every
// block's shared memory (in rank order: bitwise reproducible), writes the logits and routes them
// with route_token. Grid and cluster depend on the shapes only (graph safe); no workspace.
constexpr int kHiddenThreads = 256;
constexpr int kHiddenBatch = 8;         // rows a thread loads per step (two steps in flight)
#ifndef MOE_ROUTER_HIDDEN_MAX_CLUSTER  // benchmarks/micro/router_latency.cu builds it with 8 as well
#define MOE_ROUTER_HIDDEN_MAX_CLUSTER 16
#endif
constexpr int kHiddenMaxCluster = MOE_ROUTER_HIDDEN_MAX_CLUSTER;  // blocks of a cluster (16: non-portable, sm_90)
#ifdef MOE_ROUTER_TRACE  // router_latency.cu's phase trace: block 0's SM clock at each mark
__device__ long long router_trace[8];
#define MOE_ROUTER_MARK(i) (rank == 0 && threadIdx.x == 0 ? void(router_trace[i] = clock64()) : void())
#else
#define MOE_ROUTER_MARK(i) void()
#endif
constexpr int kHiddenMinRows = 64;      // rows per block at least
constexpr int kHiddenMaxSlots = 8;      // E <= 256
constexpr int64_t kHiddenMaxShared = 200 * 1024;

// Thread-block clusters need sm_90; the device's major version, read once per call of the handler.
int compute_capability_major() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return 0;
  return major;
}

struct HiddenPlan {
  int cluster = 1, tokens_per_group = 1;
  int64_t span = 0;  // rows per block
  int64_t part_floats = 0, red_floats = 0, xs_elems = 0, staging_floats = 0, shared_bytes = 0;
};

int64_t cdiv(int64_t x, int64_t m) { return (x + m - 1) / m; }

HiddenPlan hidden_plan(int64_t tokens, int64_t hidden, int64_t experts, int64_t num_groups, int cluster) {
  HiddenPlan p;
  p.tokens_per_group = tokens <= 1 ? 1 : tokens <= 2 ? 2 : tokens <= 4 ? 4 : 8;
  p.cluster = int(std::clamp<int64_t>(cdiv(hidden, kHiddenMinRows), 1, cluster));
  p.span = cdiv(std::max<int64_t>(hidden, 1), p.cluster);
  const int64_t cols = experts / gemm::decode::kVec, rows_per_pass = kHiddenThreads / std::max<int64_t>(cols, 1);
  p.part_floats = p.tokens_per_group * experts;
  p.red_floats = rows_per_pass * p.tokens_per_group * experts;
  p.xs_elems = p.tokens_per_group * (p.span + p.span % 2);  // 2-byte elements, an even count
  p.staging_floats = experts + 2 * num_groups;
  p.shared_bytes = 4 * (p.part_floats + p.red_floats + p.staging_floats) + 2 * p.xs_elems;
  return p;
}

template <typename X, int kTokens, int kSlots>
__global__ void __launch_bounds__(kHiddenThreads) router_hidden_kernel(RouterHiddenArgs a, HiddenPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  using gemm::decode::kVec;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), blocks = int(cluster.num_blocks());
  MOE_ROUTER_MARK(0);
  const int64_t H = a.hidden, E = a.route.experts;
  const int64_t layer = a.layer == nullptr ? 0 : gemm::decode::stacked_layer(a.layer, a.layers);
  RouterArgs r = a.route;
  if (r.bias != nullptr) r.bias += layer * E;  // a stacked bias (one router: layer 0)
  const int64_t t0 = int64_t{blockIdx.y} * kTokens;
  const int tokens = int(std::min<int64_t>(kTokens, r.tokens - t0));
  const int cols = int(E / kVec), rows_per_pass = kHiddenThreads / cols;
  const int col = threadIdx.x % cols, lane_row = threadIdx.x / cols;
  const bool active = lane_row < rows_per_pass;
  const int64_t span = plan.span, h0 = std::min(H, rank * span), h1 = std::min(H, h0 + span);

  extern __shared__ float4 shared_words[];
  float* part = reinterpret_cast<float*>(shared_words);  // [kTokens, E]: this block's sums
  float* red = part + plan.part_floats;                  // [rows_per_pass, kTokens, E]; then a logits row
  float* staging = red + plan.red_floats;                // route_token's grouped-choice rows
  X* xs = reinterpret_cast<X*>(staging + plan.staging_floats);  // [kTokens, span]: the block's slice of x

  const X* w = static_cast<const X*>(a.weight) + layer * H * E + col * kVec;
  const int64_t step = int64_t{kHiddenBatch} * rows_per_pass;
  auto load = [&](int64_t h, uint4 (&wv)[kHiddenBatch]) {
#pragma unroll
    for (int u = 0; u < kHiddenBatch; ++u) {
      const int64_t k = h + u * rows_per_pass;
      wv[u] = active && k < h1 ? gemm::decode::load_stream(w + k * E) : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 wv[kHiddenBatch];
  load(h0 + lane_row, wv);  // the weight read starts before x is staged
  const X* x = static_cast<const X*>(a.x);
  for (int64_t i = threadIdx.x; i < kTokens * span; i += kHiddenThreads) {
    const int t = int(i / span);
    const int64_t k = i - t * span;
    xs[i] = t < tokens && h0 + k < h1 ? x[(t0 + t) * H + h0 + k] : X(0.0f);
  }
  __syncthreads();
  MOE_ROUTER_MARK(1);

  float acc[kTokens][kVec] = {};
  if (active) {
#pragma unroll 1
    for (int64_t h = h0 + lane_row; h < h1; h += step) {
      uint4 next[kHiddenBatch];
      load(h + step, next);
#pragma unroll
      for (int u = 0; u < kHiddenBatch; ++u) {
        const int64_t k = h + u * rows_per_pass;
        if (k >= h1) break;
        float wf[kVec];
        gemm::decode::to_float8<X>(wv[u], wf);
#pragma unroll
        for (int t = 0; t < kTokens; ++t) {
          const float v = to_f32(xs[t * span + (k - h0)]);
#pragma unroll
          for (int c = 0; c < kVec; ++c) acc[t][c] = fmaf(v, wf[c], acc[t][c]);
        }
      }
#pragma unroll
      for (int u = 0; u < kHiddenBatch; ++u) wv[u] = next[u];
    }
  }
  MOE_ROUTER_MARK(2);
  // Where the columns tile a warp (E / 8 a power of two below 32), the lanes of one column first
  // add their sums by shuffles, so that shared memory holds a row per warp, not per lane row:
  // with few experts (Mixtral's 8) the serial sum below would otherwise run over 256 rows.
  const int column_lanes = cols < 32 && 32 % cols == 0 ? 32 / cols : 1;
  const int red_rows = rows_per_pass / column_lanes;
  if (column_lanes > 1) {  // every thread is active: cols * rows_per_pass == kHiddenThreads
    for (int offset = cols; offset < 32; offset *= 2)
#pragma unroll
      for (int t = 0; t < kTokens; ++t)
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc[t][c] += __shfl_xor_sync(0xffffffffu, acc[t][c], offset);
  }
  if (active && lane_row % column_lanes == 0) {
    const int64_t q = lane_row / column_lanes;
#pragma unroll
    for (int t = 0; t < kTokens; ++t)
#pragma unroll
      for (int c = 0; c < kVec; ++c) red[(q * kTokens + t) * E + col * kVec + c] = acc[t][c];
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < kTokens * E; j += kHiddenThreads) {  // the block's rows, in order
    float sum = 0.0f;
#pragma unroll 8
    for (int q = 0; q < red_rows; ++q) sum += red[q * kTokens * E + j];
    part[j] = sum;
  }
  MOE_ROUTER_MARK(3);
  cluster.sync();  // every block's part is complete
  MOE_ROUTER_MARK(4);

  // Block t % blocks finishes token t: the blocks' parts in rank order, then the route. A thread
  // issues its reads of every block's shared memory before adding any (one latency, not 16).
  float* row = red;
  for (int t = rank; t < tokens; t += blocks) {
    for (int64_t e = threadIdx.x; e < E; e += kHiddenThreads) {
      float parts[kHiddenMaxCluster];
#pragma unroll
      for (int q = 0; q < kHiddenMaxCluster; ++q)
        parts[q] = q < blocks ? cluster.map_shared_rank(part, q)[t * E + e] : 0.0f;
      float sum = 0.0f;
#pragma unroll
      for (int q = 0; q < kHiddenMaxCluster; ++q)
        if (q < blocks) sum += parts[q];
      row[e] = sum;
      a.logits[(t0 + t) * E + e] = sum;
    }
    __syncthreads();
    MOE_ROUTER_MARK(5);
    if (threadIdx.x < 32)
      route_token<float, kSlots>(r, int(threadIdx.x), t0 + t, row, staging, staging + E,
                                 reinterpret_cast<int32_t*>(staging + E + r.num_groups));
    __syncthreads();  // the row is rewritten by the block's next token
    MOE_ROUTER_MARK(6);
  }
  // A block's shared memory outlives the other blocks' reads of it. Those reads are complete (their
  // values were added), so the arrival needs no memory ordering: no fence behind the global writes.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  MOE_ROUTER_MARK(7);
#endif
}

// The cluster size the device takes for this kernel with `shared_bytes` per block:
// kHiddenMaxCluster where it fits, else 8.
template <typename Kernel>
int cluster_size_for(Kernel kernel, int64_t shared_bytes, cudaStream_t stream) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    (void)cudaGetLastError();
    return 8;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kHiddenMaxCluster, 1);
  config.blockDim = dim3(kHiddenThreads);
  config.dynamicSmemBytes = size_t(shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = kHiddenMaxCluster;
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters < 1) {
    (void)cudaGetLastError();
    return 8;
  }
  return kHiddenMaxCluster;
}

constexpr int kMaxDevices = 64;

template <typename X, int kTokens, int kSlots>
cudaError_t launch_router_hidden(const RouterHiddenArgs& a, cudaStream_t stream) {
  auto kernel = router_hidden_kernel<X, kTokens, kSlots>;
  // Once per device: the kernel's shared-memory limit raised to the most any plan takes, and the
  // cluster size it gets there (no smaller plan gets less). The decode step is host-bound: these
  // queries cost more than the launch.
  static std::atomic<int> device_cluster[kMaxDevices];
  int device = 0;
  MOE_CUDA_TRY(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  int most = device_cluster[device].load(std::memory_order_acquire);
  if (most == 0) {
    MOE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kHiddenMaxShared)));
    most = cluster_size_for(kernel, kHiddenMaxShared, stream);
    device_cluster[device].store(most, std::memory_order_release);
  }
  const RouterArgs& r = a.route;
  const HiddenPlan plan = hidden_plan(r.tokens, a.hidden, r.experts, r.num_groups, most);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(plan.cluster), unsigned(cdiv(r.tokens, kTokens)));
  config.blockDim = dim3(kHiddenThreads);
  config.dynamicSmemBytes = size_t(plan.shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = unsigned(plan.cluster);
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  MOE_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, a, plan));
  return cudaGetLastError();
}

template <typename X, int kTokens>
cudaError_t router_hidden_for_experts(const RouterHiddenArgs& a, cudaStream_t stream) {
  const int64_t slots = (a.route.experts + 31) / 32;
  if (slots <= 1) return launch_router_hidden<X, kTokens, 1>(a, stream);
  if (slots <= 2) return launch_router_hidden<X, kTokens, 2>(a, stream);
  if (slots <= 4) return launch_router_hidden<X, kTokens, 4>(a, stream);
  return launch_router_hidden<X, kTokens, 8>(a, stream);
}

template <typename X>
cudaError_t router_hidden_for_tokens(const RouterHiddenArgs& a, cudaStream_t stream) {
  switch (hidden_plan(a.route.tokens, a.hidden, a.route.experts, a.route.num_groups, 1).tokens_per_group) {
    case 1: return router_hidden_for_experts<X, 1>(a, stream);
    case 2: return router_hidden_for_experts<X, 2>(a, stream);
    case 4: return router_hidden_for_experts<X, 4>(a, stream);
    default: return router_hidden_for_experts<X, 8>(a, stream);
  }
}

}  // namespace

cudaError_t router(const RouterArgs& a, cudaStream_t stream) {
  static_assert(kRouterMaxExperts <= 32 * 32, "a lane holds at most 32 experts");
  if (a.tokens == 0) return cudaSuccess;
  if (a.experts > kRouterMaxExperts) return cudaErrorInvalidValue;
  switch (a.logits_dtype) {
    case Dtype::kBF16: return launch_for_experts<__nv_bfloat16>(a, stream);
    case Dtype::kF16: return launch_for_experts<__half>(a, stream);
    default: return launch_for_experts<float>(a, stream);
  }
}

bool router_hidden_fits(int64_t tokens, int64_t hidden, int64_t experts, int64_t num_groups) {
  if (experts < 8 || experts % gemm::decode::kVec != 0 || experts > 32 * kHiddenMaxSlots || hidden < 1) return false;
  // The plan with the smallest cluster the launch may fall back to needs the most shared memory.
  return hidden_plan(tokens, hidden, experts, num_groups, 8).shared_bytes <= kHiddenMaxShared;
}

cudaError_t router_hidden(const RouterHiddenArgs& a, cudaStream_t stream) {
  if (a.route.tokens == 0) return cudaSuccess;
  if (!router_hidden_fits(a.route.tokens, a.hidden, a.route.experts, a.route.num_groups)) return cudaErrorInvalidValue;
  if (compute_capability_major() < 9) return cudaErrorNotSupported;  // clusters
  return a.dtype == Dtype::kBF16 ? router_hidden_for_tokens<__nv_bfloat16>(a, stream)
                                 : router_hidden_for_tokens<__half>(a, stream);
}

}  // namespace moe::cuda
