// The host layer's state per rank and what one forward saves (shared by host_moe_layer.cc and
// host_balance.cc; internal to the layer library).
#pragma once

#include <memory>
#include <vector>

#include "rdep/balance/layer_balance.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {

// The layer's own state per rank: this rank's experts (owner role), their gradients, and the
// context of calls made without one.
struct HostMoELayer::RankState {
  std::vector<float> w1, w2, dw1, dw2;  // the layer's own copy (empty for a layer created without weights)
  size_t w1_count = 0, w2_count = 0;    // E_loc * H * 2F, E_loc * F * H
  ExternalWeights<float, float> bound;  // the caller's, when bound
  ForwardContext own_context;
  std::vector<double> eplb_history;     // [E] admitted rows per expert of the last balanced plan (EPLB)

  const float* W1() const { return bound.w1 ? bound.w1 : w1.data(); }
  const float* W2() const { return bound.w2 ? bound.w2 : w2.data(); }
  float* DW1() { return bound.dw1 ? bound.dw1 : dw1.data(); }
  float* DW2() { return bound.dw2 ? bound.dw2 : dw2.data(); }
  bool has_weights() const { return bound.w1 || !w1.empty() || w1_count == 0; }
  bool has_grads() const { return bound.dw1 || !dw1.empty() || w1_count == 0; }
};

// What a forward saves for its backward on one rank (held by a ForwardContext).
struct HostMoELayer::Saved final : ForwardContext::State {
  // Front-end: the accepted route set and its placement.
  int64_t num_tokens = 0;
  RankRouting routing;
  RankAcceptance acceptance;
  std::vector<std::vector<int32_t>> tokens_to;  // [W] tokens with a slot on owner q, token order
  std::vector<int64_t> stream_base;             // [W] base of this rank's tokens in q's stream
  int64_t num_segments = 0;
  std::vector<float> expert_out;                // [n*K*H] returned rows f_k(x_t), 0 if dropped
  // Owner: the token stream this rank received.
  int64_t stream_tokens = 0;
  std::vector<float> saved_x;                   // [stream_tokens][H]
  std::vector<int64_t> rows_per_expert;         // admitted rows per local expert: [E_loc], or with
                                                // balancing per physical index [layout L] (slots last)
  std::vector<OwnerTraceEntry> trace;
  // Dispatch/combine with the caller's experts (owner): the row id of each received row, in the order
  // Dispatch delivered them (expert-major over the local experts, stream order within an expert).
  std::vector<uint64_t> recv_row_ids;
  std::vector<int64_t> load;                    // [W][E] the full load matrix (LayerConfig::load_matrix)
  // Where each accepted route slot t*K+k is computed: the rank and its physical local index there
  // (the owner and lambda(e), or with balancing a replica's slot_base + s); -1 for a dropped slot.
  std::vector<int32_t> dest_rank, dest_local;   // [n*K]
  // Two-phase (nodes > 1), relay role: the tokens this rank relays into its node for the sources with
  // its local index (source node order, token order), their rows sorted by slot, the rows' expert
  // outputs (for dgate) and where each (token, owner) pair sits in the owner's stream.
  struct RelayEntry {
    int32_t owner = 0;
    int64_t pos = 0;
    std::vector<RowSideband> rows;
  };
  struct Relayed {
    int32_t src_node = 0, token = 0;
    std::vector<RelayEntry> entries;  // owners of its node, ascending
    std::vector<RowSideband> rows;    // every row on this node, by slot
    int64_t out = 0;                  // its first row in relay_out
  };
  std::vector<Relayed> relayed;
  std::vector<float> relay_out;                 // [relayed rows][H] expert outputs
  NodeTraffic traffic;
  // Balancing: the plan (identical on every rank) and what it did.
  std::shared_ptr<const BalancePlan> plan;
  std::shared_ptr<const RelayPlan> relays;      // experts streamed through chunk relays
  BalanceTelemetry telemetry;
  size_t bytes() const override {
    size_t b = relay_out.size() * 4 + relayed.size() * sizeof(Relayed) + load.size() * 8 + (dest_rank.size() + dest_local.size()) * 4 + routing.experts.size() * 4 +
               routing.gates.size() * 4 + acceptance.accepted.size() +
               acceptance.effective_gates.size() * 4 + (expert_out.size() + saved_x.size()) * 4 +
               (stream_base.size() + rows_per_expert.size() + recv_row_ids.size()) * 8 + trace.size() * sizeof(OwnerTraceEntry);
    for (const auto& v : tokens_to) b += v.size() * 4;
    return b;
  }
};

}  // namespace rdep
