// LaunchPeerRowsCopy (the transport's floor in rdep bench dispatch) on the GPU, bitwise: each destination receives
// its run of source rows in order and nothing past it (destinations poisoned first), destinations without rows
// are left alone, and the 16-byte and 2-byte row paths both copy. With two GPUs one destination is on the other
// GPU (peer access). Bad arguments are refused naming the field. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "experts/experts_test_util.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/peer_rows_copy.h"

namespace rdep::dispatch {
namespace {

using kernels::test_util::Dev;
using kernels::test_util::RandomBf16;

void CheckCopy(int64_t H, bool across_gpus) {
  const std::vector<int64_t> rows = {5, 0, 130, 1};  // per destination, one without rows
  const int64_t slack = 3;                           // poisoned rows past each destination's run
  PeerRowsCopy c;
  c.num_destinations = static_cast<int32_t>(rows.size());
  for (size_t q = 0; q < rows.size(); ++q) c.begin[q + 1] = c.begin[q] + rows[q];
  const int64_t total = c.begin[rows.size()];
  const std::vector<uint16_t> src_h = RandomBf16(static_cast<size_t>(total * H), 11 + static_cast<uint64_t>(H), 2.f);
  Dev<uint16_t> src(src_h.size());
  src.Upload(src_h);
  std::vector<std::unique_ptr<Dev<uint16_t>>> dst;
  for (size_t q = 0; q < rows.size(); ++q) {
    const bool other = across_gpus && q == 2;
    if (other) {
      ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    }
    dst.push_back(std::make_unique<Dev<uint16_t>>(static_cast<size_t>((rows[q] + slack) * H)));
    dst.back()->Poison();
    if (other) {
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    }
    c.dst[q] = dst.back()->p;
  }
  const Status st = LaunchPeerRowsCopy(src.p, c, H, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t q = 0; q < rows.size(); ++q) {
    const std::vector<uint16_t> got = dst[q]->Download();
    for (int64_t r = 0; r < rows[q] + slack; ++r)
      for (int64_t j = 0; j < H; ++j) {
        const uint16_t want = r < rows[q] ? src_h[static_cast<size_t>((c.begin[q] + r) * H + j)] : uint16_t{0xFFFF};
        ASSERT_EQ(got[static_cast<size_t>(r * H + j)], want) << "destination " << q << " row " << r << " column " << j;
      }
  }
}

TEST(PeerRowsCopy, EachDestinationGetsItsRowsInOrder) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  for (const int64_t H : {2048, 40, 36}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    CheckCopy(H, false);
  }
}

TEST(PeerRowsCopy, IntoAnotherGpu) {
  if (cuda::DeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  int can = 0;
  ASSERT_EQ(cudaDeviceCanAccessPeer(&can, 0, 1), cudaSuccess);
  if (!can) GTEST_SKIP() << "GPU 0 cannot store into GPU 1";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const cudaError_t e = cudaDeviceEnablePeerAccess(1, 0);
  ASSERT_TRUE(e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled) << cudaGetErrorString(e);
  cudaGetLastError();
  CheckCopy(2048, true);
}

TEST(PeerRowsCopy, RefusesBadArgumentsNamingTheField) {
  uint16_t* fake = reinterpret_cast<uint16_t*>(uintptr_t{256});  // never dereferenced: every call below is refused
  auto refused = [&](PeerRowsCopy c, int64_t H, const uint16_t* src, const std::string& field) {
    const Status st = LaunchPeerRowsCopy(src, c, H, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(st.message().find(field), std::string::npos) << st;
  };
  PeerRowsCopy c;
  c.num_destinations = 9;
  refused(c, 8, fake, "num_destinations=9");
  c.num_destinations = 2;
  c.dst[0] = c.dst[1] = fake;
  c.begin[1] = 4;
  c.begin[2] = 3;
  refused(c, 8, fake, "begin[2]=3");
  c.begin[2] = 6;
  refused(c, 0, fake, "H=0");
  refused(c, 8, nullptr, "src is null");
  c.dst[1] = nullptr;
  refused(c, 8, fake, "dst[1] is null");
  c.begin[0] = 1;
  refused(c, 8, fake, "begin[0]=1");
}

}  // namespace
}  // namespace rdep::dispatch
