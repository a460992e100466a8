// The CUDA layer's backward with each rank's bf16 weights inside its own fp32 weight-gradient buffers
// (weights_in_grads.h; what rdep.torch does with fp32 master weights): W = 4 ranks on the GPUs present
// (sharing them when fewer), CUTLASS compute, the caller's weights and gradients bound per rank. The
// forward reads weights of their own; before the backward each rank's weights are copied into the first
// half of its gradient bytes and bound from there. dx, dgates, dW1 and dW2 must be the bits of the same
// backward with the weights apart (outputs poisoned with NaN first), with and without gate_in_expert and
// with the paged stash. The cuBLASLt layer and w1 inside dw2 are refused, naming the rank, before the
// collective (the context stays usable).
// Skips without a GPU or where the CUTLASS compute cannot be made (a failure under RDEP_REQUIRE_CUTLASS=1).
//   exercise: build-*/src/layer/layer_test --gtest_filter='*CudaWeightsInGrads*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <string>
#include <vector>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/device_count.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

constexpr int32_t kRanks = 4;

struct Case {
  std::string name;
  bool gate_in_expert = false;
  int64_t stash_rows = 0;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Outputs {
  std::vector<uint16_t> dx;
  std::vector<float> dg, dw1, dw2;
};

// One rank's weights (bf16) and gradients (fp32) on its GPU.
struct RankArrays {
  __nv_bfloat16 *w1 = nullptr, *w2 = nullptr;
  float *dw1 = nullptr, *dw2 = nullptr;
  size_t n1 = 0, n2 = 0;
  ~RankArrays() {
    for (void* p : {static_cast<void*>(w1), static_cast<void*>(w2), static_cast<void*>(dw1), static_cast<void*>(dw2)})
      if (p) cudaFree(p);
  }
};

Status UploadWeights(const MoEWeights& w, const OwnershipMap& own, int32_t r, RankArrays& a) {
  const auto first = static_cast<size_t>(own.num_local(r) > 0 ? own.global_expert(r, 0) : 0), n = static_cast<size_t>(own.num_local(r));  // contiguous
  a.n1 = n * w.w1_per_expert();
  a.n2 = n * w.w2_per_expert();
  const std::vector<float> w1(w.w1.begin() + static_cast<std::ptrdiff_t>(first * w.w1_per_expert()),
                              w.w1.begin() + static_cast<std::ptrdiff_t>(first * w.w1_per_expert() + a.n1));
  const std::vector<float> w2(w.w2.begin() + static_cast<std::ptrdiff_t>(first * w.w2_per_expert()),
                              w.w2.begin() + static_cast<std::ptrdiff_t>(first * w.w2_per_expert() + a.n2));
  RDEP_RETURN_IF_ERROR(UploadBf16(w1, &a.w1));
  RDEP_RETURN_IF_ERROR(UploadBf16(w2, &a.w2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&a.dw1, std::max<size_t>(a.n1, 1) * 4));
  return cuda::CudaStatus(cudaMalloc(&a.dw2, std::max<size_t>(a.n2, 1) * 4), "dw2", __FILE__, __LINE__);
}

// A forward and a backward per rank; with `inside`, the backward's weights are copies placed in the first
// half of the rank's gradient bytes.
StatusOr<std::vector<Outputs>> RunLayer(const Case& c, bool inside) {
  const LayerShape s{.tokens = 48, .hidden = 64, .ffn = 32, .experts = 16, .topk = 4, .ranks = kRanks};
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = 0.9});
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.gate_in_expert = c.gate_in_expert;
  cfg.stash_rows = c.stash_rows;
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, kRanks);
  const MoEWeights weights = RandomWeights(s, 11);
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(kRanks, {.barrier_timeout_s = 20,
                                                                              .devices = RoundRobinDevices(kRanks, std::min(kRanks, cuda::DeviceCount()))}));
  RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain, cfg, own));
  RoutingSpec spec = *RoutingSpec::Parse("zipf:1.5");
  spec.seed = 5;
  RDEP_ASSIGN_OR_RETURN(Routing rt, GenerateRouting(s, spec));
  const auto x = RandomActivations(s, rt, 12), dy = RandomActivations(s, rt, 13);
  std::vector<Outputs> out(kRanks);
  RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(rt[i], x[i], dy[i], s.hidden, b));
    RankArrays a;
    RDEP_RETURN_IF_ERROR(UploadWeights(weights, own, r, a));
    const auto nh = static_cast<size_t>(b.n * s.hidden), nk = static_cast<size_t>(b.n * s.topk);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dx, 0xFF, std::max<size_t>(nh, 1) * 2));  // NaN
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dg, 0xFF, std::max<size_t>(nk, 1) * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(a.dw1, 0xFF, std::max<size_t>(a.n1, 1) * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(a.dw2, 0xFF, std::max<size_t>(a.n2, 1) * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // before the layer's non-blocking stream
    RDEP_RETURN_IF_ERROR(layer->BindExpertWeights(r, ExternalWeights<__nv_bfloat16, float>{a.w1, a.w2, a.dw1, a.dw2}));
    RDEP_RETURN_IF_ERROR(layer->Forward(r, b.e, b.g, b.n, b.x, b.y));
    if (inside) {  // the copies the backward reads, in the gradients it then writes
      RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(a.dw1, a.w1, a.n1 * 2, cudaMemcpyDeviceToDevice));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(a.dw2, a.w2, a.n2 * 2, cudaMemcpyDeviceToDevice));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(a.w1, 0xFF, std::max<size_t>(a.n1, 1) * 2));  // the originals unreadable
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(a.w2, 0xFF, std::max<size_t>(a.n2, 1) * 2));
      RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      const ExternalWeights<__nv_bfloat16, float> staged{reinterpret_cast<const __nv_bfloat16*>(a.dw1),
                                                         reinterpret_cast<const __nv_bfloat16*>(a.dw2), a.dw1, a.dw2};
      RDEP_RETURN_IF_ERROR(layer->BindExpertWeights(r, staged));
    }
    RDEP_RETURN_IF_ERROR(layer->Backward(r, b.dy, b.dx, b.dg));
    RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
    Outputs& o = out[i];
    RDEP_ASSIGN_OR_RETURN(o.dx, Download(reinterpret_cast<const uint16_t*>(b.dx), nh));
    RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, nk));
    RDEP_ASSIGN_OR_RETURN(o.dw1, Download(a.dw1, a.n1));
    RDEP_ASSIGN_OR_RETURN(o.dw2, Download(a.dw2, a.n2));
    return Status::Ok();
  }));
  return out;
}

template <typename T>
bool Same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <typename T>
bool AllFinite(const std::vector<T>& v) {
  for (const T& x : v) {
    const float f = std::is_same_v<T, uint16_t> ? Bf16BitsToFloat(static_cast<uint16_t>(x)) : static_cast<float>(x);
    if (!std::isfinite(f)) return false;
  }
  return true;
}

class CudaWeightsInGrads : public ::testing::TestWithParam<Case> {};

TEST_P(CudaWeightsInGrads, TheBackwardGivesTheBitsOfWeightsApart) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  auto apart = RunLayer(GetParam(), false);
  ASSERT_TRUE(apart.ok()) << apart.status();
  auto inside = RunLayer(GetParam(), true);
  ASSERT_TRUE(inside.ok()) << inside.status();
  for (size_t r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Outputs &a = (*inside)[r], &b = (*apart)[r];
    EXPECT_TRUE(AllFinite(b.dx) && AllFinite(b.dg) && AllFinite(b.dw1) && AllFinite(b.dw2)) << "a poisoned value was not written";
    EXPECT_TRUE(Same(a.dx, b.dx)) << "dx";
    EXPECT_TRUE(Same(a.dg, b.dg)) << "dgates";
    EXPECT_TRUE(Same(a.dw1, b.dw1)) << "dW1";
    EXPECT_TRUE(Same(a.dw2, b.dw2)) << "dW2";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaWeightsInGrads,
                         ::testing::Values(Case{"default"}, Case{"gate_in_expert", true}, Case{"gate_stash", true, 4096}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Refusals come before the collective: one rank, its context still usable afterwards.
TEST(CudaWeightsInGrads_Errors, RefusedWhereTheOrderDoesNotHold) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::string why;
  const bool cutlass = CutlassLayerAvailable(&why);
  SmallProblem p(1, "uniform", 3, 4);
  for (const bool use_cutlass : {false, true}) {
    if (use_cutlass && !cutlass) continue;
    SCOPED_TRACE(use_cutlass ? "cutlass" : "cublaslt");
    LayerConfig cfg = MakeLayerConfig(p.shape);
    cfg.expert_compute = use_cutlass ? ExpertComputeKind::kCutlass : ExpertComputeKind::kCublasLt;
    auto domain = CudaDomain::CreateSingleProcess(1, {.barrier_timeout_s = 5, .devices = {0}});
    ASSERT_TRUE(domain.ok()) << domain.status();
    auto layer = CudaMoELayer::Create(**domain, cfg, p.own);
    ASSERT_TRUE(layer.ok()) << layer.status();
    Batch b;
    ASSERT_TRUE(Upload(p.routing[0], p.x[0], p.dy[0], p.shape.hidden, b).ok());
    RankArrays a;
    ASSERT_TRUE(UploadWeights(p.w, p.own, 0, a).ok());
    ASSERT_TRUE((*layer)->BindExpertWeights(0, {a.w1, a.w2, a.dw1, a.dw2}).ok());
    ASSERT_TRUE((*layer)->Forward(0, b.e, b.g, b.n, b.x, b.y).ok());
    // cuBLASLt: any overlap; CUTLASS: w1 inside dw2 (dW2 is written before dx reads w1).
    const auto* in_dw1 = reinterpret_cast<const __nv_bfloat16*>(a.dw1);
    const auto* in_dw2 = reinterpret_cast<const __nv_bfloat16*>(a.dw2);
    const ExternalWeights<__nv_bfloat16, float> bad =
        use_cutlass ? ExternalWeights<__nv_bfloat16, float>{in_dw2, a.w2, a.dw1, a.dw2}
                    : ExternalWeights<__nv_bfloat16, float>{in_dw1, in_dw2, a.dw1, a.dw2};
    ASSERT_TRUE((*layer)->BindExpertWeights(0, bad).ok());
    const Status s = (*layer)->Backward(0, b.dy, b.dx, b.dg);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(use_cutlass ? "backward on rank 0: w1 overlaps its dw2" : "backward on rank 0: w1 overlaps its dw1"),
              std::string::npos) << s;
    // The context was kept: the backward with the weights apart runs.
    ASSERT_TRUE((*layer)->BindExpertWeights(0, {a.w1, a.w2, a.dw1, a.dw2}).ok());
    EXPECT_TRUE((*layer)->Backward(0, b.dy, b.dx, b.dg).ok());
    EXPECT_TRUE((*domain)->Synchronize(0).ok());
  }
}

}  // namespace
}  // namespace rdep
#endif  // RDEP_HAVE_CUDA
