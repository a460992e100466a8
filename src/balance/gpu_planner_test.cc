// GPU planner vs host planner: bitwise-equal plans over many seeded load matrices. Skips (with the
// reason) when the build has no CUDA or no device is present.
#include "rdep/balance/gpu_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

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
  // Not staged (an entry above int32) with a hot expert below 2^25 rows: its reroute reads the residual
  // demand from the global copy on the 32-bit chain, next to the int64 chain of the big expert.
  std::vector<int64_t> big2 = big;
  for (int r = 0; r < 8; ++r) big2[static_cast<size_t>(r * 32 + 12)] = 50000 + 17 * r;
  loads.push_back(big2);
  for (const auto& load : loads) {
    QuotaConfig cfg;
    cfg.num_slots = 2;
    auto host = SolveQuotaPlan(load, *own, cfg);
    auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
    ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
    ExpectSamePlan(*gpu, *host, "edge");
  }
}

// One expert hot on every rank of 64 gets more than 32 instances: the reroute's one-thread fallback
// (the warp path takes at most 32), with the register-resident probe (R <= 64).
TEST(GpuPlanner, MatchesHostWithMoreThan32Instances) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  auto own = OwnershipMap::Contiguous(32, 64);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load(64 * 32, 0);
  for (int r = 0; r < 64; ++r) {
    load[static_cast<size_t>(r * 32 + 3)] = 5000 + 7 * r;
    load[static_cast<size_t>(r * 32 + (r % 32))] += 10 + r;
  }
  for (int64_t umin : {int64_t{1}, int64_t{50}}) {
    QuotaConfig cfg;
    cfg.num_slots = 2;
    cfg.min_quota = umin;
    auto host = SolveQuotaPlan(load, *own, cfg);
    auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
    ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
    EXPECT_GT(host->instance_offsets[4] - host->instance_offsets[3], 32);
    ExpectSamePlan(*gpu, *host, "hot expert, u_min=" + std::to_string(umin));
  }
}

// The benchmark's shape (rdep plan bench defaults: E=256, R=64, N_slot=2, alpha=1, T=4096, K=8,
// u_min = 1% of the mean rank load): equal plans, and the per-phase cycle split of the kernel.
TEST(GpuPlanner, MatchesHostAtBenchShapeAndReportsPhases) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  SyntheticLoadSpec spec;
  spec.experts = 256;
  spec.ranks = 64;
  spec.alpha = 1.0;
  spec.tokens = 4096;
  spec.topk = 8;
  spec.seed = 1;
  auto trace = GenerateSyntheticLoads(spec, 4);
  ASSERT_TRUE(trace.ok()) << trace.status();
  auto own = OwnershipMap::Contiguous(256, 64);
  ASSERT_TRUE(own.ok());
  QuotaConfig cfg;
  cfg.num_slots = 2;
  cfg.min_quota = static_cast<int64_t>(std::floor(0.01 * 4096 * 8));
  for (size_t step = 0; step < trace->steps.size(); ++step) {
    const auto& load = trace->steps[step];
    auto host = SolveQuotaPlan(load, *own, cfg);
    auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
    ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
    ExpectSamePlan(*gpu, *host, "bench shape, step " + std::to_string(step));
    auto t = BenchQuotaPlanGpu(load, *own, cfg, 5, 50);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->phase_cycles.size(), 7u);
    int multi = 0, max_inst = 0;
    for (int32_t e = 0; e < host->num_experts; ++e) {
      const int k = host->instance_offsets[static_cast<size_t>(e) + 1] - host->instance_offsets[static_cast<size_t>(e)];
      multi += k > 1 ? 1 : 0;
      max_inst = std::max(max_inst, k);
    }
    std::printf("step %zu: p50 %.1f us, %d probe threads (%d probe warps if the warp search runs); cycles setup %.0f, search %.0f, record %.0f, tables+reroute %.0f "
                "(prep %.0f, replicated %.0f, tables+single %.0f; %d replicated experts, <= %d instances) (clock %.0f MHz)\n",
                step, t->solve_us.p50, t->config.probe_threads, t->config.probe_warps, t->phase_cycles[0], t->phase_cycles[1], t->phase_cycles[2],
                t->phase_cycles[3], t->phase_cycles[4], t->phase_cycles[5], t->phase_cycles[6], multi, max_inst,
                t->clock_mhz);
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
