// Closed-form cost models of seeds 000 (sections 4 and 5.5, Appendix B) and seeds 004 (cross-node
// expert parallelism): pooling law, capacity slack, grouped-launch inflation, routing-context and
// payload memory, replicated dense lower bound, barrier budget, and the node-limited IB/NVLink model.
// Every call validates its inputs and names the one that is wrong. `rdep model ...` prints them.
#pragma once

#include <cstdint>
#include <ostream>
#include <span>

#include "rdep/status.h"

namespace rdep::model {

// ---- Pooling law (seeds 000 eq. 14) ----
struct PoolingLaw {
  double mu = 0;            // E[M_e] = DP*T*K/E
  double cv = 0;            // CV(M_e) = sqrt((1 - K/E) / mu) under independent uniform routing
  double cv_single = 0;     // the same at DP = 1 (cv * sqrt(DP))
  double mu_single = 0;     // T*K/E
};
StatusOr<PoolingLaw> Pooling(int64_t dp, int64_t tokens, int64_t topk, int64_t experts);

// ---- Capacity slack (seeds 000 eqs. 15-16, Proposition B.3) ----
// Union-bound overflow probability Pr(max_e M_e > (1+beta) mu) <= E*exp(-mu*beta^2/3), clamped to 1.
StatusOr<double> ChernoffOverflowBound(int64_t experts, double mu, double beta);
// Smallest beta whose bound meets target probability p in (0, 1): beta = sqrt(3*ln(E/p)/mu).
StatusOr<double> ChernoffSlack(int64_t experts, double mu, double target_probability);

// ---- Grouped-launch inflation (seeds 000 eq. 19/31) ----
// rho = E_loc * max_j m_j / sum_j m_j (1 when all counts are 0). Rejects empty or negative counts.
StatusOr<double> GroupedLaunchInflation(std::span<const int64_t> counts);

// ---- Routing-context memory (seeds 000 eq. 20/32) ----
// M_ctx = bytes_per_row * L_moe * DP * T * K bytes per GPU (bytes_per_row = 8 in the paper).
StatusOr<double> RoutingContextBytes(int64_t moe_layers, int64_t dp, int64_t tokens, int64_t topk,
                                     int64_t bytes_per_row = 8);

// ---- Symmetric payload memory per GPU, bulk vs segmented (seeds 000 section 4.4, Table 4) ----
struct PayloadMemoryArgs {
  int64_t capacity_rows = 196608;  // M_cap: bulk buffers hold the admitted owner capacity (W*T*K = 8*4096*6)
  int64_t segment_rows = 4096;     // S
  int64_t hidden = 2048;           // H
  int64_t bytes_per_element = 2;   // bf16
  int64_t layers = 27;             // MoE layers whose buffers are live
  int64_t tensors = 4;             // symmetric tensors per layer: dispatch send/recv, return send/recv
  int64_t buffers_per_segment = 2; // double buffering
};
struct PayloadMemory {
  double bulk_bytes_per_layer = 0;       // tensors * M_cap * H * b
  double segmented_bytes_per_layer = 0;  // tensors * buffers * S * H * b
  double bulk_bytes = 0;                 // times layers
  double segmented_bytes = 0;
};
StatusOr<PayloadMemory> SymmetricPayloadMemory(const PayloadMemoryArgs& args);

// ---- Replicated dense lower bound (seeds 000 eq. 21/33) ----
// P = V*H + 4*L*H^2 + 3*L_dense*H*D_dense parameters.
StatusOr<double> DenseLowerBound(int64_t vocab, int64_t hidden, int64_t layers, int64_t dense_layers,
                                 int64_t dense_ffn);

// ---- Barrier budget (seeds 000 section 4.5, Proposition B.7) ----
struct BarrierBudget {
  double barrier_min_s = 0, barrier_max_s = 0;    // W * ns_per_peer (one Theta(W) sweep)
  double segment_min_s = 0, segment_max_s = 0;    // times barriers_per_segment
};
StatusOr<BarrierBudget> Barrier(int64_t width, double ns_per_peer_min, double ns_per_peer_max,
                                int64_t barriers_per_segment = 4);

// ---- Cross-node expert parallelism (seeds 004) ----
// E[distinct nodes] = N*(1 - (1 - 1/N)^k) under uniform routing over N nodes.
StatusOr<double> ExpectedDistinctNodes(int64_t nodes, int64_t topk);

struct CrossNodeArgs {
  int64_t nodes = 8;             // N
  int64_t topk = 8;              // k
  int64_t tokens = 4096;         // T: tokens per GPU before dispatch
  int64_t hidden = 7168;         // d
  int64_t bytes_per_element = 2; // b
  int64_t max_nodes = 0;         // M: node cap (0 = unconstrained)
  double ib_gbps = 50;           // IB GB/s per GPU (1e9 bytes/s)
  double nvlink_gbps = 600;      // NVLink GB/s per GPU
};
struct CrossNode {
  double distinct_nodes = 0;     // per token: N(1-(1-1/N)^k), capped at M when M > 0 (the seed's bound)
  double remote_nodes = 0;       // distinct_nodes - 1 (the home node needs no IB hop)
  double ib_rows = 0;            // R_IB = T * remote_nodes per dispatch
  double ib_bytes = 0;           // B_IB = R_IB * d * b per dispatch (the combine is symmetric)
  double ib_round_trip_bytes = 0;
  double nvlink_rows = 0;        // T * (k - remote_nodes): picks served inside a visited node
  double nvlink_round_trip_bytes = 0;
  double ib_time_s = 0;          // round trip on IB
  double nvlink_time_s = 0;      // round trip on NVLink
  double wall_time_s = 0;        // max of the two (the links run concurrently)
  double naive_ib_bytes = 0;     // one row per off-node slot, no node dedup: T*k*(1-1/N)*d*b
};
StatusOr<CrossNode> CrossNodeDispatch(const CrossNodeArgs& args);

// The least restrictive node cap whose round-trip IB time fits budget_s: scanning M down from N
// (the seed's "drag M down from N" search), the first M with ib_time_s <= budget_s. M = 1 sends
// nothing over IB, so an answer always exists for budget_s >= 0.
StatusOr<int64_t> NodeCapForBudget(CrossNodeArgs args, double budget_s);

std::ostream& operator<<(std::ostream& os, const CrossNode& c);

// ---- Transport floor inside one NVLink domain (DESIGN.md's target table; issue 19's floors) ----
// Uniform routing: a token picks K distinct experts of E, owned by W ranks (contiguous ownership, the
// first E mod W ranks own one more). A token crosses to owner q once (deduplication) when any of its
// experts lives there: P_q = 1 - C(E - E_q, K) / C(E, K). Averaged over source ranks, a token crosses
// to ((W-1)/W) * sum_q P_q remote owners and K*(W-1)/W of its slots are remote. The floor is the bytes
// a GPU must send over its NVLink egress bandwidth (activations of bytes_per_element; the sideband of
// 8 bytes per crossing token and 16 per remote slot counted apart).
struct TransportArgs {
  int64_t ranks = 4;              // W
  int64_t experts = 64;           // E
  int64_t topk = 6;               // K
  int64_t tokens = 4096;          // T per rank
  int64_t hidden = 2048;          // H
  int64_t bytes_per_element = 2;  // bf16
  double peer_gbps = 386;         // per-GPU egress GB/s (1e9 B/s): a copy between two H200s measured 386
};
struct TransportFloor {
  double owners_per_token = 0;         // E[distinct owners] = sum_q P_q
  double remote_owners_per_token = 0;  // ((W-1)/W) * sum_q P_q
  double dispatch_rows = 0;            // T * remote owners: token rows sent per rank
  double dispatch_bytes = 0;           // dispatch_rows * H * b
  double sideband_bytes = 0;           // 8 * dispatch_rows + 16 * T*K*(W-1)/W
  double slot_rows = 0;                // T*K*(W-1)/W remote slots
  double combine_slot_bytes = 0;       // one returned row per remote slot: slot_rows * H * b
  double combine_reduced_bytes = 0;    // the owner reduces its rows per token first: dispatch_rows * H * b
  double dispatch_time_s = 0, combine_slot_time_s = 0, combine_reduced_time_s = 0;  // bytes / peer bandwidth
  double dedup_saving = 0;             // slot_rows / dispatch_rows: how much deduplication saves
};
StatusOr<TransportFloor> IntraDomainTransport(const TransportArgs& args);
std::ostream& operator<<(std::ostream& os, const TransportFloor& t);

}  // namespace rdep::model
