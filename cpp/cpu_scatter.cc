// scatter on the CPU: entries grouped by row with a counting sort (ascending flat index within a
// row, so sums are deterministic), then rows spread over the thread pool.
#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "cpu_kernels.h"
#include "dtype_dispatch.h"
#include "kernel_args.h"

namespace moe::cpu {

int64_t scatter_workspace_bytes(int64_t entries, int64_t rows) { return 4 * (rows + 1 + entries); }

void scatter(const ScatterArgs& a, const ParallelFor& parallel) {
  const int64_t H = a.hidden_size, K = a.topk, n = a.tokens * a.topk, R = a.rows;
  int32_t* offsets = static_cast<int32_t*>(a.workspace);  // [R + 1], then entries [n]
  int32_t* entries = offsets + R + 1;
  visit_input<CpuTypes>(a.x_dtype, [&](auto xtag) {
    using X = typename decltype(xtag)::type;
    visit_output<CpuTypes>(a.out_dtype, [&](auto otag) {
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

}  // namespace moe::cpu
