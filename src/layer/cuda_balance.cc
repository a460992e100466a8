// Balancing in the CUDA layer (LayerConfig::balance), the device twin of src/layer/host_balance.cc:
//   Plan      phase 1 stores this rank's row of the load matrix into every rank -> barrier -> every
//             rank applies the capacity rule and solves the same plan on its own GPU in its stream
//             (ultraep: DevicePlanner, no host round trip; eplb, eplb-exact: the baselines have no
//             device planner, so the load matrix comes to the host once and the plan goes back) into
//             the context -> each route slot's acceptance and physical instance (LaunchAssignInstances)
//             and effective gates -> rows per (destination, physical index) and tokens per destination
//             into the destinations' control words -> barrier (dispatch.route) -> phase 2's stream
//             offsets (the plan applied the capacity) -> barrier -> control words into the context.
//   Run, Backward  owners stream their replicated experts' weights into the replicas' slots
//             (LaunchStreamReplicaWeights) before the first segment barrier; owners compute rows of
//             physical indices (the main experts in one call, each slot with rows in a one-expert
//             call); backward accumulates replica gradients in the slot-gradient region, and after
//             backward.done each owner adds its replicas' gradients to its own in instance order.
//   exercise: build-*/src/layer/layer_test --gtest_filter='CudaBalance*'
//             build-*/bin/rdep check --backend cuda --ranks 4 --routing zipf:2 --balance ultraep
#include <algorithm>
#include <climits>
#include <string>

#include "layer/context_access.h"
#include "layer/cuda_balance_kernels.h"
#include "layer/cuda_layer_state.h"
#include "rdep/balance/layer_balance.h"
#include "rdep/cuda/check.h"

namespace rdep {

using namespace cuda_layer;  // MarkPhase, DevicePlanCopy

namespace {

constexpr int64_t kReplicaTileBytes = 64 << 10;  // streaming tile: read once from the owner, stored to every replica

}  // namespace

// ---- the context's copy of the plan ------------------------------------------------------------------

namespace cuda_layer {

Status DevicePlanCopy::Reserve(int32_t num_experts, int32_t num_ranks, int32_t num_slots, bool with_relays) {
  E = num_experts;
  W = num_ranks;
  slots = num_slots;
  const auto imax = static_cast<size_t>(max_instances()), w = static_cast<size_t>(W);
  relays = with_relays;
  if (relays) {
    RDEP_RETURN_IF_ERROR(relay_chunks.Reserve(static_cast<size_t>(E)));
    RDEP_RETURN_IF_ERROR(relay_wide.Reserve(static_cast<size_t>(E)));
    RDEP_RETURN_IF_ERROR(relay_chunk_of.Reserve(imax));
    RDEP_RETURN_IF_ERROR(relay_range.Reserve(2 * imax));
    RDEP_RETURN_IF_ERROR(relay_count.Reserve(1));
    RDEP_RETURN_IF_ERROR(relay_load.Reserve(w));
  }
  RDEP_RETURN_IF_ERROR(offsets.Reserve(static_cast<size_t>(E) + 1));
  for (auto* b : {&expert, &rank, &slot}) RDEP_RETURN_IF_ERROR(b->Reserve(imax));
  RDEP_RETURN_IF_ERROR(quota.Reserve(imax));
  RDEP_RETURN_IF_ERROR(slot_expert.Reserve(w * static_cast<size_t>(slots)));
  RDEP_RETURN_IF_ERROR(route.Reserve(w * imax));
  RDEP_RETURN_IF_ERROR(admitted.Reserve(w * static_cast<size_t>(E)));
  return misc.Reserve(4);
}

namespace {

Status CopyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  if (bytes == 0) return Status::Ok();
  if (!dst || !src) return InternalError("balance plan copy: a buffer is missing");
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, s));
  return Status::Ok();
}

}  // namespace

// The planner's buffers have the same capacities (E+1 offsets, I_max instances, R*I_max route words),
// so copying the whole reserved extent stays in bounds on both sides.
Status DevicePlanCopy::CopyFrom(const DevicePlanView& v, cudaStream_t s) {
  const auto imax = static_cast<size_t>(max_instances()), w = static_cast<size_t>(W);
  const cudaMemcpyKind d2d = cudaMemcpyDeviceToDevice;
  RDEP_RETURN_IF_ERROR(CopyAsync(offsets.ptr, v.instance_offsets, (static_cast<size_t>(E) + 1) * 4, d2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(expert.ptr, v.instance_expert, imax * 4, d2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(rank.ptr, v.instance_rank, imax * 4, d2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(slot.ptr, v.instance_slot, imax * 4, d2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(quota.ptr, v.instance_quota, imax * 8, d2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(slot_expert.ptr, v.slot_expert, w * static_cast<size_t>(slots) * 4, d2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(route.ptr, v.route, w * imax * 4, d2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(admitted.ptr, v.admitted_load, w * static_cast<size_t>(E) * 8, d2d, s));
  return CopyAsync(misc.ptr, v.misc, 4 * 8, d2d, s);
}

// Host sources are pageable: cudaMemcpyAsync returns once they are staged, so the temporaries may go.
Status DevicePlanCopy::Upload(const BalancePlan& p, const std::vector<int64_t>& admitted_load, cudaStream_t s) {
  const auto I = static_cast<size_t>(p.num_instances()), w = static_cast<size_t>(W), e = static_cast<size_t>(E);
  if (p.num_experts != E || p.num_ranks != W || p.instance_offsets.size() != e + 1 || I < e ||
      I > static_cast<size_t>(max_instances()) || p.instance_expert.size() != I || p.instance_slot.size() != I ||
      p.instance_quota.size() != I || p.slot_expert.size() != w * static_cast<size_t>(slots) || p.route.size() != w * I ||
      admitted_load.size() != w * e)
    return InternalError("balance plan upload: the plan (E=" + std::to_string(p.num_experts) + ", R=" + std::to_string(p.num_ranks) +
                         ", " + std::to_string(I) + " instances) does not fit the layer's (E=" + std::to_string(E) + ", W=" +
                         std::to_string(W) + ", at most " + std::to_string(max_instances()) + " instances)");
  std::vector<int32_t> route32(p.route.size());
  for (size_t i = 0; i < route32.size(); ++i) {
    if (p.route[i] < 0 || p.route[i] > INT32_MAX) return InternalError("balance plan upload: a route count exceeds int32");
    route32[i] = static_cast<int32_t>(p.route[i]);
  }
  const int64_t status[4] = {p.threshold, 0, 0, 0};
  const cudaMemcpyKind h2d = cudaMemcpyHostToDevice;
  RDEP_RETURN_IF_ERROR(CopyAsync(offsets.ptr, p.instance_offsets.data(), (e + 1) * 4, h2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(expert.ptr, p.instance_expert.data(), I * 4, h2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(rank.ptr, p.instance_rank.data(), I * 4, h2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(slot.ptr, p.instance_slot.data(), I * 4, h2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(quota.ptr, p.instance_quota.data(), I * 8, h2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(slot_expert.ptr, p.slot_expert.data(), p.slot_expert.size() * 4, h2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(route.ptr, route32.data(), route32.size() * 4, h2d, s));
  RDEP_RETURN_IF_ERROR(CopyAsync(admitted.ptr, admitted_load.data(), admitted_load.size() * 8, h2d, s));
  return CopyAsync(misc.ptr, status, sizeof status, h2d, s);
}

DevicePlanView DevicePlanCopy::view() const {
  return DevicePlanView{offsets.ptr, expert.ptr, rank.ptr, slot.ptr, quota.ptr, slot_expert.ptr, route.ptr, admitted.ptr, misc.ptr};
}

StatusOr<BalancePlan> DevicePlanCopy::Download(cudaStream_t s) const {
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  int64_t status[4] = {0, 0, 0, 0};
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(status, misc.ptr, sizeof status, cudaMemcpyDeviceToHost));
  if (status[3] != 0) return InternalError("balance plan: the device planner found residual demand above residual quota");
  BalancePlan p;
  p.num_experts = E;
  p.num_ranks = W;
  p.num_slots = slots;
  p.threshold = status[0];
  p.instance_offsets.resize(static_cast<size_t>(E) + 1);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.instance_offsets.data(), offsets.ptr, p.instance_offsets.size() * 4, cudaMemcpyDeviceToHost));
  const int64_t I = p.instance_offsets.back();
  if (I < E || I > max_instances())
    return InternalError("balance plan: " + std::to_string(I) + " instances, outside [E=" + std::to_string(E) + ", " +
                         std::to_string(max_instances()) + "]");
  const auto n = static_cast<size_t>(I), w = static_cast<size_t>(W);
  p.instance_expert.resize(n);
  p.instance_rank.resize(n);
  p.instance_slot.resize(n);
  p.instance_quota.resize(n);
  p.slot_expert.resize(w * static_cast<size_t>(slots));
  std::vector<int32_t> route32(w * n);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.instance_expert.data(), expert.ptr, n * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.instance_rank.data(), rank.ptr, n * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.instance_slot.data(), slot.ptr, n * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.instance_quota.data(), quota.ptr, n * 8, cudaMemcpyDeviceToHost));
  if (!p.slot_expert.empty())
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.slot_expert.data(), slot_expert.ptr, p.slot_expert.size() * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(route32.data(), route.ptr, route32.size() * 4, cudaMemcpyDeviceToHost));
  p.route.assign(route32.begin(), route32.end());
  return p;
}

StatusOr<RelayPlan> DevicePlanCopy::DownloadRelays(cudaStream_t s) const {
  RelayPlan out;
  if (!relays) return out;
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  std::vector<int32_t> off(static_cast<size_t>(E) + 1), chunks(static_cast<size_t>(E));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(off.data(), offsets.ptr, off.size() * 4, cudaMemcpyDeviceToHost));
  const int32_t I = off.back();
  if (I < E || I > max_instances()) return InternalError("balance relays: " + std::to_string(I) + " instances in the plan");
  std::vector<int32_t> chunk_of(static_cast<size_t>(I));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(chunks.data(), relay_chunks.ptr, chunks.size() * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(chunk_of.data(), relay_chunk_of.ptr, chunk_of.size() * 4, cudaMemcpyDeviceToHost));
  for (int32_t e = 0; e < E; ++e) {
    const int32_t m = chunks[static_cast<size_t>(e)];
    if (m == 0) continue;
    ExpertRelays er{e, std::vector<int32_t>(static_cast<size_t>(m), -1)};
    for (int32_t i = off[static_cast<size_t>(e)]; i < off[static_cast<size_t>(e) + 1]; ++i) {
      const int32_t c = chunk_of[static_cast<size_t>(i)];
      if (c < 0) continue;
      if (c >= m) return InternalError("balance relays: expert " + std::to_string(e) + " relays chunk " + std::to_string(c) + " of " + std::to_string(m));
      er.relays[static_cast<size_t>(c)] = i;
    }
    out.experts.push_back(std::move(er));
  }
  return out;
}

StatusOr<std::vector<int64_t>> DevicePlanCopy::DownloadAdmitted(cudaStream_t s) const {
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  std::vector<int64_t> out(static_cast<size_t>(W) * static_cast<size_t>(E));
  if (!out.empty()) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.data(), admitted.ptr, out.size() * 8, cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace cuda_layer

// ---- setup ---------------------------------------------------------------------------------------------

int32_t CudaMoELayer::physical_experts(const RankState& st) const {
  return config_.balance.enabled() ? static_cast<int32_t>(layout_.L) : st.num_local;
}

// Per rank, with its device current (CreateLayer): the planner and the slots' expert compute.
Status CudaMoELayer::CreateBalancing(RankState& st) {
  const LayerShape& s = config_.shape;
  if (s.tokens > INT32_MAX) return InvalidArgument("cuda layer: balancing counts rows in int32; T must be below 2^31");
  if (config_.balance.kind == BalanceKind::kUltraEp) {
    RDEP_ASSIGN_OR_RETURN(st.planner, DevicePlanner::Create(ownership_, QuotaConfig{config_.balance.num_slots, config_.balance.min_quota,
                                                                                     /*locality=*/true, config_.balance.min_gain}));
  }
  if (config_.replica_slots() > 0) {
    kernels::ExpertMlpConfig one_expert;
    one_expert.num_streams = 1;  // one expert per call: nothing to spread over side streams
    // A slot's rows in one segment are at most the segment's tokens (a token has one row per instance).
    RDEP_ASSIGN_OR_RETURN(st.slot_mlp, kernels::MakeCublasLtExpertCompute({1, s.hidden, s.ffn, std::max<int64_t>(layout_.S, 1), config_.gate_up},
                                                                          st.device, one_expert));
  }
  return Status::Ok();
}

// ---- plan ----------------------------------------------------------------------------------------------

// Steps 1-3 of the balanced plan (file head); ends with the control words in the context.
Status CudaMoELayer::PlanBalanced(int32_t rank, RankState& st, Saved& sv) {
  const LayerShape& s = config_.shape;
  const int64_t K = s.topk, n = sv.num_tokens;
  cudaStream_t stream = domain_.stream(rank);
  auto control_of = reinterpret_cast<int64_t* const*>(domain_.peer_table(rank, regions_.control));
  const auto* my_control = static_cast<const int64_t*>(domain_.region(rank, regions_.control));
  // Phase 1: this rank's row of the load matrix into every rank.
  RDEP_RETURN_IF_ERROR(dispatch::LaunchPublishLoadRow(sv.experts.ptr, n, layout_, rank, control_of, stream));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchCounts));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkRouting));
  // Every rank: the same plan; the j-th row of (rank, e) in (t, k) order is accepted iff j is below the
  // admitted rows of (rank, e), and goes to the instance whose cumulative route count covers j.
  RDEP_RETURN_IF_ERROR(SolveBalancePlan(rank, st, sv));
  RDEP_RETURN_IF_ERROR(LaunchAssignInstances(sv.plan.view(), rank, static_cast<int32_t>(s.experts), sv.experts.ptr, st.rank_in_expert.ptr,
                                             n * K, st.local.ptr, static_cast<int32_t>(slot_base()), sv.accepted.ptr, sv.dest_rank.ptr,
                                             sv.dest_local.ptr, stream));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchRenormalizeAccepted(sv.gates.ptr, sv.accepted.ptr, n, K, sv.effective.ptr, sv.dropped.ptr, stream));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkPlan));
  // Rows per (destination, physical index) and tokens per destination, into the destinations.
  const dispatch::RouteTargets targets{{st.owner.ptr, st.local.ptr}, sv.dest_rank.ptr, sv.dest_local.ptr};
  RDEP_RETURN_IF_ERROR(dispatch::LaunchCountAndPublish(sv.experts.ptr, n, layout_, targets, rank, sv.tok_index.ptr, control_of,
                                                       st.count_scratch.ptr, static_cast<int64_t>(st.count_scratch.count), stream));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchRoute));
  // Phase 2's stream offsets as without balancing; every published row is admitted (no capacity left).
  RDEP_RETURN_IF_ERROR(dispatch::LaunchOwnerScan(layout_, rank, static_cast<int32_t>(layout_.L), INT64_MAX, control_of,
                                                 sv.rows_per_expert.ptr, stream));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchOffsets));
  // From here on the forward and its backward read the context's copy (the live words belong to the next forward).
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sv.control.ptr, my_control, layout_.control_bytes(), cudaMemcpyDeviceToDevice, stream));
  return Status::Ok();
}

// The plan of the admitted load, into the context (with its status words on their way to the host and
// the logical expert of each of this rank's physical indices).
Status CudaMoELayer::SolveBalancePlan(int32_t rank, RankState& st, Saved& sv) {
  const LayerShape& s = config_.shape;
  const int64_t W = s.ranks, E = s.experts;
  cudaStream_t stream = domain_.stream(rank);
  const int64_t capacity = config_.capacity.ExpertCapacity(s);
  const auto* lambda = static_cast<const int64_t*>(domain_.region(rank, regions_.control)) + layout_.load(0, 0);
  if (config_.balance.kind == BalanceKind::kUltraEp) {
    RDEP_RETURN_IF_ERROR(st.planner->Solve(lambda, capacity, stream));
    RDEP_RETURN_IF_ERROR(sv.plan.CopyFrom(st.planner->view(), stream));
  } else {
    // The EPLB baselines have no device planner: the load matrix comes to the host (one sync per
    // forward), every rank solves the same plan there (SolveLayerPlan, as the host layer) and uploads it.
    std::vector<int64_t> load(static_cast<size_t>(W * E));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(load.data(), lambda, load.size() * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    RDEP_RETURN_IF_ERROR(domain_.Synchronize(rank));
    const std::vector<int64_t> admitted = AdmitLoadMatrix(load, W, E, capacity);
    RDEP_ASSIGN_OR_RETURN(BalancePlan plan, SolveLayerPlan(config_.balance, admitted, ownership_, st.eplb_history));
    st.eplb_history.assign(static_cast<size_t>(E), 0.0);
    for (int64_t r = 0; r < W; ++r)
      for (int64_t e = 0; e < E; ++e) st.eplb_history[static_cast<size_t>(e)] += static_cast<double>(admitted[static_cast<size_t>(r * E + e)]);
    RDEP_RETURN_IF_ERROR(sv.plan.Upload(plan, admitted, stream));
  }
  // The chunk relays of the plan (relay_rule.h, the host layer's PlanRelays rule), on the device.
  if (sv.plan.relays)
    RDEP_RETURN_IF_ERROR(LaunchPlanRelays(sv.plan.view(), static_cast<int32_t>(E), static_cast<int32_t>(W), config_.balance.relay_above,
                                          3 * s.hidden * s.ffn * static_cast<int64_t>(sizeof(__nv_bfloat16)), sv.plan.relay_load.ptr,
                                          sv.plan.relay_wide.ptr, sv.plan.relay_chunks.ptr, sv.plan.relay_chunk_of.ptr,
                                          sv.plan.relay_range.ptr, sv.plan.relay_count.ptr, stream));
  // The plan's status words reach the host with the routing check's fault record (CheckRoutingInput
  // reads both after fault_copied, re-recorded here).
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sv.host_plan_misc, sv.plan.misc.ptr, 4 * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(sv.fault_copied, stream));
  // Physical index -> logical expert (the sentinel echo): the main experts, then the plan's slots of this rank.
  if (st.num_local > 0)
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sv.phys_global.ptr, st.local_to_global.ptr, static_cast<size_t>(st.num_local) * 4,
                                              cudaMemcpyDeviceToDevice, stream));
  const int32_t slots = config_.replica_slots();
  if (slots > 0)
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sv.phys_global.ptr + slot_base(), sv.plan.slot_expert.ptr + static_cast<int64_t>(rank) * slots,
                                              static_cast<size_t>(slots) * 4, cudaMemcpyDeviceToDevice, stream));
  return Status::Ok();
}

// ---- run and backward ----------------------------------------------------------------------------------

// Owner: its replicated experts' weights into every active replica's slot (through the peers' slot
// pointers); with chunk relays (relays_possible_), stage 1 (a relayed expert's chunk c to relay c),
// the relay barrier, and stage 2 on every rank (each relay's chunk into its expert's other replicas).
// The caller's next barrier orders the stores before any replica computes; the previous call's last
// barrier (of this layer or of any other layer sharing the slots) ordered them after every replica's
// previous use of its slot.
Status CudaMoELayer::StreamReplicas(int32_t rank, RankState& st, const Saved& sv, bool backward) {
  if (replica_w_ < 0 || kind_ != ExpertKind::kSwiGLU) return Status::Ok();
  const LayerShape& s = config_.shape;
  const int64_t w1_bytes = 2 * s.hidden * s.ffn * 2, w2_bytes = s.ffn * s.hidden * 2;
  auto* slots_of = reinterpret_cast<unsigned char* const*>(domain_.peer_table(rank, replica_w_));
  cudaStream_t stream = domain_.stream(rank);
  const DeviceRelayView relays = sv.plan.relay_view();
  if (st.num_local > 0) {  // a rank without experts owns no replicated expert
    const kernels::ExpertWeightsView w = st.weights();
    RDEP_RETURN_IF_ERROR(LaunchStreamReplicaWeights(sv.plan.view(), rank, static_cast<int32_t>(s.experts), st.owner.ptr, st.local.ptr,
                                                    w.w1, w1_bytes, w.w2, w2_bytes, slots_of, kReplicaTileBytes, 0, stream, relays));
    if (replica_fault_)
      RDEP_RETURN_IF_ERROR(LaunchCorruptReplicaForTest(sv.plan.view(), relays, rank, static_cast<int32_t>(s.experts), st.owner.ptr, slots_of,
                                                       w1_bytes + w2_bytes, 2 * s.hidden * s.ffn, stream));
  }
  if (relays_possible_) {  // every rank takes the barrier (the host cannot know whether this plan relays)
    if (!relays.chunks) return InternalError("stream replicas on rank " + std::to_string(rank) + ": the context has no relay plan");
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kReplicaRelay));
    RDEP_RETURN_IF_ERROR(LaunchRelayReplicaChunks(sv.plan.view(), relays, rank, static_cast<int32_t>(s.experts), w1_bytes + w2_bytes,
                                                  slots_of, kReplicaTileBytes, 0, stream));
  }
  return Mark(rank, st, backward, kMarkStream);
}

// Owner, after backward.done: its replicas' gradients (peer reads) added to its own, in instance order.
Status CudaMoELayer::ReduceReplicas(int32_t rank, RankState& st, const Saved& sv) {
  if (replica_g_ < 0) return Status::Ok();
  if (st.num_local > 0) {
    const LayerShape& s = config_.shape;
    const kernels::ExpertGradsView g = st.grads();  // fp32 (bf16 gradients are refused with balancing)
    if (g.bf16() || !g.dw1) return InternalError("reduce replicas on rank " + std::to_string(rank) + ": no fp32 weight gradients");
    RDEP_RETURN_IF_ERROR(LaunchReduceReplicaGradients(sv.plan.view(), rank, static_cast<int32_t>(s.experts), st.owner.ptr, st.local.ptr,
                                                      g.dw1, 2 * s.hidden * s.ffn, g.dw2, s.ffn * s.hidden,
                                                      reinterpret_cast<const float* const*>(domain_.peer_table(rank, replica_g_)),
                                                      domain_.stream(rank)));
  }
  return Mark(rank, st, true, kMarkReduce);
}

// The expert-compute calls of one segment's grouped rows, expert-major over physical indices (counts
// [physical_experts]): the main experts' rows first, then (balancing) each slot's rows; the physical
// indices between E_loc and slot_base (ranks with fewer experts than the most) never have rows.
// Backward's first segment overwrites the main experts' gradients (an expert without rows gets zeros:
// both computes do that), later segments add to them; replica gradients always add (their region is
// zeroed at segment 0).
std::vector<CudaMoELayer::ExpertCall> CudaMoELayer::ExpertCalls(int32_t rank, RankState& st, const int64_t* dev_counts,
                                                                const std::vector<int64_t>& counts, bool first_segment) const {
  std::vector<ExpertCall> calls;
  const auto num_local = static_cast<size_t>(st.num_local);
  int64_t main_rows = 0;
  for (size_t j = 0; j < num_local && j < counts.size(); ++j) main_rows += counts[j];
  if (st.mlp && main_rows > 0) {
    const kernels::ExpertGradsView g = st.grads();
    calls.push_back({st.mlp.get(), 0, main_rows, {dev_counts, main_rows, counts.data()}, st.weights(), g, /*accumulate=*/!g.bf16() && !first_segment});
  }
  if (replica_w_ < 0 || !st.slot_mlp) return calls;
  const LayerShape& s = config_.shape;
  const int64_t n1 = 2 * s.hidden * s.ffn, per = 3 * s.hidden * s.ffn;  // a slot: [w1 | w2], as LaunchStreamReplicaWeights writes
  const auto* w = static_cast<const __nv_bfloat16*>(domain_.region(rank, replica_w_));
  auto* g = static_cast<float*>(domain_.region(rank, replica_g_));
  const auto base = static_cast<size_t>(slot_base());
  int64_t first = 0;
  for (size_t j = 0; j < base && j < counts.size(); ++j) first += counts[j];
  for (int32_t sl = 0; sl < config_.replica_slots(); ++sl) {
    const size_t j = base + static_cast<size_t>(sl);
    if (j >= counts.size()) break;
    const int64_t rows = counts[j];
    if (rows <= 0) continue;
    const int64_t at = sl * per;
    calls.push_back({st.slot_mlp.get(), first, rows, {dev_counts ? dev_counts + j : nullptr, rows, counts.data() + j},
                     {w + at, w + at + n1}, {g + at, g + at + n1}, /*accumulate=*/true});
    first += rows;
  }
  return calls;
}

// ---- what the plan did ---------------------------------------------------------------------------------

const CudaMoELayer::Saved* CudaMoELayer::balanced_saved(const ForwardContext& ctx, Status* why) const {
  if (!config_.balance.enabled()) {
    *why = FailedPrecondition("balance plan: the layer was created with balancing off");
    return nullptr;
  }
  const int32_t rank = ctx.rank();
  const Saved* sv = CheckLocalRank(rank).ok() ? ContextAccess::Peek<Saved>(ctx, id_, rank) : nullptr;
  if (!sv) *why = FailedPrecondition("balance plan: the context holds no planned forward of this layer on a local rank");
  return sv;
}

StatusOr<BalancePlan> CudaMoELayer::balance_plan(const ForwardContext& ctx) const {
  Status why;
  const Saved* sv = balanced_saved(ctx, &why);
  if (!sv) return why;
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  return sv->plan.Download(domain_.stream(ctx.rank()));
}

StatusOr<BalanceTelemetry> CudaMoELayer::balance_telemetry(const ForwardContext& ctx) const {
  RDEP_ASSIGN_OR_RETURN(BalancePlan plan, balance_plan(ctx));
  const Saved* sv = ContextAccess::Peek<Saved>(ctx, id_, ctx.rank());
  RDEP_ASSIGN_OR_RETURN(std::vector<int64_t> admitted, sv->plan.DownloadAdmitted(domain_.stream(ctx.rank())));
  const LayerShape& s = config_.shape;
  BalanceTelemetry t = ComputeBalanceTelemetry(plan, admitted, ownership_, 3 * s.hidden * s.ffn * static_cast<int64_t>(sizeof(__nv_bfloat16)));
  RDEP_ASSIGN_OR_RETURN(RelayPlan relays, sv->plan.DownloadRelays(domain_.stream(ctx.rank())));
  t.relayed_experts = static_cast<int32_t>(relays.experts.size());
  return t;
}

StatusOr<RelayPlan> CudaMoELayer::balance_relays(const ForwardContext& ctx) const {
  Status why;
  const Saved* sv = balanced_saved(ctx, &why);
  if (!sv) return why;
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  return sv->plan.DownloadRelays(domain_.stream(ctx.rank()));
}

StatusOr<RowInstances> CudaMoELayer::CopyRowInstances(const ForwardContext& ctx) const {
  Status why;
  const Saved* sv = balanced_saved(ctx, &why);
  if (!sv) return why;
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(ctx.rank())));
  const auto nk = static_cast<size_t>(sv->num_tokens * config_.shape.topk);
  RowInstances out;
  out.rank.resize(nk);
  out.local.resize(nk);
  if (nk) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.rank.data(), sv->dest_rank.ptr, nk * 4, cudaMemcpyDeviceToHost));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.local.data(), sv->dest_local.ptr, nk * 4, cudaMemcpyDeviceToHost));
  }
  return out;
}

StatusOr<BalancePlan> CudaMoELayer::balance_plan(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  return balance_plan(ranks_[static_cast<size_t>(rank)]->own_context);
}

StatusOr<BalanceTelemetry> CudaMoELayer::balance_telemetry(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  return balance_telemetry(ranks_[static_cast<size_t>(rank)]->own_context);
}

StatusOr<RowInstances> CudaMoELayer::CopyRowInstances(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  return CopyRowInstances(ranks_[static_cast<size_t>(rank)]->own_context);
}

}  // namespace rdep
