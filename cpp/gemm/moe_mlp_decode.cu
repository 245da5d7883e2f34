// The routed experts' MLP of a decode step in two launches, straight from the tokens:
//   out[t] = sum_k weights[t, k] * (act(x[t] · w_in[ids[t, k]]) · w_out[ids[t, k]])
// for calls with a few (token, expert) pairs per expert, where the time is the weight read. It
// replaces permute, the two grouped GEMMs with their partial-sum kernels, the activation and the
// weighted unpermute (seven launches) of the unfused path. Two forms, chosen at launch: the split
// form (here) and the slice form (below, for few units of work).
//
// The split form. Launch 1 (gate_up): a block takes one pair p = (t, k), a strip of 256 columns
// of w_in and one of S1 row ranges (split-K), stages its slice of x[t] in shared memory (no
// permuted copy) and writes float32 partial sums [S1, P, 2F]. Its first block also zeroes the
// arrival counters of launch 2. Both launches issue their first weight loads before that prologue.
// Launch 2 (down): a block takes a pair, a strip of 256 output columns and one of S2 ranges of
// w_out's F rows; it adds launch 1's S1 partials of its F range in a fixed order, rounds them as
// the unfused path stores them (gate_up in the element type), applies the activation (rounded
// again), streams its rows of w_out and writes float32 partials [S2, P, H']. The last block to
// arrive for a (token, strip) (an atomic counter per token and strip) adds the K x S2 partials
// in a fixed order, rounding each expert's output to the element type before the weighted sum, as
// the unfused path does: results are bitwise reproducible and equal that path's to rounding.
//
// Launch 2 is a programmatic dependent launch of launch 1 (PDL): its blocks take the SMs launch 1's
// blocks leave and issue their first weight loads, then wait for launch 1's grid before its sums.
// Pairs whose id lies outside [0, E) contribute nothing. Grids depend on the shapes only (graph
// safe); no host work, no setup kernel.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <cooperative_groups.h>

#include "cuda_check.h"
#include "decode_common.cuh"
#include "moe_mlp_decode.h"

namespace moe::gemm {
namespace {

using namespace decode;

constexpr int kBatch = 8;            // weight rows a warp loads per step (12 measured slower)
constexpr int kMinSplitRows = 128;   // a split reads at least this many rows of a matrix
constexpr int kMaxInRows = 8192;     // H rows per split of launch 1 (its slice of x in shared memory)
constexpr int kMaxDownRows = 4096;   // F rows per split of launch 2 (its activations in shared memory)
constexpr int kMaxSplits = 64;

struct Plan {
  int64_t pairs = 0, in_strips = 0, out_strips = 0;
  int in_splits = 1, out_splits = 1;
  int64_t in_split_rows = 0, out_split_rows = 0;
  int64_t gate_up_offset = 0, out_offset = 0, arrivals_offset = 0, bytes = 0;  // workspace layout
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Splits that make about one wave of resident blocks, at least kMinSplitRows rows each.
int splits_for(int64_t blocks, int64_t rows, int64_t fewest) {
  const int64_t want = std::max<int64_t>(1, kBlocksPerSm * int64_t(sm_count()) / std::max<int64_t>(1, blocks));
  const int64_t most = std::max<int64_t>(fewest, std::min<int64_t>(kMaxSplits, rows / kMinSplitRows));
  return int(std::clamp<int64_t>(want, fewest, most));
}

Plan plan_of(const MoeMlpDecodeArgs& a) {
  Plan p;
  p.pairs = a.tokens * a.top_k;
  p.in_strips = ceil_div(a.in_cols, kStrip);
  p.out_strips = ceil_div(a.out_cols, kStrip);
  p.in_splits = splits_for(p.pairs * p.in_strips, a.hidden, ceil_div(a.hidden, kMaxInRows));
  p.in_split_rows = std::min<int64_t>(kMaxInRows, round_up(ceil_div(a.hidden, p.in_splits), kVec));
  p.out_splits = splits_for(p.pairs * p.out_strips, a.ffn, ceil_div(a.ffn, kMaxDownRows));
  p.out_split_rows = std::min<int64_t>(kMaxDownRows, round_up(ceil_div(a.ffn, p.out_splits), kVec));
  p.gate_up_offset = 0;
  p.out_offset = align256(p.in_splits * p.pairs * a.in_cols * int64_t(sizeof(float)));
  p.arrivals_offset = p.out_offset + align256(p.out_splits * p.pairs * a.out_cols * int64_t(sizeof(float)));
  p.bytes = p.arrivals_offset + align256(a.tokens * p.out_strips * int64_t(sizeof(int32_t)));
  return p;
}

// Programmatic dependent launch: launch 1 lets launch 2 start early; launch 2 waits for launch 1's
// completion and memory before reading its results (a no-op when launched without the attribute).
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }
__device__ __forceinline__ float gelu(float g) { return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)); }

template <MlpActivation A>
__device__ __forceinline__ float activate(float g) {
  if constexpr (A == MlpActivation::kSwiglu) return silu(g);
  else if constexpr (A == MlpActivation::kGeglu || A == MlpActivation::kGelu) return gelu(g);
  else return fmaxf(g, 0.0f);
}

constexpr bool gated(MlpActivation a) { return a == MlpActivation::kSwiglu || a == MlpActivation::kGeglu; }

// Rows of a block's strip of w, kBatch rows a step. kWarpRows: warp w takes rows k_begin + w,
// + kWarps, ... below k_end (the warps split the rows, and their sums are added afterwards);
// otherwise each warp takes every row (its own strip). A block issues its first step before its
// prologue (staging x, or the activations), so that the weight read starts at once, and each
// step's loads before the previous step's multiplies: two steps, 16 loads a thread, in flight.
template <class E, bool kWarpRows = true>
struct WeightRows {
  const E* __restrict__ w;
  int64_t n, k_begin, k_end, col;
  bool col_ok;

  static constexpr int kRowStride = kWarpRows ? kWarps : 1;
  __device__ __forceinline__ static int first_row() { return kWarpRows ? int(threadIdx.x / 32) : 0; }

  __device__ __forceinline__ void load(int64_t k0, uint4 (&wv)[kBatch]) const {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t k = k0 + u * kRowStride + first_row();
      wv[u] = col_ok && k < k_end ? load_stream(w + k * n + col) : make_uint4(0, 0, 0, 0);
    }
  }

  // acc[c] += v(k) * w[k, col + c] over the thread's rows; wv holds the first step's loads.
  template <class V>
  __device__ __forceinline__ void multiply(V v, uint4 (&wv)[kBatch], float (&acc)[kVec]) const {
    constexpr int64_t kStep = kBatch * kRowStride;
#pragma unroll 1
    for (int64_t k0 = k_begin; k0 < k_end; k0 += kStep) {
      uint4 next[kBatch];
      load(k0 + kStep, next);
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t k = k0 + u * kRowStride + first_row();
        const float vk = k < k_end ? v(k) : 0.0f;
        float wf[kVec];
        to_float8<E>(wv[u], wf);
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc[c] = fmaf(vk, wf[c], acc[c]);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) wv[u] = next[u];
    }
  }
};

// The warps' sums of one strip added in warp order; thread j returns column j's (kStrip = kThreads).
__device__ __forceinline__ float sum_over_warps(const float (&acc)[kVec], float (&red)[kWarps][kStrip]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int c = 0; c < kVec; ++c) red[warp][lane * kVec + c] = acc[c];
  __syncthreads();
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red[w][threadIdx.x];
  return sum;
}

// The block's product of x[t]'s rows [rows.k_begin, rows.k_end) with its rows of w_in (the first
// step's loads in wv): x's rows staged in shared memory (xs), then the warps' sums added; thread j
// returns strip column j's.
template <class E>
__device__ __forceinline__ float x_times_rows(const MoeMlpDecodeArgs& a, int64_t t, const WeightRows<E>& rows,
                                              uint4 (&wv)[kBatch], E* xs, float (&red)[kWarps][kStrip]) {
  const E* x = static_cast<const E*>(a.x) + t * a.hidden;  // rows of 16-byte multiples (hidden % kVec == 0)
  for (int64_t k = rows.k_begin + threadIdx.x * kVec; k < rows.k_end; k += kThreads * kVec)
    *reinterpret_cast<uint4*>(xs + (k - rows.k_begin)) = *reinterpret_cast<const uint4*>(x + k);
  __syncthreads();
  float acc[kVec] = {};
  rows.multiply([&](int64_t k) { return to_float(xs[k - rows.k_begin]); }, wv, acc);
  return sum_over_warps(acc, red);
}

__device__ __forceinline__ bool valid_expert(int32_t e, int64_t experts) { return e >= 0 && e < experts; }

// The index of expert e's matrix in w_in / w_out: stacked weights add the layer's E experts.
__device__ __forceinline__ int64_t weight_index(const MoeMlpDecodeArgs& a, int32_t e) {
  return a.layer == nullptr ? e : stacked_layer(a.layer, a.layers) * a.experts + e;
}

// Rows [first, first + count) of expert e's w_in (clipped to H), from column col.
template <class E>
__device__ __forceinline__ WeightRows<E> w_in_rows(const MoeMlpDecodeArgs& a, int32_t e, int64_t first, int64_t count,
                                                   int64_t col, bool col_ok) {
  const int64_t k_begin = std::min(a.hidden, first), k_end = std::min(a.hidden, k_begin + count);
  const E* w_in = static_cast<const E*>(a.w_in) + weight_index(a, e) * a.hidden * a.in_cols;
  return WeightRows<E>{w_in, a.in_cols, k_begin, k_end, col, col_ok};
}

template <class E>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) gate_up_kernel(MoeMlpDecodeArgs a, Plan plan) {
  __shared__ float red[kWarps][kStrip];
  __shared__ alignas(16) E xs[kMaxInRows];  // the split's slice of x[t]
  float* partials = reinterpret_cast<float*>(static_cast<char*>(a.workspace) + plan.gate_up_offset);
  int32_t* arrivals = reinterpret_cast<int32_t*>(static_cast<char*>(a.workspace) + plan.arrivals_offset);
  launch_dependents();  // launch 2 may start its weight reads as this grid's blocks retire
  if (blockIdx.x == 0 && blockIdx.y == 0)  // launch 2 reads them after this one: its counters start at zero
    for (int64_t i = threadIdx.x; i < a.tokens * plan.out_strips; i += kThreads) arrivals[i] = 0;
  const int64_t p = blockIdx.y, t = p / a.top_k;
  const int32_t e = a.ids[p];
  if (!valid_expert(e, a.experts)) return;
  const int64_t split = blockIdx.x % plan.in_splits, col0 = int64_t(blockIdx.x / plan.in_splits) * kStrip;
  const int64_t col = col0 + (threadIdx.x % 32) * kVec;
  const WeightRows<E> rows = w_in_rows<E>(a, e, split * plan.in_split_rows, plan.in_split_rows, col, col < a.in_cols);
  uint4 wv[kBatch];
  rows.load(rows.k_begin, wv);
  const float sum = x_times_rows(a, t, rows, wv, xs, red);
  if (col0 + threadIdx.x < a.in_cols) partials[(split * plan.pairs + p) * a.in_cols + col0 + threadIdx.x] = sum;
}

// out[i] = the weighted sum, rounded to E, plus the residual where there is one: in float32, rounded
// once more, as XLA adds two arrays of E.
template <class E>
__device__ __forceinline__ void store_output(const MoeMlpDecodeArgs& a, int64_t i, float sum) {
  float value = round_to<E>(sum);
  if (a.residual != nullptr) value += to_float(static_cast<const E*>(a.residual)[i]);
  static_cast<E*>(a.out)[i] = from_float<E>(value);
}

template <class E, MlpActivation A>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) down_kernel(MoeMlpDecodeArgs a, Plan plan) {
  __shared__ float red[kWarps][kStrip];
  __shared__ float h[kMaxDownRows];
  __shared__ float gates[kThreads];  // the last block's: weights of kThreads of the token's pairs
  __shared__ bool routed[kThreads];  // and whether each has an expert
  __shared__ bool last;
  const float* gate_up = reinterpret_cast<const float*>(static_cast<const char*>(a.workspace) + plan.gate_up_offset);
  float* partials = reinterpret_cast<float*>(static_cast<char*>(a.workspace) + plan.out_offset);
  int32_t* arrivals = reinterpret_cast<int32_t*>(static_cast<char*>(a.workspace) + plan.arrivals_offset);
  const int64_t p = blockIdx.y, t = p / a.top_k, P = plan.pairs;
  const int64_t split = blockIdx.x % plan.out_splits, strip = blockIdx.x / plan.out_splits, col0 = strip * kStrip;
  const int32_t e = a.ids[p];
  float sum = 0.0f;  // this thread's column of the block's partial (zero for a pair without an expert)
  if (valid_expert(e, a.experts)) {
    const int64_t f_begin = std::min(a.ffn, split * plan.out_split_rows);
    const int64_t f_end = std::min(a.ffn, f_begin + plan.out_split_rows);
    const int64_t col = col0 + (threadIdx.x % 32) * kVec;
    const E* w_out = static_cast<const E*>(a.w_out) + weight_index(a, e) * a.ffn * a.out_cols;
    const WeightRows<E> rows{w_out, a.out_cols, f_begin, f_end, col, col < a.out_cols};
    uint4 wv[kBatch];
    rows.load(f_begin, wv);
    wait_for_previous_grid();  // launch 1's sums (and zeroed counters) are complete from here on
    for (int64_t f = f_begin + threadIdx.x; f < f_end; f += kThreads) {
      float g = 0.0f, u = 0.0f;
#pragma unroll 8
      for (int s = 0; s < plan.in_splits; ++s) {
        const float* row = gate_up + (s * P + p) * a.in_cols;
        g += __ldcg(row + f);
        if constexpr (gated(A)) u += __ldcg(row + a.ffn + f);
      }
      float value = activate<A>(round_to<E>(g));
      if constexpr (gated(A)) value = round_to<E>(value) * round_to<E>(u);
      h[f - f_begin] = round_to<E>(value);
    }
    __syncthreads();
    float acc[kVec] = {};
    rows.multiply([&](int64_t f) { return h[f - f_begin]; }, wv, acc);
    sum = sum_over_warps(acc, red);
  }
  wait_for_previous_grid();  // (again for a pair without an expert: the counters)
  if (col0 + threadIdx.x < a.out_cols) partials[(split * P + p) * a.out_cols + col0 + threadIdx.x] = sum;
  // The last of the K x S2 blocks of (t, strip) adds their partials.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0)
    last = atomicAdd(arrivals + t * plan.out_strips + strip, 1) == int(a.top_k * plan.out_splits) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int64_t col = col0 + threadIdx.x;
  const bool col_ok = col < a.out_cols;
  // Over the terms (k, s) in order, 16 loads in flight: y_k = sum_s partial, out = sum_k w_k * y_k.
  // The pairs' gates are staged first (kThreads pairs at a time): loaded inside the serial sum, each
  // would cost a memory latency. Counters, not divisions: 64-bit division costs tens of instructions.
  const float* column = partials + t * a.top_k * a.out_cols + col;
  float out = 0.0f;
  for (int64_t k_base = 0; k_base < a.top_k; k_base += kThreads) {
    const int pairs = int(std::min<int64_t>(kThreads, a.top_k - k_base));
    __syncthreads();  // the previous chunk's gates are read
    if (threadIdx.x < pairs) {
      const int64_t q = t * a.top_k + k_base + threadIdx.x;
      routed[threadIdx.x] = valid_expert(a.ids[q], a.experts);
      gates[threadIdx.x] = a.weights[q];
    }
    __syncthreads();
    if (!col_ok) continue;
    const int terms = pairs * plan.out_splits;
    const float* chunk = column + k_base * a.out_cols;
    float y = 0.0f;
    int k = 0, s = 0;  // of the next term to add
    for (int i0 = 0; i0 < terms; i0 += 16) {
      float v[16];
      int lk = k, ls = s;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        v[j] = i0 + j < terms ? __ldcg(chunk + (int64_t(ls) * P + lk) * a.out_cols) : 0.0f;
        if (++ls == plan.out_splits) ls = 0, ++lk;
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        if (i0 + j >= terms) break;
        y += v[j];
        if (++s == plan.out_splits) {
          if (routed[k]) out += gates[k] * round_to<E>(y);
          y = 0.0f, s = 0, ++k;
        }
      }
    }
  }
  if (col_ok) store_output<E>(a, t * a.out_cols + col, out);
}

// ---- The slice form: one cluster per (pair, slice of F), then a sum launch -------------------
//
// The split form above waits, between its launches, for every block of launch 1: launch 2's blocks
// start as launch 1's retire and stream only 192 rows each (Qwen3) between that wait and the
// cross-block sum (docs/layer.md, "The decode MLP"). Here a thread-block cluster takes a
// pair p and a slice of F (128 gate and 128 up columns of w_in, or 256 columns ungated): its C
// blocks split H, add their sums of the slice in distributed shared memory, apply the activation
// and go on to the slice's rows of w_out (each block a share of them, every output column), then
// add their output sums in distributed shared memory and write one float32 partial [P, R, H'] per
// cluster. No block waits for another cluster: a cluster's w_out rows follow its own w_in rows.
// A second, dependent launch adds the partials of each token in a fixed order (no counters).

constexpr int kMaxCluster = 8;        // portable cluster size
constexpr int kMaxSliceRows = 8192;   // H rows per block (its slice of x in shared memory)
constexpr int kMaxSliceOut = 8192;    // H' (a block's output sums in shared memory)
constexpr int kSumCols = 64;          // output columns per block of the sum launch
constexpr int kSumGroups = kThreads / kSumCols;  // threads adding one column, each a share of the K pairs

struct SlicePlan {
  int64_t pairs = 0, slices = 0, slice_ffn = 0;  // P, R slices of slice_ffn F columns each
  int cluster = 1;
  int64_t rows_per_block = 0, down_rows_per_block = 0, out_strips = 0;
  int64_t partials_bytes = 0;
  size_t shared_bytes = 0;
};

SlicePlan slice_plan_of(const MoeMlpDecodeArgs& a, int forced_cluster) {
  SlicePlan p;
  p.pairs = a.tokens * a.top_k;
  p.slice_ffn = gated(a.activation) ? kStrip / 2 : kStrip;
  p.slices = ceil_div(a.ffn, p.slice_ffn);
  const int64_t units = std::max<int64_t>(1, p.pairs * p.slices);
  int c = forced_cluster;
  if (c <= 0) {  // the largest power of two that keeps the grid within one wave of resident blocks
                 // (clusters of 5 and 6 blocks measured 25% slower than of 4 for Qwen3 on an H100)
    c = 1;
    while (2 * c <= kMaxCluster && units * 2 * c <= int64_t(kBlocksPerSm) * sm_count()) c *= 2;
  }
  // Fewer blocks than H rows of 16 bytes, and each block's x slice within shared memory.
  c = int(std::clamp<int64_t>(c, ceil_div(a.hidden, kMaxSliceRows), std::max<int64_t>(1, a.hidden / kVec)));
  p.cluster = std::min(c, kMaxCluster);
  p.rows_per_block = round_up(ceil_div(a.hidden, p.cluster), kVec);
  p.down_rows_per_block = ceil_div(p.slice_ffn, p.cluster);
  p.out_strips = ceil_div(a.out_cols, kStrip);
  p.partials_bytes = align256(p.pairs * p.slices * a.out_cols * int64_t(sizeof(float)));
  p.shared_bytes = sizeof(float) * (kWarps * kStrip + 3 * kStrip + p.out_strips * kStrip) +
                   sizeof(uint16_t) * p.rows_per_block;
  return p;
}

bool slice_form_fits(const MoeMlpDecodeArgs& a, const SlicePlan& p) {
  return a.ffn % kVec == 0 && a.out_cols <= kMaxSliceOut && p.rows_per_block <= kMaxSliceRows &&
         p.cluster <= kMaxCluster && p.pairs <= 65535 && p.slices * p.cluster <= INT32_MAX && a.tokens <= 65535;
}

// Dynamic shared memory of a slice block, in that order: the warps' sums, the block's sums of the
// slice's w_in columns (read by the cluster), their cluster totals, the activations, the block's
// output sums (read by the cluster), its rows of x.
struct SliceShared {
  float (*red)[kWarps][kStrip];
  float* part;  // [kStrip]
  float* total; // [kStrip]
  float* h;     // [kStrip]
  float* outs;  // [out_strips * kStrip]
  void* xs;     // [rows_per_block] elements

  __device__ SliceShared(char* base, const SlicePlan& p) {
    red = reinterpret_cast<float(*)[kWarps][kStrip]>(base);
    part = reinterpret_cast<float*>(base) + kWarps * kStrip;
    total = part + kStrip;
    h = total + kStrip;
    outs = h + kStrip;
    xs = outs + p.out_strips * kStrip;
  }
};

template <class E, MlpActivation A>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) slice_kernel(MoeMlpDecodeArgs a, SlicePlan plan) {
  namespace cg = cooperative_groups;
  extern __shared__ __align__(16) char shared[];
  const SliceShared sm(shared, plan);
  E* xs = static_cast<E*>(sm.xs);
  launch_dependents();  // the sum launch may start; it waits for this grid before reading
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int64_t p = blockIdx.y, t = p / a.top_k, slice = blockIdx.x / plan.cluster;
  const int32_t e = a.ids[p];
  if (!valid_expert(e, a.experts)) return;  // the whole cluster (one pair): its partial is never read
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t f0 = slice * plan.slice_ffn;

  // w_in: this block's H rows of the slice's columns; lane l holds 8 of them.
  const int64_t c8 = int64_t(lane) * kVec;
  const int64_t f_lane = f0 + (gated(A) ? c8 % plan.slice_ffn : c8);
  const int64_t in_col = (gated(A) && c8 >= plan.slice_ffn ? a.ffn : 0) + f_lane;
  const WeightRows<E> in_rows =
      w_in_rows<E>(a, e, rank * plan.rows_per_block, plan.rows_per_block, in_col, f_lane < a.ffn);
  uint4 wv[kBatch];
  in_rows.load(in_rows.k_begin, wv);
  sm.part[threadIdx.x] = x_times_rows(a, t, in_rows, wv, xs, *sm.red);  // thread j: slice column j's

  // w_out: this block's share of the slice's F rows, warp w across strips w, w + kWarps, ... of
  // every output column. Its first loads go out before the cluster's exchange.
  const int64_t f_begin = std::min(a.ffn, f0 + rank * plan.down_rows_per_block);
  const int64_t f_end = std::min({a.ffn, f0 + plan.slice_ffn, f_begin + plan.down_rows_per_block});
  const E* w_out = static_cast<const E*>(a.w_out) + weight_index(a, e) * a.ffn * a.out_cols;
  auto out_rows = [&](int64_t strip) {
    const int64_t col = strip * kStrip + c8;
    return WeightRows<E, false>{w_out, a.out_cols, f_begin, f_end, col, col < a.out_cols};
  };
  if (warp < plan.out_strips) out_rows(warp).load(f_begin, wv);

  cluster.sync();  // every block's part is complete
  {
    float sum = 0.0f;
    for (int q = 0; q < plan.cluster; ++q) sum += cluster.map_shared_rank(sm.part, q)[threadIdx.x];
    sm.total[threadIdx.x] = sum;
  }
  __syncthreads();
  // The activation of the slice's F columns, rounded as the unfused path stores gate_up and h.
  if (threadIdx.x < plan.slice_ffn && f0 + threadIdx.x < a.ffn) {
    float value = activate<A>(round_to<E>(sm.total[threadIdx.x]));
    if constexpr (gated(A)) value = round_to<E>(value) * round_to<E>(sm.total[plan.slice_ffn + threadIdx.x]);
    sm.h[threadIdx.x] = round_to<E>(value);
  }
  __syncthreads();
  for (int64_t strip = warp; strip < plan.out_strips; strip += kWarps) {
    const WeightRows<E, false> rows = out_rows(strip);
    if (strip != warp) rows.load(f_begin, wv);
    float out[kVec] = {};
    rows.multiply([&](int64_t f) { return sm.h[f - f0]; }, wv, out);
#pragma unroll
    for (int c = 0; c < kVec; ++c) sm.outs[strip * kStrip + c8 + c] = out[c];
  }
  cluster.sync();  // every block's outs are complete (and its reads of the others' part done)
  // Block `rank` adds the cluster's output sums of strips rank, rank + C, ... in rank order.
  float* partial = reinterpret_cast<float*>(a.workspace) + (p * plan.slices + slice) * a.out_cols;
  for (int64_t strip = rank; strip < plan.out_strips; strip += plan.cluster) {
    const int64_t col = strip * kStrip + threadIdx.x;
    if (col >= a.out_cols) continue;
    float sum = 0.0f;
    for (int q = 0; q < plan.cluster; ++q) sum += cluster.map_shared_rank(sm.outs, q)[strip * kStrip + threadIdx.x];
    partial[col] = sum;
  }
  cluster.sync();  // a block's shared memory outlives the other blocks' reads of it
}

// out[t, col] = sum_k weights[t, k] * round(sum_r partial[t K + k, r, col]): kSumGroups threads a
// column, thread group g over pairs k = g, g + kSumGroups, ..., their sums added in group order.
template <class E>
__global__ void __launch_bounds__(kThreads) slice_sum_kernel(MoeMlpDecodeArgs a, SlicePlan plan) {
  __shared__ float sums[kSumGroups][kSumCols];
  const int64_t t = blockIdx.y, col = int64_t(blockIdx.x) * kSumCols + threadIdx.x % kSumCols;
  const int group = threadIdx.x / kSumCols;
  const bool col_ok = col < a.out_cols;
  wait_for_previous_grid();  // the partials are complete from here on
  const float* partials = reinterpret_cast<const float*>(a.workspace);
  float out = 0.0f;
  for (int64_t k = group; col_ok && k < a.top_k; k += kSumGroups) {
    const int64_t q = t * a.top_k + k;
    if (!valid_expert(a.ids[q], a.experts)) continue;
    const float* column = partials + q * plan.slices * a.out_cols + col;
    float y = 0.0f;
#pragma unroll 8
    for (int64_t r = 0; r < plan.slices; ++r) y += __ldcg(column + r * a.out_cols);
    out += a.weights[q] * round_to<E>(y);
  }
  sums[group][threadIdx.x % kSumCols] = out;
  __syncthreads();
  if (group != 0 || !col_ok) return;
  float total = 0.0f;
#pragma unroll
  for (int g = 0; g < kSumGroups; ++g) total += sums[g][threadIdx.x];
  store_output<E>(a, t * a.out_cols + col, total);
}

// JAX_MOE_PERMUTE_DECODE_PDL=0 launches the two kernels one after the other, for profiles that
// sum kernel times (CUPTI): with PDL launch 2's time includes its wait for launch 1.
bool dependent_launch_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_MOE_PERMUTE_DECODE_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

// One launch of `kernel` (kThreads a block): `dependent` as a programmatic dependent launch after the
// stream's previous launch (PDL), `cluster` > 0 as clusters of that many blocks.
template <class Kernel, class P>
cudaError_t launch_kernel(Kernel kernel, dim3 grid, size_t shared_bytes, int cluster, bool dependent,
                          const MoeMlpDecodeArgs& a, const P& plan, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  int count = 0;
  if (dependent) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 0) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = unsigned(cluster);
    attributes[count].val.clusterDim.y = attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  MOE_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, a, plan));
  return cudaGetLastError();
}

template <class E, MlpActivation A>
cudaError_t launch_split(const MoeMlpDecodeArgs& a, const Plan& plan, cudaStream_t stream) {
  gate_up_kernel<E><<<dim3(unsigned(plan.in_strips * plan.in_splits), unsigned(plan.pairs)), kThreads, 0, stream>>>(
      a, plan);
  MOE_CHECK_LAUNCH();
  // Launch 2's blocks start as launch 1's retire and stream their rows of w_out while launch 1
  // finishes; they wait for it before reading its sums.
  return launch_kernel(down_kernel<E, A>, dim3(unsigned(plan.out_strips * plan.out_splits), unsigned(plan.pairs)), 0,
                       0, dependent_launch_enabled(), a, plan, stream);
}

// The most dynamic shared memory a slice block takes (kMaxSliceOut outputs, kMaxSliceRows of x).
constexpr size_t kMaxSliceShared = sizeof(float) * (kWarps * kStrip + 3 * kStrip + kMaxSliceOut) +
                                   sizeof(uint16_t) * kMaxSliceRows;

template <class E, MlpActivation A>
cudaError_t launch_slices(const MoeMlpDecodeArgs& a, const SlicePlan& plan, cudaStream_t stream) {
  if (plan.shared_bytes > 48 * 1024)  // past the default: opt in (on the current device; wide outputs only)
    MOE_CUDA_TRY(cudaFuncSetAttribute(slice_kernel<E, A>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(kMaxSliceShared)));
  const dim3 grid(unsigned(plan.slices * plan.cluster), unsigned(plan.pairs));
  MOE_CUDA_TRY(launch_kernel(slice_kernel<E, A>, grid, plan.shared_bytes, plan.cluster, false, a, plan, stream));
  return launch_kernel(slice_sum_kernel<E>, dim3(unsigned(ceil_div(a.out_cols, kSumCols)), unsigned(a.tokens)), 0, 0,
                       dependent_launch_enabled(), a, plan, stream);
}

// Which form runs: JAX_MOE_PERMUTE_DECODE_MLP=split|slices forces one where it fits, and with
// slices JAX_MOE_PERMUTE_DECODE_CLUSTER=n its cluster size (A/B switches, read at every launch:
// unset, one getenv a launch).
struct FormSwitch {
  bool slices = false, split = false;
  int cluster = 0;  // 0: the plan's
};

FormSwitch form_switch() {
  FormSwitch f;
  if (const char* v = std::getenv("JAX_MOE_PERMUTE_DECODE_MLP")) {
    f.slices = std::string(v) == "slices", f.split = std::string(v) == "split";
    if (f.slices)
      if (const char* c = std::getenv("JAX_MOE_PERMUTE_DECODE_CLUSTER")) f.cluster = std::atoi(c);
  }
  return f;
}

// The rule: the slice form where its units (pair, slice) number at most a quarter of a wave of
// resident blocks, so that each gets a cluster of 4 or more (Qwen3-30B-A3B at T = 1: 48 units on
// 132 SMs); with more units it measured even with the split form or slower (Mixtral).
bool slice_form_chosen(const MoeMlpDecodeArgs& a, const SlicePlan& plan, const FormSwitch& f) {
  if (!slice_form_fits(a, plan) || f.split) return false;
  return f.slices || 4 * plan.pairs * plan.slices <= int64_t(kBlocksPerSm) * sm_count();
}

template <class E, MlpActivation A>
cudaError_t launch(const MoeMlpDecodeArgs& a, const Plan& plan, const SlicePlan& slices, bool use_slices,
                   cudaStream_t stream) {
  return use_slices ? launch_slices<E, A>(a, slices, stream) : launch_split<E, A>(a, plan, stream);
}

template <class E, class... Rest>
cudaError_t launch_activation(const MoeMlpDecodeArgs& a, const Rest&... rest) {
  switch (a.activation) {
    case MlpActivation::kSwiglu: return launch<E, MlpActivation::kSwiglu>(a, rest...);
    case MlpActivation::kGeglu: return launch<E, MlpActivation::kGeglu>(a, rest...);
    case MlpActivation::kGelu: return launch<E, MlpActivation::kGelu>(a, rest...);
    case MlpActivation::kRelu: return launch<E, MlpActivation::kRelu>(a, rest...);
  }
  return cudaErrorInvalidValue;
}

// Either form's workspace: the form is chosen at launch.
int64_t workspace_bytes(const Plan& plan, const SlicePlan& slices) {
  return std::max(plan.bytes, slices.partials_bytes);
}

}  // namespace

bool moe_mlp_decode_fits(const MoeMlpDecodeArgs& a) {
  const Plan plan = plan_of(a);
  const bool widths_ok = a.hidden % kVec == 0 && a.in_cols % kVec == 0 && a.out_cols % kVec == 0 &&
                         a.in_cols == (gated(a.activation) ? 2 * a.ffn : a.ffn);
  return widths_ok && plan.pairs <= 65535 && plan.in_strips * plan.in_splits <= INT32_MAX &&
         plan.out_strips * plan.out_splits <= INT32_MAX;
}

int64_t moe_mlp_decode_workspace_bytes(const MoeMlpDecodeArgs& a) {
  return workspace_bytes(plan_of(a), slice_plan_of(a, 0));
}

cudaError_t moe_mlp_decode(Dtype dtype, const MoeMlpDecodeArgs& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.out_cols == 0) return cudaSuccess;
  const size_t element = 2;  // bf16, f16
  if (a.top_k == 0 || a.hidden == 0 || a.ffn == 0)  // no pair contributes
    return cudaMemsetAsync(a.out, 0, size_t(a.tokens * a.out_cols) * element, stream);
  if (!moe_mlp_decode_fits(a)) return cudaErrorInvalidValue;
  const FormSwitch form = form_switch();
  const Plan plan = plan_of(a);
  const SlicePlan slices = slice_plan_of(a, form.cluster);
  if (a.workspace_bytes < workspace_bytes(plan, slices)) return cudaErrorInvalidValue;
  const bool use_slices = slice_form_chosen(a, slices, form);
  return dtype == Dtype::kBf16 ? launch_activation<__nv_bfloat16>(a, plan, slices, use_slices, stream)
                               : launch_activation<__half>(a, plan, slices, use_slices, stream);
}

}  // namespace moe::gemm
