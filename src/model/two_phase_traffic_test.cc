// PredictTwoPhaseTraffic on hand-made routings whose per-rank, per-phase counts are worked out in the
// comments, plus a statistical tie to the uniform closed form and the bad inputs.
#include "rdep/model/two_phase_traffic.h"

#include <gtest/gtest.h>

#include <cmath>

namespace rdep::model {
namespace {

// Distinct sizes per term, so a wrong term shows in the bytes.
constexpr TwoPhaseWire kWire{.bundle = 1000, .entry = 100, .row = 10, .combine = 7, .pair = 50, .intra_row = 3, .return_row = 2};

RankRouting Tokens(int64_t K, std::vector<int32_t> experts) {
  RankRouting r;
  r.topk = K;
  r.num_tokens = static_cast<int64_t>(experts.size()) / K;
  r.gates.assign(experts.size(), 1.f / static_cast<float>(K));
  r.experts = std::move(experts);
  return r;
}
RankAcceptance Accept(std::vector<uint8_t> a) { return RankAcceptance{std::move(a), {}, 0}; }

// W = 4 ranks, E = 4 experts (expert e on rank e), N = 2 nodes of G = 2, K = 3.
//   rank 0 (node 0, local 0): t0 -> {0, 2, 3}; t1 -> {1, 3, 2} with expert 2 dropped
//   rank 3 (node 1, local 1): t0 -> {0, 1, 3}; t1 -> {2, 0, 1} all dropped
//   ranks 1 and 2: no tokens
// rank 0 t0: bundle to node 1 (relay 2) with owners 2, 3 (1 row each): 1000+2*100+2*10 = 1220 B;
//   relay 0 scatters to owner 0 (53 B), relay 2 to owners 2, 3 (2*53 B); relay 2 combines 7 B.
// rank 0 t1: bundle to node 1 (owner 3, 1 row): 1110 B; relay 0 -> owner 1, relay 2 -> owner 3.
// rank 3 t0: bundle to node 0 (relay 1, owners 0 and 1): 1220 B; relay 3 (itself) -> owner 3.
TEST(TwoPhaseTraffic, W4_N2_K3_HandCounted) {
  const Routing routing{Tokens(3, {0, 2, 3, 1, 3, 2}), Tokens(3, {}), Tokens(3, {}), Tokens(3, {0, 1, 3, 2, 0, 1})};
  const std::vector<RankAcceptance> acc{Accept({1, 1, 1, 1, 1, 0}), Accept({}), Accept({}), Accept({1, 1, 1, 0, 0, 0})};
  auto own = OwnershipMap::Contiguous(4, 4);
  ASSERT_TRUE(own.ok());
  auto t = PredictTwoPhaseTraffic(routing, acc, *own, 2, kWire);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->size(), 4u);
  // {inter dispatch rows, bytes, intra dispatch rows, bytes, return rows, bytes, combine rows, bytes}
  const std::vector<RankPhaseTraffic> want{
      {2, 2330, 2, 106, 2, 4, 0, 0},
      {0, 0, 2, 106, 2, 4, 1, 7},
      {0, 0, 3, 159, 1, 2, 2, 14},
      {1, 1220, 1, 53, 3, 6, 0, 0},
  };
  for (size_t r = 0; r < want.size(); ++r) EXPECT_EQ((*t)[r], want[r]) << "rank " << r << ": " << (*t)[r];
  EXPECT_EQ(FirstTrafficMismatch(*t, want), "");
  auto off = want;
  off[2].inter_combine_bytes = 21;
  EXPECT_EQ(FirstTrafficMismatch(*t, off), "rank 2, inter-node combine: bytes measured 14, rdep model predicts 21");
}

// One node: no inter-node traffic; each (token, owner) pair is scattered by its own source.
// N = W (G = 1): the relay on each node is its only rank, the owner.
TEST(TwoPhaseTraffic, W2_OneNodeAndOneRankPerNode) {
  const Routing routing{Tokens(2, {0, 1, 1, 1}), Tokens(2, {0, 0})};
  const std::vector<RankAcceptance> acc{Accept({1, 1, 1, 1}), Accept({1, 1})};
  auto own = OwnershipMap::Contiguous(2, 2);
  ASSERT_TRUE(own.ok());
  auto one = PredictTwoPhaseTraffic(routing, acc, *own, 1, kWire);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)[0], (RankPhaseTraffic{0, 0, 3, 3 * 50 + 4 * 3, 3, 6, 0, 0}));  // (t0,0) (t0,1) (t1,1: 2 rows)
  EXPECT_EQ((*one)[1], (RankPhaseTraffic{0, 0, 1, 50 + 2 * 3, 3, 6, 0, 0}));      // (t0,0: 2 rows)
  auto two = PredictTwoPhaseTraffic(routing, acc, *own, 2, kWire);
  ASSERT_TRUE(two.ok());
  // rank 0: bundles (t0: owner 1, 1 row) and (t1: owner 1, 2 rows) to node 1; it relays its own (t0, 0)
  // and rank 1's (t0, 0: 2 rows). rank 1: one bundle (t0: owner 0, 2 rows); it relays rank 0's pairs.
  EXPECT_EQ((*two)[0], (RankPhaseTraffic{2, 1110 + 1120, 2, 53 + 56, 3, 6, 1, 7}));
  EXPECT_EQ((*two)[1], (RankPhaseTraffic{1, 1120, 2, 53 + 56, 3, 6, 2, 14}));
}

// Uniform routing over E = 64 experts on N = 4 nodes (K = 6 distinct experts): the mean inter-node rows
// per rank approach T*(N-1)*(1 - C(E-E/N, K)/C(E, K)), the exact expectation for distinct picks.
TEST(TwoPhaseTraffic, UniformRoutingMeetsTheExpectation) {
  LayerShape s;
  s.ranks = 8, s.tokens = 2048, s.hidden = 8, s.ffn = 8, s.experts = 64, s.topk = 6;
  auto routing = GenerateRouting(s, RoutingSpec{});
  ASSERT_TRUE(routing.ok());
  std::vector<RankAcceptance> acc;
  for (const auto& rr : *routing) acc.push_back(Accept(std::vector<uint8_t>(rr.experts.size(), 1)));
  auto own = OwnershipMap::Contiguous(64, 8);
  ASSERT_TRUE(own.ok());
  auto t = PredictTwoPhaseTraffic(*routing, acc, *own, 4, kWire);
  ASSERT_TRUE(t.ok());
  double rows = 0;
  for (const auto& r : *t) rows += static_cast<double>(r.inter_dispatch_rows);
  double miss = 1;
  for (int i = 0; i < 6; ++i) miss *= (48.0 - i) / (64.0 - i);
  EXPECT_NEAR(rows / 8, 2048 * 3 * (1 - miss), 0.02 * 2048 * 3 * (1 - miss));
}

TEST(TwoPhaseTraffic, BadInputNamesIt) {
  const Routing routing{Tokens(1, {0}), Tokens(1, {1}), Tokens(1, {2})};
  const std::vector<RankAcceptance> acc{Accept({1}), Accept({1}), Accept({1})};
  auto own = OwnershipMap::Contiguous(3, 3);
  ASSERT_TRUE(own.ok());
  EXPECT_NE(PredictTwoPhaseTraffic(routing, acc, *own, 2, kWire).status().message().find("nodes must divide W=3, got 2"),
            std::string::npos);
  EXPECT_NE(PredictTwoPhaseTraffic(routing, {acc[0]}, *own, 1, kWire).status().message().find("accepted sets for 1 ranks"),
            std::string::npos);
  const Routing bad{Tokens(1, {0}), Tokens(1, {7}), Tokens(1, {2})};
  EXPECT_NE(PredictTwoPhaseTraffic(bad, acc, *own, 1, kWire).status().message().find("rank 1 routes to expert 7"), std::string::npos);
}

}  // namespace
}  // namespace rdep::model
