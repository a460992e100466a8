// Tests of route-health telemetry on crafted routings whose statistics are known exactly.
#include "rdep/router/telemetry.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

namespace rdep {
namespace {

RankRouting Make(std::vector<int32_t> experts, int64_t k) {
  RankRouting r;
  r.topk = k;
  r.num_tokens = static_cast<int64_t>(experts.size()) / k;
  r.gates.assign(experts.size(), 0.5f);
  r.experts = std::move(experts);
  return r;
}

TEST(Telemetry, LoadsCvPercentilesActiveAndEntropy) {
  // E = 4 over two ranks, K = 2. Loads: e0 = 4, e1 = 2, e2 = 2, e3 = 0.
  Routing routing{Make({0, 1, 0, 2}, 2), Make({0, 1, 0, 2}, 2)};
  auto t = ComputeTelemetry(routing, 4);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->loads, (std::vector<int64_t>{4, 2, 2, 0}));
  EXPECT_EQ(t->total_rows, 8);
  EXPECT_DOUBLE_EQ(t->mean_rows, 2.0);
  EXPECT_NEAR(t->cv, std::sqrt(2.0) / 2.0, 1e-15);  // stddev sqrt(2), mean 2
  EXPECT_NEAR(t->p10_rows, 0.6, 1e-12);               // sorted {0,2,2,4}: 0 + 0.3*(2-0)
  EXPECT_EQ(t->active_experts, 3);
  EXPECT_EQ(t->max_rows, 4);
  EXPECT_DOUBLE_EQ(t->max_over_mean, 2.0);
  EXPECT_NEAR(t->load_entropy, -(0.5 * std::log(0.5) + 2 * 0.25 * std::log(0.25)), 1e-15);
}

TEST(Telemetry, UniformLoadsHaveZeroCvAndMaxEntropy) {
  Routing routing{Make({0, 1, 2, 3, 4, 5, 6, 7}, 4)};
  auto t = ComputeTelemetry(routing, 8);
  ASSERT_TRUE(t.ok());
  EXPECT_DOUBLE_EQ(t->cv, 0.0);
  EXPECT_NEAR(t->load_entropy, std::log(8.0), 1e-15);
  EXPECT_EQ(t->active_experts, 8);
  EXPECT_DOUBLE_EQ(t->p10_rows, 1.0);
}

TEST(Telemetry, OwnerLoadsAndPaddingRatio) {
  auto own = OwnershipMap::Contiguous(4, 2);
  ASSERT_TRUE(own.ok());
  Routing routing{Make({0, 1, 0, 2}, 2), Make({0, 1, 0, 2}, 2)};
  auto t = ComputeTelemetry(routing, *own);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->owner_loads, (std::vector<int64_t>{6, 2}));
  EXPECT_DOUBLE_EQ(t->max_padding_ratio, 2.0);  // owner 0: 2*4/6 = 1.33, owner 1: 2*2/2 = 2
  std::ostringstream os;
  os << *t;
  EXPECT_NE(os.str().find("active experts     3 / 4"), std::string::npos) << os.str();
  EXPECT_NE(os.str().find("CV                 0.707 (70.7%)"), std::string::npos) << os.str();
  EXPECT_NE(os.str().find("max padding ratio  2.000"), std::string::npos) << os.str();
}

TEST(Telemetry, ScoreEntropyAndErrors) {
  // Uniform over 4: ln 4; one-hot: 0. Rows are renormalized (sigmoid scores).
  auto h = MeanScoreEntropy(std::vector<double>{0.5, 0.5, 0.5, 0.5, 1, 0, 0, 0}, 2, 4);
  ASSERT_TRUE(h.ok());
  EXPECT_NEAR(*h, std::log(4.0) / 2, 1e-15);
  EXPECT_FALSE(MeanScoreEntropy(std::vector<double>{0.5, -0.5}, 1, 2).ok());
  EXPECT_FALSE(MeanScoreEntropy(std::vector<double>{0.5}, 1, 2).ok());
  EXPECT_FALSE(MeanScoreEntropy(std::vector<double>{0, 0}, 1, 2).ok());
  Routing bad{Make({0, 9}, 2)};
  auto t = ComputeTelemetry(bad, 4);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("rank 0 slot 1 names expert 9"), std::string::npos);
  EXPECT_FALSE(ComputeTelemetry(bad, 0).ok());
  // Empty routing: zero rows, no active experts.
  auto empty = ComputeTelemetry(Routing{Make({}, 2)}, 4);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->active_experts, 0);
  EXPECT_DOUBLE_EQ(empty->cv, 0.0);
}

}  // namespace
}  // namespace rdep
