// MoE layer on the host backend: the RDEP execution model end to end on a HostDomain, in fp32.
//
// Forward (collective; every rank calls it from its thread inside HostDomain::Run):
//   route rows -> phase 1 counts -> barrier -> phase 2 owner scan + capacity -> barrier ->
//   per segment: phase 3 scatter (token payload + row sideband) -> barrier -> owner expands tokens
//   into expert-grouped rows, runs the SwiGLU expert MLP, writes each output row to its front-end at
//   the slot decoded from row_id -> ... -> barrier -> front-end combine y_t = sum_k g'_k f_k in slot
//   order with fp32 accumulation.
// Backward traverses the saved routing context (accepted set, stream positions, gates): dy crosses
// once per (token, owner), owners compute dgrad and wgrad (fp32, rows in a fixed order, so results
// are bitwise identical for every segment size), dx rows return by row_id, and the front-end computes
// dgate (w.r.t. the router's gates, through the capacity renormalization).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "rdep/balance/layer_balance.h"
#include "rdep/balance/plan.h"
#include "rdep/core/capacity.h"
#include "rdep/core/ownership.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/layer/forward_context.h"
#include "rdep/layer/layer_config.h"
#include "rdep/model/two_phase_traffic.h"
#include "rdep/status.h"
#include "rdep/transport/host_domain.h"
#include "rdep/transport/inter_node.h"

namespace rdep {

// What owners compute. kSentinel replaces the MLP by the identity-revealing echo of
// rdep/dispatch/region_layout.h (SentinelField) for the dispatch invariants check. kIdentity returns
// each row as it came (f(x) = x, so y = (sum of the token's accepted gates) * x): a transport benchmark
// that, unlike the sentinel, also runs with owner_reduce (`rdep bench dispatch --owner-reduce`). Both are
// forward only.
enum class ExpertKind { kSwiGLU, kSentinel, kIdentity };

// One row as an owner grouped it (recorded when tracing is on).
struct OwnerTraceEntry {
  uint64_t row_id;
  int32_t local_expert;
  int32_t segment;
  int64_t group_position;  // index among the segment's expert-grouped rows
};

// What the two-phase exchange moved on one rank in one forward (nodes > 1): rows are activation rows
// of H values; bytes count the activations (fp32 on the host backend, bf16 on CUDA) and the metadata
// beside them. rdep::model::PredictTwoPhaseTraffic (rdep/model/two_phase_traffic.h) predicts every
// count from the routing and the accepted set; Counts() gives them in its form.
struct NodeTraffic {
  int64_t inter_dispatch_rows = 0;   // one per (token, remote node) with an accepted row there
  int64_t inter_combine_rows = 0;    // reduced rows this rank sent back across nodes as a relay
  int64_t intra_dispatch_rows = 0;   // one per (relayed token, owner in the node) this rank scattered
  int64_t inter_dispatch_bytes = 0;  // bytes sent to remote nodes (activations + metadata)
  int64_t inter_combine_bytes = 0;
  int64_t intra_dispatch_bytes = 0;  // bytes scattered to the node's owners (payload rows, row counts, sidebands)
  int64_t intra_return_rows = 0;     // rows this rank returned to relays as an owner
  int64_t intra_return_bytes = 0;
  double dispatch_s = 0, intra_s = 0, combine_s = 0;  // wall time of the inter-node hop, of the node's
                                                      // protocol (scatter, experts, return), of the return hop
  model::RankPhaseTraffic Counts() const {
    return {inter_dispatch_rows, inter_dispatch_bytes, intra_dispatch_rows, intra_dispatch_bytes,
            intra_return_rows,   intra_return_bytes,   inter_combine_rows,  inter_combine_bytes};
  }
};

class HostMoELayer {
 public:
  // Each rank keeps a copy of its own experts' slices of `weights`.
  static StatusOr<std::unique_ptr<HostMoELayer>> Create(HostDomain& domain, const LayerConfig& config,
                                                        const OwnershipMap& ownership, const MoEWeights& weights);
  // A layer without weights of its own: every rank binds the caller's (BindExpertWeights) before its
  // first forward (the PyTorch binding's expert parameters).
  static StatusOr<std::unique_ptr<HostMoELayer>> Create(HostDomain& domain, const LayerConfig& config,
                                                        const OwnershipMap& ownership);
  // The caller's weights of this rank's experts and where backward writes their gradients (fp32,
  // rdep/layer/layer_config.h: ExternalWeights), used by every later call of the rank instead of the
  // layer's own; all-null restores the layer's own. Not while the rank is inside a call.
  Status BindExpertWeights(int32_t rank, const ExternalWeights<float, float>& weights);
  ~HostMoELayer();

  // Collective. x and y are [routing.num_tokens][H]. What backward needs is saved in `ctx`, which the
  // caller owns (rdep/layer/forward_context.h): several forwards may be in flight before backwards.
  Status Forward(int32_t rank, ForwardContext& ctx, const RankRouting& routing, std::span<const float> x,
                 std::span<float> y);
  // Collective, after the forward that filled ctx (every rank passes its context of the same forward).
  // dy, dx are [n][H]; dgates is [n][K]. Weight gradients of this call (overwritten, not accumulated)
  // are in dw1(rank), dw2(rank).
  Status Backward(int32_t rank, ForwardContext& ctx, std::span<const float> dy, std::span<float> dx,
                  std::span<float> dgates);
  // A forward in its two steps (Forward = Plan + Run; both collective): Plan validates the routing
  // and runs phases 1-2 of dispatch (counts, the owners' capacity decision, accepted set, effective
  // gates) into ctx; Run scatters, computes, returns and combines the plan in ctx.
  Status Plan(int32_t rank, ForwardContext& ctx, const RankRouting& routing);
  Status Run(int32_t rank, ForwardContext& ctx, std::span<const float> x, std::span<float> y);
  // The caller's own experts (dispatch / combine, in the manner of DeepEP's Buffer API), all
  // collective, every rank calling the same steps in the same order:
  //   Plan(rank, ctx, routing)                      phases 1-2 as above
  //   recv_counts(ctx)                              rows this rank receives per local expert (M = sum)
  //   Dispatch(rank, ctx, x, recv)                  recv [M][H]: the admitted rows of this rank's experts,
  //                                                 expert-major; within an expert by source rank, token,
  //                                                 slot (recv_row_ids(ctx) names each row)
  //   ... the caller computes out [M][H] from recv (one output row per received row) ...
  //   Combine(rank, ctx, out, y)                    y_t = sum_k g'_k out(t, k), fixed slot order, fp32
  //   CombineBackward(rank, ctx, dy, d_out, dgates) d_out [M][H] = g'_k dy_t per received row; dgates
  //                                                 w.r.t. the router's gates (through renormalization)
  //   DispatchBackward(rank, ctx, d_recv, dx)       dx_t = sum_k d_recv(t, k), fixed slot order, fp32
  // Not with balancing or nodes (FailedPrecondition). Rows keep the layer's contracts: identities,
  // the accepted set of Plan reused by every step, return by row_id.
  StatusOr<std::vector<int64_t>> recv_counts(const ForwardContext& ctx) const;
  StatusOr<std::vector<uint64_t>> recv_row_ids(const ForwardContext& ctx) const;  // after Dispatch
  Status Dispatch(int32_t rank, ForwardContext& ctx, std::span<const float> x, std::span<float> recv);
  Status Combine(int32_t rank, ForwardContext& ctx, std::span<const float> out, std::span<float> y);
  Status CombineBackward(int32_t rank, ForwardContext& ctx, std::span<const float> dy, std::span<float> d_out,
                         std::span<float> dgates);
  Status DispatchBackward(int32_t rank, ForwardContext& ctx, std::span<const float> d_recv, std::span<float> dx);

  // The same with the layer's own context per rank (one forward at a time).
  Status Forward(int32_t rank, const RankRouting& routing, std::span<const float> x, std::span<float> y);
  Status Backward(int32_t rank, std::span<const float> dy, std::span<float> dx, std::span<float> dgates);

  const LayerConfig& config() const { return config_; }
  const OwnershipMap& ownership() const { return ownership_; }
  const RegionLayout& layout() const { return layout_; }
  void set_expert_kind(ExpertKind kind) { kind_ = kind; }
  void set_trace(bool on) { trace_ = on; }

  // Per-rank results of the last forward made with the layer's own context (empty before one).
  const RankAcceptance& acceptance(int32_t rank) const;       // front-end: accepted set, g'
  int64_t segments(int32_t rank) const;                       // segments the last forward used
  const std::vector<OwnerTraceEntry>& owner_trace(int32_t rank) const;
  const std::vector<float>& expert_outputs(int32_t rank) const;  // [n*K][H] returned rows f_k(x_t), 0 if dropped;
                                                                 // empty with owner_reduce (the owners keep them)
  const std::vector<int64_t>& owner_rows_per_expert(int32_t rank) const;  // admitted rows per local expert
  std::span<const float> dw1(int32_t rank) const;             // [E_loc][H][2F] (the bound buffer, if any)
  // The full load matrix Lambda [W][E] (rows per source rank and expert) of the forward in ctx, as
  // every rank holds it after phase 1; needs LayerConfig::load_matrix.
  StatusOr<std::vector<int64_t>> load_matrix(const ForwardContext& ctx) const;
  std::span<const float> dw2(int32_t rank) const;             // [E_loc][F][H]

  // Two-phase exchange (LayerConfig::nodes): what the last forward with the layer's own context moved.
  const NodeTraffic& node_traffic(int32_t rank) const;
  // The byte sizes of this backend's two-phase records (fp32 rows), for rdep::model::PredictTwoPhaseTraffic.
  model::TwoPhaseWire two_phase_wire() const;

  // Balancing (LayerConfig::balance): the plan the forward in ctx used (the same on every rank) and
  // what it did; FailedPrecondition without a planned forward of this layer or with balancing off.
  StatusOr<BalancePlan> balance_plan(const ForwardContext& ctx) const;
  StatusOr<BalanceTelemetry> balance_telemetry(const ForwardContext& ctx) const;
  // The same for the last forward made with the layer's own context on `rank`.
  StatusOr<BalancePlan> balance_plan(int32_t rank) const;
  StatusOr<BalanceTelemetry> balance_telemetry(int32_t rank) const;
  // The first index of the redundant slots in a rank's physical local experts (layout L - N_slot).
  int64_t slot_base() const { return layout_.L - config_.replica_slots(); }
  // Bytes per rank of the redundant slots' weights and gradients (fp32 [N_slot][3*H*F] each; 0 with
  // balancing off). The slots are shared by every balanced layer of the same slot size on the domain
  // (Domain::AcquireShared): a model of many such layers holds them once, not once per layer, and
  // HostDomain::symmetric_bytes_per_rank counts them once. Sharing is safe because each call streams
  // its replicas' weights before it computes (backward again), zeroes the slot gradients at its first
  // backward segment and reduces them into the owners' gradients before its backward returns.
  size_t replica_slot_bytes() const {
    return 2 * static_cast<size_t>(config_.replica_slots()) * static_cast<size_t>(3 * config_.shape.hidden * config_.shape.ffn) * sizeof(float);
  }
  // Test hook: each forward and backward adds 1 to one weight of the first replica it streams (a
  // corrupted tile), so exactness tests can show that they catch a bad copy.
  void set_replica_fault_for_test(bool on) { replica_fault_ = on; }
  // Test hook: `rank` sleeps `seconds` after each barrier that precedes its reads of rows other ranks
  // stored (its segment buffers, its return rows), so tests can show that the barriers which keep the
  // next stores out of those regions are there.
  void set_read_delay_for_test(int32_t rank, double seconds) {
    delay_rank_ = rank;
    delay_s_ = seconds;
  }

 private:
  struct RankState;
  struct Saved;
  HostMoELayer(HostDomain& domain, LayerConfig config, OwnershipMap ownership);
  static StatusOr<std::unique_ptr<HostMoELayer>> CreateLayer(HostDomain& domain, const LayerConfig& config,
                                                             const OwnershipMap& ownership, const MoEWeights* weights);
  Status CheckRank(int32_t rank) const;
  const Saved& last(int32_t rank) const;
  Status PlanByOwner(int32_t rank, Saved& st);
  Status PlanBalanced(int32_t rank, Saved& st);
  void PublishLoadRow(int32_t rank, const RankRouting& routing);
  Status PublishStreamOffsets(int32_t rank, Saved& st);
  Status PushReplicaWeights(int32_t rank, const Saved& st);
  void ReduceReplicaGradients(int32_t rank, const Saved& st);
  const float* ExpertWeights(int32_t rank, const Saved& st, int64_t local, int which) const;
  float* ExpertGrads(int32_t rank, int64_t local, int which);
  int32_t ExpertAt(int32_t rank, const Saved& st, int64_t local) const;
  Status Exchange(int32_t rank, Saved& st, bool backward, std::span<const float> payload);
  Status ExchangeTwoPhase(int32_t rank, Saved& st, bool backward, std::span<const float> payload,
                          std::vector<std::vector<std::byte>>& returned);
  Status SendToRelays(int32_t rank, Saved& st, bool backward, std::span<const float> payload, std::vector<float>& relay_in);
  int64_t ScatterRelayed(const Saved& st, int64_t seg, std::span<const float> relay_in);  // bytes written
  void ReduceAtRelay(int32_t rank, Saved& st, bool backward, std::span<const float> relay_in,
                     std::vector<std::vector<std::byte>>& send);
  Status RunTwoPhase(int32_t rank, Saved& st, std::span<const float> x, std::span<float> y);
  Status BackwardTwoPhase(int32_t rank, Saved& st, std::span<const float> dy, std::span<float> dx, std::span<float> dgates);
  float* ReturnRow(int32_t owner, uint64_t row_id) const;
  void OwnerSegment(int32_t rank, Saved& st, int64_t segment, bool backward);
  // One received row as an owner groups a segment: its token's index in the segment and its sideband.
  struct GroupedRow {
    int64_t token;
    RowSideband row;
  };
  static int64_t SegmentTokenRows(const std::byte* sideband, size_t token_sideband_bytes, int64_t position);
  std::vector<GroupedRow> GroupSegment(int32_t rank, const Saved& st, int64_t segment) const;
  void ScatterSegment(int32_t rank, const Saved& st, int64_t segment, std::span<const float> payload);
  void CombineReturned(int32_t rank, Saved& st, std::span<float> y);
  void ComputeDgates(const Saved& st, std::span<const float> dy, std::span<float> dgates) const;
  void SumReturned(int32_t rank, const Saved& st, std::span<float> out, bool lead_only = false) const;
  // LayerConfig::owner_reduce (host_owner_reduce.cc): the front-end's side (lead slots, dgate from the
  // owners' dot products; SumReturned sums the lead rows) and the owner's (a token's lead row, dots).
  bool IsLeadSlot(const Saved& st, int64_t t, int64_t k) const;
  void DgatesFromDots(int32_t rank, const Saved& st, std::span<float> dgates) const;
  void ZeroLeadRows(int32_t rank, const std::byte* sideband, int64_t n_seg) const;
  float* LeadRow(int32_t rank, const std::byte* sideband, int64_t position) const;
  void WriteDot(uint64_t row_id, double dot) const;
  Status CheckRowsSupported(const char* call) const;
  Status TakeSegmentRows(int32_t rank, Saved& st, int64_t segment, bool backward, std::span<float> rows,
                         std::vector<int64_t>& fill);
  Status ReturnCallerRows(int32_t rank, const Saved& st, std::span<const float> rows, bool backward);

  HostDomain& domain_;
  LayerConfig config_;
  OwnershipMap ownership_;
  RegionLayout layout_;
  LayerRegions regions_;
  RegionId replica_w_ = -1, replica_g_ = -1;  // [N_slot][3*H*F] per rank: replica weights, their gradients (shared regions)
  bool replica_fault_ = false;
  int32_t delay_rank_ = -1;
  double delay_s_ = 0;
  void TestDelay(int32_t rank) const;
  std::unique_ptr<InterNodeExchange> inter_;                // nodes > 1
  std::vector<int32_t> node_of_expert_;                     // [E] node of each expert's owner
  mutable std::vector<std::vector<float>> gathered_out_;    // expert_outputs() of two-phase runs
  ExpertKind kind_ = ExpertKind::kSwiGLU;
  bool trace_ = false;
  uint64_t id_ = 0;  // process-unique; contexts remember it
  std::vector<std::unique_ptr<RankState>> ranks_;
};

}  // namespace rdep
