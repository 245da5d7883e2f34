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
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda_check.h"
#include "cuda_common.cuh"
#include "cuda_kernels.h"
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

template <typename L, int kSlots>
__global__ void __launch_bounds__(kRouterThreads) router_kernel(RouterArgs a) {
  extern __shared__ float staging[];  // grouped choice only: per warp E + 2 * num_groups words
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int32_t E = static_cast<int32_t>(a.experts), K = static_cast<int32_t>(a.topk);
  const int64_t per_warp = E + 2 * a.num_groups;
  float* choice_row = staging + warp * per_warp;
  float* group_score = choice_row + E;
  int32_t* kept = reinterpret_cast<int32_t*>(group_score + a.num_groups);
  for (int64_t t = int64_t{blockIdx.x} * kWarps + warp; t < a.tokens; t += int64_t{gridDim.x} * kWarps) {
    const L* row = static_cast<const L*>(a.logits) + t * E;
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
    int32_t key[kSlots];
#pragma unroll
    for (int j = 0; j < kSlots; ++j) key[j] = order_key(choice[j]);

    // K rounds of a warp argmax; lane k % 32 keeps round k's result in slot k / 32.
    uint32_t taken = 0;  // bit j: this lane's expert lane + 32 j is chosen already
    float picked_w[kSlots];
    int32_t picked_id[kSlots];
    float sum = 0.0f;
    for (int32_t k = 0; k < K; ++k) {
      int32_t best_key = kLowestKey, best = INT32_MAX;
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        const int32_t e = lane + 32 * j;
        if (e < E && !(taken >> j & 1) && ranks_before(key[j], e, best_key, best)) {
          best_key = key[j];
          best = e;
        }
      }
      // The warp's best: the largest key, then the lowest expert holding it (two warp reductions,
      // in place of a five-step shuffle tree over (key, expert) pairs).
      const int32_t top_key = __reduce_max_sync(kFull, best_key);
      best = __reduce_min_sync(kFull, best_key == top_key ? best : INT32_MAX);
      const int owner = best % 32, slot = best / 32;
      float own = 0.0f;
#pragma unroll
      for (int j = 0; j < kSlots; ++j)
        if (j == slot) own = score[j];
      if (lane == owner) taken |= 1u << slot;
      const float w = __shfl_sync(kFull, own, owner);
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

}  // namespace moe::cuda
