// Caller-owned forward contexts on the host layer: two forwards in flight before their backwards (in
// either order) give bitwise the results of forward/backward pairs run one after the other; misuse
// (another layer's or rank's context, a backward without a forward, a second backward) is an error
// naming it; a context outlives its layer safely.
#include "rdep/layer/forward_context.h"

#include <gtest/gtest.h>

#include <array>

#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

constexpr int32_t kW = 4;

struct Fixture {
  LayerShape shape{.tokens = 24, .hidden = 8, .ffn = 6, .experts = 8, .topk = 3, .ranks = kW};
  std::unique_ptr<HostDomain> domain = std::move(*HostDomain::Create(kW, {.barrier_timeout_s = 10}));
  OwnershipMap own = *OwnershipMap::Contiguous(8, kW);
  MoEWeights w = RandomWeights(shape, 1);
  LayerConfig config = MakeLayerConfig(shape, {.capacity_factor = 0.8}, 5);  // drops and several segments
  // Two micro-batches with different routing, inputs and upstream gradients.
  Routing routing[2] = {*GenerateRouting(shape, RoutingSpec{}), *GenerateRouting(shape, *RoutingSpec::Parse("zipf:1.2"))};
  std::vector<std::vector<float>> x[2] = {RandomActivations(shape, routing[0], 2), RandomActivations(shape, routing[1], 3)};
  std::vector<std::vector<float>> dy[2] = {RandomActivations(shape, routing[0], 4), RandomActivations(shape, routing[1], 5)};
};

// What one micro-batch produced on every rank.
struct Result {
  std::vector<std::vector<float>> y, dx, dg, dw1, dw2;
  Result() : y(kW), dx(kW), dg(kW), dw1(kW), dw2(kW) {}
};

void RunSchedule(Fixture& f, HostMoELayer& layer, const std::vector<int>& order, Result out[2]) {
  std::vector<std::array<ForwardContext, 2>> ctx(kW);  // per rank, per micro-batch
  Status s = f.domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    for (int step : order) {  // step b >= 0: forward of b; step ~b: backward of b
      const int b = step >= 0 ? step : ~step;
      const RankRouting& rr = f.routing[b][i];
      Result& o = out[b];
      if (step >= 0) {
        o.y[i].assign(static_cast<size_t>(rr.num_tokens * f.shape.hidden), 0.f);
        RDEP_RETURN_IF_ERROR(layer.Forward(r, ctx[i][static_cast<size_t>(b)], rr, f.x[b][i], o.y[i]));
        EXPECT_TRUE(ctx[i][static_cast<size_t>(b)].ready_for_backward());
        EXPECT_GT(ctx[i][static_cast<size_t>(b)].bytes(), 0u);
      } else {
        o.dx[i].assign(o.y[i].size(), 0.f);
        o.dg[i].assign(static_cast<size_t>(rr.num_tokens * f.shape.topk), 0.f);
        RDEP_RETURN_IF_ERROR(layer.Backward(r, ctx[i][static_cast<size_t>(b)], f.dy[b][i], o.dx[i], o.dg[i]));
        o.dw1[i].assign(layer.dw1(r).begin(), layer.dw1(r).end());
        o.dw2[i].assign(layer.dw2(r).begin(), layer.dw2(r).end());
      }
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
}

void ExpectSame(const Result& a, const Result& b, const char* what) {
  for (int r = 0; r < kW; ++r) {
    const auto i = static_cast<size_t>(r);
    EXPECT_EQ(a.y[i], b.y[i]) << what << ": y, rank " << r;
    EXPECT_EQ(a.dx[i], b.dx[i]) << what << ": dx, rank " << r;
    EXPECT_EQ(a.dg[i], b.dg[i]) << what << ": dgates, rank " << r;
    EXPECT_EQ(a.dw1[i], b.dw1[i]) << what << ": dW1, rank " << r;
    EXPECT_EQ(a.dw2[i], b.dw2[i]) << what << ": dW2, rank " << r;
  }
}

TEST(ForwardContext_Host, W4_TwoForwardsInFlightEqualSequentialPairs) {
  Fixture f;
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own, f.w);
  Result sequential[2], nested[2], interleaved[2];
  RunSchedule(f, *layer, {0, ~0, 1, ~1}, sequential);
  RunSchedule(f, *layer, {0, 1, ~1, ~0}, nested);       // last in, first out (pipeline / recompute)
  RunSchedule(f, *layer, {0, 1, ~0, ~1}, interleaved);  // first in, first out (micro-batches)
  ASSERT_FALSE(sequential[0].y[0].empty());
  ExpectSame(sequential[0], nested[0], "nested, batch 0");
  ExpectSame(sequential[1], nested[1], "nested, batch 1");
  ExpectSame(sequential[0], interleaved[0], "interleaved, batch 0");
  ExpectSame(sequential[1], interleaved[1], "interleaved, batch 1");
}

// Plan and Run apart: two plans before either run, runs and backwards in the other order, equal to
// plain forwards; a run without a plan is refused.
TEST(ForwardContext_Host, W4_PlansAheadOfRunsEqualForwards) {
  Fixture f;
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own, f.w);
  Result plain[2];
  RunSchedule(f, *layer, {0, ~0, 1, ~1}, plain);
  std::vector<std::vector<float>> y[2] = {std::vector<std::vector<float>>(kW), std::vector<std::vector<float>>(kW)};
  std::vector<Status> no_plan(kW);
  Status s = f.domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    std::array<ForwardContext, 2> ctx;
    for (int b : {0, 1}) RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx[static_cast<size_t>(b)], f.routing[b][i]));
    for (int b : {1, 0}) {
      y[b][i].assign(static_cast<size_t>(f.routing[b][i].num_tokens * f.shape.hidden), 0.f);
      RDEP_RETURN_IF_ERROR(layer->Run(r, ctx[static_cast<size_t>(b)], f.x[b][i], y[b][i]));
    }
    ForwardContext fresh;
    no_plan[i] = layer->Run(r, fresh, f.x[0][i], y[0][i]);
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < kW; ++i) {
    EXPECT_EQ(y[0][i], plain[0].y[i]) << "batch 0, rank " << i;
    EXPECT_EQ(y[1][i], plain[1].y[i]) << "batch 1, rank " << i;
    EXPECT_EQ(no_plan[i].code(), StatusCode::kFailedPrecondition) << no_plan[i];
    EXPECT_NE(no_plan[i].message().find("holds no plan"), std::string::npos) << no_plan[i];
  }
}

// With LayerConfig::load_matrix every rank's plan holds the full load matrix Lambda[W][E], equal to
// the routing's; without it, asking is an error.
TEST(ForwardContext_Host, W4_PlanHoldsTheFullLoadMatrix) {
  Fixture f;
  for (bool on : {true, false}) {
    LayerConfig cfg = f.config;
    cfg.load_matrix = on;
    auto layer = *HostMoELayer::Create(*f.domain, cfg, f.own, f.w);
    const std::vector<int64_t> want = LoadMatrix(f.routing[1], f.shape.experts);
    std::vector<StatusOr<std::vector<int64_t>>> got(kW, std::vector<int64_t>{});
    Status s = f.domain->Run([&](int32_t r) -> Status {
      ForwardContext ctx;
      RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx, f.routing[1][static_cast<size_t>(r)]));
      got[static_cast<size_t>(r)] = layer->load_matrix(ctx);
      std::vector<float> y(static_cast<size_t>(f.routing[1][static_cast<size_t>(r)].num_tokens * f.shape.hidden));
      return layer->Run(r, ctx, f.x[1][static_cast<size_t>(r)], y);
    });
    ASSERT_TRUE(s.ok()) << s;
    for (int r = 0; r < kW; ++r) {
      if (!on) {
        EXPECT_EQ(got[static_cast<size_t>(r)].status().code(), StatusCode::kFailedPrecondition);
        continue;
      }
      ASSERT_TRUE(got[static_cast<size_t>(r)].ok()) << got[static_cast<size_t>(r)].status();
      EXPECT_EQ(*got[static_cast<size_t>(r)], want) << "rank " << r;
    }
  }
}

TEST(ForwardContext_Host, MisuseIsAnErrorNamingIt) {
  Fixture f;
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own, f.w);
  auto other = *HostMoELayer::Create(*f.domain, f.config, f.own, f.w);
  std::vector<ForwardContext> ctx(kW);
  std::vector<Status> no_forward(kW), wrong_layer(kW), wrong_rank(kW), second(kW);
  Status s = f.domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    const RankRouting& rr = f.routing[0][i];
    std::vector<float> y(static_cast<size_t>(rr.num_tokens * f.shape.hidden)), dx(y.size());
    std::vector<float> dg(static_cast<size_t>(rr.num_tokens * f.shape.topk));
    no_forward[i] = layer->Backward(r, ctx[i], f.dy[0][i], dx, dg);
    RDEP_RETURN_IF_ERROR(layer->Forward(r, ctx[i], rr, f.x[0][i], y));
    wrong_layer[i] = other->Backward(r, ctx[i], f.dy[0][i], dx, dg);
    wrong_rank[i] = layer->Backward((r + 1) % kW, ctx[i], f.dy[0][i], dx, dg);
    RDEP_RETURN_IF_ERROR(layer->Backward(r, ctx[i], f.dy[0][i], dx, dg));
    second[i] = layer->Backward(r, ctx[i], f.dy[0][i], dx, dg);
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < kW; ++r) {
    const auto i = static_cast<size_t>(r);
    EXPECT_EQ(no_forward[i].code(), StatusCode::kFailedPrecondition) << no_forward[i];
    EXPECT_NE(no_forward[i].message().find("without a completed forward"), std::string::npos) << no_forward[i];
    EXPECT_EQ(wrong_layer[i].code(), StatusCode::kInvalidArgument) << wrong_layer[i];
    EXPECT_NE(wrong_layer[i].message().find("belongs to another layer"), std::string::npos) << wrong_layer[i];
    EXPECT_EQ(wrong_rank[i].code(), StatusCode::kInvalidArgument) << wrong_rank[i];
    EXPECT_NE(wrong_rank[i].message().find("belongs to rank " + std::to_string(r)), std::string::npos) << wrong_rank[i];
    EXPECT_EQ(second[i].code(), StatusCode::kFailedPrecondition) << second[i];
    EXPECT_NE(second[i].message().find("already used by a backward"), std::string::npos) << second[i];
  }
  // Contexts outlive their layer: destroying the layer first is safe, and the context is refused by
  // a new layer (and freed with the context).
  layer.reset();
  EXPECT_GT(ctx[0].bytes(), 0u);
  s = f.domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    std::vector<float> y(static_cast<size_t>(f.routing[0][i].num_tokens * f.shape.hidden));
    return other->Forward(r, ctx[i], f.routing[0][i], f.x[0][i], y);
  });
  EXPECT_NE(s.message().find("belongs to another layer"), std::string::npos) << s;
  ctx[0].Release();
  EXPECT_EQ(ctx[0].bytes(), 0u);
}

}  // namespace
}  // namespace rdep
