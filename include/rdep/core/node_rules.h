// Rules of the two-phase exchange across nodes (seeds 004), one definition for host and device code.
// W = N*G ranks form N nodes of G consecutive ranks (rank = node*G + local index). The host layer
// (src/layer/host_two_phase.cc, host_moe_layer.cc) and the CUDA layer's kernels
// (rdep/dispatch/two_phase_kernels.h) both call these:
//   NodeSplit::relay / relay_return_index  where an owner returns a row of a source on another node:
//       to the relay of that source in the owner's node (the rank with the source's local index), at
//       (source node, t, k) of the relay's return region [N][T*K][H];
//   CountTokenNodes                        the distinct nodes a token's experts lie on (node-limited
//       routing: CheckNodeLimit on the host, the CUDA layer's device check).
#pragma once

#include <cstdint>

#include "rdep/core/route_rules.h"  // RDEP_HOST_DEVICE
#include "rdep/core/row_id.h"

namespace rdep {

struct NodeSplit {
  int64_t ranks_per_node = 1;  // G

  RDEP_HOST_DEVICE int64_t node(int64_t rank) const { return rank / ranks_per_node; }
  // The rank in owner's node with src_rank's local index: src_rank's relay there.
  RDEP_HOST_DEVICE int64_t relay(int64_t owner, int64_t src_rank) const {
    return (owner / ranks_per_node) * ranks_per_node + src_rank % ranks_per_node;
  }
  // Row index in the relay's return region of route row `key`: ((source node)*T + t)*K + k. With one
  // node (G = W) it is the one-domain index t*K + k at the source itself.
  RDEP_HOST_DEVICE int64_t relay_return_index(const RowKey& key, int64_t T, int64_t K) const {
    return ((key.rank / ranks_per_node) * T + key.token) * K + key.slot;
  }
};

// Distinct nodes among one token's K experts (node_of(e) gives an expert's node; O(K^2), no memory).
template <typename NodeOf>
RDEP_HOST_DEVICE inline int64_t CountTokenNodes(const int32_t* token_experts, int64_t K, NodeOf node_of) {
  int64_t distinct = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t nd = node_of(token_experts[k]);
    bool seen = false;
    for (int64_t j = 0; j < k && !seen; ++j) seen = node_of(token_experts[j]) == nd;
    if (!seen) ++distinct;
  }
  return distinct;
}

}  // namespace rdep
