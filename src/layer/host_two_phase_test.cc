// The two-phase exchange (LayerConfig::nodes) on the host backend against the one-domain layer on the
// same routing: accepted set, dgates and weight gradients bitwise (owners see the same streams);
// y and dx within fp32 reassociation (a relay reduces a token's rows on its node first, the source
// adds node partials in node order); node-limited routing; the inter-node rows are exactly one per
// (token, remote node with an accepted row); bad node configurations and tokens over the cap.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

struct NodeCase {
  int32_t nodes, per_node, max_nodes;
  int64_t experts = 0;           // 0 = 4 per rank (a node then holds at least K = 4)
  double capacity_factor = 0;
  int64_t segment = 0;
  std::string routing = "zipf:1.2";
};

void PrintTo(const NodeCase& c, std::ostream* os) {
  *os << "N" << c.nodes << "_G" << c.per_node << "_M" << c.max_nodes << "_E" << c.experts << "_cf" << c.capacity_factor << "_S"
      << c.segment << "_" << c.routing;
}

struct Out {
  std::vector<std::vector<float>> y, dx, dg, dw1, dw2;
  std::vector<RankAcceptance> acc;
  std::vector<NodeTraffic> traffic;
};

LayerShape ShapeOf(const NodeCase& c) {
  const int64_t W = c.nodes * c.per_node;
  return LayerShape{.tokens = 24, .hidden = 10, .ffn = 6, .experts = c.experts ? c.experts : 4 * W, .topk = 4, .ranks = W};
}

Out RunLayer(const LayerShape& s, const LayerConfig& cfg, const Routing& rt) {
  auto domain = std::move(*HostDomain::Create(s.ranks, {.barrier_timeout_s = 10}));
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  auto layer_or = HostMoELayer::Create(*domain, cfg, own, RandomWeights(s, 3));
  EXPECT_TRUE(layer_or.ok()) << layer_or.status();
  auto layer = std::move(*layer_or);
  const auto x = RandomActivations(s, rt, 4), dy = RandomActivations(s, rt, 5);
  const auto W = static_cast<size_t>(s.ranks);
  Out o;
  o.y.resize(W), o.dx.resize(W), o.dg.resize(W), o.dw1.resize(W), o.dw2.resize(W), o.acc.resize(W), o.traffic.resize(W);
  Status st = domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    o.y[i].assign(x[i].size(), NAN);
    o.dx[i].assign(x[i].size(), NAN);
    o.dg[i].assign(static_cast<size_t>(rt[i].num_tokens * s.topk), NAN);
    RDEP_RETURN_IF_ERROR(layer->Forward(r, rt[i], x[i], o.y[i]));
    RDEP_RETURN_IF_ERROR(layer->Backward(r, dy[i], o.dx[i], o.dg[i]));
    return Status::Ok();
  });
  EXPECT_TRUE(st.ok()) << st;
  for (int32_t r = 0; r < s.ranks; ++r) {
    const auto i = static_cast<size_t>(r);
    o.dw1[i].assign(layer->dw1(r).begin(), layer->dw1(r).end());
    o.dw2[i].assign(layer->dw2(r).begin(), layer->dw2(r).end());
    o.acc[i] = layer->acceptance(r);
    o.traffic[i] = layer->node_traffic(r);
  }
  return o;
}

bool Bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// |a - b| <= 1e-5 * max|b| elementwise (fp32 reassociation of at most K terms).
void ExpectClose(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  float scale = 0;
  for (float v : b) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < a.size(); ++i) ASSERT_LE(std::abs(a[i] - b[i]), 1e-5f * scale) << what << " element " << i;
}

std::vector<int32_t> NodeOfExpert(const LayerShape& s, int32_t per_node) {
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  std::vector<int32_t> node(static_cast<size_t>(s.experts));
  for (int32_t e = 0; e < s.experts; ++e) node[static_cast<size_t>(e)] = own.owner(e) / per_node;
  return node;
}

class HostTwoPhase : public ::testing::TestWithParam<NodeCase> {};

TEST_P(HostTwoPhase, AgreesWithTheOneDomainLayer) {
  const NodeCase c = GetParam();
  const LayerShape s = ShapeOf(c);
  Routing rt = *GenerateRouting(s, *RoutingSpec::Parse(c.routing));
  const std::vector<int32_t> node = NodeOfExpert(s, c.per_node);
  const int32_t cap = c.max_nodes > 0 ? c.max_nodes : c.nodes;
  if (cap < c.nodes) {
    ASSERT_TRUE(LimitRoutingNodes(rt, node, cap).ok());
  }
  for (const auto& r : rt) ASSERT_TRUE(CheckNodeLimit(r, node, cap).ok());

  LayerConfig one = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
  LayerConfig two = one;
  two.nodes = NodeConfig{.nodes = c.nodes, .max_nodes = c.max_nodes};
  const Out a = RunLayer(s, one, rt), b = RunLayer(s, two, rt);
  int64_t expect_inter = 0, sent = 0, combined = 0;
  for (int64_t r = 0; r < s.ranks; ++r) {
    const auto i = static_cast<size_t>(r);
    const std::string at = " on rank " + std::to_string(r);
    EXPECT_EQ(b.acc[i].accepted, a.acc[i].accepted) << "accepted set" << at;
    EXPECT_TRUE(Bitwise(b.dg[i], a.dg[i])) << "dgates" << at;
    EXPECT_TRUE(Bitwise(b.dw1[i], a.dw1[i])) << "dW1" << at;
    EXPECT_TRUE(Bitwise(b.dw2[i], a.dw2[i])) << "dW2" << at;
    ExpectClose(b.y[i], a.y[i], "y" + at);
    ExpectClose(b.dx[i], a.dx[i], "dx" + at);
    // One inter-node row per (token, remote node holding an accepted row of it).
    const int32_t home = static_cast<int32_t>(r) / c.per_node;
    for (int64_t t = 0; t < rt[i].num_tokens; ++t) {
      std::vector<int32_t> remote;
      for (int64_t k = 0; k < s.topk; ++k) {
        const auto idx = static_cast<size_t>(t * s.topk + k);
        const int32_t nd = node[static_cast<size_t>(rt[i].experts[idx])];
        if (a.acc[i].accepted[idx] && nd != home && std::find(remote.begin(), remote.end(), nd) == remote.end()) remote.push_back(nd);
      }
      expect_inter += static_cast<int64_t>(remote.size());
    }
    sent += b.traffic[i].inter_dispatch_rows;
    combined += b.traffic[i].inter_combine_rows;
    EXPECT_EQ(b.traffic[i].inter_dispatch_bytes > 0, b.traffic[i].inter_dispatch_rows > 0) << at;
  }
  EXPECT_EQ(sent, expect_inter);
  EXPECT_EQ(combined, expect_inter);  // every row that crossed comes back once, reduced
  if (c.nodes > 1 && c.routing != "one-expert") {
    EXPECT_GT(sent, 0);
  }
}

std::vector<NodeCase> Cases() {
  std::vector<NodeCase> v;
  for (int32_t N : {2, 3, 4})
    for (int32_t G : {1, 2, 4})
      for (int32_t M : {1, 2, N})
        if (M <= N && !(M == 2 && N == 2)) v.push_back(NodeCase{N, G, M == N ? 0 : M});
  v.push_back(NodeCase{2, 2, 0, 13});                       // experts not divisible by ranks or nodes
  v.push_back(NodeCase{3, 2, 2, 0, 0.8});                   // capacity drops
  v.push_back(NodeCase{2, 4, 0, 0, 0, 5});                  // small segments
  v.push_back(NodeCase{4, 2, 2, 0, 1.0, 7, "one-expert"});  // all tokens to one expert set, drops, segments
  v.push_back(NodeCase{4, 1, 0, 0, 0, 0, "uniform"});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Nodes, HostTwoPhase, ::testing::ValuesIn(Cases()), [](const ::testing::TestParamInfo<NodeCase>& p) {
  const NodeCase& c = p.param;
  std::string name = "N" + std::to_string(c.nodes) + "_G" + std::to_string(c.per_node) + "_M" +
                     std::to_string(c.max_nodes ? c.max_nodes : c.nodes);
  if (c.experts) name += "_E" + std::to_string(c.experts);
  if (c.capacity_factor > 0) name += "_drops";
  if (c.segment) name += "_S" + std::to_string(c.segment);
  if (c.routing != "zipf:1.2") name += c.routing == "one-expert" ? "_one_expert" : "_uniform";
  return name;
});

TEST(HostTwoPhaseNodeSplit, SegmentSizeChangesNothingAndSplitsAgreeToRounding) {
  const NodeCase c{2, 2, 0};
  const LayerShape s = ShapeOf(c);  // W = 4
  const Routing rt = *GenerateRouting(s, *RoutingSpec::Parse("zipf:1"));
  LayerConfig a = MakeLayerConfig(s), b = MakeLayerConfig(s, {}, 3), d = MakeLayerConfig(s);
  a.nodes = b.nodes = NodeConfig{.nodes = 2};
  d.nodes = NodeConfig{.nodes = 4};
  const Out x = RunLayer(s, a, rt), y = RunLayer(s, b, rt), z = RunLayer(s, d, rt);
  for (size_t r = 0; r < x.y.size(); ++r) {
    EXPECT_TRUE(Bitwise(x.y[r], y.y[r]) && Bitwise(x.dx[r], y.dx[r]) && Bitwise(x.dw1[r], y.dw1[r])) << "segment size, rank " << r;
    ExpectClose(z.y[r], x.y[r], "4 nodes vs 2, y rank " + std::to_string(r));
    EXPECT_TRUE(Bitwise(z.dw1[r], x.dw1[r]) && Bitwise(z.dg[r], x.dg[r])) << "4 nodes vs 2, rank " << r;
  }
}

TEST(HostTwoPhaseErrors, BadNodeConfigurationsAndTokensOverTheCap) {
  const LayerShape s{.tokens = 8, .hidden = 8, .ffn = 4, .experts = 12, .topk = 3, .ranks = 6};
  auto domain = std::move(*HostDomain::Create(6, {.barrier_timeout_s = 10}));
  const OwnershipMap own = *OwnershipMap::Contiguous(12, 6);
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.nodes = NodeConfig{.nodes = 4};
  EXPECT_NE(HostMoELayer::Create(*domain, cfg, own).status().message().find("N=4 must be >= 1 and divide W=6"), std::string::npos);
  cfg.nodes = NodeConfig{.nodes = 3, .max_nodes = 4};
  EXPECT_NE(HostMoELayer::Create(*domain, cfg, own).status().message().find("M=4 must be in [1, N=3]"), std::string::npos);
  cfg.nodes = NodeConfig{.nodes = 3, .max_nodes = 1};
  cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp};
  EXPECT_NE(HostMoELayer::Create(*domain, cfg, own).status().message().find("not supported yet"), std::string::npos);
  cfg.balance = BalanceConfig{};
  auto layer = std::move(*HostMoELayer::Create(*domain, cfg, own, RandomWeights(s, 1)));
  // Token 2 of rank 1 picks experts 0, 4, 8: owners 0, 2, 4, i.e. nodes 0, 1, 2 with a cap of 1.
  Routing rt = *GenerateRouting(s, *RoutingSpec::Parse("one-expert"));  // experts 0,1,2: node 0 only
  rt[1].experts[2 * 3 + 1] = 4;
  rt[1].experts[2 * 3 + 2] = 8;
  const auto x = RandomActivations(s, rt, 2);
  Status st = domain->Run([&](int32_t r) -> Status {
    std::vector<float> y(x[static_cast<size_t>(r)].size());
    return layer->Forward(r, rt[static_cast<size_t>(r)], x[static_cast<size_t>(r)], y);
  });
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rank 1: routing: token 2 has experts on 3 nodes (0,1,2), more than the node cap M=1"),
            std::string::npos) << st;
}

TEST(LimitRoutingNodes, KeepsTheFirstNodesAndRefusesWhatCannotFit) {
  const LayerShape s{.tokens = 32, .hidden = 8, .ffn = 4, .experts = 16, .topk = 4, .ranks = 4};
  Routing rt = *GenerateRouting(s, *RoutingSpec::Parse("uniform"));
  const Routing before = rt;
  const std::vector<int32_t> node = NodeOfExpert(s, 1);  // 4 nodes of 4 experts
  ASSERT_TRUE(LimitRoutingNodes(rt, node, 2).ok());
  for (size_t r = 0; r < rt.size(); ++r) {
    EXPECT_TRUE(CheckNodeLimit(rt[r], node, 2).ok());
    EXPECT_TRUE(rt[r].Validate(s).ok());             // still K distinct experts per token
    EXPECT_EQ(rt[r].gates, before[r].gates);         // gates unchanged
    EXPECT_EQ(rt[r].experts[0], before[r].experts[0]);  // the first slot's node is always kept
  }
  Routing again = before;
  EXPECT_NE(LimitRoutingNodes(again, std::vector<int32_t>(16, 0), 1).message(), "x");  // one node: nothing to change
  const std::vector<int32_t> tiny{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};  // 4 experts per node
  Routing k4 = before;
  EXPECT_TRUE(LimitRoutingNodes(k4, tiny, 1).ok());  // K = 4 fits in one node of 4
  const LayerShape s5{.tokens = 8, .hidden = 8, .ffn = 4, .experts = 16, .topk = 5, .ranks = 4};
  Routing k5 = *GenerateRouting(s5, *RoutingSpec::Parse("uniform"));
  EXPECT_NE(LimitRoutingNodes(k5, tiny, 1).message().find("K=5 experts do not fit on M=1 nodes"), std::string::npos);
}

}  // namespace
}  // namespace rdep
