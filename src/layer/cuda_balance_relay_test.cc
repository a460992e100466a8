// The CUDA layer's chunk relays and replica slots shared by several layers, ranks sharing the GPUs
// present (barriers are stream-ordered joins there):
//   - W = 8, experts with more than relay_above = 1 replicas stream through relays (stage 1, the
//     relay barrier, stage 2): y, dx, dgates and weight gradients bitwise those of relay_above = 0
//     (every replica streamed from its owner); the relays are the host rule's (PlanRelays of the
//     plan) and the telemetry counts them; a corrupted relayed chunk fails the comparison with
//     balancing off;
//   - three balanced layers at W = 8 on one domain (one set of slots; the third relays), forwards and backwards interleaved
//     (A fwd, B fwd, B bwd, C fwd, A bwd, C bwd): bitwise what each layer gives alone on a domain of
//     its own, and within the bf16 bound of balancing off; the domain counts the slots once.
// Every test skips, saying so, without a GPU.
//   exercise: build-*/src/layer/layer_test --gtest_filter='CudaBalanceRelays*:CudaSharedSlots*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "layer/cuda_test_util.h"
#include "rdep/balance/layer_balance.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

constexpr double kRelL2 = 1e-2;  // the CUDA checks' bf16 bound (ValidationOptions::rel_l2)
using Activations = std::vector<std::vector<float>>;

LayerShape ShapeW(int64_t W, int64_t E) { return LayerShape{.tokens = 48, .hidden = 64, .ffn = 32, .experts = E, .topk = 4, .ranks = W}; }

StatusOr<std::unique_ptr<CudaDomain>> MakeDomain(int32_t W) {
  const int gpus = cuda::DeviceCount();
  return CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(W, std::min(W, gpus))});
}

struct RankResult {
  std::vector<float> y, dx, dg, dw1, dw2;
};
struct LayerResult {
  std::vector<RankResult> ranks;
  BalanceTelemetry telemetry;  // rank 0's
  RelayPlan relays;            // rank 0's
  BalancePlan plan;            // rank 0's
};

// One layer's inputs on every rank.
struct Inputs {
  Routing rt;
  Activations x, dy;
};

Inputs MakeInputs(const LayerShape& s, const std::string& routing, uint64_t seed) {
  RoutingSpec spec = *RoutingSpec::Parse(routing);
  spec.seed = seed;
  Inputs in{*GenerateRouting(s, spec), {}, {}};
  in.x = RandomActivations(s, in.rt, 8 + seed);
  in.dy = RandomActivations(s, in.rt, 9 + seed);
  return in;
}

// A step of a schedule on rank r: layer's forward (backward = false) into ctx, or its backward.
Status Step(CudaDomain& domain, CudaMoELayer& layer, ForwardContext& ctx, Batch& b, bool backward, int32_t r, LayerResult& out) {
  const LayerShape& s = layer.config().shape;
  const auto i = static_cast<size_t>(r);
  if (!backward) {
    RDEP_RETURN_IF_ERROR(layer.Forward(r, ctx, b.e, b.g, b.n, b.x, b.y));
    if (r == 0 && layer.config().balance.enabled()) {
      RDEP_ASSIGN_OR_RETURN(out.telemetry, layer.balance_telemetry(ctx));
      RDEP_ASSIGN_OR_RETURN(out.relays, layer.balance_relays(ctx));
      RDEP_ASSIGN_OR_RETURN(out.plan, layer.balance_plan(ctx));
    }
    return Status::Ok();
  }
  RDEP_RETURN_IF_ERROR(layer.Backward(r, ctx, b.dy, b.dx, b.dg));
  RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
  RankResult& o = out.ranks[i];
  const auto nh = static_cast<size_t>(b.n * s.hidden);
  const auto L = static_cast<size_t>(OwnershipMap::Contiguous(s.experts, s.ranks)->num_local(r));
  RDEP_ASSIGN_OR_RETURN(o.y, DownloadBf16(b.y, nh));
  RDEP_ASSIGN_OR_RETURN(o.dx, DownloadBf16(b.dx, nh));
  RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, static_cast<size_t>(b.n * s.topk)));
  RDEP_ASSIGN_OR_RETURN(o.dw1, Download(layer.dw1(r), L * static_cast<size_t>(2 * s.hidden * s.ffn)));
  RDEP_ASSIGN_OR_RETURN(o.dw2, Download(layer.dw2(r), L * static_cast<size_t>(s.ffn * s.hidden)));
  return Status::Ok();
}

// Layers on one domain run a schedule of (layer, backward?) steps; results per layer.
StatusOr<std::vector<LayerResult>> RunSchedule(CudaDomain& domain, const std::vector<CudaMoELayer*>& layers, const std::vector<Inputs>& in,
                                               const std::vector<std::pair<size_t, bool>>& schedule) {
  const int32_t W = domain.num_ranks();
  std::vector<LayerResult> out(layers.size());
  for (LayerResult& o : out) o.ranks.assign(static_cast<size_t>(W), {});
  RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    std::vector<Batch> b(layers.size());
    std::vector<ForwardContext> ctx(layers.size());
    for (size_t l = 0; l < layers.size(); ++l)
      RDEP_RETURN_IF_ERROR(Upload(in[l].rt[i], in[l].x[i], in[l].dy[i], layers[l]->config().shape.hidden, b[l]));
    for (const auto& [l, backward] : schedule) RDEP_RETURN_IF_ERROR(Step(domain, *layers[l], ctx[l], b[l], backward, r, out[l]));
    return Status::Ok();
  }));
  return out;
}

// A layer of `cfg` (weights of `seed`) alone on a fresh domain: forward, backward.
StatusOr<LayerResult> RunAlone(const LayerConfig& cfg, uint64_t seed, const Inputs& in, bool fault = false) {
  RDEP_ASSIGN_OR_RETURN(auto domain, MakeDomain(static_cast<int32_t>(cfg.shape.ranks)));
  const OwnershipMap own = *OwnershipMap::Contiguous(cfg.shape.experts, cfg.shape.ranks);
  RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain, cfg, own, RandomWeights(cfg.shape, seed)));
  layer->set_replica_fault_for_test(fault);
  RDEP_ASSIGN_OR_RETURN(std::vector<LayerResult> r, RunSchedule(*domain, {layer.get()}, {in}, {{0, false}, {0, true}}));
  return std::move(r[0]);
}

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
double RelL2(const std::vector<float>& a, const std::vector<float>& b) { return a.size() == b.size() ? RelL2(a.data(), b.data(), a.size()) : INFINITY; }
double WorstExpertRelL2(const std::vector<float>& a, const std::vector<float>& b, size_t per) {
  if (a.size() != b.size() || per == 0) return INFINITY;
  double worst = 0;
  for (size_t at = 0; at < a.size(); at += per) worst = std::max(worst, RelL2(a.data() + at, b.data() + at, per));
  return worst;
}

void ExpectBitwise(const LayerResult& a, const LayerResult& b, const std::string& what) {
  ASSERT_EQ(a.ranks.size(), b.ranks.size()) << what;
  for (size_t r = 0; r < a.ranks.size(); ++r) {
    const std::string at = what + ", rank " + std::to_string(r);
    EXPECT_TRUE(Bitwise(a.ranks[r].y, b.ranks[r].y)) << at << ": y";
    EXPECT_TRUE(Bitwise(a.ranks[r].dx, b.ranks[r].dx)) << at << ": dx";
    EXPECT_TRUE(Bitwise(a.ranks[r].dg, b.ranks[r].dg)) << at << ": dgates";
    EXPECT_TRUE(Bitwise(a.ranks[r].dw1, b.ranks[r].dw1)) << at << ": dW1";
    EXPECT_TRUE(Bitwise(a.ranks[r].dw2, b.ranks[r].dw2)) << at << ": dW2";
  }
}

void ExpectWithinBound(const LayerResult& on, const LayerResult& off, const LayerShape& s, const std::string& what) {
  ASSERT_EQ(on.ranks.size(), off.ranks.size()) << what;
  for (size_t r = 0; r < on.ranks.size(); ++r) {
    const RankResult &a = on.ranks[r], &b = off.ranks[r];
    const std::string at = what + ", rank " + std::to_string(r);
    EXPECT_LE(RelL2(a.y, b.y), kRelL2) << at << ": y";
    EXPECT_LE(RelL2(a.dx, b.dx), kRelL2) << at << ": dx";
    EXPECT_LE(RelL2(a.dg, b.dg), kRelL2) << at << ": dgates";
    EXPECT_LE(WorstExpertRelL2(a.dw1, b.dw1, static_cast<size_t>(2 * s.hidden * s.ffn)), kRelL2) << at << ": dW1 of some expert";
    EXPECT_LE(WorstExpertRelL2(a.dw2, b.dw2, static_cast<size_t>(s.ffn * s.hidden)), kRelL2) << at << ": dW2 of some expert";
  }
}

LayerConfig Balanced(const LayerShape& s, BalanceKind kind, int32_t relay_above, double capacity = 0) {
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = capacity});
  cfg.balance = BalanceConfig{.kind = kind, .num_slots = 2, .relay_above = relay_above};
  return cfg;
}

// ---- chunk relays ----------------------------------------------------------------------------------

class CudaBalanceRelays : public ::testing::TestWithParam<std::pair<const char*, BalanceKind>> {};

TEST_P(CudaBalanceRelays, W8_RelayedStreamingEqualsDirectStreaming) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer's relays run on a GPU";
  const auto& [routing, kind] = GetParam();
  const LayerShape s = ShapeW(8, 32);
  const Inputs in = MakeInputs(s, routing, 1);
  auto relayed = RunAlone(Balanced(s, kind, 1), 7, in);
  ASSERT_TRUE(relayed.ok()) << relayed.status();
  auto direct = RunAlone(Balanced(s, kind, 0), 7, in);
  ASSERT_TRUE(direct.ok()) << direct.status();
  ASSERT_FALSE(relayed->relays.empty()) << routing << ": the case must stream through relays";
  EXPECT_TRUE(direct->relays.empty());
  // The device computed the host rule's relays for its plan, and the telemetry counts them.
  const RelayPlan want = PlanRelays(relayed->plan, 1);
  ASSERT_EQ(relayed->relays.experts.size(), want.experts.size());
  for (size_t k = 0; k < want.experts.size(); ++k) {
    EXPECT_EQ(relayed->relays.experts[k].expert, want.experts[k].expert);
    EXPECT_EQ(relayed->relays.experts[k].relays, want.experts[k].relays) << "expert " << want.experts[k].expert;
  }
  EXPECT_EQ(relayed->telemetry.relayed_experts, static_cast<int32_t>(want.experts.size()));
  EXPECT_EQ(direct->telemetry.relayed_experts, 0);
  ExpectBitwise(*relayed, *direct, std::string(routing) + ": relayed vs direct streaming");
  LayerConfig off = MakeLayerConfig(s);
  auto plain = RunAlone(off, 7, in);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ExpectWithinBound(*relayed, *plain, s, std::string(routing) + ": relayed vs balancing off");
}

INSTANTIATE_TEST_SUITE_P(Layer_bf16, CudaBalanceRelays,
                         ::testing::Values(std::pair<const char*, BalanceKind>{"one-expert", BalanceKind::kUltraEp},
                                           std::pair<const char*, BalanceKind>{"zipf:2", BalanceKind::kUltraEp},
                                           std::pair<const char*, BalanceKind>{"one-expert", BalanceKind::kEplbExact}),
                         [](const ::testing::TestParamInfo<std::pair<const char*, BalanceKind>>& p) {
                           std::string n = std::string(p.param.first) + "_" + BalanceKindName(p.param.second);
                           for (char& ch : n)
                             if (ch == '-' || ch == ':') ch = '_';
                           return n;
                         });

TEST(CudaBalanceRelayFaults, W8_CorruptedRelayedChunkIsCaught) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer's relays run on a GPU";
  const LayerShape s = ShapeW(8, 32);
  const Inputs in = MakeInputs(s, "one-expert", 1);
  auto bad = RunAlone(Balanced(s, BalanceKind::kUltraEp, 1), 7, in, /*fault=*/true);
  ASSERT_TRUE(bad.ok()) << bad.status();
  ASSERT_FALSE(bad->relays.empty());
  auto off = RunAlone(MakeLayerConfig(s), 7, in);
  ASSERT_TRUE(off.ok()) << off.status();
  std::vector<float> y_bad, y_off;
  for (size_t r = 0; r < bad->ranks.size(); ++r) {
    y_bad.insert(y_bad.end(), bad->ranks[r].y.begin(), bad->ranks[r].y.end());
    y_off.insert(y_off.end(), off->ranks[r].y.begin(), off->ranks[r].y.end());
  }
  EXPECT_GT(RelL2(y_bad, y_off), kRelL2) << "a corrupted relayed chunk must fail the comparison with balancing off";
}

// ---- slots shared by several layers -------------------------------------------------------------------

TEST(CudaSharedSlots, W8_ThreeLayersInterleavedEqualEachLayerAloneAndBalancingOff) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer's balancing runs on a GPU";
  const LayerShape s = ShapeW(8, 32);
  const std::vector<LayerConfig> cfgs = {Balanced(s, BalanceKind::kUltraEp, 4, 1.0), Balanced(s, BalanceKind::kEplbExact, 4, 1.0),
                                         Balanced(s, BalanceKind::kUltraEp, 1)};
  const std::vector<Inputs> in = {MakeInputs(s, "zipf:2", 1), MakeInputs(s, "zipf:1.5", 5), MakeInputs(s, "one-expert", 3)};
  const uint64_t seeds[3] = {7, 8, 9};

  auto domain = MakeDomain(8);
  ASSERT_TRUE(domain.ok()) << domain.status();
  const size_t base = (*domain)->symmetric_bytes_per_rank();
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  std::vector<std::unique_ptr<CudaMoELayer>> layers;
  for (size_t l = 0; l < cfgs.size(); ++l) {
    auto layer = CudaMoELayer::Create(**domain, cfgs[l], own, RandomWeights(s, seeds[l]));
    ASSERT_TRUE(layer.ok()) << layer.status();
    layers.push_back(std::move(*layer));
  }
  const size_t slots = layers[0]->replica_slot_bytes();
  ASSERT_GT(slots, 0u);
  std::set<size_t> row_sizes;  // the owner's output rows: one shared region per size
  for (const auto& layer : layers) row_sizes.insert(layer->shared_row_bytes());
  size_t rows = 0;
  for (size_t b : row_sizes) rows += b;
  const size_t transport = layers[0]->shared_transport_bytes();  // the same sizes in all three layers
  ASSERT_GT(transport, 0u);
  EXPECT_EQ((*domain)->symmetric_bytes_per_rank(), base + 3 * (layers[0]->layout().total_bytes() - transport) + slots + rows + transport)
      << "the three layers hold one set of replica slots, one set of output rows per size and one set of transport regions";
  EXPECT_EQ(layers[0]->shared_row_bytes(), layers[1]->shared_row_bytes()) << "layers 0 and 1 (same capacity) share their output rows";

  // A fwd, B fwd, B bwd, C fwd, A bwd, C bwd.
  auto shared = RunSchedule(**domain, {layers[0].get(), layers[1].get(), layers[2].get()}, in,
                            {{0, false}, {1, false}, {1, true}, {2, false}, {0, true}, {2, true}});
  ASSERT_TRUE(shared.ok()) << shared.status();
  for (size_t l = 0; l < cfgs.size(); ++l) {
    const std::string what = "layer " + std::to_string(l) + " (" + BalanceKindName(cfgs[l].balance.kind) + ")";
    EXPECT_GT((*shared)[l].telemetry.replicas, 0) << what << ": the case must use replicas";
    auto alone = RunAlone(cfgs[l], seeds[l], in[l]);
    ASSERT_TRUE(alone.ok()) << alone.status();
    ExpectBitwise((*shared)[l], *alone, what + ": shared slots vs its own");
    auto off = RunAlone(MakeLayerConfig(s, cfgs[l].capacity), seeds[l], in[l]);
    ASSERT_TRUE(off.ok()) << off.status();
    ExpectWithinBound((*shared)[l], *off, s, what + ": vs balancing off");
  }
  EXPECT_GT((*shared)[2].telemetry.relayed_experts, 0) << "layer 2 must stream through chunk relays";
}

}  // namespace
}  // namespace rdep
#endif
