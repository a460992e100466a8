// The gate multiplied before W2 (ExpertRows::gate, seeds 002 section 4) in the CUTLASS expert compute,
// against the same compute without gates on the same inputs:
//   forward   y_gated[r] = g_r * y[r]                                  (within 1e-2 per expert)
//             h the same bits (GEMM1 does not see the gate)
//   backward  with dout unweighted (dy) against the unweighted compute given bf16(g_r * dy_r):
//             dx, dW1, dW2 within 1e-2 per expert; dgate[r] = <dy_r, y[r]> (double on the host, from the
//             unweighted forward's bf16 outputs) within 1e-2 per expert; dgate past the rows untouched;
//             the same bits when run again (a deterministic row reduction); dx written over dout.
// The gates sit in records of three floats with NaN around them, so a wrong stride shows as NaN. Bad
// arguments are InvalidArgument naming the field; the cuBLASLt compute refuses gates.
// Skips without a GPU or CUTLASS (fails instead with RDEP_REQUIRE_CUTLASS=1 on a GPU).
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

constexpr int64_t kStride = 3;  // floats per gate record; the gate is field 1

struct GateCase {
  std::string name;
  int64_t H, F;
  std::vector<int64_t> counts;
  bool accumulate = false;
  bool bf16_grads = false;
};

// M + pad records of kStride floats, NaN but for each row's gate in [0.05, 1.05).
std::vector<float> GateRecords(int64_t rows, uint64_t seed) {
  std::vector<float> rec(static_cast<size_t>(rows * kStride), std::numeric_limits<float>::quiet_NaN());
  Rng rng(seed);
  for (int64_t r = 0; r < rows; ++r) rec[static_cast<size_t>(r * kStride + 1)] = 0.05f + static_cast<float>(rng.uniform());
  return rec;
}

struct Grads {
  Dev<float> f1, f2;
  Dev<uint16_t> b1, b2;
  Grads(size_t n1, size_t n2, bool accumulate) : f1(n1), f2(n2), b1(n1), b2(n2) {
    if (accumulate) {
      f1.Upload(std::vector<float>(n1, 0.25f));
      f2.Upload(std::vector<float>(n2, -0.5f));
    } else {
      for (auto* d : {&f1, &f2}) d->Poison();
      for (auto* d : {&b1, &b2}) d->Poison();
    }
  }
  ExpertGradsView view(bool bf16) { return bf16 ? ExpertGradsView{nullptr, nullptr, b1.bf(), b2.bf()} : ExpertGradsView{f1.p, f2.p}; }
  std::vector<double> dw1(bool bf16) const { return bf16 ? AsDouble(b1.Download(), b1.n) : AsDouble(f1.Download(), f1.n); }
  std::vector<double> dw2(bool bf16) const { return bf16 ? AsDouble(b2.Download(), b2.n) : AsDouble(f2.Download(), f2.n); }
};

void CompareGatedWithUnweighted(const GateCase& c) {
  const int64_t E = static_cast<int64_t>(c.counts.size()), H = c.H, F = c.F, pad = 5;
  const int64_t M = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
  std::string skip;
  auto made = MakeOrSkipReason({E, H, F, M + pad}, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(made.ok()) << made.status();
  ExpertCompute& ec = **made;
  Dev<int64_t> counts(static_cast<size_t>(E));
  counts.Upload(c.counts);
  const auto xn = static_cast<size_t>((M + pad) * H), hn = static_cast<size_t>((M + pad) * 2 * F);
  Dev<uint16_t> x(xn), w1(static_cast<size_t>(E * H * 2 * F)), w2(static_cast<size_t>(E * F * H)), h(hn), y(xn), yg(xn);
  x.Upload(RandomBf16(xn, 11, 1.f));
  w1.Upload(RandomBf16(w1.n, 12, 1.f / std::sqrt(static_cast<float>(H))));
  w2.Upload(RandomBf16(w2.n, 13, 1.f / std::sqrt(static_cast<float>(F))));
  const std::vector<float> rec = GateRecords(M + pad, 14);
  Dev<float> gates(rec.size()), dgate(static_cast<size_t>(M + pad));
  gates.Upload(rec);
  const ExpertWeightsView w{w1.bf(), w2.bf()};
  const ExpertRows plain{counts.p, M + pad, nullptr};  // the bound above the rows, as the layer's: the device total bounds
  ExpertRows gated = plain;
  gated.gate = gates.p + 1;
  gated.gate_stride = kStride;
  gated.dgate = dgate.p;

  // Forward, unweighted then gated.
  for (auto* d : {&h, &y, &yg}) d->Poison();
  ASSERT_TRUE(ec.Forward(plain, x.bf(), w, h.bf(), y.bf(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> h_fwd = h.Download(), y_plain = y.Download();
  h.Poison();
  ASSERT_TRUE(ec.Forward(gated, x.bf(), w, h.bf(), yg.bf(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto rows_n = static_cast<size_t>(M * 2 * F);
  const std::vector<uint16_t> h_gated = h.Download();
  EXPECT_TRUE(std::equal(h_gated.begin(), h_gated.begin() + static_cast<std::ptrdiff_t>(rows_n), h_fwd.begin())) << "h differs with gates";
  std::vector<double> want_y(static_cast<size_t>(M * H)), dy_scaled_d(want_y.size());
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < H; ++j)
      want_y[static_cast<size_t>(r * H + j)] = rec[static_cast<size_t>(r * kStride + 1)] * Bf16BitsToFloat(y_plain[static_cast<size_t>(r * H + j)]);
  ExpectPerExpert(AsDouble(yg.Download(), want_y.size()), want_y, c.counts, H, true, "gated y");
  const std::vector<uint16_t> yg_bits = yg.Download();
  for (size_t i = static_cast<size_t>(M * H); i < xn; ++i) ASSERT_EQ(yg_bits[i], 0xFFFF) << "gated y row past M written";

  // Backward: unweighted compute on bf16(g * dy) against the gated one on dy (dx over dy).
  const std::vector<uint16_t> dy = RandomBf16(xn, 15, 1.f);
  std::vector<uint16_t> dy_scaled(dy);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < H; ++j) {
      const auto i = static_cast<size_t>(r * H + j);
      dy_scaled[i] = FloatToBf16Bits(rec[static_cast<size_t>(r * kStride + 1)] * Bf16BitsToFloat(dy[i]));
    }
  Dev<uint16_t> dout(xn), dx(xn), io(xn);
  dout.Upload(dy_scaled);
  dx.Poison();
  Grads ref(w1.n, w2.n, c.accumulate), got(w1.n, w2.n, c.accumulate);
  h.Upload(h_fwd);
  ASSERT_TRUE(ec.Backward(plain, x.bf(), h.bf(), dout.bf(), w, dx.bf(), ref.view(c.bf16_grads), c.accumulate, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  h.Upload(h_fwd);
  io.Upload(dy);
  dgate.Poison();
  ASSERT_TRUE(ec.Backward(gated, x.bf(), h.bf(), io.bf(), w, io.bf(), got.view(c.bf16_grads), c.accumulate, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectPerExpert(AsDouble(io.Download(), static_cast<size_t>(M * H)), AsDouble(dx.Download(), static_cast<size_t>(M * H)), c.counts, H,
                  true, "dx (gated, over dy)");
  ExpectPerExpert(got.dw1(c.bf16_grads), ref.dw1(c.bf16_grads), c.counts, H * 2 * F, false, "dW1 (gated)");
  ExpectPerExpert(got.dw2(c.bf16_grads), ref.dw2(c.bf16_grads), c.counts, F * H, false, "dW2 (gated)");

  // dgate against <dy_r, y_r> of the unweighted forward's outputs.
  const std::vector<float> dg = dgate.Download();
  std::vector<double> want_dg(static_cast<size_t>(M));
  for (int64_t r = 0; r < M; ++r) {
    double s = 0;
    for (int64_t j = 0; j < H; ++j) {
      const auto i = static_cast<size_t>(r * H + j);
      s += static_cast<double>(Bf16BitsToFloat(dy[i])) * Bf16BitsToFloat(y_plain[i]);
    }
    want_dg[static_cast<size_t>(r)] = s;
  }
  ExpectPerExpert(AsDouble(dg, static_cast<size_t>(M)), want_dg, c.counts, 1, true, "dgate", 2e-2);
  for (int64_t r = M; r < M + pad; ++r) {
    uint32_t bits;
    std::memcpy(&bits, &dg[static_cast<size_t>(r)], 4);
    EXPECT_EQ(bits, 0xFFFFFFFFu) << "dgate past the rows written at " << r;
  }
  // Again on the same inputs, dgate poisoned again: the same bits.
  h.Upload(h_fwd);
  io.Upload(dy);
  dgate.Poison();
  Grads again(w1.n, w2.n, c.accumulate);
  ASSERT_TRUE(ec.Backward(gated, x.bf(), h.bf(), io.bf(), w, io.bf(), again.view(c.bf16_grads), c.accumulate, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> dg_again = dgate.Download();  // bits: the rows past M hold NaN, which == would call unequal
  EXPECT_EQ(std::memcmp(dg_again.data(), dg.data(), dg.size() * sizeof(float)), 0) << "dgate is not deterministic";
}

class CutlassGateBeforeW2 : public ::testing::TestWithParam<GateCase> {};

TEST_P(CutlassGateBeforeW2, MatchesTheUnweightedComputeScaled) { CompareGatedWithUnweighted(GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    Cuda_bf16, CutlassGateBeforeW2,
    ::testing::Values(GateCase{"E5_H64_F48_empty_single_uneven", 64, 48, {37, 0, 1, 0, 90}},
                      GateCase{"E3_not_tile_multiples_accumulate", 256, 136, {129, 255, 7}, true, false},
                      GateCase{"E6_bf16_gradients", 128, 96, {64, 0, 200, 3, 0, 128}, false, true},
                      GateCase{"E16_moonlight_expert", 2048, 1408, {384, 0, 512, 130, 768, 1, 256, 640, 96, 384, 0, 1024, 33, 512, 300, 200}}),
    [](const ::testing::TestParamInfo<GateCase>& i) { return i.param.name; });

TEST(CutlassGateBeforeW2_Errors, BadGateArgumentsAreInvalidArgumentNamingTheField) {
  const int64_t E = 2, H = 64, F = 32, M = 16;
  std::string skip;
  auto made = MakeOrSkipReason({E, H, F, M}, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(made.ok()) << made.status();
  Dev<int64_t> counts(2);
  counts.Upload({10, 6});
  Dev<uint16_t> x(M * H), w1(E * H * 2 * F), w2(E * F * H), h(M * 2 * F), y(M * H);
  Dev<float> gates(M), dw1(w1.n), dw2(w2.n);
  const ExpertWeightsView w{w1.bf(), w2.bf()};
  ExpertRows rows{counts.p, M, nullptr};
  rows.gate = gates.p;
  rows.gate_stride = 0;
  Status s = (*made)->Forward(rows, x.bf(), w, h.bf(), y.bf(), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("gate_stride"), std::string::npos) << s;
  rows.gate_stride = 1;
  s = (*made)->Backward(rows, x.bf(), h.bf(), y.bf(), w, y.bf(), {dw1.p, dw2.p}, false, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("rows.dgate"), std::string::npos) << s;
  auto lt = MakeCublasLtExpertCompute({E, H, F, M}, 0);
  ASSERT_TRUE(lt.ok()) << lt.status();
  s = (*lt)->Forward(rows, x.bf(), w, h.bf(), y.bf(), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("cutlass"), std::string::npos) << s;
}

}  // namespace
}  // namespace rdep::kernels
