// CPU kernels: an O(T*K + E) counting sort for the row layout, memcpy row copies and
// float32 accumulation in fixed-size stack chunks (no allocation inside a handler).
#include "cpu_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "moe_index.h"

namespace moe::cpu {
namespace {

struct BF16 { uint16_t bits; };
struct F8E4M3FN { uint8_t bits; };
struct F8E5M2 { uint8_t bits; };
using F16 = _Float16;

inline float bits_to_f32(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// float8 decodes through 256-entry tables built once from the formats' definitions.
std::array<float, 256> make_f8_table(int exp_bits, bool ieee_specials) {
  std::array<float, 256> table{};
  const int man_bits = 7 - exp_bits, bias = (1 << (exp_bits - 1)) - 1;
  for (int v = 0; v < 256; ++v) {
    const int sign = v >> 7, e = (v >> man_bits) & ((1 << exp_bits) - 1), m = v & ((1 << man_bits) - 1);
    float mag;
    if (ieee_specials && e == (1 << exp_bits) - 1) {
      mag = m == 0 ? INFINITY : NAN;
    } else if (!ieee_specials && e == (1 << exp_bits) - 1 && m == (1 << man_bits) - 1) {
      mag = NAN;  // e4m3fn: no infinities, a single NaN pattern per sign
    } else if (e == 0) {
      mag = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
    } else {
      mag = std::ldexp(1.0f + std::ldexp(static_cast<float>(m), -man_bits), e - bias);
    }
    table[v] = sign ? -mag : mag;
  }
  return table;
}

inline float to_f32(float x) { return x; }
inline float to_f32(F16 x) { return static_cast<float>(x); }
inline float to_f32(BF16 x) { return bits_to_f32(static_cast<uint32_t>(x.bits) << 16); }
inline float to_f32(F8E4M3FN x) {
  static const std::array<float, 256> table = make_f8_table(4, false);
  return table[x.bits];
}
inline float to_f32(F8E5M2 x) {
  static const std::array<float, 256> table = make_f8_table(5, true);
  return table[x.bits];
}

template <typename T> T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline F16 from_f32<F16>(float x) { return static_cast<F16>(x); }
template <> inline BF16 from_f32<BF16>(float x) {
  const uint32_t b = f32_to_bits(x);
  if (std::isnan(x)) return BF16{static_cast<uint16_t>((b >> 16) | 0x40)};
  return BF16{static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16)};
}

template <typename T> struct Tag { using type = T; };

// Calls f(Tag<T>{}) with the C++ type of `d`.
template <typename F>
void visit_input(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kF32: return f(Tag<float>{});
    case Dtype::kBF16: return f(Tag<BF16>{});
    case Dtype::kF16: return f(Tag<F16>{});
    case Dtype::kF8E4M3FN: return f(Tag<F8E4M3FN>{});
    case Dtype::kF8E5M2: return f(Tag<F8E5M2>{});
  }
}
// Outputs are float32, bfloat16 or float16 (the Python layer casts to float8 afterwards).
template <typename F>
void visit_output(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kBF16: return f(Tag<BF16>{});
    case Dtype::kF16: return f(Tag<F16>{});
    default: return f(Tag<float>{});
  }
}

float load_weight(const void* w, Dtype d, int64_t i) {
  if (w == nullptr) return 1.0f;
  float out = 0.0f;
  visit_input(d, [&](auto tag) {
    out = to_f32(static_cast<const typename decltype(tag)::type*>(w)[i]);
  });
  return out;
}

constexpr int64_t kChunk = 512;

// Large XLA outputs are fresh mmap'd memory: first-touch page faults cost more than the copy
// itself (4 KiB each). Asking for transparent huge pages turns 512 faults into one. A hint:
// failure (or another OS) changes nothing.
void prefer_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(4 * kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}  // float32 accumulators on the stack per pass over a row

}  // namespace

int64_t permute_workspace_bytes(int64_t num_local) { return 4 * std::max<int64_t>(num_local, 1); }

int64_t scatter_workspace_bytes(int64_t entries, int64_t rows) { return 4 * (rows + 1 + entries); }

void permute(const PermuteArgs& a) {
  const int64_t n = a.tokens * a.topk, row_bytes = a.hidden_size * a.elem_bytes;
  const int32_t L = a.num_local;
  int32_t* cursor = static_cast<int32_t*>(a.workspace);
  prefer_huge_pages(a.out, a.batch * a.rows * row_bytes);
  for (int64_t b = 0; b < a.batch; ++b) {
    const int32_t* ids = a.ids + b * a.ids_bstride;
    const int32_t* map = a.expert_map ? a.expert_map + b * a.map_bstride : nullptr;
    const char* hidden = static_cast<const char*>(a.hidden) + b * a.hidden_bstride * a.elem_bytes;
    char* out = static_cast<char*>(a.out) + b * a.rows * row_bytes;
    int32_t* counts = a.group_sizes + b * L;  // holds the unpadded counts until the end
    int32_t* row_map = a.row_map + b * n;

    std::fill(counts, counts + L, 0);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t e = local_expert(ids[i], map, a.num_experts, L);
      if (e < L) ++counts[e];
    }
    int64_t start = 0;
    for (int32_t j = 0; j < L; ++j) {
      cursor[j] = static_cast<int32_t>(start);
      start += round_up(counts[j], a.align);
    }
    // Ascending flat index inside each expert: a stable counting sort.
    for (int64_t i = 0; i < n; ++i) {
      const int32_t e = local_expert(ids[i], map, a.num_experts, L);
      row_map[i] = e == L ? -1 : cursor[e]++;
    }
    // One thread: the copy is bound by first-touch faults of the output, and two threads
    // faulting huge pages into one mapping measured slower than one.
    for (int64_t i = 0; i < n; ++i)
      if (row_map[i] >= 0) std::memcpy(out + row_map[i] * row_bytes, hidden + (i / a.topk) * row_bytes, row_bytes);
    start = 0;
    for (int32_t j = 0; j < L; ++j) {  // zero each block's padding; cursor[j] is its fill end
      const int64_t end = start + round_up(counts[j], a.align);
      std::memset(out + cursor[j] * row_bytes, 0, (end - cursor[j]) * row_bytes);
      counts[j] = static_cast<int32_t>(end - start);
      start = end;
    }
    std::memset(out + start * row_bytes, 0, (a.rows - start) * row_bytes);  // rows past the last block
  }
}

void unpermute(const UnpermuteArgs& a, const ParallelFor& parallel) {
  const int64_t H = a.hidden_size, K = a.topk;
  visit_input(a.x_dtype, [&](auto xtag) {
    using X = typename decltype(xtag)::type;
    visit_output(a.out_dtype, [&](auto otag) {
      using O = typename decltype(otag)::type;
      const X* xs = static_cast<const X*>(a.x);
      O* out = static_cast<O*>(a.out);
      prefer_huge_pages(out, a.batch * a.tokens * H * int64_t{sizeof(O)});
      parallel(a.batch * a.tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(H * K, 1)),
               [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g) {
          const int64_t b = g / a.tokens, t = g % a.tokens;
          const X* x = xs + b * a.x_bstride;
          const int32_t* rm = a.row_map + b * a.rm_bstride;
          const int64_t wb = b * a.w_bstride;
          O* o = out + g * H;
          for (int64_t h0 = 0; h0 < H; h0 += kChunk) {
            const int64_t len = std::min(kChunk, H - h0);
            float acc[kChunk];
            std::fill(acc, acc + len, 0.0f);
            for (int64_t k = 0; k < K; ++k) {
              const int64_t r = rm[t * K + k];
              if (r < 0 || r >= a.rows) continue;
              const float w = load_weight(a.weights, a.w_dtype, wb + t * K + k);
              const X* src = x + r * H + h0;
              for (int64_t h = 0; h < len; ++h) acc[h] += w * to_f32(src[h]);
            }
            for (int64_t h = 0; h < len; ++h) o[h0 + h] = from_f32<O>(acc[h]);
          }
        }
      });
    });
  });
}

void scatter(const ScatterArgs& a, const ParallelFor& parallel) {
  const int64_t H = a.hidden_size, K = a.topk, n = a.tokens * a.topk, R = a.rows;
  int32_t* offsets = static_cast<int32_t*>(a.workspace);  // [R + 1], then entries [n]
  int32_t* entries = offsets + R + 1;
  visit_input(a.x_dtype, [&](auto xtag) {
    using X = typename decltype(xtag)::type;
    visit_output(a.out_dtype, [&](auto otag) {
      using O = typename decltype(otag)::type;
      prefer_huge_pages(a.out, a.batch * R * H * int64_t{sizeof(O)});
      for (int64_t b = 0; b < a.batch; ++b) {
        const X* x = static_cast<const X*>(a.x) + b * a.x_bstride;
        const int32_t* rm = a.row_map + b * a.rm_bstride;
        O* out = static_cast<O*>(a.out) + b * R * H;
        // Entries grouped by row, ascending flat index within a row: deterministic sums.
        std::fill(offsets, offsets + R + 1, 0);
        for (int64_t i = 0; i < n; ++i)
          if (rm[i] >= 0 && rm[i] < R) ++offsets[rm[i] + 1];
        for (int64_t r = 0; r < R; ++r) offsets[r + 1] += offsets[r];
        for (int64_t i = 0; i < n; ++i)
          if (rm[i] >= 0 && rm[i] < R) entries[offsets[rm[i]]++] = static_cast<int32_t>(i);
        // offsets[r] now holds the end of row r's entries; its start is offsets[r - 1].
        parallel(R, std::max<int64_t>(1, 4096 / std::max<int64_t>(H, 1)),
                 [&](int64_t row_begin, int64_t row_end) {
          for (int64_t r = row_begin; r < row_end; ++r) {
            const int64_t begin = r == 0 ? 0 : offsets[r - 1], end = offsets[r];
            O* o = out + r * H;
            for (int64_t h0 = 0; h0 < H; h0 += kChunk) {
              const int64_t len = std::min(kChunk, H - h0);
              float acc[kChunk];
              std::fill(acc, acc + len, 0.0f);
              for (int64_t p = begin; p < end; ++p) {
                const int64_t i = entries[p];
                const float w = load_weight(a.weights, a.w_dtype, b * a.w_bstride + i);
                const X* src = x + (i / K) * H + h0;
                // The first term is assigned, not added, so a lone -0.0 stays -0.0.
                if (p == begin) for (int64_t h = 0; h < len; ++h) acc[h] = w * to_f32(src[h]);
                else for (int64_t h = 0; h < len; ++h) acc[h] += w * to_f32(src[h]);
              }
              for (int64_t h = 0; h < len; ++h) o[h0 + h] = from_f32<O>(acc[h]);
            }
          }
        });
      }
    });
  });
}

void weight_grad(const WeightGradArgs& a, const ParallelFor& parallel) {
  const int64_t H = a.hidden_size, K = a.topk;
  visit_input(a.ct_dtype, [&](auto ctag) {
    using C = typename decltype(ctag)::type;
    visit_input(a.x_dtype, [&](auto xtag) {
      using X = typename decltype(xtag)::type;
      visit_output(a.out_dtype, [&](auto otag) {
        using O = typename decltype(otag)::type;
        parallel(a.batch * a.tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(H * K, 1)),
                 [&](int64_t begin, int64_t end) {
          for (int64_t g = begin; g < end; ++g) {
            const int64_t b = g / a.tokens, t = g % a.tokens;
            const C* ct = static_cast<const C*>(a.ct) + b * a.ct_bstride;
            const X* x = static_cast<const X*>(a.x) + b * a.x_bstride;
            const int32_t* rm = a.row_map + b * a.rm_bstride;
            O* out = static_cast<O*>(a.out) + b * a.tokens * K;
            for (int64_t k = 0; k < K; ++k) {
              const int64_t r = rm[t * K + k];
              float dot = 0.0f;
              if (r >= 0 && r < a.rows)
                for (int64_t h = 0; h < H; ++h) dot += to_f32(ct[t * H + h]) * to_f32(x[r * H + h]);
              out[t * K + k] = from_f32<O>(dot);
            }
          }
        });
      });
    });
  });
}

}  // namespace moe::cpu
