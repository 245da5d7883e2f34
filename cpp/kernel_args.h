// What every kernel launcher receives, filled once from the FFI buffers (ffi_decode.h, by field
// name) and consumed by the CPU (cpu_kernels.h) and CUDA (cuda_kernels.h) implementations alike.
// Strides are in elements; a batch stride of 0 broadcasts the operand over the batch.
#pragma once

#include <cstdint>

namespace moe {

enum class Dtype : int32_t { kF32, kBF16, kF16, kF8E4M3FN, kF8E5M2 };

inline int64_t dtype_bytes(Dtype d) {
  switch (d) {
    case Dtype::kF32: return 4;
    case Dtype::kBF16:
    case Dtype::kF16: return 2;
    default: return 1;
  }
}

// out[b, row_map[b,t,k]] = hidden[b,t]; rows that hold no entry are zero.
struct PermuteArgs {
  const void* hidden; int64_t hidden_bstride;
  const int32_t* ids; int64_t ids_bstride;
  const int32_t* expert_map; int64_t map_bstride;  // expert_map is null when absent
  int64_t batch, tokens, topk, hidden_size, elem_bytes;
  int64_t num_experts; int32_t num_local; int64_t align, rows;
  void* out; int32_t* group_sizes; int32_t* row_map;
  void* workspace; int64_t workspace_bytes;
};

// out[b,t] = sum_k w[b,t,k] * x[b, row_map[b,t,k]] over valid rows, in float32.
struct UnpermuteArgs {
  const void* x; Dtype x_dtype; int64_t x_bstride; int64_t rows;
  const int32_t* row_map; int64_t rm_bstride;
  const void* weights; Dtype w_dtype; int64_t w_bstride;  // weights null means 1
  int64_t batch, tokens, topk, hidden_size;
  void* out; Dtype out_dtype;
  // Optional residual [B or 1, T, H] of out's dtype: out = residual + the sum rounded to out's
  // dtype first (what XLA's add after the unpermute gives, bit for bit). Null: none.
  const void* residual = nullptr; int64_t res_bstride = 0;
};

// out[b,r] = sum over (t,k) with row_map[b,t,k] == r of w[b,t,k] * x[b,t], in float32,
// summed in ascending t*K+k; rows nothing maps to are zero.
struct ScatterArgs {
  const void* x; Dtype x_dtype; int64_t x_bstride;
  const int32_t* row_map; int64_t rm_bstride;
  const void* weights; Dtype w_dtype; int64_t w_bstride;
  int64_t batch, tokens, topk, hidden_size, rows;
  void* out; Dtype out_dtype;
  void* workspace; int64_t workspace_bytes;
};

// dw[b,t,k] = <ct[b,t], x[b, row_map[b,t,k]]> in float32, 0 for invalid rows.
struct WeightGradArgs {
  const void* ct; Dtype ct_dtype; int64_t ct_bstride;
  const void* x; Dtype x_dtype; int64_t x_bstride; int64_t rows;
  const int32_t* row_map; int64_t rm_bstride;
  int64_t batch, tokens, topk, hidden_size;
  void* out; Dtype out_dtype;
};

// Both cotangents of unpermute in one pass: out_x[b,r] = sum over (t,k) with row_map[b,t,k] == r
// of w[b,t,k] * ct[b,t] (a scatter; rows nothing maps to are zero) and out_w[b,t,k] =
// <ct[b,t], x[b, row_map[b,t,k]]> (0 for invalid rows), both in float32.
struct UnpermuteBwdArgs {
  const void* ct; Dtype ct_dtype; int64_t ct_bstride;
  const void* x; Dtype x_dtype; int64_t x_bstride; int64_t rows;
  const int32_t* row_map; int64_t rm_bstride;
  const void* weights; Dtype w_dtype; int64_t w_bstride;
  int64_t batch, tokens, topk, hidden_size;
  void* out_x; Dtype out_x_dtype; void* out_w; Dtype out_w_dtype;
  void* workspace; int64_t workspace_bytes;
};

// route's choice and gates, one token (row) at a time: scores = softmax or sigmoid of the logits
// in float32; choice = scores + bias, restricted to the topk_groups best of num_groups equal
// groups (a group scored by the sum of its two best choice values) when num_groups > 0; ids = the
// top-k of the choice (larger first, equal values in ascending expert order, -0.0 below +0.0);
// weights = the scores of ids, divided by their sum (+1e-20 for sigmoid) when renormalize, times
// scale.
enum class Scoring : int32_t { kSoftmax = 0, kSigmoid = 1 };
constexpr int64_t kRouterMaxExperts = 1024;  // the kernels hold a row on the stack / in registers

struct RouterArgs {
  const void* logits; Dtype logits_dtype;               // [T, E] float32, bfloat16 or float16
  const float* bias; int64_t bias_rstride;              // [1 or T, E]; null when absent
  int64_t tokens, experts, topk;
  Scoring scoring; bool renormalize;
  int64_t num_groups, topk_groups;                      // num_groups 0: no groups
  float scale;
  float* weights; int32_t* ids;                         // [T, K]
};

// logits = x · weight in float32, then route them (RouterArgs, whose logits field is unused).
struct RouterHiddenArgs {
  const void* x; const void* weight; Dtype dtype;       // x [T, H], weight [H, E]: bfloat16 or float16
  int64_t hidden;
  float* logits;                                        // [T, E]
  RouterArgs route;
  // Stacked routers: weight [layers, H, E] and route.bias [layers, E] (row stride 0), the layer
  // read on the device, wrapped and clamped as dynamic_slice does. Null: one router.
  const int32_t* layer = nullptr;
  int64_t layers = 1;
};

}  // namespace moe
