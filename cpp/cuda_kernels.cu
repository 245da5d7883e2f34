// CUDA kernels. Row layout: for small batches without padding, each entry's row counted by the
// block that copies it; otherwise entries ranked by local expert in shared memory (one launch for
// small batches, tiles + offsets for large ones; a CUB radix sort past 1023 local experts).
// Data movement: blocks over (token, chunk of the row), 16-byte vector accesses where rows
// are aligned, float32 accumulation.
#include "cuda_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>
#include <cub/cub.cuh>

#include "moe_index.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover anything larger

int blocks_for(int64_t items, int per_block = kThreads) {
  return static_cast<int>(std::max<int64_t>(1, std::min(kMaxBlocks, (items + per_block - 1) / per_block)));
}

// ---- element conversions ---------------------------------------------------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_f32(__nv_fp8_e5m2 x) { return static_cast<float>(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

template <typename T> struct Tag { using type = T; };

template <typename F>
void visit_input(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kF32: return f(Tag<float>{});
    case Dtype::kBF16: return f(Tag<__nv_bfloat16>{});
    case Dtype::kF16: return f(Tag<__half>{});
    case Dtype::kF8E4M3FN: return f(Tag<__nv_fp8_e4m3>{});
    case Dtype::kF8E5M2: return f(Tag<__nv_fp8_e5m2>{});
  }
}
template <typename F>
void visit_output(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kBF16: return f(Tag<__nv_bfloat16>{});
    case Dtype::kF16: return f(Tag<__half>{});
    default: return f(Tag<float>{});
  }
}

// V consecutive elements moved as one aligned access (V = 16 bytes / element, or 1).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec { T v[V]; };

template <typename T, int V>
__device__ __forceinline__ void load_f32(const T* p, float (&f)[V]) {
  const Vec<T, V> x = *reinterpret_cast<const Vec<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) f[i] = to_f32(x.v[i]);
}
template <typename T, int V>
__device__ __forceinline__ void store_f32(T* p, const float (&f)[V]) {
  Vec<T, V> x;
#pragma unroll
  for (int i = 0; i < V; ++i) x.v[i] = from_f32<T>(f[i]);
  *reinterpret_cast<Vec<T, V>*>(p) = x;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Multiprocessors of the current device, read once per device (no synchronisation).
int64_t multiprocessors() {
  static int cached[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int count = 0;
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    cached[device] = count > 0 ? count : 132;
  }
  return cached[device];
}

__device__ __forceinline__ float weight_at(const void* w, Dtype d, int64_t i) {
  if (w == nullptr) return 1.0f;
  switch (d) {
    case Dtype::kBF16: return to_f32(static_cast<const __nv_bfloat16*>(w)[i]);
    case Dtype::kF16: return to_f32(static_cast<const __half*>(w)[i]);
    default: return static_cast<const float*>(w)[i];
  }
}

// Writes a weight (or weight cotangent) of dtype d: float32, bfloat16 or float16.
__device__ __forceinline__ void store_weight(void* out, Dtype d, int64_t i, float value) {
  float v[1] = {value};
  switch (d) {
    case Dtype::kBF16: return store_f32<__nv_bfloat16, 1>(static_cast<__nv_bfloat16*>(out) + i, v);
    case Dtype::kF16: return store_f32<__half, 1>(static_cast<__half*>(out) + i, v);
    default: return store_f32<float, 1>(static_cast<float*>(out) + i, v);
  }
}

__device__ __forceinline__ int64_t lower_bound(const uint32_t* keys, int64_t n, uint64_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

int key_bits(uint64_t max_key) {
  int bits = 1;
  while (bits < 32 && (max_key >> bits) != 0) ++bits;
  return bits;
}

// Exclusive prefix sum of v over the block's threads in linear order (blockDim of any shape, at
// most 1024 threads); *total gets the block's sum. A warp-shuffle scan and one warp scanning the
// warp sums: two barriers, where a 1024-thread cub::BlockScan walks the 32 warp sums serially.
// `sums` is shared scratch of 33 values. Ends with a barrier, so `sums` can be reused at once.
template <typename T>
__device__ T block_exclusive_sum(T v, T* sums, T* total) {
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int id = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int lane = id % 32, warp = id / 32, warps = (threads + 31) / 32;
  const int in_warp = min(32, threads - warp * 32);  // the last warp may be partial
  const uint32_t mask = in_warp == 32 ? 0xffffffffu : (1u << in_warp) - 1;
  T x = v;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const T y = __shfl_up_sync(mask, x, d);
    if (lane >= d) x += y;
  }
  if (lane == in_warp - 1) sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const T own = lane < warps ? sums[lane] : T{};
    const uint32_t mask0 = threads >= 32 ? 0xffffffffu : mask;
    T y = own;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const T z = __shfl_up_sync(mask0, y, d);
      if (lane >= d) y += z;
    }
    if (lane < warps) sums[lane] = y - own;
    if (lane == warps - 1) sums[32] = y;
  }
  __syncthreads();
  const T result = sums[warp] + x - v;
  *total = sums[32];
  __syncthreads();
  return result;
}

// ---- workspace ---------------------------------------------------------------------------
// Sorted-key workspace: keys and values in and out, then `extra` int32s, then CUB's storage.
struct SortSpace {
  uint32_t *keys_in, *keys_out, *vals_in, *vals_out;
  int32_t* extra;
  void* cub_temp;
  size_t cub_bytes;
};

int64_t pad256(int64_t b) { return (b + 255) / 256 * 256; }

cudaError_t cub_sort_bytes(int64_t items, int bits, size_t* bytes) {
  return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, static_cast<uint32_t*>(nullptr),
                                         static_cast<uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
                                         static_cast<uint32_t*>(nullptr), static_cast<int>(items), 0, bits);
}

cudaError_t sort_space_bytes(int64_t items, int64_t extra, int bits, int64_t* bytes) {
  size_t cub_bytes = 0;
  if (cudaError_t err = cub_sort_bytes(items, bits, &cub_bytes); err != cudaSuccess) return err;
  *bytes = 4 * pad256(4 * items) + pad256(4 * extra) + pad256(static_cast<int64_t>(cub_bytes));
  return cudaSuccess;
}

SortSpace carve(void* ws, int64_t items, int64_t extra, size_t cub_bytes) {
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

cudaError_t run_sort(const SortSpace& s, int64_t items, int bits, cudaStream_t stream) {
  if (items == 0) return cudaSuccess;
  if (items > INT32_MAX) return cudaErrorInvalidValue;  // CUB counts items in int
  size_t bytes = s.cub_bytes;
  return cub::DeviceRadixSort::SortPairs(s.cub_temp, bytes, s.keys_in, s.keys_out, s.vals_in, s.vals_out,
                                         static_cast<int>(items), 0, bits, stream);
}

#define MOE_CHECK_LAUNCH()                                        \
  do {                                                            \
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) \
      return err;                                                 \
  } while (0)

// ---- permute -----------------------------------------------------------------------------
__global__ void expert_keys_kernel(const int32_t* ids, int64_t ids_bstride, const int32_t* map,
                                   int64_t map_bstride, int64_t entries, int64_t total, int64_t num_experts,
                                   int32_t num_local, uint32_t* keys, uint32_t* vals) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / entries, j = i % entries;
    const int32_t e = local_expert(ids[b * ids_bstride + j], map ? map + b * map_bstride : nullptr,
                                   num_experts, num_local);
    keys[i] = static_cast<uint32_t>(b * (num_local + 1) + e);
    vals[i] = static_cast<uint32_t>(i);
  }
}

// One block per example: expert segment bounds in the sorted keys, then block starts.
// seg: [B, L+2] segment bounds; starts: [B, L+1] first row of each block, then the total.
__global__ void expert_layout_kernel(const uint32_t* sorted_keys, int64_t total, int32_t num_local,
                                     int64_t align, int32_t* seg, int32_t* starts, int32_t* counts,
                                     int32_t* group_sizes) {
  __shared__ int64_t sums[33];
  const int64_t b = blockIdx.x, L = num_local;
  int32_t* my_seg = seg + b * (L + 2);
  for (int64_t e = threadIdx.x; e <= L + 1; e += blockDim.x)
    my_seg[e] = static_cast<int32_t>(lower_bound(sorted_keys, total, uint64_t(b * (L + 1) + e)));
  __syncthreads();
  int64_t carry = 0;
  for (int64_t e0 = 0; e0 < L; e0 += blockDim.x) {
    const int64_t e = e0 + threadIdx.x;
    const int64_t padded = e < L ? round_up(my_seg[e + 1] - my_seg[e], align) : 0;
    int64_t chunk_total;
    const int64_t offset = block_exclusive_sum(padded, sums, &chunk_total) + carry;
    if (e < L) {
      starts[b * (L + 1) + e] = static_cast<int32_t>(offset);
      counts[b * L + e] = my_seg[e + 1] - my_seg[e];
      group_sizes[b * L + e] = static_cast<int32_t>(padded);
    }
    carry += chunk_total;
  }
  if (threadIdx.x == 0) starts[b * (L + 1) + L] = static_cast<int32_t>(carry);
}

__global__ void assign_rows_kernel(const uint32_t* sorted_keys, const uint32_t* sorted_vals, int64_t total,
                                   int32_t num_local, const int32_t* seg, const int32_t* starts,
                                   int32_t* row_map) {
  const int64_t L = num_local;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < total; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t key = sorted_keys[p], b = key / (L + 1), e = key % (L + 1);
    row_map[sorted_vals[p]] = e == L ? -1 : static_cast<int32_t>(starts[b * (L + 1) + e] + (p - seg[b * (L + 2) + e]));
  }
}

// Each thread moves up to kUnroll vectors of a row, all loads issued before the first store.
constexpr int kCopyThreads = 128, kUnroll = 4;
constexpr int64_t kCopyChunk = int64_t{kCopyThreads} * kUnroll;  // vectors per block-chunk of a row

// Where each example's expert blocks start and how many entries they hold.
struct RowLayout {
  const int32_t* starts;  // [B, L+1] first row of each expert block, then the rows in use
  const int32_t* counts;  // [B, L] entries of each expert
};

// Threads first, first + stride, ... zero the row (a block, or a warp: first = lane, stride 32).
template <typename V>
__device__ __forceinline__ void zero_row(V* row, int64_t nvec, int first, int stride) {
  for (int64_t v = first; v < nvec; v += stride) row[v] = V{};
}

// The grid zeroes rows [first, rows), a warp per row; rows go round the blocks first, so that a
// few rows spread over as many multiprocessors.
template <typename V>
__device__ void zero_rows_from(int64_t first, int64_t rows, int64_t nvec, V* out) {
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t r = first + blockIdx.x + int64_t{gridDim.x} * (threadIdx.x / 32); r < rows; r += warps)
    zero_row(out + r * nvec, nvec, threadIdx.x % 32, 32);
}

// Zeroes the rows that hold no entry: each expert block's padding [starts[e] + counts[e],
// starts[e+1]) (fewer than `align` rows) and the tail [starts[L], rows). Blocks stride over
// candidate rows only, so nothing is spent without padding or dropped entries.
template <typename V>
__device__ void zero_unused_rows(RowLayout layout, int64_t L, int64_t align, int64_t batch, int64_t rows,
                                 int64_t nvec, V* out) {
  const int64_t per_example = L * (align - 1);
  for (int64_t c = blockIdx.x; c < batch * per_example; c += gridDim.x) {
    const int64_t b = c / per_example, e = c % per_example / (align - 1), j = c % per_example % (align - 1);
    const int64_t r = layout.starts[b * (L + 1) + e] + layout.counts[b * L + e] + j;
    if (r < layout.starts[b * (L + 1) + e + 1])
      zero_row(out + (b * rows + r) * nvec, nvec, threadIdx.x, blockDim.x);
  }
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = layout.starts[b * (L + 1) + L] + blockIdx.x; r < rows; r += gridDim.x)
      zero_row(out + (b * rows + r) * nvec, nvec, threadIdx.x, blockDim.x);
}

// ---- ranking entries by local expert, in shared memory -------------------------------
// A block of kRankThreads threads ranks up to kRankThreads * kItems entries among equal local
// experts in flat-index order, without sorting: warp w owns entries [w * 32 * kItems,
// (w + 1) * 32 * kItems) in chunks of 32; a ballot per key bit finds a chunk's equal experts, a
// per-warp per-expert counter carries the rank across chunks, and a prefix over warps across
// warps. (It replaced a stable block radix sort: 1 to 3 passes of several barriers each.)
constexpr int kRankThreads = 256, kRankWarps = kRankThreads / 32;
constexpr int64_t kMaxRankedLocal = 1023;  // experts a block ranks in shared memory
constexpr int kRankKeyBits = 10;            // local expert (or L when dropped) < 1024
static_assert(kMaxRankedLocal < (1 << kRankKeyBits), "a ranked key fits in kRankKeyBits");

// Calls f(std::integral_constant<int, kItems>{}) with the fewest entries per thread (1, 2, 4 or
// 8) that let a kRankThreads-thread block hold n entries.
template <typename F>
void with_items(int64_t n, F&& f) {
  if (n <= kRankThreads) f(std::integral_constant<int, 1>{});
  else if (n <= 2 * kRankThreads) f(std::integral_constant<int, 2>{});
  else if (n <= 4 * kRankThreads) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

struct RankSpace {
  int32_t counts[kMaxRankedLocal + 1];                 // entries of expert e
  uint16_t earlier[kRankWarps][kMaxRankedLocal + 1];  // entries of expert e in the warps before w
};

// The lanes holding the same key as this one (what __match_any_sync returns), from one ballot
// per key bit: constant time, where match.any takes longer the more distinct keys the warp holds
// (H200, one-launch permute at T=64: ranking 512 entries over 128/256 experts took 2.2 us with
// match.any, 0.8 us for 128 entries over 8). Keys are below 2^bits; every lane must call it.
__device__ __forceinline__ uint32_t lanes_with_key(int32_t key, int bits) {
  uint32_t peers = 0xffffffffu;
#pragma unroll
  for (int bit = 0; bit < kRankKeyBits; ++bit) {
    if (bit >= bits) break;  // uniform over the warp
    const bool one = (key >> bit) & 1;
    const uint32_t ones = __ballot_sync(0xffffffffu, one);
    peers &= one ? ones : ~ones;
  }
  return peers;
}

template <int kItems>
__device__ __forceinline__ int64_t ranked_entry(int c) {
  return (int64_t{threadIdx.x / 32} * kItems + c) * 32 + threadIdx.x % 32;
}

// key[c] = local expert of this thread's c-th entry (L when dropped or past `size`); rank[c] =
// entries of the same expert before it. Fills s.counts. Ends with a barrier.
template <int kItems>
__device__ void rank_by_expert(const PermuteArgs& a, const int32_t* ids, const int32_t* map, int64_t size,
                               RankSpace& s, int32_t (&key)[kItems], int32_t (&rank)[kItems]) {
  const int32_t L = a.num_local;
  const int warp = threadIdx.x / 32;
  const uint32_t lanes_below = (1u << (threadIdx.x % 32)) - 1;
  const int key_bits = 32 - __clz(L);  // keys run to L (dropped)
#pragma unroll
  for (int c = 0; c < kItems; ++c) {
    const int64_t i = ranked_entry<kItems>(c);
    key[c] = i < size ? local_expert(ids[i], map, a.num_experts, L) : L;
  }
  for (int e = threadIdx.x; e < L; e += kRankThreads)
#pragma unroll
    for (int w = 0; w < kRankWarps; ++w) s.earlier[w][e] = 0;
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kItems; ++c) {  // this warp's running count per expert, chunk by chunk
    const uint32_t peers = lanes_with_key(key[c], key_bits);
    const int32_t seen = key[c] < L ? s.earlier[warp][key[c]] : 0;
    rank[c] = seen + __popc(peers & lanes_below);
    __syncwarp();
    if (key[c] < L && (peers & lanes_below) == 0) s.earlier[warp][key[c]] = static_cast<uint16_t>(seen + __popc(peers));
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += kRankThreads) {  // per-warp counts -> prefix over warps
    int32_t total = 0;
#pragma unroll
    for (int w = 0; w < kRankWarps; ++w) {
      const int32_t c = s.earlier[w][e];
      s.earlier[w][e] = static_cast<uint16_t>(total);
      total += c;
    }
    s.counts[e] = total;
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kItems; ++c)
    if (key[c] < L) rank[c] += s.earlier[warp][key[c]];
}

// ---- permute, large batches: a tiled counting sort -------------------------------------
// 1. Each block ranks one tile of entries by local expert and records the tile's per-expert
//    counts and each entry's (expert, rank within the tile).
// 2. One block per example turns counts into padded expert blocks and each tile's first row
//    per expert.
// 3. The copy kernel finds each entry's row (its tile's first row for the expert + its rank)
//    and writes the row map as it copies.
// Tiles hold 256 to 2048 entries: small tiles keep the ranking short (a chain of kItems
// chunks per warp), large ones keep step 2 short (tiles * L counts to scan).
constexpr int kOffsetThreads = 1024;  // >= one thread per local expert (L <= kMaxRankedLocal)

// Entries per thread of a tile: the fewest that keep the tile counts to kMaxShare per thread
// of the offsets block.
constexpr int kMaxShare = 8;
int tile_items(int64_t entries, int64_t L) {
  for (int items = 1; items < 8; items *= 2) {
    const int64_t tile = int64_t{kRankThreads} * items;
    if ((entries + tile - 1) / tile * L <= kMaxShare * kOffsetThreads) return items;
  }
  return 8;
}

struct TileSpace {
  int32_t* ranked;   // [B * tiles * tile_entries] rank within the tile << kRankKeyBits | local expert
  int32_t* hist;     // [B * tiles * L] entries of expert e in the tile
  int32_t* offset;   // [B * tiles * L] row of expert e's first entry of the tile
  int32_t* starts;   // [B * (L + 1)]
  int32_t* counts;   // [B * L]
  int64_t tiles, tile_entries;
  int32_t shares, share_tiles;  // the offsets block: L x shares threads, share_tiles tiles each
};

// Carves the workspace at `ws` (any address when only the size is wanted) and adds up its bytes.
TileSpace carve_tiles(void* ws, int64_t batch, int64_t entries, int64_t L, int64_t* bytes = nullptr) {
  TileSpace t;
  t.tile_entries = int64_t{kRankThreads} * tile_items(entries, L);
  t.tiles = std::max<int64_t>(1, (entries + t.tile_entries - 1) / t.tile_entries);
  t.shares = static_cast<int32_t>(std::min<int64_t>(t.tiles, kOffsetThreads / std::max<int64_t>(L, 1)));
  t.share_tiles = static_cast<int32_t>((t.tiles + t.shares - 1) / t.shares);
  const int64_t slots = batch * t.tiles;
  int64_t used = 0;
  auto take = [&](int64_t count) {
    int32_t* q = reinterpret_cast<int32_t*>(reinterpret_cast<uintptr_t>(ws) + used);
    used += pad256(4 * count);
    return q;
  };
  t.ranked = take(slots * t.tile_entries);
  t.hist = take(slots * L);
  t.offset = take(slots * L);
  t.starts = take(batch * (L + 1));
  t.counts = take(batch * L);
  if (bytes) *bytes = used;
  return t;
}

template <int kItems>
__global__ void __launch_bounds__(kRankThreads) tile_rank_kernel(PermuteArgs a, TileSpace ts) {
  __shared__ RankSpace space;
  const int64_t b = blockIdx.y, slot = b * ts.tiles + blockIdx.x;
  const int64_t n = a.tokens * a.topk, L = a.num_local, first = blockIdx.x * ts.tile_entries;
  const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
  int32_t key[kItems], rank[kItems];
  rank_by_expert<kItems>(a, a.ids + b * a.ids_bstride + first, map, n - first, space, key, rank);
#pragma unroll
  for (int c = 0; c < kItems; ++c)
    ts.ranked[slot * ts.tile_entries + ranked_entry<kItems>(c)] = rank[c] << kRankKeyBits | key[c];
  for (int64_t e = threadIdx.x; e < L; e += kRankThreads) ts.hist[slot * L + e] = space.counts[e];
}

// One block of L x P threads per example: thread (e, p) owns expert e over the p-th contiguous
// share of `share_tiles` tiles (at most kMaxShare with tile_items, counts kept in registers). One
// block scan in expert-major order gives both the experts' totals and each share's first row
// within its expert; with padding, a second scans the padded totals into expert block starts.
// The launch shape spares the thread any division. (ncu: the 1024-thread version with a
// cub::BlockScan and 64-bit index math issued ~500 instructions per warp on its one SM, 3.4-4.5
// us; this one takes 1.9 us at L=8 and 3.1-3.2 us at L=128/256, H200.)
__global__ void __launch_bounds__(kOffsetThreads) tile_offsets_kernel(PermuteArgs a, TileSpace ts) {
  __shared__ int32_t before[kOffsetThreads + 1];  // expert-major exclusive prefix of the shares
  __shared__ int32_t starts[kMaxRankedLocal + 1];
  __shared__ int32_t sums[33];
  const int32_t L = a.num_local, P = blockDim.y, tiles = static_cast<int32_t>(ts.tiles);
  const int32_t e = threadIdx.x, p = threadIdx.y, i = p * L + e;
  const int32_t t0 = min(tiles, p * ts.share_tiles), t1 = min(tiles, t0 + ts.share_tiles);
  const int64_t b = blockIdx.x;
  const int32_t* hist = ts.hist + b * tiles * L;
  int32_t counts[kMaxShare];
  int32_t sum = 0;
#pragma unroll
  for (int c = 0; c < kMaxShare; ++c) counts[c] = t0 + c < t1 ? hist[(t0 + c) * L + e] : 0;
#pragma unroll
  for (int c = 0; c < kMaxShare; ++c) sum += counts[c];
  for (int32_t t = t0 + kMaxShare; t < t1; ++t) sum += hist[t * L + e];
  before[e * P + p] = sum;
  __syncthreads();
  int32_t all;
  const int32_t prefix = block_exclusive_sum(before[i], sums, &all);
  before[i] = prefix;
  if (i == 0) before[L * P] = all;
  __syncthreads();
  const int32_t count = i < L ? before[(i + 1) * P] - before[i * P] : 0;
  int32_t start = i < L ? before[i * P] : 0, total = all;
  if (a.align > 1)  // uniform over the block
    start = block_exclusive_sum(static_cast<int32_t>(round_up(count, a.align)), sums, &total);
  if (i < L) {
    starts[i] = start;
    ts.starts[b * (L + 1) + i] = start;
    ts.counts[b * L + i] = count;
    a.group_sizes[b * L + i] = static_cast<int32_t>(round_up(count, a.align));
  }
  if (i == 0) ts.starts[b * (L + 1) + L] = total;
  __syncthreads();
  int32_t row = starts[e] + before[e * P + p] - before[e * P];
  int32_t* offset = ts.offset + b * tiles * L;
#pragma unroll
  for (int c = 0; c < kMaxShare; ++c) {
    if (t0 + c < t1) offset[(t0 + c) * L + e] = row;
    row += counts[c];
  }
  for (int32_t t = t0 + kMaxShare; t < t1; ++t) {
    offset[t * L + e] = row;
    row += hist[t * L + e];
  }
}

// Where the copy kernel finds a token's rows: in the row map, or (tiled routing, ranked not
// null) from each entry's tile: the tile's first row of its expert + its rank, recorded in the
// row map on the way.
struct EntryRows {
  int32_t* row_map;        // [B, n]
  const int32_t* ranked;   // TileSpace::ranked, or null
  const int32_t* offset;   // TileSpace::offset
  int64_t tiles;
  int tile_shift;          // log2 of the tile's entries
};

// Row of the token's k-th entry; i0 = t * K is the token's first entry within example b.
template <bool kFromTiles>
__device__ __forceinline__ int32_t entry_row(const EntryRows& er, int64_t b, int64_t n, int64_t i0, int64_t k,
                                             int32_t L, bool record) {
  int32_t* rm = er.row_map + b * n + i0;
  if constexpr (!kFromTiles) {
    return rm[k];
  } else {
    // Tiles are laid out back to back, so an entry's slot is its flat index within the example.
    const int32_t packed = er.ranked[(b * er.tiles << er.tile_shift) + i0 + k];
    const int32_t e = packed & ((1 << kRankKeyBits) - 1);
    const int32_t tile = static_cast<int32_t>((i0 + k) >> er.tile_shift);
    const int32_t r = e < L ? er.offset[(b * er.tiles + tile) * L + e] + (packed >> kRankKeyBits) : -1;
    if (record) rm[k] = r;
    return r;
  }
}

// Blocks over (token, chunk of the row): the token's row is read once and written to each of
// its K rows. Then the same blocks zero the rows no entry holds. kSkipUnrouted (with an
// expert_map, where many tokens have no local expert): read the row only when some entry of
// the token has a row, at the price of finding the rows first.
template <typename V, bool kSkipUnrouted, bool kFromTiles>
__global__ void __launch_bounds__(kCopyThreads) copy_rows_kernel(
    const char* hidden, int64_t hidden_bstride_bytes, EntryRows er, int64_t tokens, int64_t topk,
    int64_t batch, int64_t rows, int64_t row_bytes, RowLayout layout, int32_t L, int64_t align, char* out) {
  // At least one chunk per token, so that tiled routing records the rows even when H = 0.
  const int64_t nvec = row_bytes / sizeof(V), chunks = max(int64_t{1}, (nvec + kCopyChunk - 1) / kCopyChunk);
  const int64_t n = tokens * topk;
  for (int64_t u = blockIdx.x; u < batch * tokens * chunks; u += gridDim.x) {
    const int64_t g = u / chunks, b = g / tokens, i0 = (g - b * tokens) * topk;
    const int64_t v0 = (u % chunks) * kCopyChunk + threadIdx.x;
    const bool record = kFromTiles && u % chunks == 0 && threadIdx.x == 0;
    if (kSkipUnrouted) {
      bool routed = false;
      for (int64_t k = 0; k < topk; ++k) routed |= entry_row<kFromTiles>(er, b, n, i0, k, L, record) >= 0;
      if (!routed) continue;
    }
    const V* src = reinterpret_cast<const V*>(hidden + b * hidden_bstride_bytes + (g - b * tokens) * row_bytes);
    V value[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (v0 + j * kCopyThreads < nvec) value[j] = src[v0 + j * kCopyThreads];
    V* dst = reinterpret_cast<V*>(out + b * rows * row_bytes);
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t r = entry_row<kFromTiles>(er, b, n, i0, k, L, record && !kSkipUnrouted);
      if (r < 0) continue;
#pragma unroll
      for (int j = 0; j < kUnroll; ++j)
        if (v0 + j * kCopyThreads < nvec) dst[r * nvec + v0 + j * kCopyThreads] = value[j];
    }
  }
  zero_unused_rows<V>(layout, L, align, batch, rows, nvec, reinterpret_cast<V*>(out));
}

// ---- permute, small batches: one launch -------------------------------------------------
// Every block routes the whole (small) example in shared memory (rank_by_expert, then one scan
// of the padded counts for the expert blocks). Then the blocks share the copies (read each token
// row once, write its K rows) and the zero rows.
constexpr int kSmallThreads = kRankThreads;
constexpr int64_t kSmallMaxEntries = 2048;

// Example b's rows as a small-batch block sees them: chunks of kSmallThreads vectors (at least
// one, so that H = 0 still launches a block).
template <typename V>
struct SmallRows {
  const V* hidden;
  V* out;
  int64_t nvec, chunks;

  __device__ SmallRows(const PermuteArgs& a, int64_t b) {
    const int64_t row_bytes = a.hidden_size * a.elem_bytes;
    nvec = row_bytes / sizeof(V);
    chunks = max(int64_t{1}, (nvec + kSmallThreads - 1) / kSmallThreads);
    hidden = reinterpret_cast<const V*>(static_cast<const char*>(a.hidden) + b * a.hidden_bstride * a.elem_bytes);
    out = reinterpret_cast<V*>(static_cast<char*>(a.out) + b * a.rows * row_bytes);
  }
  // This thread's vector of chunk c of token t's row; V{} past the row.
  __device__ V load(int64_t t, int64_t c) const {
    const int64_t v = c * kSmallThreads + threadIdx.x;
    return v < nvec ? hidden[t * nvec + v] : V{};
  }
};

template <int kItems, typename V>
__global__ void __launch_bounds__(kSmallThreads) permute_small_kernel(PermuteArgs a) {
  __shared__ int64_t sums[33];
  __shared__ RankSpace space;
  __shared__ int32_t starts[kMaxRankedLocal + 1];
  __shared__ int32_t pad_before[kMaxRankedLocal + 1];  // padding rows of the experts before e
  __shared__ int32_t row_of[kSmallThreads * kItems];

  const int64_t b = blockIdx.y, n = a.tokens * a.topk;
  const int32_t L = a.num_local;
  const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
  int32_t key[kItems], rank[kItems];
  rank_by_expert<kItems>(a, a.ids + b * a.ids_bstride, map, n, space, key, rank);
  // One scan of (padded rows << 32 | padding rows): expert block starts and padding prefix.
  int64_t carry = 0;
  for (int e0 = 0; e0 < L; e0 += kSmallThreads) {
    const int e = e0 + threadIdx.x;
    const int64_t padded = e < L ? round_up(space.counts[e], a.align) : 0;
    const int64_t both = padded << 32 | (e < L ? padded - space.counts[e] : 0);
    int64_t total;
    const int64_t before = block_exclusive_sum(both, sums, &total) + carry;
    if (e < L) {
      starts[e] = static_cast<int32_t>(before >> 32);
      pad_before[e] = static_cast<int32_t>(before & 0xffffffff);
    }
    carry += total;
  }
  if (threadIdx.x == 0) {
    starts[L] = static_cast<int32_t>(carry >> 32);
    pad_before[L] = static_cast<int32_t>(carry & 0xffffffff);
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kItems; ++c) {
    const int64_t i = ranked_entry<kItems>(c);
    if (i < n) row_of[i] = key[c] < L ? starts[key[c]] + rank[c] : -1;
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int64_t i = threadIdx.x; i < n; i += kSmallThreads) a.row_map[b * n + i] = row_of[i];
    for (int e = threadIdx.x; e < L; e += kSmallThreads) a.group_sizes[b * L + e] = starts[e + 1] - starts[e];
  }

  const SmallRows<V> rows(a, b);
  const int64_t nvec = rows.nvec, chunks = rows.chunks;
  V* out = rows.out;
  for (int64_t u = blockIdx.x; u < a.tokens * chunks; u += gridDim.x) {
    const int64_t t = u / chunks, v = (u % chunks) * kSmallThreads + threadIdx.x;
    bool routed = false;  // shared-memory reads: cheaper than reading a row nobody needs
    for (int64_t k = 0; k < a.topk; ++k) routed |= row_of[t * a.topk + k] >= 0;
    if (v >= nvec || !routed) continue;
    const V value = rows.hidden[t * nvec + v];
    for (int64_t k = 0; k < a.topk; ++k) {
      const int32_t r = row_of[t * a.topk + k];
      if (r >= 0) out[r * nvec + v] = value;
    }
  }
  // Zero fill: unused row q < pad_before[L] is padding, found by a binary search over the
  // padding prefix; the rest is the tail [starts[L], rows). A warp per row, so that the
  // searches of a block's rows overlap; rows go round the blocks first, so that a few rows
  // spread over as many multiprocessors. (Walking the L expert blocks per thread took ~70 ns
  // per expert: 20 us at T=1, L=256, align 128; the copy kernel's candidate walk,
  // zero_unused_rows, would cost three 64-bit divisions per candidate here.)
  const int64_t unused = pad_before[L] + (a.rows - starts[L]);
  const int64_t warps = int64_t{gridDim.x} * (kSmallThreads / 32);
  for (int64_t q = blockIdx.x + int64_t{gridDim.x} * (threadIdx.x / 32); q < unused; q += warps) {
    int64_t r = starts[L] + (q - pad_before[L]);
    if (q < pad_before[L]) {
      int32_t lo = 0, hi = L;  // pad_before[lo] <= q < pad_before[hi]
      while (hi - lo > 1) {
        const int32_t mid = (lo + hi) / 2;
        if (pad_before[mid] <= q) lo = mid; else hi = mid;
      }
      r = starts[lo] + space.counts[lo] + (q - pad_before[lo]);
    }
    zero_row(out + r * nvec, nvec, threadIdx.x % 32, 32);
  }
}

// ---- permute, a token or so (at most 32 entries, no padding): one warp routes -----------
// An entry's row is the number of entries ordered before it by (local expert, index): one warp
// holding all entries finds it with 32 shuffles, without permute_small_kernel's shared-memory
// ranking and scan. Blocks over (entry, chunk of the row), so that the K copies spread over K
// times as many blocks; each block loads its first chunk before routing, which that load does
// not depend on. (H200, T=1: 3.2 / 3.6 / 3.7 us -> 2.0 / 2.1 / 2.2 for Mixtral / Qwen3 /
// DeepSeek; session 4's warp routing with the token-major copy alone gained 0.1 us.)
constexpr int64_t kTinyMaxEntries = 32;

template <typename V>
__global__ void __launch_bounds__(kSmallThreads) permute_tiny_kernel(PermuteArgs a) {
  __shared__ int32_t key_of[kTinyMaxEntries], row_of[kTinyMaxEntries];
  __shared__ int32_t routed;  // entries with a local expert: rows [routed, rows) stay unused
  const int64_t b = blockIdx.y, n = a.tokens * a.topk;
  const int32_t L = a.num_local;
  const SmallRows<V> rows(a, b);
  const int64_t chunks = rows.chunks;
  const V first = blockIdx.x < n * chunks ? rows.load(blockIdx.x / chunks / a.topk, blockIdx.x % chunks) : V{};
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
    const int32_t key = lane < n ? local_expert(a.ids[b * a.ids_bstride + lane], map, a.num_experts, L) : L;
    int32_t before = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int32_t other = __shfl_sync(0xffffffffu, key, j);
      before += other < key || (other == key && j < lane);
    }
    key_of[lane] = key;
    row_of[lane] = key < L ? before : -1;
    const uint32_t local = __ballot_sync(0xffffffffu, key < L);
    if (lane == 0) routed = __popc(local);
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int64_t i = threadIdx.x; i < n; i += kSmallThreads) a.row_map[b * n + i] = row_of[i];
    for (int64_t e = threadIdx.x; e < L; e += kSmallThreads) {
      int32_t count = 0;
      for (int64_t i = 0; i < n; ++i) count += key_of[i] == e;
      a.group_sizes[b * L + e] = count;
    }
  }
  for (int64_t u = blockIdx.x; u < n * chunks; u += gridDim.x) {
    const int64_t i = u / chunks, v = (u % chunks) * kSmallThreads + threadIdx.x;
    const int32_t r = row_of[i];
    if (v >= rows.nvec || r < 0) continue;
    rows.out[r * rows.nvec + v] = u == blockIdx.x ? first : rows.hidden[i / a.topk * rows.nvec + v];
  }
  zero_rows_from(routed, a.rows, rows.nvec, rows.out);
}

// ---- permute, small batches without padding: each block counts what it writes ----------
// Without padding, an entry's row is the number of entries ordered before it by (local expert,
// index), and an expert's group size the number of entries it holds: counts over all entries.
// So a block need not rank every entry and scan every expert (permute_small_kernel: 1.1-1.7 us
// of ranking and 0.8 us of scan at T=64, H200); it answers at most 32 queries in one round: the
// entries with a local expert (where unused rows start), the group sizes of a share of the
// experts, and the rows of its token's K entries. An entry is held as one packed key, local
// expert * kSmallMaxEntries + index, so that every query (entries of an expert; entries before
// (expert, index)) is one range of keys: a subtraction and an unsigned comparison per held entry,
// a warp sum per query, one barrier for the block's sum. It loads its chunk of the token row
// first. (H200, T=64, Mixtral / Qwen3 / DeepSeek: ranked 3.3 / 4.4 / 5.6 us; two rounds of
// queries, five barriers 2.7 / 3.8 / 5.2; one round 2.2 / 3.0 / 4.4; packed keys 2.2 / 2.8 / 4.25;
// with no count at all, wrong rows, 1.9 / 2.3 / 3.6.)
constexpr int kMaxCountQueries = 32;  // one per lane of warp 0, which sets and sums them
constexpr int32_t kKeyStride = kSmallMaxEntries;  // packed key = local expert * kKeyStride + index

template <int kItems, typename V>
__global__ void __launch_bounds__(kSmallThreads) permute_counted_kernel(PermuteArgs a) {
  __shared__ int32_t warp_counts[kSmallThreads / 32][kMaxCountQueries];
  __shared__ int32_t counts[kMaxCountQueries];  // the answers; a token entry's row, or -1
  const int64_t b = blockIdx.y;
  const int32_t n = static_cast<int32_t>(a.tokens * a.topk), L = a.num_local;
  const SmallRows<V> rows(a, b);
  // This block's (token, chunk): the grid has one block per unit (one block when T = 0).
  const int32_t chunks = static_cast<int32_t>(rows.chunks), t = static_cast<int32_t>(blockIdx.x) / chunks;
  const int32_t i0 = t * static_cast<int32_t>(a.topk), c = static_cast<int32_t>(blockIdx.x) - t * chunks;
  const V value = t < a.tokens ? rows.load(t, c) : V{};
  const int32_t* ids = a.ids + b * a.ids_bstride;
  const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
  int32_t key[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int32_t j = i * kSmallThreads + threadIdx.x;
    key[i] = (j < n ? local_expert(ids[j], map, a.num_experts, L) : L) * kKeyStride + j;
  }

  // Lane q sets query q, the keys [first, first + span): 0 counts entries with a local expert;
  // 1..S the group sizes of experts blockIdx.x + m * gridDim.x; S + 1 + k the row of the token's
  // entry k. (S <= 31 keeps L and every key below 2^31.)
  const int32_t S = (L + gridDim.x - 1) / gridDim.x, K = t < a.tokens ? static_cast<int32_t>(a.topk) : 0;
  const int Q = 1 + S + K, lane = threadIdx.x % 32;
  int32_t lo = 0, hi = L, below = 0, entry_key = L;
  if (lane >= 1 && lane <= S) {
    lo = blockIdx.x + (lane - 1) * gridDim.x;
    hi = lo + 1;
  } else if (lane > S && lane < Q) {
    below = i0 + lane - 1 - S;
    entry_key = local_expert(ids[below], map, a.num_experts, L);
    hi = entry_key;
  }
  const int32_t first = lo * kKeyStride, span = hi * kKeyStride + below - first;
  int32_t mine = 0;
  for (int q0 = 0; q0 < Q; q0 += 4) {  // four queries at a time keep four warp sums in flight
    int32_t sum[4];
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      const int32_t qfirst = __shfl_sync(0xffffffffu, first, q0 + d);
      const uint32_t qspan = __shfl_sync(0xffffffffu, span, q0 + d);
      sum[d] = 0;
#pragma unroll
      for (int i = 0; i < kItems; ++i) sum[d] += static_cast<uint32_t>(key[i] - qfirst) < qspan;
    }
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      const int32_t total = __reduce_add_sync(0xffffffffu, sum[d]);
      if (lane == q0 + d) mine = total;
    }
  }
  warp_counts[threadIdx.x / 32][lane] = mine;
  __syncthreads();
  if (threadIdx.x < Q) {
    int32_t total = 0;
#pragma unroll
    for (int w = 0; w < kSmallThreads / 32; ++w) total += warp_counts[w][threadIdx.x];
    if (threadIdx.x > S) {
      total = entry_key < L ? total : -1;
      if (c == 0) a.row_map[b * n + below] = total;
    } else if (threadIdx.x >= 1 && lo < L) {
      a.group_sizes[b * L + lo] = total;
    }
    counts[threadIdx.x] = total;
  }
  __syncthreads();

  const int64_t v = c * kSmallThreads + threadIdx.x;
  if (v < rows.nvec)
    for (int32_t k = 0; k < K; ++k) {
      const int32_t r = counts[S + 1 + k];
      if (r >= 0) rows.out[r * rows.nvec + v] = value;
    }
  zero_rows_from(counts[0], a.rows, rows.nvec, rows.out);
}

// The widest access (up to 16 bytes) that divides the row and every base address.
template <typename F>
cudaError_t with_access_type(int64_t row_bytes, std::initializer_list<const void*> ptrs, F&& f) {
  uintptr_t bits = static_cast<uintptr_t>(row_bytes);
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  if (bits % 16 == 0) return f(Tag<uint4>{});
  if (bits % 8 == 0) return f(Tag<uint2>{});
  if (bits % 4 == 0) return f(Tag<uint32_t>{});
  if (bits % 2 == 0) return f(Tag<uint16_t>{});
  return f(Tag<uint8_t>{});
}

// ---- unpermute ---------------------------------------------------------------------------
// Blocks over (token, chunk of H): each thread owns V consecutive features (one 16-byte access
// where rows are aligned). It reads kBatch row indices, issues kBatch raw row loads, and only
// then converts and accumulates in float32, in ascending k. Raw staging keeps the register count
// low enough for ~10 resident blocks per multiprocessor (measured on the H200, see
// benchmarks/micro/variants.cu): kBatch = 2 when K <= 2 (4.1 TB/s vs 3.4 with four converted
// loads), 4 for larger K, 8 when the grid is too small to fill the GPU (latency-bound).
constexpr int kGatherThreads = 128, kGatherVecBytes = 16;

// acc += w * raw, widened to float32.
template <typename X, int V>
__device__ __forceinline__ void add_weighted(const Vec<X, V>& raw, float w, float (&acc)[V]) {
  if constexpr (std::is_same_v<X, __nv_bfloat16> && V % 2 == 0) {
    // bf16 is the high half of a float32: widen two per 32-bit word with integer ops.
    const uint32_t* words = reinterpret_cast<const uint32_t*>(raw.v);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      acc[2 * i] += w * __uint_as_float(words[i] << 16);
      acc[2 * i + 1] += w * __uint_as_float(words[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] += w * to_f32(raw.v[i]);
  }
}

// Resident blocks per multiprocessor to ask of the compiler for 16-bit inputs (register caps of
// 32 and 48, no spills; the microbenchmark's fastest kernels used as many); other inputs and
// kBatch 8 (small grids, latency-bound) are left alone.
constexpr int gather_min_blocks(size_t elem_bytes, int batch) {
  return elem_bytes != 2 ? 1 : batch == 2 ? 16 : batch == 4 ? 10 : 1;
}

template <typename X, typename O, int V, int kBatch>
__global__ void __launch_bounds__(kGatherThreads, gather_min_blocks(sizeof(X), kBatch)) unpermute_kernel(UnpermuteArgs a) {
  const int64_t H = a.hidden_size, K = a.topk;
  const int64_t h = (blockIdx.y * int64_t(kGatherThreads) + threadIdx.x) * V;
  if (h >= H) return;
  for (int64_t g = blockIdx.x; g < a.batch * a.tokens; g += gridDim.x) {
    const int64_t b = g / a.tokens;
    const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + h;
    const int32_t* rm = a.row_map + b * a.rm_bstride + (g - b * a.tokens) * K;
    const int64_t w0 = b * a.w_bstride + (g - b * a.tokens) * K;
    float acc[V] = {};
    for (int64_t k0 = 0; k0 < K; k0 += kBatch) {
      // Weights are read with the row indices (one round trip for both) except at kBatch 4,
      // whose register cap has no room for them; there they follow the row loads.
      constexpr bool kWeightsFirst = kBatch != 4;
      int32_t r[kBatch];
      float w[kBatch];
      Vec<X, V> raw[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        r[j] = k0 + j < K ? rm[k0 + j] : -1;
        if (kWeightsFirst) w[j] = k0 + j < K ? weight_at(a.weights, a.w_dtype, w0 + k0 + j) : 0.0f;
        if (r[j] >= a.rows) r[j] = -1;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (r[j] >= 0) raw[j] = *reinterpret_cast<const Vec<X, V>*>(x + r[j] * H);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (r[j] < 0) continue;  // skipped, not added as 0: keeps -0.0 and NaN rules
        add_weighted(raw[j], kWeightsFirst ? w[j] : weight_at(a.weights, a.w_dtype, w0 + k0 + j), acc);
      }
    }
    store_f32<O, V>(static_cast<O*>(a.out) + g * H + h, acc);
  }
}

// Small grids (decode: a token or a few per multiprocessor) are latency-bound: one warp per
// scheduler, so every instruction between launch and the last store is on the critical path.
// One block per (chunk, token, example): no grid-stride loop and no 64-bit division; all K <=
// kFewMaxK row indices and weights read at once. (H200, T=1, Mixtral / Qwen3 / DeepSeek: 1.44 /
// 1.73 / 1.76 us with unpermute_kernel, 1.54 / 1.57 / 1.60 with this kernel's first form,
// 1.31 / 1.47 / 1.47-1.50 with WeightReader, 1.25 / 1.31 / 1.35 with few_access_split's narrower
// accesses; XLA's fused gather 1.02 / 1.18 / 1.25. The stages, timed by cutting the kernel
// short: launch 0.5 us, + the store 0.74, + the row map's load 0.84, + one row's load 1.12.)
constexpr int kFewMaxK = 8;

// Reads weights in two steps: raw bits by predicated loads of the width their dtype has (no
// branch on the dtype, whose merge held back the row loads issued after it: -0.1 us at T=1 on
// the H200), then their values once the rows are in flight. Null weights read as 1.
struct WeightReader {
  const char* w;
  bool wide, half;
  __device__ explicit WeightReader(const UnpermuteArgs& a)
      : w(static_cast<const char*>(a.weights)), wide(a.w_dtype == Dtype::kF32), half(a.w_dtype == Dtype::kF16) {}
  __device__ uint32_t bits(int64_t i) const {
    if (w == nullptr) return 0;
    return wide ? *reinterpret_cast<const uint32_t*>(w + i * 4) : uint32_t{*reinterpret_cast<const uint16_t*>(w + i * 2)};
  }
  __device__ float value(uint32_t b) const {
    if (w == nullptr) return 1.0f;
    if (wide) return __uint_as_float(b);
    return half ? __half2float(__ushort_as_half(static_cast<unsigned short>(b))) : __uint_as_float(b << 16);
  }
};

template <typename X, typename O, int V>
__global__ void __launch_bounds__(kGatherThreads) unpermute_few_kernel(UnpermuteArgs a) {
  const int32_t H = static_cast<int32_t>(a.hidden_size), K = static_cast<int32_t>(a.topk);
  const int32_t h = (blockIdx.x * kGatherThreads + threadIdx.x) * V;
  if (h >= H) return;
  const int64_t b = blockIdx.z, g = b * a.tokens + blockIdx.y;
  const int32_t* rm = a.row_map + b * a.rm_bstride + int64_t{blockIdx.y} * K;
  const int64_t w0 = b * a.w_bstride + int64_t{blockIdx.y} * K;
  const WeightReader weights(a);
  int32_t r[kFewMaxK];
  uint32_t w_bits[kFewMaxK];
#pragma unroll
  for (int j = 0; j < kFewMaxK; ++j) {
    r[j] = j < K ? rm[j] : -1;
    w_bits[j] = j < K ? weights.bits(w0 + j) : 0;
    if (r[j] >= a.rows) r[j] = -1;
  }
  const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + h;
  Vec<X, V> raw[kFewMaxK];
#pragma unroll
  for (int j = 0; j < kFewMaxK; ++j)
    if (r[j] >= 0) raw[j] = *reinterpret_cast<const Vec<X, V>*>(x + int64_t{r[j]} * H);
  float w[kFewMaxK];
#pragma unroll
  for (int j = 0; j < kFewMaxK; ++j) w[j] = weights.value(w_bits[j]);
  float acc[V] = {};
#pragma unroll
  for (int j = 0; j < kFewMaxK; ++j)
    if (r[j] >= 0) add_weighted(raw[j], w[j], acc);  // skipped, not added as 0: keeps -0.0 and NaN rules
  store_f32<O, V>(static_cast<O*>(a.out) + g * H + h, acc);
}

// How many times (1, 2, 4 or 8) to narrow the lean kernel's access of `vec` elements of
// `elem_bytes`, for `items` output rows of `row_bytes`. On grids this small the time follows the
// bytes each block loads and the blocks each multiprocessor runs: halve the access while each
// thread still loads more than 16 bytes over its K rows, the access stays >= 2 bytes and the grid
// stays within half the multiprocessors. (H200, bf16, T = 1 to 32, three models: the fastest
// width, or within 0.04 us of it, at all 18 points; BENCHMARKS.md item 50.)
int few_access_split(int64_t items, int64_t row_bytes, int64_t topk, int64_t elem_bytes, int vec) {
  int split = 1;
  while (split < 8 && vec % (2 * split) == 0) {
    const int64_t narrow = elem_bytes * vec / (2 * split), per_block = int64_t{kGatherThreads} * narrow;
    const int64_t blocks = items * ((row_bytes + per_block - 1) / per_block);
    if (narrow < 2 || topk * 2 * narrow <= 16 || 2 * blocks > multiprocessors()) break;
    split *= 2;
  }
  return split;
}

dim3 gather_grid(int64_t items, int64_t hidden, int vec) {
  const int64_t per_block = int64_t{kGatherThreads} * vec;
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(kMaxBlocks, items))),
              static_cast<unsigned>((hidden + per_block - 1) / per_block));
}

// ---- scatter -----------------------------------------------------------------------------
__global__ void row_keys_kernel(const int32_t* row_map, int64_t rm_bstride, int64_t entries, int64_t total,
                                int64_t rows, uint32_t* keys, uint32_t* vals) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / entries, r = row_map[b * rm_bstride + i % entries];
    keys[i] = static_cast<uint32_t>(b * (rows + 1) + ((r < 0 || r >= rows) ? rows : r));
    vals[i] = static_cast<uint32_t>(i);
  }
}

__global__ void segment_bounds_kernel(const uint32_t* sorted_keys, int64_t total, int64_t num_keys, int32_t* seg) {
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q <= num_keys; q += int64_t(gridDim.x) * blockDim.x)
    seg[q] = static_cast<int32_t>(lower_bound(sorted_keys, total, q));
}

// Rows that exactly one entry maps to (all of them for a row map from permute) are written
// token-major, like permute's copy: each token row is read once and its weighted copies go to
// its K rows. Rows with no entry or several are left to multi_entry_rows_kernel.
// seg[b * (R + 1) + r] .. seg[b * (R + 1) + r + 1]: the sorted entries of row r.
// Blocks over (token, chunk of kUnroll * kGatherThreads vectors): kUnroll = 4 keeps enough
// loads in flight on large grids (one vector per thread wrote at ~3 TB/s for K = 2), 1 spreads
// small grids over more blocks.
template <typename X, typename O, int V, int kUnroll>
__global__ void __launch_bounds__(kGatherThreads) single_entry_rows_kernel(ScatterArgs a, const int32_t* seg) {
  const int64_t H = a.hidden_size, K = a.topk, R = a.rows;
  const int64_t h0 = (blockIdx.y * int64_t{kGatherThreads} * kUnroll + threadIdx.x) * V;
  if (h0 >= H) return;
  for (int64_t g = blockIdx.x; g < a.batch * a.tokens; g += gridDim.x) {
    const int64_t b = g / a.tokens, t = g - b * a.tokens;
    const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + t * H;
    Vec<X, V> raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t h = h0 + int64_t{u} * kGatherThreads * V;
      if (h < H) raw[u] = *reinterpret_cast<const Vec<X, V>*>(x + h);
    }
    const int32_t* rm = a.row_map + b * a.rm_bstride + t * K;
    const int32_t* my_seg = seg + b * (R + 1);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = rm[k];
      if (r < 0 || r >= R || my_seg[r + 1] - my_seg[r] != 1) continue;
      const float w = weight_at(a.weights, a.w_dtype, b * a.w_bstride + t * K + k);
      O* out = static_cast<O*>(a.out) + (b * R + r) * H;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t h = h0 + int64_t{u} * kGatherThreads * V;
        if (h >= H) break;
        float f[V];
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = w * to_f32(raw[u].v[i]);
        store_f32<O, V>(out + h, f);
      }
    }
  }
}

// Rows with no entry or several: zeros, or the weighted sum of their entries in ascending flat
// index (the sorted order), float32. Each warp checks 32 rows at once (one per lane: most rows
// have exactly one entry and are done) and then moves the rows left, one after another.
template <typename X, typename O, int V>
__global__ void multi_entry_rows_kernel(ScatterArgs a, const uint32_t* sorted_vals, const int32_t* seg) {
  const X* xs = static_cast<const X*>(a.x);
  const int64_t H = a.hidden_size, K = a.topk, R = a.rows, n = a.tokens * a.topk;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32), lane = threadIdx.x % 32;
  const int64_t groups = a.batch * ((R + 31) / 32);
  for (int64_t q = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; q < groups; q += warps) {
    const int64_t b = q / ((R + 31) / 32), r_mine = q % ((R + 31) / 32) * 32 + lane;
    const bool todo = r_mine < R && seg[b * (R + 1) + r_mine + 1] - seg[b * (R + 1) + r_mine] != 1;
    for (uint32_t left = __ballot_sync(0xffffffffu, todo); left != 0; left &= left - 1) {
      const int64_t r = r_mine - lane + __ffs(left) - 1;
      const int64_t begin = seg[b * (R + 1) + r], end = seg[b * (R + 1) + r + 1];
      for (int64_t h = lane * int64_t(V); h < H; h += 32 * V) {
        float acc[V] = {};
        for (int64_t p = begin; p < end; ++p) {
          const int64_t j = sorted_vals[p] % n;  // flat t*K+k within the example
          const float w = weight_at(a.weights, a.w_dtype, b * a.w_bstride + j);
          float f[V];
          load_f32<X, V>(xs + b * a.x_bstride + (j / K) * H + h, f);
#pragma unroll
          for (int i = 0; i < V; ++i) acc[i] = p == begin ? w * f[i] : acc[i] + w * f[i];
        }
        store_f32<O, V>(static_cast<O*>(a.out) + (b * R + r) * H + h, acc);
      }
    }
  }
}

// ---- weight gradient ---------------------------------------------------------------------
// dw[t, k] = <ct[t], x[row_map[t, k]]>, float32, by a group of kGroup threads per entry: a warp
// for short rows when there are entries enough to fill the GPU (no block barrier; the K warps
// of a token read its cotangent row through L1), else the whole block.
// A warp's threads read two vector pairs before they multiply (a block's, one: fewer registers,
// more resident blocks; measured faster on the H200); the group's sum is a warp shuffle tree,
// then (block groups) the warps' sums in order.
// The sum of v over a warp (kGroup 32) or the block (kGroup kThreads) in a fixed order: a
// shuffle tree per warp, then the warps' sums in ascending order. Valid in the group's first
// thread. Block groups: every thread calls it; warp_sums holds kThreads / 32 floats of shared
// memory and can be reused as soon as it returns.
template <int kGroup>
__device__ __forceinline__ float group_sum(float v, float* warp_sums) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if constexpr (kGroup > 32) {
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 1; w < kGroup / 32; ++w) v += warp_sums[w];
    __syncthreads();
  }
  return v;
}

template <typename C, typename X, int V, int kGroup>
__global__ void __launch_bounds__(kThreads) weight_grad_kernel(WeightGradArgs a) {
  constexpr int kGroups = kThreads / kGroup, kWgUnroll = kGroup == 32 ? 2 : 1;
  __shared__ float warp_sums[kThreads / 32];
  const int64_t H = a.hidden_size, K = a.topk, entries = a.batch * a.tokens * K, per_example = a.tokens * K;
  const int lane = threadIdx.x % kGroup;
  for (int64_t g0 = blockIdx.x * int64_t{kGroups}; g0 < entries; g0 += int64_t(gridDim.x) * kGroups) {
    const int64_t g = g0 + threadIdx.x / kGroup;  // g = b * T * K + t * K + k
    float partial = 0.0f;
    const int64_t b = g / per_example, j = g - b * per_example;
    const int64_t r = g < entries ? a.row_map[b * a.rm_bstride + j] : -1;
    if (r >= 0 && r < a.rows) {
      const C* ct = static_cast<const C*>(a.ct) + b * a.ct_bstride + (j / K) * H;
      const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + r * H;
      for (int64_t h0 = lane * int64_t(V); h0 < H; h0 += int64_t{kGroup} * V * kWgUnroll) {
        Vec<C, V> c[kWgUnroll];
        Vec<X, V> f[kWgUnroll];
#pragma unroll
        for (int u = 0; u < kWgUnroll; ++u) {
          const int64_t h = h0 + int64_t{u} * kGroup * V;
          if (h < H) {
            c[u] = *reinterpret_cast<const Vec<C, V>*>(ct + h);
            f[u] = *reinterpret_cast<const Vec<X, V>*>(x + h);
          }
        }
#pragma unroll
        for (int u = 0; u < kWgUnroll; ++u) {
          if (h0 + int64_t{u} * kGroup * V >= H) break;
#pragma unroll
          for (int i = 0; i < V; ++i) partial += to_f32(c[u].v[i]) * to_f32(f[u].v[i]);
        }
      }
    }
    partial = group_sum<kGroup>(partial, warp_sums);
    if (lane == 0 && g < entries) store_weight(a.out, a.out_dtype, g, partial);
  }
}

// ---- unpermute's backward, fused ------------------------------------------------------------
// 1. owner[b, r] = -1 (a memset). 2. `parts` warps per token (one on large grids, up to a
//    block's 8 on small ones) read its cotangent row once for both cotangents: the dot products
//    with its K expert rows (the weights' cotangent) and w * ct into each entry's row. No
//    barrier when a warp holds the whole token. Each entry also claims its row: owner = the
//    entry, or -2 once a second entry claims it (atomics only tell "one entry" from "several",
//    so results stay deterministic). 3. A warp per 32 rows zeroes the rows nothing maps to and
//    sums the rows of several entries in ascending entry order, one pass over the row map per
//    such row (permute never makes them; a user's row map may), overwriting what step 2 wrote.
// Small batches take one launch instead (unpermute_bwd_small_kernel below).
constexpr int kBwdMaxParts = kThreads / 32;

// A lane holds kUnroll vectors of the cotangent row and kGroup entries' vectors of their rows
// in flight, with registers for kMinBlocks resident blocks. Measured on the H200: (8, 1, 2) for
// K > 2 ((4, 1, 3) and (2, 1, 4) were 1-17 % slower); (2, 1, 4) for K <= 2, where (2, 2, 2)
// was latency-bound at 15 warps per multiprocessor (Mixtral T=32768: 393 -> 329 us). The h
// loop is warp-uniform (lanes past H idle in it) because it shuffles. partial: [kThreads / 32][K]
// floats of dynamic shared memory when parts > 1, to add the dot products of a token's warps in
// a fixed order.
template <typename C, typename X, int V, int kGroup, int kUnroll, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    token_cotangents_kernel(UnpermuteBwdArgs a, int32_t* owner, int parts) {
  extern __shared__ float partial[];
  constexpr int64_t kStep = 32 * V;  // values a warp covers with one vector per lane
  const int64_t H = a.hidden_size, K = a.topk, R = a.rows, n = a.batch * a.tokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per_round = kBwdMaxParts / parts, slot = warp / parts, part = warp % parts;
  for (int64_t g0 = blockIdx.x * int64_t{per_round}; g0 < n; g0 += int64_t(gridDim.x) * per_round) {
    const int64_t g = g0 + slot;  // this warp's token; the block's round ends with a barrier
    if (g < n) {
      const int64_t b = g / a.tokens, t = g - b * a.tokens;
      const C* ct = static_cast<const C*>(a.ct) + b * a.ct_bstride + t * H;
      const X* x = static_cast<const X*>(a.x) + b * a.x_bstride;
      X* dx = static_cast<X*>(a.out_x) + b * R * H;
      for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
        const int64_t j = t * K + k0 + lane;  // lane e < kGroup reads entry k0 + e
        int32_t my_row = -1;
        float my_weight = 0.0f;
        if (lane < kGroup && k0 + lane < K) {
          my_row = a.row_map[b * a.rm_bstride + j];
          if (my_row >= R) my_row = -1;
          my_weight = weight_at(a.weights, a.w_dtype, b * a.w_bstride + j);
        }
        if (my_row >= 0 && part == 0 && atomicCAS(owner + b * R + my_row, -1, static_cast<int32_t>(j)) != -1)
          atomicExch(owner + b * R + my_row, -2);
        int32_t r[kGroup];
        float dot[kGroup];
#pragma unroll
        for (int e = 0; e < kGroup; ++e) {
          r[e] = __shfl_sync(0xffffffffu, my_row, e);
          dot[e] = 0.0f;
        }
        for (int64_t base = part * kStep * kUnroll; base < H; base += parts * kStep * kUnroll) {
          Vec<C, V> c[kUnroll];
          Vec<X, V> raw[kUnroll][kGroup];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t h = base + u * kStep + lane * V;
            if (h >= H) continue;
            c[u] = *reinterpret_cast<const Vec<C, V>*>(ct + h);
#pragma unroll
            for (int e = 0; e < kGroup; ++e)
              if (r[e] >= 0) raw[u][e] = *reinterpret_cast<const Vec<X, V>*>(x + r[e] * H + h);
          }
#pragma unroll
          for (int e = 0; e < kGroup; ++e) {
            const float w = __shfl_sync(0xffffffffu, my_weight, e);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int64_t h = base + u * kStep + lane * V;
              if (h >= H || r[e] < 0) continue;
              float scaled[V];
#pragma unroll
              for (int i = 0; i < V; ++i) {
                const float cf = to_f32(c[u].v[i]);
                dot[e] += cf * to_f32(raw[u][e].v[i]);
                scaled[i] = w * cf;
              }
              store_f32<X, V>(dx + r[e] * H + h, scaled);
            }
          }
        }
#pragma unroll
        for (int e = 0; e < kGroup; ++e)
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) dot[e] += __shfl_xor_sync(0xffffffffu, dot[e], offset);
        // Every lane holds the sums now; lane e keeps entry k0 + e's (a row out of range adds 0).
        float mine = 0.0f;
#pragma unroll
        for (int e = 0; e < kGroup; ++e)
          if (lane == e) mine = dot[e];
        if (lane < kGroup && k0 + lane < K) {
          if (parts == 1) store_weight(a.out_w, a.out_w_dtype, g * K + k0 + lane, mine);
          else partial[warp * K + k0 + lane] = mine;
        }
      }
    }
    if (parts > 1) {
      __syncthreads();
      for (int i = threadIdx.x; i < per_round * K; i += kThreads) {
        const int s = i / K, k = i - s * K;
        if (g0 + s >= n) continue;
        float total = 0.0f;
        for (int p = 0; p < parts; ++p) total += partial[(s * parts + p) * K + k];
        store_weight(a.out_w, a.out_w_dtype, (g0 + s) * K + k, total);
      }
      __syncthreads();  // partial serves the next round
    }
  }
}

// A warp: of rows r0 .. r0 + 31 of example b, zeroes those nothing maps to and sums those of
// several entries in ascending entry order (owner_b: that example's owners, global or shared).
template <typename C, typename X, int V>
__device__ void shared_and_empty_rows(const UnpermuteBwdArgs& a, int64_t b, int64_t r0, const int32_t* owner_b) {
  const int64_t H = a.hidden_size, K = a.topk, n = a.tokens * K, R = a.rows, r = r0 + threadIdx.x % 32;
  const int lane = threadIdx.x % 32;
  const int32_t o = r < R ? owner_b[r] : 0;
  uint32_t todo = __ballot_sync(0xffffffffu, r < R && o < 0);
  while (todo) {
    const int src = __ffs(todo) - 1;
    todo &= todo - 1;
    const int64_t row = r0 + src;
    const bool several = __shfl_sync(0xffffffffu, o, src) == -2;
    X* out = static_cast<X*>(a.out_x) + (b * R + row) * H;
    for (int64_t base = 0; base < H; base += 32 * int64_t{V}) {
      const int64_t h = base + lane * int64_t{V};
      float acc[V] = {};
      for (int64_t j0 = 0; several && j0 < n; j0 += 32) {
        const int64_t j = j0 + lane;
        uint32_t hits = __ballot_sync(0xffffffffu, j < n && a.row_map[b * a.rm_bstride + j] == row);
        while (hits) {
          const int64_t e = j0 + __ffs(hits) - 1;  // ascending entry order
          hits &= hits - 1;
          const float w = weight_at(a.weights, a.w_dtype, b * a.w_bstride + e);
          if (h < H) {
            float c[V];
            load_f32<C, V>(static_cast<const C*>(a.ct) + b * a.ct_bstride + (e / K) * H + h, c);
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += w * c[i];
          }
        }
      }
      if (h < H) store_f32<X, V>(out + h, acc);
    }
  }
}

template <typename C, typename X, int V>
__global__ void shared_and_empty_rows_kernel(UnpermuteBwdArgs a, const int32_t* owner) {
  const int64_t per_example = (a.rows + 31) / 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t q = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; q < a.batch * per_example; q += warps) {
    const int64_t b = q / per_example;
    shared_and_empty_rows<C, X, V>(a, b, (q - b * per_example) * 32, owner + b * a.rows);
  }
}

// Small batches in one launch (no memset, no second pass): each block claims its example's
// rows in shared memory itself (the same owners the token pass gives), then takes whole
// entries, a block per entry (its dot product, the 8 warps' sums added in order, and w * ct
// into the row it owns alone), and groups of 32 rows for shared_and_empty_rows. Measured on
// the H200 against the token pass: faster up to 1024 entries (Mixtral T=512 5.8 vs 11.7 us,
// DeepSeek T=128 8.4 vs 10.8), slower at 2048 (Qwen3 T=256 8.9 vs 7.0), where every block
// repeats a claim of 2048 entries.
constexpr int64_t kBwdSmallMaxEntries = 1024, kBwdSmallMaxRows = 8192;  // 32 KiB of owners
constexpr int kBwdSmallUnroll = 2, kBwdSmallBlocksPerSM = 4;  // 64 registers, no spills

template <typename C, typename X, int V>
__global__ void __launch_bounds__(kThreads, kBwdSmallBlocksPerSM) unpermute_bwd_small_kernel(UnpermuteBwdArgs a) {
  extern __shared__ int32_t owner[];  // [rows]
  __shared__ float warp_dots[kThreads / 32];
  const int64_t H = a.hidden_size, K = a.topk, R = a.rows, b = blockIdx.y;
  const int n = static_cast<int>(a.tokens * K);
  const int32_t* rm = a.row_map + b * a.rm_bstride;
  for (int r = threadIdx.x; r < R; r += kThreads) owner[r] = -1;
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const int32_t r = rm[j];
    if (r >= 0 && r < R && atomicCAS(&owner[r], -1, j) != -1) atomicExch(&owner[r], -2);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  for (int j = blockIdx.x; j < n; j += gridDim.x) {
    const int64_t r = rm[j] < R ? rm[j] : -1;
    const float w = weight_at(a.weights, a.w_dtype, b * a.w_bstride + j);
    const bool owned = r >= 0 && owner[r] == j;
    const C* ct = static_cast<const C*>(a.ct) + b * a.ct_bstride + (j / K) * H;
    const X* x = static_cast<const X*>(a.x) + b * a.x_bstride + r * H;
    X* dx = static_cast<X*>(a.out_x) + (b * R + r) * H;
    float dot = 0.0f;
    for (int64_t base = threadIdx.x * int64_t{V}; r >= 0 && base < H; base += kThreads * V * kBwdSmallUnroll) {
      Vec<C, V> c[kBwdSmallUnroll];
      Vec<X, V> raw[kBwdSmallUnroll];
#pragma unroll
      for (int u = 0; u < kBwdSmallUnroll; ++u) {
        const int64_t h = base + u * kThreads * V;
        if (h >= H) continue;
        c[u] = *reinterpret_cast<const Vec<C, V>*>(ct + h);
        raw[u] = *reinterpret_cast<const Vec<X, V>*>(x + h);
      }
#pragma unroll
      for (int u = 0; u < kBwdSmallUnroll; ++u) {
        const int64_t h = base + u * kThreads * V;
        if (h >= H) continue;
        float scaled[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float cf = to_f32(c[u].v[i]);
          dot += cf * to_f32(raw[u].v[i]);
          scaled[i] = w * cf;
        }
        if (owned) store_f32<X, V>(dx + h, scaled);
      }
    }
    dot = group_sum<kThreads>(dot, warp_dots);
    if (threadIdx.x == 0) store_weight(a.out_w, a.out_w_dtype, b * n + j, dot);
  }
  for (int64_t q = blockIdx.x * int64_t{kThreads / 32} + warp; q * 32 < R; q += int64_t(gridDim.x) * (kThreads / 32))
    shared_and_empty_rows<C, X, V>(a, b, q * 32, owner);
}

bool use_small_bwd(const UnpermuteBwdArgs& a) {
  return a.tokens * a.topk <= kBwdSmallMaxEntries && a.rows <= kBwdSmallMaxRows && a.batch <= 65535;
}

template <typename C, typename X, int V>
cudaError_t launch_unpermute_bwd_small(const UnpermuteBwdArgs& a, cudaStream_t stream) {
  // A block per entry, enough for the row groups too, but no more than are resident at once
  // (4 per multiprocessor): every block repeats the claim.
  const int64_t blocks = std::max(a.tokens * a.topk, (a.rows + kThreads - 1) / kThreads);
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, kBwdSmallBlocksPerSM * multiprocessors())),
                  static_cast<unsigned>(a.batch));
  unpermute_bwd_small_kernel<C, X, V><<<grid, kThreads, sizeof(int32_t) * a.rows, stream>>>(a);
  return cudaGetLastError();
}

template <typename C, typename X, int V, int kGroup, int kUnroll, int kMinBlocks>
cudaError_t launch_token_cotangents(const UnpermuteBwdArgs& a, int32_t* owner, cudaStream_t stream) {
  // One warp per token once the tokens alone give every multiprocessor ~24 warps; else more
  // warps per token, as many as the row has warp-wide chunks, up to a block.
  const int64_t n = a.batch * a.tokens, chunks = (a.hidden_size + 32 * V * kUnroll - 1) / (32 * V * kUnroll);
  const size_t partial_bytes = sizeof(float) * kBwdMaxParts * a.topk;
  int parts = 1;
  while (parts < kBwdMaxParts && 2 * parts <= chunks && n * parts < 24 * multiprocessors() &&
         partial_bytes <= 48 * 1024)
    parts *= 2;
  token_cotangents_kernel<C, X, V, kGroup, kUnroll, kMinBlocks>
      <<<blocks_for(n, kBwdMaxParts / parts), kThreads, parts > 1 ? partial_bytes : 0, stream>>>(a, owner, parts);
  return cudaGetLastError();
}

template <typename C, typename X, int V>
cudaError_t launch_unpermute_bwd(const UnpermuteBwdArgs& a, int32_t* owner, cudaStream_t stream) {
  if (a.batch * a.tokens > 0) {
    const cudaError_t err = a.topk <= 2 ? launch_token_cotangents<C, X, V, 2, 1, 4>(a, owner, stream)
                                        : launch_token_cotangents<C, X, V, 8, 1, 2>(a, owner, stream);
    if (err != cudaSuccess) return err;
  }
  if (a.hidden_size > 0)
    shared_and_empty_rows_kernel<C, X, V>
        <<<blocks_for(a.batch * ((a.rows + 31) / 32), kThreads / 32), kThreads, 0, stream>>>(a, owner);
  return cudaGetLastError();
}

}  // namespace

bool use_tiles(int64_t num_local) { return num_local <= kMaxRankedLocal; }

cudaError_t permute_workspace_bytes(int64_t batch, int64_t entries, int64_t num_local, int64_t* bytes) {
  if (use_tiles(num_local)) {
    carve_tiles(nullptr, batch, entries, num_local, bytes);
    return cudaSuccess;
  }
  const int64_t items = batch * entries;
  const int64_t extra = batch * (num_local + 2) + batch * (num_local + 1) + batch * num_local;
  return sort_space_bytes(items, extra, key_bits(uint64_t(batch) * (num_local + 1) - 1), bytes);
}

cudaError_t scatter_workspace_bytes(int64_t batch, int64_t entries, int64_t rows, int64_t* bytes) {
  const int64_t items = batch * entries;
  return sort_space_bytes(items, batch * (rows + 1) + 1, key_bits(uint64_t(batch) * (rows + 1) - 1), bytes);
}

cudaError_t permute_small(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk, row_bytes = a.hidden_size * a.elem_bytes;
  return with_access_type(std::max<int64_t>(row_bytes, 1), {a.hidden, a.out}, [&](auto tag) -> cudaError_t {
    using V = typename decltype(tag)::type;
    const int64_t chunks = std::max<int64_t>(1, (row_bytes / int64_t{sizeof(V)} + kSmallThreads - 1) / kSmallThreads);
    const int64_t units = std::max(a.tokens, a.rows) * chunks;
    // Every block pays for the routing: use about two blocks per multiprocessor, not one per unit.
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(units, 2 * multiprocessors()))),
                    static_cast<unsigned>(a.batch));
    if (n <= kTinyMaxEntries && a.align == 1) {
      const dim3 tiny_grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(n * chunks, 2 * multiprocessors()))),
                           static_cast<unsigned>(a.batch));
      permute_tiny_kernel<V><<<tiny_grid, kSmallThreads, 0, stream>>>(a);
      return cudaGetLastError();
    }
    // Counting pays while each block copies one (token, chunk): with several, each waits for its
    // count before loading (H200, DeepSeek T=256: 22.7 us against 17.3 ranked).
    const dim3 counted_grid(static_cast<unsigned>(std::max<int64_t>(1, a.tokens * chunks)), static_cast<unsigned>(a.batch));
    const int64_t shares = (a.num_local + counted_grid.x - 1) / counted_grid.x;
    if (a.align == 1 && a.tokens * chunks <= 2 * multiprocessors() && 1 + shares + a.topk <= kMaxCountQueries) {
      with_items(n, [&](auto items) { permute_counted_kernel<decltype(items)::value, V><<<counted_grid, kSmallThreads, 0, stream>>>(a); });
      return cudaGetLastError();
    }
    with_items(n, [&](auto items) { permute_small_kernel<decltype(items)::value, V><<<grid, kSmallThreads, 0, stream>>>(a); });
    return cudaGetLastError();
  });
}

// Copies each token row to its K rows and zeroes the rows no entry holds.
cudaError_t copy_and_zero(const PermuteArgs& a, const EntryRows& er, RowLayout layout, cudaStream_t stream) {
  const int64_t row_bytes = a.hidden_size * a.elem_bytes;
  if (row_bytes == 0 && er.ranked == nullptr) return cudaSuccess;  // tiled routing still records the rows
  return with_access_type(std::max<int64_t>(row_bytes, 1), {a.hidden, a.out}, [&](auto tag) -> cudaError_t {
    using V = typename decltype(tag)::type;
    const int64_t chunks = std::max<int64_t>(1, (row_bytes / int64_t{sizeof(V)} + kCopyChunk - 1) / kCopyChunk);
    const int64_t units = std::max(a.batch * a.tokens * chunks, int64_t{4} * multiprocessors());
    auto kernel = er.ranked ? (a.expert_map ? copy_rows_kernel<V, true, true> : copy_rows_kernel<V, false, true>)
                            : (a.expert_map ? copy_rows_kernel<V, true, false> : copy_rows_kernel<V, false, false>);
    kernel<<<blocks_for(units, 1), kCopyThreads, 0, stream>>>(
        static_cast<const char*>(a.hidden), a.hidden_bstride * a.elem_bytes, er, a.tokens, a.topk, a.batch, a.rows,
        row_bytes, layout, a.num_local, a.align, static_cast<char*>(a.out));
    return cudaGetLastError();
  });
}

cudaError_t permute_tiled(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk;
  const TileSpace ts = carve_tiles(a.workspace, a.batch, n, a.num_local);
  const dim3 grid(static_cast<unsigned>(ts.tiles), static_cast<unsigned>(a.batch));
  with_items(ts.tile_entries, [&](auto items) { tile_rank_kernel<decltype(items)::value><<<grid, kRankThreads, 0, stream>>>(a, ts); });
  MOE_CHECK_LAUNCH();
  tile_offsets_kernel<<<static_cast<unsigned>(a.batch), dim3(static_cast<unsigned>(a.num_local), ts.shares), 0, stream>>>(
      a, ts);
  MOE_CHECK_LAUNCH();
  int shift = 0;
  while ((int64_t{1} << shift) < ts.tile_entries) ++shift;
  return copy_and_zero(a, EntryRows{a.row_map, ts.ranked, ts.offset, ts.tiles, shift}, RowLayout{ts.starts, ts.counts},
                       stream);
}

// Fallback for more than kMaxRankedLocal local experts: a CUB radix sort of (batch, expert) keys.
cudaError_t permute_sorted(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk, total = a.batch * n, L = a.num_local;
  const int bits = key_bits(uint64_t(a.batch) * (L + 1) - 1);
  const int64_t extra = a.batch * (L + 2) + a.batch * (L + 1) + a.batch * L;
  size_t cub_bytes = 0;
  if (cudaError_t err = cub_sort_bytes(total, bits, &cub_bytes); err != cudaSuccess) return err;
  SortSpace s = carve(a.workspace, total, extra, cub_bytes);
  int32_t* seg = s.extra;
  int32_t* starts = seg + a.batch * (L + 2);
  int32_t* counts = starts + a.batch * (L + 1);
  expert_keys_kernel<<<blocks_for(total), kThreads, 0, stream>>>(a.ids, a.ids_bstride, a.expert_map,
                                                                 a.map_bstride, n, total, a.num_experts,
                                                                 a.num_local, s.keys_in, s.vals_in);
  MOE_CHECK_LAUNCH();
  if (cudaError_t err = run_sort(s, total, bits, stream); err != cudaSuccess) return err;
  expert_layout_kernel<<<static_cast<int>(a.batch), kThreads, 0, stream>>>(s.keys_out, total, a.num_local, a.align,
                                                                           seg, starts, counts, a.group_sizes);
  MOE_CHECK_LAUNCH();
  assign_rows_kernel<<<blocks_for(total), kThreads, 0, stream>>>(s.keys_out, s.vals_out, total, a.num_local, seg,
                                                                 starts, a.row_map);
  MOE_CHECK_LAUNCH();
  return copy_and_zero(a, EntryRows{a.row_map, nullptr, nullptr, 0, 0}, RowLayout{starts, counts}, stream);
}

cudaError_t permute(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk;
  if (a.batch == 0) return cudaSuccess;
  if (a.batch > 65535) return cudaErrorInvalidValue;  // grid.y
  if (n <= kSmallMaxEntries && a.num_local <= kMaxRankedLocal) return permute_small(a, stream);
  return use_tiles(a.num_local) ? permute_tiled(a, stream) : permute_sorted(a, stream);
}

template <typename X, typename O, int V>
cudaError_t launch_unpermute(const UnpermuteArgs& a, cudaStream_t stream) {
  const dim3 grid = gather_grid(a.batch * a.tokens, a.hidden_size, V);
  const bool fills_gpu = int64_t{grid.x} * grid.y >= 4 * multiprocessors();
  if (!fills_gpu && a.topk <= kFewMaxK && a.tokens <= 65535 && a.batch <= 65535 &&
      a.hidden_size < (int64_t{1} << 30)) {
    auto launch = [&](auto width) {
      constexpr int W = decltype(width)::value;  // divides V, so H and the row bases stay aligned to it
      const int64_t per_block = int64_t{kGatherThreads} * W;
      unpermute_few_kernel<X, O, W><<<dim3(static_cast<unsigned>((a.hidden_size + per_block - 1) / per_block),
                                           static_cast<unsigned>(a.tokens), static_cast<unsigned>(a.batch)),
                                      kGatherThreads, 0, stream>>>(a);
      return cudaGetLastError();
    };
    const int split = few_access_split(a.batch * a.tokens, a.hidden_size * int64_t{sizeof(X)}, a.topk, sizeof(X), V);
    if constexpr (V % 8 == 0) if (split == 8) return launch(std::integral_constant<int, V / 8>{});
    if constexpr (V % 4 == 0) if (split == 4) return launch(std::integral_constant<int, V / 4>{});
    if constexpr (V % 2 == 0) if (split == 2) return launch(std::integral_constant<int, V / 2>{});
    return launch(std::integral_constant<int, V>{});
  }
  if (a.topk <= 2) unpermute_kernel<X, O, V, 2><<<grid, kGatherThreads, 0, stream>>>(a);
  else if (fills_gpu) unpermute_kernel<X, O, V, 4><<<grid, kGatherThreads, 0, stream>>>(a);
  else unpermute_kernel<X, O, V, 8><<<grid, kGatherThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t unpermute(const UnpermuteArgs& a, cudaStream_t stream) {
  if (a.batch * a.tokens == 0 || a.hidden_size == 0) return cudaSuccess;
  cudaError_t result = cudaSuccess;
  visit_input(a.x_dtype, [&](auto xtag) {
    using X = typename decltype(xtag)::type;
    visit_output(a.out_dtype, [&](auto otag) {
      using O = typename decltype(otag)::type;
      constexpr int kVec = kGatherVecBytes / sizeof(X);
      const bool vec = a.hidden_size % kVec == 0 && aligned16(a.x) &&
                       reinterpret_cast<uintptr_t>(a.out) % (sizeof(O) * kVec) == 0;
      result = vec ? launch_unpermute<X, O, kVec>(a, stream) : launch_unpermute<X, O, 1>(a, stream);
    });
  });
  return result;
}

template <typename X, typename O, int V>
cudaError_t launch_scatter(const ScatterArgs& a, const uint32_t* sorted_vals, const int32_t* seg,
                           cudaStream_t stream) {
  if (a.batch * a.tokens > 0) {
    const dim3 grid = gather_grid(a.batch * a.tokens, a.hidden_size, V);
    if (int64_t{grid.x} * grid.y >= 16 * multiprocessors()) {
      single_entry_rows_kernel<X, O, V, 4><<<gather_grid(a.batch * a.tokens, a.hidden_size, 4 * V), kGatherThreads, 0,
                                              stream>>>(a, seg);
    } else {
      single_entry_rows_kernel<X, O, V, 1><<<grid, kGatherThreads, 0, stream>>>(a, seg);
    }
    MOE_CHECK_LAUNCH();
  }
  multi_entry_rows_kernel<X, O, V><<<blocks_for(a.batch * ((a.rows + 31) / 32), kThreads / 32), kThreads, 0, stream>>>(
      a, sorted_vals, seg);
  return cudaGetLastError();
}

cudaError_t scatter(const ScatterArgs& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.topk, total = a.batch * n, R = a.rows;
  if (a.batch * R == 0) return cudaSuccess;
  if (uint64_t(a.batch) * (R + 1) >= (uint64_t(1) << 31)) return cudaErrorInvalidValue;
  const int64_t num_keys = a.batch * (R + 1);
  const int bits = key_bits(uint64_t(num_keys) - 1);
  size_t cub_bytes = 0;
  if (cudaError_t err = cub_sort_bytes(total, bits, &cub_bytes); err != cudaSuccess) return err;
  SortSpace s = carve(a.workspace, total, num_keys + 1, cub_bytes);
  if (total > 0) {
    row_keys_kernel<<<blocks_for(total), kThreads, 0, stream>>>(a.row_map, a.rm_bstride, n, total, R, s.keys_in,
                                                                s.vals_in);
    MOE_CHECK_LAUNCH();
    if (cudaError_t err = run_sort(s, total, bits, stream); err != cudaSuccess) return err;
  }
  segment_bounds_kernel<<<blocks_for(num_keys + 1), kThreads, 0, stream>>>(s.keys_out, total, num_keys, s.extra);
  MOE_CHECK_LAUNCH();
  if (a.hidden_size == 0) return cudaSuccess;
  cudaError_t result = cudaSuccess;
  visit_input(a.x_dtype, [&](auto xtag) {
    using X = typename decltype(xtag)::type;
    visit_output(a.out_dtype, [&](auto otag) {
      using O = typename decltype(otag)::type;
      constexpr int kVec = 16 / sizeof(X);
      const bool vec = a.hidden_size % kVec == 0 && aligned16(a.x) &&
                       reinterpret_cast<uintptr_t>(a.out) % (sizeof(O) * kVec) == 0;
      result = vec ? launch_scatter<X, O, kVec>(a, s.vals_out, s.extra, stream)
                   : launch_scatter<X, O, 1>(a, s.vals_out, s.extra, stream);
    });
  });
  return result;
}

cudaError_t weight_grad(const WeightGradArgs& a, cudaStream_t stream) {
  const int64_t entries = a.batch * a.tokens * a.topk;
  if (entries == 0) return cudaSuccess;
  // A warp per entry for short rows (<= 8 vectors per lane) once that gives every
  // multiprocessor two blocks of work; else a block per entry. Measured on the H200: a warp
  // per entry took Qwen3 (H=2048) T=16384 from 288 to 217 us but Mixtral (H=4096) T=4096
  // from 34 to 38 and DeepSeek (H=7168) T=4096 from 147 to 167.
  const int64_t elem = std::max(dtype_bytes(a.ct_dtype), dtype_bytes(a.x_dtype));
  const bool warps = entries >= int64_t{2} * (kThreads / 32) * multiprocessors() &&
                     a.hidden_size * elem <= 8 * 32 * kGatherVecBytes;
  cudaError_t result = cudaSuccess;
  visit_input(a.ct_dtype, [&](auto ctag) {
    using C = typename decltype(ctag)::type;
    visit_input(a.x_dtype, [&](auto xtag) {
      using X = typename decltype(xtag)::type;
      constexpr int kVec = 16 / (sizeof(C) > sizeof(X) ? sizeof(C) : sizeof(X));
      const bool vec = a.hidden_size % kVec == 0 && aligned16(a.ct) && aligned16(a.x);
      auto kernel = vec ? (warps ? weight_grad_kernel<C, X, kVec, 32> : weight_grad_kernel<C, X, kVec, kThreads>)
                        : (warps ? weight_grad_kernel<C, X, 1, 32> : weight_grad_kernel<C, X, 1, kThreads>);
      const int64_t per_block = warps ? kThreads / 32 : 1;
      kernel<<<blocks_for(entries, per_block), kThreads, 0, stream>>>(a);
      result = cudaGetLastError();
    });
  });
  return result;
}

int64_t unpermute_bwd_workspace_bytes(int64_t batch, int64_t rows) {
  return pad256(4 * std::max<int64_t>(1, batch * rows));
}

cudaError_t unpermute_bwd(const UnpermuteBwdArgs& a, cudaStream_t stream) {
  // float8 inputs take scatter + weight_grad (the lowering chooses); the expert rows' cotangent
  // comes in expert_out's dtype.
  auto wide = [](Dtype d) { return d == Dtype::kF32 || d == Dtype::kBF16 || d == Dtype::kF16; };
  if (!wide(a.ct_dtype) || !wide(a.x_dtype) || a.out_x_dtype != a.x_dtype) return cudaErrorInvalidValue;
  if (a.batch == 0) return cudaSuccess;
  const bool small = use_small_bwd(a);
  int32_t* owner = static_cast<int32_t*>(a.workspace);
  // All bytes 0xff: every owner -1.
  if (!small && a.batch * a.rows > 0)
    if (cudaError_t err = cudaMemsetAsync(owner, 0xff, sizeof(int32_t) * a.batch * a.rows, stream); err != cudaSuccess)
      return err;
  cudaError_t result = cudaSuccess;
  visit_output(a.ct_dtype, [&](auto ctag) {
    using C = typename decltype(ctag)::type;
    visit_output(a.x_dtype, [&](auto xtag) {
      using X = typename decltype(xtag)::type;
      constexpr int kVec = 16 / (sizeof(C) > sizeof(X) ? sizeof(C) : sizeof(X));
      const bool vec = a.hidden_size % kVec == 0 && aligned16(a.ct) && aligned16(a.x) && aligned16(a.out_x);
      if (small)
        result = vec ? launch_unpermute_bwd_small<C, X, kVec>(a, stream) : launch_unpermute_bwd_small<C, X, 1>(a, stream);
      else
        result = vec ? launch_unpermute_bwd<C, X, kVec>(a, owner, stream) : launch_unpermute_bwd<C, X, 1>(a, owner, stream);
    });
  });
  return result;
}

}  // namespace moe::cuda
