// A tile order for CUTLASS's sm90 ptr-array grouped kernels that keeps each cluster on one group
// for several tiles in a row.
//
// CUTLASS's grouped persistent scheduler hands cluster c the tiles c, c + C, c + 2C, ... of the
// groups' tiles laid end to end (C clusters). When a group has fewer tiles than there are clusters
// (the weight gradient of a fine-grained MoE: 24-48 cluster tiles per expert on 66 clusters), each
// tile of a cluster belongs to another group, and at every group change the kernel rewrites its TMA
// descriptors: the producer before its next loads, the consumers once the last tile's stores have
// left shared memory.
//
// RunTileScheduler hands each cluster `run` consecutive tiles per round instead: a round covers
// C * run consecutive tiles, so the clusters working at one time still share a few groups'
// operands in L2, and a cluster changes group at most once per run. The last round is usually
// incomplete; it falls back to the strided order so that the clusters still finish together.
// run = 1 is CUTLASS's order exactly. Measured on the H200, runs of 8 speed up Qwen3's dW by
// 2-6%, not more: within a group too a tile's stores and the next tile's MMAs do not overlap
// (docs/design-notes.md, "Grouped GEMM tiles").
#pragma once

#include <cstdint>

#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace moe::gemm {

// The grouped problem shape, carrying the run length to the scheduler (a distinct type, so that
// the kernels built with it select RunTileScheduler below).
struct RunProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {
  int run = 1;  // consecutive tiles per cluster and round
};

template <int Stages>
class RunTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<RunProblemShape, Stages> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<RunProblemShape, Stages>;

 public:
  using typename Base::Params;
  using typename Base::RasterOrder;
  using typename Base::SchedulerResponse;
  using typename Base::WorkTileInfo;

  RunTileScheduler() = default;

  CUTLASS_DEVICE RunTileScheduler(Params const& params, SchedulerResponse* response) : Base(params, response) {
#if defined(__CUDA_ARCH__)
    const bool along_m = params.raster_order_ == RasterOrder::AlongM;
    first_ = along_m ? uint64_t(blockIdx.x) * gridDim.y + blockIdx.y : uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x;
    grid_ = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
    // Along M the grid is (clusters, cluster's N extent): blockIdx.x names the cluster.
    run_ = along_m && params.problem_shapes_.run > 1 ? uint64_t(params.problem_shapes_.run) : 1;
    cluster_ = blockIdx.x;
    clusters_ = gridDim.x;
    minor_ = blockIdx.y;
    minor_extent_ = gridDim.y;
    const int lane = cutlass::canonical_lane_idx();
    if (lane < params.problem_shapes_.groups()) probe_shapes_[1] = params.problem_shapes_.get_problem_shape(lane);
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return this->get_current_work_for_linear_idx(linear_index(0));
  }

  // As CUTLASS's: the scheduler warp publishes each next tile to the other warps' pipeline.
  template <typename TileSchedulerPipeline, typename TileSchedulerPipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(TileSchedulerPipeline& pipeline, TileSchedulerPipelineState state,
                                           uint32_t advance_count = 1) {
    step_ += advance_count;
    WorkTileInfo work = this->get_current_work_for_linear_idx(linear_index(step_));
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

 private:
  // The scheduler's group-walk state, for looking ahead without moving the base's own walk
  // (both only ever move forward).
  struct GroupWalk {
    int group_idx = 0;
    uint64_t start_linear_idx = 0, total_tiles = 0, problem_blocks_along_raster_order = 0;
  };

  // The linear index (CTA tiles, as CUTLASS counts them) of this CTA's step-th tile. A whole warp calls it.
  CUTLASS_DEVICE uint64_t linear_index(uint64_t step) {
    if (run_ == 1) return first_ + step * grid_;
    const uint64_t per_round = clusters_ * run_;
    while (!tail_ && checked_rounds_ <= step / run_) {  // is the round's last tile a tile?
      if (is_tile((checked_rounds_ + 1) * per_round - 1)) {
        ++checked_rounds_;
      } else {
        tail_ = true;
      }
    }
    const uint64_t unit = tail_ && step >= checked_rounds_ * run_
                              ? checked_rounds_ * per_round + cluster_ + (step - checked_rounds_ * run_) * clusters_
                              : step / run_ * per_round + cluster_ * run_ + step % run_;
    return unit * minor_extent_ + minor_;
  }

  CUTLASS_DEVICE bool is_tile(uint64_t unit) {
    auto& p = this->scheduler_params;
    return Base::template get_work_idx_m_and_n<WorkTileInfo>(
               unit * minor_extent_ + minor_, walk_, p.problem_shapes_, probe_shapes_, p.cta_shape_, p.cluster_shape_,
               p.divmod_cluster_shape_major_, p.divmod_cluster_shape_minor_, p.divmod_cta_shape_m_,
               p.divmod_cta_shape_n_, p.log_swizzle_size_, p.raster_order_)
        .is_valid();
  }

  uint64_t step_ = 0, first_ = 0, grid_ = 1, run_ = 1;
  uint64_t cluster_ = 0, clusters_ = 1, minor_ = 0, minor_extent_ = 1;
  uint64_t checked_rounds_ = 0;  // rounds known to be complete
  bool tail_ = false;            // round checked_rounds_ is incomplete: strided from there
  GroupWalk walk_;
  typename RunProblemShape::UnderlyingProblemShape probe_shapes_[2];
};

}  // namespace moe::gemm

namespace cutlass::gemm::kernel::detail {

// Kernels whose problem shape is RunProblemShape get RunTileScheduler.
template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, Stages, moe::gemm::RunProblemShape> {
  using Scheduler = moe::gemm::RunTileScheduler<int(Stages)>;
};

}  // namespace cutlass::gemm::kernel::detail
