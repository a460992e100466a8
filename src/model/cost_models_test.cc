// Cost-model tests: each worked number of the seeds is asserted with a tolerance matching how the seed
// rounds it (e.g. "about 42 MB" -> +-0.5 MB). Where the seed's number does not follow from its own
// formula, the test says so and asserts the formula.
#include "rdep/model/cost_models.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace rdep::model {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

TEST(CostModelPooling, MoonlightMuAndCv) {
  // Seeds 000 line "single-replica value is only 384 rows per expert" (T=4096, K=6, E=64).
  auto p = Pooling(8, 4096, 6, 64);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->mu_single, 384.0);
  EXPECT_DOUBLE_EQ(p->mu, 3072.0);
  EXPECT_NEAR(p->cv, std::sqrt((1 - 6.0 / 64) / 3072), 1e-15);
  // CV falls by 1/sqrt(DP) (eq. 14).
  EXPECT_NEAR(p->cv_single / p->cv, std::sqrt(8.0), 1e-12);
  EXPECT_NE(Pooling(8, 4096, 65, 64).status().message().find("topk (65) exceeds experts (64)"), std::string::npos);
  EXPECT_NE(Pooling(0, 4096, 6, 64).status().message().find("dp must be > 0"), std::string::npos);
}

TEST(CostModelCapacity, ChernoffBoundAndSlackAreInverse) {
  // mu = 3072, E = 64, beta = 0.1: 64 * exp(-3072 * 0.01 / 3) = 64 * exp(-10.24).
  auto b = ChernoffOverflowBound(64, 3072, 0.1);
  ASSERT_TRUE(b.ok());
  EXPECT_NEAR(*b, 64 * std::exp(-10.24), 1e-15);
  auto beta = ChernoffSlack(64, 3072, 0.01);
  ASSERT_TRUE(beta.ok());
  EXPECT_NEAR(*ChernoffOverflowBound(64, 3072, *beta), 0.01, 1e-12);
  // The same slack buys more protection as mu rises (pooling helps capacity).
  EXPECT_LT(*ChernoffOverflowBound(64, 4 * 3072, 0.1), *ChernoffOverflowBound(64, 3072, 0.1));
  EXPECT_DOUBLE_EQ(*ChernoffOverflowBound(64, 384, 0.0), 1.0);  // clamped
  EXPECT_FALSE(ChernoffSlack(64, 3072, 1.5).ok());
  EXPECT_FALSE(ChernoffOverflowBound(64, -1, 0.1).ok());
}

TEST(CostModelPadding, GroupedLaunchInflation) {
  EXPECT_DOUBLE_EQ(*GroupedLaunchInflation(std::vector<int64_t>{384, 384, 384, 384}), 1.0);
  EXPECT_DOUBLE_EQ(*GroupedLaunchInflation(std::vector<int64_t>{4, 1, 1, 2}), 4.0 * 4 / 8);
  EXPECT_FALSE(GroupedLaunchInflation(std::vector<int64_t>{}).ok());
  EXPECT_NE(GroupedLaunchInflation(std::vector<int64_t>{1, -2}).status().message().find("count 1 is negative"),
            std::string::npos);
}

TEST(CostModelMemory, RoutingContext42MBAnd9p1GB) {
  // Seeds 000 eq. 20: "about 42 MB per GPU" and "about 9.1 GB per GPU" (decimal units).
  auto small = RoutingContextBytes(27, 8, 4096, 6);
  ASSERT_TRUE(small.ok());
  EXPECT_DOUBLE_EQ(*small, 42467328.0);
  EXPECT_NEAR(*small / 1e6, 42.0, 0.5);
  auto large = RoutingContextBytes(60, 72, 32768, 8);
  ASSERT_TRUE(large.ok());
  EXPECT_NEAR(*large / 1e9, 9.1, 0.05);
  EXPECT_FALSE(RoutingContextBytes(27, 8, 4096, 0).ok());
}

TEST(CostModelMemory, PayloadTable4BulkVsSegmented) {
  // Seeds 000 Table 4 at H = 2048, 27 layers: bulk ~3.1 GiB/layer, ~84 GiB; segmented (S = 4096,
  // double buffered) ~0.13 GiB/layer, ~3.4 GiB. Model: 4 symmetric bf16 tensors per layer.
  auto m = SymmetricPayloadMemory({});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(std::round(100 * m->segmented_bytes_per_layer / kGiB), 13);  // 0.125 GiB prints as 0.13
  EXPECT_NEAR(m->segmented_bytes / kGiB, 3.4, 0.05);              // 3.375
  // Bulk: the 4-tensor model at M_cap = 192K = 196,608 rows gives 3.0 GiB/layer and 81 GiB; the
  // seed prints ~3.1 and ~84 (3.7% higher; the extra is not derivable from the stated inputs).
  EXPECT_DOUBLE_EQ(m->bulk_bytes_per_layer / kGiB, 3.0);
  EXPECT_NEAR(m->bulk_bytes_per_layer / kGiB, 3.1, 0.04 * 3.1);
  EXPECT_NEAR(m->bulk_bytes / kGiB, 84.0, 0.04 * 84.0);
  EXPECT_NEAR(m->bulk_bytes / m->segmented_bytes, 84.0 / 3.4, 0.04 * 84.0 / 3.4);
  PayloadMemoryArgs bad;
  bad.segment_rows = 0;
  EXPECT_NE(SymmetricPayloadMemory(bad).status().message().find("segment rows must be > 0"), std::string::npos);
}

TEST(CostModelDense, LowerBounds1p38To1p77AndTen47) {
  // Seeds 000 eq. 21: 2880-wide family, V = 201,088, L in {24, 36}, no dense FFN layers -> 1.38B-1.77B.
  auto a = DenseLowerBound(201088, 2880, 24, 0, 0);
  auto b = DenseLowerBound(201088, 2880, 36, 0, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(*a / 1e9, 1.38, 0.005);
  EXPECT_NEAR(*b / 1e9, 1.77, 0.005);
  // 7168-wide family, L = 42, D_dense = 18,432 -> 10.47B. The seed does not state V and L_dense for
  // this family; V = 201,088 (as above) with one dense FFN layer gives 10.4696B.
  auto c = DenseLowerBound(201088, 7168, 42, 1, 18432);
  ASSERT_TRUE(c.ok());
  EXPECT_NEAR(*c / 1e9, 10.47, 0.005);
  EXPECT_FALSE(DenseLowerBound(201088, 7168, 42, 43, 18432).ok());
  EXPECT_FALSE(DenseLowerBound(201088, 7168, 42, 1, 0).ok());
}

TEST(CostModelBarrier, Width72Budget) {
  // Seeds 000 section 4.5: 50-100 ns per peer -> 3.6-7.2 us at W = 72; four barriers ~14-29 us.
  auto b = Barrier(72, 50, 100);
  ASSERT_TRUE(b.ok());
  EXPECT_NEAR(b->barrier_min_s * 1e6, 3.6, 1e-9);
  EXPECT_NEAR(b->barrier_max_s * 1e6, 7.2, 1e-9);
  EXPECT_NEAR(b->segment_min_s * 1e6, 14.0, 0.5);
  EXPECT_NEAR(b->segment_max_s * 1e6, 29.0, 0.5);
  EXPECT_FALSE(Barrier(72, 100, 50).ok());
}

TEST(CostModelCrossNode, DistinctNodes5p25) {
  // Seeds 004: N = 8, k = 8 -> about 5.25 distinct nodes (8 * 0.656).
  auto d = ExpectedDistinctNodes(8, 8);
  ASSERT_TRUE(d.ok());
  EXPECT_NEAR(*d, 5.25, 0.005);
  EXPECT_NEAR(1 - *d / 8, std::pow(7.0 / 8.0, 8), 1e-15);
  EXPECT_DOUBLE_EQ(*ExpectedDistinctNodes(1, 8), 1.0);
  EXPECT_DOUBLE_EQ(*ExpectedDistinctNodes(8, 1), 1.0);
}

TEST(CostModelCrossNode, CaseAUnconstrainedAndCaseBWithM4) {
  CrossNodeArgs a;  // N = 8, k = 8, T = 4096, d = 7168, b = 2, 50 GB/s IB, 600 GB/s NVLink
  auto ua = CrossNodeDispatch(a);
  ASSERT_TRUE(ua.ok());
  // Case A: 4.25 remote hops, 17,408 rows (the seed rounds 4.2511 to 4.25 first), ~250 MB per
  // dispatch, 500 MB round trip, ~10 ms at 50 GB/s.
  EXPECT_NEAR(ua->remote_nodes, 4.25, 0.005);
  EXPECT_NEAR(ua->ib_rows, 17408, 0.001 * 17408);
  EXPECT_NEAR(ua->ib_bytes / 1e6, 250, 0.5);
  EXPECT_NEAR(ua->ib_round_trip_bytes / 1e6, 500, 1.0);
  EXPECT_NEAR(ua->ib_time_s * 1e3, 10, 0.05);
  // The intro's per-slot estimate: 4096 * 8 * 0.875 * 14 KB ~ 400 MB, doubled at 50 GB/s ~ 16 ms.
  EXPECT_NEAR(ua->naive_ib_bytes / 1e6, 400, 0.03 * 400);
  EXPECT_NEAR(2 * ua->naive_ib_bytes / 50e9 * 1e3, 16, 0.5);
  // Case B: M = 4 -> 3 remote hops, 12,288 rows, ~176 MB, 352 MB round trip, ~7 ms.
  a.max_nodes = 4;
  auto ub = CrossNodeDispatch(a);
  ASSERT_TRUE(ub.ok());
  EXPECT_DOUBLE_EQ(ub->remote_nodes, 3.0);
  EXPECT_DOUBLE_EQ(ub->ib_rows, 12288.0);
  EXPECT_DOUBLE_EQ(ub->ib_bytes, 12288.0 * 7168 * 2);
  EXPECT_NEAR(ub->ib_bytes / 1e6, 176, 0.5);
  EXPECT_NEAR(ub->ib_round_trip_bytes / 1e6, 352, 1.0);
  EXPECT_NEAR(ub->ib_time_s * 1e3, 7, 0.1);
  // "~30% reduction in IB time".
  EXPECT_NEAR(1 - ub->ib_time_s / ua->ib_time_s, 0.30, 0.01);
  // Sanity check: NVLink moves 5/3 ~ 1.7x the rows of IB; at 12x the bandwidth its time is ~0.14 of IB's.
  EXPECT_NEAR(ub->nvlink_rows / ub->ib_rows, 1.7, 0.05);
  EXPECT_NEAR(ub->nvlink_time_s / ub->ib_time_s, 0.14, 0.005);
  EXPECT_DOUBLE_EQ(ub->wall_time_s, ub->ib_time_s);
  // Cap above the unconstrained expectation changes nothing; M = 1 sends nothing over IB.
  a.max_nodes = 8;
  EXPECT_DOUBLE_EQ(CrossNodeDispatch(a)->ib_bytes, ua->ib_bytes);
  a.max_nodes = 1;
  EXPECT_DOUBLE_EQ(CrossNodeDispatch(a)->ib_bytes, 0.0);
  // Independent of N once capped.
  a.max_nodes = 4;
  a.nodes = 16;
  EXPECT_DOUBLE_EQ(CrossNodeDispatch(a)->ib_rows, 12288.0);
  a.max_nodes = 17;
  EXPECT_NE(CrossNodeDispatch(a).status().message().find("max nodes (17) is larger than nodes (16)"), std::string::npos);
}

TEST(CostModelCrossNode, NodeCapForBudget) {
  CrossNodeArgs a;
  // Round-trip IB at 50 GB/s: M=4 7.05 ms, M=5 9.40 ms, M=6 ~10 ms (5.25 distinct < 6, so same as
  // unconstrained: 9.98 ms). A 10 ms budget fits even unconstrained routing -> M = N = 8.
  EXPECT_EQ(*NodeCapForBudget(a, 10e-3), 8);
  EXPECT_EQ(*NodeCapForBudget(a, 9.5e-3), 5);
  EXPECT_EQ(*NodeCapForBudget(a, 7.1e-3), 4);
  EXPECT_EQ(*NodeCapForBudget(a, 0.0), 1);
  EXPECT_FALSE(NodeCapForBudget(a, -1).ok());
}

// Moonlight at W = 4: P(owner hit) = 1 - C(48,6)/C(64,6) = 0.8363; 2.509 remote owners per token;
// 4096 tokens x 2.509 x 4 KiB = 42.1 MB, 109 us at 386 GB/s (issue 19's ~110 us floor).
TEST(CostModelTransport, MoonlightW4FloorAndDeduplication) {
  auto t = IntraDomainTransport({});
  ASSERT_TRUE(t.ok()) << t.status();
  const double hit = 1 - (48.0 * 47 * 46 * 45 * 44 * 43) / (64.0 * 63 * 62 * 61 * 60 * 59);
  EXPECT_NEAR(t->owners_per_token, 4 * hit, 1e-12);
  EXPECT_NEAR(t->remote_owners_per_token, 3 * hit, 1e-12);
  EXPECT_NEAR(t->dispatch_bytes, 4096 * 3 * hit * 2048 * 2, 1e-3);
  EXPECT_NEAR(t->dispatch_time_s * 1e6, 109.3, 0.5);
  EXPECT_NEAR(t->slot_rows, 4096 * 6 * 0.75, 1e-9);
  EXPECT_NEAR(t->combine_slot_bytes, 4096 * 6 * 0.75 * 4096, 1e-3);
  EXPECT_DOUBLE_EQ(t->combine_reduced_bytes, t->dispatch_bytes);
  EXPECT_NEAR(t->dedup_saving, 6 * 0.75 / (3 * hit), 1e-12);
}

// Uneven ownership (E = 6 over W = 4: two ranks own 2, two own 1), one rank, and one expert per rank
// with K = E (every token reaches every owner).
TEST(CostModelTransport, UnevenOwnershipAndEdges) {
  TransportArgs a;
  a.ranks = 4;
  a.experts = 6;
  a.topk = 2;
  auto t = IntraDomainTransport(a);
  ASSERT_TRUE(t.ok()) << t.status();
  const double miss2 = (4.0 / 6) * (3.0 / 5), miss1 = (5.0 / 6) * (4.0 / 5);
  EXPECT_NEAR(t->owners_per_token, 2 * (1 - miss2) + 2 * (1 - miss1), 1e-12);
  a.ranks = 1;
  t = IntraDomainTransport(a);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->dispatch_bytes, 0);
  EXPECT_EQ(t->dedup_saving, 1);
  a.ranks = 4;
  a.experts = 4;
  a.topk = 4;
  t = IntraDomainTransport(a);
  ASSERT_TRUE(t.ok());
  EXPECT_DOUBLE_EQ(t->owners_per_token, 4);
  EXPECT_DOUBLE_EQ(t->dedup_saving, 1);
  a.topk = 5;
  EXPECT_NE(IntraDomainTransport(a).status().message().find("topk (5) is larger than experts (4)"), std::string::npos);
  a.topk = 1;
  a.peer_gbps = 0;
  EXPECT_NE(IntraDomainTransport(a).status().message().find("peer bandwidth"), std::string::npos);
}

}  // namespace
}  // namespace rdep::model
