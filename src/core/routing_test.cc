#include "rdep/core/routing.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace rdep {
namespace {

LayerShape Shape() { return LayerShape{.tokens = 200, .hidden = 8, .ffn = 8, .experts = 16, .topk = 4, .ranks = 3}; }

void ExpectValid(const LayerShape& s, const Routing& r) {
  ASSERT_EQ(r.size(), static_cast<size_t>(s.ranks));
  for (const auto& rr : r) {
    EXPECT_TRUE(rr.Validate(s).ok()) << rr.Validate(s);
    for (int64_t t = 0; t < rr.num_tokens; ++t) {
      double sum = 0;
      for (int64_t k = 0; k < s.topk; ++k) sum += rr.gates[static_cast<size_t>(t * s.topk + k)];
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  }
}

TEST(Routing, FamiliesAreValidAndSeeded) {
  for (const char* fam : {"uniform", "zipf:1.2", "one-expert", "sparse"}) {
    auto spec = RoutingSpec::Parse(fam);
    ASSERT_TRUE(spec.ok()) << fam;
    auto a = GenerateRouting(Shape(), *spec);
    auto b = GenerateRouting(Shape(), *spec);
    ASSERT_TRUE(a.ok());
    ExpectValid(Shape(), *a);
    for (size_t r = 0; r < a->size(); ++r) {
      EXPECT_EQ((*a)[r].experts, (*b)[r].experts) << fam;
      EXPECT_EQ((*a)[r].gates, (*b)[r].gates) << fam;
    }
    spec->seed = 99;
    auto c = GenerateRouting(Shape(), *spec);
    if (std::string(fam) != "one-expert") {
      EXPECT_NE((*a)[0].gates, (*c)[0].gates) << fam;
    }
  }
}

TEST(Routing, FamilyShapes) {
  auto one = GenerateRouting(Shape(), *RoutingSpec::Parse("one-expert"));
  auto loads = ExpertLoads(*one, 16);
  EXPECT_EQ(loads[0], 3 * 200);  // every token reaches expert 0
  EXPECT_EQ(loads[5], 0);

  auto sparse = GenerateRouting(Shape(), *RoutingSpec::Parse("sparse"));
  loads = ExpertLoads(*sparse, 16);
  for (int e = 1; e < 16; e += 2) EXPECT_EQ(loads[static_cast<size_t>(e)], 0) << e;
  EXPECT_GT(loads[0], 0);

  auto zipf = GenerateRouting(Shape(), *RoutingSpec::Parse("zipf:2"));
  loads = ExpertLoads(*zipf, 16);
  int64_t mx = 0, mn = 1 << 30;
  for (auto l : loads) { mx = std::max(mx, l); mn = std::min(mn, l); }
  EXPECT_GT(mx, 4 * std::max<int64_t>(mn, 1));  // skewed

  RoutingSpec spec;
  spec.empty_rank = 1;
  auto empty = GenerateRouting(Shape(), spec);
  EXPECT_EQ((*empty)[1].num_tokens, 0);
  EXPECT_TRUE((*empty)[1].experts.empty());
  EXPECT_EQ((*empty)[0].num_tokens, 200);
}

TEST(Routing, SparseKeepsAtLeastKExperts) {
  LayerShape s = Shape();
  s.experts = 5;
  s.topk = 5;
  auto r = GenerateRouting(s, *RoutingSpec::Parse("sparse"));
  ASSERT_TRUE(r.ok());
  ExpectValid(s, *r);
}

TEST(Routing, ParseRejectsGarbage) {
  EXPECT_FALSE(RoutingSpec::Parse("zipf:").ok());
  EXPECT_FALSE(RoutingSpec::Parse("zipf:-1").ok());
  EXPECT_FALSE(RoutingSpec::Parse("zipf:abc").ok());
  EXPECT_FALSE(RoutingSpec::Parse("gaussian").ok());
  EXPECT_EQ(RoutingSpec::Parse("zipf:1.5")->alpha, 1.5);
}

TEST(Routing, ValidateNamesTheProblem) {
  LayerShape s = Shape();
  RankRouting rr{.num_tokens = 1, .topk = 4, .experts = {0, 1, 1, 2}, .gates = {0.25f, 0.25f, 0.25f, 0.25f}};
  EXPECT_NE(rr.Validate(s).message().find("token 0 slot 2: expert 1 chosen twice"), std::string::npos) << rr.Validate(s);
  rr.experts = {0, 1, 2, 16};
  EXPECT_NE(rr.Validate(s).message().find("token 0 slot 3: expert 16 outside [0, E=16)"), std::string::npos) << rr.Validate(s);
  rr.experts = {0, 1, 2, 3};
  rr.gates[1] = NAN;
  EXPECT_NE(rr.Validate(s).message().find("token 0 slot 1: gate nan is negative or not finite"), std::string::npos) << rr.Validate(s);
  rr.gates = {1, 1, 1};
  EXPECT_NE(rr.Validate(s).message().find("expected 4"), std::string::npos);
  rr.num_tokens = 201;
  EXPECT_FALSE(rr.Validate(s).ok());
}

TEST(Routing, LoadMatrixSumsToRows) {
  auto r = GenerateRouting(Shape(), RoutingSpec{});
  auto m = LoadMatrix(*r, 16);
  int64_t sum = 0;
  for (auto v : m) sum += v;
  EXPECT_EQ(sum, Shape().total_rows());
}

}  // namespace
}  // namespace rdep
