// dz's SwiGLU' epilogue (kNT_SwiGLUGrad, swiglu_grad_epilogue_sm90.cuh): the CUTLASS compute with
// tiles.swiglu_grad_epilogue writes z (dz's output) and dh (over h) in dz's epilogue. Checked against
//   - the same compute with the separate SwiGLU' kernel (the flag off): after a forward and a backward, h (now dh),
//     z (the scratch), dx, dW1 and dW2 the same bits, in both layouts of W1 (split, interleaved8), fp32 gradients
//     overwritten and accumulated, and bf16 gradients;
//   - a host reference of the SwiGLU' on the forward's h and dz = dout.W2^T computed from the bf16 inputs (z and dh
//     within ||a-b||/||b|| <= 1e-2 per expert);
//   - with per-row gates the pass runs (dgate is its row reduction): every output the unfused compute's bits;
// over the three tiles built with the epilogue, row counts that are not tile multiples, empty experts, one expert
// holding every row, and F not a multiple of the tile's N (F = 24, 200). Outputs are poisoned first; rows past M
// stay untouched. Skips as the other CUTLASS tests do (experts_test_util.h).
//   build/src/experts/experts_test --gtest_filter='*CutlassSwigluGradEpilogue*'
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

constexpr int64_t kPad = 5;
constexpr int64_t kStride = 3;  // gate records: [?, gate, ?]

struct GradCase {
  std::string name;
  int64_t H, F;
  std::vector<int64_t> counts;
  std::string tile;  // dz's ("" = its default)
  mlp::GateUp gate_up = mlp::GateUp::kSplit;
  bool gated = false;
  bool reference = false;  // also against the host reference (small shapes)
};

struct Outputs {
  std::vector<uint16_t> h_fwd, dh, z, dx;
  std::vector<float> dw1, dw2, dgate;
  std::vector<uint16_t> dw1_bf16, dw2_bf16;
};

// The inputs of one case, on the device.
struct Inputs {
  ExpertMlpDesc desc;
  int64_t M;
  Dev<int64_t> counts;
  Dev<uint16_t> x, w1, w2;
  Dev<float> gates;
  std::vector<uint16_t> x_bits, w2_bits, dy;
  Inputs(const GradCase& c, int64_t M_)
      : desc{static_cast<int64_t>(c.counts.size()), c.H, c.F, M_ + kPad, c.gate_up},
        M(M_),
        counts(c.counts.size()),
        x(static_cast<size_t>((M_ + kPad) * c.H)),
        w1(static_cast<size_t>(static_cast<int64_t>(c.counts.size()) * c.H * 2 * c.F)),
        w2(static_cast<size_t>(static_cast<int64_t>(c.counts.size()) * c.F * c.H)),
        gates(static_cast<size_t>((M_ + kPad) * kStride)) {}
};

// One forward and backward on poisoned outputs into caller scratch (z); the weight gradients fp32 overwritten, then
// (accumulate) the same backward again adding into them, and a bf16 backward on a fresh h.
void RunOnce(const GradCase& c, const CutlassTiles& tiles, Inputs& in, Outputs* out) {
  const int64_t F = c.F, rows_bound = in.desc.max_rows;
  Dev<uint16_t> z(CutlassExpertScratchBytes(in.desc) / sizeof(uint16_t));
  z.Poison();
  auto made = MakeCutlassExpertCompute(in.desc, 0, tiles, z.p);
  ASSERT_TRUE(made.ok()) << made.status();
  ExpertCompute& ec = **made;
  Dev<float> dgate(static_cast<size_t>(rows_bound));
  dgate.Poison();
  ExpertRows rows{in.counts.p, rows_bound, nullptr};
  if (c.gated) {
    rows.gate = in.gates.p + 1;
    rows.gate_stride = kStride;
    rows.dgate = dgate.p;
  }
  const ExpertWeightsView w{in.w1.bf(), in.w2.bf()};
  Dev<uint16_t> h(static_cast<size_t>(rows_bound * 2 * F)), y(in.x.n), io(in.x.n);
  Dev<float> dw1(in.w1.n), dw2(in.w2.n);
  for (auto* d : {&h, &y}) d->Poison();
  for (auto* d : {&dw1, &dw2}) d->Poison();
  ASSERT_TRUE(ec.Forward(rows, in.x.bf(), w, h.bf(), y.bf(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out->h_fwd = h.Download();
  io.Upload(in.dy);
  Status b = ec.Backward(rows, in.x.bf(), h.bf(), io.bf(), w, io.bf(), ExpertGradsView{dw1.p, dw2.p}, false, nullptr);
  ASSERT_TRUE(b.ok()) << b;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out->dh = h.Download();
  out->z = z.Download();
  out->dx = io.Download();
  out->dgate = dgate.Download();
  // Accumulate: a second backward from the forward's h adds into the gradients.
  h.Upload(out->h_fwd);
  io.Upload(in.dy);
  b = ec.Backward(rows, in.x.bf(), h.bf(), io.bf(), w, io.bf(), ExpertGradsView{dw1.p, dw2.p}, true, nullptr);
  ASSERT_TRUE(b.ok()) << b;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out->dw1 = dw1.Download();
  out->dw2 = dw2.Download();
  // bf16 gradients (written once).
  Dev<uint16_t> dw1b(in.w1.n), dw2b(in.w2.n);
  dw1b.Poison();
  dw2b.Poison();
  h.Upload(out->h_fwd);
  io.Upload(in.dy);
  ExpertGradsView gb;
  gb.dw1_bf16 = dw1b.bf();
  gb.dw2_bf16 = dw2b.bf();
  b = ec.Backward(rows, in.x.bf(), h.bf(), io.bf(), w, io.bf(), gb, false, nullptr);
  ASSERT_TRUE(b.ok()) << b;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out->dw1_bf16 = dw1b.Download();
  out->dw2_bf16 = dw2b.Download();
  ASSERT_EQ(h.Download(), out->dh) << "a second backward's dh differs from the first's";
}

template <typename T>
void ExpectSame(const std::vector<T>& a, const std::vector<T>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t first = a.size();
  for (size_t i = 0; i < a.size() && first == a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) first = i;
  EXPECT_EQ(first, a.size()) << what << " differs first at element " << first;
}

// The host SwiGLU' of the forward's h and dz = dout.W2^T (bf16 inputs, fp64 sums rounded to bf16 as the GEMM's
// output is): z and dh in h's layout.
void HostSwigluGrad(const GradCase& c, const Inputs& in, const std::vector<uint16_t>& h, std::vector<double>* z,
                    std::vector<double>* dh) {
  const int64_t H = c.H, F = c.F;
  const bool inter = c.gate_up == mlp::GateUp::kInterleaved8;
  z->assign(static_cast<size_t>(in.M * F), 0.0);
  dh->assign(static_cast<size_t>(in.M * 2 * F), 0.0);
  int64_t r = 0;
  for (size_t e = 0; e < c.counts.size(); ++e) {
    for (int64_t i = 0; i < c.counts[e]; ++i, ++r) {
      for (int64_t j = 0; j < F; ++j) {
        double acc = 0;
        const uint16_t* w2 = in.w2_bits.data() + (static_cast<int64_t>(e) * F + j) * H;
        for (int64_t k = 0; k < H; ++k) acc += static_cast<double>(Bf16BitsToFloat(in.dy[static_cast<size_t>(r * H + k)])) * Bf16BitsToFloat(w2[k]);
        const double dd = RoundToBf16(static_cast<float>(acc));
        const int64_t gc = inter ? 16 * (j / 8) + j % 8 : j, uc = inter ? gc + 8 : F + j;
        const double a = Bf16BitsToFloat(h[static_cast<size_t>(r * 2 * F + gc)]);
        const double b = Bf16BitsToFloat(h[static_cast<size_t>(r * 2 * F + uc)]);
        const double s = 1.0 / (1.0 + std::exp(-a)), silu = a * s;
        (*z)[static_cast<size_t>(r * F + j)] = silu * b;
        (*dh)[static_cast<size_t>(r * 2 * F + gc)] = dd * b * s * (1.0 + a * (1.0 - s));
        (*dh)[static_cast<size_t>(r * 2 * F + uc)] = dd * silu;
      }
    }
  }
}

void Compare(const GradCase& c) {
  const int64_t H = c.H, F = c.F;
  const int64_t M = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
  CutlassTiles fused;
  fused.dgrad_z = c.tile;
  fused.swiglu_grad_epilogue = true;
  CutlassTiles unfused = fused;
  unfused.swiglu_grad_epilogue = false;
  std::string skip;
  Inputs in(c, M);
  auto probe = MakeOrSkipReason(in.desc, &skip, fused);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(probe.ok()) << probe.status();

  in.counts.Upload(c.counts);
  in.x_bits = RandomBf16(in.x.n, 31, 1.f);
  in.x.Upload(in.x_bits);
  in.w1.Upload(RandomBf16(in.w1.n, 32, 1.f / std::sqrt(static_cast<float>(H))));
  in.w2_bits = RandomBf16(in.w2.n, 33, 1.f / std::sqrt(static_cast<float>(F)));
  in.w2.Upload(in.w2_bits);
  in.dy = RandomBf16(in.x.n, 34, 1.f);
  std::vector<float> rec(in.gates.n, std::numeric_limits<float>::quiet_NaN());
  Rng rng(35);
  for (int64_t r = 0; r < M + kPad; ++r) rec[static_cast<size_t>(r * kStride + 1)] = 0.05f + static_cast<float>(rng.uniform());
  in.gates.Upload(rec);

  Outputs f, u;
  RunOnce(c, fused, in, &f);
  RunOnce(c, unfused, in, &u);
  ExpectSame(f.h_fwd, u.h_fwd, "h (forward)");
  ExpectSame(f.dh, u.dh, "dh (epilogue vs kernel), every row");
  ExpectSame(f.z, u.z, "z (epilogue vs kernel), the whole scratch");
  ExpectSame(f.dx, u.dx, "dx");
  ExpectSame(f.dw1, u.dw1, "dW1 (fp32, overwritten then accumulated)");
  ExpectSame(f.dw2, u.dw2, "dW2 (fp32, overwritten then accumulated)");
  ExpectSame(f.dw1_bf16, u.dw1_bf16, "dW1 (bf16)");
  ExpectSame(f.dw2_bf16, u.dw2_bf16, "dW2 (bf16)");
  if (c.gated) ExpectSame(f.dgate, u.dgate, "dgate");
  const auto hn = static_cast<size_t>(M * 2 * F), zn = static_cast<size_t>(M * F);
  for (size_t i = hn; i < f.dh.size(); ++i) ASSERT_EQ(f.dh[i], 0xFFFF) << "h row past M written at element " << i;
  for (size_t i = zn; i < f.z.size(); ++i) ASSERT_EQ(f.z[i], 0xFFFF) << "z row past M written at element " << i;
  if (!c.reference || c.gated) return;
  std::vector<double> z_ref, dh_ref;
  HostSwigluGrad(c, in, f.h_fwd, &z_ref, &dh_ref);
  ExpectPerExpert(AsDouble(f.z, zn), z_ref, c.counts, F, true, "z vs host");
  ExpectPerExpert(AsDouble(f.dh, hn), dh_ref, c.counts, 2 * F, true, "dh vs host");
}

class CutlassSwigluGradEpilogue : public ::testing::TestWithParam<GradCase> {};

TEST_P(CutlassSwigluGradEpilogue, MatchesTheKernelBitwiseAndTheHost) { Compare(GetParam()); }

const std::vector<int64_t> kUneven = {0, 1, 300, 129, 0, 77, 512, 64};
constexpr auto kSplit = mlp::GateUp::kSplit;
constexpr auto kInter = mlp::GateUp::kInterleaved8;

INSTANTIATE_TEST_SUITE_P(
    Cases, CutlassSwigluGradEpilogue,
    ::testing::Values(GradCase{"moonlight_coop_128x128_split", 2048, 1408, kUneven, "coop_128x128", kSplit},
                      GradCase{"moonlight_coop_128x256_split", 2048, 1408, kUneven, "coop_128x256", kSplit},
                      GradCase{"moonlight_ping_128x128_split", 2048, 1408, kUneven, "ping_128x128", kSplit},
                      GradCase{"moonlight_ping_128x128_inter", 2048, 1408, kUneven, "ping_128x128", kInter},
                      GradCase{"moonlight_gated_keeps_the_pass", 2048, 1408, kUneven, "ping_128x128", kSplit, true},
                      GradCase{"f24_partial_n_tile_host", 64, 24, {3, 0, 17, 130}, "", kSplit, false, true},
                      GradCase{"f200_inter_host", 128, 200, {1, 257, 0, 31}, "coop_128x256", kInter, false, true},
                      GradCase{"f200_ping_split_host", 256, 200, {40, 0, 300, 9}, "ping_128x128", kSplit, false, true},
                      GradCase{"one_expert_all_rows", 256, 128, {0, 0, 1000, 0}, "coop_128x128", kInter}),
    [](const ::testing::TestParamInfo<GradCase>& i) { return i.param.name; });

// A dgrad_z tile built without the epilogue is InvalidArgument naming the field; without the flag any tile runs.
TEST(CutlassSwigluGradEpilogue_Errors, ATileWithoutTheEpilogueIsInvalidArgument) {
  const ExpertMlpDesc desc{4, 64, 24, 64, kSplit};
  std::string skip;
  auto probe = MakeOrSkipReason(desc, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  CutlassTiles tiles;
  tiles.dgrad_z = "coop_256x128_c2x1";
  tiles.swiglu_grad_epilogue = true;
  auto bad = MakeCutlassExpertCompute(desc, 0, tiles);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("dgrad_z"), std::string::npos) << bad.status();
  tiles.swiglu_grad_epilogue = false;
  EXPECT_TRUE(MakeCutlassExpertCompute(desc, 0, tiles).ok());
}

}  // namespace
}  // namespace rdep::kernels
