// XLA FFI handlers for the CPU platform: decode, then run the kernels on XLA's intra-op
// thread pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "cpu_kernels.h"
#include "ffi_decode.h"
#include "ffi_handlers.h"
#include "moe_index.h"

namespace moe {
namespace {

// Splits [0, n) into chunks that the caller and up to num_threads() pool tasks claim from a
// shared counter. The caller never waits for a task that has not started: it claims any
// chunk nobody took, so a busy pool only costs parallelism, never progress.
cpu::ParallelFor parallel_on(ffi::ThreadPool& pool) {
  return [&pool](int64_t n, int64_t grain, const cpu::RangeFn& body) {
    const int64_t workers = std::max<int64_t>(1, pool.num_threads());
    const int64_t chunks = std::min<int64_t>((n + grain - 1) / std::max<int64_t>(grain, 1), 4 * workers);
    if (n <= 0) return;
    if (chunks <= 1 || workers <= 1) return body(0, n);
    struct State {
      std::atomic<int64_t> next{0}, done{0};
      std::mutex mu;
      std::condition_variable cv;
    };
    auto state = std::make_shared<State>();
    const int64_t step = (n + chunks - 1) / chunks;
    // Tasks that start after the last chunk was claimed touch only `state`, never `body`.
    auto run = [state, chunks, step, n, &body] {
      for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
        body(c * step, std::min(n, (c + 1) * step));
        if (state->done.fetch_add(1) + 1 == chunks) {
          std::lock_guard<std::mutex> lock(state->mu);
          state->cv.notify_all();
        }
      }
    };
    for (int64_t w = 1; w < std::min(workers + 1, chunks); ++w) pool.Schedule([run] { run(); });
    run();
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done.load() == chunks; });
  };
}

ffi::Error PermuteCpu(ffi::AnyBuffer hidden, I32Buffer ids, I32Buffer expert_map, int64_t num_experts,
                      int64_t num_local, int64_t align, int64_t has_map, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<I32Buffer> group_sizes, ffi::Result<I32Buffer> row_map,
                      ffi::Result<ffi::AnyBuffer> workspace) {
  PermuteArgs a;
  if (auto err = decode_permute(hidden, ids, expert_map, num_experts, num_local, align, has_map, *out,
                                *group_sizes, *row_map, *workspace, &a);
      !err.success())
    return err;
  if (a.workspace_bytes < cpu::permute_workspace_bytes(num_local)) return invalid("permute: workspace too small");
  cpu::permute(a);
  return ffi::Error::Success();
}

ffi::Error UnpermuteCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights, int64_t has_weights,
                        ffi::Result<ffi::AnyBuffer> out) {
  UnpermuteArgs a;
  if (auto err = decode_unpermute(x, row_map, weights, has_weights, *out, &a); !err.success()) return err;
  cpu::unpermute(a, parallel_on(pool));
  return ffi::Error::Success();
}

ffi::Error ScatterCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, I32Buffer row_map, ffi::AnyBuffer weights, int64_t has_weights,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  ScatterArgs a;
  if (auto err = decode_scatter(x, row_map, weights, has_weights, *out, *workspace, &a); !err.success())
    return err;
  if (a.workspace_bytes < cpu::scatter_workspace_bytes(a.tokens * a.topk, a.rows))
    return invalid("scatter: workspace too small");
  cpu::scatter(a, parallel_on(pool));
  return ffi::Error::Success();
}

ffi::Error WeightGradCpu(ffi::ThreadPool pool, ffi::AnyBuffer ct, ffi::AnyBuffer x, I32Buffer row_map,
                         ffi::Result<ffi::AnyBuffer> out) {
  WeightGradArgs a;
  if (auto err = decode_weight_grad(ct, x, row_map, *out, &a); !err.success()) return err;
  cpu::weight_grad(a, parallel_on(pool));
  return ffi::Error::Success();
}

ffi::Error RouterCpu(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> bias, int64_t top_k,
                     int64_t scoring, int64_t renormalize, int64_t num_groups, int64_t topk_groups, int64_t has_bias,
                     float scale, ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<I32Buffer> ids) {
  RouterArgs a;
  if (auto err = decode_router(logits, bias, top_k, scoring, renormalize, num_groups, topk_groups, has_bias, scale,
                               *weights, *ids, &a);
      !err.success())
    return err;
  cpu::router(a, parallel_on(pool));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermuteCpu, moe::PermuteCpu, moe::bind_permute(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteCpu, moe::UnpermuteCpu, moe::bind_unpermute(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeScatterCpu, moe::ScatterCpu, moe::bind_scatter(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeWeightGradCpu, moe::WeightGradCpu,
                              moe::bind_weight_grad(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRouterCpu, moe::RouterCpu, moe::bind_router(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
