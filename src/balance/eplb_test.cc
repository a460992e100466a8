// EPLB baseline tests: slot budget, no duplicates, round-robin split, hierarchical packing.
#include "rdep/balance/eplb.h"

#include <gtest/gtest.h>

#include "rdep/balance/load_trace.h"

namespace rdep {
namespace {

TEST(Eplb, PlansSatisfyConstraints) {
  for (bool hier : {false, true}) {
    for (int32_t S : {0, 1, 2, 4}) {
      SyntheticLoadSpec spec;
      spec.experts = 64;
      spec.ranks = 16;
      spec.alpha = 1.2;
      spec.tokens = 512;
      spec.seed = 3;
      auto t = GenerateSyntheticLoads(spec, 2);
      ASSERT_TRUE(t.ok());
      auto own = OwnershipMap::Contiguous(64, 16);
      ASSERT_TRUE(own.ok());
      EplbConfig cfg;
      cfg.num_slots = S;
      cfg.hierarchical = hier;
      cfg.ranks_per_node = 4;
      auto exact = EplbExactPlan(t->steps[1], *own, cfg);
      ASSERT_TRUE(exact.ok()) << exact.status();
      EXPECT_TRUE(CheckPlan(*exact, t->steps[1], *own).ok()) << CheckPlan(*exact, t->steps[1], *own);
      EXPECT_EQ(exact->num_replicas(), 16 * S);  // EPLB spends the whole budget
      std::vector<double> hist(64, 0);
      for (size_t i = 0; i < t->steps[0].size(); ++i) hist[i % 64] += static_cast<double>(t->steps[0][i]);
      auto h = EplbPlan(hist, t->steps[1], *own, cfg);
      ASSERT_TRUE(h.ok());
      EXPECT_TRUE(CheckPlan(*h, t->steps[1], *own).ok());
    }
  }
}

TEST(Eplb, RoundRobinSplitsEvenly) {
  auto own = OwnershipMap::Contiguous(4, 4);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load(16, 0);
  load[0 * 4 + 0] = 7;  // expert 0: 7 + 6 = 13 rows
  load[1 * 4 + 0] = 6;
  EplbConfig cfg;
  cfg.num_slots = 1;
  auto p = EplbExactPlan(load, *own, cfg);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(CheckPlan(*p, load, *own).ok()) << CheckPlan(*p, load, *own);
  // Expert 0 gets the 3 free... every slot: 4 instances (main + 3 replicas; rank 0 hosts the main).
  EXPECT_EQ(p->instance_offsets[1] - p->instance_offsets[0], 4);
  for (int32_t i = 0; i < 4; ++i) EXPECT_EQ(p->instance_quota[static_cast<size_t>(i)], i == 0 ? 4 : 3);
}

TEST(Eplb, RejectsBadConfig) {
  auto own = OwnershipMap::Contiguous(8, 6);
  ASSERT_TRUE(own.ok());
  EplbConfig cfg;
  cfg.hierarchical = true;
  cfg.ranks_per_node = 4;  // does not divide 6
  EXPECT_EQ(EplbPlace(std::vector<double>(8, 1.0), *own, cfg).status().code(), StatusCode::kInvalidArgument);
  cfg.hierarchical = false;
  EXPECT_EQ(EplbPlace(std::vector<double>(7, 1.0), *own, cfg).status().code(), StatusCode::kInvalidArgument);
  cfg.num_slots = -1;
  EXPECT_EQ(EplbPlace(std::vector<double>(8, 1.0), *own, cfg).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdep
