// A tile order for the sm_90a grouped GEMMs (grouped_gemm_sm90_runner.cuh) in which each CTA of the
// persistent grid computes `chunk` consecutive tiles of the grouped order before moving on. CUTLASS's
// group scheduler (PersistentTileSchedulerSm90Group) hands CTA c of a P-CTA grid the tiles c, c + P,
// c + 2P, ...: where a group holds fewer than P tiles, every tile a CTA takes is in another group, and
// the kernel rewrites its TMA descriptors for each (the expert weight gradients at the training
// example's shape: 88 tiles a group against 132 CTAs; docs/perf-notes.md, twenty-fourth session). With
// chunk B the CTA's n-th tile is
//     ((n / B) * P + c) * B + n % B
// (for clustered tiles, in units of whole clusters: cluster tiles, cluster c of P, its CTAs' places kept), so it
// stays in one group for up to B tiles, while the P CTAs in flight still cover about P * B tiles of
// the order (a few groups: their operands stay in L2). B = 1 is CUTLASS's order. Which CTA computes a
// tile changes, not how: every output is the same bits for every B.
//
// The chunk travels in the problem shape (ChunkedGroupProblemShape), which the kernel's parameters
// carry to the device, so one kernel serves every chunk; the TileSchedulerSelector specialization
// below picks the scheduler for that problem shape. Include only from grouped_gemm_sm90_runner.cuh.
#pragma once

#include <cstdint>

#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace rdep::kernels::internal {

template <class Underlying>
struct ChunkedGroupProblemShape : cutlass::gemm::GroupProblemShape<Underlying> {
  int32_t chunk = 1;  // tiles a CTA takes in a row (>= 1)
};

template <class GroupShape, int kStages>
class ChunkedTileSchedulerSm90Group : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupShape, kStages> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupShape, kStages>;

 public:
  using typename Base::Params;
  using typename Base::SchedulerResponse;

  ChunkedTileSchedulerSm90Group() = default;

  CUTLASS_DEVICE explicit ChunkedTileSchedulerSm90Group(Params const& params, SchedulerResponse* response_ptr)
      : Base(params, response_ptr) {
#if defined(__CUDA_ARCH__)
    // The CTA's first linear index as the base computes it, split into its cluster and its place there: the CTAs of
    // one cluster hold an aligned run of cluster-size linear indices (the raster's minor mode from blockIdx, the
    // major one from the index), and each group's tiles are rounded to whole clusters, so the run stays one
    // cluster tile of one group at every step.
    const uint64_t first = params.raster_order_ == Base::RasterOrder::AlongN
                               ? uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * uint64_t(gridDim.x)
                               : uint64_t(blockIdx.x) * uint64_t(gridDim.y) + uint64_t(blockIdx.y);
    const uint64_t size = uint64_t(params.cluster_shape_.m()) * uint64_t(params.cluster_shape_.n());
    cluster_ = first / size;
    in_cluster_ = first % size;
    clusters_ = (uint64_t(gridDim.x) * uint64_t(gridDim.y) * uint64_t(gridDim.z)) / size;
    cluster_size_ = size;
    chunk_ = params.problem_shapes_.chunk > 1 ? uint64_t(params.problem_shapes_.chunk) : uint64_t{1};
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE auto initial_work_tile_info(ClusterShape) {
    return this->get_current_work_for_linear_idx(LinearIdx(0));
  }

  // The base's advance with the chunked index (it publishes the tile to the consumers the same way).
  template <typename TileSchedulerPipeline, typename TileSchedulerPipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(TileSchedulerPipeline& scheduler_pipeline,
                                           TileSchedulerPipelineState scheduler_pipe_producer_state, uint32_t advance_count = 1) {
    step_ += advance_count;
    auto work_tile = this->get_current_work_for_linear_idx(LinearIdx(step_));
    scheduler_pipeline.producer_acquire(scheduler_pipe_producer_state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[scheduler_pipe_producer_state.index()] = work_tile;
      cutlass::arch::fence_view_async_shared();
      scheduler_pipeline.producer_commit(scheduler_pipe_producer_state);
    }
    return cute::make_tuple(work_tile, true);
  }

 private:
  // The linear index of this CTA's n-th tile: increasing in n, as the base's group search needs.
  CUTLASS_DEVICE uint64_t LinearIdx(uint64_t n) const {
    const uint64_t cluster_tile = ((n / chunk_) * clusters_ + cluster_) * chunk_ + n % chunk_;
    return cluster_tile * cluster_size_ + in_cluster_;
  }

  uint64_t step_ = 0, cluster_ = 0, in_cluster_ = 0, clusters_ = 1, cluster_size_ = 1, chunk_ = 1;
};

}  // namespace rdep::kernels::internal

namespace cutlass::gemm::kernel::detail {

// The grouped kernels take their scheduler from this selector; for rdep's problem shape, the chunked one.
template <class TileShape, class ClusterShape, uint32_t kStages, class Underlying>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, kStages,
                             rdep::kernels::internal::ChunkedGroupProblemShape<Underlying>> {
  using Scheduler =
      rdep::kernels::internal::ChunkedTileSchedulerSm90Group<rdep::kernels::internal::ChunkedGroupProblemShape<Underlying>, kStages>;
};

}  // namespace cutlass::gemm::kernel::detail
