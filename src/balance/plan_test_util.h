// Test helpers shared by the planner and layer tests: one synthetic load matrix, and two balance plans
// equal field by field (each field's mismatch reported on its own, with `what`).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "rdep/balance/load_trace.h"
#include "rdep/balance/plan.h"

namespace rdep::test_util {

// The load matrix [R][E] of one step of GenerateSyntheticLoads (power law alpha, T tokens per rank, top-K).
inline StatusOr<std::vector<int64_t>> SyntheticLoad(int32_t E, int32_t R, double alpha, uint64_t seed, int64_t tokens, int32_t topk) {
  SyntheticLoadSpec spec;
  spec.experts = E;
  spec.ranks = R;
  spec.alpha = alpha;
  spec.seed = seed;
  spec.tokens = tokens;
  spec.topk = topk;
  RDEP_ASSIGN_OR_RETURN(LoadTrace trace, GenerateSyntheticLoads(spec, 1));
  return std::move(trace.steps[0]);
}

inline void ExpectSamePlan(const BalancePlan& a, const BalancePlan& b, const std::string& what) {
  EXPECT_EQ(a.threshold, b.threshold) << what;
  EXPECT_EQ(a.instance_offsets, b.instance_offsets) << what;
  EXPECT_EQ(a.instance_expert, b.instance_expert) << what;
  EXPECT_EQ(a.instance_rank, b.instance_rank) << what;
  EXPECT_EQ(a.instance_slot, b.instance_slot) << what;
  EXPECT_EQ(a.instance_quota, b.instance_quota) << what;
  EXPECT_EQ(a.slot_expert, b.slot_expert) << what;
  EXPECT_EQ(a.route, b.route) << what;
}

}  // namespace rdep::test_util
