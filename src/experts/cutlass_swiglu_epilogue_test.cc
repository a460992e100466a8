// GEMM1's SwiGLU epilogue (kNN_SwiGLU, swiglu_epilogue_sm90.cuh): the CUTLASS compute with W1 as
// GateUp::kInterleaved8 and tiles.swiglu_epilogue writes z in GEMM1's epilogue. Checked against
//   - the same compute with the separate SwiGLU kernel (tiles.swiglu_epilogue false, the default): h and y the same
//     bits (the epilogue rounds as the kernel does), with and without per-row gates;
//   - the split layout (W1 gate | up) on the same weights moved: h, y, dx, dW1 (moved back), dW2 and dgate
//     within ||a-b||/||b|| <= 1e-2 per expert (2e-2 for dgate);
//   - the cuBLASLt compute given the interleaved layout (ungated): y within 1e-2;
// over the three tiles built with the epilogue, row counts that are not tile multiples, empty experts, one
// expert holding every row, and 2F not a multiple of the tile's N (F = 24, 200). Outputs are poisoned
// first; rows past M stay untouched. Skips as the other CUTLASS tests do (experts_test_util.h).
//   build/src/experts/experts_test --gtest_filter='*CutlassSwigluEpilogue*'
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "experts/experts_test_util.h"
#include "rdep/core/random.h"
#include "rdep/cuda/bf16.h"
#include "rdep/experts/expert_compute.h"

namespace rdep::kernels {
namespace {

using test_util::AsDouble;
using test_util::Dev;
using test_util::ExpectPerExpert;
using test_util::MakeOrSkipReason;
using test_util::RandomBf16;
using test_util::ToInterleaved8;
using test_util::ToSplit;

constexpr int64_t kPad = 5;
constexpr int64_t kStride = 3;  // gate records: [?, gate, ?]

struct SwiCase {
  std::string name;
  int64_t H, F;
  std::vector<int64_t> counts;
  std::string tile;  // GEMM1's ("" = its default)
  bool gated = false;
};

struct Outputs {
  std::vector<uint16_t> h, y, dx;
  std::vector<float> dw1, dw2, dgate;
};

// One forward and backward (fp32 gradients, overwritten) on poisoned outputs.
void RunOnce(ExpertCompute& ec, const ExpertRows& rows, const Dev<uint16_t>& x, const Dev<uint16_t>& w1, const Dev<uint16_t>& w2,
             const std::vector<uint16_t>& dy, Dev<float>& dgate, Outputs* out) {
  const ExpertWeightsView w{w1.bf(), w2.bf()};
  Dev<uint16_t> h(static_cast<size_t>(rows.max_rows * ec.desc().ffn * 2)), y(x.n), io(x.n);
  Dev<float> dw1(w1.n), dw2(w2.n);
  for (auto* d : {&h, &y}) d->Poison();
  for (auto* d : {&dw1, &dw2}) d->Poison();
  dgate.Poison();
  ASSERT_TRUE(ec.Forward(rows, x.bf(), w, h.bf(), y.bf(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out->h = h.Download();
  out->y = y.Download();
  io.Upload(dy);
  const Status b = ec.Backward(rows, x.bf(), h.bf(), io.bf(), w, io.bf(), ExpertGradsView{dw1.p, dw2.p}, false, nullptr);
  ASSERT_TRUE(b.ok()) << b;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out->dx = io.Download();
  out->dw1 = dw1.Download();
  out->dw2 = dw2.Download();
  out->dgate = dgate.Download();
}

void ExpectSameRows(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, size_t n, const char* what) {
  size_t first = n;
  for (size_t i = 0; i < n && first == n; ++i)
    if (a[i] != b[i]) first = i;
  EXPECT_EQ(first, n) << what << " differs first at element " << first;
}

// z itself, in poisoned caller scratch (MakeCutlassExpertCompute's scratch: the forward's z rows): the epilogue's
// rows [0, M) are the kernel's bits, and its rows [M, max_rows) stay untouched.
void ExpectSameZ(const ExpertMlpDesc& desc, const CutlassTiles& fused_tiles, const CutlassTiles& unfused_tiles, const ExpertRows& rows,
                 const Dev<uint16_t>& x, const Dev<uint16_t>& w1, const Dev<uint16_t>& w2, int64_t M) {
  const size_t zn = CutlassExpertScratchBytes(desc) / sizeof(uint16_t);
  Dev<uint16_t> zf(zn), zu(zn), h(static_cast<size_t>(desc.max_rows * 2 * desc.ffn)), y(x.n);
  zf.Poison();
  zu.Poison();
  auto fused = MakeCutlassExpertCompute(desc, 0, fused_tiles, zf.p);
  auto unfused = MakeCutlassExpertCompute(desc, 0, unfused_tiles, zu.p);
  ASSERT_TRUE(fused.ok()) << fused.status();
  ASSERT_TRUE(unfused.ok()) << unfused.status();
  for (ExpertCompute* ec : {fused->get(), unfused->get()})
    ASSERT_TRUE(ec->Forward(rows, x.bf(), ExpertWeightsView{w1.bf(), w2.bf()}, h.bf(), y.bf(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> f = zf.Download(), u = zu.Download();
  const auto n = static_cast<size_t>(M * desc.ffn);
  ExpectSameRows(f, u, n, "z (epilogue vs kernel)");
  for (size_t i = n; i < zn; ++i) ASSERT_EQ(f[i], 0xFFFF) << "z row past M written at element " << i;
}

void CompareLayouts(const SwiCase& c) {
  const int64_t E = static_cast<int64_t>(c.counts.size()), H = c.H, F = c.F;
  const int64_t M = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
  const ExpertMlpDesc split_desc{E, H, F, M + kPad, mlp::GateUp::kSplit};
  const ExpertMlpDesc inter_desc{E, H, F, M + kPad, mlp::GateUp::kInterleaved8};
  CutlassTiles fused_tiles;
  fused_tiles.gemm1 = c.tile;
  fused_tiles.swiglu_epilogue = true;
  CutlassTiles unfused_tiles = fused_tiles;
  unfused_tiles.swiglu_epilogue = false;
  std::string skip;
  auto fused = MakeOrSkipReason(inter_desc, &skip, fused_tiles);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(fused.ok()) << fused.status();
  auto unfused = MakeCutlassExpertCompute(inter_desc, 0, unfused_tiles);
  auto split = MakeCutlassExpertCompute(split_desc, 0, unfused_tiles);
  ASSERT_TRUE(unfused.ok()) << unfused.status();
  ASSERT_TRUE(split.ok()) << split.status();

  Dev<int64_t> counts(static_cast<size_t>(E));
  counts.Upload(c.counts);
  const auto xn = static_cast<size_t>((M + kPad) * H);
  Dev<uint16_t> x(xn), w1_split(static_cast<size_t>(E * H * 2 * F)), w1_inter(w1_split.n), w2(static_cast<size_t>(E * F * H));
  x.Upload(RandomBf16(xn, 21, 1.f));
  const std::vector<uint16_t> w1_bits = RandomBf16(w1_split.n, 22, 1.f / std::sqrt(static_cast<float>(H)));
  w1_split.Upload(w1_bits);
  w1_inter.Upload(ToInterleaved8(w1_bits, F));
  w2.Upload(RandomBf16(w2.n, 23, 1.f / std::sqrt(static_cast<float>(F))));
  const std::vector<uint16_t> dy = RandomBf16(xn, 24, 1.f);
  std::vector<float> rec(static_cast<size_t>((M + kPad) * kStride), std::numeric_limits<float>::quiet_NaN());
  Rng rng(25);
  for (int64_t r = 0; r < M + kPad; ++r) rec[static_cast<size_t>(r * kStride + 1)] = 0.05f + static_cast<float>(rng.uniform());
  Dev<float> gates(rec.size()), dgate(static_cast<size_t>(M + kPad));
  gates.Upload(rec);
  ExpertRows rows{counts.p, M + kPad, nullptr};
  if (c.gated) {
    rows.gate = gates.p + 1;
    rows.gate_stride = kStride;
    rows.dgate = dgate.p;
  }

  Outputs f, u, s;
  RunOnce(**fused, rows, x, w1_inter, w2, dy, dgate, &f);
  RunOnce(**unfused, rows, x, w1_inter, w2, dy, dgate, &u);
  RunOnce(**split, rows, x, w1_split, w2, dy, dgate, &s);
  const auto hn = static_cast<size_t>(M * 2 * F), yn = static_cast<size_t>(M * H);
  ExpectSameRows(f.h, u.h, hn, "h (epilogue vs kernel)");
  ExpectSameRows(f.y, u.y, yn, "y (epilogue vs kernel)");
  for (size_t i = yn; i < xn; ++i) ASSERT_EQ(f.y[i], 0xFFFF) << "y row past M written at " << i;
  for (size_t i = hn; i < f.h.size(); ++i) ASSERT_EQ(f.h[i], 0xFFFF) << "h row past M written at " << i;

  ExpectPerExpert(AsDouble(ToSplit(f.h, F), hn), AsDouble(s.h, hn), c.counts, 2 * F, true, "h (interleaved, moved back) vs split");
  ExpectPerExpert(AsDouble(f.y, yn), AsDouble(s.y, yn), c.counts, H, true, "y vs split");
  ExpectPerExpert(AsDouble(f.dx, yn), AsDouble(s.dx, yn), c.counts, H, true, "dx vs split");
  ExpectPerExpert(AsDouble(ToSplit(f.dw1, F), f.dw1.size()), AsDouble(s.dw1, s.dw1.size()), c.counts, H * 2 * F, false,
                  "dW1 (moved back) vs split");
  ExpectPerExpert(AsDouble(f.dw2, f.dw2.size()), AsDouble(s.dw2, s.dw2.size()), c.counts, F * H, false, "dW2 vs split");
  if (c.gated) ExpectPerExpert(AsDouble(f.dgate, static_cast<size_t>(M)), AsDouble(s.dgate, static_cast<size_t>(M)), c.counts, 1, true,
                               "dgate vs split", 2e-2);
  ExpectSameZ(inter_desc, fused_tiles, unfused_tiles, rows, x, w1_inter, w2, M);
  if (c.gated) return;  // the cuBLASLt compute takes no gates
  auto lt = MakeCublasLtExpertCompute(inter_desc, 0);
  ASSERT_TRUE(lt.ok()) << lt.status();
  Dev<uint16_t> h(static_cast<size_t>((M + kPad) * 2 * F)), y(xn);
  y.Poison();
  ASSERT_TRUE((*lt)->Forward(rows, x.bf(), ExpertWeightsView{w1_inter.bf(), w2.bf()}, h.bf(), y.bf(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectPerExpert(AsDouble(f.y, yn), AsDouble(y.Download(), yn), c.counts, H, true, "y vs cuBLASLt (interleaved)");
}

class CutlassSwigluEpilogue : public ::testing::TestWithParam<SwiCase> {};

TEST_P(CutlassSwigluEpilogue, MatchesTheKernelBitwiseAndTheSplitLayout) { CompareLayouts(GetParam()); }

const std::vector<int64_t> kUneven = {0, 1, 300, 129, 0, 77, 512, 64};

INSTANTIATE_TEST_SUITE_P(
    Cases, CutlassSwigluEpilogue,
    ::testing::Values(SwiCase{"moonlight_coop_128x256", 2048, 1408, kUneven, "coop_128x256"},
                      SwiCase{"moonlight_coop_128x128", 2048, 1408, kUneven, "coop_128x128"},
                      SwiCase{"moonlight_ping_128x128", 2048, 1408, kUneven, "ping_128x128"},
                      SwiCase{"moonlight_gated", 2048, 1408, kUneven, "", true},
                      SwiCase{"f24_partial_n_tile", 64, 24, {3, 0, 17, 130}, ""},
                      SwiCase{"f200_gated_ping", 128, 200, {1, 257, 0, 31}, "ping_128x128", true},
                      SwiCase{"one_expert_all_rows", 256, 128, {0, 0, 1000, 0}, "coop_128x128"}),
    [](const ::testing::TestParamInfo<SwiCase>& i) { return i.param.name; });

TEST(CutlassSwigluEpilogue_Errors, ATileWithoutTheEpilogueOrTheSplitLayoutIsInvalidArgument) {
  const ExpertMlpDesc desc{4, 64, 64, 64, mlp::GateUp::kInterleaved8};
  std::string skip;
  auto ok = MakeOrSkipReason(desc, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(ok.ok()) << ok.status();
  CutlassTiles tiles;
  tiles.gemm1 = "coop_256x128_c1x2";
  tiles.swiglu_epilogue = true;
  auto bad = MakeCutlassExpertCompute(desc, 0, tiles);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("tiles.gemm1"), std::string::npos) << bad.status();
  tiles.swiglu_epilogue = false;  // the separate kernel runs after any tile
  EXPECT_TRUE(MakeCutlassExpertCompute(desc, 0, tiles).ok());
  tiles = {};
  tiles.swiglu_epilogue = true;  // the split layout has no epilogue
  auto split = MakeCutlassExpertCompute(ExpertMlpDesc{4, 64, 64, 64, mlp::GateUp::kSplit}, 0, tiles);
  ASSERT_FALSE(split.ok());
  EXPECT_EQ(split.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(split.status().message().find("swiglu_epilogue"), std::string::npos) << split.status();
}

}  // namespace
}  // namespace rdep::kernels
