// The CUDA domain's barriers, with every rank on its own GPU (device barrier kernels), with ranks
// sharing a GPU (stream-ordered joins), and with ranks sharing a GPU through barrier kernels
// (CudaDomainOptions::kernel_barriers, so that one GPU tests the kernels): stores before a barrier are
// visible after it, a rank that never arrives gives a Timeout naming the rank and the phase (no hang),
// ranks sharing a GPU do not deadlock when one rank's thread synchronizes the whole device between
// barriers, and barriers captured in a CUDA graph synchronize in every replay.
#include "rdep/transport/cuda_domain.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "rdep/cuda/check.h"

namespace rdep {
namespace {

// Placements to test: every rank on its own GPU (when the machine has W), and all on GPU 0, with host joins
// or with barrier kernels.
struct Placement {
  const char* name;
  bool shared;
  bool kernel_barriers = false;
};
void PrintTo(const Placement& p, std::ostream* os) { *os << p.name; }

class CudaDomainBarrier : public ::testing::TestWithParam<Placement> {
 protected:
  StatusOr<std::unique_ptr<CudaDomain>> Make(int64_t W, double timeout_s) {
    const int n = cuda::DeviceCount();
    if (n == 0) return Unavailable("no CUDA device");
    if (!GetParam().shared && n < W) return Unavailable("needs " + std::to_string(W) + " CUDA devices");
    return CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = timeout_s,
                                               .devices = GetParam().shared ? RoundRobinDevices(W, 1) : std::vector<int>{},
                                               .kernel_barriers = GetParam().kernel_barriers});
  }
};

// One kTest barrier on every rank, each rank's stream synchronized after it.
Status BarrierOnEveryRank(CudaDomain& d) {
  return d.Run([&](int32_t r) -> Status {
    RDEP_RETURN_IF_ERROR(d.Barrier(r, Phase::kTest));
    return d.Synchronize(r);
  });
}

TEST_P(CudaDomainBarrier, W2_MissingRankTimesOutNamingRankAndPhase) {
  auto d = Make(2, 0.5);
  if (d.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << d.status().message();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->shares_gpus(), GetParam().shared);
  // One barrier that both ranks reach works.
  ASSERT_TRUE(BarrierOnEveryRank(**d).ok());
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

// Every rank stores into every peer, a barrier, every rank reads its slots; repeated so that each
// of the join's two events per rank is reused. Rank 0's thread synchronizes the whole device and
// frees memory between barriers (what a layer's buffer growth does), which deadlocks a spinning
// barrier kernel on a shared GPU.
TEST_P(CudaDomainBarrier, W4_StoresVisibleAfterBarrierWithDeviceSyncsBetween) {
  constexpr int32_t W = 4;
  if (GetParam().shared && GetParam().kernel_barriers)
    GTEST_SKIP() << "a whole-device synchronize between barrier kernels on one GPU waits for peers' spinning barriers";
  auto d = Make(W, 5.0);
  if (d.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << d.status().message();
  ASSERT_TRUE(d.ok()) << d.status();
  auto region = (*d)->AllocateSymmetric(sizeof(int64_t) * W, "smoke");
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<int64_t> wrong(W, 0);
  Status s = (*d)->Run([&](int32_t r) -> Status {
    for (int round = 0; round < 5; ++round) {
      int64_t* mine = static_cast<int64_t*>((*d)->region(r, *region));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(mine, 0xFF, sizeof(int64_t) * W, (*d)->stream(r)));  // poison
      RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kTest));  // every rank poisoned before anyone stores
      if (r == 0) {
        void* p = nullptr;
        RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, 1 << 20));
        RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
        RDEP_CUDA_RETURN_IF_ERROR(cudaFree(p));
      }
      RDEP_RETURN_IF_ERROR(LaunchSmokeStore((*d)->peer_table(r, *region), r, W, (*d)->stream(r)));
      RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kSmoke));
      RDEP_RETURN_IF_ERROR((*d)->Synchronize(r));
      std::vector<int64_t> got(W);
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(got.data(), mine, sizeof(int64_t) * W, cudaMemcpyDeviceToHost));
      for (int32_t p = 0; p < W; ++p) wrong[static_cast<size_t>(r)] += got[static_cast<size_t>(p)] != 1000 * p + r;
      RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kTest));  // every rank read before the next poison
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int32_t r = 0; r < W; ++r) EXPECT_EQ(wrong[static_cast<size_t>(r)], 0) << "rank " << r;
}

void CUDART_CB SleepTwoMs(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }

// Rank 1, held back 2 ms by a host node, copies a value into rank 0's slot; a barrier; rank 0 copies its slot
// out; a second barrier. Captured once through BeginCapture / EndCapture and replayed three times, each on a
// new value with rank 0's slot and output poisoned: rank 0 must read each replay's value. A barrier that
// repeated the epochs captured (the host's) would let every replay after the first read the poison.
TEST_P(CudaDomainBarrier, W2_CapturedBarriersSynchronizeInEveryReplay) {
  constexpr int32_t W = 2;
  auto d = Make(W, 5.0);
  if (d.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << d.status().message();
  ASSERT_TRUE(d.ok()) << d.status();
  auto slot = (*d)->AllocateSymmetric(sizeof(int64_t) * 2, "slot");  // [0] rank 0's slot, [1] its output
  ASSERT_TRUE(slot.ok()) << slot.status();
  auto* value = static_cast<int64_t*>((*d)->region(1, *slot)) + 1;  // rank 1's source
  auto* target = static_cast<int64_t*>((*d)->region(0, *slot));
  cudaGraph_t graph = nullptr;
  Status s = (*d)->Run([&](int32_t r) -> Status {
    cudaStream_t st = (*d)->stream(r);
    RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kTest));  // eager barriers first: the epochs go on from there
    RDEP_RETURN_IF_ERROR((*d)->Synchronize(r));
    RDEP_RETURN_IF_ERROR((*d)->BeginCapture(r));
    Status work = Status::Ok();
    if (r == 1) {
      work = cuda::CudaStatus(cudaLaunchHostFunc(st, SleepTwoMs, nullptr), "cudaLaunchHostFunc", __FILE__, __LINE__);
      if (work.ok())
        work = cuda::CudaStatus(cudaMemcpyAsync(target, value, sizeof(int64_t), cudaMemcpyDefault, st), "cudaMemcpyAsync",
                                __FILE__, __LINE__);
    }
    if (work.ok()) work = (*d)->Barrier(r, Phase::kSmoke);
    if (work.ok() && r == 0)
      work = cuda::CudaStatus(cudaMemcpyAsync(target + 1, target, sizeof(int64_t), cudaMemcpyDefault, st), "cudaMemcpyAsync",
                              __FILE__, __LINE__);
    if (work.ok()) work = (*d)->Barrier(r, Phase::kTest);
    auto g = (*d)->EndCapture(r);
    RDEP_RETURN_IF_ERROR(work);
    RDEP_RETURN_IF_ERROR(g.status());
    if (*g) graph = *g;
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_NE(graph, nullptr);
  const int32_t first = (*d)->local_ranks().front();
  ASSERT_EQ(cudaSetDevice((*d)->device(first)), cudaSuccess);  // the graph is launched on the first rank's stream
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cudaGraphDestroy(graph);
  std::unique_ptr<CUgraphExec_st, decltype(&cudaGraphExecDestroy)> exec_owner(exec, &cudaGraphExecDestroy);
  // With barrier kernels on one GPU this relies on the graph running the two ranks' branches at once (CUDA
  // does not promise it): otherwise the barriers time out (5 s) and the test fails rather than hangs.
  for (int64_t k = 0; k < 3; ++k) {
    const int64_t want = 100 + k, poison[2] = {-1, -1};
    ASSERT_EQ(cudaMemcpy(value, &want, sizeof(want), cudaMemcpyDefault), cudaSuccess);  // synchronous copies
    ASSERT_EQ(cudaMemcpy(target, poison, sizeof(poison), cudaMemcpyDefault), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, (*d)->stream(first)), cudaSuccess);
    ASSERT_TRUE((*d)->Synchronize(first).ok());
    for (int32_t q = 0; q < W; ++q) ASSERT_TRUE((*d)->CheckErrors(q).ok()) << (*d)->CheckErrors(q) << " replay " << k;
    int64_t seen[2] = {0, 0};
    ASSERT_EQ(cudaMemcpy(seen, target, sizeof(seen), cudaMemcpyDefault), cudaSuccess);
    EXPECT_EQ(seen[1], want) << "replay " << k << ": rank 0 read its slot before rank 1's copy arrived";
  }
  exec_owner.reset();
  // Eager barriers after the replays still meet (the epochs counted on the device agree across ranks).
  const Status after = BarrierOnEveryRank(**d);
  EXPECT_TRUE(after.ok()) << after;
}

// The child of W2_CapturedBarrierThatFailsTrapsAfterItsRecord: one graph of both ranks' work in which only rank 0
// recorded a barrier, replayed. Rank 0's barrier times out (0.2 s) in the replay, writes its record and traps. Prints
// the synchronization's error and the record's message; exits 3 when both say it failed, 4 otherwise, 5 on set-up.
[[noreturn]] void ExitWith(int code, const std::string& what) {
  std::fprintf(stderr, "%s\n", what.c_str());
  std::fflush(stderr);
  std::_Exit(code);  // no teardown of a stopped CUDA context
}

[[noreturn]] void ReplayOneSidedBarrier(const Placement& placement) {
  auto d = CudaDomain::CreateSingleProcess(2, {.barrier_timeout_s = 0.2,
                                               .devices = placement.shared ? RoundRobinDevices(2, 1) : std::vector<int>{},
                                               .kernel_barriers = placement.kernel_barriers});
  if (!d.ok()) ExitWith(5, d.status().ToString());
  cudaGraph_t graph = nullptr;
  const Status s = (*d)->Run([&](int32_t r) -> Status {
    RDEP_RETURN_IF_ERROR((*d)->BeginCapture(r));
    const Status work = r == 0 ? (*d)->Barrier(r, Phase::kSmoke) : Status::Ok();
    auto g = (*d)->EndCapture(r);
    RDEP_RETURN_IF_ERROR(work);
    RDEP_RETURN_IF_ERROR(g.status());
    if (*g) graph = *g;
    return Status::Ok();
  });
  if (!s.ok() || graph == nullptr) ExitWith(5, "capture: " + s.ToString());
  const int32_t first = (*d)->local_ranks().front();
  cudaGraphExec_t exec = nullptr;
  if (cudaSetDevice((*d)->device(first)) != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess ||
      cudaGraphLaunch(exec, (*d)->stream(first)) != cudaSuccess)
    ExitWith(5, "launch failed");
  const cudaError_t synced = cudaStreamSynchronize((*d)->stream(first));
  const Status record = (*d)->CheckErrors(0);
  ExitWith(synced != cudaSuccess && !record.ok() ? 3 : 4,
       std::string("replay: ") + cudaGetErrorName(synced) + "; rank 0's record: " + record.ToString());
}

// A barrier kernel recorded in a CUDA graph traps when it fails (here a timeout: rank 1 recorded no barrier), after
// writing its record: no host call follows a replay to report the record, and the replay must not go on without
// the peer. The CUDA context stops, so the replay runs in a child process (a death test, re-executed: "threadsafe").
TEST_P(CudaDomainBarrier, W2_CapturedBarrierThatFailsTrapsAfterItsRecord) {
  if (GetParam().shared && !GetParam().kernel_barriers) GTEST_SKIP() << "host joins: captured, a join is a graph edge";
  auto d = Make(2, 0.2);  // only to skip where the placement is missing; the child makes its own
  if (d.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << d.status().message();
  ASSERT_TRUE(d.ok()) << d.status();
  d->reset();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(ReplayOneSidedBarrier(GetParam()), ::testing::ExitedWithCode(3),
              "replay: cuda.*; rank 0's record: .*device barrier 'smoke' \\(#1\\) timed out after 0.2 s; no arrival from rank\\(s\\) 1");
}

// Barrier kernels whose epoch counts diverged (rank 1 ran three barriers rank 0 never joined, each timing out)
// report it at rank 0's next barrier, naming the peer and both epochs, instead of passing it.
TEST_P(CudaDomainBarrier, W2_DivergedEpochsAreReportedNotPassed) {
  if (GetParam().shared && !GetParam().kernel_barriers) GTEST_SKIP() << "host joins count no device epochs";
  auto d = Make(2, 0.2);
  if (d.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << d.status().message();
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(BarrierOnEveryRank(**d).ok());
  const Status ahead = (*d)->Run([&](int32_t r) -> Status {
    if (r == 0) return Status::Ok();
    for (int i = 0; i < 3; ++i) RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kSmoke));
    return (*d)->Synchronize(r);
  });
  EXPECT_EQ(ahead.code(), StatusCode::kTimeout) << ahead;
  const Status behind = (*d)->Run([&](int32_t r) -> Status {
    if (r == 1) return Status::Ok();
    RDEP_RETURN_IF_ERROR((*d)->Barrier(r, Phase::kTest));
    return (*d)->Synchronize(r);
  });
  EXPECT_EQ(behind.code(), StatusCode::kInternal) << behind;
  EXPECT_NE(behind.message().find("epochs diverged, rank 1 is at #4"), std::string::npos) << behind;
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaDomainBarrier,
                         ::testing::Values(Placement{"own_gpus", false}, Placement{"shared_gpu", true},
                                           Placement{"shared_gpu_kernels", true, true}),
                         [](const ::testing::TestParamInfo<Placement>& i) { return std::string(i.param.name); });

TEST(CudaDomain_Create, RejectsMoreRanksThanGpusWithoutAPlacement) {
  const int n = cuda::DeviceCount();
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  auto d = CudaDomain::CreateSingleProcess(n + 1);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("this machine has " + std::to_string(n)), std::string::npos) << d.status();
  EXPECT_NE(d.status().message().find("--gpus"), std::string::npos) << d.status();
}

TEST(CudaDomain_Create, RejectsBadWidthsAndDevices) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (int64_t W : {int64_t{0}, kMaxCudaRanks + 1}) {
    auto d = CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = 1, .devices = RoundRobinDevices(W, 1)});
    ASSERT_FALSE(d.ok()) << "W=" << W;
    EXPECT_NE(d.status().message().find("ranks W must be in"), std::string::npos) << d.status();
  }
  auto d = CudaDomain::CreateSingleProcess(2, {.barrier_timeout_s = 1, .devices = {0, cuda::DeviceCount()}});
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("does not exist"), std::string::npos) << d.status();
}

TEST(CudaDomain_Placement, SaysWhenRanksShareAGpu) {
  EXPECT_EQ(RoundRobinDevices(5, 2), (std::vector<int>{0, 1, 0, 1, 0}));
  EXPECT_TRUE(RoundRobinDevices(3, 0).empty());
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto d = CudaDomain::CreateSingleProcess(3, {.barrier_timeout_s = 1, .devices = RoundRobinDevices(3, 1)});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->placement(), "3 ranks on 1 GPU (GPU 0: ranks 0,1,2); ranks share GPUs: timings do not measure NVLink");
}

}  // namespace
}  // namespace rdep
