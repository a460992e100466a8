// The validation matrix's view of balancing (internal to the testing library): where each accepted
// row must be computed, and the exactness of a balanced run against the same layer without balancing.
#pragma once

#include <cstdint>
#include <vector>

#include "rdep/testing/validation.h"

namespace rdep {

// Where the sentinel run must compute every accepted row: the owner and lambda(e) without balancing;
// with it, the instance that the balancer's plan, solved here from the routing's admitted load
// (the reference's accepted set), gives the row by cumulative quota.
struct RowPlacement {
  std::vector<std::vector<int32_t>> rank, local;  // [W][n*K]; -1 for a dropped row
  std::vector<std::vector<int32_t>> expert_at;    // [W][physical local index] logical expert (-1: unused slot)
};
StatusOr<RowPlacement> ExpectedPlacement(const LayerConfig& cfg, const OwnershipMap& own, const Routing& routing,
                                         const std::vector<RankAcceptance>& reference);

// A balanced run against the balancing-off run on the same inputs. rel_l2 = 0 (fp32 backends): y, dx,
// dgates bitwise; weight gradients bitwise for experts without replicas and within 1e-5 relative for
// replicated experts (their rows are summed in two parts, so fp32 rounding may differ). rel_l2 > 0
// (bf16 backends: a replica's rows are a GEMM of their own, whose bf16 outputs may round differently):
// y, dx, dgates each within ||on - off|| / ||off|| <= rel_l2, and every expert's dW1 and dW2 too
// (bitwise zero where the run without balancing has zero); the detail says which were bitwise equal.
// yx_rel_l2 > 0 with rel_l2 = 0 (fp32 with LayerConfig::owner_reduce, whose per-rank sums replicas
// reassociate): y and dx within that relative L2 instead of bitwise, dgates and dW as for rel_l2 = 0.
CheckResult BalancingExactness(const LayerRun& on, const LayerRun& off, const LayerShape& shape, double rel_l2 = 0,
                               double yx_rel_l2 = 0);

// The node of every expert's owner (N nodes of W/N consecutive ranks).
std::vector<int32_t> NodeOfExpert(const OwnershipMap& own, const LayerConfig& cfg);
// Every rank's measured two-phase traffic (rows and bytes per phase) against rdep model's prediction
// for the same routing: equal integers, else the first differing rank, phase and count.
CheckResult TwoPhaseTrafficCheck(const std::vector<NodeTraffic>& measured, const std::vector<model::RankPhaseTraffic>& predicted);
// A two-phase run against the one-domain run on the same inputs: dgates and weight gradients
// bitwise, y and dx within value_tol of their largest value (a relay sums a token's rows on its node
// first; 1e-5 for fp32 outputs, one bf16 rounding for bf16 ones),
// and the inter-node rows the ranks sent (and the relays sent back) equal to the routing's count.
CheckResult NodeAgreement(const LayerRun& two, const LayerRun& one, int64_t expected_inter_rows, double value_tol = 1e-5);

}  // namespace rdep
