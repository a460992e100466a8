// The bootstrap collectives with threads standing in for processes (a FunctionBootstrap over a
// shared buffer): variable-size gathers and the cross-rank agreement check.
#include "rdep/transport/bootstrap.h"

#include <gtest/gtest.h>

#include <barrier>
#include <cstring>
#include <thread>

namespace rdep {
namespace {

// W threads; AllGather copies each contribution into a shared area between two barrier phases.
struct ThreadWorld {
  explicit ThreadWorld(int w) : size(w), sync(w) {}
  int size;
  std::barrier<> sync;
  std::vector<uint8_t> area;
  std::unique_ptr<Bootstrap> Make(int rank) {
    return std::make_unique<FunctionBootstrap>(rank, size, [this, rank](const void* send, size_t bytes, void* recv) {
      sync.arrive_and_wait();
      if (rank == 0) area.assign(bytes * static_cast<size_t>(size), 0);
      sync.arrive_and_wait();
      std::memcpy(area.data() + static_cast<size_t>(rank) * bytes, send, bytes);
      sync.arrive_and_wait();
      std::memcpy(recv, area.data(), bytes * static_cast<size_t>(size));
      sync.arrive_and_wait();
      return Status::Ok();
    });
  }
};

TEST(Bootstrap, AllGatherBytesKeepsEachRanksSize) {
  ThreadWorld world(3);
  std::vector<std::vector<std::vector<uint8_t>>> got(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      auto boot = world.Make(r);
      std::vector<uint8_t> mine(static_cast<size_t>(r * 5), static_cast<uint8_t>(r + 1));
      auto all = AllGatherBytes(*boot, mine);
      ASSERT_TRUE(all.ok());
      got[static_cast<size_t>(r)] = *all;
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(got[static_cast<size_t>(r)].size(), 3u);
    for (int q = 0; q < 3; ++q)
      EXPECT_EQ(got[static_cast<size_t>(r)][static_cast<size_t>(q)], std::vector<uint8_t>(static_cast<size_t>(q * 5), static_cast<uint8_t>(q + 1)));
  }
}

TEST(Bootstrap, AgreeAcrossRanksNamesTheDifferingRank) {
  ThreadWorld world(4);
  std::vector<Status> status(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r)
    threads.emplace_back([&, r] {
      auto boot = world.Make(r);
      const std::vector<uint8_t> cfg = {static_cast<uint8_t>(r == 2 ? 9 : 7)};
      status[static_cast<size_t>(r)] = AgreeAcrossRanks(*boot, cfg, "layer config", [](const std::vector<uint8_t>& b) {
        return "H=" + std::to_string(b.empty() ? -1 : b[0]);
      });
    });
  for (auto& t : threads) t.join();
  for (const auto& s : status) {
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.message(), "layer config mismatch between ranks: rank 0 has H=7, rank 2 has H=9");
  }
}

TEST(Bootstrap, MpiIsReportedWhenAbsent) {
#if defined(RDEP_HAVE_MPI)
  GTEST_SKIP() << "this build has MPI; the MPI bootstrap runs under mpirun (rdep check --bootstrap mpi)";
#else
  auto b = MakeMpiBootstrap();
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("no MPI"), std::string::npos);
#endif
}

}  // namespace
}  // namespace rdep
