// The validation matrix on the CUDA backend at 1, 2 and 4 GPUs: the paper's shapes and the odd
// cases. Each case skips (saying why) when the build has no CUDA or the machine has too few GPUs.
#include <gtest/gtest.h>

#include "rdep/layer/cuda_validation.h"

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
        Case{"W4_empty_experts", S(4, 64, 64, 64, 16, 3), "sparse", 0, 0, -1},
        Case{"W4_capacity_drops_zipf", S(4, 128, 64, 64, 16, 4), "zipf:1.5", 0.8, 0, -1},
        Case{"W4_small_segments", S(4, 64, 64, 64, 16, 2), "zipf:1.2", 0, 37, -1}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace rdep
