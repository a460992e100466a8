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
#include <cmath>
#include <cstring>
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
  std::vector<uint16_t> y, dx;
  std::vector<float> dg, dw1, dw2;
  bool in_place = false;
  bool operator==(const Outputs& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
    };
    return same(y, o.y) && same(dx, o.dx) && same(dg, o.dg) && same(dw1, o.dw1) && same(dw2, o.dw2);
  }
};

bool AllFinite(const Outputs& o) {
  for (const auto* v : {&o.y, &o.dx})
    for (const uint16_t b : *v)
      if ((b & 0x7f80) == 0x7f80) return false;
  for (const auto* v : {&o.dg, &o.dw1, &o.dw2})
    for (const float f : *v)
      if (!std::isfinite(f)) return false;
  return true;
}

StatusOr<Outputs> OneCall(CudaMoELayer& layer, CudaDomain& domain, uint64_t call, const std::string& routing) {
  const LayerShape& s = kShape;
  RoutingSpec spec = *RoutingSpec::Parse(routing);
  spec.seed = call;
  RDEP_ASSIGN_OR_RETURN(Routing rt, GenerateRouting(s, spec));
  const auto x = RandomActivations(s, rt, 7 + call), dy = RandomActivations(s, rt, 17 + call);
  Batch b;
  RDEP_RETURN_IF_ERROR(Upload(rt[0], x[0], dy[0], s.hidden, b));
  const auto nh = static_cast<size_t>(b.n * s.hidden), nk = static_cast<size_t>(b.n * s.topk);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.y, 0xFF, std::max<size_t>(nh, 1) * 2));  // NaN
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dx, 0xFF, std::max<size_t>(nh, 1) * 2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dg, 0xFF, std::max<size_t>(nk, 1) * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  Outputs o;
  RDEP_RETURN_IF_ERROR(layer.Forward(0, b.e, b.g, b.n, b.x, b.y));
  const bool forward_in_place = layer.combined_in_place(0);
  RDEP_RETURN_IF_ERROR(layer.Backward(0, b.dy, b.dx, b.dg));
  RDEP_RETURN_IF_ERROR(domain.Synchronize(0));
  if (layer.combined_in_place(0) != forward_in_place)
    return InternalError("the backward's combine took the other path than its forward's");
  o.in_place = forward_in_place;
  RDEP_ASSIGN_OR_RETURN(o.y, Download(reinterpret_cast<const uint16_t*>(b.y), nh));
  RDEP_ASSIGN_OR_RETURN(o.dx, Download(reinterpret_cast<const uint16_t*>(b.dx), nh));
  RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, nk));
  RDEP_ASSIGN_OR_RETURN(o.dw1, Download(layer.dw1(0), static_cast<size_t>(s.experts * 2 * s.hidden * s.ffn)));
  RDEP_ASSIGN_OR_RETURN(o.dw2, Download(layer.dw2(0), static_cast<size_t>(s.experts * s.ffn * s.hidden)));
  return o;
}

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
    RDEP_ASSIGN_OR_RETURN(Outputs o, OneCall(*layer, *domain, call, c.routing));
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
    EXPECT_TRUE(AllFinite(b)) << "a poisoned output was not written";
    EXPECT_TRUE(a == b) << "not the bits of the layer that copies its rows into the return region";
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
