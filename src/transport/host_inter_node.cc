#include <string>

#include "rdep/transport/inter_node.h"

namespace rdep {

Status NodeConfig::Validate(int64_t ranks) const {
  if (nodes < 1 || ranks % nodes != 0)
    return InvalidArgument("nodes: N=" + std::to_string(nodes) + " must be >= 1 and divide W=" + std::to_string(ranks) +
                           " (N nodes x G ranks per node = W)");
  if (max_nodes < 0 || max_nodes > nodes)
    return InvalidArgument("max_nodes: M=" + std::to_string(max_nodes) + " must be in [1, N=" + std::to_string(nodes) +
                           "] (0 = N)");
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const NodeConfig& c) {
  os << "N=" << c.nodes;
  if (c.max_nodes > 0 && c.max_nodes < c.nodes) os << " M=" << c.max_nodes;
  return os;
}

namespace {

class HostInterNode final : public InterNodeExchange {
 public:
  HostInterNode(HostDomain& d, NodeConfig n)
      : domain_(d), nodes_(n.nodes), per_node_(n.ranks_per_node(d.num_ranks())),
        mailbox_(static_cast<size_t>(d.num_ranks()), std::vector<std::vector<std::byte>>(static_cast<size_t>(n.nodes))) {}
  int32_t num_nodes() const override { return nodes_; }
  int32_t ranks_per_node() const override { return per_node_; }

  Status AllToAllV(int32_t rank, std::vector<std::vector<std::byte>>& send, std::vector<std::vector<std::byte>>& recv) override {
    if (send.size() != static_cast<size_t>(nodes_))
      return InvalidArgument("inter-node exchange on rank " + std::to_string(rank) + ": " + std::to_string(send.size()) +
                             " send buffers for N=" + std::to_string(nodes_) + " nodes");
    const int32_t node = rank / per_node_, local = rank % per_node_;
    // mailbox_[dst][src node] is written by exactly one rank and read by exactly one, between barriers.
    for (int32_t b = 0; b < nodes_; ++b) mailbox_[static_cast<size_t>(b * per_node_ + local)][static_cast<size_t>(node)] = std::move(send[static_cast<size_t>(b)]);
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kInterNode));
    recv.resize(static_cast<size_t>(nodes_));
    for (int32_t a = 0; a < nodes_; ++a) recv[static_cast<size_t>(a)] = std::move(mailbox_[static_cast<size_t>(rank)][static_cast<size_t>(a)]);
    return domain_.Barrier(rank, Phase::kInterNodeDone);
  }

 private:
  HostDomain& domain_;
  int32_t nodes_, per_node_;
  std::vector<std::vector<std::vector<std::byte>>> mailbox_;  // [W][N]
};

}  // namespace

StatusOr<std::unique_ptr<InterNodeExchange>> MakeHostInterNodeExchange(HostDomain& domain, NodeConfig nodes) {
  RDEP_RETURN_IF_ERROR(nodes.Validate(domain.num_ranks()));
  return std::unique_ptr<InterNodeExchange>(new HostInterNode(domain, nodes));
}

}  // namespace rdep
