// The CUTLASS compute's SwiGLU scratch in the return region at W = 1 (ScratchInReturnRegion, layer_config.h):
// one rank, one segment a call, so nothing stores into the return region while the owner's compute uses it.
// Against the same layer with a scratch of its own (RDEP_EXPERT_SCRATCH=own at Create), two forward and backward
// calls each (the second finds the first's values in both regions): y, dx, dgates, dW1 and dW2 bit for bit, outputs
// poisoned with NaN first; and the layer's shared rows hold the scratch's bytes less. Cases: uniform, Zipf 2 with
// capacity drops, the gate before W2, owner_reduce (with and without the gate), the gate with the paged stash.
// Skips without a GPU or where the CUTLASS compute cannot be made (a failure under RDEP_REQUIRE_CUTLASS=1).
//   exercise: build-*/src/layer/layer_test --gtest_filter='*CudaScratchInReturn*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/device_count.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

struct Case {
  std::string name;
  std::string routing = "uniform";
  double capacity_factor = 0;
  bool gate_in_expert = false;
  bool owner_reduce = false;
  int64_t stash_rows = 0;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Outputs {
  W1Outputs rows;
  size_t shared_row_bytes = 0;
};

// Two calls (routing seeds 1 and 2) on one W = 1 layer; `own`: a scratch of its own.
StatusOr<std::vector<Outputs>> RunCalls(const Case& c, bool own) {
  const LayerShape s{.tokens = 96, .hidden = 128, .ffn = 64, .experts = 8, .topk = 3, .ranks = 1};
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor});
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.gate_in_expert = c.gate_in_expert;
  cfg.owner_reduce = c.owner_reduce;
  cfg.stash_rows = c.stash_rows;
  const OwnershipMap ownership = *OwnershipMap::Contiguous(s.experts, 1);
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(1, {.barrier_timeout_s = 20, .devices = {0}}));
  StatusOr<std::unique_ptr<CudaMoELayer>> made = InvalidArgument("not made");
  {
    const ScopedEnv env("RDEP_EXPERT_SCRATCH", own ? "own" : nullptr);
    made = CudaMoELayer::Create(*domain, cfg, ownership, RandomWeights(s, 5));
  }
  RDEP_ASSIGN_OR_RETURN(auto layer, std::move(made));
  std::vector<Outputs> out(2);
  for (uint64_t call = 1; call <= 2; ++call) {
    RDEP_ASSIGN_OR_RETURN(out[call - 1].rows, RunW1Call(*layer, *domain, s, c.routing, call));
    out[call - 1].shared_row_bytes = layer->shared_row_bytes();
  }
  return out;
}

class CudaScratchInReturn : public ::testing::TestWithParam<Case> {};

// The shape's scratch (max_rows x F) must fit its return region (T*K x H): F <= H here, or both layers would keep a
// scratch of their own and the comparison would prove nothing (the memory check below also catches that).
TEST_P(CudaScratchInReturn, BitwiseTheLayerWithAScratchOfItsOwn) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  auto in_return = RunCalls(GetParam(), false);
  ASSERT_TRUE(in_return.ok()) << in_return.status();
  auto own = RunCalls(GetParam(), true);
  ASSERT_TRUE(own.ok()) << own.status();
  for (size_t call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call + 1));
    EXPECT_TRUE((*own)[call].rows.AllFinite()) << "a poisoned output was not written";
    EXPECT_TRUE((*in_return)[call].rows == (*own)[call].rows) << "not the bits of the layer with a scratch of its own";
  }
  // The scratch is max_rows rows of F bf16 values: the W = 1 layer holds that much less.
  const LayerShape s{.tokens = 96, .hidden = 128, .ffn = 64, .experts = 8, .topk = 3, .ranks = 1};
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = GetParam().capacity_factor});
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.segment_tokens = s.tokens;  // what Create sets for 0 (W*T)
  const RegionLayout l = MakeRegionLayout(cfg, *OwnershipMap::Contiguous(s.experts, 1), 2);
  const size_t scratch = kernels::CutlassExpertScratchBytes({1, s.hidden, s.ffn, std::max<int64_t>(MaxSegmentRows(cfg, l), 1)});
  EXPECT_TRUE(ScratchInReturnRegion(cfg, l, scratch)) << "the case does not take the path under test";
  EXPECT_EQ((*own)[0].shared_row_bytes - (*in_return)[0].shared_row_bytes, scratch);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaScratchInReturn,
                         ::testing::Values(Case{"uniform"}, Case{"zipf2_drops", "zipf:2", 0.8}, Case{"gate", "zipf:1", 0, true},
                                           Case{"owner_reduce", "zipf:1", 0.9, false, true},
                                           Case{"gate_owner_reduce", "zipf:1", 0, true, true},
                                           Case{"gate_stash", "zipf:1.5", 0, true, false, 4096}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(ScratchInReturnRegion, OnlyForOneRankAndOneSegment) {
  const LayerShape s{.tokens = 96, .hidden = 128, .ffn = 64, .experts = 8, .topk = 3, .ranks = 1};
  const OwnershipMap one = *OwnershipMap::Contiguous(8, 1);
  LayerConfig cfg = MakeLayerConfig(s, {}, s.tokens);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  const RegionLayout l = MakeRegionLayout(cfg, one, 2);
  EXPECT_TRUE(ScratchInReturnRegion(cfg, l, 1024));
  EXPECT_FALSE(ScratchInReturnRegion(cfg, l, l.return_bytes() + 1)) << "larger than the region";
  LayerConfig lt = cfg;
  lt.expert_compute = ExpertComputeKind::kCublasLt;
  EXPECT_FALSE(ScratchInReturnRegion(lt, l, 1024));
  LayerConfig seg = cfg;
  seg.segment_tokens = 32;  // three segments: the return region is written between the computes
  EXPECT_FALSE(ScratchInReturnRegion(seg, MakeRegionLayout(seg, one, 2), 1024));
  LayerShape s4 = s;
  s4.ranks = 4;
  LayerConfig four = MakeLayerConfig(s4, {}, 4 * s.tokens);
  four.expert_compute = ExpertComputeKind::kCutlass;
  EXPECT_FALSE(ScratchInReturnRegion(four, MakeRegionLayout(four, *OwnershipMap::Contiguous(8, 4), 2), 1024))
      << "peers store into a rank's return region at any time";
}

TEST(CudaScratchInReturn_Errors, AnUnknownValueOfTheVariableIsRefusedNamingIt) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  const LayerShape s{.tokens = 32, .hidden = 64, .ffn = 32, .experts = 4, .topk = 2, .ranks = 1};
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  auto domain = CudaDomain::CreateSingleProcess(1, {.barrier_timeout_s = 5, .devices = {0}});
  ASSERT_TRUE(domain.ok()) << domain.status();
  const ScopedEnv env("RDEP_EXPERT_SCRATCH", "mine");
  auto layer = CudaMoELayer::Create(**domain, cfg, *OwnershipMap::Contiguous(s.experts, 1), RandomWeights(s, 1));
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().code(), StatusCode::kInvalidArgument) << layer.status();
  EXPECT_NE(layer.status().message().find("RDEP_EXPERT_SCRATCH='mine'"), std::string::npos) << layer.status();
}

// Layers of one shape share the return region ("layer.return", acquired by name and size: T*K*H of the shape)
// whatever their compute and segments: A (CUTLASS, its
// scratch in the return region), B (cuBLASLt), C (CUTLASS in three segments, a scratch of its own) on one W = 1
// domain, called A, B, C forward then A, B, C backward: each one's results are the bits of the same layer alone on
// a domain of its own, so no call's scratch reaches rows another call still needs.
TEST(CudaScratchInReturn_Sharing, W1_LayersOfOneShapeInterleavedEqualEachAlone) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  const LayerShape s{.tokens = 96, .hidden = 128, .ffn = 64, .experts = 8, .topk = 3, .ranks = 1};
  const OwnershipMap ownership = *OwnershipMap::Contiguous(s.experts, 1);
  LayerConfig a = MakeLayerConfig(s), b = MakeLayerConfig(s), c = MakeLayerConfig(s, {}, 32);
  a.expert_compute = c.expert_compute = ExpertComputeKind::kCutlass;
  const LayerConfig cfgs[3] = {a, b, c};
  std::vector<Routing> routing;
  std::vector<std::vector<std::vector<float>>> xs, dys;
  for (uint64_t i = 0; i < 3; ++i) {
    RoutingSpec spec = *RoutingSpec::Parse(i == 1 ? "uniform" : "zipf:1.2");
    spec.seed = 3 + i;
    routing.push_back(*GenerateRouting(s, spec));
    xs.push_back(RandomActivations(s, routing.back(), 30 + i));
    dys.push_back(RandomActivations(s, routing.back(), 40 + i));
  }
  struct Got {
    std::vector<uint16_t> y, dx;
    std::vector<float> dg, dw1, dw2;
  };
  // Runs the layers on one domain (order: every forward, then every backward) or each on its own.
  auto run = [&](bool shared) -> StatusOr<std::vector<Got>> {
    const ScopedEnv env("RDEP_EXPERT_SCRATCH", nullptr);
    std::vector<std::unique_ptr<CudaDomain>> domains;
    std::vector<std::unique_ptr<CudaMoELayer>> layers;
    for (int i = 0; i < 3; ++i) {
      if (!shared || domains.empty()) {
        RDEP_ASSIGN_OR_RETURN(auto d, CudaDomain::CreateSingleProcess(1, {.barrier_timeout_s = 20, .devices = {0}}));
        domains.push_back(std::move(d));
      }
      RDEP_ASSIGN_OR_RETURN(auto l, CudaMoELayer::Create(*domains.back(), cfgs[i], ownership, RandomWeights(s, 50 + i)));
      layers.push_back(std::move(l));
    }
    std::vector<Batch> batches(3);
    std::vector<Got> got(3);
    for (size_t i = 0; i < 3; ++i) {
      RDEP_RETURN_IF_ERROR(Upload(routing[i][0], xs[i][0], dys[i][0], s.hidden, batches[i]));
      RDEP_RETURN_IF_ERROR(layers[i]->Forward(0, batches[i].e, batches[i].g, batches[i].n, batches[i].x, batches[i].y));
    }
    for (size_t i = 0; i < 3; ++i) RDEP_RETURN_IF_ERROR(layers[i]->Backward(0, batches[i].dy, batches[i].dx, batches[i].dg));
    for (size_t i = 0; i < 3; ++i) {
      RDEP_RETURN_IF_ERROR(domains[shared ? 0 : i]->Synchronize(0));
      const Batch& bt = batches[i];
      const auto nh = static_cast<size_t>(bt.n * s.hidden), nk = static_cast<size_t>(bt.n * s.topk);
      RDEP_ASSIGN_OR_RETURN(got[i].y, Download(reinterpret_cast<const uint16_t*>(bt.y), nh));
      RDEP_ASSIGN_OR_RETURN(got[i].dx, Download(reinterpret_cast<const uint16_t*>(bt.dx), nh));
      RDEP_ASSIGN_OR_RETURN(got[i].dg, Download(bt.dg, nk));
      RDEP_ASSIGN_OR_RETURN(got[i].dw1, Download(layers[i]->dw1(0), static_cast<size_t>(s.experts * 2 * s.hidden * s.ffn)));
      RDEP_ASSIGN_OR_RETURN(got[i].dw2, Download(layers[i]->dw2(0), static_cast<size_t>(s.experts * s.ffn * s.hidden)));
    }
    return got;
  };
  auto alone = run(false);
  ASSERT_TRUE(alone.ok()) << alone.status();
  auto together = run(true);
  ASSERT_TRUE(together.ok()) << together.status();
  const char* names[3] = {"A (scratch in the return region)", "B (cuBLASLt)", "C (three segments)"};
  for (size_t i = 0; i < 3; ++i) {
    const Got &g = (*together)[i], &w = (*alone)[i];
    EXPECT_EQ(g.y, w.y) << names[i] << ": y";
    EXPECT_EQ(g.dx, w.dx) << names[i] << ": dx";
    EXPECT_EQ(g.dg, w.dg) << names[i] << ": dgates";
    EXPECT_EQ(g.dw1, w.dw1) << names[i] << ": dW1";
    EXPECT_EQ(g.dw2, w.dw2) << names[i] << ": dW2";
  }
}

}  // namespace
}  // namespace rdep
#endif  // RDEP_HAVE_CUDA
