// The grouped GEMM for decode-sized groups (a few rows per expert): out[rows of g] = lhs[rows of
// g] · rhs[g], each routed matrix streamed once from memory by CUDA cores. With 1-8 rows a group
// the work is the weight read (a tensor-core tile would be mostly padding).
//
// A block takes one group (its "slot"), a strip of 256 columns and one of S row ranges of the
// matrix (split-K, so that a handful of groups still fills every multiprocessor): each warp reads
// 512 contiguous bytes of a row at a time and applies them to all of the group's rows. With S = 1
// the block writes its output rows; with S > 1 it writes float32 partial sums to the workspace
// and a second kernel adds the S partials in a fixed order (bitwise reproducible) and zeroes the
// rows past the sum of the sizes.
//
// Grid: (strips x S, slots, batch). Slot s is the s-th group that has rows, found by each block
// from the group sizes with two block scans; there are min(G, M) + 1 slots, so the grid is static
// (graph-safe) and blocks of slots past the last group with rows return at once (with S = 1 the
// first of them zeroes the rows past the sum). No setup kernel, no host work.
#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "decode_common.cuh"
#include "grouped_gemm.h"

namespace moe::gemm {
namespace {

using namespace decode;

constexpr int kStageK = 1024;           // lhs columns staged in shared memory at a time
constexpr int kPassRows = 8;            // rows of a group applied per pass over its strip
constexpr int kMaxSlots = 65535;        // gridDim.y and gridDim.z
constexpr int kMinSplitRows = 256;      // a split reads at least this many rows of the matrix

struct Slot {
  int64_t start = 0;    // first row of the group
  int64_t rows = 0;     // clamped rows of the group
  int64_t covered = 0;  // rows covered by all groups (the tail starts here)
  int64_t group = -1;   // the slot's group, -1 if none
  int64_t active = 0;   // groups with rows
};

// The block's slot: clamped group starts (exclusive sums of the sizes) and ranks among groups
// with rows (exclusive sums of the flags), 256 groups at a time.
__device__ void find_slot(const int32_t* sizes, int64_t groups, int64_t rows, int64_t slot, Slot& out) {
  using RowScan = cub::BlockScan<int64_t, kThreads>;
  using RankScan = cub::BlockScan<int, kThreads>;
  __shared__ union {
    typename RowScan::TempStorage rows;
    typename RankScan::TempStorage ranks;
  } scan;
  int64_t rows_before = 0, active_before = 0;
  if (threadIdx.x == 0) out.group = -1;
  for (int64_t base = 0; base < groups; base += kThreads) {
    const int64_t g = base + threadIdx.x;
    const int64_t size = g < groups ? std::max(sizes[g], 0) : 0;
    int64_t prefix, chunk_rows;
    RowScan(scan.rows).ExclusiveSum(size, prefix, chunk_rows);
    __syncthreads();
    const int64_t start = std::min(rows_before + prefix, rows);
    const int64_t own = std::min(size, rows - start);
    int rank, chunk_active;
    RankScan(scan.ranks).ExclusiveSum(own > 0 ? 1 : 0, rank, chunk_active);
    __syncthreads();
    if (own > 0 && active_before + rank == slot) {
      out.group = g;
      out.start = start;
      out.rows = own;
    }
    rows_before += chunk_rows;
    active_before += chunk_active;
  }
  if (threadIdx.x == 0) {
    out.covered = std::min(rows_before, rows);
    out.active = active_before;
  }
  __syncthreads();
}

// The first R staged rows of one k, read as one shared-memory access.
template <class E, int R>
struct alignas(sizeof(E) * R) RowVector {
  E v[R];
};

template <class E>
union Shared {
  alignas(16) E x[kStageK][kPassRows];            // staged lhs, transposed: one vector of rows per k
  float partial[kWarps / 2][kPassRows][kStrip];  // the warps' sums, added pairwise
};

// Rows [0, rows) (rows <= R <= kPassRows) of x · w[k_begin:k_end, strip]: to out (S = 1, element
// type, row stride N) or to partial (S > 1, float32, row stride N).
template <class E, int R>
__device__ void multiply_rows(const E* __restrict__ x, int rows, const E* __restrict__ w, int64_t K, int64_t N,
                              int64_t k_begin, int64_t k_end, int64_t col0, E* __restrict__ out,
                              float* __restrict__ partial, Shared<E>& sh) {
  constexpr int kUnroll = R <= 2 ? 16 : R <= 4 ? 8 : 4;  // loads in flight per thread (registers allow)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col = col0 + int64_t(lane) * kVec;
  const bool col_ok = col < N;

  float acc[R][kVec] = {};
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kStageK) {
    const int stage = int(std::min<int64_t>(kStageK, k_end - k0));
    __syncthreads();  // the previous stage's readers are done
    for (int i = threadIdx.x; i < kStageK / kVec * R; i += kThreads) {
      const int r = i % R, kv = i / R;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < rows && kv * kVec < stage) v = *reinterpret_cast<const uint4*>(x + r * K + k0 + kv * kVec);
      const E* e = reinterpret_cast<const E*>(&v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sh.x[kv * kVec + j][r] = e[j];
    }
    __syncthreads();
    const E* w_stage = w + k0 * N + col;
    // Unrolled twice: the next step's loads are issued while this step's multiply.
#pragma unroll 2
    for (int s0 = 0; s0 < stage; s0 += kUnroll * kWarps) {
      uint4 wv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = s0 + u * kWarps + warp;
        wv[u] = col_ok && k < stage ? load_stream(w_stage + int64_t(k) * N) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = s0 + u * kWarps + warp;
        if (k >= kStageK) break;  // only in a stage's last step; x rows past `stage` are zero
        float wf[kVec];
        to_float8<E>(wv[u], wf);
        const RowVector<E, R> xk = *reinterpret_cast<const RowVector<E, R>*>(sh.x[k]);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float xr = to_float(xk.v[r]);
#pragma unroll
          for (int c = 0; c < kVec; ++c) acc[r][c] = fmaf(xr, wf[c], acc[r][c]);
        }
      }
    }
  }

  // The warps hold sums over different rows of w: add them pairwise through shared memory.
  __syncthreads();  // x is dead; its space holds the partial sums
#pragma unroll
  for (int half = kWarps / 2; half >= 1; half /= 2) {
    if (warp >= half && warp < 2 * half)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < kVec; ++c) sh.partial[warp - half][r][lane * kVec + c] = acc[r][c];
    __syncthreads();
    if (warp < half)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc[r][c] += sh.partial[warp][r][lane * kVec + c];
    __syncthreads();
  }
  if (warp == 0 && col_ok) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      if (partial != nullptr) {
        float4* p = reinterpret_cast<float4*>(partial + r * N + col);
        p[0] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
        p[1] = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
      } else {
        uint4 packed;
        E* e = reinterpret_cast<E*>(&packed);
#pragma unroll
        for (int c = 0; c < kVec; ++c) e[c] = from_float<E>(acc[r][c]);
        *reinterpret_cast<uint4*>(out + r * N + col) = packed;
      }
    }
  }
}

template <class E>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    decode_grouped_gemm(GroupedGemmArgs a, int splits, int64_t split_rows, float* partials, int64_t* covered) {
  __shared__ Slot slot;
  __shared__ Shared<E> sh;
  const int64_t b = blockIdx.z, M = a.rows, K = a.k, N = a.n;
  find_slot(a.group_sizes + b * a.sizes_batch_stride, a.groups, M, blockIdx.y, slot);
  const int64_t split = blockIdx.x % splits, col0 = int64_t(blockIdx.x / splits) * kStrip;
  E* out = static_cast<E*>(a.out) + b * M * N;
  float* partial = partials == nullptr ? nullptr : partials + (b * splits + split) * M * N;
  if (covered != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) covered[b] = slot.covered;
  if (slot.group < 0) {
    if (partials != nullptr || blockIdx.y != slot.active) return;
    // The first spare slot zeroes this strip of the rows past the sum of the sizes.
    for (int64_t i = threadIdx.x; i < (M - slot.covered) * (kStrip / kVec); i += kThreads) {
      const int64_t row = slot.covered + i / (kStrip / kVec), c = col0 + (i % (kStrip / kVec)) * kVec;
      if (c < N) *reinterpret_cast<uint4*>(out + row * N + c) = make_uint4(0, 0, 0, 0);
    }
    return;
  }
  const int64_t k_begin = split * split_rows, k_end = std::min(K, k_begin + split_rows);
  const E* lhs = static_cast<const E*>(a.lhs) + b * a.lhs_batch_stride + slot.start * K;
  const E* w = static_cast<const E*>(a.rhs) + b * a.rhs_batch_stride + slot.group * K * N;
  for (int64_t r0 = 0; r0 < slot.rows; r0 += kPassRows) {
    const int rows = int(std::min<int64_t>(kPassRows, slot.rows - r0));
    const E* x = lhs + r0 * K;
    const int64_t row = slot.start + r0;
    E* o = out + row * N;
    float* p = partial == nullptr ? nullptr : partial + row * N;
    if (rows == 1) multiply_rows<E, 1>(x, rows, w, K, N, k_begin, k_end, col0, o, p, sh);
    else if (rows == 2) multiply_rows<E, 2>(x, rows, w, K, N, k_begin, k_end, col0, o, p, sh);
    else if (rows <= 4) multiply_rows<E, 4>(x, rows, w, K, N, k_begin, k_end, col0, o, p, sh);
    else multiply_rows<E, 8>(x, rows, w, K, N, k_begin, k_end, col0, o, p, sh);
  }
}

// out[b, row] = the sum of the S partials in split order for covered rows, zero past them.
template <class E>
__global__ void __launch_bounds__(kThreads) add_partials(E* out, const float* partials, const int64_t* covered,
                                                         int splits, int64_t M, int64_t N) {
  const int64_t b = blockIdx.y, vecs = M * N / kVec;
  for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < vecs; v += int64_t(gridDim.x) * kThreads) {
    const int64_t i = v * kVec;
    float sum[kVec] = {};
    if (i / N < covered[b]) {
#pragma unroll 4
      for (int s = 0; s < splits; ++s) {
        const float4* p = reinterpret_cast<const float4*>(partials + (b * splits + s) * M * N + i);
        const float4 lo = p[0], hi = p[1];
        sum[0] += lo.x, sum[1] += lo.y, sum[2] += lo.z, sum[3] += lo.w;
        sum[4] += hi.x, sum[5] += hi.y, sum[6] += hi.z, sum[7] += hi.w;
      }
    }
    uint4 packed;
    E* e = reinterpret_cast<E*>(&packed);
#pragma unroll
    for (int c = 0; c < kVec; ++c) e[c] = from_float<E>(sum[c]);
    *reinterpret_cast<uint4*>(out + b * M * N + i) = packed;
  }
}

// Rows of the matrix per split: a multiple of 8 so every split starts on a 16-byte row boundary.
int64_t split_rows_of(int64_t k, int splits) { return ((k + splits - 1) / splits + kVec - 1) / kVec * kVec; }

template <class E>
cudaError_t launch_decode(const GroupedGemmArgs& a, int splits, cudaStream_t stream) {
  const int64_t slots = std::min(a.groups, a.rows) + 1, strips = (a.n + kStrip - 1) / kStrip;
  float* partials = nullptr;
  int64_t* covered = nullptr;
  if (splits > 1) {
    covered = static_cast<int64_t*>(a.workspace);
    partials = reinterpret_cast<float*>(static_cast<char*>(a.workspace) + align256(a.batch * sizeof(int64_t)));
  }
  dim3 grid(unsigned(strips * splits), unsigned(slots), unsigned(a.batch));
  decode_grouped_gemm<E><<<grid, kThreads, 0, stream>>>(a, splits, split_rows_of(a.k, splits), partials, covered);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess || splits == 1) return err;
  const int64_t vecs = a.rows * a.n / kVec;
  dim3 add_grid(unsigned(std::clamp<int64_t>((vecs + kThreads - 1) / kThreads, 1, 8 * sm_count())), unsigned(a.batch));
  add_partials<E><<<add_grid, kThreads, 0, stream>>>(static_cast<E*>(a.out), partials, covered, splits, a.rows, a.n);
  return cudaGetLastError();
}

}  // namespace

bool decode_gemm_fits(const GroupedGemmArgs& a) {
  return std::min(a.groups, a.rows) + 1 <= kMaxSlots && a.batch <= kMaxSlots;
}

int decode_splits(const GroupedGemmArgs& a) {
  // One wave of resident blocks when every slot has a group: a block's fixed costs (finding its
  // group, the sums across warps) are paid once and its loads stay in flight for longer.
  const int64_t blocks = std::max<int64_t>(1, std::min(a.groups, a.rows) * ((a.n + kStrip - 1) / kStrip) * a.batch);
  const int64_t want = std::max<int64_t>(1, kBlocksPerSm * int64_t(sm_count()) / blocks);
  return int(std::clamp<int64_t>(want, 1, std::max<int64_t>(1, std::min<int64_t>(64, a.k / kMinSplitRows))));
}

int64_t decode_workspace_bytes(const GroupedGemmArgs& a) {
  const int splits = decode_splits(a);
  if (splits == 1) return 0;
  return align256(a.batch * sizeof(int64_t)) + a.batch * splits * a.rows * a.n * int64_t(sizeof(float));
}

cudaError_t decode_grouped_gemm(Dtype dtype, const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.rows == 0 || a.n == 0) return cudaSuccess;
  if (!decode_gemm_fits(a)) return cudaErrorInvalidValue;
  // A workspace sized for fewer splits (none) runs unsplit: the same sums, fewer blocks.
  const int splits = a.workspace_bytes >= decode_workspace_bytes(a) ? decode_splits(a) : 1;
  return dtype == Dtype::kBf16 ? launch_decode<__nv_bfloat16>(a, splits, stream)
                               : launch_decode<__half>(a, splits, stream);
}

}  // namespace moe::gemm
