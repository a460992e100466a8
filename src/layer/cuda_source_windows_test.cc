// LayerConfig::source_windows on the CUDA layer, W = 4 ranks on the GPUs present (sharing them when
// fewer): a Forward that is dropless in one segment places each source's tokens in a fixed window of
// every owner's stream (region_layout.h) and its plan exchanges nothing. Against the same layer with the
// windows off (the three phases), on the same routings, weights and inputs: y, dx, dgates and both
// weight gradients bit for bit, over three forward+backward calls per layer whose routings change
// (uniform; the case's; uniform with rank 1 holding 17 tokens and rank 2 none), so that a window tail an
// earlier call filled must read as empty (the scatter clears it). Outputs are poisoned with NaN first.
// The windowed layer must report the windows (source_windows) and the other must not; Plan + Run on the
// windowed layer takes the three phases (the caller's experts need the counts at the plan) and gives
// the same bits; recv_counts of a windowed Forward's context is refused, naming the windows. A stack of two
// layers sharing the transport regions, with the owner's reduce, checks the backward's own tail clear. Cases: the
// per-slot return (cuBLASLt), Zipf 2, one expert set for every token (three owners' windows empty), the
// owner's reduce, an SM budget of 3 blocks, H = 40, and the CUTLASS (sync-free) compute, which skips
// where it cannot be made (a failure under RDEP_REQUIRE_CUTLASS=1). Every test skips without a GPU.
//   exercise: build-*/src/layer/layer_test --gtest_filter='*CudaSourceWindows*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/device_count.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

constexpr int32_t kW = 4;
constexpr int kCalls = 3;

struct Case {
  std::string name;
  std::string routing = "uniform";  // the second call's
  bool owner_reduce = false;
  int32_t transport_sms = 0;
  bool cutlass = false;
  int64_t hidden = 64;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

LayerShape Shape(const Case& c) {
  return LayerShape{.tokens = 48, .hidden = c.hidden, .ffn = 32, .experts = 16, .topk = 4, .ranks = kW};
}

struct RankOut {
  std::vector<float> y, dx, dg, dw1, dw2;
  bool windowed = false;
};

// Rank r's outputs and gradients of one forward+backward into o; an output left NaN (the poison) is an error.
Status Collect(const CudaMoELayer& layer, int32_t r, const Batch& b, const LayerShape& s, size_t num_local, RankOut& o) {
  RDEP_ASSIGN_OR_RETURN(o.y, DownloadBf16(b.y, static_cast<size_t>(b.n * s.hidden)));
  RDEP_ASSIGN_OR_RETURN(o.dx, DownloadBf16(b.dx, static_cast<size_t>(b.n * s.hidden)));
  RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, static_cast<size_t>(b.n * s.topk)));
  RDEP_ASSIGN_OR_RETURN(o.dw1, Download(layer.dw1(r), num_local * static_cast<size_t>(2 * s.hidden * s.ffn)));
  RDEP_ASSIGN_OR_RETURN(o.dw2, Download(layer.dw2(r), num_local * static_cast<size_t>(s.ffn * s.hidden)));
  for (const auto* v : {&o.y, &o.dx, &o.dg})
    for (float value : *v)
      if (std::isnan(value)) return InternalError("rank " + std::to_string(r) + ": an output holds a value nobody wrote (NaN)");
  return Status::Ok();
}

// The routing of call `call` (1-based): uniform, the case's, then uniform with short and empty ranks.
StatusOr<Routing> CallRouting(const Case& c, const LayerShape& s, int call) {
  RDEP_ASSIGN_OR_RETURN(RoutingSpec spec, RoutingSpec::Parse(call == 2 ? c.routing : "uniform"));
  spec.seed = static_cast<uint64_t>(call);
  if (call == 3) spec.empty_rank = 2;
  RDEP_ASSIGN_OR_RETURN(Routing rt, GenerateRouting(s, spec));
  if (call == 3) {
    RankRouting& r1 = rt[1];
    r1.num_tokens = 17;
    r1.experts.resize(static_cast<size_t>(17 * s.topk));
    r1.gates.resize(static_cast<size_t>(17 * s.topk));
  }
  return rt;
}

// kCalls forward+backward calls on one layer: [call][rank] outputs. split: Plan + Run instead of Forward.
StatusOr<std::vector<std::vector<RankOut>>> RunLayer(const Case& c, bool windows, bool split = false) {
  const LayerShape s = Shape(c);
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.source_windows = windows;
  cfg.owner_reduce = c.owner_reduce;
  cfg.transport_sms = c.transport_sms;
  if (c.cutlass) cfg.expert_compute = ExpertComputeKind::kCutlass;
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, kW);
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(
                                         kW, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(kW, std::min(kW, cuda::DeviceCount()))}));
  RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain, cfg, own, RandomWeights(s, 7)));
  std::vector<ForwardContext> ctxs(kW);  // after the layer: freed before it
  std::vector<std::vector<RankOut>> out(kCalls, std::vector<RankOut>(kW));
  for (int call = 1; call <= kCalls; ++call) {
    RDEP_ASSIGN_OR_RETURN(Routing rt, CallRouting(c, s, call));
    const auto x = RandomActivations(s, rt, 8 + static_cast<uint64_t>(call));
    const auto dy = RandomActivations(s, rt, 20 + static_cast<uint64_t>(call));
    RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      Batch b;
      RDEP_RETURN_IF_ERROR(Upload(rt[i], x[i], dy[i], s.hidden, b));
      const auto nh = static_cast<size_t>(std::max<int64_t>(b.n * s.hidden, 1)), nk = static_cast<size_t>(std::max<int64_t>(b.n * s.topk, 1));
      for (auto [p, bytes] : {std::pair<void*, size_t>{b.y, nh * 2}, {b.dx, nh * 2}, {b.dg, nk * 4}})
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0xFF, bytes));  // NaN in bf16 and fp32
      RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());         // before the layer's non-blocking stream
      ForwardContext& ctx = ctxs[i];
      if (split) {
        RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx, b.e, b.g, b.n));
        RDEP_RETURN_IF_ERROR(layer->Run(r, ctx, b.x, b.y));
      } else {
        RDEP_RETURN_IF_ERROR(layer->Forward(r, ctx, b.e, b.g, b.n, b.x, b.y));
      }
      RankOut& o = out[static_cast<size_t>(call - 1)][i];
      o.windowed = layer->source_windows(ctx, r);
      RDEP_RETURN_IF_ERROR(layer->Backward(r, ctx, b.dy, b.dx, b.dg));
      RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
      return Collect(*layer, r, b, s, static_cast<size_t>(own.num_local(r)), o);
    }));
  }
  return out;
}

void ExpectSameBits(const std::vector<std::vector<RankOut>>& a, const std::vector<std::vector<RankOut>>& b) {
  for (size_t call = 0; call < a.size(); ++call)
    for (int32_t r = 0; r < kW; ++r) {
      SCOPED_TRACE("call " + std::to_string(call + 1) + ", rank " + std::to_string(r));
      const RankOut &p = a[call][static_cast<size_t>(r)], &q = b[call][static_cast<size_t>(r)];
      EXPECT_TRUE(Bitwise(p.y, q.y)) << "y";
      EXPECT_TRUE(Bitwise(p.dx, q.dx)) << "dx";
      EXPECT_TRUE(Bitwise(p.dg, q.dg)) << "dgates";
      EXPECT_TRUE(Bitwise(p.dw1, q.dw1)) << "dW1";
      EXPECT_TRUE(Bitwise(p.dw2, q.dw2)) << "dW2";
    }
}

class CudaSourceWindows : public ::testing::TestWithParam<Case> {};

TEST_P(CudaSourceWindows, GiveTheBitsOfTheThreePhases) {
  const Case& c = GetParam();
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer runs on a GPU";
  std::string why;
  if (c.cutlass && !CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  auto windowed = RunLayer(c, true);
  ASSERT_TRUE(windowed.ok()) << windowed.status();
  auto phased = RunLayer(c, false);
  ASSERT_TRUE(phased.ok()) << phased.status();
  for (int call = 0; call < kCalls; ++call)
    for (int32_t r = 0; r < kW; ++r) {
      EXPECT_TRUE((*windowed)[static_cast<size_t>(call)][static_cast<size_t>(r)].windowed) << "call " << call + 1 << " rank " << r;
      EXPECT_FALSE((*phased)[static_cast<size_t>(call)][static_cast<size_t>(r)].windowed) << "call " << call + 1 << " rank " << r;
    }
  ExpectSameBits(*windowed, *phased);
}

TEST_P(CudaSourceWindows, PlanAndRunTakeTheThreePhases) {
  const Case& c = GetParam();
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer runs on a GPU";
  std::string why;
  if (c.cutlass && !CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  auto windowed = RunLayer(c, true);
  ASSERT_TRUE(windowed.ok()) << windowed.status();
  auto split = RunLayer(c, true, /*split=*/true);
  ASSERT_TRUE(split.ok()) << split.status();
  for (int call = 0; call < kCalls; ++call)
    for (int32_t r = 0; r < kW; ++r)
      EXPECT_FALSE((*split)[static_cast<size_t>(call)][static_cast<size_t>(r)].windowed) << "call " << call + 1 << " rank " << r;
  ExpectSameBits(*split, *windowed);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaSourceWindows,
                         ::testing::Values(Case{.name = "uniform"}, Case{.name = "zipf2", .routing = "zipf:2"},
                                           Case{.name = "one_expert", .routing = "one-expert"},
                                           Case{.name = "owner_reduce", .routing = "one-expert", .owner_reduce = true},
                                           Case{.name = "sm_budget", .routing = "zipf:1", .transport_sms = 3},
                                           Case{.name = "H40", .routing = "zipf:1", .hidden = 40},
                                           Case{.name = "cutlass_zipf1", .routing = "zipf:1", .cutlass = true}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Two layers of one shape on one domain share the segment payload and sideband (LayerRegions::shared_transport),
// with the owner's reduce, whose backward reads every position's row count: forward A (short windows: rank 1
// holds 17 tokens, rank 2 none), forward B (full windows), backward B, backward A. B's calls leave rows in A's
// window tails, so A's backward is right only if its own scatter clears them again. Windows against the three
// phases, both layers' outputs and gradients bit for bit, none left unwritten.
StatusOr<std::vector<std::vector<RankOut>>> RunStack(bool windows) {
  const Case c{.name = "stack", .owner_reduce = true};
  const LayerShape s = Shape(c);
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.source_windows = windows;
  cfg.owner_reduce = true;
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, kW);
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(
                                         kW, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(kW, std::min(kW, cuda::DeviceCount()))}));
  RDEP_ASSIGN_OR_RETURN(auto a, CudaMoELayer::Create(*domain, cfg, own, RandomWeights(s, 7)));
  RDEP_ASSIGN_OR_RETURN(auto b, CudaMoELayer::Create(*domain, cfg, own, RandomWeights(s, 8)));
  std::vector<ForwardContext> ctx_a(kW), ctx_b(kW);
  RDEP_ASSIGN_OR_RETURN(Routing rt_a, CallRouting(c, s, 3));  // short and empty ranks
  RDEP_ASSIGN_OR_RETURN(Routing rt_b, CallRouting(c, s, 1));  // every rank full
  const auto x_a = RandomActivations(s, rt_a, 31), dy_a = RandomActivations(s, rt_a, 32);
  const auto x_b = RandomActivations(s, rt_b, 33), dy_b = RandomActivations(s, rt_b, 34);
  std::vector<std::vector<RankOut>> out(2, std::vector<RankOut>(kW));
  RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch ba, bb;
    RDEP_RETURN_IF_ERROR(Upload(rt_a[i], x_a[i], dy_a[i], s.hidden, ba));
    RDEP_RETURN_IF_ERROR(Upload(rt_b[i], x_b[i], dy_b[i], s.hidden, bb));
    for (Batch* bt : {&ba, &bb}) {
      const auto nh = static_cast<size_t>(std::max<int64_t>(bt->n * s.hidden, 1)), nk = static_cast<size_t>(std::max<int64_t>(bt->n * s.topk, 1));
      for (auto [p, bytes] : {std::pair<void*, size_t>{bt->y, nh * 2}, {bt->dx, nh * 2}, {bt->dg, nk * 4}})
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0xFF, bytes));
    }
    RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    RDEP_RETURN_IF_ERROR(a->Forward(r, ctx_a[i], ba.e, ba.g, ba.n, ba.x, ba.y));
    RDEP_RETURN_IF_ERROR(b->Forward(r, ctx_b[i], bb.e, bb.g, bb.n, bb.x, bb.y));
    RDEP_RETURN_IF_ERROR(b->Backward(r, ctx_b[i], bb.dy, bb.dx, bb.dg));
    RDEP_RETURN_IF_ERROR(a->Backward(r, ctx_a[i], ba.dy, ba.dx, ba.dg));
    RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
    const auto L = static_cast<size_t>(own.num_local(r));
    const std::pair<CudaMoELayer*, Batch*> layers[] = {{a.get(), &ba}, {b.get(), &bb}};
    for (size_t m = 0; m < 2; ++m) {
      auto [layer, bt] = layers[m];
      RankOut& o = out[m][i];
      o.windowed = layer->source_windows(m == 0 ? ctx_a[i] : ctx_b[i], r);
      RDEP_RETURN_IF_ERROR(Collect(*layer, r, *bt, s, L, o));
    }
    return Status::Ok();
  }));
  return out;
}

TEST(CudaSourceWindowsStack, BackwardsOfTwoLayersWithTheOwnersReduce) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer runs on a GPU";
  auto windowed = RunStack(true);
  ASSERT_TRUE(windowed.ok()) << windowed.status();
  auto phased = RunStack(false);
  ASSERT_TRUE(phased.ok()) << phased.status();
  for (size_t m = 0; m < 2; ++m)
    for (int32_t r = 0; r < kW; ++r) {
      EXPECT_TRUE((*windowed)[m][static_cast<size_t>(r)].windowed) << "layer " << m << " rank " << r;
      EXPECT_FALSE((*phased)[m][static_cast<size_t>(r)].windowed) << "layer " << m << " rank " << r;
    }
  ExpectSameBits(*windowed, *phased);  // [layer][rank]: the helper's "call" is the layer here
}

// The counts of a windowed Forward were never exchanged: recv_counts refuses its context, naming the
// windows and what gives the counts; after a Plan on the same layer it answers.
TEST(CudaSourceWindowsRows, RecvCountsOfAWindowedForwardAreRefused) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer runs on a GPU";
  const Case c{.name = "rows"};
  const LayerShape s = Shape(c);
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, kW);
  auto domain = CudaDomain::CreateSingleProcess(kW, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(kW, std::min(kW, cuda::DeviceCount()))});
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, MakeLayerConfig(s), own, RandomWeights(s, 7));
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto rt = CallRouting(c, s, 1);
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto x = RandomActivations(s, *rt, 9);
  std::vector<ForwardContext> ctxs(kW);
  std::vector<std::string> refused(kW);
  std::vector<int64_t> planned_rows(kW, -1);
  Status st = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload((*rt)[i], x[i], x[i], s.hidden, b));
    ForwardContext& ctx = ctxs[i];
    RDEP_RETURN_IF_ERROR((*layer)->Forward(r, ctx, b.e, b.g, b.n, b.x, b.y));
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    refused[i] = (*layer)->recv_counts(ctx).status().message();
    RDEP_RETURN_IF_ERROR((*layer)->Plan(r, ctx, b.e, b.g, b.n));
    RDEP_ASSIGN_OR_RETURN(std::vector<int64_t> counts, (*layer)->recv_counts(ctx));
    planned_rows[i] = 0;
    for (int64_t v : counts) planned_rows[i] += v;
    return (*layer)->Run(r, ctx, b.x, b.y);
  });
  ASSERT_TRUE(st.ok()) << st;
  int64_t rows = 0;
  for (int32_t r = 0; r < kW; ++r) {
    EXPECT_NE(refused[static_cast<size_t>(r)].find("per-source windows"), std::string::npos) << "rank " << r << ": " << refused[static_cast<size_t>(r)];
    EXPECT_NE(refused[static_cast<size_t>(r)].find("call Plan"), std::string::npos) << "rank " << r << ": " << refused[static_cast<size_t>(r)];
    rows += planned_rows[static_cast<size_t>(r)];
  }
  EXPECT_EQ(rows, s.ranks * s.tokens * s.topk) << "the plan's counts hold every row (dropless)";
}

}  // namespace
}  // namespace rdep
#endif  // RDEP_HAVE_CUDA
