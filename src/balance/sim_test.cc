// Simulation and load-trace tests: the trace format round-trips, the sim scores every planner and
// UltraEP is never worse than no balancing on any load matrix.
#include "rdep/balance/sim.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>

namespace rdep {
namespace {

TEST(PlanSim, TraceRoundTrips) {
  LayerShape shape{64, 8, 8, 16, 2, 4};
  auto spec = RoutingSpec::Parse("zipf:1.2");
  ASSERT_TRUE(spec.ok());
  auto t = RecordRoutingLoads(shape, *spec, 3);
  ASSERT_TRUE(t.ok()) << t.status();
  int64_t total = 0;
  for (int64_t v : t->steps[0]) total += v;
  EXPECT_EQ(total, 4 * 64 * 2);
  const std::string path = ::testing::TempDir() + "/rdep_trace_test.txt";
  ASSERT_TRUE(WriteLoadTrace(*t, path).ok());
  auto back = ReadLoadTrace(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->num_experts, 16);
  EXPECT_EQ(back->num_ranks, 4);
  EXPECT_EQ(back->steps, t->steps);
  {
    std::ofstream f(path);
    f << "rdep-load-trace v1 experts=2 ranks=1 steps=1\nstep 0\n1,x\n";
  }
  auto bad = ReadLoadTrace(path);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(":3:"), std::string::npos) << bad.status();
  std::remove(path.c_str());
}

TEST(PlanSim, TraceHeaderBoundsWhatIsRead) {
  const std::string path = ::testing::TempDir() + "/rdep_trace_header_test.txt";
  {
    std::ofstream f(path);
    f << "# a comment\nrdep-load-trace v1 experts=2000000000 ranks=2000000000 steps=2\nstep 0\n1\n";
  }
  auto h = ReadLoadTraceHeader(path);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->num_experts, 2000000000);
  EXPECT_EQ(h->num_ranks, 2000000000);
  EXPECT_EQ(h->num_steps, 2);
  EXPECT_DOUBLE_EQ(h->bytes(), 8.0 * 2 * 2e9 * 2e9);
  auto t = ReadLoadTrace(path, 1e9);  // refused from the header, nothing allocated
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find(":2: header says 2 steps of 2000000000 x 2000000000"), std::string::npos) << t.status();
  {
    std::ofstream f(path);
    f << "rdep-load-trace v1 experts=1 ranks=1 steps=1\nstep 0\n5\nstep 1\n6\n";
  }
  auto more = ReadLoadTrace(path);
  ASSERT_FALSE(more.ok());
  EXPECT_NE(more.status().message().find("more steps than the header's 1"), std::string::npos) << more.status();
  {
    std::ofstream f(path);
    f << "rdep-load-trace v1 experts=4294967297 ranks=1 steps=1\n";
  }
  auto wide = ReadLoadTraceHeader(path);
  ASSERT_FALSE(wide.ok());
  EXPECT_NE(wide.status().message().find("int32"), std::string::npos) << wide.status();
  std::remove(path.c_str());
}

TEST(PlanSim, SyntheticGridScoresAllPlanners) {
  SimConfig cfg;
  cfg.experts = {32};
  cfg.ranks = {8};
  cfg.slots = {0, 2};
  cfg.alphas = {1.0};
  cfg.steps = 3;
  cfg.tokens = 256;
  auto rep = RunSyntheticSim(cfg);
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_EQ(rep->records.size(), 2u * 2u * SimPlanners().size());
  std::map<std::pair<int, int>, double> none;  // (slots, step) -> imbalance without balancing
  for (const auto& r : rep->records)
    if (r.planner == "none") none[{r.slots, r.step}] = r.imbalance;
  for (const auto& r : rep->records) {
    if (r.planner == "ultraep") {
      const double base = none[{r.slots, r.step}];
      EXPECT_LE(r.imbalance, base + 1e-12);
      if (r.slots == 0) {
        EXPECT_EQ(r.replicas, 0);
      }
    }
  }
  const std::string json = ::testing::TempDir() + "/rdep_sim_test.json";
  ASSERT_TRUE(WriteSimJson(*rep, json).ok());
  std::ifstream f(json);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"ultraep\": {\"count\": 4"), std::string::npos);
  std::remove(json.c_str());
}

// The gain gate through the simulator: a gate no plan meets leaves UltraEP with no replicas and the
// unbalanced imbalance; without it the same grid replicates.
TEST(PlanSim, GainGateReachesTheUltraEpPlanner) {
  SimConfig cfg;
  cfg.experts = {32};
  cfg.ranks = {8};
  cfg.slots = {2};
  cfg.alphas = {1.2};
  cfg.steps = 2;
  cfg.tokens = 256;
  for (int64_t gain : {int64_t{0}, int64_t{1} << 40}) {
    cfg.min_gain = gain;
    auto rep = RunSyntheticSim(cfg);
    ASSERT_TRUE(rep.ok()) << rep.status();
    double none = -1;
    for (const auto& r : rep->records)
      if (r.planner == "none") none = r.imbalance;
    for (const auto& r : rep->records) {
      if (r.planner != "ultraep") continue;
      if (gain == 0) {
        EXPECT_GT(r.replicas, 0);
      } else {
        EXPECT_EQ(r.replicas, 0);
        EXPECT_DOUBLE_EQ(r.imbalance, none);
      }
    }
  }
}

TEST(PlanSim, RejectsBadGrid) {
  SimConfig cfg;
  cfg.steps = 1;
  EXPECT_EQ(RunSyntheticSim(cfg).status().code(), StatusCode::kInvalidArgument);
  cfg.steps = 3;
  cfg.slots = {-1};
  EXPECT_EQ(RunSyntheticSim(cfg).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdep
