// The balancer simulation behind `rdep plan sim`: runs every planner on the same load matrices (a
// seeded synthetic grid over (E, R, N_slot, alpha), or a recorded load trace) and reports seeds 001
// Table 4's metrics per planner: post-balance imbalance (max/mean rank load), host solve time,
// redundant slots used sum_e(|H(e)|-1), max_e |H(e)|, and the in-flight token ratio.
// Planners: none | ultraep | eplb (historical load, global) | eplb-hier (historical, hierarchical)
//           | eplb++ (EPLB placement from the exact load, round-robin reroute).
// EPLB's history is the mean load of the previous `history` steps; step 0 of each sequence only
// seeds the history and is not scored.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "rdep/balance/load_trace.h"
#include "rdep/status.h"

namespace rdep {

struct SimConfig {
  std::vector<int32_t> experts{128, 256};
  std::vector<int32_t> ranks{32, 64};
  std::vector<int32_t> slots{1, 2, 4};
  std::vector<double> alphas{0.6, 1.0, 1.4};
  int32_t steps = 8;            // per grid point (the first only seeds EPLB's history)
  int64_t tokens = 4096;        // per rank and step
  int32_t topk = 8;
  double umin_frac = 0.01;      // u_min = max(1, floor(umin_frac * mean rank load))
  int64_t min_gain = 0;         // UltraEP's gain gate (QuotaConfig::min_gain), rows per replica; 0 = off
  int32_t history = 4;          // EPLB's window of past steps
  int32_t ranks_per_node = 8;   // hierarchical EPLB's node size
  uint64_t seed = 1;
  bool check = true;            // verify every plan with CheckPlan
};

struct SimRecord {  // one planner on one load matrix
  std::string planner;
  int32_t experts = 0, ranks = 0, slots = 0;
  double alpha = 0;  // NaN for traces
  int32_t step = 0;
  double imbalance = 0, solve_us = 0, inflight = 0;
  int32_t replicas = 0, max_hosts = 0;
};

struct SimReport {
  std::vector<std::string> planners;
  std::vector<SimRecord> records;
  std::string source;  // "synthetic grid" or the trace path
};

std::vector<std::string> SimPlanners();
StatusOr<SimReport> RunSyntheticSim(const SimConfig& config);
// A recorded trace at one N_slot (uses config.umin_frac, history, ranks_per_node, check).
StatusOr<SimReport> RunTraceSim(const LoadTrace& trace, int32_t num_slots, const SimConfig& config,
                                const std::string& source);

// Per planner over all records: mean/p50/p99/max imbalance and the means of the other metrics.
void PrintSimTable(const SimReport& report, std::ostream& os);
Status WriteSimJson(const SimReport& report, const std::string& path);
Status WriteSimPng(const SimReport& report, const std::string& path);

}  // namespace rdep
