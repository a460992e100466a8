// The tile-streaming weight copy (rdep/dispatch/weight_stream.h) on the GPU: every destination holds
// exactly its job's source bytes, whatever the sizes (zero, sub-vector, tile edges), alignment,
// destination count, tile size and block count; bytes around every destination stay untouched.
// Skips without a GPU.
#include "rdep/dispatch/weight_stream.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace rdep::dispatch {
namespace {

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

constexpr int64_t kGuard = 64;         // poisoned bytes before and after every destination
constexpr unsigned char kPoison = 0xCD;

struct Layout {
  std::vector<int64_t> bytes;           // per job
  std::vector<int> dsts;                // destinations per job
  std::vector<int64_t> src_off, dst_off;  // byte offsets in the arenas (alignment variety)
};

// Runs one layout with fresh random sources and poisoned destinations; checks every byte.
void RunLayout(const Layout& l, int64_t tile, int blocks, uint32_t seed) {
  std::mt19937 rng(seed);
  int64_t src_total = 0, dst_total = 0;
  std::vector<int64_t> src_at, dst_at;
  for (size_t j = 0; j < l.bytes.size(); ++j) {
    src_at.push_back(src_total + l.src_off[j]);
    src_total += l.src_off[j] + l.bytes[j] + 32;
    for (int d = 0; d < l.dsts[j]; ++d) {
      dst_at.push_back(dst_total + kGuard + l.dst_off[j]);
      dst_total += kGuard + l.dst_off[j] + l.bytes[j] + kGuard;
    }
  }
  std::vector<unsigned char> src(static_cast<size_t>(src_total) + 1), dst(static_cast<size_t>(dst_total) + 1, kPoison);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  unsigned char *d_src = nullptr, *d_dst = nullptr;
  ASSERT_EQ(cudaMalloc(&d_src, src.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_dst, dst.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_src, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_dst, dst.data(), dst.size(), cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<StreamJob> jobs;
  size_t k = 0;
  int64_t written = 0;
  for (size_t j = 0; j < l.bytes.size(); ++j) {
    StreamJob job{d_src + src_at[j], l.bytes[j], {}};
    for (int d = 0; d < l.dsts[j]; ++d) job.dst.push_back(d_dst + dst_at[k++]);
    written += l.bytes[j] * l.dsts[j];
    jobs.push_back(job);
  }
  auto plan = StreamPlan::Create(jobs, tile);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->bytes_written(), written);
  ASSERT_TRUE(plan->Launch(nullptr, blocks).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<unsigned char> got(dst.size());
  ASSERT_EQ(cudaMemcpy(got.data(), d_dst, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  // Expected: poison everywhere except each destination, which holds its job's source.
  std::vector<unsigned char> want(dst.size(), kPoison);
  k = 0;
  for (size_t j = 0; j < l.bytes.size(); ++j)
    for (int d = 0; d < l.dsts[j]; ++d)
      std::memcpy(want.data() + dst_at[k++], src.data() + src_at[j], static_cast<size_t>(l.bytes[j]));
  size_t first_bad = want.size();
  for (size_t i = 0; i < want.size() && first_bad == want.size(); ++i)
    if (got[i] != want[i]) first_bad = i;
  EXPECT_EQ(first_bad, want.size()) << "first wrong byte at " << first_bad << " (tile " << tile << ", blocks " << blocks << ")";
  cudaFree(d_src);
  cudaFree(d_dst);
}

TEST(WeightStream, EveryDestinationGetsItsSourceExactly) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t T = 4096;
  Layout l;
  l.bytes = {0, 1, 15, 16, 17, T - 1, T, T + 1, 3 * T + 5, 1 << 20, 5 * T};
  l.dsts = {3, 1, 2, 3, 1, 7, 2, 0, 4, 3, 1};
  l.src_off = {0, 0, 3, 0, 1, 0, 16, 0, 5, 0, 0};   // some sources unaligned
  l.dst_off = {0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 1};    // some destinations unaligned
  for (int64_t tile : {int64_t{16}, T, int64_t{64 * 1024}})
    for (int blocks : {0, 1, 3}) RunLayout(l, tile, blocks, static_cast<uint32_t>(tile + blocks));
}

TEST(WeightStream, ExpertSizedJobsToManyReplicas) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  // Experts of 3*H*D_ff bf16 values at H = 256, D_ff = 176 (264 KiB), to 1..6 replicas.
  Layout l;
  for (int j = 0; j < 6; ++j) {
    l.bytes.push_back(3 * 256 * 176 * 2);
    l.dsts.push_back(j + 1);
    l.src_off.push_back(0);
    l.dst_off.push_back(0);
  }
  RunLayout(l, kDefaultStreamTileBytes, 0, 7);
}

TEST(WeightStream, BadPlansAreRejected) {
  std::vector<StreamJob> none;
  EXPECT_NE(StreamPlan::Create(none, 0).status().message().find("multiple of 16"), std::string::npos);
  EXPECT_NE(StreamPlan::Create(none, 24).status().message().find("multiple of 16"), std::string::npos);
  static unsigned char buf[32];
  std::vector<StreamJob> bad{{buf, 16, {nullptr}}};
  EXPECT_NE(StreamPlan::Create(bad, 16).status().message().find("destination 0 is null"), std::string::npos);
  std::vector<StreamJob> neg{{buf, -1, {}}};
  EXPECT_NE(StreamPlan::Create(neg, 16).status().message().find("negative"), std::string::npos);
  auto empty = StreamPlan::Create(none, 16);  // nothing to move: no device memory, Launch is a no-op
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->total_tiles(), 0);
  EXPECT_TRUE(empty->Launch(nullptr).ok());
}

}  // namespace
}  // namespace rdep::dispatch
