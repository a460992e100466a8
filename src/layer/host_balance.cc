// Balancing in the host layer (LayerConfig::balance): phase 1 gives every rank the load matrix; every
// rank applies the capacity rule to it and solves the same plan; accepted rows are rerouted to
// physical instances by cumulative quota (a row keeps its row_id and returns to its own front-end);
// owners push their experts' weights into the replicas' slots before each forward and backward, and
// reduce the replicas' gradients into their own after backward.
#include <algorithm>
#include <memory>

#include "layer/context_access.h"
#include "layer/host_layer_state.h"
#include "rdep/core/capacity.h"

namespace rdep {

Status HostMoELayer::PlanBalanced(int32_t rank, Saved& st) {
  const LayerShape& s = config_.shape;
  const int64_t W = s.ranks, K = s.topk, E = s.experts, L = layout_.L, n = st.num_tokens;
  RankState& rs = *ranks_[static_cast<size_t>(rank)];
  auto ctrl = [&](int64_t q) { return domain_.region_as<int64_t>(static_cast<int32_t>(q), regions_.control); };

  // Phase 1: the load matrix on every rank.
  PublishLoadRow(rank, st.routing);
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchCounts));
  const int64_t* lambda = ctrl(rank) + layout_.load(0, 0);
  st.load.assign(lambda, lambda + W * E);

  // Every rank: the same admitted load and the same plan (deterministic; no further exchange).
  const std::vector<int64_t> admitted = AdmitLoadMatrix(st.load, W, E, config_.capacity.ExpertCapacity(s));
  RDEP_ASSIGN_OR_RETURN(BalancePlan plan, SolveLayerPlan(config_.balance, admitted, ownership_, rs.eplb_history));
  rs.eplb_history.assign(static_cast<size_t>(E), 0.0);
  for (int64_t r = 0; r < W; ++r)
    for (int64_t e = 0; e < E; ++e) rs.eplb_history[static_cast<size_t>(e)] += static_cast<double>(admitted[static_cast<size_t>(r * E + e)]);
  st.telemetry = ComputeBalanceTelemetry(plan, admitted, ownership_, 3 * s.hidden * s.ffn * static_cast<int64_t>(sizeof(float)));

  // Front-end: the j-th row of (this rank, e) in (t, k) order is accepted iff j < admitted[rank][e];
  // an accepted row goes to the instance whose cumulative route count covers j.
  RankAcceptance& acc = st.acceptance;
  acc.accepted.assign(static_cast<size_t>(n * K), 0);
  acc.effective_gates.assign(static_cast<size_t>(n * K), 0.f);
  acc.dropped = 0;
  st.dest_rank.assign(static_cast<size_t>(n * K), -1);
  st.dest_local.assign(static_cast<size_t>(n * K), -1);
  std::vector<int64_t> taken(static_cast<size_t>(E), 0), rows(static_cast<size_t>(W * L), 0);
  std::vector<int64_t> last(static_cast<size_t>(W), -1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const auto i = static_cast<size_t>(t * K + k);
      const int32_t e = st.routing.experts[i];
      const int64_t j = taken[static_cast<size_t>(e)]++;
      if (j >= admitted[static_cast<size_t>(rank * E + e)]) {
        ++acc.dropped;
        continue;
      }
      const int32_t inst = InstanceForRow(plan, rank, e, j);
      if (inst < 0) return InternalError("balance: the plan routes fewer rows of expert " + std::to_string(e) + " from rank " +
                                         std::to_string(rank) + " than were admitted");
      const int32_t q = plan.instance_rank[static_cast<size_t>(inst)], slot = plan.instance_slot[static_cast<size_t>(inst)];
      acc.accepted[i] = 1;
      st.dest_rank[i] = q;
      st.dest_local[i] = static_cast<int32_t>(slot < 0 ? ownership_.local_index(e) : slot_base() + slot);
      ++rows[static_cast<size_t>(q * L + st.dest_local[i])];
      if (last[static_cast<size_t>(q)] != t) {
        st.tokens_to[static_cast<size_t>(q)].push_back(static_cast<int32_t>(t));
        last[static_cast<size_t>(q)] = t;
      }
    }
    RenormalizeGates(st.routing.gates.data() + t * K, acc.accepted.data() + t * K, K, acc.effective_gates.data() + t * K);
  }

  // Rows per physical instance and tokens to every rank; then phase 2's offsets as without balancing.
  for (int64_t q = 0; q < W; ++q) {
    int64_t* c = ctrl(q);
    for (int64_t j = 0; j < L; ++j) c[layout_.recv_counts(rank, j)] = rows[static_cast<size_t>(q * L + j)];
    c[layout_.recv_tokens(rank)] = static_cast<int64_t>(st.tokens_to[static_cast<size_t>(q)].size());
  }
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchRoute));
  const int64_t* mine = ctrl(rank);
  st.rows_per_expert.assign(static_cast<size_t>(L), 0);
  for (int64_t j = 0; j < L; ++j)
    for (int64_t src = 0; src < W; ++src) st.rows_per_expert[static_cast<size_t>(j)] += mine[layout_.recv_counts(src, j)];
  st.relays = std::make_shared<const RelayPlan>(PlanRelays(plan, config_.balance.relay_above));
  st.telemetry.relayed_experts = static_cast<int32_t>(st.relays->experts.size());
  st.plan = std::make_shared<const BalancePlan>(std::move(plan));
  return PublishStreamOffsets(rank, st);
}

// The owner of each replicated expert stores its weights into every replica's slot (each source
// weight read once per destination; the host backend's stand-in for the GPU's tile streaming); an
// expert with more than relay_above replicas goes in two stages: chunk c to relay c, a barrier, then
// each relay stores its chunk into the other replicas' slots.
Status HostMoELayer::PushReplicaWeights(int32_t rank, const Saved& st) {
  if (kind_ != ExpertKind::kSwiGLU || replica_w_ < 0) return Status::Ok();
  const BalancePlan& p = *st.plan;
  const RelayPlan& relays = *st.relays;
  RankState& rs = *ranks_[static_cast<size_t>(rank)];
  const auto n1 = static_cast<size_t>(2 * config_.shape.hidden * config_.shape.ffn), n2 = n1 / 2, per = n1 + n2;
  auto slot_of = [&](int32_t inst) {
    return domain_.region_as<float>(p.instance_rank[static_cast<size_t>(inst)], replica_w_) +
           static_cast<size_t>(p.instance_slot[static_cast<size_t>(inst)]) * per;
  };
  // Floats [lo, hi) of the owner's [w1 | w2] of local expert j into dst + lo.
  auto copy_range = [&](size_t j, size_t lo, size_t hi, float* dst) {
    for (size_t c = lo; c < std::min(hi, n1); ++c) dst[c] = rs.W1()[j * n1 + c];
    for (size_t c = std::max(lo, n1); c < hi; ++c) dst[c] = rs.W2()[j * n2 + (c - n1)];
  };
  bool fault = replica_fault_;
  auto corrupt = [&](float* dst, size_t at) {
    if (fault) {
      dst[at] += 1.f;
      fault = false;
    }
  };
  size_t next_relayed = 0;
  for (int32_t e = 0; e < p.num_experts; ++e) {
    const bool relayed = next_relayed < relays.experts.size() && relays.experts[next_relayed].expert == e;
    const ExpertRelays* er = relayed ? &relays.experts[next_relayed++] : nullptr;
    if (ownership_.owner(e) != rank) continue;
    const auto j = static_cast<size_t>(ownership_.local_index(e));
    if (er) {  // stage 1: chunk c to relay c
      const auto m = static_cast<int64_t>(er->relays.size());
      for (int64_t c = 0; c < m; ++c) {
        const auto lo = static_cast<size_t>(RelayPlan::ChunkBegin(static_cast<int64_t>(per * 4), m, c) / 4);
        const auto hi = static_cast<size_t>(RelayPlan::ChunkBegin(static_cast<int64_t>(per * 4), m, c + 1) / 4);
        float* dst = slot_of(er->relays[static_cast<size_t>(c)]);
        copy_range(j, lo, c + 1 == m ? per : hi, dst);
        if (hi > lo) corrupt(dst, lo);
      }
      continue;
    }
    for (int32_t i = p.instance_offsets[static_cast<size_t>(e)] + 1; i < p.instance_offsets[static_cast<size_t>(e) + 1]; ++i) {
      if (p.instance_quota[static_cast<size_t>(i)] == 0) continue;  // computes nothing (EPLB places idle replicas)
      float* dst = slot_of(i);
      copy_range(j, 0, per, dst);
      corrupt(dst, 0);
    }
  }
  if (relays.empty()) return Status::Ok();
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kReplicaRelay));
  for (const ExpertRelays& er : relays.experts) {  // stage 2: this rank's chunks to the other replicas
    const auto m = static_cast<int64_t>(er.relays.size());
    for (int64_t c = 0; c < m; ++c) {
      const int32_t relay = er.relays[static_cast<size_t>(c)];
      if (p.instance_rank[static_cast<size_t>(relay)] != rank) continue;
      const auto lo = static_cast<size_t>(RelayPlan::ChunkBegin(static_cast<int64_t>(per * 4), m, c) / 4);
      const size_t hi = c + 1 == m ? per : static_cast<size_t>(RelayPlan::ChunkBegin(static_cast<int64_t>(per * 4), m, c + 1) / 4);
      const float* src = slot_of(relay);
      for (int32_t i = p.instance_offsets[static_cast<size_t>(er.expert)] + 1; i < p.instance_offsets[static_cast<size_t>(er.expert) + 1]; ++i)
        if (i != relay && p.instance_quota[static_cast<size_t>(i)] > 0) std::copy(src + lo, src + hi, slot_of(i) + lo);
    }
  }
  return Status::Ok();
}

// After backward.done every replica's gradient is final: the owner adds them to its own, per expert
// in instance order (deterministic).
void HostMoELayer::ReduceReplicaGradients(int32_t rank, const Saved& st) {
  if (replica_g_ < 0) return;
  const BalancePlan& p = *st.plan;
  RankState& rs = *ranks_[static_cast<size_t>(rank)];
  const auto n1 = static_cast<size_t>(2 * config_.shape.hidden * config_.shape.ffn), n2 = n1 / 2;
  for (int32_t i = 0; i < p.num_instances(); ++i) {
    const int32_t e = p.instance_expert[static_cast<size_t>(i)], slot = p.instance_slot[static_cast<size_t>(i)];
    // A replica without rows computed nothing, and its host never zeroed its slot's gradient this call
    // (when no rank has rows, no segment runs): only replicas with a quota are reduced.
    if (slot < 0 || ownership_.owner(e) != rank || p.instance_quota[static_cast<size_t>(i)] == 0) continue;
    const auto j = static_cast<size_t>(ownership_.local_index(e));
    const float* src = domain_.region_as<float>(p.instance_rank[static_cast<size_t>(i)], replica_g_) + static_cast<size_t>(slot) * (n1 + n2);
    float* d1 = rs.DW1() + j * n1;
    float* d2 = rs.DW2() + j * n2;
    for (size_t c = 0; c < n1; ++c) d1[c] += src[c];
    for (size_t c = 0; c < n2; ++c) d2[c] += src[n1 + c];
  }
}

const float* HostMoELayer::ExpertWeights(int32_t rank, const Saved&, int64_t local, int which) const {
  const RankState& rs = *ranks_[static_cast<size_t>(rank)];
  const auto n1 = static_cast<size_t>(2 * config_.shape.hidden * config_.shape.ffn), n2 = n1 / 2;
  if (local < slot_base()) return which == 1 ? rs.W1() + static_cast<size_t>(local) * n1 : rs.W2() + static_cast<size_t>(local) * n2;
  const float* base = domain_.region_as<float>(rank, replica_w_) + static_cast<size_t>(local - slot_base()) * (n1 + n2);
  return which == 1 ? base : base + n1;
}

float* HostMoELayer::ExpertGrads(int32_t rank, int64_t local, int which) {
  RankState& rs = *ranks_[static_cast<size_t>(rank)];
  const auto n1 = static_cast<size_t>(2 * config_.shape.hidden * config_.shape.ffn), n2 = n1 / 2;
  if (local < slot_base()) return which == 1 ? rs.DW1() + static_cast<size_t>(local) * n1 : rs.DW2() + static_cast<size_t>(local) * n2;
  float* base = domain_.region_as<float>(rank, replica_g_) + static_cast<size_t>(local - slot_base()) * (n1 + n2);
  return which == 1 ? base : base + n1;
}

int32_t HostMoELayer::ExpertAt(int32_t rank, const Saved& st, int64_t local) const {
  if (local < slot_base()) return ownership_.global_expert(rank, static_cast<int32_t>(local));
  return st.plan->slot_expert[static_cast<size_t>(rank * config_.replica_slots() + (local - slot_base()))];
}

StatusOr<BalancePlan> HostMoELayer::balance_plan(const ForwardContext& ctx) const {
  const Saved* saved = ctx.rank() >= 0 && ctx.rank() < config_.shape.ranks ? ContextAccess::Peek<Saved>(ctx, id_, ctx.rank()) : nullptr;
  if (!saved || !saved->plan)
    return FailedPrecondition(config_.balance.enabled() ? "balance plan: the context holds no planned forward of this layer"
                                                        : "balance plan: the layer was created with balancing off");
  return *saved->plan;
}

StatusOr<BalanceTelemetry> HostMoELayer::balance_telemetry(const ForwardContext& ctx) const {
  RDEP_RETURN_IF_ERROR(balance_plan(ctx).status());
  return ContextAccess::Peek<Saved>(ctx, id_, ctx.rank())->telemetry;
}

StatusOr<BalancePlan> HostMoELayer::balance_plan(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  return balance_plan(ranks_[static_cast<size_t>(rank)]->own_context);
}

StatusOr<BalanceTelemetry> HostMoELayer::balance_telemetry(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  return balance_telemetry(ranks_[static_cast<size_t>(rank)]->own_context);
}

}  // namespace rdep
