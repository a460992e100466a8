// The W = 1 combine reading the owner's rows in place (CudaMoELayer::CombinesInPlace): against the same layer
// made with RDEP_W1_RETURN=copy (the rows copied into the return region by row identity, as at W > 1), two
// forward and backward calls each (the second finds the first's values everywhere): y, dx, dgates, dW1 and dW2
// bit for bit, outputs poisoned with NaN first, and which path each layer took (combined_in_place). Cases: the
// sync-free CUTLASS owner (uniform, Zipf 2 with capacity drops, the gate before W2, the paged stash) and the
// host-synced cuBLASLt owner (its dx rows behind the dout rows); two segments and owner_reduce keep the copy.
// A bad RDEP_W1_RETURN is refused by Create, naming it. Skips without a GPU (the CUTLASS cases also where the
// CUTLASS compute cannot be made: a failure under RDEP_REQUIRE_CUTLASS=1).
//   exercise: build-*/src/layer/layer_test --gtest_filter='*CudaW1InPlace*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/device_count.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

struct Case {
  std::string name;
  ExpertComputeKind compute = ExpertComputeKind::kCutlass;
  std::string routing = "uniform";
  double capacity_factor = 0;
  bool gate_in_expert = false;
  int64_t stash_rows = 0;
  int64_t segment_tokens = 0;  // 0: one segment (W*T)
  bool owner_reduce = false;
  bool in_place = true;  // what the default layer is expected to do
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

const LayerShape kShape{.tokens = 96, .hidden = 128, .ffn = 64, .experts = 8, .topk = 3, .ranks = 1};

struct Outputs {
  W1Outputs rows;
  bool in_place = false;  // the call combined the owner's rows in place
};

LayerConfig ConfigOf(const Case& c) {
  LayerConfig cfg = MakeLayerConfig(kShape, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment_tokens);
  cfg.expert_compute = c.compute;
  cfg.gate_in_expert = c.gate_in_expert;
  cfg.stash_rows = c.stash_rows;
  cfg.owner_reduce = c.owner_reduce;
  return cfg;
}

// Two calls (routing seeds 1 and 2) on one W = 1 layer made with RDEP_W1_RETURN=`setting` (null: unset).
StatusOr<std::vector<Outputs>> RunCalls(const Case& c, const char* setting) {
  const OwnershipMap ownership = *OwnershipMap::Contiguous(kShape.experts, 1);
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(1, {.barrier_timeout_s = 20, .devices = {0}}));
  StatusOr<std::unique_ptr<CudaMoELayer>> made = InvalidArgument("not made");
  {
    const ScopedEnv env("RDEP_W1_RETURN", setting);
    made = CudaMoELayer::Create(*domain, ConfigOf(c), ownership, RandomWeights(kShape, 5));
  }
  RDEP_ASSIGN_OR_RETURN(auto layer, std::move(made));
  std::vector<Outputs> out;
  for (uint64_t call = 1; call <= 2; ++call) {
    Outputs o;
    bool forward_in_place = false;
    RDEP_ASSIGN_OR_RETURN(o.rows, RunW1Call(*layer, *domain, kShape, c.routing, call,
                                            [&] { forward_in_place = layer->combined_in_place(0); }));
    if (layer->combined_in_place(0) != forward_in_place)
      return InternalError("the backward's combine took the other path than its forward's");
    o.in_place = forward_in_place;
    out.push_back(std::move(o));
  }
  return out;
}

class CudaW1InPlace : public ::testing::TestWithParam<Case> {};

TEST_P(CudaW1InPlace, BitwiseTheLayerThatCopiesItsRows) {
  const Case& c = GetParam();
  std::string why;
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  if (c.compute == ExpertComputeKind::kCutlass && !CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  auto in_place = RunCalls(c, nullptr);
  ASSERT_TRUE(in_place.ok()) << in_place.status();
  auto copy = RunCalls(c, "copy");
  ASSERT_TRUE(copy.ok()) << copy.status();
  for (size_t call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call + 1));
    const Outputs &a = (*in_place)[call], &b = (*copy)[call];
    EXPECT_EQ(a.in_place, c.in_place) << "the default layer's path";
    EXPECT_FALSE(b.in_place) << "RDEP_W1_RETURN=copy combined in place";
    EXPECT_TRUE(b.rows.AllFinite()) << "a poisoned output was not written";
    EXPECT_TRUE(a.rows == b.rows) << "not the bits of the layer that copies its rows into the return region";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaW1InPlace,
    ::testing::Values(Case{"cutlass_uniform"}, Case{"cutlass_zipf2_drops", ExpertComputeKind::kCutlass, "zipf:2", 0.8},
                      Case{"cutlass_gate", ExpertComputeKind::kCutlass, "zipf:1", 0, true},
                      Case{"cutlass_stash", ExpertComputeKind::kCutlass, "zipf:1.5", 0, false, 4096},
                      Case{"cublaslt_uniform", ExpertComputeKind::kCublasLt},
                      Case{"cublaslt_zipf2_drops", ExpertComputeKind::kCublasLt, "zipf:2", 0.8},
                      Case{"cutlass_two_segments_copy", ExpertComputeKind::kCutlass, "uniform", 0, false, 0, 48, false, false},
                      Case{"cublaslt_two_segments_copy", ExpertComputeKind::kCublasLt, "zipf:1", 0, false, 0, 48, false, false},
                      Case{"owner_reduce_copy", ExpertComputeKind::kCutlass, "zipf:1", 0.9, false, 0, 0, true, false}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(CudaW1InPlaceSetting, ABadValueIsNamedByCreate) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto domain = CudaDomain::CreateSingleProcess(1, {.barrier_timeout_s = 20, .devices = {0}});
  ASSERT_TRUE(domain.ok()) << domain.status();
  const ScopedEnv env("RDEP_W1_RETURN", "sideways");
  Case c{"cublaslt", ExpertComputeKind::kCublasLt};
  auto made = CudaMoELayer::Create(**domain, ConfigOf(c), *OwnershipMap::Contiguous(kShape.experts, 1), RandomWeights(kShape, 5));
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("RDEP_W1_RETURN='sideways'"), std::string::npos) << made.status();
}

}  // namespace
}  // namespace rdep
#endif  // RDEP_HAVE_CUDA
