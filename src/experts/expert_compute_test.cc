// ExpertCompute (cuBLASLt implementation): counts read from device memory give bitwise the results of
// the same counts passed as a host mirror, forward and backward, with empty experts and row counts
// that are not multiples of anything; outputs are poisoned first and rows past M stay poisoned. The
// workspace estimate equals what the object holds; bad calls are InvalidArgument.
//   build/src/experts/experts_test --gtest_filter='ExpertCompute*'
#include "rdep/experts/expert_compute.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "experts/experts_test_util.h"
#include "rdep/core/random.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"

namespace rdep::kernels {
namespace {

using test_util::Dev;
using test_util::RandomBf16;

TEST(ExpertCompute_Cuda_bf16, DeviceCountsEqualHostMirrorBitwise) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t E = 5, H = 64, F = 48, pad = 3;
  const std::vector<int64_t> counts = {37, 0, 1, 0, 90};  // empty experts, a single row, uneven
  const int64_t M = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const ExpertMlpDesc desc{E, H, F, M + pad};
  auto ec = MakeCublasLtExpertCompute(desc, 0);
  ASSERT_TRUE(ec.ok()) << ec.status();
  EXPECT_FALSE((*ec)->graph_safe());
  EXPECT_EQ((*ec)->workspace_bytes(), ExpertComputeWorkspaceBytes(desc));
  Dev<int64_t> dcounts(static_cast<size_t>(E));
  dcounts.Upload(counts);
  Dev<uint16_t> x(static_cast<size_t>((M + pad) * H)), w1(static_cast<size_t>(E * H * 2 * F)), w2(static_cast<size_t>(E * F * H));
  Dev<uint16_t> dout(static_cast<size_t>((M + pad) * H));
  x.Upload(RandomBf16(x.n, 1, 1.f));
  w1.Upload(RandomBf16(w1.n, 2, 0.1f));
  w2.Upload(RandomBf16(w2.n, 3, 0.1f));
  dout.Upload(RandomBf16(dout.n, 4, 1.f));
  struct Out {
    std::vector<uint16_t> h, y, dx;
    std::vector<float> dw1, dw2;
  } got[2];
  for (int mode = 0; mode < 2; ++mode) {  // 0: device counts, 1: host mirror
    Dev<uint16_t> h(static_cast<size_t>((M + pad) * 2 * F)), y(static_cast<size_t>((M + pad) * H)), dx(y.n);
    Dev<float> dw1(w1.n), dw2(w2.n);
    for (auto* d : {&h, &y, &dx}) d->Poison();
    dw1.Poison();
    dw2.Poison();
    const ExpertRows rows{mode == 0 ? dcounts.p : nullptr, M, mode == 1 ? counts.data() : nullptr};
    const ExpertWeightsView w{w1.bf(), w2.bf()};
    ASSERT_TRUE((*ec)->Forward(rows, x.bf(), w, h.bf(), y.bf(), nullptr).ok());
    ASSERT_TRUE((*ec)->Backward(rows, x.bf(), h.bf(), dout.bf(), w, dx.bf(), {dw1.p, dw2.p}, false, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got[mode] = {h.Download(), y.Download(), dx.Download(), dw1.Download(), dw2.Download()};
    for (int64_t i = M * H; i < (M + pad) * H; ++i) {
      ASSERT_EQ(got[mode].y[static_cast<size_t>(i)], 0xFFFF) << "y row past M written, mode " << mode;
      ASSERT_EQ(got[mode].dx[static_cast<size_t>(i)], 0xFFFF) << "dx row past M written, mode " << mode;
    }
    for (int64_t i = 0; i < M * H; ++i) ASSERT_NE(got[mode].y[static_cast<size_t>(i)], 0xFFFF) << "y row not written";
    // Empty experts' gradients are zeroed by an overwrite.
    for (int64_t i = 0; i < H * 2 * F; ++i) ASSERT_EQ(got[mode].dw1[static_cast<size_t>(1 * H * 2 * F + i)], 0.f);
  }
  EXPECT_EQ(got[0].h, got[1].h);
  EXPECT_EQ(got[0].y, got[1].y);
  EXPECT_EQ(got[0].dx, got[1].dx);
  EXPECT_EQ(got[0].dw1, got[1].dw1);
  EXPECT_EQ(got[0].dw2, got[1].dw2);
}

TEST(ExpertCompute_Cuda_bf16, BadCallsAreInvalidArgument) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto ec = MakeCublasLtExpertCompute({2, 64, 32, 10}, 0);
  ASSERT_TRUE(ec.ok()) << ec.status();
  Dev<uint16_t> buf(4096);
  const int64_t counts[2] = {3, 4};
  const float scale = 1.f;
  auto* p = buf.bf();
  EXPECT_EQ((*ec)->Forward({nullptr, 7, nullptr}, p, {p, p}, p, p, nullptr).code(), StatusCode::kInvalidArgument);  // no counts
  EXPECT_EQ((*ec)->Forward({nullptr, 11, counts}, p, {p, p}, p, p, nullptr).code(), StatusCode::kInvalidArgument);  // max_rows > desc
  EXPECT_EQ((*ec)->Forward({nullptr, 7, counts}, p, {p, p, &scale, nullptr}, p, p, nullptr).code(), StatusCode::kInvalidArgument);  // FP8 scales
}

// RDEP_CUTLASS_TILES and `rdep bench gemm --path cutlass:SPEC`: one tile for every GEMM, six in CutlassTiles' order
// with empty fields for the defaults, anything else named. Host only (no device needed).
TEST(ExpertCompute_TileSpec, OneTileOrSixFieldsInCutlassTilesOrder) {
  auto one = ParseCutlassTileSpec("ping_128x128", "RDEP_CUTLASS_TILES");
  ASSERT_TRUE(one.ok()) << one.status();
  for (const std::string* t : {&one->gemm1, &one->gemm2, &one->dgrad_z, &one->dgrad_x, &one->wgrad_w2, &one->wgrad_w1})
    EXPECT_EQ(*t, "ping_128x128");
  auto six = ParseCutlassTileSpec("a/b//d//f", "RDEP_CUTLASS_TILES");
  ASSERT_TRUE(six.ok()) << six.status();
  EXPECT_EQ(six->gemm1, "a");
  EXPECT_EQ(six->gemm2, "b");
  EXPECT_EQ(six->dgrad_z, "");
  EXPECT_EQ(six->dgrad_x, "d");
  EXPECT_EQ(six->wgrad_w2, "");
  EXPECT_EQ(six->wgrad_w1, "f");
  EXPECT_FALSE(six->swiglu_epilogue);
  auto bad = ParseCutlassTileSpec("a/b/c", "RDEP_CUTLASS_TILES");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("RDEP_CUTLASS_TILES = 'a/b/c'"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("3 fields"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace rdep::kernels
