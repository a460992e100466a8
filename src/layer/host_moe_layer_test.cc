// Direct tests of the host layer's API contract: input errors, call order, segment-bounded memory,
// and a protocol failure on one rank that must not hang the others.
#include "rdep/layer/host_moe_layer.h"

#include <gtest/gtest.h>

#include <chrono>

namespace rdep {
namespace {

struct Fixture {
  LayerShape shape{.tokens = 16, .hidden = 8, .ffn = 4, .experts = 8, .topk = 2, .ranks = 4};
  std::unique_ptr<HostDomain> domain;
  OwnershipMap own = *OwnershipMap::Contiguous(8, 4);
  MoEWeights w = RandomWeights(shape, 1);
  Routing routing = *GenerateRouting(shape, RoutingSpec{});
  std::vector<std::vector<float>> x = RandomActivations(shape, routing, 2);
  Fixture() { domain = std::move(*HostDomain::Create(4, {.barrier_timeout_s = 10})); }
};

TEST(HostMoELayer, CreateRejectsMismatches) {
  Fixture f;
  LayerConfig cfg = MakeLayerConfig(f.shape);
  cfg.shape.ranks = 2;
  EXPECT_NE(HostMoELayer::Create(*f.domain, cfg, f.own, f.w).status().message().find("domain has 4"), std::string::npos);
  cfg.shape = f.shape;
  auto own2 = *OwnershipMap::Contiguous(6, 4);
  EXPECT_NE(HostMoELayer::Create(*f.domain, cfg, own2, f.w).status().message().find("ownership map"), std::string::npos);
  MoEWeights w2 = f.w;
  w2.w2.pop_back();
  EXPECT_FALSE(HostMoELayer::Create(*f.domain, cfg, f.own, w2).ok());
}

TEST(HostMoELayer, ShapeErrorOnOneRankFailsFastEverywhere) {
  Fixture f;
  auto layer = *HostMoELayer::Create(*f.domain, MakeLayerConfig(f.shape), f.own, f.w);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = f.domain->Run([&](int32_t r) -> Status {
    std::vector<float> y(static_cast<size_t>(16 * 8));
    std::vector<float> x = f.x[static_cast<size_t>(r)];
    if (r == 3) x.resize(5);  // a mismatched tensor on one rank
    return layer->Forward(r, f.routing[static_cast<size_t>(r)], x, y);
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rank 3: forward input x on rank 3 has 5 values, expected num_tokens*H = 128"),
            std::string::npos) << s;
}

TEST(HostMoELayer, BackwardBeforeForwardIsAnError) {
  Fixture f;
  auto layer = *HostMoELayer::Create(*f.domain, MakeLayerConfig(f.shape), f.own, f.w);
  Status s = f.domain->Run([&](int32_t r) -> Status {
    std::vector<float> dy(128), dx(128), dg(32);
    return layer->Backward(r, dy, dx, dg);
  });
  EXPECT_NE(s.message().find("without a completed forward"), std::string::npos) << s;
}

TEST(HostMoELayer, BufferMemoryDependsOnSegmentNotOwnerLoad) {
  Fixture f;
  // Every token to one expert: owner 0 receives all W*T tokens, yet buffers scale with S.
  Routing one = *GenerateRouting(f.shape, *RoutingSpec::Parse("one-expert"));
  for (int64_t S : {2, 4}) {
    auto layer = *HostMoELayer::Create(*f.domain, MakeLayerConfig(f.shape, {}, S), f.own, f.w);
    const RegionLayout& l = layer->layout();
    EXPECT_EQ(l.payload_bytes(), 2 * static_cast<size_t>(S) * 8 * sizeof(float));  // S < W*T: double-buffered
    Status s = f.domain->Run([&](int32_t r) -> Status {
      std::vector<float> y(128);
      return layer->Forward(r, one[static_cast<size_t>(r)], f.x[static_cast<size_t>(r)], y);
    });
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(layer->segments(0), 4 * 16 / S);  // W*T tokens at owner 0, S per segment
  }
}

}  // namespace
}  // namespace rdep
