// Owner-side capacity policy and the accepted route-row set (seeds 000 section 3.6, Appendix A).
//
// Dropless is the default (capacity_factor = 0). With a capacity factor c, expert e admits
//   C = ceil(c * W * T * K / E) rows,
// and the accepted set is the rule every backend implements identically:
//   an expert admits its candidate rows in ascending row_id order (source rank, then token, then slot)
//   until C rows are admitted; later rows are dropped.
// An owner realizes this from the per-source counts alone: source s gets
//   admitted[s][e] = clamp(C - sum_{s'<s} count[s'][e], 0, count[s][e])
// and admits its first admitted[s][e] rows for e in token order.
// Dropped slots get gate 0 and the token's surviving gates are rescaled to keep the token's gate sum:
//   g'_k = g_k * S / A  for accepted k, with S = sum_k g_k and A = sum_{accepted k} g_k
// (for gates that sum to 1 this is "renormalize over the accepted slots"); if A = 0 every g' is 0.
// The admission step, the renormalization and its backward are defined once, for host and device
// code, in rdep/core/capacity_rules.h; the functions below and the CUDA kernels call those.
#pragma once

#include <cstdint>
#include <vector>

#include "rdep/core/routing.h"
#include "rdep/core/shape.h"
#include "rdep/status.h"

namespace rdep {

struct CapacityPolicy {
  double capacity_factor = 0.0;  // 0 = dropless

  // Finite and >= 0.
  Status Validate() const;
  bool dropless() const { return capacity_factor == 0.0; }
  // Rows each expert admits; INT64_MAX when dropless.
  int64_t ExpertCapacity(const LayerShape& shape) const;
};

// admitted[s] for one expert, from the per-source candidate counts, under the rule above
// (SourceOrderAdmission).
void AdmitBySourceOrder(const int64_t* counts_by_src, int64_t num_src, int64_t capacity, int64_t* admitted_by_src);

// The accepted set of one rank: accepted[t*K+k] and the effective (renormalized) gates.
struct RankAcceptance {
  std::vector<uint8_t> accepted;     // [n*K] 1 = admitted
  std::vector<float> effective_gates;  // [n*K] g' (0 for dropped)
  int64_t dropped = 0;
};

// Host reference of the accepted set over the whole domain (what the protocol must reproduce).
StatusOr<std::vector<RankAcceptance>> ApplyCapacity(const LayerShape& shape, const Routing& routing,
                                                    const CapacityPolicy& policy);

// g' from g and the accepted mask for one token's K slots (the rule in the header comment;
// RenormalizeTokenGates).
void RenormalizeGates(const float* gates, const uint8_t* accepted, int64_t K, float* effective);

// Chain rule through RenormalizeGates: given dL/dg' for one token, returns dL/dg (double precision;
// RenormalizeTokenGatesBackward).
void RenormalizeGatesBackward(const float* gates, const uint8_t* accepted, int64_t K, const double* d_effective,
                              double* d_gates);

}  // namespace rdep
