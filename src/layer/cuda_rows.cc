// The CUDA layer with the caller's own experts: Dispatch, Combine and their backward steps
// (rdep/layer/cuda_moe_layer.h). One segment per forward: the owner's received rows are the one
// segment's expert-grouped rows (LaunchExpand's order, the host layer's order), so the protocol's own
// launchers move them (scatter, expand, gather, return by row_id, combine) and nothing here is a new
// kernel. Region order between calls as on the host (src/layer/host_rows.cc): steps that store into
// peers' return rows start with a barrier (return.start); steps that scatter into owners' segment
// buffers end with one (rows.taken).
#include <numeric>
#include <string>

#include "layer/context_access.h"
#include "layer/cuda_layer_state.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {

using cuda_layer::Bits;
using dispatch::bf16_bits;
using dispatch::GroupedRow;

Status CudaMoELayer::CheckRowsSupported(const char* call) const {
  if (config_.balance.enabled())
    return FailedPrecondition(std::string(call) + ": the caller's experts cannot run with balancing (" +
                              BalanceKindName(config_.balance.kind) +
                              "): replicas compute on weights the layer streams; create the layer with balance off");
  if (config_.nodes.nodes > 1)
    return FailedPrecondition(std::string(call) + ": the caller's experts cannot run with nodes (N=" +
                              std::to_string(config_.nodes.nodes) + "): the two-phase exchange keeps rows at the relays; "
                              "create the layer with nodes 1");
  if (config_.owner_reduce)
    return FailedPrecondition(std::string(call) + ": the caller's experts return one row per slot; create the layer without owner_reduce");
  if (config_.gate_in_expert)
    return FailedPrecondition(std::string(call) + ": the caller's experts return unweighted rows (the layer weights them at the "
                              "combine); create the layer without gate_in_expert");
  const int64_t worst = config_.shape.ranks * config_.shape.tokens;
  if (layout_.S < worst)
    return FailedPrecondition(std::string(call) + ": the caller's experts on the CUDA backend need one segment per forward "
                              "(segment_tokens 0 or >= W*T = " + std::to_string(worst) + "; this layer has S = " +
                              std::to_string(layout_.S) + ")");
  return Status::Ok();
}

Status CudaMoELayer::CheckRows(const char* call, int32_t rank, const char* what, int64_t got, int64_t want,
                               const char* formula) const {
  if (got == want) return Status::Ok();
  return InvalidArgument(std::string(call) + " on rank " + std::to_string(rank) + ": " + what + " has " + std::to_string(got) +
                         " rows, expected " + formula + " = " + std::to_string(want));
}

// Before Combine, CombineBackward, DispatchBackward (once the context holds dispatched rows): the
// caller's buffer of received rows and its buffer of per-token rows have the forward's sizes.
Status CudaMoELayer::CheckCallerRows(const char* call, int32_t rank, const ForwardContext& ctx, const char* received,
                                     int64_t received_rows, const char* per_token, int64_t token_rows) const {
  const Saved* peek = ContextAccess::Peek<Saved>(ctx, id_, rank);
  if (!peek || !ctx.rows_forward()) return Status::Ok();  // the step's Begin names what is missing
  RDEP_RETURN_IF_ERROR(CheckRows(call, rank, received, received_rows, peek->total_rows, "the rows received"));
  return CheckRows(call, rank, per_token, token_rows, peek->num_tokens, "num_tokens");
}

// Combine (backward false) and DispatchBackward: the caller's rows go back to their sources by row_id
// (return.start first: a peer may still read its return rows after its last barrier; then return.done or
// backward.done, after which every row sent to this rank has landed), and the combine of this rank's into out.
// At W = 1 (w1_in_place_) the combine reads the caller's rows in place through Dispatch's slot map.
Status CudaMoELayer::CombineCallerRows(int32_t rank, const Saved& sv, const __nv_bfloat16* rows, bool backward, const float* weights,
                                       __nv_bfloat16* out, __nv_bfloat16* save) {
  RDEP_RETURN_IF_ERROR(domain_.CheckErrors(rank));
  ranks_[static_cast<size_t>(rank)]->plan_copy_pending = false;  // a barrier first, or (in place, W = 1) no peer to wait for
  if (w1_in_place_) return CombineFrom(rank, sv, rows, sv.total_rows, weights, out, save);
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kReturnStart));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchReturnRows(Bits(rows), sv.grouped.ptr, sv.total_rows, layout_,
                                                  domain_.peer_table(rank, regions_.ret), domain_.stream(rank)));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardDone : Phase::kReturnDone));
  return CombineFrom(rank, sv, nullptr, 0, weights, out, save);
}

// The plan's admitted rows per local expert, on the host: one synchronization of the rank's stream
// per plan (the owner scan wrote them on the device).
Status CudaMoELayer::HostRecvCounts(int32_t rank, Saved& sv) {
  if (sv.have_recv_counts) return Status::Ok();
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  sv.recv_counts.assign(static_cast<size_t>(st.num_local), 0);
  if (st.num_local > 0)
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sv.recv_counts.data(), sv.rows_per_expert.ptr, sizeof(int64_t) * sv.recv_counts.size(),
                                              cudaMemcpyDeviceToHost, domain_.stream(rank)));
  RDEP_RETURN_IF_ERROR(domain_.Synchronize(rank));
  sv.have_recv_counts = true;
  return Status::Ok();
}

StatusOr<std::vector<int64_t>> CudaMoELayer::recv_counts(ForwardContext& ctx) {
  const int32_t rank = ctx.rank();
  Saved* sv = CheckLocalRank(rank).ok() ? ContextAccess::PeekMutable<Saved>(ctx, id_, rank) : nullptr;
  if (!sv) return FailedPrecondition("recv counts: the context holds no plan of this layer (call Plan first)");
  if (sv->windowed)
    return FailedPrecondition("recv counts: the context holds a Forward of rank " + std::to_string(rank) +
                              ", whose rows took per-source windows and were never counted at its plan (call Plan for the counts, "
                              "or set LayerConfig::source_windows false)");
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("recv counts"));
  RDEP_RETURN_IF_ERROR(HostRecvCounts(rank, *sv));
  return sv->recv_counts;
}

StatusOr<std::vector<uint64_t>> CudaMoELayer::recv_row_ids(ForwardContext& ctx) {
  const int32_t rank = ctx.rank();
  Saved* sv = CheckLocalRank(rank).ok() ? ContextAccess::PeekMutable<Saved>(ctx, id_, rank) : nullptr;
  if (!sv || !ctx.rows_forward()) return FailedPrecondition("recv row ids: the context holds no dispatched rows of this layer");
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  RDEP_RETURN_IF_ERROR(domain_.Synchronize(rank));
  std::vector<GroupedRow> rows(static_cast<size_t>(sv->total_rows));
  if (!rows.empty())
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(rows.data(), sv->grouped.ptr, rows.size() * sizeof(GroupedRow), cudaMemcpyDeviceToHost));
  std::vector<uint64_t> ids(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) ids[i] = rows[i].row_id;
  return ids;
}

Status CudaMoELayer::Dispatch(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* x, int64_t x_rows, __nv_bfloat16* recv,
                              int64_t recv_rows) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("dispatch"));
  if (Saved* peek = ContextAccess::PeekMutable<Saved>(ctx, id_, rank); peek && ctx.planned()) {  // before the collective
    RDEP_RETURN_IF_ERROR(HostRecvCounts(rank, *peek));
    const int64_t M = std::accumulate(peek->recv_counts.begin(), peek->recv_counts.end(), int64_t{0});
    RDEP_RETURN_IF_ERROR(CheckRows("dispatch", rank, "x", x_rows, peek->num_tokens, "num_tokens"));
    RDEP_RETURN_IF_ERROR(CheckRows("dispatch", rank, "recv", recv_rows, M, "the rows received (the sum of recv_counts)"));
  }
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginDispatch<Saved>(ctx, id_, rank));
  Saved& sv = *saved;
  ContextAccess::StepGuard guard(ctx);  // a failure below leaves ctx unusable (named by the next step)
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_RETURN_IF_ERROR(domain_.CheckErrors(rank));
  ranks_[static_cast<size_t>(rank)]->plan_copy_pending = false;  // this step passes a barrier first
  const LayerShape& s = config_.shape;
  cudaStream_t stream = domain_.stream(rank);
  const int64_t M = std::accumulate(sv.recv_counts.begin(), sv.recv_counts.end(), int64_t{0});
  RDEP_RETURN_IF_ERROR(dispatch::LaunchScatter(Bits(x), sv.experts.ptr, sv.accepted.ptr, sv.effective.ptr, sv.tok_index.ptr,
                                               sv.num_tokens, layout_, dispatch::OwnerMapView{st.owner.ptr, st.local.ptr}, rank,
                                               sv.control.ptr, /*lo=*/0, /*buf=*/0, domain_.peer_table(rank, regions_.payload),
                                               domain_.peer_table(rank, regions_.sideband), stream));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchSegment));
  RDEP_RETURN_IF_ERROR(sv.grouped.Grow(static_cast<size_t>(MaxSegmentRows(config_, layout_)), 0, stream));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchExpand(domain_.region(rank, regions_.sideband), 0, 0, layout_, sv.control.ptr, st.num_local,
                                              st.seg_counts.ptr, sv.grouped.ptr, MaxSegmentRows(config_, layout_), st.expand_scratch.ptr,
                                              stream, nullptr, w1_in_place_ ? sv.slot_rows.ptr : nullptr));
  const auto* payload = static_cast<const bf16_bits*>(domain_.region(rank, regions_.payload));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchGatherRows(payload, sv.grouped.ptr, M, s.hidden, false, Bits(recv), stream));
  sv.num_segments = 1;
  sv.seg_rows.assign(1, sv.recv_counts);
  sv.seg_base.assign(1, 0);
  sv.total_rows = M;
  return guard.Done(domain_.Barrier(rank, Phase::kRowsTaken));
}

Status CudaMoELayer::Combine(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* out, int64_t out_rows, __nv_bfloat16* y,
                             int64_t y_rows) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("combine"));
  RDEP_RETURN_IF_ERROR(CheckCallerRows("combine", rank, ctx, "the expert outputs", out_rows, "y", y_rows));
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginCombine<Saved>(ctx, id_, rank));
  Saved& sv = *saved;
  ContextAccess::StepGuard guard(ctx);  // a failure below leaves ctx unusable (named by the next step)
  RDEP_RETURN_IF_ERROR(CombineCallerRows(rank, sv, out, /*backward=*/false, sv.effective.ptr, y, sv.saved_f.ptr));
  RDEP_RETURN_IF_ERROR(CheckRoutingInput(rank, sv, /*wait=*/true));
  ContextAccess::FinishCombine(ctx);
  return guard.Done(Status::Ok());
}

Status CudaMoELayer::CombineBackward(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* dy, int64_t dy_rows,
                                     __nv_bfloat16* d_out, int64_t d_out_rows, float* dgates) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("combine backward"));
  RDEP_RETURN_IF_ERROR(CheckCallerRows("combine backward", rank, ctx, "d_out", d_out_rows, "dy", dy_rows));
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginCombineBackward<Saved>(ctx, id_, rank));
  Saved& sv = *saved;
  ContextAccess::StepGuard guard(ctx);  // a failure below leaves ctx unusable (named by the next step)
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_RETURN_IF_ERROR(domain_.CheckErrors(rank));
  ranks_[static_cast<size_t>(rank)]->plan_copy_pending = false;  // this step passes a barrier first
  const LayerShape& s = config_.shape;
  cudaStream_t stream = domain_.stream(rank);
  RDEP_RETURN_IF_ERROR(dispatch::LaunchDgate(Bits(dy), Bits(sv.saved_f.ptr), sv.gates.ptr, sv.accepted.ptr, sv.num_tokens, s.topk,
                                             s.hidden, st.scratch.ptr, dgates, stream));
  // dy crosses like x did (the forward's saved control words: the same stream positions), and each
  // owner gathers g' * dy in the forward's grouped order, i.e. the order of the received rows.
  RDEP_RETURN_IF_ERROR(dispatch::LaunchScatter(Bits(dy), sv.experts.ptr, sv.accepted.ptr, sv.effective.ptr, sv.tok_index.ptr,
                                               sv.num_tokens, layout_, dispatch::OwnerMapView{st.owner.ptr, st.local.ptr}, rank,
                                               sv.control.ptr, /*lo=*/0, /*buf=*/0, domain_.peer_table(rank, regions_.payload),
                                               domain_.peer_table(rank, regions_.sideband), stream));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kBackwardSegment));
  const auto* payload = static_cast<const bf16_bits*>(domain_.region(rank, regions_.payload));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchGatherRows(payload, sv.grouped.ptr, sv.total_rows, s.hidden, true, Bits(d_out), stream));
  return guard.Done(domain_.Barrier(rank, Phase::kRowsTaken));
}

Status CudaMoELayer::DispatchBackward(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* d_recv, int64_t d_recv_rows,
                                      __nv_bfloat16* dx, int64_t dx_rows) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("dispatch backward"));
  RDEP_RETURN_IF_ERROR(CheckCallerRows("dispatch backward", rank, ctx, "d_recv", d_recv_rows, "dx", dx_rows));
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginDispatchBackward<Saved>(ctx, id_, rank));
  Saved& sv = *saved;
  ContextAccess::StepGuard guard(ctx);  // a failure below leaves ctx unusable (named by the next step)
  return guard.Done(CombineCallerRows(rank, sv, d_recv, /*backward=*/true, nullptr, dx, nullptr));
}

}  // namespace rdep
