// What the CPU kernel units share: the element types and their float32 conversions, weight
// reads, the accumulator chunk, and the huge-page hint for large outputs.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cpu {

struct BF16 { uint16_t bits; };
struct F8E4M3FN { uint8_t bits; };
struct F8E5M2 { uint8_t bits; };
using F16 = _Float16;

struct CpuTypes {
  using f32 = float;
  using bf16 = BF16;
  using f16 = F16;
  using f8e4m3fn = F8E4M3FN;
  using f8e5m2 = F8E5M2;
};

inline float bits_to_f32(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// float8 decodes through 256-entry tables built once from the formats' definitions.
inline std::array<float, 256> make_f8_table(int exp_bits, bool ieee_specials) {
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

// Weight i of dtype d; null weights read as 1.
inline float load_weight(const void* w, Dtype d, int64_t i) {
  if (w == nullptr) return 1.0f;
  float out = 0.0f;
  visit_input<CpuTypes>(d, [&](auto tag) {
    out = to_f32(static_cast<const typename decltype(tag)::type*>(w)[i]);
  });
  return out;
}

// float32 accumulators on the stack per pass over a row (no allocation inside a handler).
constexpr int64_t kChunk = 512;

// Large XLA outputs are fresh mmap'd memory: first-touch page faults cost more than the copy
// itself (4 KiB each). Asking for transparent huge pages turns 512 faults into one. A hint:
// failure (or another OS) changes nothing.
inline void prefer_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(4 * kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

}  // namespace moe::cpu
