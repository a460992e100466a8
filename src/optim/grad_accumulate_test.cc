// A bf16 gradient moved into an fp32 accumulator: the host reference against the sum written out (float of the
// bf16 bits, one fp32 add), the argument checks, and the CUDA kernel against the host reference bitwise on
// fresh random inputs (accumulators that fp32 holds but bf16 cannot), copy and add, vectorized, unaligned and
// odd lengths, with poisoned guard elements around both arrays that must come back untouched.
#include "rdep/optim/grad_accumulate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "rdep/cuda/bf16.h"
#if defined(RDEP_HAVE_CUDA)
#include "optim/optim_test_util.h"
#include "rdep/cuda/check.h"
#endif

namespace rdep::optim {
namespace {

struct Arrays {
  std::vector<float> acc;
  std::vector<uint16_t> grad;
};

Arrays Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  Arrays a;
  for (int64_t i = 0; i < n; ++i) {
    a.acc.push_back(d(rng) * 1e-3f);  // 24 significant bits: a bf16 round trip would change most of them
    a.grad.push_back(FloatToBf16Bits(d(rng) * 1e-3f));
  }
  return a;
}

TEST(GradAccumulateHost, AddsTheBf16ValueInOneFp32Rounding) {
  Arrays a = Random(1000, 1);
  const std::vector<float> before = a.acc;
  GradAccumulateHost({a.acc.data(), a.grad.data(), 1000, /*add=*/true});
  for (size_t i = 0; i < a.acc.size(); ++i) {
    const float want = before[i] + Bf16BitsToFloat(a.grad[i]);  // fp32 + fp32, rounded once
    ASSERT_EQ(std::memcmp(&a.acc[i], &want, 4), 0) << "element " << i;
  }
  GradAccumulateHost({a.acc.data(), a.grad.data(), 1000, /*add=*/false});
  for (size_t i = 0; i < a.acc.size(); ++i) ASSERT_EQ(a.acc[i], Bf16BitsToFloat(a.grad[i])) << "copy, element " << i;
}

TEST(GradAccumulateChecks, FieldsAreNamed) {
  float acc[4] = {};
  const uint16_t grad[4] = {};
  auto msg = [](const GradAccumulation& a) { return CheckGradAccumulation(a).message(); };
  EXPECT_TRUE(CheckGradAccumulation({acc, grad, 4, true}).ok());
  EXPECT_TRUE(CheckGradAccumulation({nullptr, nullptr, 0, true}).ok());  // nothing to move
  EXPECT_NE(msg({acc, grad, -1, true}).find("numel must be >= 0, got -1"), std::string::npos);
  EXPECT_NE(msg({nullptr, grad, 4, true}).find("acc (the fp32 accumulator) is null"), std::string::npos);
  EXPECT_NE(msg({acc, nullptr, 4, true}).find("grad (the bf16 gradient) is null"), std::string::npos);
  auto* inside = reinterpret_cast<const uint16_t*>(acc + 2);  // the gradient's bytes within the accumulator's
  EXPECT_NE(msg({acc, inside, 4, true}).find("acc and grad overlap"), std::string::npos);
  auto* after = reinterpret_cast<const uint16_t*>(acc + 4);  // adjacent, not overlapping
  EXPECT_TRUE(CheckGradAccumulation({acc, after, 4, true}).ok());
}

#if defined(RDEP_HAVE_CUDA)
using test_util::Download;
using test_util::Guarded;
using test_util::Upload;

void RunKernelCase(int64_t n, int64_t skew, bool add, uint32_t seed) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  SCOPED_TRACE("numel " + std::to_string(n) + " skew " + std::to_string(skew) + (add ? " add" : " copy"));
  Arrays host = Random(n, seed);
  const float nanf = std::nanf("");
  const uint16_t nanb = 0x7FC1;
  Guarded<float> acc;
  Guarded<uint16_t> grad;
  // A copy must write every element: its accumulator starts as NaN.
  ASSERT_TRUE(Upload(add ? host.acc : std::vector<float>(host.acc.size(), nanf), skew, nanf, &acc).ok());
  ASSERT_TRUE(Upload(host.grad, skew, nanb, &grad).ok());
  GradAccumulateHost({host.acc.data(), host.grad.data(), n, add});
  const Status s = LaunchGradAccumulate({acc.data(), grad.data(), n, add}, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got;
  std::vector<uint16_t> grad_after;
  Download(acc, nanf, &got, "acc");
  Download(grad, nanb, &grad_after, "grad");
  EXPECT_EQ(grad_after, host.grad) << "the gradient is read only";
  ASSERT_EQ(got.size(), host.acc.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(std::memcmp(&got[i], &host.acc[i], 4), 0) << "element " << i;
}

TEST(GradAccumulateCuda, AddMatchesHostBitwiseVectorized) { RunKernelCase(100003, 0, true, 11); }     // 8 a thread, then the tail
TEST(GradAccumulateCuda, CopyMatchesHostBitwiseVectorized) { RunKernelCase(100003, 0, false, 12); }
TEST(GradAccumulateCuda, AddMatchesHostBitwiseUnaligned) { RunKernelCase(4097, 1, true, 13); }        // one a thread
TEST(GradAccumulateCuda, CopyMatchesHostBitwiseUnaligned) { RunKernelCase(4097, 3, false, 14); }
TEST(GradAccumulateCuda, ShorterThanAVector) { RunKernelCase(5, 0, true, 15); }
TEST(GradAccumulateCuda, EmptyLaunchesNothing) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(LaunchGradAccumulate({nullptr, nullptr, 0, true}, nullptr).ok());
}
#endif

}  // namespace
}  // namespace rdep::optim
