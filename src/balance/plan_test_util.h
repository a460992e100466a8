// Test helper shared by the planner and layer tests: two balance plans equal field by field (each
// field's mismatch reported on its own, with `what`).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "rdep/balance/plan.h"

namespace rdep::test_util {

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
