// The CUDA layer's state per rank and what one forward saves (shared by cuda_moe_layer.cc and
// cuda_rows.cc; internal to the layer library).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rdep/balance/gpu_planner.h"
#include "rdep/balance/layer_balance.h"
#include "rdep/balance/plan.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {

namespace cuda_layer {

using dispatch::bf16_bits;

// Profiling marks: the phase a recorded event closes (CudaMoELayer::Mark, LastPhaseTimes).
enum MarkPhase {
  kMarkStart, kMarkRouting, kMarkDispatch, kMarkExpert, kMarkReturn, kMarkCombine, kMarkPlan, kMarkStream, kMarkReduce,
  kMarkRouteLocal, kMarkRouteCounts, kMarkRouteScan,  // parts of routing, with EnableProfiling(true, true)
  kMarkReturnWait,  // the one-domain exchange's final barrier: part of return_ms, also in return_wait_ms
};

// This thread's stream-capture mode set to relaxed for the scope's life, then restored. A context's first
// forward allocates its buffers (cudaMalloc, cudaHostAlloc: CudaMoELayer::NewSaved); when that forward is being
// captured (a new pinned context: CUDA graph trees record one per forward node), those calls would invalidate the
// capture in the global or thread-local mode. They are not stream work and the buffers outlive the graph (a
// captured context is kept while the layer lives), so the capture may ignore them.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCaptureScope() {
    if (ok_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

// A device buffer that keeps its allocation across calls and grows only when asked for more.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Free(); }
  // Set while ptr came from a caller's allocator (ReserveWith): Free gives it back there.
  RowAllocator ext{};
  int ext_device = 0;
  Status Reserve(size_t n) {
    if (n <= count) return Status::Ok();
    Free();
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
    count = n;
    return Status::Ok();
  }
  // The same from the caller's allocator a (its alloc ordered on the caller's stream s of device d).
  Status ReserveWith(size_t n, const RowAllocator& a, int d, cudaStream_t s) {
    if (n <= count) return Status::Ok();
    Free();
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    void* p = a.alloc(a.user, bytes, d, static_cast<void*>(s));
    if (!p)
      return Unavailable("the caller's row allocator returned no memory for " + std::to_string(bytes) + " bytes on device " +
                         std::to_string(d));
    ptr = static_cast<T*>(p);
    count = n;
    ext = a;
    ext_device = d;
    return Status::Ok();
  }
  // Grows keeping the first `keep` elements (stream-ordered copy, then a sync before the free).
  Status Grow(size_t n, size_t keep, cudaStream_t s) {
    if (n <= count) return Status::Ok();
    T* fresh = nullptr;
    const size_t want = std::max(n, count + count / 2);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&fresh, want * sizeof(T)));
    if (keep) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(fresh, ptr, keep * sizeof(T), cudaMemcpyDeviceToDevice, s));
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    Free();
    ptr = fresh;
    count = want;
    return Status::Ok();
  }
  void Free() {
    if (ptr && ext.free) ext.free(ext.user, ptr, count * sizeof(T), ext_device);
    else if (ptr) cudaFree(ptr);
    ptr = nullptr;
    count = 0;
    ext = {};
  }
};

// A context's saved-row buffer (CudaMoELayer::SetRowAllocator): from the caller's allocator when the rank
// has one (on the caller's stream), else cudaMalloc.
template <typename T>
Status ReserveRows(DeviceBuffer<T>& b, size_t n, const RowAllocator& a, int device, cudaStream_t caller) {
  return a.alloc ? b.ReserveWith(n, a, device, caller) : b.Reserve(n);
}

inline const bf16_bits* Bits(const __nv_bfloat16* p) { return reinterpret_cast<const bf16_bits*>(p); }
inline bf16_bits* Bits(__nv_bfloat16* p) { return reinterpret_cast<bf16_bits*>(p); }

// A forward's own copy of its balance plan on the device (the DevicePlanner's buffers belong to the
// next solve; backward streams and reduces with this copy). The arrays of DevicePlanView, sized for
// E experts, W ranks and N_slot slots per rank: at most I_max = E + W*N_slot instances; route is
// [W][I] with I = offsets[E] (I_max*W words reserved). Methods in cuda_balance.cc.
struct DevicePlanCopy {
  int32_t E = 0, W = 0, slots = 0;
  DeviceBuffer<int32_t> offsets, expert, rank, slot, slot_expert, route;  // [E+1], [I_max] x3, [W*N_slot], [W*I_max]
  DeviceBuffer<int64_t> quota, admitted, misc;                             // [I_max], [W*E], [4]
  // The plan's chunk relays (LaunchPlanRelays; only when the layer may relay): m per expert [E], the
  // chunk each instance relays [I_max] and its byte range [I_max][2], the number of relayed experts [1]; the rule's scratch
  // (load [W], wide [E]).
  bool relays = false;
  DeviceBuffer<int32_t> relay_chunks, relay_chunk_of, relay_count, relay_wide;
  DeviceBuffer<int64_t> relay_range;  // [I_max][2]
  DeviceBuffer<double> relay_load;
  Status Reserve(int32_t num_experts, int32_t num_ranks, int32_t num_slots, bool with_relays);
  DeviceRelayView relay_view() const {
    return relays ? DeviceRelayView{relay_chunks.ptr, relay_chunk_of.ptr, relay_range.ptr} : DeviceRelayView{};
  }
  // The relays of the last plan on the host (synchronizes s); empty without relays.
  StatusOr<RelayPlan> DownloadRelays(cudaStream_t s) const;
  int64_t max_instances() const { return static_cast<int64_t>(E) + static_cast<int64_t>(W) * slots; }
  // Enqueues device-to-device copies of a plan on the device (a DevicePlanner's view).
  Status CopyFrom(const DevicePlanView& v, cudaStream_t s);
  // Enqueues copies of a plan solved on the host, with its admitted load [W][E].
  Status Upload(const BalancePlan& p, const std::vector<int64_t>& admitted_load, cudaStream_t s);
  DevicePlanView view() const;
  // The plan on the host (synchronizes s); InternalError when the planner flagged a fault.
  StatusOr<BalancePlan> Download(cudaStream_t s) const;
  StatusOr<std::vector<int64_t>> DownloadAdmitted(cudaStream_t s) const;
  void Free() {
    for (auto* b : {&offsets, &expert, &rank, &slot, &slot_expert, &route, &relay_chunks, &relay_chunk_of, &relay_count, &relay_wide})
      b->Free();
    for (auto* b : {&quota, &admitted, &misc, &relay_range}) b->Free();
    relay_load.Free();
  }
  size_t bytes() const {
    return (offsets.count + expert.count + rank.count + slot.count + slot_expert.count + route.count) * 4 +
           (quota.count + admitted.count + misc.count) * 8 +
           (relay_chunks.count + relay_chunk_of.count + relay_count.count + relay_wide.count) * 4 +
           (relay_load.count + relay_range.count) * 8;
  }
};

struct TwoPhaseSaved;                          // layer/cuda_two_phase.h
size_t TwoPhaseBytes(const TwoPhaseSaved* tp);  // 0 for null

}  // namespace cuda_layer

// What a forward saves for its backward on one rank (held by a ForwardContext; device buffers on
// the rank's GPU, freed with the context).
struct CudaMoELayer::Saved final : ForwardContext::State {
  int device = 0;
  // Front-end: the routing as validated, the accepted set and effective gates, each token's place in
  // each owner's stream, the returned rows (for dgate), and a copy of this rank's control words after
  // phase 2 (backward's scatter reads its send offsets from it; the live region belongs to the next forward).
  int64_t num_tokens = 0;
  cuda_layer::DeviceBuffer<int32_t> experts, tok_index;
  cuda_layer::DeviceBuffer<float> gates, effective;
  cuda_layer::DeviceBuffer<uint8_t> accepted;
  cuda_layer::DeviceBuffer<int32_t> armed;  // [1] set by each completed forward, taken by its backward (CudaDomain::TakeForward)
  cuda_layer::DeviceBuffer<int64_t> dropped, control;  // dropped: [0] rows dropped (zeroed by the routing check's second kernel), [1] the check's word (zeroed once when
                                                       // the context is made; the check leaves it 0)
  cuda_layer::DeviceBuffer<__nv_bfloat16> saved_f;  // [T*K][H] returned rows, kept for dgate (not with owner_reduce)
  cuda_layer::DeviceBuffer<uint8_t> lead;           // owner_reduce: [T*K] slots whose return rows carry an owner's sum
  // CombinesInPlace (W = 1): each accepted slot's grouped row ([T*K], the forward's expand), and where this call's
  // rows are (the forward's outputs, the backward's dx rows: set by the owner's segment, read by the combine).
  cuda_layer::DeviceBuffer<int32_t> slot_rows;
  const __nv_bfloat16* combine_rows = nullptr;
  // Owner: every segment's grouped rows, inputs and pre-activations.
  int64_t num_segments = 0;
  std::vector<std::vector<int64_t>> seg_rows;  // host: per segment, rows per local expert
  std::vector<int64_t> seg_base;               // host: first grouped row of each segment
  int64_t total_rows = 0;
  cuda_layer::DeviceBuffer<dispatch::GroupedRow> grouped;
  cuda_layer::DeviceBuffer<__nv_bfloat16> x_rows, h_rows;
  // owner_reduce: the expert outputs f_k (dgate's dots in backward; not with gate_in_expert) and, per segment, each token
  // position's rows as grouped indices ([S][slots_per_token], LaunchExpand's inv).
  cuda_layer::DeviceBuffer<__nv_bfloat16> f_rows;
  cuda_layer::DeviceBuffer<int32_t> inv;
  cuda_layer::DeviceBuffer<int64_t> rows_per_expert;       // the plan's admitted rows per local expert (owner scan);
                                                           // with balancing per physical index [layout L]
  // Balancing (LayerConfig::balance): the plan, where each route slot is computed (rank and physical
  // local index, -1 for a dropped slot), the logical expert of each physical index of this rank
  // (sentinel echo), and the plan's status words copied to the host (pinned [4], with the routing
  // fault: final at fault_copied).
  cuda_layer::DevicePlanCopy plan;
  cuda_layer::DeviceBuffer<int32_t> dest_rank, dest_local;  // [T*K]
  cuda_layer::DeviceBuffer<int32_t> phys_global;            // [layout L]
  int64_t* host_plan_misc = nullptr;
  // Dispatch/combine with the caller's experts: rows_per_expert on the host (read once per plan).
  std::vector<int64_t> recv_counts;
  bool have_recv_counts = false;
  // Sync-free owner work (CudaMoELayer::SyncFree): the one segment's rows per physical expert and their
  // total, on the device only [phys + 1]; the host never learns them during the call.
  cuda_layer::DeviceBuffer<int64_t> dev_counts;
  bool counts_on_device = false;
  bool overlapped = false;  // the forward ran its segments as the pipeline (LayerConfig::overlap_segments)
  // Per-source windows (CudaMoELayer::PlanWindowed): the plan exchanged nothing; this rank's tokens for each
  // owner ([W], device), whose window tails its scatters clear (forward and backward).
  bool windowed = false;
  cuda_layer::DeviceBuffer<int64_t> window_tokens;
  // The paged stash (LayerConfig::stash_rows; cuda_stash.cc): the pool pages this context's owner rows
  // are in ([StashMaxPages]), the device state ([0] pages held or -1 after an overflow, [1] rows << 32 |
  // pages needed), every rank's outcome of the same forward copied to the host after its final barrier
  // ([W]: rows << 32 | pages needed, or -1), and the event after that copy.
  cuda_layer::DeviceBuffer<int32_t> stash_pages;
  cuda_layer::DeviceBuffer<int64_t> stash_state;
  int64_t* stash_outcomes_host = nullptr;
  cudaEvent_t stash_taken = nullptr;
  bool stash_held = false;  // a forward stashed rows that neither a backward nor ReleaseRows gave back yet
  std::function<void()> stash_give_back;  // gives held pages back when the context is freed (a no-op once the layer is gone)
  bool fault_unchecked = false;  // sync-free forward: the routing check had not completed when it returned
  bool fault_in_capture = false;  // the plan ran in a stream capture: fault_copied is a graph node, not queryable
  // The plan's input check: the first faulty routing slot, written by the device into mapped pinned
  // memory; final when the event after the check has completed.
  dispatch::RoutingFault* host_fault = nullptr;
  dispatch::RoutingFault* fault_dev = nullptr;  // the device's view of host_fault
  cudaEvent_t fault_copied = nullptr;
  // Two-phase exchange (LayerConfig::nodes > 1; cuda_two_phase.cc): bundles, relayed records, kept rows.
  std::shared_ptr<cuda_layer::TwoPhaseSaved> two_phase;
  ~Saved() override {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device);
    if (host_fault) cudaFreeHost(host_fault);
    if (host_plan_misc) cudaFreeHost(host_plan_misc);
    if (stash_held && stash_give_back) stash_give_back();  // before the page table is freed (cudaFree waits for the kernel)
    if (stash_taken) cudaEventSynchronize(stash_taken);  // the outcomes' copy into stash_outcomes_host has landed
    if (stash_outcomes_host) cudaFreeHost(stash_outcomes_host);
    if (stash_taken) cudaEventDestroy(stash_taken);
    stash_pages.Free();
    stash_state.Free();
    plan.Free();
    for (auto* b : {&dest_rank, &dest_local, &phys_global}) b->Free();
    if (fault_copied) cudaEventDestroy(fault_copied);
    for (auto* b : {&experts, &tok_index}) b->Free();
    for (auto* b : {&gates, &effective}) b->Free();
    for (auto* b : {&dropped, &control, &rows_per_expert, &dev_counts, &window_tokens}) b->Free();
    for (auto* b : {&saved_f, &x_rows, &h_rows, &f_rows}) b->Free();
    accepted.Free();
    lead.Free();
    inv.Free();
    slot_rows.Free();
    grouped.Free();
    cudaSetDevice(current);
  }
  size_t bytes() const override {
    return (experts.count + tok_index.count + gates.count + effective.count + inv.count + slot_rows.count + armed.count) * 4 +
           accepted.count + lead.count +
           (dropped.count + control.count + rows_per_expert.count + dev_counts.count + stash_state.count + window_tokens.count) * 8 +
           stash_pages.count * 4 +
           (saved_f.count + x_rows.count + h_rows.count + f_rows.count) * 2 +
           grouped.count * sizeof(dispatch::GroupedRow) + plan.bytes() + (dest_rank.count + dest_local.count + phys_global.count) * 4 + cuda_layer::TwoPhaseBytes(two_phase.get());
  }
};

// The layer's own state per rank: weights, gradients, workspaces reused by every call.
struct CudaMoELayer::RankState {
  int device = 0;
  RowAllocator rows;                   // SetRowAllocator: where contexts' saved rows come from (all-null: cudaMalloc)
  cudaStream_t caller_stream = nullptr;  // SetCallerStream: the caller's stream of the next calls
  int32_t num_local = 0;
  std::unique_ptr<kernels::ExpertCompute> mlp;  // expert compute (cuBLASLt implementation)
  // Balancing: the rank's device planner (ultraep), the expert compute of one redundant slot (one
  // expert: the slot's [w1 | w2] is one expert's weights; called once per slot with rows), and the
  // EPLB baseline's history (admitted rows per expert of the last plan, identical on every rank).
  std::unique_ptr<DevicePlanner> planner;
  std::unique_ptr<kernels::ExpertCompute> slot_mlp;
  std::vector<double> eplb_history;
  // Weights (bf16) and gradients (fp32) of this rank's experts (the layer's own, unless the caller's
  // are bound; a layer created without weights has none of its own); ownership map on the device.
  cuda_layer::DeviceBuffer<__nv_bfloat16> w1, w2;
  cuda_layer::DeviceBuffer<float> dw1, dw2;
  size_t w1_count = 0, w2_count = 0;  // E_loc * H * 2F, E_loc * F * H
  bool own_weights = false;
  ExternalWeights<__nv_bfloat16, float> bound;
  __nv_bfloat16* bound_dw1_bf16 = nullptr;  // bf16 gradients bound instead of fp32 ones
  __nv_bfloat16* bound_dw2_bf16 = nullptr;
  kernels::ExpertWeightsView weights() const { return {bound.w1 ? bound.w1 : w1.ptr, bound.w1 ? bound.w2 : w2.ptr}; }
  kernels::ExpertGradsView grads() const {
    if (bound_dw1_bf16) return {nullptr, nullptr, bound_dw1_bf16, bound_dw2_bf16};
    return {bound.dw1 ? bound.dw1 : dw1.ptr, bound.dw1 ? bound.dw2 : dw2.ptr};
  }
  bool has_weights() const { return bound.w1 || own_weights || num_local == 0; }
  bool has_grads() const { return bound.dw1 || bound_dw1_bf16 || own_weights || num_local == 0; }
  cuda_layer::DeviceBuffer<int32_t> owner, local, local_to_global;
  // Workspaces of one call (sized for T tokens at Create).
  cuda_layer::DeviceBuffer<int32_t> rank_in_expert;
  cuda_layer::DeviceBuffer<float> scratch;
  cuda_layer::DeviceBuffer<int64_t> seg_counts;
  cuda_layer::DeviceBuffer<int32_t> count_scratch;   // LaunchCountAndPublish's and LaunchWindowPlan's (the larger need for T tokens)
  cuda_layer::DeviceBuffer<int32_t> expand_scratch;  // LaunchExpand's (dispatch::ExpandScratchInts for the physical experts)
  cuda_layer::DeviceBuffer<float> row_dgates;        // gate_in_expert: a segment's per-row dgates (MaxSegmentRows), backward
  int64_t* host_counts = nullptr;  // pinned [max(num_local, physical experts) + W + 1]
  // Profiling: an event pool and the (phase, event) marks of the last forward / backward.
  std::vector<cudaEvent_t> events;
  std::vector<std::pair<int, cudaEvent_t>> marks[2];
  // LayerConfig::overlap_segments (cuda_overlap.cc): the stream the experts compute on while the domain's
  // stream carries the transport, and the events that order the two. Null when the config is off.
  cudaStream_t compute_stream = nullptr;
  struct OverlapEvents {
    cudaEvent_t start = nullptr;      // comm: the call's work before the segments (compute waits on it)
    cudaEvent_t dispatched = nullptr; // comm: segment s's barrier passed (its rows are here)
    cudaEvent_t read = nullptr;       // compute: segment s's payload and sideband read (the buffer half is free)
    cudaEvent_t computed = nullptr;   // compute: segment s's expert outputs written
    cudaEvent_t returned[2] = {};     // comm: segment s's rows returned (its half of the output rows is free), by s % 2
  } overlap;
  // The context of calls made without one.
  ForwardContext own_context;
  // The last collective step was a Plan: a peer may still be copying that plan's control words (its
  // accept runs after the offsets barrier), so a Plan right after it starts with a barrier before it
  // stores into the peers' control words. Any other step passes a barrier of its own first.
  bool plan_copy_pending = false;
};

// One expert-compute call over a run of a segment's grouped rows (CudaMoELayer::ExpertCalls): the
// main experts (physical indices 0..E_loc-1) in one call on the rank's weights; with balancing, each
// redundant slot with rows in a one-expert call on the slot's weights and gradient buffers.
struct CudaMoELayer::ExpertCall {
  kernels::ExpertCompute* mlp = nullptr;
  int64_t first = 0, rows = 0;       // the segment's grouped rows [first, first + rows)
  kernels::ExpertRows counts;        // per-expert counts of the call's experts (device and host)
  kernels::ExpertWeightsView weights;
  kernels::ExpertGradsView grads;
  bool accumulate = false;           // weight gradients added to (fp32) or written (bf16)
};

}  // namespace rdep
