// Tests of the host UltraEP quota planner: constraints, never worse than no balancing, edge cases.
#include "rdep/balance/quota_planner.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "balance/plan_test_util.h"
#include "rdep/balance/load_trace.h"
#include "rdep/core/random.h"

namespace rdep {
namespace {

std::vector<int64_t> Synthetic(int32_t E, int32_t R, double alpha, uint64_t seed, int64_t tokens = 512) {
  auto load = test_util::SyntheticLoad(E, R, alpha, seed, tokens, std::min(8, E));
  EXPECT_TRUE(load.ok()) << load.status();
  return load.ok() ? *load : std::vector<int64_t>{};
}

int64_t MaxRankLoad(const BalancePlan& p) {
  auto l = p.RankLoads();
  return *std::max_element(l.begin(), l.end());
}

TEST(QuotaPlanner, ConstraintsHoldOverSeededGrid) {
  for (int32_t E : {16, 64, 128}) {
    for (int32_t R : {4, 8, 16}) {
      for (int32_t S : {0, 1, 2, 4}) {
        for (uint64_t seed : {1u, 2u, 3u}) {
          auto own = OwnershipMap::Contiguous(E, R);
          ASSERT_TRUE(own.ok());
          const auto load = Synthetic(E, R, 1.2, seed);
          QuotaConfig cfg;
          cfg.num_slots = S;
          cfg.min_quota = 8;
          auto plan = SolveQuotaPlan(load, *own, cfg);
          ASSERT_TRUE(plan.ok()) << plan.status();
          ASSERT_TRUE(CheckPlan(*plan, load, *own, cfg.min_quota).ok())
              << CheckPlan(*plan, load, *own, cfg.min_quota) << " E=" << E << " R=" << R << " S=" << S;
          auto none = NoBalancePlan(load, *own);
          ASSERT_TRUE(none.ok());
          EXPECT_LE(MaxRankLoad(*plan), MaxRankLoad(*none)) << "E=" << E << " R=" << R << " S=" << S;
          EXPECT_EQ(MaxRankLoad(*plan), plan->threshold);
          EXPECT_LE(plan->num_replicas(), R * S);
          if (S == 0) {
            EXPECT_EQ(plan->num_replicas(), 0);
          }
        }
      }
    }
  }
}

TEST(QuotaPlanner, UniformLoadNeedsNoReplicas) {
  auto own = OwnershipMap::Contiguous(64, 8);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load(8 * 64, 100);
  auto plan = SolveQuotaPlan(load, *own, QuotaConfig{});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->num_replicas(), 0);
  EXPECT_EQ(plan->threshold, 800 * 8);
  EXPECT_TRUE(CheckPlan(*plan, load, *own).ok());
}

TEST(QuotaPlanner, OneExpertHoldsAllLoad) {
  const int32_t E = 32, R = 8;
  auto own = OwnershipMap::Contiguous(E, R);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load(R * E, 0);
  for (int32_t r = 0; r < R; ++r) load[static_cast<size_t>(r * E + 5)] = 1000;
  QuotaConfig cfg;
  cfg.num_slots = 1;
  auto plan = SolveQuotaPlan(load, *own, cfg);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(CheckPlan(*plan, load, *own, cfg.min_quota).ok()) << CheckPlan(*plan, load, *own, cfg.min_quota);
  // Expert 5 spreads over all 8 ranks: 8000 rows, 1000 each.
  EXPECT_EQ(plan->num_replicas(), R - 1);
  EXPECT_EQ(plan->threshold, 1000);
  // Locality: every rank computes exactly its own rows, nothing is in flight.
  EXPECT_EQ(ComputeMetrics(*plan).inflight_ratio, 0.0);
}

TEST(QuotaPlanner, SingleRankIsTrivial) {
  auto own = OwnershipMap::Contiguous(8, 1);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load{5, 0, 3, 9, 1, 1, 0, 2};
  auto plan = SolveQuotaPlan(load, *own, QuotaConfig{});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->num_replicas(), 0);
  EXPECT_EQ(plan->threshold, 21);
  EXPECT_TRUE(CheckPlan(*plan, load, *own).ok());
}

TEST(QuotaPlanner, AllZeroLoad) {
  auto own = OwnershipMap::Contiguous(16, 4);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load(64, 0);
  auto plan = SolveQuotaPlan(load, *own, QuotaConfig{});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->num_replicas(), 0);
  EXPECT_DOUBLE_EQ(ComputeMetrics(*plan).imbalance, 1.0);
}

TEST(QuotaPlanner, NonUniformOwnership) {
  // E = 20 over R = 12: 8 ranks own 2 experts, 4 own 1; and E < R: some ranks own none.
  for (auto [E, R] : {std::pair{20, 12}, std::pair{6, 10}, std::pair{128, 72}}) {
    auto own = OwnershipMap::Contiguous(E, R);
    ASSERT_TRUE(own.ok());
    const auto load = Synthetic(E, R, 1.0, 7, 256);
    QuotaConfig cfg;
    cfg.num_slots = 2;
    auto plan = SolveQuotaPlan(load, *own, cfg);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(CheckPlan(*plan, load, *own, cfg.min_quota).ok()) << CheckPlan(*plan, load, *own, cfg.min_quota);
    auto none = NoBalancePlan(load, *own);
    EXPECT_LT(MaxRankLoad(*plan), MaxRankLoad(*none)) << "E=" << E << " R=" << R;
  }
}

TEST(QuotaPlanner, MinQuotaRespected) {
  auto own = OwnershipMap::Contiguous(64, 16);
  ASSERT_TRUE(own.ok());
  const auto load = Synthetic(64, 16, 1.2, 11);
  for (int64_t umin : {1, 50, 500, 5000}) {
    QuotaConfig cfg;
    cfg.min_quota = umin;
    auto plan = SolveQuotaPlan(load, *own, cfg);
    ASSERT_TRUE(plan.ok());
    EXPECT_TRUE(CheckPlan(*plan, load, *own, umin).ok()) << CheckPlan(*plan, load, *own, umin);
  }
}

// The gain gate: a plan whose replicas take fewer than min_gain rows each off the busiest rank is
// dropped (every row stays on its owner, the threshold is the maximum rank load); at exactly
// min_gain rows each it is kept. Negative min_gain is refused.
TEST(QuotaPlanner, GainGateDropsPlansThatMoveTooFewRowsPerReplica) {
  auto own = OwnershipMap::Contiguous(64, 16);
  ASSERT_TRUE(own.ok());
  const auto load = Synthetic(64, 16, 1.2, 11);
  auto none = NoBalancePlan(load, *own);
  ASSERT_TRUE(none.ok());
  const int64_t max0 = MaxRankLoad(*none);
  QuotaConfig cfg;
  auto open = SolveQuotaPlan(load, *own, cfg);
  ASSERT_TRUE(open.ok()) << open.status();
  const int64_t n = open->num_replicas(), gain = max0 - open->threshold;
  ASSERT_GT(n, 0);
  ASSERT_GT(gain, n) << "the skewed load must be worth more than one row per replica";
  cfg.min_gain = gain / n;  // the edge: kept
  auto kept = SolveQuotaPlan(load, *own, cfg);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->num_replicas(), n);
  EXPECT_EQ(kept->threshold, open->threshold);
  EXPECT_EQ(MaxRankLoad(*kept), MaxRankLoad(*open));
  cfg.min_gain = gain / n + 1;  // past it: dropped
  auto dropped = SolveQuotaPlan(load, *own, cfg);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->num_replicas(), 0);
  EXPECT_EQ(dropped->threshold, max0);
  EXPECT_EQ(MaxRankLoad(*dropped), max0);
  EXPECT_TRUE(CheckPlan(*dropped, load, *own, cfg.min_quota).ok()) << CheckPlan(*dropped, load, *own, cfg.min_quota);
  cfg.min_gain = INT64_MAX;  // "never": no overflow turns it into "always"
  auto never = SolveQuotaPlan(load, *own, cfg);
  ASSERT_TRUE(never.ok()) << never.status();
  EXPECT_EQ(never->num_replicas(), 0);
  cfg.min_gain = -1;
  auto bad = SolveQuotaPlan(load, *own, cfg);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("min_gain"), std::string::npos) << bad.status();
}

TEST(QuotaPlanner, TokensAssignedExactlyOnce) {
  const int32_t E = 16, R = 4, K = 2;
  auto own = OwnershipMap::Contiguous(E, R);
  ASSERT_TRUE(own.ok());
  LayerShape shape{64, 8, 8, E, K, R};
  auto spec = RoutingSpec::Parse("zipf:1.5");
  ASSERT_TRUE(spec.ok());
  auto routing = GenerateRouting(shape, *spec);
  ASSERT_TRUE(routing.ok());
  const auto load = LoadMatrix(*routing, E);
  QuotaConfig cfg;
  cfg.num_slots = 2;
  auto plan = SolveQuotaPlan(load, *own, cfg);
  ASSERT_TRUE(plan.ok());
  ASSERT_GT(plan->num_replicas(), 0);
  std::vector<int64_t> received(static_cast<size_t>(plan->num_instances()), 0);
  for (int32_t r = 0; r < R; ++r) {
    auto a = AssignTokens(*plan, r, (*routing)[static_cast<size_t>(r)].experts);
    ASSERT_TRUE(a.ok()) << a.status();
    const auto& ex = (*routing)[static_cast<size_t>(r)].experts;
    for (size_t k = 0; k < ex.size(); ++k) {
      const int32_t i = (*a)[k];
      ASSERT_GE(i, 0);
      EXPECT_EQ(plan->instance_expert[static_cast<size_t>(i)], ex[k]);  // same logical expert
      received[static_cast<size_t>(i)]++;
    }
  }
  for (int32_t i = 0; i < plan->num_instances(); ++i)
    EXPECT_EQ(received[static_cast<size_t>(i)], plan->instance_quota[static_cast<size_t>(i)]);
}

// The reroute's rounding: with locality off, each source (ascending rank) gives every instance the
// floor or the ceiling of its proportional share d * ru_i / D of the residual quotas, the shares sum to
// its demand, and what is left afterwards is exactly zero.
TEST(QuotaPlanner, RerouteSharesAreProportionalWithinOneRow) {
  for (uint64_t seed : {1u, 2u, 3u, 4u}) {
    const int32_t E = 64, R = 16;
    auto own = OwnershipMap::Contiguous(E, R);
    ASSERT_TRUE(own.ok());
    const auto load = Synthetic(E, R, 1.4, seed, 2048);
    QuotaConfig cfg;
    cfg.num_slots = 2;
    cfg.locality = false;
    auto plan = SolveQuotaPlan(load, *own, cfg);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const int32_t n = plan->num_instances();
    int checked = 0;
    for (int32_t e = 0; e < E; ++e) {
      const int32_t b = plan->instance_offsets[static_cast<size_t>(e)];
      const int32_t k = plan->instance_offsets[static_cast<size_t>(e) + 1] - b;
      if (k == 1) continue;
      std::vector<int64_t> ru(static_cast<size_t>(k));
      int64_t D = 0;
      for (int32_t i = 0; i < k; ++i) D += ru[static_cast<size_t>(i)] = plan->instance_quota[static_cast<size_t>(b + i)];
      for (int32_t r = 0; r < R; ++r) {
        const int64_t d = load[static_cast<size_t>(r) * E + static_cast<size_t>(e)];
        int64_t sum = 0;
        for (int32_t i = 0; i < k; ++i) {
          const int64_t take = plan->route[static_cast<size_t>(r) * static_cast<size_t>(n) + static_cast<size_t>(b + i)];
          const int64_t lo = D > 0 ? d * ru[static_cast<size_t>(i)] / D : 0;
          const bool exact = D > 0 && d * ru[static_cast<size_t>(i)] % D == 0;
          EXPECT_TRUE(take == lo || (!exact && take == lo + 1))
              << "seed " << seed << " expert " << e << " source " << r << " instance " << i << ": took " << take
              << ", proportional share " << d << "*" << ru[static_cast<size_t>(i)] << "/" << D;
          ru[static_cast<size_t>(i)] -= take;
          sum += take;
          ++checked;
        }
        EXPECT_EQ(sum, d);
        D -= d;
      }
      for (int64_t left : ru) EXPECT_EQ(left, 0) << "expert " << e;
    }
    EXPECT_GT(checked, 100) << "seed " << seed;
  }
}

TEST(QuotaPlanner, CumulativeQuotaLookup) {
  // Expert 0 (main on rank 0) with a replica on rank 1; source 1 sends 5 rows split 2 / 3.
  BalancePlan p;
  p.num_experts = 2;
  p.num_ranks = 2;
  p.num_slots = 1;
  p.instance_offsets = {0, 2, 3};
  p.instance_expert = {0, 0, 1};
  p.instance_rank = {0, 1, 1};
  p.instance_slot = {-1, 0, -1};
  p.instance_quota = {2, 3, 0};
  p.slot_expert = {-1, 0};
  p.route = {0, 0, 0, /*src 1*/ 2, 3, 0};
  EXPECT_EQ(InstanceForRow(p, 1, 0, 0), 0);
  EXPECT_EQ(InstanceForRow(p, 1, 0, 1), 0);
  EXPECT_EQ(InstanceForRow(p, 1, 0, 2), 1);
  EXPECT_EQ(InstanceForRow(p, 1, 0, 4), 1);
  EXPECT_EQ(InstanceForRow(p, 1, 0, 5), -1);
}

TEST(QuotaPlanner, RejectsInvalidInput) {
  auto own = OwnershipMap::Contiguous(8, 2);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load(16, 1);
  QuotaConfig cfg;
  cfg.num_slots = -1;
  EXPECT_EQ(SolveQuotaPlan(load, *own, cfg).status().code(), StatusCode::kInvalidArgument);
  cfg.num_slots = 9;
  EXPECT_EQ(SolveQuotaPlan(load, *own, cfg).status().code(), StatusCode::kInvalidArgument);
  cfg.num_slots = 2;
  cfg.min_quota = 0;
  EXPECT_EQ(SolveQuotaPlan(load, *own, cfg).status().code(), StatusCode::kInvalidArgument);
  cfg.min_quota = 1;
  std::vector<int64_t> wrong(15, 1);
  auto st = SolveQuotaPlan(wrong, *own, cfg).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("R*E"), std::string::npos) << st;
  load[3] = -1;
  EXPECT_EQ(SolveQuotaPlan(load, *own, cfg).status().code(), StatusCode::kInvalidArgument);
}

TEST(QuotaPlanner, ReachesNearBalanceOnSkewedLoad) {
  auto own = OwnershipMap::Contiguous(256, 64);
  ASSERT_TRUE(own.ok());
  const auto load = Synthetic(256, 64, 1.0, 5, 4096);
  QuotaConfig cfg;
  cfg.num_slots = 2;
  auto plan = SolveQuotaPlan(load, *own, cfg);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(CheckPlan(*plan, load, *own).ok());
  const auto m = ComputeMetrics(*plan);
  const auto m0 = ComputeMetrics(*NoBalancePlan(load, *own));
  EXPECT_GT(m0.imbalance, 1.3);
  EXPECT_LT(m.imbalance, 1.05) << m;
}

}  // namespace
}  // namespace rdep
