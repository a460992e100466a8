#include "rdep/core/reference.h"

#include <gtest/gtest.h>

#include <cmath>

#include "rdep/core/random.h"

namespace rdep {
namespace {

LayerShape Shape() { return LayerShape{.tokens = 3, .hidden = 5, .ffn = 3, .experts = 4, .topk = 2, .ranks = 2}; }

// Scalar loss L = sum(dy * y) so dL/dy = dy; central differences in double on float inputs.
double Loss(const LayerShape& s, const MoEWeights& w, const Routing& routing, const CapacityPolicy& p,
            const std::vector<std::vector<float>>& x, const std::vector<std::vector<float>>& dy) {
  auto f = ReferenceForward(s, w, routing, p, x);
  EXPECT_TRUE(f.ok());
  double l = 0;
  for (size_t r = 0; r < dy.size(); ++r)
    for (size_t i = 0; i < dy[r].size(); ++i) l += static_cast<double>(dy[r][i]) * f->y[r][i];
  return l;
}

template <typename Vec, typename Grad>
void CheckFd(Vec& param, const Grad& analytic, const std::function<double()>& loss, const char* what) {
  for (size_t i = 0; i < param.size(); i += 1 + param.size() / 23) {
    const float keep = param[i];
    const float eps = 1e-2f * std::max(1.0f, std::abs(keep));
    param[i] = keep + eps;
    const double lp = loss();
    param[i] = keep - eps;
    const double lm = loss();
    param[i] = keep;
    const double fd = (lp - lm) / (2.0 * static_cast<double>(eps));
    EXPECT_NEAR(analytic[i], fd, 1e-3 * (1 + std::abs(fd))) << what << "[" << i << "]";
  }
}

TEST(Rng, SkipEqualsDrawing) {
  Rng a(7, 3), b(7, 3);
  for (int i = 0; i < 1000; ++i) a.next();
  b.skip(1000);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(a.next(), b.next()) << "draw " << i << " after 1000";
}

// RandomWeights fills in parallel chunks (large shapes): the values must be one sequential stream,
// w1 then w2, whatever the thread count.
TEST(Reference, RandomWeightsAreOneSequentialStream) {
  const LayerShape s{.tokens = 1, .hidden = 1024, .ffn = 1024, .experts = 5, .topk = 1, .ranks = 1};  // 15.7 M values
  const MoEWeights w = RandomWeights(s, 11);
  Rng rng(11, 1001);
  const double s1 = 1.0 / std::sqrt(1024.0), s2 = 1.0 / std::sqrt(1024.0);
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < w.w1.size(); ++i)
    if (w.w1[i] != static_cast<float>(rng.normal() * s1) && bad++ == 0) first_bad = i;
  EXPECT_EQ(bad, 0u) << "w1 differs from the sequential stream, first at " << first_bad;
  bad = 0;
  for (size_t i = 0; i < w.w2.size(); ++i)
    if (w.w2[i] != static_cast<float>(rng.normal() * s2) && bad++ == 0) first_bad = i;
  EXPECT_EQ(bad, 0u) << "w2 differs from the sequential stream, first at " << first_bad;
}

TEST(Reference, GradientsMatchFiniteDifferences) {
  for (double c : {0.0, 0.5}) {
    const LayerShape s = Shape();
    auto routing = *GenerateRouting(s, *RoutingSpec::Parse("one-expert"));
    // Mix in a second routing family so capacity drops hit some tokens partially.
    routing[1] = (*GenerateRouting(s, RoutingSpec{}))[1];
    const CapacityPolicy p{c};
    MoEWeights w = RandomWeights(s, 3, 0.5);
    auto x = RandomActivations(s, routing, 4);
    auto dy = RandomActivations(s, routing, 5);
    auto g = ReferenceBackward(s, w, routing, p, x, dy);
    ASSERT_TRUE(g.ok()) << g.status();
    auto loss = [&] { return Loss(s, w, routing, p, x, dy); };
    CheckFd(w.w1, g->dw1, loss, "dw1");
    CheckFd(w.w2, g->dw2, loss, "dw2");
    for (size_t r = 0; r < x.size(); ++r) {
      CheckFd(x[r], g->dx[r], loss, "dx");
      CheckFd(routing[r].gates, g->dgates[r], loss, "dgates");
    }
  }
}

TEST(Reference, DroppedSlotsContributeNothing) {
  const LayerShape s = Shape();
  auto routing = *GenerateRouting(s, *RoutingSpec::Parse("one-expert"));
  MoEWeights w = RandomWeights(s, 3);
  auto x = RandomActivations(s, routing, 4);
  // Capacity 1 row per expert: only rank 0 token 0 is admitted anywhere.
  auto f = ReferenceForward(s, w, routing, CapacityPolicy{1e-9}, x);
  ASSERT_TRUE(f.ok());
  for (int64_t t = 1; t < 3; ++t)
    for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(f->y[0][static_cast<size_t>(t * 5 + c)], 0.0);
  EXPECT_NE(f->y[0][0], 0.0);
}

TEST(Reference, RejectsMismatchedTensors) {
  const LayerShape s = Shape();
  auto routing = *GenerateRouting(s, RoutingSpec{});
  MoEWeights w = RandomWeights(s, 3);
  auto x = RandomActivations(s, routing, 4);
  x[1].pop_back();
  auto f = ReferenceForward(s, w, routing, CapacityPolicy{}, x);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("x[1]"), std::string::npos) << f.status();
  LayerShape other = s;
  other.hidden = 6;
  EXPECT_FALSE(w.Validate(other).ok());
}

}  // namespace
}  // namespace rdep
