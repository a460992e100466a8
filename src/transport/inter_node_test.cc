// The host inter-node exchange: each rank receives, from every node, exactly what the rank with its
// local index there sent it; node configurations are validated.
#include "rdep/transport/inter_node.h"

#include <gtest/gtest.h>

#include <string>

namespace rdep {
namespace {

TEST(HostInterNode, EveryRankGetsWhatItsPeersWithTheSameLocalIndexSent) {
  const int32_t N = 3, G = 2;
  auto domain = std::move(*HostDomain::Create(N * G, {.barrier_timeout_s = 10}));
  auto x = std::move(*MakeHostInterNodeExchange(*domain, NodeConfig{.nodes = N}));
  EXPECT_EQ(x->ranks_per_node(), G);
  for (int round = 0; round < 2; ++round) {  // mailboxes are reusable
    Status st = domain->Run([&](int32_t r) -> Status {
      std::vector<std::vector<std::byte>> send(N), recv;
      for (int32_t b = 0; b < N; ++b)  // (round, sender, destination node), with a length that varies
        for (int32_t i = 0; i < 1 + r + b; ++i) send[static_cast<size_t>(b)].push_back(static_cast<std::byte>(round * 64 + r * 8 + b));
      RDEP_RETURN_IF_ERROR(x->AllToAllV(r, send, recv));
      for (int32_t a = 0; a < N; ++a) {
        const int32_t from = a * G + r % G;
        const auto& got = recv[static_cast<size_t>(a)];
        if (got.size() != static_cast<size_t>(1 + from + r / G)) return InternalError("rank " + std::to_string(r) + ": size from node " + std::to_string(a));
        for (std::byte v : got)
          if (v != static_cast<std::byte>(round * 64 + from * 8 + r / G)) return InternalError("rank " + std::to_string(r) + ": content");
      }
      return Status::Ok();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

TEST(HostInterNode, BadConfigurationsAndSendCountsAreErrors) {
  auto domain = std::move(*HostDomain::Create(4, {.barrier_timeout_s = 5}));
  EXPECT_NE(MakeHostInterNodeExchange(*domain, NodeConfig{.nodes = 3}).status().message().find("divide W=4"), std::string::npos);
  EXPECT_NE(MakeHostInterNodeExchange(*domain, NodeConfig{.nodes = 2, .max_nodes = 3}).status().message().find("M=3"),
            std::string::npos);
  EXPECT_NE(MakeHostInterNodeExchange(*domain, NodeConfig{.nodes = 0}).status().message().find("N=0"), std::string::npos);
  auto x = std::move(*MakeHostInterNodeExchange(*domain, NodeConfig{.nodes = 2}));
  Status st = domain->Run([&](int32_t r) -> Status {
    std::vector<std::vector<std::byte>> send(r == 0 ? 3 : 2), recv;
    return x->AllToAllV(r, send, recv);
  });
  EXPECT_NE(st.message().find("3 send buffers for N=2 nodes"), std::string::npos) << st;
}

}  // namespace
}  // namespace rdep
