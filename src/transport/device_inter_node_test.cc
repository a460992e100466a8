// The device inter-node exchanges (device_inter_node.h). Every rank receives, from every node,
// exactly the bytes the rank with its local index there sent it: sentinel words encode (round,
// source rank, destination node, word index), receive slots are poisoned first and followed by a
// poisoned guard, sizes vary with zero bytes to some nodes, rounds reuse the buffers, alternate the
// domain's stream with a stream of the rank's own, and learn their sizes through ExchangeCounts.
// device-copy: W = N*G ranks sharing one GPU, N in {2,3,4} x G in {1,2,4}, and W = 4 over two GPUs
// where there are two. nccl: every rank on its
// own GPU (skips, saying how many GPUs it needs, on a smaller machine). Also: the chooser, the
// placements each implementation refuses, bad input named. Without a GPU only the buffer checks run.
//   ctest --test-dir build -R 'DeviceInterNode|DeviceCopyInterNode|NcclInterNode' --output-on-failure
#include "rdep/transport/device_inter_node.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "rdep/cuda/check.h"
#include "transport/device_inter_node_internal.h"

namespace rdep {
namespace {

constexpr int64_t kMaxWords = 300;    // the longest message, in 32-bit words
constexpr int64_t kGuardWords = 16;   // poisoned words after each receive slot
constexpr int64_t kSlotWords = kMaxWords + kGuardWords;
constexpr uint32_t kPoison = 0xEEEEEEEEu;  // round 14: never a sentinel
constexpr int kRounds = 3;                 // rounds 1..3

// Words rank `src` sends to node `dst` in round `round`: none for about a quarter of the pairs.
int64_t Words(int32_t src, int32_t dst, int round) {
  if ((src * 5 + dst * 3 + round) % 4 == 0) return 0;
  return 1 + (src * 13 + dst * 7 + round * 11) % kMaxWords;
}

// Word i of that message: round (4 bits) | source rank (8) | destination node (4) | index (16).
uint32_t Sentinel(int round, int32_t src, int32_t dst, int64_t i) {
  return (static_cast<uint32_t>(round) << 28) | (static_cast<uint32_t>(src) << 20) | (static_cast<uint32_t>(dst) << 16) |
         static_cast<uint32_t>(i);
}

std::string Hex(uint32_t v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", v);
  return s;
}

// Device memory of the calling thread's current GPU, freed on scope exit.
struct DeviceBuffer {
  void* p = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p != nullptr) cudaFree(p);
  }
  Status Allocate(size_t bytes) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
    return Status::Ok();
  }
  uint32_t* words() const { return static_cast<uint32_t*>(p); }
};

struct OwnStream {
  cudaStream_t s = nullptr;
  OwnStream() = default;
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  ~OwnStream() {
    if (s != nullptr) cudaStreamDestroy(s);
  }
};

// One rank's part of kRounds exchanges through x, each checked word by word. Round 1 learns its
// receive sizes through ExchangeCounts; round 2 runs on a stream of the rank's own. A wrong size or
// word is recorded and the rank goes on with every round, so that its peers' sends and receives
// still find theirs (an early return would leave them blocked in NCCL); the first one is returned.
Status ExchangeAndCheck(CudaDomain& d, DeviceInterNodeExchange& x, int32_t rank) {
  const int32_t N = x.num_nodes(), G = x.ranks_per_node(), node = rank / G, local = rank % G;
  const auto n = static_cast<size_t>(N);
  DeviceBuffer send_arena, recv_arena;  // send: N slots of kMaxWords; recv: N slots of kSlotWords
  RDEP_RETURN_IF_ERROR(send_arena.Allocate(sizeof(uint32_t) * n * kMaxWords));
  RDEP_RETURN_IF_ERROR(recv_arena.Allocate(sizeof(uint32_t) * n * kSlotWords));
  OwnStream own;
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&own.s, cudaStreamNonBlocking));
  const std::string who = "rank " + std::to_string(rank) + " (node " + std::to_string(node) + ")";
  Status first_wrong = Status::Ok();
  for (int round = 1; round <= kRounds; ++round) {
    const cudaStream_t stream = round == 2 ? own.s : d.stream(rank);
    std::vector<uint32_t> host(n * kMaxWords, 0);
    std::vector<const void*> send(n, nullptr);
    std::vector<void*> recv(n, nullptr);
    std::vector<int64_t> send_bytes(n), recv_bytes(n), expect_bytes(n);
    for (int32_t b = 0; b < N; ++b) {
      const auto q = static_cast<size_t>(b);
      const int64_t w = Words(rank, b, round);
      for (int64_t i = 0; i < w; ++i) host[q * kMaxWords + static_cast<size_t>(i)] = Sentinel(round, rank, b, i);
      send_bytes[q] = w * 4;
      if (w > 0) send[q] = send_arena.words() + q * kMaxWords;  // null where nothing is sent
      expect_bytes[q] = Words(b * G + local, node, round) * 4;
      recv[q] = recv_arena.words() + q * kSlotWords;
    }
    // The previous round's readers of send_arena are done: this rank synchronized after its second
    // barrier (device-copy) or its sends completed on its stream (nccl). The fill is ordered on
    // `stream` (a plain cudaMemcpy may return before its DMA lands, and is not ordered with it).
    RDEP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(send_arena.p, host.data(), sizeof(uint32_t) * host.size(), cudaMemcpyHostToDevice, stream));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(recv_arena.p, 0xEE, sizeof(uint32_t) * n * kSlotWords, stream));
    if (round == 1) {
      RDEP_RETURN_IF_ERROR(x.ExchangeCounts(rank, send_bytes, recv_bytes, stream));
      if (recv_bytes != expect_bytes && first_wrong.ok())
        first_wrong = InternalError(who + ": ExchangeCounts returned other sizes than were sent");
    }
    recv_bytes = expect_bytes;  // round 1: what ExchangeCounts gave, unless it was wrong
    RDEP_RETURN_IF_ERROR(x.AllToAllV(rank, {send, send_bytes, recv, recv_bytes}, stream));
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    RDEP_RETURN_IF_ERROR(d.Synchronize(rank));
    std::vector<uint32_t> got(n * kSlotWords);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(got.data(), recv_arena.p, sizeof(uint32_t) * got.size(), cudaMemcpyDeviceToHost));
    int64_t wrong = 0;
    std::string first;
    for (int32_t a = 0; a < N; ++a) {
      const int32_t from = a * G + local;
      const int64_t w = Words(from, node, round);
      for (int64_t i = 0; i < kSlotWords; ++i) {
        const uint32_t want = i < w ? Sentinel(round, from, node, i) : kPoison;
        const uint32_t v = got[static_cast<size_t>(a) * kSlotWords + static_cast<size_t>(i)];
        if (v == want) continue;
        if (wrong++ == 0)
          first = "word " + std::to_string(i) + " from node " + std::to_string(a) + " (rank " + std::to_string(from) +
                  ", " + std::to_string(w) + " words sent) is " + Hex(v) + ", expected " + Hex(want);
      }
    }
    if (wrong > 0 && first_wrong.ok())
      first_wrong = InternalError(who + " round " + std::to_string(round) + ": " + std::to_string(wrong) + " wrong words; " + first);
  }
  return first_wrong;
}

bool HaveGpu() { return cuda::DeviceCount() > 0; }
#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device: this test needs 1 GPU (the ranks share it)"

StatusOr<std::unique_ptr<CudaDomain>> OnOneGpu(int64_t W, double timeout_s = 60) {
  return CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = timeout_s, .devices = RoundRobinDevices(W, 1)});
}

// ---- the buffer checks (host only) ------------------------------------------------------------------

void* Fake(uintptr_t v) { return reinterpret_cast<void*>(v); }

// Buffers for N = 2 nodes, checked as rank 3 of G = 2 (node 1).
struct Call {
  std::vector<const void*> send{Fake(0x1000), Fake(0x2000)};
  std::vector<int64_t> send_bytes{64, 16};
  std::vector<void*> recv{Fake(0x3000), Fake(0x4000)};
  std::vector<int64_t> recv_bytes{32, 16};
  std::string Check() const {
    return internal::CheckDeviceExchange({send, send_bytes, recv, recv_bytes}, 3, 2, 2, "nccl").message();
  }
};

TEST(DeviceInterNodeCheck, GoodBuffersPassAndNullIsFineForZeroBytes) {
  Call c;
  EXPECT_EQ(c.Check(), "");
  c.send[0] = nullptr;
  c.send_bytes[0] = 0;
  c.recv[0] = nullptr;
  c.recv_bytes[0] = 0;
  EXPECT_EQ(c.Check(), "");
}

TEST(DeviceInterNodeCheck, WrongNumberOfBuffersIsNamed) {
  const std::string where = "inter-node exchange (nccl) on rank 3 (node 1): ";
  Call c;
  c.send.push_back(Fake(0x5000));
  EXPECT_EQ(c.Check(), where + "3 send buffers for N=2 nodes (one per node)");
  c = Call{};
  c.send_bytes.pop_back();
  EXPECT_EQ(c.Check(), where + "1 send_bytes entries for N=2 nodes (one per node)");
  c = Call{};
  c.recv.clear();
  EXPECT_EQ(c.Check(), where + "0 recv buffers for N=2 nodes (one per node)");
  c = Call{};
  c.recv_bytes.push_back(0);
  EXPECT_EQ(c.Check(), where + "3 recv_bytes entries for N=2 nodes (one per node)");
}

TEST(DeviceInterNodeCheck, NegativeSizesAndNullPointersAreNamed) {
  const std::string where = "inter-node exchange (nccl) on rank 3 (node 1): ";
  Call c;
  c.send_bytes[0] = -5;
  EXPECT_EQ(c.Check(), where + "send_bytes[0] = -5 is negative");
  c = Call{};
  c.recv_bytes[0] = -1;
  EXPECT_EQ(c.Check(), where + "recv_bytes[0] = -1 is negative");
  c = Call{};
  c.send[0] = nullptr;
  EXPECT_EQ(c.Check(), where + "send[0] is null with send_bytes[0] = 64");
  c = Call{};
  c.recv[1] = nullptr;
  EXPECT_EQ(c.Check(), where + "recv[1] is null with recv_bytes[1] = 16");
}

TEST(DeviceInterNodeCheck, OwnNodeSizesMustAgree) {
  Call c;
  c.recv_bytes[1] = 8;  // rank 3 is on node 1
  EXPECT_EQ(c.Check(), "inter-node exchange (nccl) on rank 3 (node 1): recv_bytes[1] = 8 differs from send_bytes[1] = 16 "
                       "for its own node (a rank receives from itself what it sends itself)");
}

// ---- device-copy: W = N*G ranks on one GPU ---------------------------------------------------------

using NodesAndRanks = std::tuple<int32_t, int32_t>;  // (N, G)
std::string ShapeName(const ::testing::TestParamInfo<NodesAndRanks>& info) {
  const auto [N, G] = info.param;
  return "N" + std::to_string(N) + "_G" + std::to_string(G) + "_W" + std::to_string(N * G);
}

class DeviceCopyInterNode : public ::testing::TestWithParam<NodesAndRanks> {};

TEST_P(DeviceCopyInterNode, SentinelsArriveExactlyOnOneGpu) {
  SKIP_WITHOUT_GPU();
  const auto [N, G] = GetParam();
  auto d = OnOneGpu(N * G);
  ASSERT_TRUE(d.ok()) << d.status();
  auto x = MakeDeviceInterNodeExchange(**d, NodeConfig{.nodes = N});
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_STREQ((*x)->name(), "device-copy") << (*x)->description();
  EXPECT_EQ((*x)->num_nodes(), N);
  EXPECT_EQ((*x)->ranks_per_node(), G);
  Status s = (*d)->Run([&](int32_t r) { return ExchangeAndCheck(**d, **x, r); });
  EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceCopyInterNode,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values(1, 2, 4)), ShapeName);

// Ranks spread over two GPUs (two per GPU): the copies cross devices (peer copies, cross-device
// event waits). Skips on a one-GPU machine.
TEST(DeviceCopyInterNodeTwoGpus, SentinelsArriveExactlyAcrossDevices) {
  if (cuda::DeviceCount() < 2) GTEST_SKIP() << "needs 2 GPUs, this machine has " << cuda::DeviceCount();
  for (const auto& [N, G] : {NodesAndRanks{2, 2}, NodesAndRanks{4, 1}}) {
    const int64_t W = N * G;
    auto d = CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = 60, .devices = RoundRobinDevices(W, 2)});
    ASSERT_TRUE(d.ok()) << d.status();
    auto x = MakeDeviceCopyInterNodeExchange(**d, NodeConfig{.nodes = N});
    ASSERT_TRUE(x.ok()) << x.status();
    Status s = (*d)->Run([&](int32_t r) { return ExchangeAndCheck(**d, **x, r); });
    EXPECT_TRUE(s.ok()) << "N=" << N << " G=" << G << ": " << s;
  }
}

TEST(DeviceCopyInterNodeOneNode, N1IsTheOwnCopyAlone) {
  SKIP_WITHOUT_GPU();
  auto d = OnOneGpu(2);
  ASSERT_TRUE(d.ok()) << d.status();
  auto x = MakeDeviceCopyInterNodeExchange(**d, NodeConfig{.nodes = 1});
  ASSERT_TRUE(x.ok()) << x.status();
  Status s = (*d)->Run([&](int32_t r) { return ExchangeAndCheck(**d, **x, r); });
  EXPECT_TRUE(s.ok()) << s;
}

// A receiver that expects other sizes than its peer sends gets an error naming both; the others
// finish (the collective completes), and the exchange and the domain remain usable.
TEST(DeviceCopyInterNodeInput, SizeMismatchWithAPeerIsNamedAndTheCollectiveCompletes) {
  SKIP_WITHOUT_GPU();
  auto d = OnOneGpu(4, 10);
  ASSERT_TRUE(d.ok()) << d.status();
  auto x = std::move(*MakeDeviceCopyInterNodeExchange(**d, NodeConfig{.nodes = 2}));
  Status s = (*d)->Run([&](int32_t r) -> Status {
    DeviceBuffer buf;
    RDEP_RETURN_IF_ERROR(buf.Allocate(64));
    char* p = static_cast<char*>(buf.p);
    const std::vector<const void*> send{p, p + 8};
    const std::vector<int64_t> send_bytes{8, 8};
    const std::vector<void*> recv{p + 16, p + 24};
    std::vector<int64_t> recv_bytes{8, 8};
    if (r == 0) recv_bytes[1] = 4;  // rank 2 (node 1) sends 8
    Status st = x->AllToAllV(r, {send, send_bytes, recv, recv_bytes}, (*d)->stream(r));
    RDEP_RETURN_IF_ERROR((*d)->Synchronize(r));  // the copies out of buf are done before it is freed
    return st;
  });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("rank 0: inter-node exchange (device-copy) on rank 0 (node 0): recv_bytes[1] = 4 but rank 2 "
                             "(node 1) sends 8 bytes to node 0"),
            std::string::npos)
      << s;
  EXPECT_EQ(s.message().find("other rank"), std::string::npos) << s;  // only rank 0 failed
  s = (*d)->Run([&](int32_t r) { return ExchangeAndCheck(**d, *x, r); });
  EXPECT_TRUE(s.ok()) << s;
}

// Bad input on every rank: each returns before communicating, naming what is wrong.
TEST(DeviceCopyInterNodeInput, BadBuffersAndConfigurationsAreNamed) {
  SKIP_WITHOUT_GPU();
  auto d = OnOneGpu(4, 10);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_NE(MakeDeviceInterNodeExchange(**d, NodeConfig{.nodes = 3}).status().message().find("N=3 must be >= 1 and divide W=4"),
            std::string::npos);
  EXPECT_NE(MakeDeviceInterNodeExchange(**d, NodeConfig{.nodes = 0}).status().message().find("N=0"), std::string::npos);
  EXPECT_NE(MakeDeviceCopyInterNodeExchange(**d, NodeConfig{.nodes = 2, .max_nodes = 3}).status().message().find("M=3"),
            std::string::npos);
  auto x = std::move(*MakeDeviceInterNodeExchange(**d, NodeConfig{.nodes = 2}));
  const auto bad = [&](auto&& mutate) {
    return (*d)->Run([&](int32_t r) -> Status {
      std::vector<const void*> send{nullptr, nullptr};
      std::vector<int64_t> send_bytes{0, 0}, recv_bytes{0, 0};
      std::vector<void*> recv{nullptr, nullptr};
      mutate(send, send_bytes, recv, recv_bytes);
      return x->AllToAllV(r, {send, send_bytes, recv, recv_bytes}, (*d)->stream(r));
    });
  };
  Status s = bad([](auto& send, auto&, auto&, auto&) { send.push_back(nullptr); });
  EXPECT_NE(s.message().find("3 send buffers for N=2 nodes"), std::string::npos) << s;
  s = bad([](auto&, auto&, auto&, auto& recv_bytes) { recv_bytes.pop_back(); });
  EXPECT_NE(s.message().find("1 recv_bytes entries for N=2 nodes"), std::string::npos) << s;
  s = bad([](auto&, auto& send_bytes, auto&, auto&) { send_bytes[1] = -3; });
  EXPECT_NE(s.message().find("send_bytes[1] = -3 is negative"), std::string::npos) << s;
  s = bad([](auto&, auto&, auto&, auto& recv_bytes) { recv_bytes[1] = 12; });
  EXPECT_NE(s.message().find("recv[1] is null with recv_bytes[1] = 12"), std::string::npos) << s;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  s = (*d)->Run([&](int32_t r) -> Status {
    std::vector<int64_t> counts{1, 2, 3}, got(2);
    return x->ExchangeCounts(r, counts, got, (*d)->stream(r));
  });
  EXPECT_NE(s.message().find("counts exchange with 3 send and 2 recv entries for N=2 nodes"), std::string::npos) << s;
  s = (*d)->Run([&](int32_t r) -> Status {
    std::vector<int64_t> counts{1, -2}, got(2);
    return x->ExchangeCounts(r, counts, got, (*d)->stream(r));
  });
  EXPECT_NE(s.message().find("send count [1] = -2 is negative"), std::string::npos) << s;
  // Nothing was communicated: the exchange still works.
  s = (*d)->Run([&](int32_t r) { return ExchangeAndCheck(**d, *x, r); });
  EXPECT_TRUE(s.ok()) << s;
}

// One rank's bad input: the others wait at the barrier and time out naming it; the error reported
// is that rank's own.
TEST(DeviceCopyInterNodeInput, OneRanksBadInputIsTheErrorReported) {
  SKIP_WITHOUT_GPU();
  auto d = OnOneGpu(4, 1.0);
  ASSERT_TRUE(d.ok()) << d.status();
  auto x = std::move(*MakeDeviceCopyInterNodeExchange(**d, NodeConfig{.nodes = 2}));
  Status s = (*d)->Run([&](int32_t r) -> Status {
    const std::vector<const void*> send{nullptr, nullptr};
    const std::vector<int64_t> bytes{0, 0};
    const std::vector<void*> recv{nullptr, nullptr};
    const std::vector<int64_t> bad{0, -1};
    return x->AllToAllV(r, {send, bytes, recv, r == 1 ? bad : bytes}, (*d)->stream(r));
  });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("rank 1: inter-node exchange (device-copy) on rank 1 (node 0): recv_bytes[1] = -1 is negative"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("and 3 other rank(s) failed"), std::string::npos) << s;  // timed out at inter-node.copy
}

// ---- the chooser and the placements each implementation refuses --------------------------------

TEST(DeviceInterNodeChooser, SharedGpuOrOneNodeIsDeviceCopy) {
  SKIP_WITHOUT_GPU();
  auto d = OnOneGpu(4);
  ASSERT_TRUE(d.ok()) << d.status();
  for (int32_t N : {1, 2, 4}) {
    auto x = MakeDeviceInterNodeExchange(**d, NodeConfig{.nodes = N});
    ASSERT_TRUE(x.ok()) << x.status();
    EXPECT_STREQ((*x)->name(), "device-copy");
    EXPECT_NE((*x)->description().find("ranks share GPUs"), std::string::npos) << (*x)->description();
  }
}

TEST(DeviceInterNodeChooser, DistinctGpusAreNcclOrUnavailableWithoutIt) {
  if (cuda::DeviceCount() < 2)
    GTEST_SKIP() << "needs 2 GPUs (one per rank), this machine has " << cuda::DeviceCount();
  auto d = CudaDomain::CreateSingleProcess(2, {.barrier_timeout_s = 60, .devices = {}});
  ASSERT_TRUE(d.ok()) << d.status();
  auto x = MakeDeviceInterNodeExchange(**d, NodeConfig{.nodes = 2});
#if defined(RDEP_HAVE_NCCL)
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_STREQ((*x)->name(), "nccl");
#else
  EXPECT_EQ(x.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(x.status().message().find("no NCCL"), std::string::npos) << x.status();
#endif
  auto copy = MakeDeviceCopyInterNodeExchange(**d, NodeConfig{.nodes = 2});
  EXPECT_EQ(copy.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(copy.status().message().find("needs ranks sharing GPUs in one process"), std::string::npos) << copy.status();
}

TEST(NcclInterNodeInput, RefusesTwoRanksOfACommunicatorOnOneGpuAndBadConfigurations) {
  SKIP_WITHOUT_GPU();
  auto d = OnOneGpu(4);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_NE(MakeNcclInterNodeExchange(**d, NodeConfig{.nodes = 3}).status().message().find("N=3 must be >= 1 and divide W=4"),
            std::string::npos);
  auto x = MakeNcclInterNodeExchange(**d, NodeConfig{.nodes = 2});
#if defined(RDEP_HAVE_NCCL)
  EXPECT_EQ(x.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(x.status().message().find("ranks 0 and 2 (local index 0, nodes 0 and 1) share GPU 0"), std::string::npos)
      << x.status();
#else
  EXPECT_EQ(x.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(x.status().message().find("no NCCL"), std::string::npos) << x.status();
#endif
}

// ---- nccl: every rank on its own GPU -----------------------------------------------------------------

class NcclInterNode : public ::testing::TestWithParam<NodesAndRanks> {};

TEST_P(NcclInterNode, SentinelsArriveExactlyOnDistinctGpus) {
#if !defined(RDEP_HAVE_NCCL)
  GTEST_SKIP() << "this build has no NCCL (nccl.h / libnccl not found when it was configured)";
#endif
  const auto [N, G] = GetParam();
  const int W = N * G, gpus = cuda::DeviceCount();
  if (gpus < W)
    GTEST_SKIP() << "needs W=" << W << " GPUs, one per rank (NCCL refuses two ranks of a communicator on one GPU); "
                 << "this machine has " << gpus;
  auto d = CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = 60, .devices = {}});
  ASSERT_TRUE(d.ok()) << d.status();
  auto x = MakeNcclInterNodeExchange(**d, NodeConfig{.nodes = N});
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_STREQ((*x)->name(), "nccl") << (*x)->description();
  Status s = (*d)->Run([&](int32_t r) { return ExchangeAndCheck(**d, **x, r); });
  EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Shapes, NcclInterNode,
                         ::testing::Values(NodesAndRanks{2, 1}, NodesAndRanks{3, 1}, NodesAndRanks{4, 1}, NodesAndRanks{2, 2},
                                           NodesAndRanks{3, 2}, NodesAndRanks{4, 2}, NodesAndRanks{2, 4}),
                         ShapeName);

}  // namespace
}  // namespace rdep
