// The host expert MLP (rdep/core/expert_mlp.h) in both GateUp layouts: weights moved from kSplit to
// kInterleaved8 give the same outputs and weight gradients (moved back) bit for bit in double (the same
// products summed in the same order), the same input gradient to 1e-12 (its sum over the 2F columns runs
// in the layout's order), and the column maps are permutations of [0, 2F).
//   build/src/core/core_test --gtest_filter='ExpertMlpHost*'
#include "rdep/core/expert_mlp.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "rdep/core/random.h"
#include "rdep/core/reference.h"

namespace rdep::mlp {
namespace {

std::vector<double> Random(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<double> v(n);
  for (auto& x : v) x = rng.uniform() * 2 - 1;
  return v;
}

// Rows of 2F columns moved between kSplit and kInterleaved8 (MoveGateUp; its column maps are pinned below).
std::vector<double> Move(const std::vector<double>& v, int64_t F, bool to_interleaved) {
  std::vector<double> out(v.size());
  const GateUp from = to_interleaved ? GateUp::kSplit : GateUp::kInterleaved8;
  const GateUp to = to_interleaved ? GateUp::kInterleaved8 : GateUp::kSplit;
  MoveGateUp(v.data(), out.data(), v.size() / static_cast<size_t>(2 * F), F, from, to);
  return out;
}

TEST(ExpertMlpHost, ColumnMapsArePermutations) {
  for (int64_t F : {8, 24, 1408}) {
    for (GateUp l : {GateUp::kSplit, GateUp::kInterleaved8}) {
      std::vector<int> seen(static_cast<size_t>(2 * F), 0);
      for (int64_t j = 0; j < F; ++j) {
        ++seen[static_cast<size_t>(GateCol(j, F, l))];
        ++seen[static_cast<size_t>(UpCol(j, F, l))];
      }
      for (int64_t c = 0; c < 2 * F; ++c) ASSERT_EQ(seen[static_cast<size_t>(c)], 1) << GateUpName(l) << " F=" << F << " column " << c;
    }
  }
  EXPECT_EQ(GateCol(9, 24, GateUp::kInterleaved8), 17);  // block 1 of gate features starts at column 16
  EXPECT_EQ(UpCol(9, 24, GateUp::kInterleaved8), 25);
  EXPECT_EQ(UpCol(9, 24, GateUp::kSplit), 33);
}

TEST(ExpertMlpHost, InterleavedWeightsGiveTheSplitResults) {
  const int64_t H = 16, F = 24;
  const std::vector<double> x = Random(H, 1), w1 = Random(static_cast<size_t>(H * 2 * F), 2), w2 = Random(static_cast<size_t>(F * H), 3),
                            dout = Random(H, 4);
  const std::vector<double> w1i = Move(w1, F, true);
  std::vector<double> h(2 * F), hi(2 * F), z(F), zi(F), y(H), yi(H);
  Forward<double>(x.data(), w1.data(), w2.data(), H, F, h.data(), z.data(), y.data());
  Forward<double>(x.data(), w1i.data(), w2.data(), H, F, hi.data(), zi.data(), yi.data(), GateUp::kInterleaved8);
  EXPECT_EQ(yi, y);
  EXPECT_EQ(zi, z);
  EXPECT_EQ(Move(hi, F, false), h);
  std::vector<double> dw1(w1.size(), 0.0), dw1i(w1.size(), 0.0), dw2(w2.size(), 0.0), dw2i(w2.size(), 0.0), dx(H), dxi(H), s(3 * F),
      si(3 * F);
  Backward<double>(x.data(), w1.data(), w2.data(), H, F, h.data(), dout.data(), dw1.data(), dw2.data(), dx.data(), s.data());
  Backward<double>(x.data(), w1i.data(), w2.data(), H, F, hi.data(), dout.data(), dw1i.data(), dw2i.data(), dxi.data(), si.data(),
                   GateUp::kInterleaved8);
  for (int64_t i = 0; i < H; ++i) EXPECT_NEAR(dxi[static_cast<size_t>(i)], dx[static_cast<size_t>(i)], 1e-12) << "dx " << i;
  EXPECT_EQ(dw2i, dw2);
  EXPECT_EQ(Move(dw1i, F, false), dw1);
}

TEST(ExpertMlpHost, WeightsMoveBetweenLayoutsAndRefuseAnFfnNotAMultipleOf8) {
  MoEWeights w;
  w.experts = 2, w.hidden = 3, w.ffn = 16;
  w.w1.resize(2 * 3 * 32);
  for (size_t i = 0; i < w.w1.size(); ++i) w.w1[i] = static_cast<float>(i);
  auto inter = w.InLayout(GateUp::kInterleaved8);
  ASSERT_TRUE(inter.ok()) << inter.status();
  EXPECT_EQ(inter->gate_up, GateUp::kInterleaved8);
  EXPECT_EQ(inter->w1[8], w.w1[16]);  // row 0: up feature 0 sits 8 columns after gate feature 0
  EXPECT_EQ(inter->w1[32 + 16], w.w1[32 + 8]);  // row 1: gate feature 8 starts the second block of 16
  auto back = inter->InLayout(GateUp::kSplit);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->w1, w.w1);
  w.ffn = 12;  // gate 11 would sit at column 19 and up 11 at 27, past a row of 24
  w.w1.resize(2 * 3 * 24);
  auto bad = w.InLayout(GateUp::kInterleaved8);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("multiple of 8"), std::string::npos) << bad.status();
  w.w2.resize(2 * 12 * 3);
  const LayerShape shape{.tokens = 1, .hidden = 3, .ffn = 12, .experts = 2, .topk = 1, .ranks = 1};
  EXPECT_TRUE(w.Validate(shape).ok());  // split: any D_ff
  w.gate_up = GateUp::kInterleaved8;
  EXPECT_FALSE(w.Validate(shape).ok());
}

}  // namespace
}  // namespace rdep::mlp
