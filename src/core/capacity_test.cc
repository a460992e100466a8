#include "rdep/core/capacity.h"

#include <gtest/gtest.h>

#include <cmath>

#include "rdep/core/random.h"

namespace rdep {
namespace {

LayerShape Shape() { return LayerShape{.tokens = 64, .hidden = 4, .ffn = 4, .experts = 8, .topk = 2, .ranks = 4}; }

TEST(Capacity, PolicyValidationAndSize) {
  EXPECT_TRUE(CapacityPolicy{}.Validate().ok());
  EXPECT_TRUE(CapacityPolicy{}.dropless());
  EXPECT_FALSE(CapacityPolicy{-0.5}.Validate().ok());
  EXPECT_NE(CapacityPolicy{NAN}.Validate().message().find("finite"), std::string::npos);
  EXPECT_FALSE(CapacityPolicy{INFINITY}.Validate().ok());
  // ceil(1.25 * 4*64*2 / 8) = 80
  EXPECT_EQ(CapacityPolicy{1.25}.ExpertCapacity(Shape()), 80);
  EXPECT_EQ(CapacityPolicy{0.01}.ExpertCapacity(Shape()), 1);
}

TEST(Capacity, AdmitBySourceOrder) {
  const int64_t counts[4] = {3, 5, 0, 4};
  int64_t admitted[4];
  AdmitBySourceOrder(counts, 4, 6, admitted);
  EXPECT_EQ(admitted[0], 3);
  EXPECT_EQ(admitted[1], 3);
  EXPECT_EQ(admitted[2], 0);
  EXPECT_EQ(admitted[3], 0);
  AdmitBySourceOrder(counts, 4, 100, admitted);
  EXPECT_EQ(admitted[3], 4);
}

TEST(Capacity, ApplyCapacityIsRowIdOrderAndRenormalizes) {
  auto routing = GenerateRouting(Shape(), *RoutingSpec::Parse("zipf:1.5"));
  ASSERT_TRUE(routing.ok());
  const CapacityPolicy policy{0.75};
  auto acc = ApplyCapacity(Shape(), *routing, policy);
  ASSERT_TRUE(acc.ok());
  const int64_t cap = policy.ExpertCapacity(Shape());
  std::vector<int64_t> admitted(8, 0), seen(8, 0);
  int64_t dropped = 0;
  for (size_t r = 0; r < routing->size(); ++r) {
    const auto& rr = (*routing)[r];
    const auto& a = (*acc)[r];
    dropped += a.dropped;
    for (int64_t t = 0; t < rr.num_tokens; ++t) {
      double s = 0, se = 0;
      for (int64_t k = 0; k < 2; ++k) {
        const auto i = static_cast<size_t>(t * 2 + k);
        const auto e = static_cast<size_t>(rr.experts[i]);
        // Row-id order rule: the first `cap` candidates of each expert are the accepted ones.
        EXPECT_EQ(a.accepted[i] != 0, seen[e] < cap);
        ++seen[e];
        admitted[e] += a.accepted[i];
        if (!a.accepted[i]) {
          EXPECT_EQ(a.effective_gates[i], 0.f);
        }
        s += rr.gates[i];
        se += a.effective_gates[i];
      }
      const bool any = a.accepted[static_cast<size_t>(t * 2)] || a.accepted[static_cast<size_t>(t * 2 + 1)];
      EXPECT_NEAR(se, any ? s : 0.0, 1e-6);
    }
  }
  EXPECT_GT(dropped, 0);  // Zipf 1.5 at c=0.75 must overflow the hot experts
  int64_t total = 0;
  for (auto v : admitted) {
    EXPECT_LE(v, cap);
    total += v;
  }
  EXPECT_EQ(total + dropped, Shape().total_rows());
}

TEST(Capacity, DroplessKeepsGatesBitwise) {
  auto routing = GenerateRouting(Shape(), RoutingSpec{});
  auto acc = ApplyCapacity(Shape(), *routing, CapacityPolicy{});
  ASSERT_TRUE(acc.ok());
  for (size_t r = 0; r < routing->size(); ++r) {
    EXPECT_EQ((*acc)[r].effective_gates, (*routing)[r].gates);
    EXPECT_EQ((*acc)[r].dropped, 0);
  }
}

TEST(Capacity, RenormalizeBackwardMatchesFiniteDifferences) {
  Rng rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t K = 4;
    float g[K];
    uint8_t acc[K];
    double G[K], dg[K];
    bool any = false;
    for (int k = 0; k < K; ++k) {
      g[k] = static_cast<float>(0.1 + rng.uniform());
      acc[k] = rng.uniform() < 0.6;
      any |= acc[k] != 0;
      G[k] = rng.normal();
    }
    RenormalizeGatesBackward(g, acc, K, G, dg);
    auto loss = [&](const float* gg) {
      float eff[K];
      RenormalizeGates(gg, acc, K, eff);
      double l = 0;
      for (int k = 0; k < K; ++k) l += G[k] * eff[k];
      return l;
    };
    for (int j = 0; j < K; ++j) {
      float gp[K], gm[K];
      for (int k = 0; k < K; ++k) gp[k] = gm[k] = g[k];
      const float eps = 1e-3f;
      gp[j] += eps;
      gm[j] -= eps;
      const double fd = (loss(gp) - loss(gm)) / (static_cast<double>(gp[j]) - gm[j]);
      EXPECT_NEAR(dg[j], fd, 2e-3 * (1 + std::abs(fd))) << "trial " << trial << " j " << j << " any " << any;
    }
  }
}

}  // namespace
}  // namespace rdep
