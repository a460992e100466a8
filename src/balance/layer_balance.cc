#include "rdep/balance/layer_balance.h"

#include <algorithm>
#include <cmath>

#include "rdep/balance/eplb.h"
#include "rdep/balance/quota_planner.h"
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
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const BalanceConfig& c) {
  os << BalanceKindName(c.kind);
  if (c.enabled()) os << "(N_slot=" << c.num_slots << (c.kind == BalanceKind::kUltraEp ? ", u_min=" + std::to_string(c.min_quota) : "") << ")";
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
      return SolveQuotaPlan(load, owners, QuotaConfig{config.num_slots, config.min_quota, /*locality=*/true});
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
  if (relay_above <= 0) return out;
  const int32_t E = plan.num_experts;
  // Replicas that compute rows (EPLB may place idle ones; they get no weights).
  auto active = [&](int32_t i) { return plan.instance_slot[static_cast<size_t>(i)] >= 0 && plan.instance_quota[static_cast<size_t>(i)] > 0; };
  auto replicas = [&](int32_t e) {
    int32_t n = 0;
    for (int32_t i = plan.instance_offsets[static_cast<size_t>(e)]; i < plan.instance_offsets[static_cast<size_t>(e) + 1]; ++i) n += active(i);
    return n;
  };
  // Sending load per rank, in expert copies: owners start with what they send directly.
  std::vector<double> load(static_cast<size_t>(plan.num_ranks), 0.0);
  std::vector<int32_t> wide;
  for (int32_t e = 0; e < E; ++e) {
    const int32_t owner = plan.instance_rank[static_cast<size_t>(plan.instance_offsets[static_cast<size_t>(e)])];
    if (replicas(e) > relay_above) {
      wide.push_back(e);
      load[static_cast<size_t>(owner)] += 1.0;  // stage 1: one copy, in chunks
    } else {
      load[static_cast<size_t>(owner)] += replicas(e);
    }
  }
  std::stable_sort(wide.begin(), wide.end(), [&](int32_t a, int32_t b) { return replicas(a) > replicas(b); });
  for (int32_t e : wide) {
    const int32_t R = replicas(e);
    const auto m = std::max<int32_t>(1, static_cast<int32_t>(std::lround(std::sqrt(static_cast<double>(R)))));
    std::vector<int32_t> cand;
    for (int32_t i = plan.instance_offsets[static_cast<size_t>(e)] + 1; i < plan.instance_offsets[static_cast<size_t>(e) + 1]; ++i)
      if (active(i)) cand.push_back(i);
    std::stable_sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) {
      const double la = load[static_cast<size_t>(plan.instance_rank[static_cast<size_t>(a)])];
      const double lb = load[static_cast<size_t>(plan.instance_rank[static_cast<size_t>(b)])];
      if (la != lb) return la < lb;
      return plan.instance_rank[static_cast<size_t>(a)] < plan.instance_rank[static_cast<size_t>(b)];
    });
    ExpertRelays er{e, std::vector<int32_t>(cand.begin(), cand.begin() + m)};
    std::sort(er.relays.begin(), er.relays.end());
    for (int32_t i : er.relays) load[static_cast<size_t>(plan.instance_rank[static_cast<size_t>(i)])] += static_cast<double>(R - 1) / m;
    out.experts.push_back(std::move(er));
  }
  std::sort(out.experts.begin(), out.experts.end(), [](const ExpertRelays& a, const ExpertRelays& b) { return a.expert < b.expert; });
  return out;
}

}  // namespace rdep
