// Tests of the host reference router: selection, tie-breaking, limits, bias, losses, Sinkhorn, and
// gradients with respect to the logits against central finite differences in double precision.
#include "rdep/router/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "rdep/core/random.h"

namespace rdep {
namespace {

std::vector<double> NormalLogits(int64_t n, int64_t e, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<double> l(static_cast<size_t>(n * e));
  for (auto& x : l) x = scale * rng.normal();
  return l;
}

RouterConfig Basic(int64_t e, int64_t k) {
  RouterConfig c;
  c.num_experts = e;
  c.topk = k;
  return c;
}

TEST(Router, SoftmaxTopkTiesGoToLowerExpert) {
  RouterConfig c = Basic(4, 2);
  const std::vector<float> logits{1, 3, 2, 3};
  auto out = Route(c, logits, 1);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->routing.experts, (std::vector<int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(out->routing.gates[0], 0.5f);
  EXPECT_FLOAT_EQ(out->routing.gates[1], 0.5f);
  // All-equal logits: experts 0..K-1 in order.
  auto flat = Route(Basic(8, 3), std::vector<float>(8, 0.25f), 1);
  ASSERT_TRUE(flat.ok());
  EXPECT_EQ(flat->routing.experts, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_NEAR(flat->routing.gates[2], 1.0 / 3.0, 1e-7);
}

TEST(Router, SoftmaxScoresAndUnnormalizedScaledGates) {
  RouterConfig c = Basic(3, 2);
  c.normalize_topk = false;
  c.scaling_factor = 2.5;
  const std::vector<double> l{0.0, std::log(2.0), std::log(5.0)};  // softmax = {1, 2, 5} / 8
  auto out = RouteF64(c, l, 1);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->routing.experts, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(out->gates_f64[0], 2.5 * 5.0 / 8.0, 1e-15);
  EXPECT_NEAR(out->gates_f64[1], 2.5 * 2.0 / 8.0, 1e-15);
  EXPECT_NEAR(out->scores[0], 1.0 / 8.0, 1e-15);
}

TEST(Router, SigmoidNormalizedGates) {
  RouterConfig c = Basic(4, 2);
  c.score_function = ScoreFunction::kSigmoid;
  c.scaling_factor = 2.0;
  const std::vector<double> l{0.0, 1.0, -1.0, 2.0};
  auto out = RouteF64(c, l, 1);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->routing.experts, (std::vector<int32_t>{3, 1}));
  const double s3 = 1 / (1 + std::exp(-2.0)), s1 = 1 / (1 + std::exp(-1.0));
  EXPECT_NEAR(out->gates_f64[0], 2.0 * s3 / (s3 + s1), 1e-15);
  EXPECT_NEAR(out->gates_f64[1], 2.0 * s1 / (s3 + s1), 1e-15);
  EXPECT_NEAR(out->scores[2], 1 / (1 + std::exp(1.0)), 1e-15);
}

TEST(Router, OutputIsAValidRankRoutingAndFloatMatchesDouble) {
  RouterConfig c = Basic(16, 4);
  const auto l64 = NormalLogits(33, 16, 7);
  std::vector<float> l32(l64.begin(), l64.end());
  auto a = Route(c, l32, 33);
  auto b = RouteF64(c, std::vector<double>(l32.begin(), l32.end()), 33);
  ASSERT_TRUE(a.ok() && b.ok());
  LayerShape shape{33, 8, 8, 16, 4, 1};
  EXPECT_TRUE(a->routing.Validate(shape).ok()) << a->routing.Validate(shape);
  EXPECT_EQ(a->routing.experts, b->routing.experts);
  int64_t total = 0;
  for (auto x : a->tokens_per_expert) total += x;
  EXPECT_EQ(total, 33 * 4);
  for (size_t i = 0; i < a->routing.gates.size(); ++i) EXPECT_EQ(a->routing.gates[i], static_cast<float>(b->gates_f64[i]));
  // Zero tokens is fine.
  auto empty = Route(c, std::vector<float>{}, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->routing.num_tokens, 0);
}

TEST(Router, GroupLimitedKeepsGroupsByTopTwoSum) {
  // E=8 in 4 groups of 2; keep 2 groups; K=2.
  RouterConfig c = Basic(8, 2);
  c.num_groups = 4;
  c.topk_groups = 2;
  // Softmax numerators: group 0 = {e^3, ~0} (top-2 sum 20.1) although expert 0 is the single best
  // expert; group 1 = {e^2.6, e^2.6} (26.9), group 2 = {e^2.5, e^2.5} (24.4), group 3 = {1, 1}.
  const std::vector<double> l{3.0, -9.0, 2.6, 2.6, 2.5, 2.5, 0.0, 0.0};
  auto out = RouteF64(c, l, 1);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->routing.experts, (std::vector<int32_t>{2, 3}));
  // Without groups, expert 0 wins.
  auto plain = RouteF64(Basic(8, 2), l, 1);
  EXPECT_EQ(plain->routing.experts, (std::vector<int32_t>{0, 2}));
  // topk_groups = 3 keeps groups 1, 2 and 0 (group 3 loses): expert 0 is back.
  c.topk_groups = 3;
  c.topk = 3;
  auto three = RouteF64(c, l, 1);
  EXPECT_EQ(three->routing.experts, (std::vector<int32_t>{0, 2, 3}));
  c.topk_groups = 1;
  c.topk = 2;
  EXPECT_EQ(RouteF64(c, l, 1)->routing.experts, (std::vector<int32_t>{2, 3}));
}

TEST(Router, NodeLimitedMatchesBruteForceNodeChoice) {
  // 16 experts on 8 ranks, 2 ranks per node -> 4 nodes of 4 experts.
  auto own = OwnershipMap::Contiguous(16, 8);
  ASSERT_TRUE(own.ok());
  auto nodes = ExpertNodeMap(*own, 2);
  ASSERT_TRUE(nodes.ok());
  EXPECT_EQ((*nodes)[0], 0);
  EXPECT_EQ((*nodes)[4], 1);
  EXPECT_EQ((*nodes)[15], 3);
  for (int64_t m : {1, 2, 3}) {
    RouterConfig c = Basic(16, 6);
    if (m == 1) c.topk = 4;
    c.max_nodes = m;
    c.node_of_expert = *nodes;
    const int64_t n = 200;
    const auto l = NormalLogits(n, 16, 100 + static_cast<uint64_t>(m));
    auto out = RouteF64(c, l, n);
    ASSERT_TRUE(out.ok()) << out.status();
    for (int64_t t = 0; t < n; ++t) {
      // Brute force: node affinity = sum of the top-2 scores on the node; keep the best m nodes.
      const double* s = &out->scores[static_cast<size_t>(t * 16)];
      std::vector<std::pair<double, int>> aff;
      for (int nd = 0; nd < 4; ++nd) {
        std::vector<double> v(s + 4 * nd, s + 4 * nd + 4);
        std::sort(v.rbegin(), v.rend());
        aff.push_back({-(v[0] + v[1]), nd});
      }
      std::sort(aff.begin(), aff.end());
      std::set<int> keep;
      for (int64_t i = 0; i < m; ++i) keep.insert(aff[static_cast<size_t>(i)].second);
      std::vector<std::pair<double, int>> cand;
      for (int ex = 0; ex < 16; ++ex)
        if (keep.count(ex / 4)) cand.push_back({-s[ex], ex});
      std::sort(cand.begin(), cand.end());
      std::set<int> used_nodes;
      for (int64_t k = 0; k < c.topk; ++k) {
        const int32_t got = out->routing.experts[static_cast<size_t>(t * c.topk + k)];
        EXPECT_EQ(got, cand[static_cast<size_t>(k)].second) << "token " << t << " slot " << k << " M=" << m;
        used_nodes.insert(got / 4);
      }
      EXPECT_LE(static_cast<int64_t>(used_nodes.size()), m);
    }
  }
  // M = number of nodes is plain top-k.
  RouterConfig all = Basic(16, 6);
  all.max_nodes = 4;
  all.node_of_expert = *nodes;
  const auto l = NormalLogits(50, 16, 3);
  EXPECT_EQ(RouteF64(all, l, 50)->routing.experts, RouteF64(Basic(16, 6), l, 50)->routing.experts);
}

TEST(Router, ExpertBiasShiftsSelectionNotGates) {
  RouterConfig c = Basic(4, 2);
  const std::vector<double> l{2.0, 1.0, 0.0, -1.0};
  const std::vector<float> bias{0.0f, 0.0f, 0.0f, 1.0f};  // softmax gap is < 1: expert 3 is selected
  auto out = RouteF64(c, l, 1, bias);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->routing.experts, (std::vector<int32_t>{3, 0}));
  const double s0 = out->scores[0], s3 = out->scores[3];
  EXPECT_NEAR(out->gates_f64[0], s3 / (s0 + s3), 1e-15);
  EXPECT_NEAR(out->gates_f64[1], s0 / (s0 + s3), 1e-15);
}

TEST(Router, ExpertBiasUpdateFollowsSignOfMeanMinusLoad) {
  std::vector<float> b{0.0f, 0.5f, 0.0f, 0.0f};
  const std::vector<int64_t> loads{1, 2, 3, 6};  // mean 3
  ASSERT_TRUE(UpdateExpertBias(b, loads, 0.25).ok());
  EXPECT_EQ(b, (std::vector<float>{0.25f, 0.75f, 0.0f, -0.25f}));
  EXPECT_FALSE(UpdateExpertBias(b, std::vector<int64_t>{1, 2}, 0.1).ok());
  EXPECT_FALSE(UpdateExpertBias(b, loads, -1.0).ok());
}

TEST(Router, ExpertBiasLoopBalancesSkewedLogits) {
  // Logits favour low expert ids; the bias loop must flatten the loads.
  const int64_t n = 512, e = 8;
  auto l = NormalLogits(n, e, 11);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < e; ++i) l[static_cast<size_t>(t * e + i)] -= 0.4 * static_cast<double>(i);
  RouterConfig c = Basic(e, 2);
  std::vector<float> bias(static_cast<size_t>(e), 0.0f);
  auto first = RouteF64(c, l, n, bias);
  const auto first_max = *std::max_element(first->tokens_per_expert.begin(), first->tokens_per_expert.end());
  std::vector<int64_t> loads;
  for (int it = 0; it < 300; ++it) {
    auto out = RouteF64(c, l, n, bias);
    ASSERT_TRUE(out.ok());
    loads = out->tokens_per_expert;
    ASSERT_TRUE(UpdateExpertBias(bias, loads, 0.01).ok());
  }
  const auto last_max = *std::max_element(loads.begin(), loads.end());
  EXPECT_GT(first_max, 250);  // mean is 128
  EXPECT_LT(last_max, 170);
}

TEST(Loss, AuxLossValuesMatchDefinitions) {
  const int64_t n = 6, e = 4, k = 2;
  const auto l = NormalLogits(n, e, 5);
  RouterConfig c = Basic(e, k);
  c.aux_loss_coeff = 0.01;
  c.seq_aux_loss_coeff = 0.1;
  c.seq_length = 3;
  c.z_loss_coeff = 0.001;
  auto out = RouteF64(c, l, n);
  ASSERT_TRUE(out.ok());
  // Independent evaluation: aux = a * E * sum_e f_e P_e, f_e = count_e / (n K), P_e = mean_t p_t,e.
  double aux = 0, z = 0, seq = 0;
  for (int64_t i = 0; i < e; ++i) {
    double p = 0;
    for (int64_t t = 0; t < n; ++t) p += out->scores[static_cast<size_t>(t * e + i)];
    aux += static_cast<double>(out->tokens_per_expert[static_cast<size_t>(i)]) / (n * k) * p / n;
  }
  for (int64_t j = 0; j < 2; ++j) {
    for (int64_t i = 0; i < e; ++i) {
      double p = 0, f = 0;
      for (int64_t t = 3 * j; t < 3 * j + 3; ++t) {
        p += out->scores[static_cast<size_t>(t * e + i)] / 3.0;
        for (int64_t q = 0; q < k; ++q) f += out->routing.experts[static_cast<size_t>(t * k + q)] == i ? 1.0 / (3 * k) : 0;
      }
      seq += e * f * p / 2.0;
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    double s = 0;
    for (int64_t i = 0; i < e; ++i) s += std::exp(l[static_cast<size_t>(t * e + i)]);
    z += std::log(s) * std::log(s) / n;
  }
  EXPECT_NEAR(out->losses.aux, 0.01 * e * aux, 1e-14);
  EXPECT_NEAR(out->losses.seq_aux, 0.1 * seq, 1e-14);
  EXPECT_NEAR(out->losses.z, 0.001 * z, 1e-15);
  EXPECT_NEAR(out->losses.total(), out->losses.aux + out->losses.seq_aux + out->losses.z, 1e-15);
}

TEST(Loss, AuxLossEqualsCoefficientAtPerfectBalanceAndZLossOfZeros) {
  // Uniform probabilities make sum_e f_e P_e = 1/E whatever the counts: the loss is the coefficient.
  RouterConfig c = Basic(8, 2);
  c.aux_loss_coeff = 0.5;
  c.z_loss_coeff = 2.0;
  auto out = RouteF64(c, std::vector<double>(16 * 8, 0.0), 16);
  ASSERT_TRUE(out.ok());
  EXPECT_NEAR(out->losses.aux, 0.5, 1e-14);
  EXPECT_NEAR(out->losses.z, 2.0 * std::log(8.0) * std::log(8.0), 1e-13);
}

// Finite-difference check of RouterBackward for one config: J(l) = sum dgates*g + losses.total().
void CheckGradient(const RouterConfig& c, int64_t n, uint64_t seed, std::span<const float> bias = {}) {
  const int64_t e = c.num_experts, k = c.topk;
  auto l = NormalLogits(n, e, seed);
  Rng rng(seed + 1000);
  std::vector<float> dg(static_cast<size_t>(n * k));
  for (auto& x : dg) x = static_cast<float>(rng.normal());
  auto fwd = RouteF64(c, l, n, bias);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto grad = RouterBackward(c, l, n, *fwd, dg);
  ASSERT_TRUE(grad.ok()) << grad.status();
  auto objective = [&](const StatusOr<RouterOutput>& o) {
    double j = o->losses.total();
    for (size_t i = 0; i < dg.size(); ++i) j += static_cast<double>(dg[i]) * o->gates_f64[i];
    return j;
  };
  const double h = 1e-6;
  int checked = 0;
  double max_abs_grad = 0;
  for (size_t i = 0; i < l.size(); ++i) {
    const double keep = l[i];
    l[i] = keep + h;
    auto plus = RouteF64(c, l, n, bias);
    l[i] = keep - h;
    auto minus = RouteF64(c, l, n, bias);
    l[i] = keep;
    ASSERT_TRUE(plus.ok() && minus.ok());
    // Selection is piecewise constant: skip the (rare) coordinates where it flips.
    if (plus->routing.experts != fwd->routing.experts || minus->routing.experts != fwd->routing.experts) continue;
    const double fd = (objective(plus) - objective(minus)) / (2 * h);
    EXPECT_NEAR((*grad)[i], fd, 1e-7 + 1e-6 * std::abs(fd)) << c << " logit " << i;
    max_abs_grad = std::max(max_abs_grad, std::abs((*grad)[i]));
    ++checked;
  }
  EXPECT_GT(checked, static_cast<int>(l.size()) * 9 / 10);
  EXPECT_GT(max_abs_grad, 1e-3);  // the check is not vacuous
}

TEST(RouterGrad, SoftmaxNormalized) { CheckGradient(Basic(8, 2), 5, 21); }

TEST(RouterGrad, SoftmaxUnnormalizedScaled) {
  RouterConfig c = Basic(8, 3);
  c.normalize_topk = false;
  c.scaling_factor = 2.5;
  CheckGradient(c, 5, 22);
}

TEST(RouterGrad, SigmoidNormalizedScaledK1AndK4) {
  RouterConfig c = Basic(8, 4);
  c.score_function = ScoreFunction::kSigmoid;
  c.scaling_factor = 2.5;
  CheckGradient(c, 5, 23);
  c.topk = 1;
  c.normalize_topk = false;
  CheckGradient(c, 5, 24);
}

TEST(RouterGrad, AllLossesSoftmaxAndSigmoid) {
  for (auto f : {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid}) {
    RouterConfig c = Basic(8, 2);
    c.score_function = f;
    c.aux_loss_coeff = 0.3;
    c.seq_aux_loss_coeff = 0.2;
    c.seq_length = 3;
    c.z_loss_coeff = 0.05;
    CheckGradient(c, 6, 25);
  }
}

TEST(RouterGrad, LossesOnlyNoGates) {
  RouterConfig c = Basic(6, 2);
  c.aux_loss_coeff = 1.0;
  c.z_loss_coeff = 0.1;
  const auto l = NormalLogits(4, 6, 31);
  auto fwd = RouteF64(c, l, 4);
  auto grad = RouterBackward(c, l, 4, *fwd, {});
  ASSERT_TRUE(grad.ok());
  // Softmax aux/z gradients sum to 0 over experts only for the aux part; check one entry by FD.
  auto l2 = l;
  l2[3] += 1e-6;
  auto p = RouteF64(c, l2, 4);
  l2[3] -= 2e-6;
  auto m = RouteF64(c, l2, 4);
  EXPECT_NEAR((*grad)[3], (p->losses.total() - m->losses.total()) / 2e-6, 1e-7);
}

TEST(RouterGrad, GroupNodeAndBiasLimitedRouting) {
  RouterConfig g = Basic(16, 4);
  g.num_groups = 4;
  g.topk_groups = 2;
  g.aux_loss_coeff = 0.1;
  CheckGradient(g, 6, 41);
  auto own = OwnershipMap::Contiguous(16, 4);
  RouterConfig nl = Basic(16, 4);
  nl.max_nodes = 2;
  nl.node_of_expert = *ExpertNodeMap(*own, 1);
  nl.score_function = ScoreFunction::kSigmoid;
  nl.scaling_factor = 2.5;
  const std::vector<float> bias{0.1f, -0.2f, 0.0f, 0.3f, 0.0f, 0.0f, 0.1f, 0.0f,
                                -0.1f, 0.0f, 0.2f, 0.0f, 0.0f, 0.0f, 0.0f, 0.05f};
  CheckGradient(nl, 6, 42, bias);
}

TEST(Sinkhorn, RowsAndColumnsNormalize) {
  const int64_t n = 12, e = 4;
  const auto l = NormalLogits(n, e, 51, 2.0);
  auto m = Sinkhorn(l, n, e, 1e-10, 10000);
  ASSERT_TRUE(m.ok());
  for (int64_t t = 0; t < n; ++t) {
    double s = 0;
    for (int64_t i = 0; i < e; ++i) s += (*m)[static_cast<size_t>(t * e + i)];
    EXPECT_NEAR(s, 1.0 / n, 1e-8);
  }
  for (int64_t i = 0; i < e; ++i) {
    double s = 0;
    for (int64_t t = 0; t < n; ++t) s += (*m)[static_cast<size_t>(t * e + i)];
    EXPECT_NEAR(s, 1.0 / e, 1e-8);
  }
  EXPECT_FALSE(Sinkhorn(l, n, e + 1, 1e-4, 10).ok());
}

TEST(Sinkhorn, RoutingBalancesAHotExpert) {
  // Every token prefers expert 0 strongly; plain top-1 sends all 16 tokens there.
  const int64_t n = 16, e = 4;
  auto l = NormalLogits(n, e, 61, 0.5);
  for (int64_t t = 0; t < n; ++t) l[static_cast<size_t>(t * e)] += 4.0;
  RouterConfig c = Basic(e, 1);
  c.normalize_topk = false;
  auto plain = RouteF64(c, l, n);
  EXPECT_EQ(plain->tokens_per_expert[0], 16);
  c.sinkhorn = true;
  c.sinkhorn_tolerance = 1e-8;
  auto balanced = RouteF64(c, l, n);
  ASSERT_TRUE(balanced.ok()) << balanced.status();
  EXPECT_LE(*std::max_element(balanced->tokens_per_expert.begin(), balanced->tokens_per_expert.end()), 8);
  // Gates still come from the softmax scores of the chosen experts, and the gradient flows through them.
  const int32_t ex = balanced->routing.experts[0];
  EXPECT_NEAR(balanced->gates_f64[0], balanced->scores[static_cast<size_t>(ex)], 1e-15);
  CheckGradient(c, 8, 62);
}

TEST(RouterConfig, RejectsBadConfigsWithClearMessages) {
  auto msg = [](const RouterConfig& c) { return c.Validate().message(); };
  RouterConfig c = Basic(8, 9);
  EXPECT_NE(msg(c).find("topk (9) exceeds num_experts (8)"), std::string::npos) << msg(c);
  c = Basic(8, 2);
  c.num_groups = 3;
  EXPECT_NE(msg(c).find("num_groups (3) does not divide num_experts (8)"), std::string::npos) << msg(c);
  c = Basic(8, 2);
  c.num_groups = 4;
  c.topk_groups = 5;
  EXPECT_NE(msg(c).find("topk_groups"), std::string::npos);
  c = Basic(8, 5);
  c.num_groups = 4;
  c.topk_groups = 2;
  EXPECT_NE(msg(c).find("topk (5) exceeds the experts in topk_groups"), std::string::npos) << msg(c);
  c = Basic(16, 2);
  c.max_nodes = 5;
  c.node_of_expert = *ExpertNodeMap(*OwnershipMap::Contiguous(16, 8), 2);
  EXPECT_NE(msg(c).find("max_nodes (5) is larger than the number of nodes (4)"), std::string::npos) << msg(c);
  c.max_nodes = 1;
  c.topk = 5;
  EXPECT_NE(msg(c).find("exceeds the experts on the 1 smallest nodes (4)"), std::string::npos) << msg(c);
  c.node_of_expert.clear();
  EXPECT_NE(msg(c).find("node_of_expert"), std::string::npos);
  c = Basic(8, 2);
  c.seq_aux_loss_coeff = 0.1;
  EXPECT_NE(msg(c).find("seq_length"), std::string::npos);
  c.seq_length = 3;
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_NE(Route(c, std::vector<float>(32, 0.f), 4).status().message().find("seq_length (3) does not divide"),
            std::string::npos);
  EXPECT_FALSE(Route(Basic(8, 2), std::vector<float>(15, 0.f), 2).ok());
  std::vector<float> nan_logits(16, 0.f);
  nan_logits[9] = std::nanf("");
  EXPECT_NE(Route(Basic(8, 2), nan_logits, 2).status().message().find("token 1, expert 1"), std::string::npos);
  EXPECT_FALSE(ExpertNodeMap(*OwnershipMap::Contiguous(16, 8), 3).ok());
  std::ostringstream os;
  RouterConfig p = Basic(64, 6);
  p.score_function = ScoreFunction::kSigmoid;
  p.num_groups = 8;
  p.topk_groups = 4;
  os << p;
  EXPECT_EQ(os.str(), "RouterConfig{E=64 K=6 score=sigmoid normalize_topk=yes scale=1 groups=4/8}");
}

}  // namespace
}  // namespace rdep
