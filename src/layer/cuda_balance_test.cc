// Balancing inside the CUDA layer (LayerConfig::balance) at W = 4 ranks sharing the GPUs present, for
// uniform, Zipf alpha 1 and 2, all-to-one-expert routing and capacity drops, with ultraep, eplb and
// eplb-exact:
//   - the plan every rank solved, the accepted set, the effective gates and each route slot's
//     physical instance equal the host layer's on the same routing, bit for bit;
//   - y, dx, dgates and every main expert's weight gradients equal the same CUDA layer with balancing
//     off within the CUDA checks' bf16 bound, ||on - off|| / ||off|| <= 1e-2 (per rank; weight
//     gradients per expert). Not bitwise: a replica's rows are a GEMM of their own (and the GEMM path
//     may change with the rows per expert), so bf16 outputs may round differently. The accepted set
//     and gates, the same computation either way, are also compared bitwise with balancing off;
//   - a corrupted streamed tile (set_replica_fault_for_test) fails that comparison;
//   - several steps on one layer (slots reused, EPLB's history, an all-empty step) and two forwards in
//     flight keep these properties; bf16 weight gradients and the caller's-experts steps are refused.
// Every test skips, saying so, without a GPU.
//   exercise: build-*/src/layer/layer_test --gtest_filter='*CudaBalance*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>

#include "balance/plan_test_util.h"
#include "layer/cuda_test_util.h"
#include "rdep/balance/layer_balance.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

constexpr int32_t kW = 4;
constexpr double kRelL2 = 1e-2;  // the CUDA checks' bf16 bound (ValidationOptions::rel_l2)
using Activations = std::vector<std::vector<float>>;

struct Case {
  std::string name;
  std::string routing = "zipf:2";
  double capacity_factor = 0;  // 0 = dropless
  BalanceKind kind = BalanceKind::kUltraEp;
  int32_t slots = 2;
  int64_t segment = 0;  // 0 = the CUDA default (W*T, one segment)
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

LayerShape Shape() { return LayerShape{.tokens = 48, .hidden = 64, .ffn = 32, .experts = 16, .topk = 4, .ranks = kW}; }
OwnershipMap Owners() { return *OwnershipMap::Contiguous(16, kW); }

LayerConfig ConfigOf(const Case& c, bool balanced) {
  LayerConfig cfg = MakeLayerConfig(Shape(), CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
  if (balanced) cfg.balance = BalanceConfig{.kind = c.kind, .num_slots = c.slots};
  return cfg;
}

StatusOr<std::unique_ptr<CudaDomain>> MakeDomain() {
  const int gpus = cuda::DeviceCount();
  return CudaDomain::CreateSingleProcess(kW, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(kW, std::min(kW, gpus))});
}

// What one forward and backward produced on one rank.
struct RankResult {
  std::vector<float> y, dx, dg, dw1, dw2;
  RankAcceptance acc;
  RowInstances inst;
};
struct CudaRun {
  std::vector<RankResult> ranks;
  std::vector<BalancePlan> plans;  // balanced: every rank's plan
  BalanceTelemetry telemetry;      // balanced: rank 0's
};

// Forward (the layer's own context) and backward on every rank, with host copies of what the checks read.
Status ForwardBackward(CudaDomain& domain, CudaMoELayer& layer, const Routing& rt, const Activations& x, const Activations& dy,
                       CudaRun& out) {
  const LayerShape& s = layer.config().shape;
  const bool balanced = layer.config().balance.enabled();
  out.ranks.assign(kW, {});
  out.plans.assign(kW, {});
  return domain.Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(rt[i], x[i], dy[i], s.hidden, b));
    RDEP_RETURN_IF_ERROR(layer.Forward(r, b.e, b.g, b.n, b.x, b.y));
    RankResult& o = out.ranks[i];
    RDEP_ASSIGN_OR_RETURN(o.acc, layer.CopyAcceptance(r));
    if (balanced) {
      RDEP_ASSIGN_OR_RETURN(o.inst, layer.CopyRowInstances(r));
      RDEP_ASSIGN_OR_RETURN(out.plans[i], layer.balance_plan(r));
      if (r == 0) {
        RDEP_ASSIGN_OR_RETURN(out.telemetry, layer.balance_telemetry(r));
      }
    }
    RDEP_RETURN_IF_ERROR(layer.Backward(r, b.dy, b.dx, b.dg));
    RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
    const auto nh = static_cast<size_t>(b.n * s.hidden), L = static_cast<size_t>(Owners().num_local(r));
    RDEP_ASSIGN_OR_RETURN(o.y, DownloadBf16(b.y, nh));
    RDEP_ASSIGN_OR_RETURN(o.dx, DownloadBf16(b.dx, nh));
    RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, static_cast<size_t>(b.n * s.topk)));
    RDEP_ASSIGN_OR_RETURN(o.dw1, Download(layer.dw1(r), L * static_cast<size_t>(2 * s.hidden * s.ffn)));
    RDEP_ASSIGN_OR_RETURN(o.dw2, Download(layer.dw2(r), L * static_cast<size_t>(s.ffn * s.hidden)));
    return Status::Ok();
  });
}

// A fresh domain and CUDA layer of `cfg` (weights of seed 7), one forward and backward.
StatusOr<CudaRun> RunCuda(const LayerConfig& cfg, const Routing& rt, const Activations& x, const Activations& dy, bool fault = false) {
  RDEP_ASSIGN_OR_RETURN(auto domain, MakeDomain());
  RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain, cfg, Owners(), RandomWeights(cfg.shape, 7)));
  layer->set_replica_fault_for_test(fault);
  CudaRun out;
  RDEP_RETURN_IF_ERROR(ForwardBackward(*domain, *layer, rt, x, dy, out));
  return out;
}

// The host layer's plan, acceptance and (from its plan, by cumulative quota) each slot's instance.
struct HostRun {
  BalancePlan plan;
  std::vector<RankAcceptance> acc;
  std::vector<RowInstances> inst;
};

StatusOr<HostRun> RunHost(const LayerConfig& cfg, const Routing& rt, const Activations& x) {
  const LayerShape& s = cfg.shape;
  const OwnershipMap own = Owners();
  RDEP_ASSIGN_OR_RETURN(auto domain, HostDomain::Create(kW, {.barrier_timeout_s = 20}));
  RDEP_ASSIGN_OR_RETURN(auto layer, HostMoELayer::Create(*domain, cfg, own, RandomWeights(s, 7)));
  RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    std::vector<float> y(static_cast<size_t>(rt[i].num_tokens * s.hidden));
    return layer->Forward(r, rt[i], x[i], y);
  }));
  HostRun h;
  RDEP_ASSIGN_OR_RETURN(h.plan, layer->balance_plan(0));
  const int32_t slot_base = std::max(1, own.max_local());
  for (int32_t r = 0; r < kW; ++r) {
    h.acc.push_back(layer->acceptance(r));
    const RankRouting& rr = rt[static_cast<size_t>(r)];
    RowInstances inst;
    inst.rank.assign(rr.experts.size(), -1);
    inst.local.assign(rr.experts.size(), -1);
    std::vector<int64_t> taken(static_cast<size_t>(s.experts), 0);
    for (size_t i = 0; i < rr.experts.size(); ++i) {
      if (!h.acc.back().accepted[i]) continue;
      const int32_t e = rr.experts[i];
      const int32_t k = InstanceForRow(h.plan, r, e, taken[static_cast<size_t>(e)]++);
      if (k < 0) return InternalError("host plan: no instance for an accepted row");
      const int32_t slot = h.plan.instance_slot[static_cast<size_t>(k)];
      inst.rank[i] = h.plan.instance_rank[static_cast<size_t>(k)];
      inst.local[i] = slot < 0 ? own.local_index(e) : slot_base + slot;
    }
    h.inst.push_back(std::move(inst));
  }
  return h;
}

// ||a - b|| / ||b|| (0 when both are zero; +inf on a NaN or a size mismatch).
double RelL2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (std::isnan(num) || std::isnan(den)) return INFINITY;
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}
double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() ? RelL2(a.data(), b.data(), a.size()) : INFINITY;
}
// The largest per-expert relative L2 of gradients laid out [E_loc][per].
double WorstExpertRelL2(const std::vector<float>& a, const std::vector<float>& b, size_t per) {
  if (a.size() != b.size() || per == 0) return INFINITY;
  double worst = 0;
  for (size_t at = 0; at < a.size(); at += per) worst = std::max(worst, RelL2(a.data() + at, b.data() + at, per));
  return worst;
}

using test_util::ExpectSamePlan;

// The routing metadata of `on` against `want` bit for bit.
void ExpectSameAcceptance(const RankAcceptance& on, const RankAcceptance& want, const std::string& what) {
  EXPECT_EQ(on.accepted, want.accepted) << what << ": accepted set";
  EXPECT_TRUE(Bitwise(on.effective_gates, want.effective_gates)) << what << ": effective gates";
  EXPECT_EQ(on.dropped, want.dropped) << what << ": dropped rows";
}

// y, dx, dgates and every main expert's dW1, dW2 within the bf16 bound of the run without balancing.
void ExpectWithinBound(const CudaRun& on, const CudaRun& off, const std::string& what) {
  const LayerShape s = Shape();
  for (size_t r = 0; r < kW; ++r) {
    const RankResult &a = on.ranks[r], &b = off.ranks[r];
    const std::string at = what + ", rank " + std::to_string(r);
    EXPECT_LE(RelL2(a.y, b.y), kRelL2) << at << ": y";
    EXPECT_LE(RelL2(a.dx, b.dx), kRelL2) << at << ": dx";
    EXPECT_LE(RelL2(a.dg, b.dg), kRelL2) << at << ": dgates";
    EXPECT_LE(WorstExpertRelL2(a.dw1, b.dw1, static_cast<size_t>(2 * s.hidden * s.ffn)), kRelL2) << at << ": dW1 of some expert";
    EXPECT_LE(WorstExpertRelL2(a.dw2, b.dw2, static_cast<size_t>(s.ffn * s.hidden)), kRelL2) << at << ": dW2 of some expert";
  }
}

class CudaBalance : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBalance, PlanEqualsHostAndOutputsEqualBalancingOff) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer's balancing runs on a GPU";
  const Case& c = GetParam();
  const LayerShape s = Shape();
  const Routing rt = *GenerateRouting(s, *RoutingSpec::Parse(c.routing));
  const Activations x = RandomActivations(s, rt, 8), dy = RandomActivations(s, rt, 9);
  auto on = RunCuda(ConfigOf(c, true), rt, x, dy);
  ASSERT_TRUE(on.ok()) << on.status();
  auto off = RunCuda(ConfigOf(c, false), rt, x, dy);
  ASSERT_TRUE(off.ok()) << off.status();
  auto host = RunHost(ConfigOf(c, true), rt, x);
  ASSERT_TRUE(host.ok()) << host.status();
  for (size_t r = 0; r < kW; ++r) {
    const std::string at = c.name + ", rank " + std::to_string(r);
    ExpectSamePlan(on->plans[r], host->plan, at + ": the plan");  // every rank solved the host layer's plan
    ExpectSameAcceptance(on->ranks[r].acc, host->acc[r], at + " vs the host layer");
    ExpectSameAcceptance(on->ranks[r].acc, off->ranks[r].acc, at + " vs balancing off");
    EXPECT_EQ(on->ranks[r].inst.rank, host->inst[r].rank) << at << ": instance ranks";
    EXPECT_EQ(on->ranks[r].inst.local, host->inst[r].local) << at << ": instance physical indices";
  }
  ExpectWithinBound(*on, *off, c.name);
  const BalanceTelemetry& t = on->telemetry;
  EXPECT_LE(t.replicas, c.slots * kW);
  EXPECT_EQ(t.weight_bytes, t.replicas * 3 * s.hidden * s.ffn * static_cast<int64_t>(sizeof(uint16_t)));
  EXPECT_EQ(t.replicas, host->plan.num_replicas());
  if (c.kind == BalanceKind::kUltraEp && c.routing != "uniform" && c.slots > 0) {
    EXPECT_GT(t.replicas, 0) << "skewed routing must replicate";
    EXPECT_LT(t.imbalance_after, t.imbalance_before);
  }
  if (c.slots == 0) {  // nowhere to place a replica: every row stays on its owner, and the telemetry says so
    EXPECT_EQ(t.replicas, 0);
    EXPECT_DOUBLE_EQ(t.imbalance_after, t.imbalance_before);
  }
}

std::vector<Case> Cases() {
  struct Family {
    const char* name;
    const char* routing;
    double capacity;
    int64_t segment;
  };
  const Family routings[] = {{"uniform", "uniform", 0, 0},          {"zipf1", "zipf:1", 0, 0},
                              {"zipf2", "zipf:2", 0, 0},              {"one_expert", "one-expert", 0, 0},
                              {"zipf2_drops", "zipf:2", 0.8, 0},      {"one_expert_drops_segments", "one-expert", 1.0, 20}};
  std::vector<Case> cases;
  for (BalanceKind kind : {BalanceKind::kUltraEp, BalanceKind::kEplb, BalanceKind::kEplbExact})
    for (const Family& r : routings) {
      std::string kind_name = BalanceKindName(kind);
      std::replace(kind_name.begin(), kind_name.end(), '-', '_');
      cases.push_back(Case{.name = std::string("W4_") + r.name + "_" + kind_name, .routing = r.routing, .capacity_factor = r.capacity,
                           .kind = kind, .segment = r.segment});
    }
  cases.push_back(Case{.name = "W4_zipf2_one_slot_ultraep", .slots = 1});
  cases.push_back(Case{.name = "W4_zipf2_no_slots_ultraep", .slots = 0});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layer_bf16, CudaBalance, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

TEST(CudaBalanceFaults, W4_CorruptedStreamedTileIsCaught) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer's balancing runs on a GPU";
  const Case c{.name = "fault"};
  const LayerShape s = Shape();
  const Routing rt = *GenerateRouting(s, *RoutingSpec::Parse(c.routing));
  const Activations x = RandomActivations(s, rt, 8), dy = RandomActivations(s, rt, 9);
  auto off = RunCuda(ConfigOf(c, false), rt, x, dy);
  ASSERT_TRUE(off.ok()) << off.status();
  auto bad = RunCuda(ConfigOf(c, true), rt, x, dy, /*fault=*/true);
  ASSERT_TRUE(bad.ok()) << bad.status();
  ASSERT_GT(bad->telemetry.replicas, 0);
  std::vector<float> y_bad, y_off;
  for (size_t r = 0; r < kW; ++r) {
    y_bad.insert(y_bad.end(), bad->ranks[r].y.begin(), bad->ranks[r].y.end());
    y_off.insert(y_off.end(), off->ranks[r].y.begin(), off->ranks[r].y.end());
  }
  EXPECT_GT(RelL2(y_bad, y_off), kRelL2) << "a corrupted replica tile must fail the comparison with balancing off";
}

// Several steps on one layer per balancer (the slots and their gradient buffers reused, EPLB's history
// carried), with an all-empty step: every step within the bound of the unbalanced layer's step, and
// the empty step's weight gradients exactly zero (no stale replica gradient is reduced).
TEST(CudaBalanceSteps, W4_EveryStepOfOneLayerIsWithinTheBoundOfBalancingOff) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer's balancing runs on a GPU";
  const LayerShape s = Shape();
  std::vector<Routing> steps;
  for (const char* family : {"zipf:2", "uniform", "one-expert", "zipf:1"}) steps.push_back(*GenerateRouting(s, *RoutingSpec::Parse(family)));
  Routing empty(static_cast<size_t>(kW));
  for (auto& r : empty) r.topk = s.topk;  // every rank with zero tokens
  steps.insert(steps.begin() + 2, empty);
  for (BalanceKind kind : {BalanceKind::kUltraEp, BalanceKind::kEplb, BalanceKind::kEplbExact}) {
    const Case c{.name = BalanceKindName(kind), .capacity_factor = 1.0, .kind = kind};
    auto d_on = MakeDomain(), d_off = MakeDomain();
    ASSERT_TRUE(d_on.ok() && d_off.ok());
    auto on = CudaMoELayer::Create(**d_on, ConfigOf(c, true), Owners(), RandomWeights(s, 7));
    auto off = CudaMoELayer::Create(**d_off, ConfigOf(c, false), Owners(), RandomWeights(s, 7));
    ASSERT_TRUE(on.ok()) << on.status();
    ASSERT_TRUE(off.ok()) << off.status();
    for (size_t step = 0; step < steps.size(); ++step) {
      const Activations x = RandomActivations(s, steps[step], 10 + step), dy = RandomActivations(s, steps[step], 20 + step);
      CudaRun a, b;
      ASSERT_TRUE(ForwardBackward(**d_on, **on, steps[step], x, dy, a).ok());
      ASSERT_TRUE(ForwardBackward(**d_off, **off, steps[step], x, dy, b).ok());
      const std::string at = c.name + " step " + std::to_string(step);
      ExpectWithinBound(a, b, at);
      if (steps[step][0].num_tokens == 0)
        for (const RankResult& rr : a.ranks) {
          for (float v : rr.dw1) ASSERT_EQ(v, 0.f) << at << ": an all-empty step has zero weight gradients";
          for (float v : rr.dw2) ASSERT_EQ(v, 0.f) << at << ": an all-empty step has zero weight gradients";
        }
    }
  }
}

// Two forwards in flight (plans made ahead of their runs, backwards in reverse order): each run and
// backward streams its own plan's replicas into the shared slots, so the results are bitwise those of
// the same forwards run one after the other on the same layer.
TEST(CudaBalanceContexts, W4_InterleavedForwardsKeepTheirOwnPlans) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer's balancing runs on a GPU";
  const LayerShape s = Shape();
  const Routing rts[2] = {*GenerateRouting(s, *RoutingSpec::Parse("zipf:2")), *GenerateRouting(s, *RoutingSpec::Parse("one-expert"))};
  const Activations xs[2] = {RandomActivations(s, rts[0], 8), RandomActivations(s, rts[1], 18)};
  const Activations dys[2] = {RandomActivations(s, rts[0], 9), RandomActivations(s, rts[1], 19)};
  auto domain = MakeDomain();
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(Case{}, true), Owners(), RandomWeights(s, 7));
  ASSERT_TRUE(layer.ok()) << layer.status();
  CudaRun alone[2];
  for (int m = 0; m < 2; ++m) ASSERT_TRUE(ForwardBackward(**domain, **layer, rts[m], xs[m], dys[m], alone[m]).ok());
  std::vector<std::array<RankResult, 2>> nested(kW);
  Status st = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b[2];
    ForwardContext ctx[2];
    for (int m = 0; m < 2; ++m) RDEP_RETURN_IF_ERROR(Upload(rts[m][i], xs[m][i], dys[m][i], s.hidden, b[m]));
    for (int m = 0; m < 2; ++m) RDEP_RETURN_IF_ERROR((*layer)->Plan(r, ctx[m], b[m].e, b[m].g, b[m].n));
    for (int m = 1; m >= 0; --m) RDEP_RETURN_IF_ERROR((*layer)->Run(r, ctx[m], b[m].x, b[m].y));
    for (int m = 1; m >= 0; --m) {
      RDEP_RETURN_IF_ERROR((*layer)->Backward(r, ctx[m], b[m].dy, b[m].dx, b[m].dg));
      RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
      RankResult& o = nested[i][static_cast<size_t>(m)];
      const auto nh = static_cast<size_t>(b[m].n * s.hidden), L = static_cast<size_t>(Owners().num_local(r));
      RDEP_ASSIGN_OR_RETURN(o.y, DownloadBf16(b[m].y, nh));
      RDEP_ASSIGN_OR_RETURN(o.dx, DownloadBf16(b[m].dx, nh));
      RDEP_ASSIGN_OR_RETURN(o.dg, Download(b[m].dg, static_cast<size_t>(b[m].n * s.topk)));
      RDEP_ASSIGN_OR_RETURN(o.dw1, Download((*layer)->dw1(r), L * static_cast<size_t>(2 * s.hidden * s.ffn)));
      RDEP_ASSIGN_OR_RETURN(o.dw2, Download((*layer)->dw2(r), L * static_cast<size_t>(s.ffn * s.hidden)));
    }
    return Status::Ok();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (size_t r = 0; r < kW; ++r)
    for (size_t m = 0; m < 2; ++m) {
      const RankResult &a = nested[r][m], &b = alone[m].ranks[r];
      const std::string at = "batch " + std::to_string(m) + ", rank " + std::to_string(r);
      EXPECT_TRUE(Bitwise(a.y, b.y)) << at << ": y";
      EXPECT_TRUE(Bitwise(a.dx, b.dx)) << at << ": dx";
      EXPECT_TRUE(Bitwise(a.dg, b.dg)) << at << ": dgates";
      EXPECT_TRUE(Bitwise(a.dw1, b.dw1)) << at << ": dW1";
      EXPECT_TRUE(Bitwise(a.dw2, b.dw2)) << at << ": dW2";
    }
}

// What balancing refuses on this backend: bf16 weight gradients and the caller's own experts, both
// FailedPrecondition before any collective work.
TEST(CudaBalanceRefusals, W4_Bf16GradientsAndCallersExpertsAreRefused) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer's balancing runs on a GPU";
  auto domain = MakeDomain();
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(Case{}, true), Owners(), RandomWeights(Shape(), 7));
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto* fake = reinterpret_cast<__nv_bfloat16*>(uintptr_t{256});  // never dereferenced: the bind is refused first
  const Status bind = (*layer)->BindExpertWeights(0, ExternalWeights<__nv_bfloat16, __nv_bfloat16>{fake, fake, fake, fake});
  EXPECT_EQ(bind.code(), StatusCode::kFailedPrecondition) << bind;
  EXPECT_NE(bind.message().find("balancing"), std::string::npos) << bind;
  ForwardContext ctx;
  const Status dispatch = (*layer)->Dispatch(0, ctx, nullptr, 0, nullptr, 0);
  EXPECT_EQ(dispatch.code(), StatusCode::kFailedPrecondition) << dispatch;
  EXPECT_NE(dispatch.message().find("cannot run with balancing (ultraep)"), std::string::npos) << dispatch;
  const Status combine = (*layer)->Combine(0, ctx, nullptr, 0, nullptr, 0);
  EXPECT_EQ(combine.code(), StatusCode::kFailedPrecondition) << combine;
  auto plain = CudaMoELayer::Create(**domain, ConfigOf(Case{}, false), Owners(), RandomWeights(Shape(), 7));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->balance_plan(0).status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace rdep
#endif
