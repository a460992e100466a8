// Caller-owned forward contexts on the CUDA layer (W = 4, ranks sharing the GPUs present): two
// forwards in flight before their backwards, in either order, and two plans made before either run
// (Plan/Run apart), give bitwise the results of forward/backward pairs run one after the other, with
// capacity drops and several segments.
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>

#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "layer/cuda_test_util.h"

namespace rdep {
namespace {

constexpr int32_t kW = 4;
constexpr int kPlan = 10, kRun = 20;  // schedule steps: Plan or Run of micro-batch m alone

struct Fixture {
  LayerShape shape{.tokens = 48, .hidden = 64, .ffn = 32, .experts = 12, .topk = 3, .ranks = kW};
  OwnershipMap own = *OwnershipMap::Contiguous(12, kW);
  MoEWeights w = RandomWeights(shape, 1);
  LayerConfig config = MakeLayerConfig(shape, {.capacity_factor = 0.9}, 20);
  Routing routing[2] = {*GenerateRouting(shape, RoutingSpec{}), *GenerateRouting(shape, *RoutingSpec::Parse("zipf:1.2"))};
  std::vector<std::vector<float>> x[2] = {RandomActivations(shape, routing[0], 2), RandomActivations(shape, routing[1], 3)};
  std::vector<std::vector<float>> dy[2] = {RandomActivations(shape, routing[0], 4), RandomActivations(shape, routing[1], 5)};
};

// Per micro-batch, per rank: y, dx (bf16 bits), dgates, dW1, dW2.
struct Result {
  std::array<std::vector<uint16_t>, kW> y, dx;
  std::array<std::vector<float>, kW> dg, dw1, dw2;
};

void RunSchedule(Fixture& f, CudaDomain& domain, CudaMoELayer& layer, const std::vector<int>& order, Result out[2]) {
  std::vector<std::array<ForwardContext, 2>> ctx(kW);
  Status s = domain.Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    const int64_t H = f.shape.hidden, K = f.shape.topk;
    Batch b[2];
    for (int m = 0; m < 2; ++m) RDEP_RETURN_IF_ERROR(Upload(f.routing[m][i], f.x[m][i], f.dy[m][i], H, b[m]));
    for (int step : order) {  // m: forward of m; ~m: backward of m; kPlan + m, kRun + m: the forward's two steps
      const int m = step < 0 ? ~step : step % 10;
      Batch& bm = b[m];
      ForwardContext& c = ctx[i][static_cast<size_t>(m)];
      if (step >= kPlan && step < kRun) {
        RDEP_RETURN_IF_ERROR(layer.Plan(r, c, bm.e, bm.g, bm.n));
        continue;
      }
      if (step >= kRun) {
        RDEP_RETURN_IF_ERROR(layer.Run(r, c, bm.x, bm.y));
        continue;
      }
      if (step >= 0) {
        RDEP_RETURN_IF_ERROR(layer.Forward(r, c, bm.e, bm.g, bm.n, bm.x, bm.y));
        continue;
      }
      RDEP_RETURN_IF_ERROR(layer.Backward(r, c, bm.dy, bm.dx, bm.dg));
      RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
      RDEP_ASSIGN_OR_RETURN(out[m].y[i], Download(reinterpret_cast<const uint16_t*>(bm.y), static_cast<size_t>(bm.n * H)));
      RDEP_ASSIGN_OR_RETURN(out[m].dx[i], Download(reinterpret_cast<const uint16_t*>(bm.dx), static_cast<size_t>(bm.n * H)));
      RDEP_ASSIGN_OR_RETURN(out[m].dg[i], Download(bm.dg, static_cast<size_t>(bm.n * K)));
      const size_t L = static_cast<size_t>(f.own.num_local(r));
      RDEP_ASSIGN_OR_RETURN(out[m].dw1[i], Download(layer.dw1(r), L * static_cast<size_t>(H * 2 * f.shape.ffn)));
      RDEP_ASSIGN_OR_RETURN(out[m].dw2[i], Download(layer.dw2(r), L * static_cast<size_t>(f.shape.ffn * H)));
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
}

void ExpectSame(const Result& a, const Result& b, const char* what) {
  for (size_t i = 0; i < kW; ++i) {
    EXPECT_EQ(a.y[i], b.y[i]) << what << ": y, rank " << i;
    EXPECT_EQ(a.dx[i], b.dx[i]) << what << ": dx, rank " << i;
    EXPECT_EQ(a.dg[i], b.dg[i]) << what << ": dgates, rank " << i;
    EXPECT_EQ(a.dw1[i], b.dw1[i]) << what << ": dW1, rank " << i;
    EXPECT_EQ(a.dw2[i], b.dw2[i]) << what << ": dW2, rank " << i;
  }
}

TEST(ForwardContext_Cuda, W4_TwoForwardsInFlightEqualSequentialPairs) {
  const int gpus = cuda::DeviceCount();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device";
  Fixture f;
  auto domain = CudaDomain::CreateSingleProcess(kW, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(kW, std::min(kW, gpus))});
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, f.config, f.own, f.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  Result sequential[2], nested[2], interleaved[2], planned_ahead[2];
  RunSchedule(f, **domain, **layer, {0, ~0, 1, ~1}, sequential);
  RunSchedule(f, **domain, **layer, {0, 1, ~1, ~0}, nested);
  RunSchedule(f, **domain, **layer, {0, 1, ~0, ~1}, interleaved);
  RunSchedule(f, **domain, **layer, {kPlan + 0, kPlan + 1, kRun + 1, kRun + 0, ~1, ~0}, planned_ahead);
  ASSERT_FALSE(sequential[0].y[0].empty());
  ExpectSame(sequential[0], nested[0], "nested, batch 0");
  ExpectSame(sequential[1], nested[1], "nested, batch 1");
  ExpectSame(sequential[0], interleaved[0], "interleaved, batch 0");
  ExpectSame(sequential[1], interleaved[1], "interleaved, batch 1");
  ExpectSame(sequential[0], planned_ahead[0], "plans ahead of runs, batch 0");
  ExpectSame(sequential[1], planned_ahead[1], "plans ahead of runs, batch 1");
}

// With LayerConfig::load_matrix every rank's plan holds the full load matrix Lambda[W][E], equal to
// the routing's (read after Plan, before Run).
TEST(ForwardContext_Cuda, W4_PlanHoldsTheFullLoadMatrix) {
  const int gpus = cuda::DeviceCount();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device";
  Fixture f;
  f.config.load_matrix = true;
  auto domain = CudaDomain::CreateSingleProcess(kW, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(kW, std::min(kW, gpus))});
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, f.config, f.own, f.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const std::vector<int64_t> want = LoadMatrix(f.routing[1], f.shape.experts);
  std::vector<std::vector<int64_t>> got(kW);
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(f.routing[1][i], f.x[1][i], f.dy[1][i], f.shape.hidden, b));
    ForwardContext ctx;
    RDEP_RETURN_IF_ERROR((*layer)->Plan(r, ctx, b.e, b.g, b.n));
    RDEP_ASSIGN_OR_RETURN(got[i], (*layer)->CopyLoadMatrix(ctx));
    RDEP_RETURN_IF_ERROR((*layer)->Run(r, ctx, b.x, b.y));
    return (*domain)->Synchronize(r);
  });
  ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < kW; ++i) EXPECT_EQ(got[i], want) << "rank " << i;
}

}  // namespace
}  // namespace rdep
#endif
