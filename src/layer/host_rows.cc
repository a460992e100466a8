// The host layer with the caller's own experts: Dispatch, Combine and their backward steps
// (rdep/layer/host_moe_layer.h). The rows cross by the layer's own protocol (phase 3's segments,
// return by row_id); only the expert computation between Dispatch and Combine is the caller's.
//
// Region order between calls: every step that stores into a peer's return rows (Combine,
// DispatchBackward) starts with a barrier (return.start), since the step before it may still be
// reading its own return rows after its last barrier; every step that scatters into the owners'
// segment buffers (Dispatch, CombineBackward) ends with a barrier (rows.taken) after the owners took
// their rows, so the next scatter never overwrites a buffer an owner still reads.
#include <algorithm>
#include <numeric>
#include <string>

#include "layer/context_access.h"
#include "layer/host_layer_state.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

Status CheckSize(const char* what, int32_t rank, size_t got, int64_t expect, const char* formula) {
  if (got == static_cast<size_t>(expect)) return Status::Ok();
  return InvalidArgument(std::string(what) + " on rank " + std::to_string(rank) + " has " + std::to_string(got) +
                         " values, expected " + formula + " = " + std::to_string(expect));
}

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// Where each local expert's rows start in the caller's row buffer (exclusive scan).
std::vector<int64_t> ExpertBases(const std::vector<int64_t>& rows_per_expert) {
  std::vector<int64_t> base(rows_per_expert.size(), 0);
  std::exclusive_scan(rows_per_expert.begin(), rows_per_expert.end(), base.begin(), int64_t{0});
  return base;
}

}  // namespace

Status HostMoELayer::CheckRowsSupported(const char* call) const {
  if (config_.balance.enabled())
    return FailedPrecondition(std::string(call) + ": the caller's experts cannot run with balancing (" +
                              BalanceKindName(config_.balance.kind) +
                              "): replicas compute on weights the layer streams; create the layer with balance off");
  if (config_.nodes.nodes > 1)
    return FailedPrecondition(std::string(call) + ": the caller's experts are not supported with the two-phase exchange (N=" +
                              std::to_string(config_.nodes.nodes) + " nodes) yet");
  if (config_.owner_reduce)
    return FailedPrecondition(std::string(call) + ": the caller's experts return one row per slot; create the layer "
                              "without owner_reduce");
  return Status::Ok();
}

StatusOr<std::vector<int64_t>> HostMoELayer::recv_counts(const ForwardContext& ctx) const {
  const Saved* st = ctx.rank() >= 0 && ctx.rank() < config_.shape.ranks ? ContextAccess::Peek<Saved>(ctx, id_, ctx.rank()) : nullptr;
  if (!st) return FailedPrecondition("recv counts: the context holds no plan of this layer (call Plan first)");
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("recv counts"));
  return st->rows_per_expert;
}

StatusOr<std::vector<uint64_t>> HostMoELayer::recv_row_ids(const ForwardContext& ctx) const {
  const Saved* st = ctx.rank() >= 0 && ctx.rank() < config_.shape.ranks ? ContextAccess::Peek<Saved>(ctx, id_, ctx.rank()) : nullptr;
  if (!st || !ctx.rows_forward()) return FailedPrecondition("recv row ids: the context holds no dispatched rows of this layer");
  return st->recv_row_ids;
}

// Owner, one received segment: each row goes to its place in the caller's buffer (its expert's next
// position). Dispatch copies the token row and records the row id; CombineBackward (backward) writes
// g' * dy and checks that the row is the one Dispatch put there.
Status HostMoELayer::TakeSegmentRows(int32_t rank, Saved& st, int64_t seg, bool backward, std::span<float> rows,
                                     std::vector<int64_t>& fill) {
  TestDelay(rank);
  const int64_t H = config_.shape.hidden, S = layout_.S;
  const float* payload = domain_.region_as<float>(rank, regions_.payload) + (seg % 2) * S * H;
  const auto num_rows = static_cast<int64_t>(st.recv_row_ids.size());
  for (const GroupedRow& g : GroupSegment(rank, st, seg)) {
    const int64_t pos = fill[static_cast<size_t>(g.row.local_expert)]++;
    if (pos >= num_rows)
      return InternalError("rank " + std::to_string(rank) + ": more rows arrived for local expert " +
                           std::to_string(g.row.local_expert) + " than the plan admitted");
    const float* src = payload + g.token * H;
    float* dst = rows.data() + pos * H;
    if (!backward) {
      st.recv_row_ids[static_cast<size_t>(pos)] = g.row.row_id;
      std::copy_n(src, H, dst);
    } else {
      if (st.recv_row_ids[static_cast<size_t>(pos)] != g.row.row_id)
        return InternalError("rank " + std::to_string(rank) + ": combine backward row " + std::to_string(pos) +
                             " is not the row dispatch delivered there");
      for (int64_t c = 0; c < H; ++c) dst[c] = g.row.gate * src[c];
    }
  }
  return Status::Ok();
}

// Combine (backward false) and DispatchBackward: each received row's counterpart in `rows` (the
// caller's expert output, or the gradient of the received row) to its front-end's return slot,
// decoded from its row id; return.start first, then return.done or backward.done, after which every
// row sent to this rank has landed.
Status HostMoELayer::ReturnCallerRows(int32_t rank, const Saved& st, std::span<const float> rows, bool backward) {
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kReturnStart));
  const int64_t H = config_.shape.hidden;
  for (size_t i = 0; i < st.recv_row_ids.size(); ++i)
    std::copy_n(rows.data() + static_cast<int64_t>(i) * H, H, ReturnRow(rank, st.recv_row_ids[i]));
  return domain_.Barrier(rank, backward ? Phase::kBackwardDone : Phase::kReturnDone);
}

Status HostMoELayer::Dispatch(int32_t rank, ForwardContext& ctx, std::span<const float> x, std::span<float> recv) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("dispatch"));
  const int64_t H = config_.shape.hidden;
  if (const Saved* peek = ContextAccess::Peek<Saved>(ctx, id_, rank); peek && ctx.planned()) {  // sizes before the collective
    RDEP_RETURN_IF_ERROR(CheckSize("dispatch input x", rank, x.size(), peek->num_tokens * H, "num_tokens*H"));
    RDEP_RETURN_IF_ERROR(CheckSize("dispatch output recv", rank, recv.size(), Sum(peek->rows_per_expert) * H,
                                   "rows received (the sum of recv_counts)*H"));
  }
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginDispatch<Saved>(ctx, id_, rank));
  Saved& st = *saved;
  ContextAccess::StepGuard guard(ctx);  // a failure below leaves ctx unusable (named by the next step)
  std::vector<int64_t> fill = ExpertBases(st.rows_per_expert);
  st.recv_row_ids.assign(static_cast<size_t>(Sum(st.rows_per_expert)), 0);
  for (int64_t seg = 0; seg < st.num_segments; ++seg) {
    ScatterSegment(rank, st, seg, x);
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchSegment));
    RDEP_RETURN_IF_ERROR(TakeSegmentRows(rank, st, seg, /*backward=*/false, recv, fill));
  }
  return guard.Done(domain_.Barrier(rank, Phase::kRowsTaken));
}

Status HostMoELayer::Combine(int32_t rank, ForwardContext& ctx, std::span<const float> out, std::span<float> y) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("combine"));
  const int64_t H = config_.shape.hidden;
  if (const Saved* peek = ContextAccess::Peek<Saved>(ctx, id_, rank); peek && ctx.rows_forward()) {
    RDEP_RETURN_IF_ERROR(CheckSize("combine input (expert outputs)", rank, out.size(),
                                   static_cast<int64_t>(peek->recv_row_ids.size()) * H, "rows received*H"));
    RDEP_RETURN_IF_ERROR(CheckSize("combine output y", rank, y.size(), peek->num_tokens * H, "num_tokens*H"));
  }
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginCombine<Saved>(ctx, id_, rank));
  Saved& st = *saved;
  ContextAccess::StepGuard guard(ctx);  // a failure below leaves ctx unusable (named by the next step)
  RDEP_RETURN_IF_ERROR(ReturnCallerRows(rank, st, out, /*backward=*/false));
  CombineReturned(rank, st, y);
  ContextAccess::FinishCombine(ctx);
  return guard.Done(Status::Ok());
}

Status HostMoELayer::CombineBackward(int32_t rank, ForwardContext& ctx, std::span<const float> dy, std::span<float> d_out,
                                     std::span<float> dgates) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("combine backward"));
  const int64_t H = config_.shape.hidden, K = config_.shape.topk;
  if (const Saved* peek = ContextAccess::Peek<Saved>(ctx, id_, rank); peek && ctx.rows_forward()) {
    const int64_t n = peek->num_tokens;
    RDEP_RETURN_IF_ERROR(CheckSize("combine backward input dy", rank, dy.size(), n * H, "num_tokens*H"));
    RDEP_RETURN_IF_ERROR(CheckSize("combine backward output d_out", rank, d_out.size(),
                                   static_cast<int64_t>(peek->recv_row_ids.size()) * H, "rows received*H"));
    RDEP_RETURN_IF_ERROR(CheckSize("combine backward output dgates", rank, dgates.size(), n * K, "num_tokens*K"));
  }
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginCombineBackward<Saved>(ctx, id_, rank));
  Saved& st = *saved;
  ContextAccess::StepGuard guard(ctx);  // a failure below leaves ctx unusable (named by the next step)
  ComputeDgates(st, dy, dgates);
  std::vector<int64_t> fill = ExpertBases(st.rows_per_expert);
  for (int64_t seg = 0; seg < st.num_segments; ++seg) {
    ScatterSegment(rank, st, seg, dy);
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kBackwardSegment));
    RDEP_RETURN_IF_ERROR(TakeSegmentRows(rank, st, seg, /*backward=*/true, d_out, fill));
  }
  return guard.Done(domain_.Barrier(rank, Phase::kRowsTaken));
}

Status HostMoELayer::DispatchBackward(int32_t rank, ForwardContext& ctx, std::span<const float> d_recv, std::span<float> dx) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  RDEP_RETURN_IF_ERROR(CheckRowsSupported("dispatch backward"));
  const int64_t H = config_.shape.hidden;
  if (const Saved* peek = ContextAccess::Peek<Saved>(ctx, id_, rank); peek && ctx.rows_forward()) {
    RDEP_RETURN_IF_ERROR(CheckSize("dispatch backward input d_recv", rank, d_recv.size(),
                                   static_cast<int64_t>(peek->recv_row_ids.size()) * H, "rows received*H"));
    RDEP_RETURN_IF_ERROR(CheckSize("dispatch backward output dx", rank, dx.size(), peek->num_tokens * H, "num_tokens*H"));
  }
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginDispatchBackward<Saved>(ctx, id_, rank));
  Saved& st = *saved;
  ContextAccess::StepGuard guard(ctx);  // a failure below leaves ctx unusable (named by the next step)
  RDEP_RETURN_IF_ERROR(ReturnCallerRows(rank, st, d_recv, /*backward=*/true));
  SumReturned(rank, st, dx);
  return guard.Done(Status::Ok());
}

}  // namespace rdep
