// MoE layer on the CUDA backend: the same protocol, contracts and capacity rule as HostMoELayer,
// with bf16 activations and expert weights, fp32 gates, combine accumulation and weight gradients.
//
// Per rank, every call is enqueued on CudaDomain::stream(rank) (inputs/outputs are device pointers
// on the rank's GPU):
//   Forward:  count+publish -> barrier -> owner scan (capacity, bases) -> barrier -> accept ->
//             per segment: scatter (token payload + row sideband) -> barrier -> expand into
//             expert-grouped rows -> [host sync: per-expert row counts for cuBLASLt] -> expert MLP ->
//             return rows to their front-ends by row_id -> ... -> barrier -> combine.
//   Backward: dgate -> per segment: scatter dy -> barrier -> gate-scaled gather -> dgrad + wgrad ->
//             return dx rows -> ... -> barrier -> sum dx rows.
// With LayerConfig::balance (replicas of hot experts, src/layer/cuda_balance.cc): phase 1 publishes the
// load matrix, every rank solves the same plan on its GPU (ultraep: DevicePlanner, no host round trip;
// the EPLB baselines on the host after one sync), assigns its rows to physical instances and publishes
// rows per (destination, physical index); owners stream their replicated experts' weights into the
// replicas' slots before each forward's and backward's expert compute (experts with more than
// relay_above replicas through chunk relays: two stages and a barrier), and after backward add the
// replicas' gradients (in instance order) to their own. bf16 weight gradients are refused with it.
// With LayerConfig::nodes (N nodes of W/N ranks, src/layer/cuda_two_phase.cc): the same plan; run and
// backward move each token once per node with an accepted row there to the rank with its local index
// (the device inter-node exchange), run the protocol inside each node from there, reduce a token's
// rows per node at that relay and send one row per (token, node) back (one more host wait per forward:
// the bundle counts). Not with balancing or the CUTLASS expert compute.
// The slots are shared by every balanced layer of the same slot size on the domain (replica_slot_bytes).
// Host synchronization inside a call: once per forward segment, because the grouped GEMMs take the
// per-expert row counts on the host (cuBLASLt); and once after phase 2 only when the segment size is
// smaller than the worst case W*T (to learn the number of segments). The default segment size on
// this backend is W*T (worst case), so a forward syncs once and backward never.
// What backward needs (the routing plan of the forward and the saved activations) lives in a
// ForwardContext the caller owns (rdep/layer/forward_context.h), so several forwards may be in flight
// before their backwards; calls without a context use the layer's own, one per rank. Weights,
// gradients and per-call workspaces belong to the layer and are allocated at Create; a context's
// saved owner activations grow only when a forward needs more rows than any before it in that context.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <atomic>
#include <memory>
#include <vector>

#include "rdep/core/capacity.h"
#include "rdep/core/ownership.h"
#include "rdep/core/reference.h"
#include "rdep/layer/host_moe_layer.h"  // ExpertKind, OwnerTraceEntry
#include "rdep/layer/forward_context.h"
#include "rdep/layer/layer_config.h"
#include "rdep/status.h"
#include "rdep/transport/cuda_domain.h"
#include "rdep/transport/device_inter_node.h"

namespace rdep::kernels {
struct ExpertRows;  // rdep/experts/expert_compute.h
}  // namespace rdep::kernels

namespace rdep {

namespace dispatch {
struct RouteTargets;  // rdep/dispatch/dispatch_kernels.h
}  // namespace dispatch

// Where a layer call's time goes (CUDA events at phase boundaries, summed over segments).
struct PhaseTimes {
  double routing_ms = 0;   // forward: counts, owner scan, acceptance (2 barriers; with per-source windows the
                           // two kernels of LaunchWindowPlan, no barrier); backward: dgate
  double dispatch_ms = 0;  // scatter of payload + sideband, segment barrier
  double expert_ms = 0;    // expansion, gather and the expert MLP (forward) / dgrad + wgrad (backward)
  double return_ms = 0;    // rows back to their front-ends, final barrier
  double return_wait_ms = 0;  // of return_ms, the one-domain exchange's final barrier: from the end of this rank's
                              // own returns to the last peer's (the rest of return_ms is its own stores)
  double combine_ms = 0;   // gate-weighted combine (forward) / dx sum (backward)
  // Balancing only (0 otherwise): the plan (solve, instance assignment, effective gates), the replica
  // weight streaming before the expert compute, and (backward) the replica gradient reduction.
  double plan_ms = 0;
  double stream_ms = 0;
  double reduce_ms = 0;
  // With EnableProfiling(on, routing_detail = true), a forward's routing_ms in parts (balancing off;
  // their sum and the acceptance after them make routing_ms): validation, expert ranks and the counts
  // published; the counts barrier; the owner scan and the offsets barrier. 0 otherwise.
  double route_local_ms = 0;
  double route_counts_ms = 0;
  double route_scan_ms = 0;
  double total_ms() const {
    return routing_ms + dispatch_ms + expert_ms + return_ms + combine_ms + plan_ms + stream_ms + reduce_ms;
  }
};

// Where a context's saved rows come from when the caller brings its own allocator (rdep.torch: PyTorch's
// caching allocator), so that they are the caller's memory to reuse between a context's backward and its
// next forward: alloc returns `bytes` of device memory on `device`, usable in stream order after the
// caller's `stream` (the caller's stream of the call that asks: CudaMoELayer::SetCallerStream), null
// when it has none; free gives a block back (after the call that used it, in the caller's stream order).
struct RowAllocator {
  void* (*alloc)(void* user, size_t bytes, int32_t device, void* stream) = nullptr;  // stream: a cudaStream_t
  void (*free)(void* user, void* ptr, size_t bytes, int32_t device) = nullptr;
  void* user = nullptr;
};

// Where each route slot of a balanced forward is computed: rank and physical local index there (the
// owner and lambda(e), or a replica's slot_base + s); -1 for a dropped slot. [n*K] each.
struct RowInstances {
  std::vector<int32_t> rank, local;
};

namespace cuda_layer {
struct StashRows;  // the paged stash's views (src/layer/cuda_stash_kernels.h)
struct StashPool;
}  // namespace cuda_layer

class CudaMoELayer {
 public:
  // Copies each rank's experts' slices of `weights` to its GPU as bf16.
  static StatusOr<std::unique_ptr<CudaMoELayer>> Create(CudaDomain& domain, const LayerConfig& config,
                                                        const OwnershipMap& ownership, const MoEWeights& weights);
  // A layer without weights of its own: every local rank binds the caller's (BindExpertWeights)
  // before its first forward (the PyTorch binding's expert parameters).
  static StatusOr<std::unique_ptr<CudaMoELayer>> Create(CudaDomain& domain, const LayerConfig& config,
                                                        const OwnershipMap& ownership);
  // The caller's weights of this rank's experts on its GPU (bf16 [E_loc][H][2F], [E_loc][F][H]) and
  // where backward writes their gradients (fp32, same shapes), used by every later call of the rank
  // instead of the layer's own (rdep/layer/layer_config.h: ExternalWeights); all-null restores the
  // layer's own. They must stay valid until the rank's stream has run the calls that use them.
  Status BindExpertWeights(int32_t rank, const ExternalWeights<__nv_bfloat16, float>& weights);
  // The same with bf16 weight gradients (the gradients of bf16 parameters: written once, each GEMM
  // accumulating in fp32 and rounding once), for forwards that ran in one segment (the default S).
  Status BindExpertWeights(int32_t rank, const ExternalWeights<__nv_bfloat16, __nv_bfloat16>& weights);
  // The saved rows of contexts made or re-filled from now on (the front-end's returned rows kept for
  // dgate and, on the sync-free path, the owner's x rows, SwiGLU inputs and kept outputs: nearly all of
  // a context's bytes) come from `a` (all-null: cudaMalloc, kept with the context, the default), and
  // ReleaseRows gives them back. Call between calls, on every local rank's thread or before any call.
  Status SetRowAllocator(const RowAllocator& a);
  // The caller's stream of the rank's next calls (the stream a RowAllocator allocates for); default 0.
  void SetCallerStream(int32_t rank, cudaStream_t stream);
  // SetCallerStream, then, with a RowAllocator, the rows ctx gave back (ReleaseRows) taken again on the
  // caller's thread before a call that forwards in ctx (so an allocator with no memory fails that call
  // before the collective starts). The C API calls it before every forward and plan.
  Status PrepareRows(int32_t rank, ForwardContext& ctx, cudaStream_t caller);
  // Gives the saved rows of ctx that came from a RowAllocator back to it (after ctx's backward, or when
  // the caller drops ctx without one) and abandons ctx's forward (a backward is then refused); its next
  // forward takes them again. A no-op without a RowAllocator. The rows were allocated on the caller's
  // stream of the forward: release them only after the calls that used them, in that stream's order
  // (the C API joins the layer's streams back into the caller's at the end of each call).
  Status ReleaseRows(ForwardContext& ctx);
  // The bytes [old_base, old_base + bytes) that ctx's saved rows were taken from (a caller's arena) were copied to
  // new_base: the rows that lay there are read at the same offsets of new_base from now on. The others (cudaMalloc'd,
  // the stash's pages, another arena's) are left. For a forward no CUDA graph recorded (its replays keep the
  // addresses the capture saw). Call between calls.
  void RebaseRows(ForwardContext& ctx, const void* old_base, size_t bytes, void* new_base);
  ~CudaMoELayer();

  // Collective (call from every rank inside CudaDomain::Run). Device pointers on rank's GPU:
  // experts [n][K] int32, gates [n][K] fp32, x and y [n][H] bf16. n <= T.
  // Inputs are checked on the device (expert ids in [0, E), no expert twice in a token, gates finite
  // and >= 0) and n against T: a bad input is InvalidArgument naming the rank, token and slot, after
  // the rank has still taken part in the collective (a faulty token with zero gates, a bad n as no
  // tokens), so the other ranks finish; nothing is written out of bounds.
  // What backward needs is saved in ctx (caller-owned; bound to this layer and rank).
  Status Forward(int32_t rank, ForwardContext& ctx, const int32_t* experts, const float* gates, int64_t num_tokens,
                 const __nv_bfloat16* x, __nv_bfloat16* y);
  // With LayerConfig::expert_compute = kCutlass, one segment per forward (S >= W*T, the default) and
  // balancing off, neither Forward nor Backward waits on the host: the host can run ahead of the GPU
  // and a call can be captured in a CUDA graph (rdep bench layer --graph). A routing fault is then
  // reported by the forward only when the device has already checked it by the time Run returns,
  // else by its Backward, or on demand by CheckRoutingFaults (which waits).
  Status CheckRoutingFaults(int32_t rank, ForwardContext& ctx);
  // Collective, after the forward that filled ctx (every rank passes its context of the same forward):
  // dy, dx [n][H] bf16; dgates [n][K] fp32 (w.r.t. the router's gates). Weight gradients of this call
  // (overwritten) in dw1(rank), dw2(rank): fp32 [E_loc][H][2F], [E_loc][F][H].
  Status Backward(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* dgates);
  // A forward in its two steps (both collective, every rank in the same order; every rank of a forward
  // calls Forward, or every rank Plan then Run: Forward's plan may take per-source windows, whose calls
  // and barriers differ from Plan's).
  // Plan: the routing checked on the device, phases 1-2 of dispatch (counts, the owners' capacity
  // decision), the accepted set and effective gates, into ctx. Run: phase 3, expert compute, return
  // and combine of the plan in ctx. A bad num_tokens makes Plan return InvalidArgument after the rank
  // took part with no tokens; its Run still follows (the other ranks need it). A bad routing slot is
  // reported by Run (after the collective), naming the rank, token and slot. Forward (not Plan) takes the
  // per-source windows where they apply (LayerConfig::source_windows): its plan then exchanges nothing.
  Status Plan(int32_t rank, ForwardContext& ctx, const int32_t* experts, const float* gates, int64_t num_tokens);
  Status Run(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* x, __nv_bfloat16* y);
  // The caller's own experts (dispatch / combine; rdep/layer/host_moe_layer.h describes the steps and
  // the order of the received rows). Device pointers on the rank's GPU, bf16 rows; each row count is
  // checked against the plan (n = num_tokens, M = the rows received, the sum of recv_counts). Needs one
  // segment per forward (S >= W*T, the default). recv_counts synchronizes the rank's stream once per
  // plan (Dispatch does if it was not called); recv_row_ids synchronizes. A bad routing slot is
  // reported by Combine (after the collective), as Run does.
  StatusOr<std::vector<int64_t>> recv_counts(ForwardContext& ctx);
  StatusOr<std::vector<uint64_t>> recv_row_ids(ForwardContext& ctx);
  Status Dispatch(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* x, int64_t x_rows, __nv_bfloat16* recv,
                  int64_t recv_rows);
  Status Combine(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* out, int64_t out_rows, __nv_bfloat16* y,
                 int64_t y_rows);
  Status CombineBackward(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* dy, int64_t dy_rows, __nv_bfloat16* d_out,
                         int64_t d_out_rows, float* dgates);
  Status DispatchBackward(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* d_recv, int64_t d_recv_rows,
                          __nv_bfloat16* dx, int64_t dx_rows);

  // The same with the layer's own context per rank (one forward at a time).
  Status Forward(int32_t rank, const int32_t* experts, const float* gates, int64_t num_tokens,
                 const __nv_bfloat16* x, __nv_bfloat16* y);
  Status Backward(int32_t rank, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* dgates);

  const LayerConfig& config() const { return config_; }
  const RegionLayout& layout() const { return layout_; }
  void set_expert_kind(ExpertKind kind) { kind_ = kind; }
  float* dw1(int32_t rank) const;
  float* dw2(int32_t rank) const;
  // Plain SGD on the rank's experts from the last backward's dw1/dw2 (enqueued on its stream):
  // w <- bf16(w - lr * dw). Call after Backward on every rank that should step.
  Status ApplySgd(int32_t rank, float lr);
  // The rank's expert weights as fp32 on the host (synchronizes), layout of MoEWeights per local expert.
  StatusOr<std::vector<float>> CopyWeights(int32_t rank, bool w2) const;

  // Host copies of the routing context of the last forward made with the layer's own context, for
  // checks (synchronize the rank's stream).
  StatusOr<RankAcceptance> CopyAcceptance(int32_t rank) const;
  // The full load matrix Lambda [W][E] of the plan in ctx, as every rank holds it after phase 1
  // (synchronizes the rank's stream); needs LayerConfig::load_matrix.
  StatusOr<std::vector<int64_t>> CopyLoadMatrix(const ForwardContext& ctx) const;
  StatusOr<std::vector<OwnerTraceEntry>> CopyOwnerTrace(int32_t rank) const;
  std::vector<int64_t> owner_rows_per_expert(int32_t rank) const;
  StatusOr<std::vector<float>> CopyExpertOutputs(int32_t rank) const;  // [n*K][H]
  int64_t segments(int32_t rank) const;
  // Whether rank's last forward ran its segments as the pipeline (LayerConfig::overlap_segments, more
  // than one segment, the sync-free layer); its backward does too.
  bool overlapped(int32_t rank) const;
  bool overlapped(const ForwardContext& ctx, int32_t rank) const;  // the forward held in ctx
  // Whether rank's last Forward or Backward in the layer's own context combined the owner's rows in place: W = 1, one
  // segment, no owner_reduce, RDEP_W1_RETURN not `copy` when the layer was made (no return copy). The caller's-rows
  // steps (Dispatch, Combine, DispatchBackward) combine in place under the same layer settings but are not reported here.
  bool combined_in_place(int32_t rank) const;
  // Whether the forward held in ctx placed rank's rows in per-source windows (LayerConfig::source_windows,
  // region_layout.h): no phase 2 and no routing barriers.
  bool source_windows(const ForwardContext& ctx, int32_t rank) const;
  // Whether this layer's Forward takes per-source windows: LayerConfig::source_windows, dropless, no
  // balancing, one node, no load matrix, one segment (S >= W*T).
  bool SourceWindows() const;
  // Testing only: in the overlapped pipeline, block the compute stream for compute_ns before each
  // segment's compute, and the domain's stream for return_ns before each segment's return (a host
  // function that sleeps; 0 = none), so that a missing wait between the two streams shows as a wrong
  // result even where the compute finishes far ahead of the transport (cuda_overlap_test.cc).
  void SetPipelineDelaysForTesting(int64_t compute_ns, int64_t return_ns) {
    pipeline_delay_ns_[0] = compute_ns;
    pipeline_delay_ns_[1] = return_ns;
  }

  // Balancing (LayerConfig::balance): the plan the forward in ctx used (the same on every rank) and
  // what it did (telemetry as the host layer's; bytes count bf16 weights), and where each of its route
  // slots is computed. Synchronize the rank's stream;
  // FailedPrecondition without a planned forward of this layer or with balancing off.
  StatusOr<BalancePlan> balance_plan(const ForwardContext& ctx) const;
  StatusOr<BalanceTelemetry> balance_telemetry(const ForwardContext& ctx) const;
  StatusOr<RowInstances> CopyRowInstances(const ForwardContext& ctx) const;
  // The chunk relays the forward in ctx streams its replicas' weights through (PlanRelays' rule,
  // computed on the device from its plan; BalanceConfig::relay_above); empty when no expert has more
  // than relay_above replicas. Synchronizes the rank's stream.
  StatusOr<RelayPlan> balance_relays(const ForwardContext& ctx) const;
  // The same for the last forward made with the layer's own context on `rank`.
  StatusOr<BalancePlan> balance_plan(int32_t rank) const;
  StatusOr<BalanceTelemetry> balance_telemetry(int32_t rank) const;
  StatusOr<RowInstances> CopyRowInstances(int32_t rank) const;
  // The first index of the redundant slots in a rank's physical local experts (layout L - N_slot).
  int64_t slot_base() const { return layout_.L - config_.replica_slots(); }
  // Test hook: each forward and backward adds 8 to the first 8 weights (the first 16-byte vector) of
  // the first replica with rows that each rank streams (a corrupted tile; for a relayed expert, in the
  // relay of chunk 0, before the relays pass it on), so exactness tests can show that they catch a bad copy.
  void set_replica_fault_for_test(bool on) { replica_fault_ = on; }

  // Two-phase exchange (LayerConfig::nodes > 1): what the last forward with the layer's own context
  // moved on `rank` (rows, bytes of records with their metadata, and the device time of each hop).
  // Synchronizes the rank's stream; FailedPrecondition without such a forward.
  StatusOr<NodeTraffic> node_traffic(int32_t rank) const;
  // The byte sizes of this backend's two-phase records (bf16 rows), for rdep::model::PredictTwoPhaseTraffic.
  model::TwoPhaseWire two_phase_wire() const;

  // Records CUDA events at phase boundaries of every later call (cheap; off by default). routing_detail
  // adds three events inside a forward's routing phase (PhaseTimes::route_*_ms), which cost a few
  // microseconds of their own: time the phases without it, the parts in a separate pass.
  Status EnableProfiling(bool on, bool routing_detail = false);
  // Phase times of the rank's last forward or backward (synchronizes the rank's stream).
  StatusOr<PhaseTimes> LastPhaseTimes(int32_t rank, bool backward) const;
  // Device bytes this layer holds on the rank (symmetric regions, weights, workspaces, its own
  // context), without the shared regions (replica_slot_bytes, shared_row_bytes); caller-owned contexts
  // report theirs (ForwardContext::bytes).
  size_t device_bytes(int32_t rank) const;
  // Device bytes per rank of the redundant slots (bf16 weights and fp32 gradients, [N_slot][3*H*F]
  // each; 0 with balancing off). Every balanced layer of the same slot size on the domain shares them
  // (Domain::AcquireShared): count them once per domain and slot size, not once per layer
  // (CudaDomain::symmetric_bytes_per_rank does). Sharing is safe because each call streams its
  // replicas' weights before it computes (backward again), zeroes the slot gradients at its first
  // backward segment and reduces them into the owners' gradients before its backward returns; the
  // domain's barriers order one call's use of the slots before the next call's stores.
  size_t replica_slot_bytes() const {
    return static_cast<size_t>(config_.replica_slots()) * static_cast<size_t>(3 * config_.shape.hidden * config_.shape.ffn) * 6;
  }
  // Device bytes per rank of the owner's output rows (one segment's expert outputs in forward; its dout and
  // dx rows in backward, OwnerOutputRowSets): a scratch no call keeps past its return, shared by every layer
  // of the same size on the domain (Domain::AcquireShared, "owner.out_rows"), so a stack of N identical layers
  // holds it once, not N times. Count it once per domain and size, like replica_slot_bytes. With the CUTLASS
  // expert compute also its SwiGLU scratch (z forward, dz then z backward: D_ff values a row of one segment's
  // rows, kernels::CutlassExpertScratchBytes), shared the same way ("expert.scratch"), except at W = 1 with
  // one segment, where it lives in the return region (ScratchInReturnRegion) and adds nothing. The regions are matched
  // by size (a cuBLASLt and a CUTLASS layer of one shape share neither: one set of output rows against two),
  // so this sum is not a key to deduplicate layers by: the domain's shared_bytes_per_rank is the total.
  size_t shared_row_bytes() const { return out_rows_bytes_ + expert_scratch_bytes_; }
  // The bytes one forward on `rank` asks the row allocator for (SetRowAllocator): its saved rows, what
  // PrepareRows and the forward reserve, each request rounded up to kRowAllocAlign bytes. A caller that hands
  // out consecutive kRowAllocAlign-aligned pieces of one buffer of this size serves the forward (rdep.torch's
  // capturable ops: the rows are then a tensor the caller's framework tracks). 0 without an allocator.
  static constexpr size_t kRowAllocAlign = 256;
  size_t row_allocator_bytes(int32_t rank) const;
  // Device bytes per rank of the segment payload, its sideband and the return region when they are shared
  // by the domain's layers of their size (LayerRegions::shared_transport: one domain, nodes = 1; "layer.*"
  // regions, held once however many layers use them), else 0 (then device_bytes counts them).
  size_t shared_transport_bytes() const { return regions_.shared_transport ? LayerRegions::SharedTransportBytes(layout_) : 0; }
  // Every shared region this layer uses (replica slots, output rows and scratch, transport regions): what
  // a layer alone, or the first of a stack of layers of one size, adds to device_bytes.
  // Device bytes per rank of the paged stash (LayerConfig::stash_rows): the transient owner rows of the worst
  // case and the page pool with its free list, both shared by the domain's layers of one shape and pool size
  // (Domain::AcquireShared, "stash.*"), and the W outcome words every stashing layer of the domain shares
  // ("stash.flags"); 0 without a stash.
  size_t stash_bytes() const { return stash_rows_bytes_ + stash_pool_bytes_ + stash_ring_bytes_ + stash_flags_bytes_; }
  size_t shared_bytes() const { return replica_slot_bytes() + shared_row_bytes() + shared_transport_bytes() + stash_bytes(); }

 private:
  struct RankState;
  struct Saved;
  CudaMoELayer(CudaDomain& domain, LayerConfig config, OwnershipMap ownership);
  static StatusOr<std::unique_ptr<CudaMoELayer>> CreateLayer(CudaDomain& domain, const LayerConfig& config,
                                                             const OwnershipMap& ownership, const MoEWeights* weights);
  Status UploadWeights(RankState& st, const OwnershipMap& ownership, int32_t q, const MoEWeights& weights);
  Status CheckLocalRank(int32_t rank) const;
  StatusOr<std::unique_ptr<Saved>> NewSaved(int32_t rank) const;
  const Saved* last(int32_t rank) const;
  Status Exchange(int32_t rank, RankState& st, Saved& sv, bool backward, const __nv_bfloat16* payload);
  // Where each accepted slot computes: its expert's owner, or with balancing the instance the plan gave it.
  dispatch::RouteTargets Targets(const RankState& st, const Saved& sv) const;
  Status OwnerForwardSegment(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload);
  Status OwnerBackwardSegment(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload);
  Status FillWeightGrads(RankState& st, int byte, cudaStream_t stream);  // every byte: 0, or 0xFF (NaN)
  Status CheckOwnWeightsInGrads(int32_t rank) const;  // weights_in_grads.h, for this rank's own arrays
  Status FillBackwardWithNaN(int32_t rank, RankState& st, const Saved& sv, __nv_bfloat16* dx, float* dgates);
  // The owner work without host waits (expert compute reading device counts, no balancing, the SwiGLU
  // kind; with nodes > 1 only in one segment): buffers sized for the worst case at the context's creation,
  // SyncFreeSegments() segments per call (cuda_sync_free.cc).
  bool SyncFree(const RankState& st) const;
  int64_t SyncFreeSegments() const;
  Status OwnerForwardSyncFree(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload);
  Status OwnerBackwardSyncFree(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload);
  Status ReserveSyncFree(const RankState& st, Saved& sv) const;
  kernels::ExpertRows SegmentRows(RankState& st, const Saved& sv, int64_t seg) const;
  // A sync-free segment's owner work in two parts: up to the return (recording read_done, if any, once the
  // segment's payload is read), and the return of its rows; on the stream given.
  Status ComputeForwardSyncFree(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload, __nv_bfloat16* out,
                                cudaStream_t stream, cudaEvent_t read_done);
  Status ComputeBackwardSyncFree(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload,
                                 __nv_bfloat16* rows, cudaStream_t stream, cudaEvent_t read_done);
  Status ReturnSyncFree(int32_t rank, const RankState& st, const Saved& sv, int64_t seg, const __nv_bfloat16* rows, cudaStream_t stream);
  // LayerConfig::overlap_segments (cuda_overlap.cc): the segments as a pipeline on the domain's stream
  // (scatter, barriers, returns) and the rank's compute stream (expand, gather, expert compute).
  Status CreateOverlap(RankState& st) const;
  static void DestroyOverlap(RankState& st);
  bool Overlapped(const RankState& st, const Saved& sv, bool backward) const;
  Status ExchangeOverlapped(int32_t rank, RankState& st, Saved& sv, bool backward, const __nv_bfloat16* payload);
  Status RunPipeline(int32_t rank, RankState& st, Saved& sv, bool backward, const __nv_bfloat16* payload);
  Status FinishExchange(int32_t rank, RankState& st, Saved& sv, bool backward);
  Status ReserveSavedF(const RankState& st, Saved& sv) const;  // the front-end's returned rows kept for dgate
  // W = 1 in one segment without owner_reduce: every row returns to this rank, so the combine reads the owner's
  // rows where the expert compute left them, through the slot map the forward's expand wrote (Saved::slot_rows),
  // instead of their copy into the return region (RDEP_W1_RETURN=copy keeps the copy, for A/B runs).
  bool CombinesInPlace(const Saved& sv) const;
  // The front-end's combine of this call's rows into out (the return region, or the rows in place).
  Status FrontCombine(int32_t rank, const Saved& sv, const float* weights, __nv_bfloat16* out, __nv_bfloat16* save);
  // The combine of `rows` rows in place through the slot map, or (in_place null) of the return region; FrontCombine's
  // and the caller's rows' (CombineCallerRows).
  Status CombineFrom(int32_t rank, const Saved& sv, const __nv_bfloat16* in_place, int64_t rows, const float* weights,
                     __nv_bfloat16* out, __nv_bfloat16* save);
  // The paged stash (LayerConfig::stash_rows; cuda_stash.cc): the sync-free owner's saved rows (x, h, f)
  // live in the shared transient rows during a call and in pool pages between forward and backward.
  struct OwnerRows {
    __nv_bfloat16 *x, *h, *f;  // f: null unless OwnerKeepsOutputs (owner_reduce without gate_in_expert)
  };
  bool Stashing(const RankState& st) const;
  Status RefuseStashInCapture(int32_t rank, const char* call) const;
  Status AcquireStash();
  OwnerRows SavedOwnerRows(int32_t rank, const RankState& st, const Saved& sv) const;
  Status ReserveStash(Saved& sv) const;
  cuda_layer::StashRows StashView(int32_t rank, const RankState& st, Saved& sv) const;
  cuda_layer::StashPool StashPoolOf(int32_t rank) const;
  // Forward, before its final barrier: the pages taken, and the outcome into every rank's flags; after the
  // barrier: the copy into the pages, and the flags (every rank's outcome) to the host.
  Status StashSaved(int32_t rank, const RankState& st, Saved& sv);
  Status StashOutcomeAfterBarrier(int32_t rank, const RankState& st, Saved& sv);
  // Backward, before anything collective: the pages back into the transient rows; when any rank's forward
  // overflowed its pool, every rank fills dx, dgates and its weight gradients with NaN and fails here.
  Status UnstashSaved(int32_t rank, RankState& st, Saved& sv, __nv_bfloat16* dx, float* dgates);
  Status ReleaseStash(int32_t rank, Saved& sv);
  StatusOr<std::vector<int64_t>> DeviceCounts(int32_t rank, const Saved& sv) const;
  Status Mark(int32_t rank, RankState& st, bool backward, int phase);
  Status CheckRoutingInput(int32_t rank, Saved& sv, bool wait);
  Status ArmForward(int32_t rank, Saved& sv);  // a completed forward, for its backward's device check
  Status CheckRowsSupported(const char* call) const;
  Status HostRecvCounts(int32_t rank, Saved& sv);
  Status CheckRows(const char* call, int32_t rank, const char* what, int64_t got, int64_t want, const char* formula) const;
  Status CheckCallerRows(const char* call, int32_t rank, const ForwardContext& ctx, const char* received, int64_t received_rows,
                         const char* per_token, int64_t token_rows) const;
  Status CombineCallerRows(int32_t rank, const Saved& sv, const __nv_bfloat16* rows, bool backward, const float* weights,
                           __nv_bfloat16* out, __nv_bfloat16* save);
  // Balancing (cuda_balance.cc).
  struct ExpertCall;
  Status CreateBalancing(RankState& st);
  Status PlanBalanced(int32_t rank, RankState& st, Saved& sv);
  // Plan with windows allowed (Forward) or not (Plan: the caller's experts need the counts at the plan).
  Status PlanFor(int32_t rank, ForwardContext& ctx, const int32_t* experts, const float* gates, int64_t num_tokens,
                 bool windows_allowed);
  // The plan when every source has a fixed window (dispatch::LaunchWindowPlan, from the caller's routing):
  // the check, positions, every row accepted, the control copy of window words; no peer memory touched.
  Status PlanWindowed(int32_t rank, RankState& st, Saved& sv, const int32_t* experts, const float* gates);
  Status SolveBalancePlan(int32_t rank, RankState& st, Saved& sv);
  Status StreamReplicas(int32_t rank, RankState& st, const Saved& sv, bool backward);
  Status ReduceReplicas(int32_t rank, RankState& st, const Saved& sv);
  std::vector<ExpertCall> ExpertCalls(int32_t rank, RankState& st, const int64_t* dev_counts, const std::vector<int64_t>& counts,
                                      bool first_segment = false) const;
  int32_t physical_experts(const RankState& st) const;
  const Saved* balanced_saved(const ForwardContext& ctx, Status* why) const;

  // Two-phase exchange across nodes (LayerConfig::nodes > 1; cuda_two_phase.cc).
  Status ReserveTwoPhase(Saved& sv) const;
  Status RunTwoPhase(int32_t rank, ForwardContext& ctx, RankState& st, Saved& sv, const __nv_bfloat16* x, __nv_bfloat16* y);
  Status BackwardTwoPhase(int32_t rank, RankState& st, Saved& sv, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* dgates);
  Status ExchangeTwoPhase(int32_t rank, RankState& st, Saved& sv, bool backward, const __nv_bfloat16* payload,
                          __nv_bfloat16* out, float* dgates);
  Status CheckNodeCap(int32_t rank, const Saved& sv) const;
  StatusOr<std::vector<float>> CopyExpertOutputsTwoPhase(int32_t rank) const;
  // Owner: a segment's rows [base, base+m) of the grouped rows back by row id, to their front-ends
  // (one domain) or to their sources' relays in this node (nodes > 1).
  Status ReturnRows(int32_t rank, const __nv_bfloat16* rows, const Saved& sv, int64_t base, int64_t m, cudaStream_t stream);
  // LayerConfig::owner_reduce (cuda_owner_reduce.cc). Front-end: lead slots (forward) and the sum of the
  // lead rows into out; dgates from the owners' dots. Owner: a segment's token sums into the lead rows
  // (rows at grouped index [base, base + m) of the segment), and its rows' dots in backward.
  Status CombineReduced(int32_t rank, Saved& sv, bool backward, __nv_bfloat16* out);
  Status DgatesFromDots(int32_t rank, RankState& st, const Saved& sv, float* dgates);
  Status ReturnReduced(int32_t rank, const __nv_bfloat16* rows, const Saved& sv, int64_t seg, int64_t base, bool backward);
  Status OwnerDots(int32_t rank, const uint16_t* seg_dy, const Saved& sv, int64_t base, int64_t m, const int64_t* device_rows);
  int32_t* SegmentInv(const Saved& sv, int64_t seg) const;

  CudaDomain& domain_;
  LayerConfig config_;
  OwnershipMap ownership_;
  RegionLayout layout_;
  LayerRegions regions_;
  RegionId replica_w_ = -1, replica_g_ = -1;  // balancing: [N_slot][w1 | w2] per rank, bf16 weights, fp32 gradients
                                              // (shared regions: Domain::AcquireShared)
  RegionId out_rows_ = -1;                    // the owner's output rows (shared: shared_row_bytes)
  size_t out_rows_bytes_ = 0;
  int64_t pipeline_delay_ns_[2] = {0, 0};  // SetPipelineDelaysForTesting: before each compute, before each return
  RegionId expert_scratch_ = -1;              // the CUTLASS compute's z, then dz (shared: shared_row_bytes)
  size_t expert_scratch_bytes_ = 0;           // 0 when it lives in the return region (scratch_in_return_)
  bool scratch_in_return_ = false;            // ScratchInReturnRegion: W = 1, one segment (layer_config.h)
  bool w1_in_place_ = false;                  // CombinesInPlace's layer half: W = 1, no owner_reduce, RDEP_W1_RETURN
  __nv_bfloat16* OutRows(int32_t rank) const { return static_cast<__nv_bfloat16*>(domain_.region(rank, out_rows_)); }
  RegionId stash_rows_ = -1, stash_pool_ = -1, stash_ring_ = -1, stash_flags_ = -1;  // the paged stash (shared: stash_bytes)
  size_t stash_rows_bytes_ = 0, stash_pool_bytes_ = 0, stash_ring_bytes_ = 0, stash_flags_bytes_ = 0;
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);  // false from the destructor on (contexts' stash hooks)
  bool replica_fault_ = false;
  bool relays_possible_ = false;  // some plan may relay (every rank then takes the relay barrier in StreamReplicas)
  ExpertKind kind_ = ExpertKind::kSwiGLU;
  bool profiling_ = false;
  bool routing_detail_ = false;
  uint64_t id_ = 0;  // process-unique; contexts remember it
  std::vector<std::unique_ptr<RankState>> ranks_;
  std::unique_ptr<DeviceInterNodeExchange> inter_;  // nodes > 1: phase A and the return hop
};

}  // namespace rdep
