// The UltraEP quota planner (seeds 001 Algorithm 1): from the exact load matrix Lambda it solves a
// threshold tau by binary search with a greedy feasibility oracle, materializes replicas into the
// redundant slots with their quotas, then reroutes with locality and deterministic rounding.
// Everything is integer arithmetic, so the GPU planner (gpu_planner.h) reproduces it bit for bit.
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "rdep/balance/plan.h"
#include "rdep/core/ownership.h"
#include "rdep/status.h"

namespace rdep {

// Reroute rounding multiplies two row counts of one expert in int64: an expert's load must stay
// below this (3e9 rows per layer and step; real layers are far below).
constexpr int64_t kMaxExpertLoad = 3'000'000'000;

struct QuotaConfig {
  int32_t num_slots = 2;   // N_slot: redundant slots per rank (0 disables replication)
  int64_t min_quota = 1;   // u_min: a new replica must carry at least this many rows (>= 1)
  bool locality = true;    // a host's own rows consume its instance's quota first
  // The gain gate: a solved plan whose replicas lower the maximum rank load by fewer than min_gain rows
  // per replica is dropped (no replicas; the threshold stays the maximum rank load). A replica costs its
  // weight streaming (forward and backward) and its gradient reduction whatever it carries, so a plan
  // that moves few rows can cost more than it saves. 0 = off (every feasible plan is kept).
  int64_t min_gain = 0;

  // Rejects negative slots, more slots than experts, min_quota < 1, min_gain < 0.
  Status Validate(int32_t num_experts) const;
};
std::ostream& operator<<(std::ostream& os, const QuotaConfig& c);

// One accepted transfer of the greedy oracle: delta rows of expert e move from its main instance to a
// new replica on rank t, in redundant slot s of t. Transfers come in creation order.
struct QuotaTransfer {
  int32_t expert = 0;
  int32_t rank = 0;
  int32_t slot = 0;
  int64_t amount = 0;
};

// SolveReplication's result: the threshold and the transfers of the last feasible probe.
struct ReplicationResult {
  int64_t threshold = 0;        // tau*: every rank's post-balance load is <= tau*
  int32_t num_probes = 0;       // oracle calls made by the binary search
  std::vector<QuotaTransfer> transfers;
};

// Binary search on tau in [ceil(sum_r l_r / R), max_r l_r] with the greedy oracle. Ties are broken
// by lower rank / expert id: overloaded ranks by descending (load, -rank); their main experts by
// descending (load, -expert); the target is the admissible rank with the largest slack (lowest id on
// ties); admissible = positive slack, a free slot, no instance of the expert yet.
StatusOr<ReplicationResult> SolveReplication(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                             const QuotaConfig& config);

// Builds the plan's instance tables from transfers (main first, then replicas in transfer order).
// Leaves route empty.
StatusOr<BalancePlan> MaterializeReplication(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                             int32_t num_slots, const ReplicationResult& replication);

// SolveReroute: fills plan->route. Per expert: locality first (the host's own rows, up to its quota),
// then each source (ascending rank) splits its residual demand d over the residual quotas ru in
// proportion to them: with W_i the residual quota of instances 0..i-1 and D the residual total,
// instance i takes floor(d*W_{i+1}/D) - floor(d*W_i/D) (the floor or the ceiling of d*ru_i/D), and the
// residual quotas shrink by what it took. Preserves per-source demand and per-instance quota exactly;
// each W_i evolves on its own (W_i -= floor(d*W_i/D)), which is what lets the GPU run one chain per
// instance boundary.
Status SolveReroute(const std::vector<int64_t>& load, bool locality, BalancePlan* plan);

// The whole of Algorithm 1 on the host: SolveReplication, MaterializeReplication, SolveReroute.
StatusOr<BalancePlan> SolveQuotaPlan(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                     const QuotaConfig& config);

}  // namespace rdep
