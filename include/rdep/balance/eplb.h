// EPLB baselines (DeepSeek's Expert-Parallelism Load Balancer) adapted to rdep's slot layout: main
// experts stay on their owners (immutable), replicas go into the N_slot redundant slots per rank with
// no duplicate on a rank. Replica counts: R*N_slot times, give one more replica to the expert with
// the highest load per replica. Placement: balanced packing, heaviest replica first onto the least
// loaded admissible rank (global), or first onto the least loaded node, then its least loaded
// admissible rank (hierarchical). Reroute: round-robin over an expert's instances (no locality).
//   EPLB (history):     placement from a historical load vector, quotas from the exact current load.
//   EPLB++ (exact):     placement from the exact current load (seeds 001's "EPLB with exact load").
#pragma once

#include <cstdint>
#include <vector>

#include "rdep/balance/plan.h"
#include "rdep/core/ownership.h"
#include "rdep/status.h"

namespace rdep {

struct EplbConfig {
  int32_t num_slots = 2;        // N_slot per rank
  bool hierarchical = false;    // pack replicas onto nodes first, then ranks within the node
  int32_t ranks_per_node = 8;   // node size for the hierarchical variant (must divide R)

  Status Validate(int32_t num_experts, int32_t num_ranks) const;
};

// A placement: replica (expert, rank, slot) triples in creation order.
struct EplbPlacement {
  std::vector<int32_t> expert, rank, slot;
};

// Decides replicas from per-expert weights (e.g. historical loads, size E).
StatusOr<EplbPlacement> EplbPlace(const std::vector<double>& expert_weight, const OwnershipMap& owners,
                                  const EplbConfig& config);

// Turns a placement into a plan for the exact load matrix with round-robin reroute: the g-th row of
// expert e (rows numbered by source rank, then order) goes to instance g mod |H(e)|.
StatusOr<BalancePlan> RoundRobinPlan(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                     int32_t num_slots, const EplbPlacement& placement);

// EPLB driven by a historical load vector, applied to the exact load.
StatusOr<BalancePlan> EplbPlan(const std::vector<double>& history, const std::vector<int64_t>& load,
                               const OwnershipMap& owners, const EplbConfig& config);

// EPLB++: EPLB placement from the exact load itself, round-robin reroute.
StatusOr<BalancePlan> EplbExactPlan(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                    const EplbConfig& config);

}  // namespace rdep
