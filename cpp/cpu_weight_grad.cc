// weight_grad on the CPU: one float32 dot product per entry, tokens spread over the thread pool.
#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "cpu_kernels.h"
#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cpu {

void weight_grad(const WeightGradArgs& a, const ParallelFor& parallel) {
  const int64_t H = a.hidden_size, K = a.topk;
  visit_input<CpuTypes>(a.ct_dtype, [&](auto ctag) {
    using C = typename decltype(ctag)::type;
    visit_input<CpuTypes>(a.x_dtype, [&](auto xtag) {
      using X = typename decltype(xtag)::type;
      visit_output<CpuTypes>(a.out_dtype, [&](auto otag) {
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
