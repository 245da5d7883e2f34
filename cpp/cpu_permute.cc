// permute on the CPU: an O(T*K + E) stable counting sort for the row layout, then memcpy row
// copies and zeroed padding.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"
#include "cpu_kernels.h"
#include "kernel_args.h"
#include "moe_index.h"

namespace moe::cpu {

int64_t permute_workspace_bytes(int64_t num_local) { return 4 * std::max<int64_t>(num_local, 1); }

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

}  // namespace moe::cpu
