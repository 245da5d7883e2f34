// route's choice and gates on the CPU (kernel_args.h gives the contract): tokens spread over the
// thread pool, each row scored, grouped and ranked on the stack. The float32 formulas are the ones
// XLA runs for the jnp route (softmax as exp(x - max) times the reciprocal of the sum, sigmoid as
// 1 / (1 + exp(-x))), so that equal inputs give equal scores and the ids match top_k's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_common.h"
#include "cpu_kernels.h"
#include "kernel_args.h"

namespace moe::cpu {
namespace {

// top_k's order on floats: an integer key that sorts -0.0 below +0.0 and NaNs by their bits.
inline int32_t order_key(float v) {
  int32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits < 0 ? bits ^ 0x7fffffff : bits;
}

// Whether expert a ranks before expert b: the larger key, equal keys in ascending index.
inline bool ranks_before(const int32_t* key, int32_t a, int32_t b) {
  return key[a] != key[b] ? key[a] > key[b] : a < b;
}

template <typename L>
void route_row(const RouterArgs& a, const L* logits, const float* bias, float* weights, int32_t* ids) {
  const int32_t E = static_cast<int32_t>(a.experts), K = static_cast<int32_t>(a.topk);
  float score[kRouterMaxExperts], choice[kRouterMaxExperts];
  int32_t key[kRouterMaxExperts], order[kRouterMaxExperts];
  for (int32_t e = 0; e < E; ++e) score[e] = to_f32(logits[e]);
  if (a.scoring == Scoring::kSoftmax) {
    float peak = -std::numeric_limits<float>::infinity();
    for (int32_t e = 0; e < E; ++e) peak = std::max(peak, score[e]);
    // Summed in double and rounded once: within half an ulp, whatever order XLA's sum takes.
    double sum = 0.0;
    for (int32_t e = 0; e < E; ++e) sum += (score[e] = std::exp(score[e] - peak));
    const float inverse = 1.0f / static_cast<float>(sum);
    for (int32_t e = 0; e < E; ++e) score[e] *= inverse;
  } else {
    for (int32_t e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-score[e]));
  }
  for (int32_t e = 0; e < E; ++e) choice[e] = bias != nullptr ? score[e] + bias[e] : score[e];
  if (a.num_groups > 0) {
    // A group's score: the sum of its two best choice values; the topk_groups best groups stay.
    const int32_t G = static_cast<int32_t>(a.num_groups), size = E / G;
    float group_score[kRouterMaxExperts];
    int32_t group_key[kRouterMaxExperts];
    for (int32_t e = 0; e < E; ++e) key[e] = order_key(choice[e]);
    for (int32_t g = 0; g < G; ++g) {
      int32_t best = g * size, second = -1;
      for (int32_t e = g * size + 1; e < (g + 1) * size; ++e) {
        if (ranks_before(key, e, best)) {
          second = best;
          best = e;
        } else if (second < 0 || ranks_before(key, e, second)) {
          second = e;
        }
      }
      group_score[g] = second < 0 ? choice[best] : choice[best] + choice[second];
      group_key[g] = order_key(group_score[g]);
    }
    for (int32_t g = 0; g < G; ++g) {
      int32_t rank = 0;
      for (int32_t h = 0; h < G; ++h) rank += ranks_before(group_key, h, g);
      if (rank >= a.topk_groups)
        for (int32_t e = g * size; e < (g + 1) * size; ++e) choice[e] = -std::numeric_limits<float>::infinity();
    }
  }
  for (int32_t e = 0; e < E; ++e) {
    key[e] = order_key(choice[e]);
    order[e] = e;
  }
  std::partial_sort(order, order + K, order + E, [&](int32_t x, int32_t y) { return ranks_before(key, x, y); });
  double sum = 0.0;
  for (int32_t k = 0; k < K; ++k) sum += score[order[k]];
  // DeepSeek-V3 adds 1e-20 to the sigmoid sum (its scores can all be tiny); softmax ones cannot.
  const float denominator = static_cast<float>(sum) + (a.scoring == Scoring::kSigmoid ? 1e-20f : 0.0f);
  for (int32_t k = 0; k < K; ++k) {
    const float w = score[order[k]];
    weights[k] = (a.renormalize ? w / denominator : w) * a.scale;
    ids[k] = order[k];
  }
}

}  // namespace

void router(const RouterArgs& a, const ParallelFor& parallel) {
  const int64_t E = a.experts, K = a.topk;
  auto run = [&](auto tag) {
    using L = typename decltype(tag)::type;
    const L* logits = static_cast<const L*>(a.logits);
    parallel(a.tokens, std::max<int64_t>(1, 16384 / (E * 4)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        route_row<L>(a, logits + t * E, a.bias == nullptr ? nullptr : a.bias + t * a.bias_rstride,
                     a.weights + t * K, a.ids + t * K);
    });
  };
  switch (a.logits_dtype) {
    case Dtype::kBF16: return run(Tag<BF16>{});
    case Dtype::kF16: return run(Tag<F16>{});
    default: return run(Tag<float>{});
  }
}

}  // namespace moe::cpu
