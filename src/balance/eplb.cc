// EPLB baselines in rdep's slot layout (see eplb.h): replica counts by highest load per replica,
// balanced packing (global or hierarchical), round-robin reroute.
#include "rdep/balance/eplb.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace rdep {
namespace {

size_t Z(int64_t v) { return static_cast<size_t>(v); }

}  // namespace

Status EplbConfig::Validate(int32_t num_experts, int32_t num_ranks) const {
  if (num_slots < 0) return InvalidArgument("eplb: N_slot " + std::to_string(num_slots) + " is negative");
  if (num_slots > num_experts)
    return InvalidArgument("eplb: N_slot " + std::to_string(num_slots) + " exceeds the number of experts E=" +
                           std::to_string(num_experts));
  if (hierarchical && (ranks_per_node < 1 || num_ranks % ranks_per_node != 0))
    return InvalidArgument("eplb: ranks_per_node " + std::to_string(ranks_per_node) + " must divide R=" +
                           std::to_string(num_ranks));
  return Status::Ok();
}

StatusOr<EplbPlacement> EplbPlace(const std::vector<double>& w, const OwnershipMap& owners, const EplbConfig& cfg) {
  const int32_t E = owners.num_experts(), R = owners.num_ranks();
  if (E < 1 || R < 1) return InvalidArgument("eplb: need E >= 1 and R >= 1");
  RDEP_RETURN_IF_ERROR(cfg.Validate(E, R));
  if (static_cast<int32_t>(w.size()) != E)
    return InvalidArgument("eplb: weight vector has " + std::to_string(w.size()) + " entries, expected E=" +
                           std::to_string(E));
  // Replica counts: the expert with the highest weight per instance gets the next replica.
  std::vector<int32_t> cnt(Z(E), 1);
  const int64_t budget = static_cast<int64_t>(R) * cfg.num_slots;
  for (int64_t k = 0; k < budget; ++k) {
    int32_t best = -1;
    double best_v = -1;
    for (int32_t e = 0; e < E; ++e) {
      if (cnt[Z(e)] >= R) continue;
      const double v = w[Z(e)] / cnt[Z(e)];
      if (v > best_v) {
        best_v = v;
        best = e;
      }
    }
    if (best < 0) break;
    cnt[Z(best)]++;
  }
  // Items: replicas, heaviest first (weight per instance), ties by expert id.
  std::vector<int32_t> items;
  for (int32_t e = 0; e < E; ++e)
    for (int32_t c = 1; c < cnt[Z(e)]; ++c) items.push_back(e);
  std::stable_sort(items.begin(), items.end(),
                   [&](int32_t a, int32_t b) { return w[Z(a)] / cnt[Z(a)] > w[Z(b)] / cnt[Z(b)]; });
  std::vector<double> rank_load(Z(R), 0);
  for (int32_t e = 0; e < E; ++e) rank_load[Z(owners.owner(e))] += w[Z(e)] / cnt[Z(e)];
  std::vector<int32_t> used(Z(R), 0);
  std::vector<std::vector<char>> has(Z(E));  // has[e][t]: expert e already on rank t
  auto hosts = [&](int32_t e, int32_t t) {
    return owners.owner(e) == t || (!has[Z(e)].empty() && has[Z(e)][Z(t)]);
  };
  const int32_t G = cfg.hierarchical ? cfg.ranks_per_node : R;
  const int32_t num_nodes = R / G;
  std::vector<double> node_load(Z(num_nodes), 0);
  for (int32_t t = 0; t < R; ++t) node_load[Z(t / G)] += rank_load[Z(t)];
  EplbPlacement out;
  for (int32_t e : items) {
    auto admissible = [&](int32_t t) { return used[Z(t)] < cfg.num_slots && !hosts(e, t); };
    int32_t node = -1;
    for (int32_t nd = 0; nd < num_nodes; ++nd) {
      bool ok = false;
      for (int32_t t = nd * G; t < (nd + 1) * G && !ok; ++t) ok = admissible(t);
      if (ok && (node < 0 || node_load[Z(nd)] < node_load[Z(node)])) node = nd;
    }
    if (node < 0) continue;  // no admissible rank left: the replica is dropped
    int32_t best = -1;
    for (int32_t t = node * G; t < (node + 1) * G; ++t)
      if (admissible(t) && (best < 0 || rank_load[Z(t)] < rank_load[Z(best)])) best = t;
    if (has[Z(e)].empty()) has[Z(e)].assign(Z(R), 0);
    has[Z(e)][Z(best)] = 1;
    out.expert.push_back(e);
    out.rank.push_back(best);
    out.slot.push_back(used[Z(best)]++);
    const double wi = w[Z(e)] / cnt[Z(e)];
    rank_load[Z(best)] += wi;
    node_load[Z(node)] += wi;
  }
  return out;
}

StatusOr<BalancePlan> RoundRobinPlan(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                     int32_t num_slots, const EplbPlacement& pl) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  const int32_t E = owners.num_experts(), R = owners.num_ranks();
  BalancePlan p;
  p.num_experts = E;
  p.num_ranks = R;
  p.num_slots = num_slots;
  p.slot_expert.assign(Z(R) * Z(num_slots), -1);
  std::vector<std::vector<size_t>> reps(Z(E));
  for (size_t k = 0; k < pl.expert.size(); ++k) reps[Z(pl.expert[k])].push_back(k);
  p.instance_offsets.resize(Z(E) + 1);
  for (int32_t e = 0; e < E; ++e) {
    p.instance_offsets[Z(e)] = p.num_instances();
    p.instance_expert.push_back(e);
    p.instance_rank.push_back(owners.owner(e));
    p.instance_slot.push_back(-1);
    for (size_t k : reps[Z(e)]) {
      p.instance_expert.push_back(e);
      p.instance_rank.push_back(pl.rank[k]);
      p.instance_slot.push_back(pl.slot[k]);
      p.slot_expert[Z(pl.rank[k]) * Z(num_slots) + Z(pl.slot[k])] = e;
    }
  }
  p.instance_offsets[Z(E)] = p.num_instances();
  const int32_t n = p.num_instances();
  p.instance_quota.assign(Z(n), 0);
  p.route.assign(Z(R) * Z(n), 0);
  // f(x, i) = #{g < x : g mod c == i}
  auto f = [](int64_t x, int64_t c, int64_t i) { return x / c + (i < x % c ? 1 : 0); };
  for (int32_t e = 0; e < E; ++e) {
    const int32_t b = p.instance_offsets[Z(e)], c = p.instance_offsets[Z(e) + 1] - b;
    int64_t prefix = 0;
    for (int32_t r = 0; r < R; ++r) {
      const int64_t m = load[Z(r) * Z(E) + Z(e)];
      for (int32_t i = 0; i < c; ++i) p.route[Z(r) * Z(n) + Z(b + i)] = f(prefix + m, c, i) - f(prefix, c, i);
      prefix += m;
    }
    for (int32_t i = 0; i < c; ++i) p.instance_quota[Z(b + i)] = f(prefix, c, i);
  }
  const auto loads = p.RankLoads();
  p.threshold = *std::max_element(loads.begin(), loads.end());
  return p;
}

StatusOr<BalancePlan> EplbPlan(const std::vector<double>& history, const std::vector<int64_t>& load,
                               const OwnershipMap& owners, const EplbConfig& config) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  RDEP_ASSIGN_OR_RETURN(EplbPlacement pl, EplbPlace(history, owners, config));
  return RoundRobinPlan(load, owners, config.num_slots, pl);
}

StatusOr<BalancePlan> EplbExactPlan(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                    const EplbConfig& config) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  const int32_t E = owners.num_experts(), R = owners.num_ranks();
  std::vector<double> w(Z(E), 0);
  for (int32_t r = 0; r < R; ++r)
    for (int32_t e = 0; e < E; ++e) w[Z(e)] += static_cast<double>(load[Z(r) * Z(E) + Z(e)]);
  return EplbPlan(w, load, owners, config);
}

}  // namespace rdep
