// LayerConfig::gate_in_expert on the CUDA layer (the gate multiplied before W2, seeds 002 section 4), W = 4
// ranks on the GPUs present (sharing them when fewer), CUTLASS compute: the owner's compute weights each row
// before W2, the front-end sums the returned rows with weights 1, and in backward the owners take each row's
// dgate and store it into the front-ends' dots. Against the same layer without it, on the same routing,
// weights and inputs, two forward and backward calls per layer (the second finds the first's values in the
// shared rows and the dots region): y, dx, dgates and the weight gradients within the CUDA checks' bf16
// bound, ||a - b|| / ||b|| <= 1e-2 per rank (the rows are rounded to bf16 at other points). Outputs are
// poisoned with NaN first, so a value nobody wrote fails. The layer must refuse CopyExpertOutputs (nothing
// kept at the front-end). With overlapped segments the results are the sequential schedule's bits. Cases:
// uniform, Zipf 2 with capacity drops, one expert for every token, several segments, the paged stash, and
// owner_reduce (both layers reduce at the owner; with the gate the owner keeps no expert outputs).
// Skips without a GPU or where the CUTLASS compute cannot be made (a failure under RDEP_REQUIRE_CUTLASS=1).
//   exercise: build-*/src/layer/layer_test --gtest_filter='*CudaGateInExpert*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/device_count.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

constexpr int32_t kRanks = 4;
constexpr double kBound = 1e-2;  // the CUDA checks' bf16 bound (ValidationOptions::rel_l2)

struct GateCase {
  std::string name;
  std::string routing = "uniform";
  double capacity_factor = 0;  // 0 = dropless
  int64_t segment = 0;         // 0 = W*T (one segment)
  int64_t stash_rows = 0;
  bool owner_reduce = false;  // both layers: the owner sums a token's rows (with the gate: rows weighted already)
};

void PrintTo(const GateCase& c, std::ostream* os) { *os << c.name; }

struct Outputs {
  std::vector<float> y, dx, dg, dw1, dw2;
};

StatusOr<std::vector<float>> AsFloats(const __nv_bfloat16* p, size_t n) {
  RDEP_ASSIGN_OR_RETURN(std::vector<uint16_t> bits, Download(reinterpret_cast<const uint16_t*>(p), n));
  std::vector<float> v(bits.size());
  std::transform(bits.begin(), bits.end(), v.begin(), Bf16BitsToFloat);
  return v;
}

// Two forward+backward calls (routing seeds 1 and 2): [call][rank].
StatusOr<std::vector<std::vector<Outputs>>> RunCalls(const GateCase& c, bool gate_in_expert, bool overlap) {
  const LayerShape s{.tokens = 48, .hidden = 64, .ffn = 32, .experts = 16, .topk = 4, .ranks = kRanks};
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.gate_in_expert = gate_in_expert;
  cfg.overlap_segments = overlap;
  cfg.stash_rows = c.stash_rows;
  cfg.owner_reduce = c.owner_reduce;
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, kRanks);
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(kRanks, {.barrier_timeout_s = 20,
                                                                              .devices = RoundRobinDevices(kRanks, std::min(kRanks, cuda::DeviceCount()))}));
  RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain, cfg, own, RandomWeights(s, 7)));
  std::vector<std::vector<Outputs>> out(2, std::vector<Outputs>(kRanks));
  for (uint64_t call = 1; call <= 2; ++call) {
    RoutingSpec spec = *RoutingSpec::Parse(c.routing);
    spec.seed = call;
    RDEP_ASSIGN_OR_RETURN(Routing rt, GenerateRouting(s, spec));
    const auto x = RandomActivations(s, rt, 8 + call), dy = RandomActivations(s, rt, 20 + call);
    RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      Batch b;
      RDEP_RETURN_IF_ERROR(Upload(rt[i], x[i], dy[i], s.hidden, b));
      const auto nh = static_cast<size_t>(b.n * s.hidden), nk = static_cast<size_t>(b.n * s.topk);
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.y, 0xFF, std::max<size_t>(nh, 1) * 2));  // NaN
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dx, 0xFF, std::max<size_t>(nh, 1) * 2));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dg, 0xFF, std::max<size_t>(nk, 1) * 4));
      RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // before the layer's non-blocking stream
      RDEP_RETURN_IF_ERROR(layer->Forward(r, b.e, b.g, b.n, b.x, b.y));
      RDEP_RETURN_IF_ERROR(layer->Backward(r, b.dy, b.dx, b.dg));
      RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
      if (gate_in_expert && layer->CopyExpertOutputs(r).ok())
        return InternalError("gate_in_expert is on but the front-end kept expert outputs (rank " + std::to_string(r) + ")");
      Outputs& o = out[call - 1][i];
      const auto L = static_cast<size_t>(own.num_local(r));
      RDEP_ASSIGN_OR_RETURN(o.y, AsFloats(b.y, nh));
      RDEP_ASSIGN_OR_RETURN(o.dx, AsFloats(b.dx, nh));
      RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, nk));
      RDEP_ASSIGN_OR_RETURN(o.dw1, Download(layer->dw1(r), L * static_cast<size_t>(2 * s.hidden * s.ffn)));
      RDEP_ASSIGN_OR_RETURN(o.dw2, Download(layer->dw2(r), L * static_cast<size_t>(s.ffn * s.hidden)));
      return Status::Ok();
    }));
  }
  return out;
}

// ||got - want|| / ||want||: infinity when a value is NaN or the sizes differ; 0 when both are zero.
double RelativeL2(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(want[i])) return INFINITY;
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  if (diff == 0) return 0;
  return norm == 0 ? INFINITY : std::sqrt(diff / norm);
}

class CudaGateInExpert : public ::testing::TestWithParam<GateCase> {};

TEST_P(CudaGateInExpert, MatchesTheLayerThatWeightsAtTheCombine) {
  const GateCase& c = GetParam();
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  auto base = RunCalls(c, false, false);
  ASSERT_TRUE(base.ok()) << base.status();
  auto gated = RunCalls(c, true, false);
  ASSERT_TRUE(gated.ok()) << gated.status();
  for (size_t call = 0; call < 2; ++call)
    for (size_t r = 0; r < kRanks; ++r) {
      SCOPED_TRACE("call " + std::to_string(call + 1) + ", rank " + std::to_string(r));
      const Outputs &a = (*gated)[call][r], &b = (*base)[call][r];
      EXPECT_LE(RelativeL2(a.y, b.y), kBound) << "y";
      EXPECT_LE(RelativeL2(a.dx, b.dx), kBound) << "dx";
      EXPECT_LE(RelativeL2(a.dg, b.dg), kBound) << "dgates";
      EXPECT_LE(RelativeL2(a.dw1, b.dw1), kBound) << "dW1";
      EXPECT_LE(RelativeL2(a.dw2, b.dw2), kBound) << "dW2";
    }
}

// With more than one segment: the overlapped pipeline gives the sequential schedule's bits.
TEST_P(CudaGateInExpert, OverlappedSegmentsGiveTheSameBits) {
  const GateCase& c = GetParam();
  if (c.segment == 0 || c.owner_reduce) GTEST_SKIP() << "one segment, or owner_reduce (the pipeline needs the per-slot return)";
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  auto seq = RunCalls(c, true, false);
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto ov = RunCalls(c, true, true);
  ASSERT_TRUE(ov.ok()) << ov.status();
  const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  };
  for (size_t call = 0; call < 2; ++call)
    for (size_t r = 0; r < kRanks; ++r) {
      SCOPED_TRACE("call " + std::to_string(call + 1) + ", rank " + std::to_string(r));
      const Outputs &a = (*ov)[call][r], &b = (*seq)[call][r];
      EXPECT_TRUE(same(a.y, b.y)) << "y";
      EXPECT_TRUE(same(a.dx, b.dx)) << "dx";
      EXPECT_TRUE(same(a.dg, b.dg)) << "dgates";
      EXPECT_TRUE(same(a.dw1, b.dw1)) << "dW1";
      EXPECT_TRUE(same(a.dw2, b.dw2)) << "dW2";
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGateInExpert,
                         ::testing::Values(GateCase{"uniform"}, GateCase{"zipf2_drops", "zipf:2", 0.9},
                                           GateCase{"one_expert", "one-expert"}, GateCase{"segments", "zipf:1", 0, 40},
                                           GateCase{"segments_drops", "zipf:1.5", 0.9, 24}, GateCase{"stash", "zipf:1", 0, 0, 4096},
                                           GateCase{"owner_reduce", "zipf:1", 0.9, 0, 0, true},
                                           GateCase{"owner_reduce_segments_stash", "zipf:2", 0, 40, 4096, true}),
                         [](const ::testing::TestParamInfo<GateCase>& i) { return i.param.name; });

TEST(CudaGateInExpert_Errors, TheSentinelExpertIsRefusedAtForward) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  SmallProblem p(1, "uniform", 3, 4);
  LayerConfig cfg = MakeLayerConfig(p.shape);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.gate_in_expert = true;
  auto domain = CudaDomain::CreateSingleProcess(1, {.barrier_timeout_s = 5, .devices = {0}});
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, cfg, p.own, p.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  (*layer)->set_expert_kind(ExpertKind::kSentinel);
  Batch b;
  ASSERT_TRUE(Upload(p.routing[0], p.x[0], p.dy[0], p.shape.hidden, b).ok());
  const Status s = (*layer)->Forward(0, b.e, b.g, b.n, b.x, b.y);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("gate_in_expert"), std::string::npos) << s;
}

}  // namespace
}  // namespace rdep
#endif  // RDEP_HAVE_CUDA
