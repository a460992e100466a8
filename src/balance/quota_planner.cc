// The host UltraEP quota planner: Algorithm 1 of seeds 001 in integer arithmetic. The GPU planner
// (gpu_planner.cu) implements the same oracle, tie-breaking and rounding and must agree bit for bit.
#include "rdep/balance/quota_planner.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace rdep {
namespace {

size_t Z(int64_t v) { return static_cast<size_t>(v); }

// Loads and the static visiting orders shared by every probe.
struct Prepared {
  int32_t E = 0, R = 0;
  std::vector<int64_t> lam;           // [E] expert loads
  std::vector<int64_t> ell;           // [R] rank loads (main placement)
  std::vector<int32_t> rank_order;    // ranks by descending ell, ascending id
  std::vector<int32_t> expert_first;  // [R+1] into expert_order
  std::vector<int32_t> expert_order;  // experts grouped by owner, each group by descending lam, ascending id
};

Prepared Prepare(const std::vector<int64_t>& load, const OwnershipMap& owners) {
  Prepared p;
  p.E = owners.num_experts();
  p.R = owners.num_ranks();
  p.lam.assign(Z(p.E), 0);
  p.ell.assign(Z(p.R), 0);
  for (int32_t r = 0; r < p.R; ++r)
    for (int32_t e = 0; e < p.E; ++e) p.lam[Z(e)] += load[Z(r) * Z(p.E) + Z(e)];
  for (int32_t e = 0; e < p.E; ++e) p.ell[Z(owners.owner(e))] += p.lam[Z(e)];
  p.rank_order.resize(Z(p.R));
  std::iota(p.rank_order.begin(), p.rank_order.end(), 0);
  std::sort(p.rank_order.begin(), p.rank_order.end(), [&](int32_t a, int32_t b) {
    return p.ell[Z(a)] != p.ell[Z(b)] ? p.ell[Z(a)] > p.ell[Z(b)] : a < b;
  });
  p.expert_first.assign(Z(p.R) + 1, 0);
  for (int32_t e = 0; e < p.E; ++e) p.expert_first[Z(owners.owner(e)) + 1]++;
  for (int32_t r = 0; r < p.R; ++r) p.expert_first[Z(r) + 1] += p.expert_first[Z(r)];
  p.expert_order.resize(Z(p.E));
  std::vector<int32_t> fill(p.expert_first.begin(), p.expert_first.end() - 1);
  for (int32_t e = 0; e < p.E; ++e) p.expert_order[Z(fill[Z(owners.owner(e))]++)] = e;
  for (int32_t r = 0; r < p.R; ++r)
    std::sort(p.expert_order.begin() + p.expert_first[Z(r)], p.expert_order.begin() + p.expert_first[Z(r) + 1],
              [&](int32_t a, int32_t b) { return p.lam[Z(a)] != p.lam[Z(b)] ? p.lam[Z(a)] > p.lam[Z(b)] : a < b; });
  return p;
}

// The greedy feasibility oracle for one threshold. Records transfers when `out` is non-null.
// Scratch vectors are reused across probes.
bool Probe(const Prepared& p, int64_t tau, int32_t num_slots, int64_t min_quota, std::vector<int64_t>& slk,
           std::vector<int32_t>& used, std::vector<int32_t>& dup, std::vector<QuotaTransfer>* out) {
  for (int32_t t = 0; t < p.R; ++t) {
    slk[Z(t)] = std::max<int64_t>(tau - p.ell[Z(t)], 0);
    used[Z(t)] = 0;
    dup[Z(t)] = -1;
  }
  if (out) out->clear();
  for (int32_t ri = 0; ri < p.R; ++ri) {
    const int32_t r = p.rank_order[Z(ri)];
    if (p.ell[Z(r)] <= tau) break;
    int64_t exc = p.ell[Z(r)] - tau;
    for (int32_t k = p.expert_first[Z(r)]; k < p.expert_first[Z(r) + 1] && exc > 0; ++k) {
      const int32_t e = p.expert_order[Z(k)];
      int64_t cap = p.lam[Z(e)];
      while (exc > 0 && cap > 0) {
        int32_t best = -1;
        int64_t best_slk = 0;
        for (int32_t t = 0; t < p.R; ++t)
          if (slk[Z(t)] > best_slk && used[Z(t)] < num_slots && t != r && dup[Z(t)] != e) {
            best_slk = slk[Z(t)];
            best = t;
          }
        if (best < 0) break;
        // Shed at least u_min (overshooting a smaller residual excess), never more than the
        // target's slack or the expert's remaining load.
        const int64_t d = std::min({std::max(exc, min_quota), best_slk, cap});
        if (d < min_quota) break;
        if (out) out->push_back(QuotaTransfer{e, best, used[Z(best)], d});
        used[Z(best)]++;
        dup[Z(best)] = e;
        slk[Z(best)] -= d;
        exc = exc > d ? exc - d : 0;
        cap -= d;
      }
    }
    if (exc > 0) return false;
  }
  return true;
}

}  // namespace

Status QuotaConfig::Validate(int32_t num_experts) const {
  if (num_slots < 0) return InvalidArgument("quota planner: N_slot " + std::to_string(num_slots) + " is negative");
  if (num_slots > num_experts)
    return InvalidArgument("quota planner: N_slot " + std::to_string(num_slots) + " exceeds the number of experts E=" +
                           std::to_string(num_experts));
  if (min_quota < 1) return InvalidArgument("quota planner: u_min " + std::to_string(min_quota) + " must be >= 1");
  if (min_gain < 0) return InvalidArgument("quota planner: min_gain " + std::to_string(min_gain) + " must be >= 0 (0 = off)");
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const QuotaConfig& c) {
  return os << "QuotaConfig{N_slot=" << c.num_slots << ", u_min=" << c.min_quota << ", min_gain=" << c.min_gain
            << ", locality=" << (c.locality ? "on" : "off") << "}";
}

StatusOr<ReplicationResult> SolveReplication(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                             const QuotaConfig& config) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  RDEP_RETURN_IF_ERROR(config.Validate(owners.num_experts()));
  const Prepared p = Prepare(load, owners);
  for (int32_t e = 0; e < p.E; ++e)
    if (p.lam[Z(e)] > kMaxExpertLoad)
      return InvalidArgument("quota planner: expert " + std::to_string(e) + " has " + std::to_string(p.lam[Z(e)]) +
                             " rows, above the exact-arithmetic limit " + std::to_string(kMaxExpertLoad));
  int64_t total = 0, hi = 0;
  for (int64_t l : p.ell) {
    total += l;
    hi = std::max(hi, l);
  }
  int64_t lo = (total + p.R - 1) / p.R;
  std::vector<int64_t> slk(Z(p.R));
  std::vector<int32_t> used(Z(p.R)), dup(Z(p.R));
  ReplicationResult res;
  bool any_feasible = false;
  while (lo < hi) {
    const int64_t tau = lo + (hi - lo) / 2;
    ++res.num_probes;
    if (Probe(p, tau, config.num_slots, config.min_quota, slk, used, dup, nullptr)) {
      hi = tau;
      any_feasible = true;
    } else {
      lo = tau + 1;
    }
  }
  res.threshold = hi;
  // Re-run the last feasible probe to record its transfers (the probe is a pure function of tau).
  if (any_feasible) Probe(p, hi, config.num_slots, config.min_quota, slk, used, dup, &res.transfers);
  // The gain gate (QuotaConfig::min_gain): the GPU planner applies the same rule to the same numbers.
  const int64_t max_load = *std::max_element(p.ell.begin(), p.ell.end());
  const auto replicas = static_cast<int64_t>(res.transfers.size());
  if (config.min_gain > 0 && replicas > 0 && (max_load - res.threshold) / replicas < config.min_gain) {  // no overflow
    res.transfers.clear();
    res.threshold = max_load;
  }
  return res;
}

StatusOr<BalancePlan> MaterializeReplication(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                             int32_t num_slots, const ReplicationResult& rep) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  const int32_t E = owners.num_experts(), R = owners.num_ranks();
  BalancePlan p;
  p.num_experts = E;
  p.num_ranks = R;
  p.num_slots = num_slots;
  p.threshold = rep.threshold;
  p.slot_expert.assign(Z(R) * Z(num_slots), -1);
  std::vector<int64_t> lam(Z(E), 0);
  for (int32_t r = 0; r < R; ++r)
    for (int32_t e = 0; e < E; ++e) lam[Z(e)] += load[Z(r) * Z(E) + Z(e)];
  // Transfers of one expert are contiguous (each expert is visited once per probe); index them.
  std::vector<int32_t> first(Z(E), -1), count(Z(E), 0);
  for (size_t k = 0; k < rep.transfers.size(); ++k) {
    const auto& t = rep.transfers[k];
    if (t.expert < 0 || t.expert >= E || t.rank < 0 || t.rank >= R || t.slot < 0 || t.slot >= num_slots)
      return InternalError("materialize: transfer out of range");
    if (first[Z(t.expert)] < 0) first[Z(t.expert)] = static_cast<int32_t>(k);
    if (first[Z(t.expert)] + count[Z(t.expert)] != static_cast<int32_t>(k))
      return InternalError("materialize: transfers of expert " + std::to_string(t.expert) + " are not contiguous");
    count[Z(t.expert)]++;
  }
  p.instance_offsets.resize(Z(E) + 1);
  for (int32_t e = 0; e < E; ++e) {
    p.instance_offsets[Z(e)] = p.num_instances();
    int64_t moved = 0;
    for (int32_t c = 0; c < count[Z(e)]; ++c) moved += rep.transfers[Z(first[Z(e)] + c)].amount;
    p.instance_expert.push_back(e);
    p.instance_rank.push_back(owners.owner(e));
    p.instance_slot.push_back(-1);
    p.instance_quota.push_back(lam[Z(e)] - moved);
    for (int32_t c = 0; c < count[Z(e)]; ++c) {
      const auto& t = rep.transfers[Z(first[Z(e)] + c)];
      p.instance_expert.push_back(e);
      p.instance_rank.push_back(t.rank);
      p.instance_slot.push_back(t.slot);
      p.instance_quota.push_back(t.amount);
      p.slot_expert[Z(t.rank) * Z(num_slots) + Z(t.slot)] = e;
    }
  }
  p.instance_offsets[Z(E)] = p.num_instances();
  return p;
}

Status SolveReroute(const std::vector<int64_t>& load, bool locality, BalancePlan* plan) {
  BalancePlan& p = *plan;
  const int32_t E = p.num_experts, R = p.num_ranks, n = p.num_instances();
  if (static_cast<int64_t>(load.size()) != static_cast<int64_t>(R) * E)
    return InvalidArgument("reroute: load matrix size does not match the plan");
  p.route.assign(Z(R) * Z(n), 0);
  auto route = [&](int32_t r, int32_t i) -> int64_t& { return p.route[Z(r) * Z(n) + Z(i)]; };
  std::vector<int64_t> local, W, q;
  for (int32_t e = 0; e < E; ++e) {
    const int32_t b = p.instance_offsets[Z(e)], k = p.instance_offsets[Z(e) + 1] - b;
    if (k == 1) {
      for (int32_t r = 0; r < R; ++r) route(r, b) = load[Z(r) * Z(E) + Z(e)];
      continue;
    }
    // W[i] = residual quota of instances 0..i-1 (W[k] = D, the residual total).
    local.assign(Z(k), 0);
    W.assign(Z(k) + 1, 0);
    q.assign(Z(k) + 1, 0);
    for (int32_t i = 0; i < k; ++i) {
      const int32_t t = p.instance_rank[Z(b + i)];
      local[Z(i)] = locality ? std::min(load[Z(t) * Z(E) + Z(e)], p.instance_quota[Z(b + i)]) : 0;
      route(t, b + i) = local[Z(i)];
      W[Z(i) + 1] = W[Z(i)] + p.instance_quota[Z(b + i)] - local[Z(i)];
    }
    for (int32_t r = 0; r < R; ++r) {
      int64_t d = load[Z(r) * Z(E) + Z(e)];
      for (int32_t i = 0; i < k; ++i)
        if (p.instance_rank[Z(b + i)] == r) d -= local[Z(i)];
      if (d == 0) continue;
      const int64_t D = W[Z(k)];
      if (D < d) return InternalError("reroute: residual demand exceeds residual quota");
      // Cut the demand at the instances' cumulative residual quotas: instance i takes
      // floor(d*W[i+1]/D) - floor(d*W[i]/D), i.e. floor or ceil of its proportional share d*ru_i/D;
      // the takes sum to d, and W stays the prefix sum of the residual quotas.
      for (int32_t i = 0; i <= k; ++i) q[Z(i)] = d * W[Z(i)] / D;
      for (int32_t i = 0; i < k; ++i) route(r, b + i) += q[Z(i) + 1] - q[Z(i)];
      for (int32_t i = 0; i <= k; ++i) W[Z(i)] -= q[Z(i)];
    }
  }
  return Status::Ok();
}

StatusOr<BalancePlan> SolveQuotaPlan(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                     const QuotaConfig& config) {
  RDEP_ASSIGN_OR_RETURN(ReplicationResult rep, SolveReplication(load, owners, config));
  RDEP_ASSIGN_OR_RETURN(BalancePlan plan, MaterializeReplication(load, owners, config.num_slots, rep));
  RDEP_RETURN_IF_ERROR(SolveReroute(load, config.locality, &plan));
  return plan;
}

}  // namespace rdep
