// The Domain interface over every implementation this machine has: host threads always; a CUDA
// domain of 3 ranks over the GPUs present (sharing them when fewer) when there is one. Through the
// base class alone: regions and their sizes, and (host) each rank writes its slot in every peer's
// region, a barrier, each rank reads its slots back; on every kind a rank that never arrives is a
// Timeout naming it and the phase. Bad specs name the field.
#include "rdep/transport/domain.h"

#include <gtest/gtest.h>

#include <cstring>

#include "rdep/cuda/device_count.h"

namespace rdep {
namespace {


class DomainKinds : public ::testing::TestWithParam<DomainSpec::Kind> {};

TEST_P(DomainKinds, W3_RegionsAndBarriersThroughTheInterface) {
  DomainSpec spec{.kind = GetParam(), .num_ranks = 3, .barrier_timeout_s = 0.5, .num_gpus = 0, .bootstrap = nullptr};
  if (spec.kind != DomainSpec::Kind::kHost && CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto d = MakeDomain(spec);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->num_ranks(), 3);
  EXPECT_EQ((*d)->local_ranks(), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FALSE((*d)->placement().empty());
  auto region = (*d)->AllocateSymmetric(3 * sizeof(int64_t), "test");
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_GE((*d)->symmetric_bytes_per_rank(), 3 * sizeof(int64_t));
  if (spec.kind == DomainSpec::Kind::kHost) {
    std::vector<int64_t> wrong(3, 0);
    Status s = (*d)->Run([&](int32_t r) -> Status {
      for (int32_t q = 0; q < 3; ++q) static_cast<int64_t*>((*d)->region_base(q, *region))[r] = 100 * r + q;
      RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kTest));
      const auto* mine = static_cast<const int64_t*>((*d)->region_base(r, *region));
      for (int32_t p = 0; p < 3; ++p) wrong[static_cast<size_t>(r)] += mine[p] != 100 * p + r;
      return Status::Ok();
    });
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t w : wrong) EXPECT_EQ(w, 0);
  }
  // A rank that never arrives: a Timeout naming it and the phase, on every implementation.
  Status s = (*d)->Run([&](int32_t r) -> Status {
    if (r == 2) return Status::Ok();
    RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kDispatchCounts));
    return (*d)->Synchronize(r);  // a device barrier reports here
  });
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s;
  EXPECT_NE(s.message().find("dispatch.counts"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rank(s) 2"), std::string::npos) << s;
  (*d)->FreeSymmetric(*region);
}

// Shared regions: the same (name, bytes) is one region counted per holder, freed with the last one;
// another size or name is another region.
TEST_P(DomainKinds, SharedRegionsAreCountedPerHolder) {
  DomainSpec spec{.kind = GetParam(), .num_ranks = 2, .barrier_timeout_s = 1, .num_gpus = 0, .bootstrap = nullptr};
  if (spec.kind != DomainSpec::Kind::kHost && CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto d = std::move(*MakeDomain(spec));
  const size_t base = d->symmetric_bytes_per_rank();
  auto a = d->AcquireShared("slots", 1024);
  auto b = d->AcquireShared("slots", 1024);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(d->shared_holders(*a), 2);
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base + 1024);
  auto c = d->AcquireShared("slots", 2048), e = d->AcquireShared("grads", 1024);
  ASSERT_TRUE(c.ok() && e.ok());
  EXPECT_NE(*c, *a);
  EXPECT_NE(*e, *a);
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base + 1024 + 2048 + 1024);
  EXPECT_EQ(d->shared_bytes_per_rank(), 1024u + 2048u + 1024u);  // "slots" 1024 once, for its two holders
  d->ReleaseShared(*a);
  EXPECT_EQ(d->shared_holders(*a), 1);
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base + 1024 + 2048 + 1024);
  d->ReleaseShared(*b);
  EXPECT_EQ(d->shared_holders(*a), 0);
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base + 2048 + 1024);
  d->ReleaseShared(*c);
  d->ReleaseShared(*e);
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base);
  EXPECT_EQ(d->shared_bytes_per_rank(), 0u);
  auto again = d->AcquireShared("slots", 1024);  // a fresh region after the last holder left
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(d->shared_holders(*again), 1);
  d->ReleaseShared(*again);
}

INSTANTIATE_TEST_SUITE_P(All, DomainKinds, ::testing::Values(DomainSpec::Kind::kHost, DomainSpec::Kind::kCudaOneProcess),
                         [](const ::testing::TestParamInfo<DomainSpec::Kind>& i) {
                           return std::string(i.param == DomainSpec::Kind::kHost ? "host" : "cuda_one_process");
                         });

TEST(MakeDomain, BadSpecsNameTheField) {
  auto bad_timeout = MakeDomain({.kind = DomainSpec::Kind::kHost, .num_ranks = 2, .barrier_timeout_s = 0, .num_gpus = 0, .bootstrap = nullptr});
  EXPECT_NE(bad_timeout.status().message().find("barrier_timeout_s"), std::string::npos) << bad_timeout.status();
  auto bad_w = MakeDomain({.kind = DomainSpec::Kind::kHost, .num_ranks = 0, .barrier_timeout_s = 1, .num_gpus = 0, .bootstrap = nullptr});
  EXPECT_FALSE(bad_w.ok());
  auto no_boot = MakeDomain({.kind = DomainSpec::Kind::kCudaPerProcess, .num_ranks = 2, .barrier_timeout_s = 1, .num_gpus = 0, .bootstrap = nullptr});
  ASSERT_FALSE(no_boot.ok());
  if (CudaDeviceCount() > 0 || no_boot.status().code() == StatusCode::kInvalidArgument)
    EXPECT_NE(no_boot.status().message().find("bootstrap"), std::string::npos) << no_boot.status();
  else
    EXPECT_EQ(no_boot.status().code(), StatusCode::kUnavailable) << no_boot.status();
  if (CudaDeviceCount() > 0) {
    auto too_many = MakeDomain({.kind = DomainSpec::Kind::kCudaOneProcess, .num_ranks = 2, .barrier_timeout_s = 1,
                                .num_gpus = CudaDeviceCount() + 1, .bootstrap = nullptr});
    EXPECT_NE(too_many.status().message().find("num_gpus"), std::string::npos) << too_many.status();
  }
}

}  // namespace
}  // namespace rdep
