// Balancing as a layer option (issue 16): which balancer a layer runs after phase 1, with its
// parameters, and the one function every rank calls on the same admitted load matrix to get the same
// plan. The layer then reroutes accepted rows to physical instances (main expert or a replica in a
// redundant slot) with InstanceForRow (rdep/balance/plan.h).
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "rdep/balance/plan.h"
#include "rdep/core/ownership.h"
#include "rdep/status.h"

namespace rdep {

enum class BalanceKind : int32_t {
  kOff = 0,    // no replicas: every row goes to its expert's owner
  kUltraEp,    // UltraEP quota planner on the exact load (seeds 001 Algorithm 1), locality on
  kEplb,       // EPLB baseline: placement from the previous forward's load of the layer, round-robin reroute
  kEplbExact,  // EPLB++ baseline: placement from the exact current load, round-robin reroute
};

const char* BalanceKindName(BalanceKind kind);  // "off", "ultraep", "eplb", "eplb-exact"
// Parses a name of BalanceKindName; an unknown name is InvalidArgument listing the valid ones.
StatusOr<BalanceKind> ParseBalanceKind(std::string_view name);

struct BalanceConfig {
  BalanceKind kind = BalanceKind::kOff;
  int32_t num_slots = 2;  // N_slot: redundant slots per rank
  int64_t min_quota = 1;  // u_min (UltraEP): a replica carries at least this many rows
  int32_t relay_above = 4;  // experts with more replicas than this stream through chunk relays (0: never)
  // UltraEP's gain gate (QuotaConfig::min_gain): no replicas unless they lower the maximum rank load by at
  // least this many rows each; 0 = off. Measured at the Moonlight shape on 2x H200 (docs/perf-notes.md,
  // 2026-11-28 third session): one replica costs about as much as ~2,900 rows of expert compute.
  int64_t min_gain = 0;

  bool enabled() const { return kind != BalanceKind::kOff; }
  // With balancing on: 0 <= N_slot <= E, u_min >= 1, min_gain >= 0 (and 0 unless ultraep). Names the field.
  Status Validate(int32_t num_experts) const;
};
std::ostream& operator<<(std::ostream& os, const BalanceConfig& c);

// The plan of `config` for the admitted load matrix [W][E] (rows each source sends to each expert
// after the capacity rule). `history` (EPLB only: per-expert loads of an earlier step; empty = use the
// current load) feeds the placement. Deterministic: every rank that calls it with the same inputs gets
// the same plan. kOff gives NoBalancePlan.
StatusOr<BalancePlan> SolveLayerPlan(const BalanceConfig& config, const std::vector<int64_t>& admitted_load,
                                     const OwnershipMap& owners, const std::vector<double>& history);

// The capacity rule on a load matrix [W][E] (rows each source routes to each expert): per expert, the
// rows admitted from each source in source order (rdep::AdmitBySourceOrder), what the owners' phase 2
// would decide from the same counts. The load every balanced layer plans for.
std::vector<int64_t> AdmitLoadMatrix(const std::vector<int64_t>& load, int64_t W, int64_t E, int64_t capacity);

// What balancing did for one forward (identical on every rank).
struct BalanceTelemetry {
  double imbalance_before = 1.0;  // max owner load / mean (admitted rows), without replicas
  double imbalance_after = 1.0;   // max rank load / mean with the plan's instances
  int32_t replicas = 0;           // replicas made (redundant slots used)
  int32_t slots = 0;             // redundant slots in all (W * N_slot)
  bool slot_limited = false;      // every slot is used and the ranks are still not level: rows that
                                  // would have gone to another replica stay on their main instance
  int64_t weight_bytes = 0;       // expert weight bytes streamed to replicas by one forward
  int32_t relayed_experts = 0;    // experts streamed through chunk relays (set by the layer)
};
BalanceTelemetry ComputeBalanceTelemetry(const BalancePlan& plan, const std::vector<int64_t>& admitted_load,
                                         const OwnershipMap& owners, int64_t bytes_per_expert);

}  // namespace rdep

namespace rdep {

// Two-stage chunk relays for wide experts (seeds 001 section 6): an expert with more than
// `relay_above` replicas (counting those with a quota: idle ones receive nothing) is split into m = round(sqrt(replicas)) chunks; in stage 1 its owner sends
// chunk c only to relay c (one of its replicas), in stage 2 every relay sends its chunk to the
// expert's other replicas. The owner then sends one copy instead of R, each relay about R/m chunks.
// Relays are chosen greedily by the ranks' sending load (widest experts first; lowest load, then
// lowest rank), the same on every rank. Chunk c of m covers bytes [Chunk(c), Chunk(c+1)) of the
// expert's weights, cut on 16-byte boundaries.
struct ExpertRelays {
  int32_t expert = 0;
  std::vector<int32_t> relays;  // plan instance indices (replicas), relays[c] receives chunk c
};
struct RelayPlan {
  std::vector<ExpertRelays> experts;  // only the relayed ones, ascending expert id
  bool empty() const { return experts.empty(); }
  static int64_t ChunkBegin(int64_t bytes, int64_t chunks, int64_t c) { return (bytes * c / chunks) / 16 * 16; }
};
// relay_above <= 0: no relays. The rule itself is ComputeRelays (rdep/balance/relay_rule.h), which the
// CUDA layer runs on the device (LaunchPlanRelays): both layers relay through the same replicas.
RelayPlan PlanRelays(const BalancePlan& plan, int32_t relay_above);

}  // namespace rdep
