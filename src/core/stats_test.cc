#include "rdep/core/stats.h"

#include <gtest/gtest.h>

#include <cmath>

namespace rdep {
namespace {

TEST(Stats, PercentileInterpolates) {
  std::vector<double> v{5, 1, 3, 2, 4};
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 3);
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 5);
  EXPECT_DOUBLE_EQ(Percentile(v, 25), 2);
  EXPECT_DOUBLE_EQ(Percentile({1, 2}, 99), 1.99);
  EXPECT_TRUE(std::isnan(Percentile({}, 50)));
}

TEST(Stats, SummaryAndCv) {
  auto s = Summarize({1, 2, 3, 4});
  EXPECT_EQ(s.count, 4);
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.max, 4);
  EXPECT_DOUBLE_EQ(CoefficientOfVariation({2, 2, 2}), 0);
  EXPECT_NEAR(CoefficientOfVariation({0, 4}), 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(CoefficientOfVariation({0, 0}), 0);
}

TEST(Stats, PaddingRatioMatchesEq31) {
  EXPECT_DOUBLE_EQ(PaddingRatio({4, 4, 4, 4}), 1.0);
  EXPECT_DOUBLE_EQ(PaddingRatio({8, 0, 0, 0}), 4.0);
  EXPECT_DOUBLE_EQ(PaddingRatio({3, 1}), 2 * 3.0 / 4.0);
  EXPECT_DOUBLE_EQ(PaddingRatio({0, 0}), 1.0);
}

TEST(Stats, MaxOverRanks) {
  auto m = MaxOverRanks({{1, 5, 2}, {3, 1, 2}});
  EXPECT_EQ(m, (std::vector<double>{3, 5, 2}));
}

}  // namespace
}  // namespace rdep
