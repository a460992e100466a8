// LayerConfig::owner_reduce on the host backend: the owner sums a token's rows before they cross back
// and takes dgate's dot products itself. Against the same layer without it, on the same routing,
// weights and inputs: dgates and the weight gradients are bitwise equal (the same per-row arithmetic),
// y and dx equal within fp32 summation-order tolerance (the sum is associated per owner first), for
// W = 1 and 4, uniform and skewed routing, capacity drops, several segments and balancing with
// replicas; two calls per layer (the second finds the first's sums in the return rows) and a rank that
// reads late. Outputs start as NaN, so a value nobody wrote fails. Bad configurations are refused. The
// identity expert (forward only) gives x times the token's gate sum in both modes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "rdep/core/capacity.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

struct Case {
  std::string name;
  int64_t ranks = 4, experts = 16, tokens = 40, topk = 4;
  std::string routing = "uniform";
  double capacity_factor = 0;  // 0 = dropless
  int64_t segment = 0;
  bool balance = false;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Result {
  std::vector<std::vector<float>> y, dx, dg, dw1, dw2;  // per rank
};

LayerShape ShapeOf(const Case& c) {
  return LayerShape{.tokens = c.tokens, .hidden = 12, .ffn = 6, .experts = c.experts, .topk = c.topk, .ranks = c.ranks};
}

// Two forward+backward calls on one layer (the second with another routing draw, so return rows hold the
// first call's values when it runs: an owner that did not zero a lead row would add to stale sums), rank
// delay_rank reading late; the second call's results.
Result RunLayer(const Case& c, bool owner_reduce, int32_t delay_rank = -1) {
  const LayerShape s = ShapeOf(c);
  auto domain = std::move(*HostDomain::Create(static_cast<int32_t>(s.ranks), {.barrier_timeout_s = 10}));
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  const MoEWeights w = RandomWeights(s, 7);
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
  cfg.owner_reduce = owner_reduce;
  if (c.balance) cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 2};
  auto layer_or = HostMoELayer::Create(*domain, cfg, own, w);
  EXPECT_TRUE(layer_or.ok()) << layer_or.status();
  auto layer = std::move(*layer_or);
  if (delay_rank >= 0) layer->set_read_delay_for_test(delay_rank, 0.02);
  const auto W = static_cast<size_t>(s.ranks);
  Result out;
  for (uint64_t call = 1; call <= 2; ++call) {
    RoutingSpec spec = *RoutingSpec::Parse(c.routing);
    spec.seed = call;
    const Routing rt = *GenerateRouting(s, spec);
    const auto x = RandomActivations(s, rt, 8 + call);
    out = Result{};
    out.y.resize(W), out.dx.resize(W), out.dg.resize(W), out.dw1.resize(W), out.dw2.resize(W);
    std::vector<ForwardContext> ctx(W);
    Status st = domain->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      const int64_t n = rt[i].num_tokens;
      out.y[i].assign(static_cast<size_t>(n * s.hidden), NAN);
      out.dx[i].assign(static_cast<size_t>(n * s.hidden), NAN);
      out.dg[i].assign(static_cast<size_t>(n * s.topk), NAN);
      RDEP_RETURN_IF_ERROR(layer->Forward(r, ctx[i], rt[i], x[i], out.y[i]));
      std::vector<float> dy(x[i].size());
      for (size_t k = 0; k < dy.size(); ++k) dy[k] = std::cos(0.29f * static_cast<float>(k * call) + static_cast<float>(r));
      RDEP_RETURN_IF_ERROR(layer->Backward(r, ctx[i], dy, out.dx[i], out.dg[i]));
      out.dw1[i].assign(layer->dw1(r).begin(), layer->dw1(r).end());
      out.dw2[i].assign(layer->dw2(r).begin(), layer->dw2(r).end());
      return Status::Ok();
    });
    EXPECT_TRUE(st.ok()) << "call " << call << ": " << st;
  }
  return out;
}

void ExpectBitwise(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    ASSERT_EQ(a[r].size(), b[r].size()) << what << " rank " << r;
    for (size_t i = 0; i < a[r].size(); ++i)
      ASSERT_EQ(std::memcmp(&a[r][i], &b[r][i], sizeof(float)), 0) << what << " rank " << r << " [" << i << "]: " << a[r][i] << " vs " << b[r][i];
  }
}

// |a - b| <= 1e-5 (1 + |a|) elementwise; NaN (an unwritten output) fails.
void ExpectClose(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    ASSERT_EQ(a[r].size(), b[r].size()) << what << " rank " << r;
    for (size_t i = 0; i < a[r].size(); ++i)
      ASSERT_LE(std::fabs(a[r][i] - b[r][i]), 1e-5f * (1.f + std::fabs(a[r][i]))) << what << " rank " << r << " [" << i << "]: "
                                                                                   << a[r][i] << " vs " << b[r][i];
  }
}

class OwnerReduce : public ::testing::TestWithParam<Case> {};

TEST_P(OwnerReduce, MatchesTheLayerThatReturnsEveryRow) {
  const Case& c = GetParam();
  const Result rows = RunLayer(c, false);
  for (int32_t delay_rank : {-1, static_cast<int32_t>(c.ranks - 1)}) {  // last rank reads late: the barriers order it
    SCOPED_TRACE(delay_rank < 0 ? "no delay" : "last rank delayed");
    const Result reduced = RunLayer(c, true, delay_rank);
    ExpectClose(rows.y, reduced.y, "y");
    ExpectClose(rows.dx, reduced.dx, "dx");
    ExpectBitwise(rows.dg, reduced.dg, "dgates");
    ExpectBitwise(rows.dw1, reduced.dw1, "dw1");
    ExpectBitwise(rows.dw2, reduced.dw2, "dw2");
  }
}

// The identity expert (ExpertKind::kIdentity, forward only), with and without owner_reduce: y = x * (sum of
// the token's accepted effective gates) within fp32 summation order, y starting as NaN; Backward refuses.
TEST_P(OwnerReduce, TheIdentityExpertReturnsTheGateSumTimesX) {
  const Case& c = GetParam();
  const LayerShape s = ShapeOf(c);
  for (bool owner_reduce : {false, true}) {
    SCOPED_TRACE(owner_reduce ? "owner_reduce" : "rows");
    auto domain = std::move(*HostDomain::Create(static_cast<int32_t>(s.ranks), {.barrier_timeout_s = 10}));
    LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
    cfg.owner_reduce = owner_reduce;
    if (c.balance) cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 2};
    auto layer = std::move(*HostMoELayer::Create(*domain, cfg, *OwnershipMap::Contiguous(s.experts, s.ranks), RandomWeights(s, 7)));
    layer->set_expert_kind(ExpertKind::kIdentity);
    RoutingSpec spec = *RoutingSpec::Parse(c.routing);
    spec.seed = 5;
    const Routing rt = *GenerateRouting(s, spec);
    const auto x = RandomActivations(s, rt, 9);
    std::vector<std::vector<float>> y(static_cast<size_t>(s.ranks));
    Status st = domain->Run([&](int32_t r) -> Status {  // the layer's own contexts: acceptance() reads them
      const auto i = static_cast<size_t>(r);
      y[i].assign(static_cast<size_t>(rt[i].num_tokens * s.hidden), NAN);
      RDEP_RETURN_IF_ERROR(layer->Forward(r, rt[i], x[i], y[i]));
      std::vector<float> dx(y[i].size()), dg(static_cast<size_t>(rt[i].num_tokens * s.topk));
      const Status bwd = layer->Backward(r, x[i], dx, dg);
      if (bwd.code() != StatusCode::kFailedPrecondition || bwd.message().find("SwiGLU") == std::string::npos)
        return InternalError("the identity expert's backward was not refused as forward only: " + bwd.ToString());
      return Status::Ok();
    });
    ASSERT_TRUE(st.ok()) << st;
    for (int32_t r = 0; r < static_cast<int32_t>(s.ranks); ++r) {
      const RankAcceptance& acc = layer->acceptance(r);
      const auto i = static_cast<size_t>(r);
      for (int64_t t = 0; t < rt[i].num_tokens; ++t) {
        double gsum = 0;
        for (int64_t k = 0; k < s.topk; ++k)
          if (acc.accepted[static_cast<size_t>(t * s.topk + k)]) gsum += acc.effective_gates[static_cast<size_t>(t * s.topk + k)];
        for (int64_t col = 0; col < s.hidden; ++col) {
          const double want = x[i][static_cast<size_t>(t * s.hidden + col)] * gsum, got = y[i][static_cast<size_t>(t * s.hidden + col)];
          ASSERT_LE(std::fabs(got - want), 1e-5 * (1 + std::fabs(want))) << "rank " << r << " token " << t << " column " << col;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, OwnerReduce,
    ::testing::Values(Case{.name = "W1", .ranks = 1, .experts = 8}, Case{.name = "W4_uniform"},
                      Case{.name = "W4_zipf2", .routing = "zipf:2"},
                      Case{.name = "W4_capacity_drops", .routing = "zipf:1", .capacity_factor = 0.6},
                      Case{.name = "W4_segments", .routing = "zipf:1", .segment = 7},
                      Case{.name = "W4_one_expert", .routing = "one-expert"},
                      Case{.name = "W4_balanced_zipf2", .routing = "zipf:2", .balance = true},
                      Case{.name = "W3_K6_E9", .ranks = 3, .experts = 9, .tokens = 33, .topk = 6, .routing = "zipf:1.5"}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(OwnerReduceConfig, RefusedWhereItDoesNotApply) {
  const LayerShape s{.tokens = 8, .hidden = 4, .ffn = 2, .experts = 4, .topk = 2, .ranks = 2};
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.owner_reduce = true;
  cfg.nodes = NodeConfig{.nodes = 2};
  Status st = cfg.Validate();
  EXPECT_NE(st.message().find("owner_reduce: with nodes (N=2)"), std::string::npos) << st;

  cfg.nodes = NodeConfig{};
  auto domain = std::move(*HostDomain::Create(2, {.barrier_timeout_s = 10}));
  const OwnershipMap own = *OwnershipMap::Contiguous(4, 2);
  auto layer = std::move(*HostMoELayer::Create(*domain, cfg, own, RandomWeights(s, 1)));
  const Routing rt = *GenerateRouting(s, RoutingSpec{});
  const auto x = RandomActivations(s, rt, 2);
  layer->set_expert_kind(ExpertKind::kSentinel);
  st = domain->Run([&](int32_t r) -> Status {
    std::vector<float> y(32);
    return layer->Forward(r, rt[static_cast<size_t>(r)], x[static_cast<size_t>(r)], y);
  });
  EXPECT_NE(st.message().find("sentinel expert's rows carry identities"), std::string::npos) << st;

  layer->set_expert_kind(ExpertKind::kSwiGLU);  // the caller's experts return one row per slot
  std::vector<ForwardContext> ctx(2);
  st = domain->Run([&](int32_t r) -> Status { return layer->Plan(r, ctx[static_cast<size_t>(r)], rt[static_cast<size_t>(r)]); });
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_NE(layer->recv_counts(ctx[0]).status().message().find("without owner_reduce"), std::string::npos);
}

}  // namespace
}  // namespace rdep
