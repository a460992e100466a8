// Route-health telemetry (seeds 000 Table 17): per-expert loads, CV, p10 rows per expert, active
// experts and router entropy, computed from a Routing (and, for the score entropy, router scores).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <span>
#include <vector>

#include "rdep/core/ownership.h"
#include "rdep/core/routing.h"
#include "rdep/status.h"

namespace rdep {

struct RoutingTelemetry {
  int64_t num_experts = 0;
  int64_t total_rows = 0;              // sum_e M_e (= W*T*K for a dropless routing)
  std::vector<int64_t> loads;          // [E] M_e, rows per expert over all ranks
  double mean_rows = 0;                // total_rows / E
  double cv = 0;                       // population stddev / mean of M_e (Table 17 prints it in %)
  double p10_rows = 0;                 // 10th percentile of M_e (linear interpolation)
  double p50_rows = 0;
  int64_t min_rows = 0, max_rows = 0;
  double max_over_mean = 0;            // hottest expert / mean (1 = perfectly balanced)
  int64_t active_experts = 0;          // experts with M_e > 0
  double load_entropy = 0;             // nats: -sum_e q_e ln q_e, q_e = M_e / total (ln E when uniform)
  std::optional<double> score_entropy; // nats: mean over tokens of -sum_e s_t,e ln s_t,e (needs scores)
  std::vector<int64_t> owner_loads;    // [W] L_q, when an ownership map was given
  double max_padding_ratio = 0;        // max_q rho_q (eq. 31) over owners, when an ownership map was given
};

// Telemetry of a routing over E experts. Fails on expert ids outside [0, E) (naming rank and slot).
StatusOr<RoutingTelemetry> ComputeTelemetry(const Routing& routing, int64_t num_experts);
// The same plus per-owner loads and the worst grouped-launch inflation rho_q under `ownership`.
StatusOr<RoutingTelemetry> ComputeTelemetry(const Routing& routing, const OwnershipMap& ownership);

// Mean per-token entropy (nats) of router scores [n, E]; each row is renormalized to sum 1 first (so
// sigmoid scores work too). Fails on negative or non-finite scores or a row that sums to 0.
StatusOr<double> MeanScoreEntropy(std::span<const double> scores, int64_t num_tokens, int64_t num_experts);

std::ostream& operator<<(std::ostream& os, const RoutingTelemetry& t);

}  // namespace rdep
