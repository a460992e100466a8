// The validation matrix on the CUDA backend at W = 1, 2, 4 and 8: the paper's shapes and the odd
// cases. Ranks go round-robin over the GPUs present, so on a machine with fewer GPUs than W they
// share GPUs (stream-join barriers) and still must agree bitwise with the host backend. Each case
// skips (saying why) only when the build has no CUDA or the machine has no GPU.
#include <gtest/gtest.h>

#include "rdep/testing/cuda_validation.h"

namespace rdep {
namespace {

struct Case {
  const char* name;
  LayerShape shape;
  const char* routing;
  double capacity;
  int64_t segment;
  int64_t empty_rank;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class CudaValidation : public ::testing::TestWithParam<Case> {};

TEST_P(CudaValidation, AllChecksPass) {
  const Case& c = GetParam();
  auto backend = MakeCudaBackend(c.shape.ranks, 5.0);
  if (!backend.ok()) GTEST_SKIP() << backend.status().message();
  ValidationOptions o;
  o.layer.shape = c.shape;
  o.layer.capacity.capacity_factor = c.capacity;
  o.layer.segment_tokens = c.segment;
  o.routing = *RoutingSpec::Parse(c.routing);
  o.routing.seed = 21;
  o.routing.empty_rank = c.empty_rank;
  o.seed = 9;
  auto rep = RunValidation(o, **backend);
  ASSERT_TRUE(rep.ok()) << rep.status();
  for (const auto& check : rep->checks) EXPECT_TRUE(check.passed) << c.name << ": " << check.name << ": " << check.detail;
  EXPECT_EQ(rep->checks.size(), 7u);  // smoke, dispatch, host agreement, fwd, grad, finite, segments
}

LayerShape S(int64_t W, int64_t T, int64_t H, int64_t F, int64_t E, int64_t K) {
  return LayerShape{.tokens = T, .hidden = H, .ffn = F, .experts = E, .topk = K, .ranks = W};
}

// rdep check --nodes on the CUDA backend, ranks sharing one GPU (device copies between them): every
// check passes, the two-phase traffic check included (each rank's rows and bytes per phase equal to
// rdep model's prediction for the routing: bf16 records, BundleLayout's padded strides).
TEST(CudaValidationNodes, W8_N4_M2_zipf_drops_TrafficEqualsModel) {
  auto backend = MakeCudaBackend(8, 10.0, /*num_gpus=*/1);
  if (!backend.ok()) GTEST_SKIP() << backend.status().message();
  ValidationOptions o;
  o.layer.shape = S(8, 32, 64, 64, 32, 4);
  o.layer.capacity.capacity_factor = 0.9;
  o.layer.nodes = NodeConfig{4, 2};
  o.routing = *RoutingSpec::Parse("zipf:1.2");
  o.routing.seed = 21;
  auto rep = RunValidation(o, **backend);
  ASSERT_TRUE(rep.ok()) << rep.status();
  for (const auto& check : rep->checks) EXPECT_TRUE(check.passed) << check.name << ": " << check.detail;
  EXPECT_EQ(rep->checks.size(), 9u);  // the 7 of the plain matrix, two-phase traffic = rdep model, two-phase vs one domain
  ASSERT_EQ(rep->traffic_model.size(), 8u);
  for (size_t r = 0; r < 8; ++r) EXPECT_EQ(rep->traffic[r].Counts(), rep->traffic_model[r]) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Cuda_bf16, CudaValidation,
    ::testing::Values(
        Case{"W1_T64_H64_F128_E8_K2", S(1, 64, 64, 128, 8, 2), "uniform", 0, 0, -1},
        Case{"W2_T128_H128_F64_E16_K4", S(2, 128, 128, 64, 16, 4), "zipf:1", 0, 0, -1},
        // The paper's invariants shape (T=256, H=256, E_loc=8), K in {2,4}.
        Case{"W4_T256_H256_Eloc8_K2", S(4, 256, 256, 128, 32, 2), "uniform", 0, 0, -1},
        Case{"W4_T256_H256_Eloc8_K4", S(4, 256, 256, 128, 32, 4), "uniform", 0, 300, -1},
        // The paper's gradient-parity shape (T=16, H=64, D_ff=128, E_loc=8).
        Case{"W4_T16_H64_F128_Eloc8_K2", S(4, 16, 64, 128, 32, 2), "uniform", 0, 0, -1},
        Case{"W4_T16_H64_F128_Eloc8_K4", S(4, 16, 64, 128, 32, 4), "uniform", 0, 0, -1},
        // Odd shapes.
        Case{"W4_E10_not_divisible", S(4, 64, 64, 64, 10, 3), "uniform", 0, 0, -1},
        Case{"W4_K1", S(4, 64, 64, 64, 16, 1), "uniform", 0, 0, -1},
        Case{"W2_K_equals_E", S(2, 32, 64, 64, 4, 4), "uniform", 0, 0, -1},
        Case{"W4_zero_tokens_on_rank1", S(4, 64, 64, 64, 16, 2), "uniform", 0, 0, 1},
        Case{"W4_all_to_one_expert", S(4, 64, 64, 64, 16, 2), "one-expert", 0, 0, -1},
        // K = 36: every token's experts 0-35 on owner 0, so a token's slots run past a warp's 32 lanes in the
        // scatter's sideband (host agreement catches a wrong expert in any slot).
        Case{"W2_K36_slots_past_a_warp", S(2, 32, 64, 64, 80, 36), "one-expert", 0, 0, -1},
        Case{"W4_empty_experts", S(4, 64, 64, 64, 16, 3), "sparse", 0, 0, -1},
        Case{"W4_capacity_drops_zipf", S(4, 128, 64, 64, 16, 4), "zipf:1.5", 0.8, 0, -1},
        Case{"W4_small_segments", S(4, 64, 64, 64, 16, 2), "zipf:1.2", 0, 37, -1},
        // W = 8 (ranks share GPUs on smaller machines): Moonlight's E = 64, K = 6 at small T and H,
        // E not divisible by W, an empty rank, capacity drops, small segments.
        Case{"W8_T32_H128_F64_E64_K6_moonlight_small", S(8, 32, 128, 64, 64, 6), "uniform", 0, 0, -1},
        Case{"W8_E12_not_divisible", S(8, 32, 64, 64, 12, 3), "zipf:1", 0, 0, -1},
        Case{"W8_zero_tokens_on_rank5", S(8, 32, 64, 64, 16, 2), "uniform", 0, 0, 5},
        Case{"W8_capacity_drops_zipf", S(8, 64, 64, 64, 32, 4), "zipf:1.5", 0.7, 0, -1},
        Case{"W8_small_segments", S(8, 48, 64, 64, 16, 2), "zipf:1.2", 0, 13, -1}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// The matrix with balancing (`rdep check --backend cuda --balance ...`): the dispatch check places every
// row on the instance of the plan solved from the reference's accepted set, host agreement compares
// the routing metadata and grouped placement with the balanced host layer bit for bit, and balancing
// exactness compares with the same CUDA layer without balancing within the bf16 bound.
struct BalanceCase {
  const char* name;
  LayerShape shape;
  const char* routing;
  double capacity;
  int64_t segment;
  BalanceKind kind;
  int32_t slots;
};

void PrintTo(const BalanceCase& c, std::ostream* os) { *os << c.name; }

class CudaBalanceValidation : public ::testing::TestWithParam<BalanceCase> {};

TEST_P(CudaBalanceValidation, AllChecksPass) {
  const BalanceCase& c = GetParam();
  auto backend = MakeCudaBackend(c.shape.ranks, 5.0);
  if (!backend.ok()) GTEST_SKIP() << backend.status().message();
  ValidationOptions o;
  o.layer.shape = c.shape;
  o.layer.capacity.capacity_factor = c.capacity;
  o.layer.segment_tokens = c.segment;
  o.layer.balance = BalanceConfig{.kind = c.kind, .num_slots = c.slots};
  o.routing = *RoutingSpec::Parse(c.routing);
  o.routing.seed = 21;
  o.seed = 9;
  auto rep = RunValidation(o, **backend);
  ASSERT_TRUE(rep.ok()) << rep.status();
  for (const auto& check : rep->checks) EXPECT_TRUE(check.passed) << c.name << ": " << check.name << ": " << check.detail;
  EXPECT_EQ(rep->checks.size(), 8u);  // the 7 of the plain matrix and balancing exactness
  EXPECT_TRUE(rep->balanced);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda_bf16, CudaBalanceValidation,
    ::testing::Values(
        BalanceCase{"W4_zipf2_ultraep", S(4, 64, 64, 64, 16, 4), "zipf:2", 0, 0, BalanceKind::kUltraEp, 2},
        BalanceCase{"W4_zipf1_eplb", S(4, 64, 64, 64, 16, 4), "zipf:1", 0, 0, BalanceKind::kEplb, 2},
        BalanceCase{"W4_one_expert_eplb_exact", S(4, 64, 64, 64, 16, 2), "one-expert", 0, 0, BalanceKind::kEplbExact, 2},
        BalanceCase{"W4_zipf2_drops_small_segments_ultraep", S(4, 64, 64, 64, 16, 4), "zipf:2", 0.8, 37, BalanceKind::kUltraEp, 2},
        BalanceCase{"W4_E10_not_divisible_ultraep", S(4, 64, 64, 64, 10, 3), "zipf:1.5", 0, 0, BalanceKind::kUltraEp, 1},
        BalanceCase{"W8_zipf2_ultraep", S(8, 32, 64, 64, 32, 4), "zipf:2", 0, 0, BalanceKind::kUltraEp, 2}),
    [](const ::testing::TestParamInfo<BalanceCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace rdep

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>

#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

// ApplySgd updates exactly w <- bf16(w - lr * dw) on every rank's experts.
TEST(CudaMoELayer_Sgd, W2_UpdatesWeightsFromLastBackward) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  LayerConfig cfg;
  cfg.shape = {.tokens = 32, .hidden = 64, .ffn = 32, .experts = 4, .topk = 2, .ranks = 2};
  auto domain = CudaDomain::CreateSingleProcess(2, {.barrier_timeout_s = 10, .devices = RoundRobinDevices(2, std::min(2, cuda::DeviceCount()))});
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto own = *OwnershipMap::Contiguous(4, 2);
  auto routing = *GenerateRouting(cfg.shape, RoutingSpec{});
  auto layer = CudaMoELayer::Create(**domain, cfg, own, RandomWeights(cfg.shape, 3));
  ASSERT_TRUE(layer.ok()) << layer.status();
  const float lr = 0.25f;
  std::vector<std::vector<float>> before1(2), before2(2), g1(2), g2(2), after1(2), after2(2);
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    const size_t nk = 32 * 2, nh = 32 * 64;
    int32_t* e;
    float *g, *dg;
    __nv_bfloat16 *x, *y, *dy, *dx;
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&e, nk * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&g, nk * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&dg, nk * 4));
    for (auto** p : {&x, &y, &dy, &dx}) RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(p, nh * 2));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(e, routing[i].experts.data(), nk * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(g, routing[i].gates.data(), nk * 4, cudaMemcpyHostToDevice));
    std::vector<uint16_t> ones(nh, FloatToBf16Bits(0.5f));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(x, ones.data(), nh * 2, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(dy, ones.data(), nh * 2, cudaMemcpyHostToDevice));
    RDEP_RETURN_IF_ERROR((*layer)->Forward(r, e, g, 32, x, y));
    RDEP_RETURN_IF_ERROR((*layer)->Backward(r, dy, dx, dg));
    RDEP_ASSIGN_OR_RETURN(before1[i], (*layer)->CopyWeights(r, false));
    RDEP_ASSIGN_OR_RETURN(before2[i], (*layer)->CopyWeights(r, true));
    g1[i].resize(before1[i].size());
    g2[i].resize(before2[i].size());
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(g1[i].data(), (*layer)->dw1(r), g1[i].size() * 4, cudaMemcpyDeviceToHost));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(g2[i].data(), (*layer)->dw2(r), g2[i].size() * 4, cudaMemcpyDeviceToHost));
    RDEP_RETURN_IF_ERROR((*layer)->ApplySgd(r, lr));
    RDEP_ASSIGN_OR_RETURN(after1[i], (*layer)->CopyWeights(r, false));
    RDEP_ASSIGN_OR_RETURN(after2[i], (*layer)->CopyWeights(r, true));
    for (void* p : {static_cast<void*>(e), static_cast<void*>(g), static_cast<void*>(dg), static_cast<void*>(x),
                    static_cast<void*>(y), static_cast<void*>(dy), static_cast<void*>(dx)})
      cudaFree(p);
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
  int64_t changed = 0;
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_FALSE(before1[r].empty());
    for (size_t k = 0; k < before1[r].size(); ++k) {
      EXPECT_EQ(after1[r][k], RoundToBf16(before1[r][k] - lr * g1[r][k])) << "w1 rank " << r << " [" << k << "]";
      changed += after1[r][k] != before1[r][k];
    }
    for (size_t k = 0; k < before2[r].size(); ++k)
      EXPECT_EQ(after2[r][k], RoundToBf16(before2[r][k] - lr * g2[r][k])) << "w2 rank " << r << " [" << k << "]";
  }
  EXPECT_GT(changed, 0);
}

}  // namespace
}  // namespace rdep
#endif
