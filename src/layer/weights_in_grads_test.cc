// CheckWeightsInGrads (weights_in_grads.h): which overlaps of a backward's weights and weight gradients
// are allowed, for which configurations, and what a refusal names. Host-only (addresses, no memory).
#include "layer/weights_in_grads.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace rdep {
namespace {

LayerConfig Cutlass() {
  LayerConfig c = MakeLayerConfig({.tokens = 64, .hidden = 128, .ffn = 64, .experts = 8, .topk = 2, .ranks = 2});
  c.expert_compute = ExpertComputeKind::kCutlass;
  return c;
}

const void* At(uintptr_t a) { return reinterpret_cast<const void*>(a); }

// A rank whose weights (n1, n2 bytes) sit at w1, w2 and whose fp32 gradients (twice the bytes) at dw1, dw2.
ExpertByteRanges Rank(uintptr_t w1, uintptr_t w2, uintptr_t dw1, uintptr_t dw2, size_t n1 = 1000, size_t n2 = 500) {
  return {At(w1), n1, At(w2), n2, At(dw1), 2 * n1, At(dw2), 2 * n2};
}

TEST(WeightsInGrads, DisjointArraysPassInEveryConfiguration) {
  const std::vector<ExpertByteRanges> r{Rank(0x10000, 0x20000, 0x30000, 0x40000), Rank(0x50000, 0x60000, 0x70000, 0x80000)};
  LayerConfig lt = Cutlass();
  lt.expert_compute = ExpertComputeKind::kCublasLt;
  EXPECT_TRUE(CheckWeightsInGrads(Cutlass(), true, r, 0).ok());
  EXPECT_TRUE(CheckWeightsInGrads(lt, true, r, 0).ok());
  EXPECT_TRUE(CheckWeightsInGrads(Cutlass(), false, r, 0).ok());
}

TEST(WeightsInGrads, EachWeightInItsOwnGradientPassesWhereTheBackwardReadsItFirst) {
  // Each rank's bf16 weights in the first half of its fp32 gradients (what rdep.torch does).
  const std::vector<ExpertByteRanges> r{Rank(0x30000, 0x40000, 0x30000, 0x40000), Rank(0x70000, 0x80000, 0x70000, 0x80000)};
  EXPECT_TRUE(BackwardReadsWeightsBeforeGrads(Cutlass(), true));
  EXPECT_TRUE(CheckWeightsInGrads(Cutlass(), true, r, 0).ok());
  LayerConfig whole = Cutlass();
  whole.segment_tokens = 2 * 64;  // W*T: still one segment
  EXPECT_TRUE(CheckWeightsInGrads(whole, true, r, 0).ok());
  // Inside, not at the start, also passes.
  const std::vector<ExpertByteRanges> mid{Rank(0x30100, 0x40100, 0x30000, 0x40000)};
  EXPECT_TRUE(CheckWeightsInGrads(Cutlass(), true, mid, 0).ok());
}

TEST(WeightsInGrads, ConfigurationsWithoutThatOrderRefuseAnyOverlap) {
  const std::vector<ExpertByteRanges> r{Rank(0x30000, 0x40000, 0x30000, 0x40000)};
  std::vector<std::pair<std::string, LayerConfig>> bad;
  LayerConfig c = Cutlass();
  c.expert_compute = ExpertComputeKind::kCublasLt;
  bad.emplace_back("cublaslt", c);
  c = Cutlass();
  c.segment_tokens = 32;  // several segments: the gradients accumulate between weight reads
  bad.emplace_back("segments", c);
  c = Cutlass();
  c.balance.kind = BalanceKind::kUltraEp;
  c.balance.num_slots = 1;
  bad.emplace_back("balance", c);
  c = Cutlass();
  c.nodes = NodeConfig{2, 2};
  bad.emplace_back("nodes", c);
  for (const auto& [name, cfg] : bad) {
    SCOPED_TRACE(name);
    EXPECT_FALSE(BackwardReadsWeightsBeforeGrads(cfg, true));
    const Status s = CheckWeightsInGrads(cfg, true, r, 3);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("backward on rank 3: w1 overlaps its dw1"), std::string::npos) << s;
    EXPECT_NE(s.message().find("expert_compute cutlass, one segment"), std::string::npos) << s;
  }
  const Status host = CheckWeightsInGrads(Cutlass(), /*cuda=*/false, r, 0);
  EXPECT_EQ(host.code(), StatusCode::kInvalidArgument) << host;
}

TEST(WeightsInGrads, AWeightInTheOtherGradientIsRefused) {
  // w1 inside dw2: dW2 is written before dx reads w1.
  const std::vector<ExpertByteRanges> r{Rank(0x40000, 0x20000, 0x30000, 0x40000)};
  const Status s = CheckWeightsInGrads(Cutlass(), true, r, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("w1 overlaps its dw2 (w1 may lie only in dw1, w2 only in dw2)"), std::string::npos) << s;
}

TEST(WeightsInGrads, AWeightInAnotherRanksGradientIsRefused) {
  // Rank 1's w2 ends inside rank 0's dw1 (one byte of overlap is enough).
  const std::vector<ExpertByteRanges> r{Rank(0x10000, 0x20000, 0x30000, 0x40000),
                                        Rank(0x50000, 0x30000 - 499, 0x70000, 0x80000)};
  const Status s = CheckWeightsInGrads(Cutlass(), true, r, 4);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("backward on rank 5: w2 overlaps rank 4's dw1"), std::string::npos) << s;
  // Adjacent (no shared byte) passes.
  const std::vector<ExpertByteRanges> adjacent{Rank(0x10000, 0x20000, 0x30000, 0x40000),
                                               Rank(0x50000, 0x30000 - 500, 0x70000, 0x80000)};
  EXPECT_TRUE(CheckWeightsInGrads(Cutlass(), true, adjacent, 4).ok());
}

TEST(WeightsInGrads, AbsentArraysNeverOverlap) {
  const std::vector<ExpertByteRanges> r{ExpertByteRanges{}, Rank(0x30000, 0x40000, 0x30000, 0x40000, 0, 0)};
  EXPECT_TRUE(CheckWeightsInGrads(Cutlass(), false, r, 0).ok());
}

}  // namespace
}  // namespace rdep
