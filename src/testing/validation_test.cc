// The validation matrix over the paper's shapes and the odd cases: every check must pass.
#include "rdep/testing/validation.h"

#include <gtest/gtest.h>

#include <cmath>

namespace rdep {
namespace {

struct Case {
  const char* name;
  LayerShape shape;
  const char* routing;
  double capacity;
  int64_t segment;
  int64_t empty_rank;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class HostValidation : public ::testing::TestWithParam<Case> {};

TEST_P(HostValidation, AllChecksPass) {
  const Case& c = GetParam();
  ValidationOptions o;
  o.layer.shape = c.shape;
  o.layer.capacity.capacity_factor = c.capacity;
  o.layer.segment_tokens = c.segment;
  auto spec = RoutingSpec::Parse(c.routing);
  ASSERT_TRUE(spec.ok());
  o.routing = *spec;
  o.routing.seed = 11;
  o.routing.empty_rank = c.empty_rank;
  o.seed = 5;
  auto rep = RunHostValidation(o);
  ASSERT_TRUE(rep.ok()) << rep.status();
  for (const auto& check : rep->checks) EXPECT_TRUE(check.passed) << c.name << ": " << check.name << ": " << check.detail;
  EXPECT_TRUE(rep->passed());
  EXPECT_EQ(rep->checks.size(), 6u);
  if (c.capacity > 0 && std::string(c.routing) != "uniform") {
    EXPECT_GT(rep->dropped_rows, 0) << "capacity case must exercise drops";
  }
}

LayerShape S(int64_t W, int64_t T, int64_t H, int64_t F, int64_t E, int64_t K) {
  return LayerShape{.tokens = T, .hidden = H, .ffn = F, .experts = E, .topk = K, .ranks = W};
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, HostValidation,
    ::testing::Values(
        // The paper's invariants shape (T=256, H=256, E_loc=8) at W=4, K in {2,4}.
        Case{"W4_T256_H256_Eloc8_K2", S(4, 256, 256, 32, 32, 2), "uniform", 0, 0, -1},
        Case{"W4_T256_H256_Eloc8_K4", S(4, 256, 256, 32, 32, 4), "uniform", 0, 100, -1},
        // The paper's gradient-parity shape (T=16, H=64, D_ff=128, E_loc=8).
        Case{"W4_T16_H64_F128_Eloc8_K2", S(4, 16, 64, 128, 32, 2), "uniform", 0, 0, -1},
        Case{"W4_T16_H64_F128_Eloc8_K4", S(4, 16, 64, 128, 32, 4), "zipf:1", 0, 5, -1},
        // Odd shapes.
        Case{"E_not_divisible_by_W", S(3, 24, 16, 8, 10, 3), "uniform", 0, 7, -1},
        Case{"K1", S(4, 32, 16, 8, 8, 1), "uniform", 0, 0, -1},
        Case{"K_equals_E", S(2, 16, 16, 8, 4, 4), "uniform", 0, 3, -1},
        Case{"W1", S(1, 32, 16, 8, 4, 2), "uniform", 0, 0, -1},
        Case{"W72_E128", S(72, 4, 8, 4, 128, 2), "uniform", 0, 0, -1},
        Case{"fewer_experts_than_ranks", S(4, 16, 8, 4, 3, 2), "uniform", 0, 0, -1},
        Case{"zero_tokens_on_a_rank", S(4, 32, 16, 8, 8, 2), "uniform", 0, 0, 2},
        Case{"all_tokens_to_one_expert", S(4, 32, 16, 8, 8, 2), "one-expert", 0, 16, -1},
        Case{"empty_experts", S(4, 32, 16, 8, 16, 3), "sparse", 0, 0, -1},
        Case{"capacity_drops_zipf", S(4, 64, 16, 8, 16, 4), "zipf:1.5", 0.8, 0, -1},
        Case{"capacity_drops_one_expert", S(4, 32, 16, 8, 8, 2), "one-expert", 1.0, 9, -1},
        Case{"tiny_segments", S(3, 20, 8, 4, 6, 2), "zipf:1.2", 0, 1, -1}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(HostValidationErrors, BadConfigurationsAreRejectedWithReasons) {
  ValidationOptions o;
  o.layer.shape = S(4, 16, 8, 8, 8, 9);  // K > E
  auto rep = RunHostValidation(o);
  ASSERT_FALSE(rep.ok());
  EXPECT_NE(rep.status().message().find("topk K must be <= experts E"), std::string::npos);
  o.layer.shape = S(4, 16, 8, 8, 8, 2);
  o.layer.capacity.capacity_factor = -1;
  EXPECT_NE(RunHostValidation(o).status().message().find("capacity factor"), std::string::npos);
  o.layer.capacity.capacity_factor = std::nan("");
  EXPECT_FALSE(RunHostValidation(o).ok());
  o.layer.capacity.capacity_factor = 0;
  o.routing.empty_rank = 4;
  EXPECT_NE(RunHostValidation(o).status().message().find("empty rank"), std::string::npos);
  o.routing.empty_rank = -1;
  o.layer.segment_tokens = -2;
  EXPECT_NE(RunHostValidation(o).status().message().find("segment"), std::string::npos);
}

// The size estimate of `rdep check`: small for the default, huge (not overflowed) for absurd shapes,
// and the largest term names the shape fields that make it large.
TEST(ValidationFootprint, GrowsWithTheShapeAndNamesTheLargestTerm) {
  ValidationOptions o;
  o.layer.shape = {64, 64, 128, 16, 4, 4};  // T, H, D_ff, E, K, W: rdep check's defaults
  const Footprint small = EstimateValidationFootprint(o, false);
  EXPECT_GT(small.host_bytes(), 1e6);
  EXPECT_LT(small.host_bytes(), 64e6);
  EXPECT_TRUE(small.device.empty());
  EXPECT_LT(small.operations(), 1e10);
  o.layer.shape.ffn = 99999999;
  const Footprint wide = EstimateValidationFootprint(o, false);
  EXPECT_GT(wide.host_bytes(), 1e12);
  const FootprintTerm* big = Footprint::Largest(wide.host);
  ASSERT_NE(big, nullptr);
  ASSERT_EQ(big->factors.size(), 3u);
  EXPECT_EQ(big->factors[2].first, "ffn");
  o.layer.shape = {int64_t{1} << 40, 1 << 20, 1 << 20, int64_t{1} << 30, 8, 4096};
  const Footprint absurd = EstimateValidationFootprint(o, true);
  EXPECT_TRUE(std::isfinite(absurd.host_bytes()));
  EXPECT_GT(absurd.host_bytes(), 1e20);
  EXPECT_FALSE(absurd.device.empty());
  EXPECT_GT(absurd.operations(), 1e20);
}

// The estimate is not below what a run really holds: the fp32 weights alone (E*3*H*D_ff floats)
// and the returned rows (W*T*K*H floats) are lower bounds it must exceed.
TEST(ValidationFootprint, CoversTheRunsOwnArrays) {
  ValidationOptions o;
  o.layer.shape = {128, 256, 512, 32, 4, 8};
  const Footprint fp = EstimateValidationFootprint(o, false);
  EXPECT_GT(fp.host_bytes(), 4.0 * 32 * 3 * 256 * 512 + 4.0 * 8 * 128 * 4 * 256);
}

// The segment payload and sideband: one buffer when a call is one segment (S >= W*T), else two, as
// RegionLayout::buffers allocates.
TEST(ValidationFootprint, CountsOneSegmentBufferWhenACallIsOneSegment) {
  auto segment_bytes = [](int64_t segment) {
    ValidationOptions o;
    o.layer.shape = {64, 32, 32, 8, 2, 4};  // T 64, W 4
    o.layer.segment_tokens = segment;
    for (const FootprintTerm& t : EstimateValidationFootprint(o, false).host)
      if (t.what.rfind("segment buffers", 0) == 0) return t.amount;
    return -1.0;
  };
  const double several = segment_bytes(128), one = segment_bytes(256);  // 256 = W*T
  ASSERT_GT(several, 0.0);
  EXPECT_DOUBLE_EQ(one, several);  // S doubles and the buffers halve
  EXPECT_DOUBLE_EQ(segment_bytes(512), 2.0 * one);  // one buffer of twice the tokens
  // The device term (one GPU of the CUDA backend; its default S is W*T): the same rule.
  auto device_bytes = [](int64_t segment) {
    ValidationOptions o;
    o.layer.shape = {64, 32, 32, 8, 2, 4};
    o.layer.segment_tokens = segment;
    for (const FootprintTerm& t : EstimateValidationFootprint(o, true).device)
      if (t.what.find("segment buffers") != std::string::npos) return t.amount;
    return -1.0;
  };
  ASSERT_GT(device_bytes(128), 0.0);
  EXPECT_DOUBLE_EQ(device_bytes(0), device_bytes(256));  // the default S = W*T: one buffer
  EXPECT_DOUBLE_EQ(device_bytes(256), device_bytes(128));
}

TEST(NormalizedError, ScalesAndCatchesNan) {
  EXPECT_LE(NormalizedError({1.0f, 2.0f}, {1.0, 2.0}, 1e-3, 1e-4), 0.0);
  EXPECT_GT(NormalizedError({1.1f}, {1.0}, 1e-3, 1e-4), 1.0);
  EXPECT_TRUE(std::isinf(NormalizedError({NAN}, {1.0}, 1e-3, 1e-4)));
  EXPECT_TRUE(std::isinf(NormalizedError({1.0f}, {1.0, 2.0}, 1e-3, 1e-4)));
}

}  // namespace
}  // namespace rdep

namespace rdep {
namespace {

// The matrix with balancing on (LayerConfig::balance): every check passes, including the placement of
// rows on the plan's replicas (dispatch invariants) and exactness against the layer without it.
struct BalancedCase {
  const char* name;
  LayerShape shape;
  const char* routing;
  BalanceKind kind;
  int32_t slots;
  double capacity;
  int64_t segment;
  int64_t empty_rank;
  bool expect_replicas;
};

void PrintTo(const BalancedCase& c, std::ostream* os) { *os << c.name; }

class BalancedValidation : public ::testing::TestWithParam<BalancedCase> {};

TEST_P(BalancedValidation, AllChecksPass) {
  const BalancedCase& c = GetParam();
  ValidationOptions o;
  o.layer.shape = c.shape;
  o.layer.capacity.capacity_factor = c.capacity;
  o.layer.segment_tokens = c.segment;
  o.layer.balance = BalanceConfig{.kind = c.kind, .num_slots = c.slots};
  o.routing = *RoutingSpec::Parse(c.routing);
  o.routing.seed = 3;
  o.routing.empty_rank = c.empty_rank;
  auto rep = RunHostValidation(o);
  ASSERT_TRUE(rep.ok()) << rep.status();
  for (const auto& check : rep->checks) EXPECT_TRUE(check.passed) << c.name << ": " << check.name << ": " << check.detail;
  EXPECT_EQ(rep->checks.size(), 7u);
  ASSERT_TRUE(rep->balanced);
  if (c.expect_replicas) {
    EXPECT_GT(rep->balance.replicas, 0);
    EXPECT_LT(rep->balance.imbalance_after, rep->balance.imbalance_before);
  }
  EXPECT_NE(rep->ToJson(o).find("\"weight_bytes_streamed\""), std::string::npos);
}

LayerShape Sb(int64_t W, int64_t T, int64_t H, int64_t F, int64_t E, int64_t K) {
  return LayerShape{.tokens = T, .hidden = H, .ffn = F, .experts = E, .topk = K, .ranks = W};
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, BalancedValidation,
    ::testing::Values(
        BalancedCase{"ultraep_zipf2", Sb(4, 64, 32, 16, 16, 4), "zipf:2", BalanceKind::kUltraEp, 2, 0, 0, -1, true},
        BalancedCase{"ultraep_zipf1_segments", Sb(4, 64, 32, 16, 16, 4), "zipf:1", BalanceKind::kUltraEp, 2, 0, 10, -1, true},
        BalancedCase{"ultraep_one_expert", Sb(4, 32, 16, 8, 8, 2), "one-expert", BalanceKind::kUltraEp, 2, 0, 0, -1, true},
        BalancedCase{"ultraep_capacity_drops", Sb(4, 64, 16, 8, 16, 4), "zipf:1.5", BalanceKind::kUltraEp, 2, 0.8, 0, -1, true},
        BalancedCase{"ultraep_E_not_divisible", Sb(3, 24, 16, 8, 10, 3), "zipf:2", BalanceKind::kUltraEp, 2, 0, 7, -1, true},
        BalancedCase{"ultraep_fewer_experts_than_ranks", Sb(4, 16, 8, 4, 3, 2), "zipf:2", BalanceKind::kUltraEp, 1, 0, 0, -1, true},
        BalancedCase{"ultraep_empty_rank", Sb(4, 32, 16, 8, 8, 2), "zipf:2", BalanceKind::kUltraEp, 2, 0, 0, 1, true},
        BalancedCase{"ultraep_W1", Sb(1, 32, 16, 8, 4, 2), "zipf:2", BalanceKind::kUltraEp, 1, 0, 0, -1, false},
        BalancedCase{"ultraep_W72_E128", Sb(72, 4, 8, 4, 128, 2), "zipf:2", BalanceKind::kUltraEp, 1, 0, 0, -1, true},
        BalancedCase{"ultraep_no_slots", Sb(4, 32, 16, 8, 8, 2), "zipf:2", BalanceKind::kUltraEp, 0, 0, 0, -1, false},
        BalancedCase{"eplb_zipf2", Sb(4, 64, 32, 16, 16, 4), "zipf:2", BalanceKind::kEplb, 2, 0, 0, -1, true},
        BalancedCase{"eplb_exact_drops_tiny_segments", Sb(4, 32, 16, 8, 16, 4), "zipf:2", BalanceKind::kEplbExact, 2, 1.0, 3, -1, true}),
    [](const ::testing::TestParamInfo<BalancedCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace rdep

namespace rdep {
namespace {

// The matrix with N nodes (LayerConfig::nodes): every check passes, including the two-phase run's
// agreement with the one-domain layer and its inter-node row count.
struct NodeValidationCase {
  const char* name;
  LayerShape shape;
  const char* routing;
  int32_t nodes, max_nodes;
  double capacity;
  int64_t segment;
  int64_t empty_rank;
};

void PrintTo(const NodeValidationCase& c, std::ostream* os) { *os << c.name; }

class NodeValidation : public ::testing::TestWithParam<NodeValidationCase> {};

TEST_P(NodeValidation, AllChecksPass) {
  const NodeValidationCase& c = GetParam();
  ValidationOptions o;
  o.layer.shape = c.shape;
  o.layer.capacity.capacity_factor = c.capacity;
  o.layer.segment_tokens = c.segment;
  o.layer.nodes = NodeConfig{c.nodes, c.max_nodes};
  o.routing = *RoutingSpec::Parse(c.routing);
  o.routing.seed = 9;
  o.routing.empty_rank = c.empty_rank;
  auto rep = RunHostValidation(o);
  ASSERT_TRUE(rep.ok()) << rep.status();
  for (const auto& check : rep->checks) EXPECT_TRUE(check.passed) << c.name << ": " << check.name << ": " << check.detail;
  EXPECT_EQ(rep->checks.size(), 8u);  // the six of one domain, two-phase traffic = rdep model, two-phase vs one domain
  ASSERT_EQ(rep->traffic.size(), static_cast<size_t>(c.shape.ranks));
  ASSERT_EQ(rep->traffic_model.size(), static_cast<size_t>(c.shape.ranks));
  for (size_t r = 0; r < rep->traffic.size(); ++r) EXPECT_EQ(rep->traffic[r].Counts(), rep->traffic_model[r]) << c.name << " rank " << r;
  int64_t sent = 0;
  for (const auto& t : rep->traffic) sent += t.inter_dispatch_rows;
  EXPECT_EQ(sent, rep->inter_rows_expected);
  EXPECT_GT(sent, 0);
  EXPECT_NE(rep->ToJson(o).find("\"two_phase\""), std::string::npos);
}

LayerShape Sn(int64_t W, int64_t T, int64_t H, int64_t F, int64_t E, int64_t K) {
  return LayerShape{.tokens = T, .hidden = H, .ffn = F, .experts = E, .topk = K, .ranks = W};
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, NodeValidation,
    ::testing::Values(NodeValidationCase{"N2_G2_uniform", Sn(4, 32, 16, 8, 16, 4), "uniform", 2, 0, 0, 0, -1},
                      NodeValidationCase{"N4_G2_M2_zipf", Sn(8, 32, 16, 8, 32, 4), "zipf:1.2", 4, 2, 0, 5, -1},
                      NodeValidationCase{"N3_G1_M1_drops", Sn(3, 32, 16, 8, 12, 3), "zipf:1.5", 3, 1, 0.8, 0, -1},
                      NodeValidationCase{"N2_G2_E_not_divisible_empty_rank", Sn(4, 24, 16, 8, 13, 3), "uniform", 2, 0, 0, 7, 1},
                      NodeValidationCase{"N4_G1_sparse", Sn(4, 32, 16, 8, 16, 2), "sparse", 4, 0, 0, 0, -1}),
    [](const ::testing::TestParamInfo<NodeValidationCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace rdep
