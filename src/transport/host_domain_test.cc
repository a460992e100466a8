#include "rdep/transport/host_domain.h"

#include <gtest/gtest.h>

#include <chrono>

namespace rdep {
namespace {

TEST(HostDomain, PeerStoresAreVisibleAfterBarrier) {
  for (int W : {1, 2, 5, 16}) {
    auto d = HostDomain::Create(W, {});
    ASSERT_TRUE(d.ok());
    auto region = (*d)->AllocateSymmetric(sizeof(int64_t) * static_cast<size_t>(W), "slots");
    ASSERT_TRUE(region.ok());
    std::vector<int64_t> wrong(static_cast<size_t>(W), 0);
    Status s = (*d)->Run([&](int32_t r) -> Status {
      for (int round = 0; round < 20; ++round) {
        // Each rank writes (rank, round) into slot r of every peer, then reads all of its own slots.
        for (int32_t q = 0; q < W; ++q) (*d)->region_as<int64_t>(q, *region)[r] = r * 1000 + round;
        RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kTest));
        for (int32_t p = 0; p < W; ++p)
          if ((*d)->region_as<int64_t>(r, *region)[p] != p * 1000 + round) ++wrong[static_cast<size_t>(r)];
        RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kTest));
      }
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << s;
    for (auto w : wrong) EXPECT_EQ(w, 0);
  }
}

TEST(HostDomain, MissingRankTimesOutNamingRankAndPhase) {
  auto d = HostDomain::Create(4, {.barrier_timeout_s = 0.2});
  ASSERT_TRUE(d.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto all = (*d)->RunAll([&](int32_t r) -> Status {
    if (r == 2) return Status::Ok();  // rank 2 never arrives (a dead peer)
    return (*d)->Barrier(r, Phase::kDispatchCounts);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 5.0);
  for (int r : {0, 1, 3}) {
    const Status& s = all[static_cast<size_t>(r)];
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kTimeout);
    EXPECT_NE(s.message().find("dispatch.counts"), std::string::npos) << s;
    EXPECT_NE(s.message().find("no arrival from rank(s) 2"), std::string::npos) << s;
  }
  EXPECT_TRUE(all[2].ok());
}

TEST(HostDomain, FailedRankReleasesWaitersWithItsError) {
  auto d = HostDomain::Create(3, {.barrier_timeout_s = 60});
  ASSERT_TRUE(d.ok());
  const auto t0 = std::chrono::steady_clock::now();
  Status s = (*d)->Run([&](int32_t r) -> Status {
    if (r == 1) return InvalidArgument("x has the wrong shape");
    return (*d)->Barrier(r, Phase::kDispatchOffsets);
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rank 1: x has the wrong shape"), std::string::npos) << s;
  EXPECT_NE(s.message().find("2 other rank(s)"), std::string::npos) << s;
}

TEST(HostDomain, PhaseMismatchIsReported) {
  auto d = HostDomain::Create(2, {.barrier_timeout_s = 5});
  ASSERT_TRUE(d.ok());
  auto all = (*d)->RunAll([&](int32_t r) -> Status {
    return (*d)->Barrier(r, r == 0 ? Phase::kDispatchCounts : Phase::kReturnDone);
  });
  bool seen = false;
  for (const auto& s : all) seen |= s.message().find("phase mismatch") != std::string::npos;
  EXPECT_TRUE(seen);
}

TEST(HostDomain, ReusableAfterFailureAndRejectsBadOptions) {
  auto d = HostDomain::Create(2, {.barrier_timeout_s = 0.1});
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE((*d)->Run([&](int32_t r) -> Status { return r ? Status::Ok() : (*d)->Barrier(r, Phase::kTest); }).ok());
  EXPECT_TRUE((*d)->Run([&](int32_t r) -> Status { return (*d)->Barrier(r, Phase::kTest); }).ok());
  EXPECT_FALSE(HostDomain::Create(0, {}).ok());
  EXPECT_FALSE(HostDomain::Create(2, {.barrier_timeout_s = 0}).ok());
}

}  // namespace
}  // namespace rdep
