// unpermute on the CPU: tokens spread over the thread pool, float32 accumulation in ascending k
// over stack chunks of the row.
#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "cpu_kernels.h"
#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cpu {

void unpermute(const UnpermuteArgs& a, const ParallelFor& parallel) {
  const int64_t H = a.hidden_size, K = a.topk;
  visit_input<CpuTypes>(a.x_dtype, [&](auto xtag) {
    using X = typename decltype(xtag)::type;
    visit_output<CpuTypes>(a.out_dtype, [&](auto otag) {
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

}  // namespace moe::cpu
