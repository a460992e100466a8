// Balancing inside the host layer (LayerConfig::balance): with replicas of hot experts, outputs, dx and
// dgates are bitwise those of the layer without balancing on the same routing; main-expert weight
// gradients are bitwise for experts without replicas and within fp32 summation-order tolerance for
// replicated ones (their rows are summed in two parts); the plan is the balancer's plan for the
// admitted load; a corrupted streamed weight is caught.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "rdep/balance/layer_balance.h"
#include "rdep/balance/load_trace.h"
#include "rdep/balance/sim.h"
#include "rdep/core/capacity.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

struct Case {
  std::string name;
  int64_t ranks = 4, experts = 16, tokens = 48, topk = 4;
  std::string routing = "zipf:2";
  double capacity_factor = 0;  // 0 = dropless
  int64_t segment = 0;
  BalanceKind kind = BalanceKind::kUltraEp;
  int32_t slots = 2;
  bool expect_replicas = true;
  int32_t relay_above = 4;  // BalanceConfig's default
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Result {
  std::vector<std::vector<float>> y, dx, dg, dw1, dw2;  // per rank
  std::vector<BalanceTelemetry> telemetry;
  std::vector<BalancePlan> plans;
};

LayerShape ShapeOf(const Case& c) {
  return LayerShape{.tokens = c.tokens, .hidden = 12, .ffn = 6, .experts = c.experts, .topk = c.topk, .ranks = c.ranks};
}

// One forward and backward of a layer with `balance` on routing `rt`; dy is derived from x.
Result RunLayer(const Case& c, const BalanceConfig& balance, const Routing& rt, bool fault = false) {
  const LayerShape s = ShapeOf(c);
  auto domain = std::move(*HostDomain::Create(static_cast<int32_t>(s.ranks), {.barrier_timeout_s = 10}));
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  const MoEWeights w = RandomWeights(s, 7);
  const auto x = RandomActivations(s, rt, 8);
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
  cfg.balance = balance;
  auto layer_or = HostMoELayer::Create(*domain, cfg, own, w);
  EXPECT_TRUE(layer_or.ok()) << layer_or.status();
  auto layer = std::move(*layer_or);
  layer->set_replica_fault_for_test(fault);
  const auto W = static_cast<size_t>(s.ranks);
  Result out;
  out.y.resize(W), out.dx.resize(W), out.dg.resize(W), out.dw1.resize(W), out.dw2.resize(W);
  out.telemetry.resize(W), out.plans.resize(W);
  std::vector<ForwardContext> ctx(W);
  Status st = domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    const int64_t n = rt[i].num_tokens;
    out.y[i].assign(static_cast<size_t>(n * s.hidden), NAN);
    out.dx[i].assign(static_cast<size_t>(n * s.hidden), NAN);
    out.dg[i].assign(static_cast<size_t>(n * s.topk), NAN);
    RDEP_RETURN_IF_ERROR(layer->Forward(r, ctx[i], rt[i], x[i], out.y[i]));
    if (balance.enabled()) {
      RDEP_ASSIGN_OR_RETURN(out.telemetry[i], layer->balance_telemetry(ctx[i]));
      RDEP_ASSIGN_OR_RETURN(out.plans[i], layer->balance_plan(ctx[i]));
    }
    std::vector<float> dy(x[i].size());
    for (size_t k = 0; k < dy.size(); ++k) dy[k] = std::sin(0.37f * static_cast<float>(k) + static_cast<float>(r));
    RDEP_RETURN_IF_ERROR(layer->Backward(r, ctx[i], dy, out.dx[i], out.dg[i]));
    out.dw1[i].assign(layer->dw1(r).begin(), layer->dw1(r).end());
    out.dw2[i].assign(layer->dw2(r).begin(), layer->dw2(r).end());
    return Status::Ok();
  });
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

bool Bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](float u, float v) {
           return std::memcmp(&u, &v, sizeof(float)) == 0;
         });
}

// Per local expert: bitwise when the expert has no replica, else |a-b| <= 1e-5 * max|b| + 1e-5 * |b|.
void ExpectGradsMatch(const std::vector<float>& a, const std::vector<float>& b, size_t per_expert,
                      const std::vector<bool>& replicated, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  float scale = 0;
  for (float v : b) scale = std::max(scale, std::abs(v));
  for (size_t j = 0; j * per_expert < b.size(); ++j) {
    for (size_t c = j * per_expert; c < (j + 1) * per_expert; ++c) {
      if (!replicated[j]) {
        ASSERT_EQ(std::memcmp(&a[c], &b[c], sizeof(float)), 0) << what << " local expert " << j << " element " << c;
      } else {
        ASSERT_LE(std::abs(a[c] - b[c]), 1e-5f * scale + 1e-5f * std::abs(b[c])) << what << " local expert " << j;
      }
    }
  }
}

class HostBalance : public ::testing::TestWithParam<Case> {};

TEST_P(HostBalance, EqualsTheLayerWithoutBalancing) {
  const Case c = GetParam();
  const LayerShape s = ShapeOf(c);
  const Routing rt = *GenerateRouting(s, *RoutingSpec::Parse(c.routing));
  const Result off = RunLayer(c, BalanceConfig{}, rt);
  const Result on = RunLayer(c, BalanceConfig{.kind = c.kind, .num_slots = c.slots, .relay_above = c.relay_above}, rt);
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  const BalancePlan& plan = on.plans[0];
  for (int64_t r = 0; r < s.ranks; ++r) {
    const auto i = static_cast<size_t>(r);
    EXPECT_TRUE(Bitwise(on.y[i], off.y[i])) << "y on rank " << r;
    EXPECT_TRUE(Bitwise(on.dx[i], off.dx[i])) << "dx on rank " << r;
    EXPECT_TRUE(Bitwise(on.dg[i], off.dg[i])) << "dgates on rank " << r;
    // Every rank solved the same plan.
    EXPECT_EQ(on.plans[i].instance_rank, plan.instance_rank) << "rank " << r;
    EXPECT_EQ(on.plans[i].route, plan.route) << "rank " << r;
    std::vector<bool> replicated(static_cast<size_t>(own.num_local(static_cast<int32_t>(r))));
    for (size_t j = 0; j < replicated.size(); ++j) {
      const int32_t e = own.global_expert(static_cast<int32_t>(r), static_cast<int32_t>(j));
      replicated[j] = plan.instance_offsets[static_cast<size_t>(e) + 1] - plan.instance_offsets[static_cast<size_t>(e)] > 1;
    }
    ExpectGradsMatch(on.dw1[i], off.dw1[i], static_cast<size_t>(2 * s.hidden * s.ffn), replicated, "dw1 rank " + std::to_string(r));
    ExpectGradsMatch(on.dw2[i], off.dw2[i], static_cast<size_t>(s.ffn * s.hidden), replicated, "dw2 rank " + std::to_string(r));
  }
  const BalanceTelemetry& t = on.telemetry[0];
  if (c.expect_replicas) {
    EXPECT_GT(t.replicas, 0);
    EXPECT_LT(t.imbalance_after, t.imbalance_before);
    EXPECT_EQ(t.weight_bytes, t.replicas * 3 * s.hidden * s.ffn * static_cast<int64_t>(sizeof(float)));
  }
  EXPECT_LE(t.replicas, c.slots * s.ranks);
  if (c.relay_above < 4) {
    EXPECT_FALSE(PlanRelays(plan, c.relay_above).empty()) << "the relay case must stream through relays";
  }

  // The plan is the balancer's plan for the admitted load (computed here from the routing).
  const std::vector<int64_t> load = LoadMatrix(rt, s.experts);
  std::vector<int64_t> admitted(load.size()), col(static_cast<size_t>(s.ranks)), kept(col.size());
  const int64_t cap = CapacityPolicy{.capacity_factor = c.capacity_factor}.ExpertCapacity(s);
  for (int64_t e = 0; e < s.experts; ++e) {
    for (int64_t r = 0; r < s.ranks; ++r) col[static_cast<size_t>(r)] = load[static_cast<size_t>(r * s.experts + e)];
    AdmitBySourceOrder(col.data(), s.ranks, cap, kept.data());
    for (int64_t r = 0; r < s.ranks; ++r) admitted[static_cast<size_t>(r * s.experts + e)] = kept[static_cast<size_t>(r)];
  }
  const BalancePlan want = *SolveLayerPlan(BalanceConfig{.kind = c.kind, .num_slots = c.slots}, admitted, own, {});
  EXPECT_EQ(plan.instance_expert, want.instance_expert);
  EXPECT_EQ(plan.instance_rank, want.instance_rank);
  EXPECT_EQ(plan.instance_quota, want.instance_quota);
  EXPECT_EQ(plan.route, want.route);
  EXPECT_TRUE(CheckPlan(plan, admitted, own).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Layer, HostBalance,
    ::testing::Values(Case{.name = "W4_zipf2_ultraep"}, Case{.name = "W4_zipf1_ultraep", .routing = "zipf:1"},
                      Case{.name = "W4_uniform_ultraep", .routing = "uniform", .expect_replicas = false},
                      Case{.name = "W4_one_expert_ultraep", .routing = "one-expert"},
                      Case{.name = "W4_zipf2_drops_ultraep", .capacity_factor = 0.8},
                      Case{.name = "W4_one_expert_drops_small_segments", .routing = "one-expert", .capacity_factor = 1.0, .segment = 5},
                      Case{.name = "W2_zipf2_ultraep", .ranks = 2, .experts = 8},
                      Case{.name = "W4_nonuniform_E10", .experts = 10, .topk = 3},
                      Case{.name = "W8_zipf2_ultraep_one_slot", .ranks = 8, .experts = 32, .slots = 1},
                      Case{.name = "W4_zipf2_eplb_exact", .kind = BalanceKind::kEplbExact},
                      Case{.name = "W4_zipf2_eplb_first_step", .kind = BalanceKind::kEplb},
                      Case{.name = "W4_zipf2_no_slots", .slots = 0, .expect_replicas = false},
                      Case{.name = "W4_zipf2_relays", .relay_above = 1},
                      Case{.name = "W8_one_expert_relays", .ranks = 8, .experts = 32, .routing = "one-expert", .relay_above = 1},
                      Case{.name = "W8_zipf2_relays_drops_segments", .ranks = 8, .experts = 32, .capacity_factor = 0.9, .segment = 7,
                           .relay_above = 1}),
    [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

// `rdep plan sim` on a trace recorded from a routing and the layer on that routing agree on the plan.
TEST(HostBalanceTrace, PlanSimAndTheLayerAgreeOnARecordedTrace) {
  const Case c{.name = "trace", .ranks = 8, .experts = 32};
  const LayerShape s = ShapeOf(c);
  const Routing rt = *GenerateRouting(s, *RoutingSpec::Parse("zipf:1.5"));
  const Result on = RunLayer(c, BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 2}, rt);
  LoadTrace trace{static_cast<int32_t>(s.experts), static_cast<int32_t>(s.ranks), {}};
  trace.steps.assign(2, LoadMatrix(rt, s.experts));  // step 0 only seeds EPLB's history in the simulation
  const std::string path = ::testing::TempDir() + "/rdep_balance_trace.txt";
  ASSERT_TRUE(WriteLoadTrace(trace, path).ok());
  auto read = ReadLoadTrace(path);
  ASSERT_TRUE(read.ok()) << read.status();
  SimConfig cfg;
  cfg.umin_frac = 0;  // u_min = 1, the layer's default
  auto rep = RunTraceSim(*read, 2, cfg, path);
  ASSERT_TRUE(rep.ok()) << rep.status();
  bool found = false;
  for (const SimRecord& r : rep->records) {
    if (r.planner != "ultraep") continue;
    found = true;
    EXPECT_EQ(r.replicas, on.telemetry[0].replicas);
    EXPECT_DOUBLE_EQ(r.imbalance, on.telemetry[0].imbalance_after);
    EXPECT_EQ(r.max_hosts, ComputeMetrics(on.plans[0]).max_hosts);
  }
  EXPECT_TRUE(found);
  EXPECT_GT(on.telemetry[0].replicas, 0);
}

TEST(HostBalanceFaults, CorruptedReplicaWeightIsCaught) {
  const Case c{.name = "fault"};
  const Routing rt = *GenerateRouting(ShapeOf(c), *RoutingSpec::Parse(c.routing));
  const Result off = RunLayer(c, BalanceConfig{}, rt);
  const Result bad = RunLayer(c, BalanceConfig{.kind = BalanceKind::kUltraEp}, rt, /*fault=*/true);
  ASSERT_GT(bad.telemetry[0].replicas, 0);
  bool all_equal = true;
  for (size_t r = 0; r < off.y.size(); ++r) all_equal = all_equal && Bitwise(bad.y[r], off.y[r]);
  EXPECT_FALSE(all_equal) << "a corrupted replica weight must change some output";
}

TEST(HostBalanceFaults, CorruptedRelayChunkIsCaught) {
  const Case c{.name = "relay_fault", .ranks = 8, .experts = 32, .routing = "one-expert"};
  const Routing rt = *GenerateRouting(ShapeOf(c), *RoutingSpec::Parse(c.routing));
  const Result off = RunLayer(c, BalanceConfig{}, rt);
  const Result bad = RunLayer(c, BalanceConfig{.kind = BalanceKind::kUltraEp, .relay_above = 1}, rt, /*fault=*/true);
  ASSERT_FALSE(PlanRelays(bad.plans[0], 1).empty());
  bool all_equal = true;
  for (size_t r = 0; r < off.y.size(); ++r) all_equal = all_equal && Bitwise(bad.y[r], off.y[r]);
  EXPECT_FALSE(all_equal) << "a corrupted relayed chunk must change some output";
}

TEST(PlanRelays, WideExpertsGetAboutSqrtRelaysAmongTheirReplicas) {
  // A plan by hand: expert 0 (owner 0) with 8 replicas on ranks 1..8, expert 1 (owner 1) with 3 on
  // ranks 2, 5, 6.
  BalancePlan p;
  p.num_experts = 2;
  p.num_ranks = 9;
  p.num_slots = 2;
  p.instance_offsets = {0, 9, 13};
  p.instance_expert = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1};
  p.instance_rank = {0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 5, 6};
  p.instance_slot = {-1, 0, 0, 0, 0, 0, 0, 0, 0, -1, 1, 1, 1};
  p.instance_quota = {5, 1, 1, 1, 1, 1, 1, 1, 1, 5, 1, 1, 1};
  const RelayPlan none = PlanRelays(p, 8);
  EXPECT_TRUE(none.empty());  // 8 replicas are not more than 8
  const RelayPlan r = PlanRelays(p, 2);
  ASSERT_EQ(r.experts.size(), 2u);
  EXPECT_EQ(r.experts[0].expert, 0);
  EXPECT_EQ(r.experts[0].relays.size(), 3u);  // round(sqrt(8))
  EXPECT_EQ(r.experts[1].relays.size(), 2u);  // round(sqrt(3))
  for (const auto& er : r.experts)
    for (int32_t i : er.relays) {
      EXPECT_EQ(p.instance_expert[static_cast<size_t>(i)], er.expert);
      EXPECT_GE(p.instance_slot[static_cast<size_t>(i)], 0);  // a replica, never the main instance
    }
  // Expert 0 (widest) goes first: ranks 2..8 send nothing yet and rank 1 sends expert 1's chunk, so
  // its relays are ranks 2, 3, 4; expert 1 then prefers ranks 5 and 6 to the loaded rank 2.
  EXPECT_EQ(r.experts[0].relays, (std::vector<int32_t>{2, 3, 4}));
  EXPECT_EQ(r.experts[1].relays, (std::vector<int32_t>{11, 12}));
  EXPECT_EQ(PlanRelays(p, 0).experts.size(), 0u);
  p.instance_quota[12] = 0;  // an idle replica (EPLB places them) neither counts nor relays
  const RelayPlan idle = PlanRelays(p, 2);
  ASSERT_EQ(idle.experts.size(), 1u);  // expert 1 has 2 active replicas now, not more than 2
  EXPECT_EQ(idle.experts[0].expert, 0);
  EXPECT_EQ(RelayPlan::ChunkBegin(1000, 3, 1) % 16, 0);
  EXPECT_EQ(RelayPlan::ChunkBegin(1000, 3, 3), 992);  // the last chunk ends at the expert's end (callers)
}

TEST(HostBalanceFaults, NoSlotsMeansRowsStayWithTheirOwnersAndTelemetrySaysSo) {
  const Case c{.name = "no_slots", .slots = 0};
  const Routing rt = *GenerateRouting(ShapeOf(c), *RoutingSpec::Parse(c.routing));
  const Result on = RunLayer(c, BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 0}, rt);
  EXPECT_EQ(on.telemetry[0].replicas, 0);
  EXPECT_TRUE(on.telemetry[0].slot_limited);
  EXPECT_DOUBLE_EQ(on.telemetry[0].imbalance_after, on.telemetry[0].imbalance_before);
}

// The gain gate in the layer: on skewed routing UltraEP replicates; with a min_gain no plan can meet,
// the layer makes no replica (every rank solves the same gated plan) and computes the unbalanced
// layer's results bit for bit.
TEST(HostBalanceGainGate, AGateNoPlanMeetsKeepsEveryRowOnItsOwner) {
  const Case c{.name = "gate"};
  const Routing rt = *GenerateRouting(ShapeOf(c), *RoutingSpec::Parse(c.routing));
  const Result open = RunLayer(c, BalanceConfig{.kind = BalanceKind::kUltraEp}, rt);
  ASSERT_GT(open.telemetry[0].replicas, 0);
  const Result gated = RunLayer(c, BalanceConfig{.kind = BalanceKind::kUltraEp, .min_gain = 1'000'000}, rt);
  const Result off = RunLayer(c, BalanceConfig{}, rt);
  for (size_t r = 0; r < gated.telemetry.size(); ++r) {
    EXPECT_EQ(gated.telemetry[r].replicas, 0) << "rank " << r;
    EXPECT_DOUBLE_EQ(gated.telemetry[r].imbalance_after, gated.telemetry[r].imbalance_before) << "rank " << r;
    EXPECT_EQ(gated.plans[r].num_replicas(), 0) << "rank " << r;
    EXPECT_EQ(gated.y[r], off.y[r]) << "rank " << r;
    EXPECT_EQ(gated.dx[r], off.dx[r]) << "rank " << r;
    EXPECT_EQ(gated.dw1[r], off.dw1[r]) << "rank " << r;
  }
}

TEST(HostBalanceConfig, BadValuesNameTheField) {
  auto bad = [](int32_t slots, int64_t min_quota) {
    return BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = slots, .min_quota = min_quota}.Validate(16).message();
  };
  EXPECT_NE(bad(-1, 1).find("N_slot"), std::string::npos);
  EXPECT_NE(bad(17, 1).find("E=16"), std::string::npos);
  EXPECT_NE(bad(2, 0).find("u_min"), std::string::npos);
  const BalanceConfig bad_relay{.kind = BalanceKind::kUltraEp, .relay_above = -1};
  EXPECT_NE(bad_relay.Validate(16).message().find("relay_above"), std::string::npos);
  const BalanceConfig bad_gain{.kind = BalanceKind::kUltraEp, .min_gain = -1};
  EXPECT_NE(bad_gain.Validate(16).message().find("min_gain"), std::string::npos);
  const BalanceConfig eplb_gain{.kind = BalanceKind::kEplb, .min_gain = 8};
  EXPECT_NE(eplb_gain.Validate(16).message().find("min_gain is UltraEP's gain gate"), std::string::npos);
  const BalanceConfig off{.kind = BalanceKind::kOff, .num_slots = -1};
  EXPECT_TRUE(off.Validate(16).ok());  // ignored when off
  EXPECT_NE(ParseBalanceKind("greedy").status().message().find("off, ultraep, eplb, eplb-exact"), std::string::npos);
  EXPECT_EQ(*ParseBalanceKind("eplb-exact"), BalanceKind::kEplbExact);
  const LayerShape s{.tokens = 8, .hidden = 8, .ffn = 4, .experts = 8, .topk = 2, .ranks = 2};
  auto domain = std::move(*HostDomain::Create(2, {}));
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 9};
  EXPECT_NE(HostMoELayer::Create(*domain, cfg, *OwnershipMap::Contiguous(8, 2)).status().message().find("N_slot"),
            std::string::npos);
}

// Several forwards in flight: each run and backward streams its own plan's replicas into the shared
// slots, so interleaving two contexts gives what each gives alone.
TEST(HostBalanceContexts, InterleavedForwardsKeepTheirOwnPlans) {
  const Case c{.name = "interleaved"};
  const LayerShape s = ShapeOf(c);
  const Routing a = *GenerateRouting(s, *RoutingSpec::Parse("zipf:2"));
  RoutingSpec other = *RoutingSpec::Parse("zipf:1.5");
  other.seed = 5;
  const Routing b = *GenerateRouting(s, other);
  const Result alone_a = RunLayer(c, BalanceConfig{.kind = BalanceKind::kUltraEp}, a);
  const Result alone_b = RunLayer(c, BalanceConfig{.kind = BalanceKind::kUltraEp}, b);

  auto domain = std::move(*HostDomain::Create(static_cast<int32_t>(s.ranks), {.barrier_timeout_s = 10}));
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp};
  auto layer = std::move(*HostMoELayer::Create(*domain, cfg, *OwnershipMap::Contiguous(s.experts, s.ranks), RandomWeights(s, 7)));
  const auto xa = RandomActivations(s, a, 8), xb = RandomActivations(s, b, 8);
  Status st = domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    ForwardContext ca, cb;
    std::vector<float> ya(xa[i].size()), yb(xb[i].size()), dxa(ya.size()), dxb(yb.size());
    std::vector<float> dga(static_cast<size_t>(a[i].num_tokens * s.topk)), dgb(static_cast<size_t>(b[i].num_tokens * s.topk));
    RDEP_RETURN_IF_ERROR(layer->Plan(r, ca, a[i]));
    RDEP_RETURN_IF_ERROR(layer->Plan(r, cb, b[i]));
    RDEP_RETURN_IF_ERROR(layer->Run(r, ca, xa[i], ya));
    RDEP_RETURN_IF_ERROR(layer->Run(r, cb, xb[i], yb));
    std::vector<float> dya(ya.size()), dyb(yb.size());
    for (size_t k = 0; k < dya.size(); ++k) dya[k] = std::sin(0.37f * static_cast<float>(k) + static_cast<float>(r));
    for (size_t k = 0; k < dyb.size(); ++k) dyb[k] = std::sin(0.37f * static_cast<float>(k) + static_cast<float>(r));
    RDEP_RETURN_IF_ERROR(layer->Backward(r, cb, dyb, dxb, dgb));
    const std::vector<float> dw1b(layer->dw1(r).begin(), layer->dw1(r).end());
    const std::vector<float> dw2b(layer->dw2(r).begin(), layer->dw2(r).end());
    RDEP_RETURN_IF_ERROR(layer->Backward(r, ca, dya, dxa, dga));
    const std::vector<float> dw1a(layer->dw1(r).begin(), layer->dw1(r).end());
    const std::vector<float> dw2a(layer->dw2(r).begin(), layer->dw2(r).end());
    if (!Bitwise(ya, alone_a.y[i]) || !Bitwise(yb, alone_b.y[i])) return InternalError("y differs on rank " + std::to_string(r));
    if (!Bitwise(dxa, alone_a.dx[i]) || !Bitwise(dxb, alone_b.dx[i])) return InternalError("dx differs on rank " + std::to_string(r));
    if (!Bitwise(dga, alone_a.dg[i]) || !Bitwise(dgb, alone_b.dg[i])) return InternalError("dgates differ on rank " + std::to_string(r));
    if (!Bitwise(dw1a, alone_a.dw1[i]) || !Bitwise(dw1b, alone_b.dw1[i]) || !Bitwise(dw2a, alone_a.dw2[i]) ||
        !Bitwise(dw2b, alone_b.dw2[i]))
      return InternalError("weight gradients differ on rank " + std::to_string(r));
    return Status::Ok();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Several steps on one layer (replica slots, their gradients and EPLB's history carried from step to
// step), with an all-empty step in the middle: every step equals the unbalanced layer's step.
TEST(HostBalanceSteps, EveryStepOfOneLayerEqualsTheUnbalancedLayer) {
  const LayerShape s{.tokens = 40, .hidden = 12, .ffn = 6, .experts = 16, .topk = 4, .ranks = 4};
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  const MoEWeights w = RandomWeights(s, 7);
  std::vector<Routing> steps;
  for (const char* family : {"zipf:2", "uniform", "zipf:1.5", "one-expert"}) steps.push_back(*GenerateRouting(s, *RoutingSpec::Parse(family)));
  Routing empty(static_cast<size_t>(s.ranks));
  for (auto& r : empty) r.topk = s.topk;  // every rank with zero tokens
  steps.insert(steps.begin() + 2, empty);
  for (BalanceKind kind : {BalanceKind::kUltraEp, BalanceKind::kEplb, BalanceKind::kEplbExact}) {
    auto d_off = std::move(*HostDomain::Create(s.ranks, {.barrier_timeout_s = 10}));
    auto d_on = std::move(*HostDomain::Create(s.ranks, {.barrier_timeout_s = 10}));
    LayerConfig off_cfg = MakeLayerConfig(s, {.capacity_factor = 1.0}), on_cfg = off_cfg;
    on_cfg.balance = BalanceConfig{.kind = kind, .num_slots = 2, .relay_above = 1};
    auto off = std::move(*HostMoELayer::Create(*d_off, off_cfg, own, w));
    auto on = std::move(*HostMoELayer::Create(*d_on, on_cfg, own, w));
    for (size_t step = 0; step < steps.size(); ++step) {
      const Routing& rt = steps[step];
      const auto x = RandomActivations(s, rt, 10 + step);
      auto run = [&](HostDomain& d, HostMoELayer& layer, std::vector<std::vector<float>>* out) {
        out->assign(5 * static_cast<size_t>(s.ranks), {});
        return d.Run([&](int32_t r) -> Status {
          const auto i = static_cast<size_t>(r);
          const int64_t n = rt[i].num_tokens;
          std::vector<float> y(static_cast<size_t>(n * s.hidden)), dx(y.size()), dg(static_cast<size_t>(n * s.topk)), dy(y.size());
          for (size_t k = 0; k < dy.size(); ++k) dy[k] = std::cos(0.11f * static_cast<float>(k) + static_cast<float>(r));
          RDEP_RETURN_IF_ERROR(layer.Forward(r, rt[i], x[i], y));
          RDEP_RETURN_IF_ERROR(layer.Backward(r, dy, dx, dg));
          (*out)[5 * i] = y;
          (*out)[5 * i + 1] = dx;
          (*out)[5 * i + 2] = dg;
          (*out)[5 * i + 3].assign(layer.dw1(r).begin(), layer.dw1(r).end());
          (*out)[5 * i + 4].assign(layer.dw2(r).begin(), layer.dw2(r).end());
          return Status::Ok();
        });
      };
      std::vector<std::vector<float>> a, b;
      ASSERT_TRUE(run(*d_off, *off, &a).ok());
      ASSERT_TRUE(run(*d_on, *on, &b).ok());
      const std::string at = std::string(BalanceKindName(kind)) + " step " + std::to_string(step);
      for (size_t i = 0; i < a.size(); ++i) {
        if (i % 5 < 3) {
          EXPECT_TRUE(Bitwise(b[i], a[i])) << at << " rank " << i / 5 << (i % 5 == 0 ? " y" : i % 5 == 1 ? " dx" : " dgates");
        } else {
          std::vector<bool> all(static_cast<size_t>(own.num_local(static_cast<int32_t>(i / 5))), true);  // tolerance for all
          ExpectGradsMatch(b[i], a[i], i % 5 == 3 ? static_cast<size_t>(2 * s.hidden * s.ffn) : static_cast<size_t>(s.ffn * s.hidden),
                           all, at + " rank " + std::to_string(i / 5) + (i % 5 == 3 ? " dW1" : " dW2"));
        }
      }
      if (steps[step][0].num_tokens == 0) {
        for (size_t i = 3; i < b.size(); i += 5) {
          for (float v : b[i]) ASSERT_EQ(v, 0.f) << at << ": an all-empty step has zero weight gradients";
        }
      }
    }
  }
}

}  // namespace
}  // namespace rdep
