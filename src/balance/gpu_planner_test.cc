// GPU planner vs host planner: bitwise-equal plans over many seeded load matrices. Skips (with the
// reason) when the build has no CUDA or no device is present.
#include "rdep/balance/gpu_planner.h"

#include <gtest/gtest.h>

#include "rdep/balance/load_trace.h"

namespace rdep {
namespace {

void ExpectSamePlan(const BalancePlan& g, const BalancePlan& h, const std::string& what) {
  EXPECT_EQ(g.threshold, h.threshold) << what;
  EXPECT_EQ(g.instance_offsets, h.instance_offsets) << what;
  EXPECT_EQ(g.instance_expert, h.instance_expert) << what;
  EXPECT_EQ(g.instance_rank, h.instance_rank) << what;
  EXPECT_EQ(g.instance_slot, h.instance_slot) << what;
  EXPECT_EQ(g.instance_quota, h.instance_quota) << what;
  EXPECT_EQ(g.slot_expert, h.slot_expert) << what;
  EXPECT_EQ(g.route, h.route) << what;
}

TEST(GpuPlanner, MatchesHostOverSeededLoads) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  int cases = 0;
  struct Shape {
    int32_t E, R;
  };
  for (Shape sh : {Shape{256, 64}, Shape{128, 64}, Shape{64, 8}, Shape{160, 40}, Shape{128, 72}, Shape{16, 32},
                   Shape{256, 32}, Shape{8, 1}}) {
    for (int32_t S : {0, 1, 2, 4}) {
      if (S > sh.E) continue;
      for (double alpha : {0.6, 1.0, 1.4}) {
        for (uint64_t seed = 1; seed <= 4; ++seed) {
          SyntheticLoadSpec spec;
          spec.experts = sh.E;
          spec.ranks = sh.R;
          spec.alpha = alpha;
          spec.seed = seed * 7919 + static_cast<uint64_t>(S);
          spec.tokens = 1024;
          spec.topk = std::min(8, sh.E);
          auto trace = GenerateSyntheticLoads(spec, 1);
          ASSERT_TRUE(trace.ok()) << trace.status();
          const auto& load = trace->steps[0];
          auto own = OwnershipMap::Contiguous(sh.E, sh.R);
          ASSERT_TRUE(own.ok());
          for (bool locality : {true, false}) {
            QuotaConfig cfg;
            cfg.num_slots = S;
            cfg.min_quota = seed == 4 ? 64 : 1;
            cfg.locality = locality;
            auto host = SolveQuotaPlan(load, *own, cfg);
            ASSERT_TRUE(host.ok()) << host.status();
            auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
            ASSERT_TRUE(gpu.ok()) << gpu.status();
            const std::string what = "E=" + std::to_string(sh.E) + " R=" + std::to_string(sh.R) +
                                     " S=" + std::to_string(S) + " alpha=" + std::to_string(alpha) +
                                     " seed=" + std::to_string(seed) + " locality=" + std::to_string(locality);
            ExpectSamePlan(*gpu, *host, what);
            EXPECT_TRUE(CheckPlan(*gpu, load, *own, cfg.min_quota).ok()) << what;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 300);
}

TEST(GpuPlanner, MatchesHostOnEdgeCases) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  auto own = OwnershipMap::Contiguous(32, 8);
  ASSERT_TRUE(own.ok());
  std::vector<std::vector<int64_t>> loads;
  loads.emplace_back(8 * 32, 0);    // no load
  loads.emplace_back(8 * 32, 100);  // uniform
  std::vector<int64_t> one(8 * 32, 0);
  for (int r = 0; r < 8; ++r) one[static_cast<size_t>(r * 32 + 3)] = 1000 + r;
  loads.push_back(one);  // one expert holds all load
  std::vector<int64_t> big(8 * 32, 1000);
  big[5] = (int64_t{1} << 31) + 5;  // an entry above int32: the kernel reads the load from global memory
  loads.push_back(big);
  for (const auto& load : loads) {
    QuotaConfig cfg;
    cfg.num_slots = 2;
    auto host = SolveQuotaPlan(load, *own, cfg);
    auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
    ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
    ExpectSamePlan(*gpu, *host, "edge");
  }
}

TEST(GpuPlanner, ReportsUnavailableOrRejectsBadInput) {
  auto own = OwnershipMap::Contiguous(8, 2);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> wrong(15, 1);
  auto r = SolveQuotaPlanGpu(wrong, *own, QuotaConfig{});
  EXPECT_FALSE(r.ok());
  std::string why;
  if (!GpuPlannerAvailable(&why)) {
    EXPECT_FALSE(why.empty());
    std::vector<int64_t> load(16, 1);
    auto u = SolveQuotaPlanGpu(load, *own, QuotaConfig{});
    EXPECT_EQ(u.status().code(), StatusCode::kUnavailable) << u.status();
  }
}

}  // namespace
}  // namespace rdep
