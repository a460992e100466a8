// BalancePlan: the output of every balancer in rdep (UltraEP quota planner, EPLB baselines, no
// balancing). It says, for one MoE layer and one step, where each expert's physical instances live
// (main expert on its owner, replicas in redundant slots), how many rows each instance computes
// (its quota), and how many rows each source rank sends to each instance (the reroute split Q).
// A layer consumes it as: slot_expert -> which weights to stream into each redundant slot;
// route -> per (source, instance) counts, turned into a per-token destination by AssignTokens.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "rdep/core/ownership.h"
#include "rdep/status.h"

namespace rdep {

// Seeds 001 notation: Lambda = load (lambda_{r,e}), U = quotas (u_{e,t}), X = slot_expert (x_{r,s}),
// Q = route (q_{r,e,t}), H(e) = the host ranks of expert e's instances.
struct BalancePlan {
  int32_t num_experts = 0;  // E
  int32_t num_ranks = 0;    // R (= W)
  int32_t num_slots = 0;    // N_slot redundant slots per rank
  int64_t threshold = 0;    // the solved tau (UltraEP); for other planners the max rank load of the plan

  // Instances of expert e are [instance_offsets[e], instance_offsets[e+1]). The first is always the
  // main instance on the owner (slot -1); replicas follow in the order the planner created them.
  std::vector<int32_t> instance_offsets;  // [E+1]
  std::vector<int32_t> instance_expert;   // [I] logical expert of each instance
  std::vector<int32_t> instance_rank;     // [I] host rank t
  std::vector<int32_t> instance_slot;     // [I] -1 for the main instance, else the redundant slot s on t
  std::vector<int64_t> instance_quota;    // [I] u_{e,t}: rows the instance computes
  std::vector<int32_t> slot_expert;       // [R * N_slot] x_{r,s}: expert replicated in slot s of rank r, -1 empty
  // route[r * I + i]: rows source rank r sends to instance i (i indexes the instance arrays).
  // Row sums per (r, expert) equal Lambda[r][e]; column sums per instance equal its quota.
  std::vector<int64_t> route;  // [R * I]

  int32_t num_instances() const { return static_cast<int32_t>(instance_rank.size()); }
  int32_t num_replicas() const { return num_instances() - num_experts; }  // sum_e (|H(e)| - 1)
  int64_t route_at(int32_t src, int32_t instance) const {
    return route[static_cast<size_t>(src) * static_cast<size_t>(num_instances()) + static_cast<size_t>(instance)];
  }
  // Post-reroute load of each rank: the sum of the quotas of the instances it hosts.
  std::vector<int64_t> RankLoads() const;
};

// Metrics of seeds 001 Table 4 for one plan.
struct PlanMetrics {
  double imbalance = 1.0;       // max rank load / mean rank load (1 when there is no load)
  int64_t max_rank_load = 0;
  double mean_rank_load = 0;
  int32_t replicas = 0;         // sum_e (|H(e)| - 1): redundant slots used
  int32_t max_hosts = 1;        // max_e |H(e)| (main included): the widest expert
  double inflight_ratio = 0;    // rows not absorbed by their own rank / all rows
};
PlanMetrics ComputeMetrics(const BalancePlan& plan);

// The plan without balancing: one main instance per expert, quotas = expert loads, no reroute.
StatusOr<BalancePlan> NoBalancePlan(const std::vector<int64_t>& load, const OwnershipMap& owners);

// Checks every constraint of a plan against its load matrix: shapes, main placement = ownership,
// slot budget and slot table consistency, no two instances of one expert on one rank, quotas sum to
// the expert load, route row sums = Lambda[r][e], route column sums = quotas, no negative counts, and
// (if min_quota > 0) every replica carries at least min_quota rows. Returns the first violation.
Status CheckPlan(const BalancePlan& plan, const std::vector<int64_t>& load, const OwnershipMap& owners,
                 int64_t min_quota = 0);

// Validates a load matrix: R >= 1, E >= 1, load.size() == R*E, no negative entry, owners sized E x R.
Status ValidateLoad(const std::vector<int64_t>& load, const OwnershipMap& owners);

// Token assignment by cumulative quotas (seeds 001 section 5.2): the j-th row (0-based) that source
// rank src sends to expert e goes to the first instance of e whose cumulative route count covers j.
// Returns the instance index, or -1 when j is not below Lambda[src][e].
int32_t InstanceForRow(const BalancePlan& plan, int32_t src, int32_t expert, int64_t j);

// Assigns every (token, slot) of a rank's routing (experts[t*K+k]) to an instance: the rows of each
// expert are numbered in (t, k) order and mapped by InstanceForRow. Fails if the routing's counts
// do not match the plan's route sums for that source.
StatusOr<std::vector<int32_t>> AssignTokens(const BalancePlan& plan, int32_t src, const std::vector<int32_t>& experts);

std::ostream& operator<<(std::ostream& os, const BalancePlan& p);
std::ostream& operator<<(std::ostream& os, const PlanMetrics& m);

}  // namespace rdep
