// What the two device inter-node exchanges (device_copy_inter_node.cc, nccl_inter_node.cc) share:
// the check of one call's buffers, the per-rank scratch of the counts exchange, and ExchangeCounts
// written once over AllToAllV. Internal to the transport library (and its tests).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rdep/transport/device_inter_node.h"

namespace rdep::internal {

// One call's buffers on `rank` of N nodes x G ranks: N entries in each span, sizes >= 0, a pointer
// wherever a size is > 0, and recv_bytes[own node] == send_bytes[own node]. InvalidArgument naming
// the field and the rank otherwise; `impl` names the implementation in the message.
Status CheckDeviceExchange(const DeviceExchangeBuffers& buffers, int32_t rank, int32_t nodes, int32_t ranks_per_node,
                           const char* impl);

class DeviceInterNodeBase : public DeviceInterNodeExchange {
 public:
  ~DeviceInterNodeBase() override;
  int32_t num_nodes() const override { return nodes_; }
  int32_t ranks_per_node() const override { return per_node_; }
  Status ExchangeCounts(int32_t rank, std::span<const int64_t> send_counts, std::span<int64_t> recv_counts,
                        cudaStream_t stream) override;

 protected:
  DeviceInterNodeBase(CudaDomain& domain, NodeConfig nodes);
  // Allocates the counts scratch of every local rank on its GPU.
  Status InitScratch();
  // `rank` is a rank of the domain that this process drives.
  Status CheckRank(int32_t rank) const;
  // "inter-node exchange (nccl) on rank 3 (node 1): "
  std::string Prefix(int32_t rank) const;

  CudaDomain& domain_;
  const int32_t nodes_, per_node_;

 private:
  // Per local rank (indexed by rank; null elsewhere), layouts of N int64:
  //   counts_dev_[r]  device, on r's GPU: [0, N) the counts r sends to node b, [N, 2N) those it received
  //   counts_host_[r] pinned host, same layout (staging for the two copies)
  std::vector<int64_t*> counts_dev_, counts_host_;
};

}  // namespace rdep::internal
