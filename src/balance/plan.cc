// BalancePlan helpers: metrics, the no-balancing plan, the constraint checker and token assignment.
#include "rdep/balance/plan.h"

#include <algorithm>
#include <string>

namespace rdep {
namespace {

std::string S(int64_t v) { return std::to_string(v); }
size_t Z(int64_t v) { return static_cast<size_t>(v); }

}  // namespace

std::vector<int64_t> BalancePlan::RankLoads() const {
  std::vector<int64_t> loads(Z(num_ranks), 0);
  for (size_t i = 0; i < instance_rank.size(); ++i) loads[Z(instance_rank[i])] += instance_quota[i];
  return loads;
}

PlanMetrics ComputeMetrics(const BalancePlan& plan) {
  PlanMetrics m;
  const auto loads = plan.RankLoads();
  int64_t total = 0;
  for (int64_t l : loads) {
    total += l;
    m.max_rank_load = std::max(m.max_rank_load, l);
  }
  m.mean_rank_load = plan.num_ranks > 0 ? static_cast<double>(total) / plan.num_ranks : 0.0;
  m.imbalance = m.mean_rank_load > 0 ? static_cast<double>(m.max_rank_load) / m.mean_rank_load : 1.0;
  m.replicas = plan.num_replicas();
  m.max_hosts = 0;
  for (int32_t e = 0; e < plan.num_experts; ++e)
    m.max_hosts = std::max(m.max_hosts, plan.instance_offsets[Z(e) + 1] - plan.instance_offsets[Z(e)]);
  const int32_t n = plan.num_instances();
  int64_t remote = 0;
  for (int32_t r = 0; r < plan.num_ranks; ++r)
    for (int32_t i = 0; i < n; ++i)
      if (plan.instance_rank[Z(i)] != r) remote += plan.route_at(r, i);
  m.inflight_ratio = total > 0 ? static_cast<double>(remote) / static_cast<double>(total) : 0.0;
  return m;
}

Status ValidateLoad(const std::vector<int64_t>& load, const OwnershipMap& owners) {
  const int64_t e = owners.num_experts(), r = owners.num_ranks();
  if (e < 1) return InvalidArgument("balance: need at least one expert (E=" + S(e) + ")");
  if (r < 1) return InvalidArgument("balance: need at least one rank (R=" + S(r) + ")");
  if (static_cast<int64_t>(load.size()) != r * e)
    return InvalidArgument("balance: load matrix has " + S(static_cast<int64_t>(load.size())) +
                           " entries, expected R*E = " + S(r) + "*" + S(e) + " = " + S(r * e));
  for (size_t i = 0; i < load.size(); ++i)
    if (load[i] < 0)
      return InvalidArgument("balance: negative load " + S(load[i]) + " at rank " + S(static_cast<int64_t>(i) / e) +
                             ", expert " + S(static_cast<int64_t>(i) % e));
  return Status::Ok();
}

StatusOr<BalancePlan> NoBalancePlan(const std::vector<int64_t>& load, const OwnershipMap& owners) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  const int32_t E = owners.num_experts(), R = owners.num_ranks();
  BalancePlan p;
  p.num_experts = E;
  p.num_ranks = R;
  p.num_slots = 0;
  p.instance_offsets.resize(Z(E) + 1);
  p.route.assign(Z(R) * Z(E), 0);
  for (int32_t e = 0; e < E; ++e) {
    p.instance_offsets[Z(e)] = e;
    p.instance_expert.push_back(e);
    p.instance_rank.push_back(owners.owner(e));
    p.instance_slot.push_back(-1);
    int64_t q = 0;
    for (int32_t r = 0; r < R; ++r) {
      q += load[Z(r) * Z(E) + Z(e)];
      p.route[Z(r) * Z(E) + Z(e)] = load[Z(r) * Z(E) + Z(e)];
    }
    p.instance_quota.push_back(q);
  }
  p.instance_offsets[Z(E)] = E;
  const auto loads = p.RankLoads();
  p.threshold = loads.empty() ? 0 : *std::max_element(loads.begin(), loads.end());
  return p;
}

Status CheckPlan(const BalancePlan& p, const std::vector<int64_t>& load, const OwnershipMap& owners,
                 int64_t min_quota) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  auto bad = [](const std::string& m) { return InternalError("plan: " + m); };
  const int32_t E = owners.num_experts(), R = owners.num_ranks();
  if (p.num_experts != E || p.num_ranks != R) return bad("E/R differ from the ownership map");
  if (p.instance_offsets.size() != Z(E) + 1 || p.instance_offsets[0] != 0) return bad("instance_offsets malformed");
  const int32_t n = p.num_instances();
  if (p.instance_offsets[Z(E)] != n || p.instance_expert.size() != Z(n) || p.instance_slot.size() != Z(n) ||
      p.instance_quota.size() != Z(n))
    return bad("instance arrays disagree in size");
  if (p.route.size() != Z(R) * Z(n)) return bad("route has the wrong size");
  if (p.slot_expert.size() != Z(R) * Z(p.num_slots)) return bad("slot_expert has the wrong size");
  std::vector<int32_t> seen_slot(Z(R) * Z(p.num_slots), -1);
  for (int32_t e = 0; e < E; ++e) {
    const int32_t b = p.instance_offsets[Z(e)], en = p.instance_offsets[Z(e) + 1];
    if (en <= b) return bad("expert " + S(e) + " has no instance");
    if (p.instance_rank[Z(b)] != owners.owner(e) || p.instance_slot[Z(b)] != -1)
      return bad("expert " + S(e) + ": first instance is not the main on its owner");
    int64_t qsum = 0;
    for (int32_t i = b; i < en; ++i) {
      if (p.instance_expert[Z(i)] != e) return bad("instance " + S(i) + " names the wrong expert");
      const int32_t t = p.instance_rank[Z(i)], s = p.instance_slot[Z(i)];
      if (t < 0 || t >= R) return bad("instance " + S(i) + " on rank " + S(t) + " outside [0, R)");
      for (int32_t j = b; j < i; ++j)
        if (p.instance_rank[Z(j)] == t) return bad("expert " + S(e) + " has two instances on rank " + S(t));
      if (i > b) {
        if (s < 0 || s >= p.num_slots) return bad("replica " + S(i) + " in slot " + S(s) + " outside the budget");
        const size_t k = Z(t) * Z(p.num_slots) + Z(s);
        if (seen_slot[k] != -1) return bad("slot " + S(s) + " of rank " + S(t) + " used twice");
        seen_slot[k] = i;
        if (p.slot_expert[k] != e) return bad("slot_expert disagrees with replica " + S(i));
        if (min_quota > 0 && p.instance_quota[Z(i)] < min_quota)
          return bad("replica " + S(i) + " of expert " + S(e) + " carries " + S(p.instance_quota[Z(i)]) +
                     " rows < u_min " + S(min_quota));
      }
      if (p.instance_quota[Z(i)] < 0) return bad("negative quota");
      qsum += p.instance_quota[Z(i)];
      int64_t col = 0;
      for (int32_t r = 0; r < R; ++r) {
        const int64_t q = p.route_at(r, i);
        if (q < 0) return bad("negative route count");
        col += q;
      }
      if (col != p.instance_quota[Z(i)])
        return bad("instance " + S(i) + " receives " + S(col) + " rows but its quota is " + S(p.instance_quota[Z(i)]));
    }
    int64_t lam = 0;
    for (int32_t r = 0; r < R; ++r) {
      int64_t row = 0;
      for (int32_t i = b; i < en; ++i) row += p.route_at(r, i);
      const int64_t want = load[Z(r) * Z(E) + Z(e)];
      if (row != want)
        return bad("source " + S(r) + " sends " + S(row) + " rows of expert " + S(e) + ", its demand is " + S(want));
      lam += want;
    }
    if (qsum != lam) return bad("quotas of expert " + S(e) + " sum to " + S(qsum) + ", its load is " + S(lam));
  }
  for (size_t k = 0; k < seen_slot.size(); ++k)
    if (seen_slot[k] == -1 && p.slot_expert[k] != -1) return bad("slot_expert names a replica that does not exist");
  return Status::Ok();
}

int32_t InstanceForRow(const BalancePlan& p, int32_t src, int32_t expert, int64_t j) {
  int64_t cum = 0;
  for (int32_t i = p.instance_offsets[Z(expert)]; i < p.instance_offsets[Z(expert) + 1]; ++i) {
    cum += p.route_at(src, i);
    if (j < cum) return i;
  }
  return -1;
}

StatusOr<std::vector<int32_t>> AssignTokens(const BalancePlan& p, int32_t src, const std::vector<int32_t>& experts) {
  if (src < 0 || src >= p.num_ranks) return InvalidArgument("AssignTokens: source rank " + S(src) + " outside [0, R)");
  std::vector<int64_t> seen(Z(p.num_experts), 0);
  std::vector<int32_t> out(experts.size(), -1);
  for (size_t k = 0; k < experts.size(); ++k) {
    const int32_t e = experts[k];
    if (e < 0 || e >= p.num_experts) return InvalidArgument("AssignTokens: expert " + S(e) + " outside [0, E)");
    const int32_t i = InstanceForRow(p, src, e, seen[Z(e)]++);
    if (i < 0)
      return InvalidArgument("AssignTokens: source " + S(src) + " has more rows for expert " + S(e) +
                             " than the plan routes");
    out[k] = i;
  }
  for (int32_t e = 0; e < p.num_experts; ++e) {
    int64_t want = 0;
    for (int32_t i = p.instance_offsets[Z(e)]; i < p.instance_offsets[Z(e) + 1]; ++i) want += p.route_at(src, i);
    if (want != seen[Z(e)])
      return InvalidArgument("AssignTokens: source " + S(src) + " has " + S(seen[Z(e)]) + " rows for expert " + S(e) +
                             ", the plan routes " + S(want));
  }
  return out;
}

std::ostream& operator<<(std::ostream& os, const BalancePlan& p) {
  os << "BalancePlan{E=" << p.num_experts << ", R=" << p.num_ranks << ", N_slot=" << p.num_slots
     << ", tau=" << p.threshold << ", replicas=" << p.num_replicas() << "}\n";
  for (int32_t e = 0; e < p.num_experts; ++e) {
    const int32_t b = p.instance_offsets[Z(e)], en = p.instance_offsets[Z(e) + 1];
    if (en - b == 1) continue;
    os << "  expert " << e << ":";
    for (int32_t i = b; i < en; ++i) {
      os << " rank " << p.instance_rank[Z(i)];
      if (p.instance_slot[Z(i)] < 0)
        os << "(main)";
      else
        os << "(slot " << p.instance_slot[Z(i)] << ")";
      os << " u=" << p.instance_quota[Z(i)] << (i + 1 < en ? "," : "");
    }
    os << "\n";
  }
  return os;
}

std::ostream& operator<<(std::ostream& os, const PlanMetrics& m) {
  return os << "imbalance=" << m.imbalance << " max_rank_load=" << m.max_rank_load << " replicas=" << m.replicas
            << " max|H(e)|=" << m.max_hosts << " inflight=" << m.inflight_ratio;
}

}  // namespace rdep
