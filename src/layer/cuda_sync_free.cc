// The CUDA layer's owner work without host waits (CudaMoELayer::SyncFree): the expert compute reads
// the per-expert counts in device memory (the CUTLASS grouped implementation), and every buffer the
// owner fills is sized for the worst case when the context is made, so nothing grows during a call.
// Segments: the host does not learn how many tokens an owner received, so a forward runs the worst
// case's count, ceil(W*T / S) (one when S >= W*T); a segment past the tokens every owner received runs
// empty (its kernels read zero counts on the device). Segment s's grouped rows, saved x and h rows (and
// with owner_reduce its kept outputs) sit at s * MaxSegmentRows, its counts at s * (phys + 1), so backward
// finds them without the host. The launches that took the row count from the host (gather, return) take
// the segment's device total as their bound:
//   forward   per segment: expand (counts per physical expert into the context) -> sum -> gather x rows ->
//             expert compute (device counts) -> return rows by row_id
//   backward  per segment: gather g' * dy rows -> expert compute backward (device counts; the first
//             segment overwrites the weight gradients, later ones add to them) -> return dx rows
// With gate_in_expert the compute applies each row's gate (forward: before W2; backward: it gathers dy
// unweighted and stores each row's dgate into its front-end's dots region).
// The host learns the counts only when asked (owner_rows_per_expert, CopyOwnerTrace: they wait).
#include <algorithm>
#include <string>

#include "layer/context_access.h"
#include "layer/cuda_layer_state.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {

using cuda_layer::Bits;
using dispatch::bf16_bits;

// Two-phase layers (nodes > 1) plan their segments from the relays' counts on the host: sync-free there
// only in one segment.
bool CudaMoELayer::SyncFree(const RankState& st) const {
  return st.mlp && st.mlp->graph_safe() && !config_.balance.enabled() && kind_ == ExpertKind::kSwiGLU &&
         (layout_.S >= config_.shape.ranks * config_.shape.tokens || config_.nodes.nodes <= 1);
}

int64_t CudaMoELayer::SyncFreeSegments() const {
  const int64_t most = std::max<int64_t>(config_.shape.ranks * config_.shape.tokens, 1);  // tokens an owner can receive
  return (most + layout_.S - 1) / layout_.S;
}

// What a sync-free forward fills, at its worst case: each segment's rows (MaxSegmentRows).
Status CudaMoELayer::ReserveSyncFree(const RankState& st, Saved& sv) const {
  const auto segs = static_cast<size_t>(SyncFreeSegments());
  const auto rows = segs * static_cast<size_t>(MaxSegmentRows(config_, layout_));
  const auto H = static_cast<size_t>(config_.shape.hidden), F = static_cast<size_t>(config_.shape.ffn);
  RDEP_RETURN_IF_ERROR(sv.grouped.Reserve(rows));
  if (Stashing(st)) {  // the rows live in the shared transient rows and the pool (cuda_stash.cc)
    RDEP_RETURN_IF_ERROR(ReserveStash(sv));
  } else {
    RDEP_RETURN_IF_ERROR(cuda_layer::ReserveRows(sv.x_rows, rows * H, st.rows, st.device, st.caller_stream));
    RDEP_RETURN_IF_ERROR(cuda_layer::ReserveRows(sv.h_rows, rows * 2 * F, st.rows, st.device, st.caller_stream));
    if (OwnerKeepsOutputs(config_))  // the expert outputs stay for dgate
      RDEP_RETURN_IF_ERROR(cuda_layer::ReserveRows(sv.f_rows, rows * H, st.rows, st.device, st.caller_stream));
  }
  if (config_.owner_reduce) {  // the token -> rows index of each segment
    RDEP_RETURN_IF_ERROR(sv.inv.Reserve(segs * static_cast<size_t>(std::max<int64_t>(layout_.S * layout_.slots_per_token, 1))));
  }
  return sv.dev_counts.Reserve(segs * (static_cast<size_t>(physical_experts(st)) + 1));
}

Status CudaMoELayer::OwnerForwardSyncFree(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload) {
  const int64_t H = config_.shape.hidden, base = seg * MaxSegmentRows(config_, layout_);
  cudaStream_t stream = domain_.stream(rank);
  RDEP_RETURN_IF_ERROR(ReserveSyncFree(st, sv));  // a no-op unless the context was made before (its first use)
  const bool reduce = config_.owner_reduce;
  __nv_bfloat16* out = OwnerKeepsOutputs(config_) ? SavedOwnerRows(rank, st, sv).f + base * H : OutRows(rank);  // kept for dgate
  RDEP_RETURN_IF_ERROR(ComputeForwardSyncFree(rank, st, sv, seg, seg_payload, out, stream, nullptr));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, cuda_layer::kMarkExpert));
  if (reduce) RDEP_RETURN_IF_ERROR(ReturnReduced(rank, out, sv, seg, base, /*backward=*/false));
  else if (CombinesInPlace(sv)) sv.combine_rows = out;
  else RDEP_RETURN_IF_ERROR(ReturnSyncFree(rank, st, sv, seg, out, stream));
  return Mark(rank, st, false, cuda_layer::kMarkReturn);
}

// Forward, segment seg's owner work up to its return: expand into expert-grouped rows (per-expert counts
// into the context, on the device), gather the x rows, expert compute into `out`. read_done (if any) is
// recorded once the segment's payload and sideband have been read.
Status CudaMoELayer::ComputeForwardSyncFree(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload,
                                            __nv_bfloat16* out, cudaStream_t stream, cudaEvent_t read_done) {
  const int64_t H = config_.shape.hidden, cap = MaxSegmentRows(config_, layout_), base = seg * cap;
  const int32_t phys = physical_experts(st);
  int64_t* counts = sv.dev_counts.ptr + seg * (phys + 1);
  const int64_t* total = counts + phys;
  RDEP_RETURN_IF_ERROR(dispatch::LaunchExpand(domain_.region(rank, regions_.sideband), static_cast<int32_t>(seg % 2), seg * layout_.S,
                                              layout_, sv.control.ptr, phys, counts, sv.grouped.ptr + base, cap, st.expand_scratch.ptr,
                                              stream, config_.owner_reduce ? SegmentInv(sv, seg) : nullptr,
                                              CombinesInPlace(sv) ? sv.slot_rows.ptr : nullptr));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchSumCounts(counts, phys, counts + phys, stream));
  sv.counts_on_device = true;  // the host does not know the segment's rows (seg_rows stays empty)
  sv.seg_base[static_cast<size_t>(seg)] = base;
  const OwnerRows saved = SavedOwnerRows(rank, st, sv);
  __nv_bfloat16* x_rows = saved.x + base * H;
  RDEP_RETURN_IF_ERROR(dispatch::LaunchGatherRows(seg_payload, sv.grouped.ptr + base, cap, H, false, Bits(x_rows), stream, total));
  if (read_done) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(read_done, stream));
  if (phys > 0)
    RDEP_RETURN_IF_ERROR(st.mlp->Forward(SegmentRows(st, sv, seg), x_rows, st.weights(), saved.h + base * 2 * config_.shape.ffn, out, stream));
  return Status::Ok();
}

// The expert compute's view of segment seg's grouped rows: the device counts and, with gate_in_expert, each
// row's effective gate (the GroupedRow field) and the per-row dgates backward writes (RankState::row_dgates).
kernels::ExpertRows CudaMoELayer::SegmentRows(RankState& st, const Saved& sv, int64_t seg) const {
  const int64_t cap = MaxSegmentRows(config_, layout_);
  kernels::ExpertRows rows{sv.dev_counts.ptr + seg * (physical_experts(st) + 1), cap, nullptr};
  if (config_.gate_in_expert) {
    static_assert(sizeof(dispatch::GroupedRow) % sizeof(float) == 0);
    rows.gate = &sv.grouped.ptr[seg * cap].gate;
    rows.gate_stride = sizeof(dispatch::GroupedRow) / sizeof(float);
    rows.dgate = st.row_dgates.ptr;
  }
  return rows;
}

// Segment seg's computed rows (`rows`, in its grouped order) back to their front-ends by row identity.
Status CudaMoELayer::ReturnSyncFree(int32_t rank, const RankState& st, const Saved& sv, int64_t seg, const __nv_bfloat16* rows,
                                    cudaStream_t stream) {
  const int64_t cap = MaxSegmentRows(config_, layout_);
  const int32_t phys = physical_experts(st);
  const int64_t* total = sv.dev_counts.ptr + seg * (phys + 1) + phys;
  return dispatch::LaunchReturnRows(Bits(rows), sv.grouped.ptr + seg * cap, cap, layout_, domain_.peer_table(rank, regions_.ret), stream,
                                    total);
}

Status CudaMoELayer::OwnerBackwardSyncFree(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload) {
  const int64_t cap = MaxSegmentRows(config_, layout_), base = seg * cap;
  cudaStream_t stream = domain_.stream(rank);
  // The dout rows, then the dx rows over them (the CUTLASS compute: DxOverDout; out_rows holds cap rows).
  __nv_bfloat16* rows = OutRows(rank);
  RDEP_RETURN_IF_ERROR(ComputeBackwardSyncFree(rank, st, sv, seg, seg_payload, rows, stream, nullptr));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, true, cuda_layer::kMarkExpert));
  if (config_.owner_reduce) {
    const int64_t* total = sv.dev_counts.ptr + seg * (physical_experts(st) + 1) + physical_experts(st);
    if (!config_.gate_in_expert)  // else the compute's dgates went to the dots already
      RDEP_RETURN_IF_ERROR(OwnerDots(rank, seg_payload, sv, base, cap, total));
    RDEP_RETURN_IF_ERROR(ReturnReduced(rank, rows, sv, seg, base, /*backward=*/true));
  } else if (CombinesInPlace(sv)) {
    sv.combine_rows = rows;
  } else {
    RDEP_RETURN_IF_ERROR(ReturnSyncFree(rank, st, sv, seg, rows, stream));
  }
  return Mark(rank, st, true, cuda_layer::kMarkReturn);
}

// Backward, segment seg's owner work up to its return: gather g' * dy rows (the dout rows; dy unweighted with
// gate_in_expert) into `rows` in the forward's grouped order, expert compute backward (device counts; the first
// segment overwrites the weight gradients, later ones add to them; the saved h rows are consumed) with the dx
// rows over them; with gate_in_expert each row's dgate then goes to its front-end's dots.
Status CudaMoELayer::ComputeBackwardSyncFree(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload,
                                             __nv_bfloat16* rows, cudaStream_t stream, cudaEvent_t read_done) {
  const int64_t H = config_.shape.hidden, cap = MaxSegmentRows(config_, layout_), base = seg * cap;
  const int32_t phys = physical_experts(st);
  const int64_t* total = sv.dev_counts.ptr + seg * (phys + 1) + phys;
  RDEP_RETURN_IF_ERROR(dispatch::LaunchGatherRows(seg_payload, sv.grouped.ptr + base, cap, H, !config_.gate_in_expert, Bits(rows), stream,
                                                   total));
  if (read_done) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(read_done, stream));
  const kernels::ExpertGradsView grads = st.grads();
  const OwnerRows saved = SavedOwnerRows(rank, st, sv);  // the transient rows, the stash's pages back in them
  if (phys == 0) return Status::Ok();
  // The first segment overwrites the weight gradients (zeroes an expert without rows), later ones add.
  RDEP_RETURN_IF_ERROR(st.mlp->Backward(SegmentRows(st, sv, seg), saved.x + base * H, saved.h + base * 2 * config_.shape.ffn, rows,
                                        st.weights(), rows, grads, /*accumulate=*/seg > 0, stream));
  if (!config_.gate_in_expert) return Status::Ok();
  return dispatch::LaunchStoreRowDots(st.row_dgates.ptr, sv.grouped.ptr + base, cap, layout_, domain_.peer_table(rank, regions_.dots),
                                      stream, total);
}

// The counts a sync-free forward left on the device, for checks (waits for the rank's stream): per
// segment, phys counts and their total.
StatusOr<std::vector<int64_t>> CudaMoELayer::DeviceCounts(int32_t rank, const Saved& sv) const {
  const int32_t phys = physical_experts(*ranks_[static_cast<size_t>(rank)]);
  std::vector<int64_t> c(static_cast<size_t>(sv.num_segments) * (static_cast<size_t>(phys) + 1), 0);
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv.device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(c.data(), sv.dev_counts.ptr, c.size() * sizeof(int64_t), cudaMemcpyDeviceToHost));
  return c;
}

Status CudaMoELayer::CheckRoutingFaults(int32_t rank, ForwardContext& ctx) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  Saved* sv = ContextAccess::PeekMutable<Saved>(ctx, id_, rank);
  if (!sv) return FailedPrecondition("check routing faults: the context holds no forward of this layer on rank " + std::to_string(rank));
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  return CheckRoutingInput(rank, *sv, /*wait=*/true);
}

}  // namespace rdep
