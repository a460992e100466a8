// The CUDA domain's device barrier: a rank that never arrives makes the waiting rank's barrier kernel
// give up after the bound and report the missing rank and the phase (no hang). Needs 2 GPUs.
#include "rdep/transport/cuda_domain.h"

#include <gtest/gtest.h>

#include <chrono>

#include "rdep/cuda/check.h"

namespace rdep {
namespace {

TEST(CudaDomain_Barrier, W2_MissingRankTimesOutNamingRankAndPhase) {
  if (cuda::DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  auto d = CudaDomain::CreateSingleProcess(2, {.barrier_timeout_s = 0.5, .devices = {}});
  ASSERT_TRUE(d.ok()) << d.status();
  // One barrier that both ranks reach works.
  ASSERT_TRUE((*d)->Run([&](int32_t r) -> Status {
                     RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kTest));
                     return (*d)->Synchronize(r);
                   }).ok());
  const auto t0 = std::chrono::steady_clock::now();
  Status s = (*d)->Run([&](int32_t r) -> Status {
    if (r == 1) return Status::Ok();  // rank 1 never arrives at the next barrier
    RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kDispatchOffsets));
    return (*d)->Synchronize(r);
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s;
  EXPECT_NE(s.message().find("dispatch.offsets"), std::string::npos) << s;
  EXPECT_NE(s.message().find("no arrival from rank(s) 1"), std::string::npos) << s;
}

TEST(CudaDomain_Create, RejectsMoreRanksThanGpus) {
  const int n = cuda::DeviceCount();
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  auto d = CudaDomain::CreateSingleProcess(n + 1);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("this machine has " + std::to_string(n)), std::string::npos) << d.status();
}

}  // namespace
}  // namespace rdep
