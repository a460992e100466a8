// The inter-node phase of a hierarchical domain (seeds 004): W = N*G ranks form N nodes of G
// consecutive ranks (rank = node*G + local). Across nodes, a rank talks only to the ranks with its own
// local index, one per node: the first hop of the two-phase dispatch (one copy per (token, node)) and
// the last hop of combine (one reduced row per (token, node)). Inside a node the RDEP protocol runs as
// on one domain. This file: the host implementation (mailboxes; the host backend, CI). On GPUs the same
// exchange of device buffers is device_inter_node.h: NCCL (one communicator per local index, grouped
// send/recv) and device copies for ranks sharing a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <vector>

#include "rdep/status.h"
#include "rdep/transport/host_domain.h"

namespace rdep {

// How the ranks of a domain form nodes, and the node cap of node-limited routing.
struct NodeConfig {
  int32_t nodes = 1;      // N: nodes of W/N consecutive ranks (1 = one NVLink domain, no inter-node phase)
  int32_t max_nodes = 0;  // M: a token's experts lie on at most M nodes (0 = N: no cap)

  // N >= 1 dividing W ("N*G must equal W"), M in [0, N]; names the field.
  Status Validate(int64_t ranks) const;
  int32_t ranks_per_node(int64_t ranks) const { return static_cast<int32_t>(ranks / nodes); }
  int32_t cap() const { return max_nodes > 0 ? max_nodes : nodes; }
};
std::ostream& operator<<(std::ostream& os, const NodeConfig& c);

class InterNodeExchange {
 public:
  virtual ~InterNodeExchange() = default;
  virtual int32_t num_nodes() const = 0;
  virtual int32_t ranks_per_node() const = 0;
  // Collective over every rank of the domain: `rank` sends send[b] to the rank of node b with its
  // local index and receives recv[a] from the one of node a (recv[own node] is send[own node]).
  // send and recv have N entries; send is consumed.
  virtual Status AllToAllV(int32_t rank, std::vector<std::vector<std::byte>>& send,
                           std::vector<std::vector<std::byte>>& recv) = 0;
};

// Host implementation: mailboxes in process memory between two barriers of `domain`.
StatusOr<std::unique_ptr<InterNodeExchange>> MakeHostInterNodeExchange(HostDomain& domain, NodeConfig nodes);

}  // namespace rdep
