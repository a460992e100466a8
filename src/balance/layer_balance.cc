#include "rdep/balance/layer_balance.h"

#include <algorithm>
#include <cmath>

#include "rdep/balance/eplb.h"
#include "rdep/balance/quota_planner.h"
#include "rdep/balance/relay_rule.h"
#include "rdep/core/capacity.h"

namespace rdep {

const char* BalanceKindName(BalanceKind kind) {
  switch (kind) {
    case BalanceKind::kOff: return "off";
    case BalanceKind::kUltraEp: return "ultraep";
    case BalanceKind::kEplb: return "eplb";
    case BalanceKind::kEplbExact: return "eplb-exact";
  }
  return "?";
}

StatusOr<BalanceKind> ParseBalanceKind(std::string_view name) {
  for (BalanceKind k : {BalanceKind::kOff, BalanceKind::kUltraEp, BalanceKind::kEplb, BalanceKind::kEplbExact})
    if (name == BalanceKindName(k)) return k;
  return InvalidArgument("balancer '" + std::string(name) + "' is not one of off, ultraep, eplb, eplb-exact");
}

Status BalanceConfig::Validate(int32_t num_experts) const {
  if (!enabled()) return Status::Ok();
  if (num_slots < 0 || num_slots > num_experts)
    return InvalidArgument("balance: N_slot (redundant slots per rank) " + std::to_string(num_slots) +
                           " must be in [0, E=" + std::to_string(num_experts) + "]");
  if (min_quota < 1) return InvalidArgument("balance: u_min (rows a replica carries at least) " + std::to_string(min_quota) +
                                            " must be >= 1");
  if (relay_above < 0) return InvalidArgument("balance: relay_above " + std::to_string(relay_above) + " must be >= 0 (0 = no relays)");
  if (min_gain < 0) return InvalidArgument("balance: min_gain (rows a replica must take off the busiest rank) " + std::to_string(min_gain) +
                                           " must be >= 0 (0 = off)");
  if (min_gain != 0 && kind != BalanceKind::kUltraEp)
    return InvalidArgument(std::string("balance: min_gain is UltraEP's gain gate; balancer ") + BalanceKindName(kind) + " has none (use 0)");
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const BalanceConfig& c) {
  os << BalanceKindName(c.kind);
  if (c.enabled())
    os << "(N_slot=" << c.num_slots << (c.kind == BalanceKind::kUltraEp ? ", u_min=" + std::to_string(c.min_quota) : "")
       << (c.min_gain > 0 ? ", min_gain=" + std::to_string(c.min_gain) : "") << ")";
  return os;
}

StatusOr<BalancePlan> SolveLayerPlan(const BalanceConfig& config, const std::vector<int64_t>& load,
                                     const OwnershipMap& owners, const std::vector<double>& history) {
  RDEP_RETURN_IF_ERROR(config.Validate(owners.num_experts()));
  EplbConfig eplb;
  eplb.num_slots = config.num_slots;
  switch (config.kind) {
    case BalanceKind::kOff:
      return NoBalancePlan(load, owners);
    case BalanceKind::kUltraEp:
      return SolveQuotaPlan(load, owners, QuotaConfig{config.num_slots, config.min_quota, /*locality=*/true, config.min_gain});
    case BalanceKind::kEplb:
      if (!history.empty()) return EplbPlan(history, load, owners, eplb);
      return EplbExactPlan(load, owners, eplb);
    case BalanceKind::kEplbExact:
      return EplbExactPlan(load, owners, eplb);
  }
  return InvalidArgument("balance: unknown balancer");
}

std::vector<int64_t> AdmitLoadMatrix(const std::vector<int64_t>& load, int64_t W, int64_t E, int64_t capacity) {
  std::vector<int64_t> admitted(load.size()), counts(static_cast<size_t>(W)), kept(static_cast<size_t>(W));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = 0; r < W; ++r) counts[static_cast<size_t>(r)] = load[static_cast<size_t>(r * E + e)];
    AdmitBySourceOrder(counts.data(), W, capacity, kept.data());
    for (int64_t r = 0; r < W; ++r) admitted[static_cast<size_t>(r * E + e)] = kept[static_cast<size_t>(r)];
  }
  return admitted;
}

BalanceTelemetry ComputeBalanceTelemetry(const BalancePlan& plan, const std::vector<int64_t>& load,
                                         const OwnershipMap& owners, int64_t bytes_per_expert) {
  BalanceTelemetry t;
  const int32_t W = owners.num_ranks(), E = owners.num_experts();
  std::vector<int64_t> owner_load(static_cast<size_t>(W), 0);
  int64_t total = 0;
  for (int32_t r = 0; r < W; ++r)
    for (int32_t e = 0; e < E; ++e) {
      const int64_t l = load[static_cast<size_t>(r) * static_cast<size_t>(E) + static_cast<size_t>(e)];
      owner_load[static_cast<size_t>(owners.owner(e))] += l;
      total += l;
    }
  const double mean = W > 0 ? static_cast<double>(total) / W : 0.0;
  const int64_t before = owner_load.empty() ? 0 : *std::max_element(owner_load.begin(), owner_load.end());
  const PlanMetrics m = ComputeMetrics(plan);
  t.imbalance_before = mean > 0 ? static_cast<double>(before) / mean : 1.0;
  t.imbalance_after = m.imbalance;
  t.replicas = m.replicas;
  t.slots = W * plan.num_slots;
  t.slot_limited = m.max_rank_load > static_cast<int64_t>((total + W - 1) / std::max(W, 1)) && t.replicas == t.slots;
  t.weight_bytes = static_cast<int64_t>(t.replicas) * bytes_per_expert;
  return t;
}

}  // namespace rdep

namespace rdep {

RelayPlan PlanRelays(const BalancePlan& plan, int32_t relay_above) {
  RelayPlan out;
  if (relay_above <= 0 || plan.instance_offsets.empty()) return out;
  const RelayRuleInputs in{plan.num_experts, plan.num_ranks, plan.instance_offsets.data(), plan.instance_rank.data(),
                           plan.instance_slot.data(), plan.instance_quota.data()};
  std::vector<double> load(static_cast<size_t>(plan.num_ranks));
  std::vector<int32_t> wide(static_cast<size_t>(plan.num_experts)), chunks(static_cast<size_t>(plan.num_experts));
  std::vector<int32_t> chunk_of(static_cast<size_t>(plan.num_instances()));
  ComputeRelays(in, relay_above, load.data(), wide.data(), chunks.data(), chunk_of.data());
  for (int32_t e = 0; e < plan.num_experts; ++e) {
    if (chunks[static_cast<size_t>(e)] == 0) continue;
    ExpertRelays er{e, std::vector<int32_t>(static_cast<size_t>(chunks[static_cast<size_t>(e)]))};
    for (int32_t i = plan.instance_offsets[static_cast<size_t>(e)]; i < plan.instance_offsets[static_cast<size_t>(e) + 1]; ++i)
      if (chunk_of[static_cast<size_t>(i)] >= 0) er.relays[static_cast<size_t>(chunk_of[static_cast<size_t>(i)])] = i;
    out.experts.push_back(std::move(er));
  }
  return out;
}

}  // namespace rdep
