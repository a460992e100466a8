// Orchestration of the RDEP protocol on the CUDA backend (kernels: rdep/dispatch/dispatch_kernels.h,
// expert MLP: rdep/experts/expert_mlp.h).
#include "rdep/layer/cuda_moe_layer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "rdep/core/route_rules.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"
#include "rdep/experts/expert_compute.h"
#include "layer/context_access.h"
#include "layer/cuda_layer_state.h"
#include "layer/sgd_kernel.h"
#include "layer/weights_in_grads.h"

namespace rdep {

using cuda_layer::Bits;
using cuda_layer::DeviceBuffer;
using dispatch::bf16_bits;
using dispatch::GroupedRow;


using namespace cuda_layer;  // MarkPhase

namespace {
constexpr size_t kEventsPerCall = 256;
}  // namespace

Status CudaMoELayer::Mark(int32_t rank, RankState& st, bool backward, int phase) {
  if (!profiling_) return Status::Ok();
  auto& marks = st.marks[backward ? 1 : 0];
  if (phase == kMarkStart) marks.clear();
  const size_t slot = (backward ? kEventsPerCall : 0) + marks.size();
  if (marks.size() >= kEventsPerCall) return Status::Ok();  // too many segments to profile: keep the first
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(st.events[slot], domain_.stream(rank)));
  marks.emplace_back(phase, st.events[slot]);
  return Status::Ok();
}

Status CudaMoELayer::EnableProfiling(bool on, bool routing_detail) {
  profiling_ = on;
  routing_detail_ = on && routing_detail;
  if (!on) return Status::Ok();
  for (auto& st : ranks_) {
    if (!st || !st->events.empty()) continue;
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st->device));
    st->events.resize(2 * kEventsPerCall);
    for (auto& e : st->events) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  }
  return Status::Ok();
}

StatusOr<PhaseTimes> CudaMoELayer::LastPhaseTimes(int32_t rank, bool backward) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  const auto& marks = st.marks[backward ? 1 : 0];
  if (marks.size() < 2) return FailedPrecondition("no profiled call on rank " + std::to_string(rank) + " (EnableProfiling first)");
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(marks.back().second));
  PhaseTimes t;
  for (size_t i = 1; i < marks.size(); ++i) {
    float ms = 0;
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second));
    switch (marks[i].first) {
      case kMarkRouting: t.routing_ms += ms; break;
      case kMarkDispatch: t.dispatch_ms += ms; break;
      case kMarkExpert: t.expert_ms += ms; break;
      case kMarkReturn: t.return_ms += ms; break;
      case kMarkPlan: t.plan_ms += ms; break;
      case kMarkStream: t.stream_ms += ms; break;
      case kMarkReduce: t.reduce_ms += ms; break;
      case kMarkRouteLocal: t.routing_ms += ms, t.route_local_ms += ms; break;
      case kMarkRouteCounts: t.routing_ms += ms, t.route_counts_ms += ms; break;
      case kMarkRouteScan: t.routing_ms += ms, t.route_scan_ms += ms; break;
      case kMarkReturnWait: t.return_ms += ms, t.return_wait_ms += ms; break;
      default: t.combine_ms += ms; break;
    }
  }
  return t;
}

size_t CudaMoELayer::device_bytes(int32_t rank) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  size_t b = layout_.total_bytes() - shared_transport_bytes();
  b += (st.w1.count + st.w2.count) * 2;
  b += (st.dw1.count + st.dw2.count + st.scratch.count + st.rank_in_expert.count) * 4;
  b += (st.owner.count + st.local.count + st.local_to_global.count + st.count_scratch.count + st.expand_scratch.count) * 4 + st.seg_counts.count * 8;
  if (st.mlp) b += st.mlp->workspace_bytes();
  if (st.slot_mlp) b += st.slot_mlp->workspace_bytes();
  return b + st.own_context.bytes();  // the shared regions: replica_slot_bytes(), shared_row_bytes(), shared_transport_bytes()
}

CudaMoELayer::CudaMoELayer(CudaDomain& domain, LayerConfig config, OwnershipMap ownership)
    : domain_(domain), config_(std::move(config)), ownership_(std::move(ownership)), id_(ContextAccess::NewLayerId()) {}

StatusOr<std::unique_ptr<CudaMoELayer::Saved>> CudaMoELayer::NewSaved(int32_t rank) const {
  const LayerShape& s = config_.shape;
  // A new context's first forward may be captured: its allocations (and, on a failure, their frees) are not graph work.
  const RelaxedCaptureScope relaxed;
  auto saved = std::make_unique<Saved>();
  saved->device = domain_.device(rank);
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(saved->device));
  const auto nk = static_cast<size_t>(std::max<int64_t>(s.tokens * s.topk, 1));
  RDEP_RETURN_IF_ERROR(saved->experts.Reserve(nk));
  RDEP_RETURN_IF_ERROR(saved->gates.Reserve(nk));
  RDEP_RETURN_IF_ERROR(saved->effective.Reserve(nk));
  RDEP_RETURN_IF_ERROR(saved->accepted.Reserve(nk));
  RDEP_RETURN_IF_ERROR(saved->tok_index.Reserve(static_cast<size_t>(std::max<int64_t>(s.ranks * s.tokens, 1))));
  if (config_.owner_reduce) RDEP_RETURN_IF_ERROR(saved->lead.Reserve(nk));
  if (w1_in_place_) RDEP_RETURN_IF_ERROR(saved->slot_rows.Reserve(nk));
  if (!OwnersTakeDgateDots(config_)) RDEP_RETURN_IF_ERROR(ReserveSavedF(*ranks_[static_cast<size_t>(rank)], *saved));  // else no f_k here
  RDEP_RETURN_IF_ERROR(saved->armed.Reserve(1));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(saved->armed.ptr, 0, sizeof(int32_t), domain_.stream(rank)));  // no forward yet
  RDEP_RETURN_IF_ERROR(saved->dropped.Reserve(2));  // [0] rows dropped, [1] the routing check's scratch word
  // Zero once, in the rank's stream order (a capture records it as a node that runs first); from then on
  // the check's second kernel leaves [1] at 0 and zeroes [0] before each plan's acceptance.
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(saved->dropped.ptr, 0, 2 * sizeof(int64_t), domain_.stream(rank)));
  RDEP_RETURN_IF_ERROR(saved->control.Reserve(layout_.control_bytes() / sizeof(int64_t)));
  RDEP_RETURN_IF_ERROR(saved->rows_per_expert.Reserve(static_cast<size_t>(std::max(physical_experts(*ranks_[static_cast<size_t>(rank)]), 1))));
  if (SourceWindows()) RDEP_RETURN_IF_ERROR(saved->window_tokens.Reserve(static_cast<size_t>(s.ranks)));
  if (SyncFree(*ranks_[static_cast<size_t>(rank)])) RDEP_RETURN_IF_ERROR(ReserveSyncFree(*ranks_[static_cast<size_t>(rank)], *saved));
  if (config_.nodes.nodes > 1) RDEP_RETURN_IF_ERROR(ReserveTwoPhase(*saved));
  if (config_.balance.enabled()) {
    RDEP_RETURN_IF_ERROR(saved->plan.Reserve(static_cast<int32_t>(s.experts), static_cast<int32_t>(s.ranks), config_.replica_slots(),
                                             relays_possible_));
    RDEP_RETURN_IF_ERROR(saved->dest_rank.Reserve(nk));
    RDEP_RETURN_IF_ERROR(saved->dest_local.Reserve(nk));
    RDEP_RETURN_IF_ERROR(saved->phys_global.Reserve(static_cast<size_t>(layout_.L)));
    void* misc = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&misc, 4 * sizeof(int64_t), cudaHostAllocPortable));
    saved->host_plan_misc = static_cast<int64_t*>(misc);
    std::fill_n(saved->host_plan_misc, 4, int64_t{0});
  }
  void* pinned = nullptr;
  RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, sizeof(dispatch::RoutingFault), cudaHostAllocMapped | cudaHostAllocPortable));
  saved->host_fault = static_cast<dispatch::RoutingFault*>(pinned);
  void* mapped = nullptr;
  RDEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&mapped, pinned, 0));
  saved->fault_dev = static_cast<dispatch::RoutingFault*>(mapped);
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&saved->fault_copied, cudaEventDisableTiming));
  return saved;
}

Status CudaMoELayer::CheckLocalRank(int32_t rank) const {
  if (rank < 0 || rank >= config_.shape.ranks)
    return InvalidArgument("rank " + std::to_string(rank) + " outside [0, W=" + std::to_string(config_.shape.ranks) + ")");
  if (!ranks_[static_cast<size_t>(rank)])
    return InvalidArgument("rank " + std::to_string(rank) + " is driven by another process");
  return Status::Ok();
}

CudaMoELayer::~CudaMoELayer() {
  for (size_t r = 0; r < ranks_.size(); ++r)  // the own contexts' stash pages back to a pool other layers may share
    if (ranks_[r])
      if (Saved* sv = ContextAccess::StateOf<Saved>(ranks_[r]->own_context, id_, static_cast<int32_t>(r)))
        (void)ReleaseStash(static_cast<int32_t>(r), *sv);
  alive_->store(false);  // a context freed from here on leaves its stash pages taken (cuda_stash.cc)
  for (auto& rank_state : ranks_) {
    if (!rank_state) continue;  // driven by another process
    RankState& st = *rank_state;
    cudaSetDevice(st.device);
    st.mlp.reset();
    DestroyOverlap(st);
    if (st.host_counts) cudaFreeHost(st.host_counts);
    for (auto e : st.events) cudaEventDestroy(e);
    rank_state.reset();  // device buffers and the own context, with the rank's device current
  }
  // Last: the computes above used them (at W = 1 the return region holds the CUTLASS compute's scratch).
  regions_.Free(domain_);
  for (RegionId id : {replica_w_, replica_g_, out_rows_, expert_scratch_, stash_rows_, stash_pool_, stash_ring_, stash_flags_})
    if (id >= 0) domain_.ReleaseShared(id);
}

StatusOr<std::unique_ptr<CudaMoELayer>> CudaMoELayer::Create(CudaDomain& domain, const LayerConfig& config,
                                                            const OwnershipMap& ownership, const MoEWeights& weights) {
  RDEP_RETURN_IF_ERROR(ValidateLayerInputs(config, domain.num_ranks(), ownership, weights));
  return CreateLayer(domain, config, ownership, &weights);
}

StatusOr<std::unique_ptr<CudaMoELayer>> CudaMoELayer::Create(CudaDomain& domain, const LayerConfig& config,
                                                            const OwnershipMap& ownership) {
  RDEP_RETURN_IF_ERROR(ValidateLayerInputs(config, domain.num_ranks(), ownership));
  return CreateLayer(domain, config, ownership, nullptr);
}

Status CudaMoELayer::BindExpertWeights(int32_t rank, const ExternalWeights<__nv_bfloat16, float>& w) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RDEP_RETURN_IF_ERROR(w.Validate(rank));
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  st.bound = w;
  st.bound_dw1_bf16 = st.bound_dw2_bf16 = nullptr;
  return Status::Ok();
}

Status CudaMoELayer::BindExpertWeights(int32_t rank, const ExternalWeights<__nv_bfloat16, __nv_bfloat16>& w) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RDEP_RETURN_IF_ERROR(w.Validate(rank));
  if (config_.balance.enabled() && w.dw1)
    return FailedPrecondition("bf16 weight gradients bound to rank " + std::to_string(rank) + " with balancing (" +
                              BalanceKindName(config_.balance.kind) +
                              "): replica gradients are reduced into fp32 main gradients; bind fp32 gradients (grad_bf16 off)");
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  st.bound = {w.w1, w.w2, nullptr, nullptr};
  st.bound_dw1_bf16 = w.dw1;
  st.bound_dw2_bf16 = w.dw2;
  return Status::Ok();
}

namespace {
// RDEP_EXPERT_SCRATCH=own: the CUTLASS compute keeps a SwiGLU scratch of its own even where it could live in the
// return region (ScratchInReturnRegion), for A/B tests; unset or empty: the default.
StatusOr<bool> ExpertScratchOfItsOwnRequested() {
  const char* v = std::getenv("RDEP_EXPERT_SCRATCH");
  if (v == nullptr || *v == '\0') return false;
  if (std::string(v) == "own") return true;
  return InvalidArgument(std::string("RDEP_EXPERT_SCRATCH='") + v + "': expected own (a scratch of its own) or unset");
}

// RDEP_W1_RETURN: in-place (the default; CombinesInPlace) or copy (the owner's rows copied into the return region
// at W = 1 as at W > 1, for A/B runs). Read when a layer is created.
StatusOr<bool> W1ReturnInPlace() {
  const char* v = std::getenv("RDEP_W1_RETURN");
  if (v == nullptr || *v == '\0' || std::string(v) == "in-place") return true;
  if (std::string(v) == "copy") return false;
  return InvalidArgument(std::string("RDEP_W1_RETURN='") + v + "': expected in-place (the default) or copy");
}
}  // namespace

StatusOr<std::unique_ptr<CudaMoELayer>> CudaMoELayer::CreateLayer(CudaDomain& domain, const LayerConfig& config_in,
                                                                 const OwnershipMap& ownership, const MoEWeights* weights) {
  LayerConfig config = config_in;
  const LayerShape& s = config.shape;
  if (s.topk > 1024) return InvalidArgument("cuda layer: K must be <= 1024");
  if (config.balance.enabled() && config.balance.kind == BalanceKind::kUltraEp) {
    auto can = GpuPlannerCanImplement(static_cast<int32_t>(s.experts), static_cast<int32_t>(s.ranks), config.balance.num_slots);
    if (!can.ok()) return InvalidArgument("cuda layer: balance ultraep: " + can.status().message());
  }
  if (config.nodes.nodes > 1 && config.expert_compute == ExpertComputeKind::kCutlass)
    return InvalidArgument("cuda layer: nodes N=" + std::to_string(config.nodes.nodes) +
                           " with expert_compute cutlass: the sync-free owner path has no two-phase exchange yet "
                           "(use expert_compute cublaslt with nodes, or nodes 1)");
  if (config.segment_tokens == 0) config.segment_tokens = std::max<int64_t>(1, s.ranks * s.tokens);  // worst case: no sync
  {
    // Every process must build the same layer: shape, capacity, segment and ownership map.
    std::vector<int64_t> fp = {s.tokens, s.hidden, s.ffn, s.experts, s.topk, s.ranks, config.segment_tokens};
    int64_t cf;
    std::memcpy(&cf, &config.capacity.capacity_factor, sizeof cf);
    fp.push_back(cf);
    fp.push_back(static_cast<int64_t>(config.balance.kind));
    fp.push_back(config.balance.enabled() ? config.balance.num_slots : 0);
    fp.push_back(config.balance.enabled() ? config.balance.min_quota : 0);
    fp.push_back(config.nodes.nodes);
    fp.push_back(config.nodes.cap());
    fp.push_back(config.balance.enabled() ? config.balance.relay_above : 0);  // ranks take the relay barrier alike
    fp.push_back(static_cast<int64_t>(config.expert_compute));                 // sync-free or not: the same barriers
    fp.push_back(config.owner_reduce ? 1 : 0);                                 // the dots region exists on all or none
    fp.push_back(config.balance.enabled() ? config.balance.min_gain : 0);       // every rank solves the same plan
    fp.push_back(config.gate_in_expert ? 1 : 0);                               // the dots region, and who weights the rows
    for (int32_t o : ownership.owners()) fp.push_back(o);
    std::vector<uint8_t> bytes(fp.size() * sizeof(int64_t));
    std::memcpy(bytes.data(), fp.data(), bytes.size());
    RDEP_RETURN_IF_ERROR(domain.AgreeAcrossRanks(bytes, "layer config", [](const std::vector<uint8_t>& b) {
      std::vector<int64_t> v(b.size() / sizeof(int64_t));
      std::memcpy(v.data(), b.data(), v.size() * sizeof(int64_t));
      if (v.size() < 18) return std::string("a malformed config");
      double c;
      std::memcpy(&c, &v[7], sizeof c);
      return "T=" + std::to_string(v[0]) + " H=" + std::to_string(v[1]) + " D_ff=" + std::to_string(v[2]) + " E=" +
             std::to_string(v[3]) + " K=" + std::to_string(v[4]) + " W=" + std::to_string(v[5]) + " S=" + std::to_string(v[6]) +
             " capacity=" + std::to_string(c) + " balance=" + BalanceKindName(static_cast<BalanceKind>(v[8])) + " N_slot=" +
             std::to_string(v[9]) + " u_min=" + std::to_string(v[10]) + " nodes N=" + std::to_string(v[11]) + " M=" +
             std::to_string(v[12]) + " relay_above=" + std::to_string(v[13]) + " expert_compute=" +
             ExpertComputeName(static_cast<ExpertComputeKind>(v[14])) + " owner_reduce=" + std::to_string(v[15]) +
             " min_gain=" + std::to_string(v[16]) + " gate_in_expert=" + std::to_string(v[17]) + (v.size() > 18 ? " (+ownership map)" : "");
    }));
  }
  std::unique_ptr<CudaMoELayer> layer(new CudaMoELayer(domain, config, ownership));
  RDEP_ASSIGN_OR_RETURN(const bool in_place, W1ReturnInPlace());
  layer->w1_in_place_ = in_place && s.ranks == 1 && config.nodes.nodes <= 1 && !config.owner_reduce;
  if (config.nodes.nodes > 1) {  // phase A and the return hop: NCCL, or device copies for ranks sharing GPUs
    RDEP_ASSIGN_OR_RETURN(layer->inter_, MakeDeviceInterNodeExchange(domain, config.nodes));
  }
  layer->layout_ = MakeRegionLayout(config, ownership, sizeof(__nv_bfloat16));
  RDEP_RETURN_IF_ERROR(dispatch::CheckKernelLimits(layer->layout_));  // every rank refuses the shape here, before any collective
  // Chunk relays need an expert with more than relay_above replicas; an expert has at most one
  // instance per rank and at most W*N_slot replicas. Otherwise no relay plan and no relay barrier.
  layer->relays_possible_ = config.replica_slots() > 0 && config.balance.relay_above > 0 &&
                            std::min<int64_t>(s.ranks, s.ranks * config.replica_slots()) > config.balance.relay_above;
  const RegionLayout& l = layer->layout_;
  // One domain: the segment payload, sideband and return region are shared by the layers of their size
  // (LayerRegions::shared_transport); the two-phase exchange keeps its own.
  RDEP_ASSIGN_OR_RETURN(layer->regions_, LayerRegions::Allocate(domain, l, OwnersTakeDgateDots(config) ? sizeof(float) : 0,
                                                                /*share_transport=*/config.nodes.nodes <= 1));
  // The owner's output rows: forward outputs of a segment; in backward, dout rows, then dx rows over them
  // (DxOverDout: the CUTLASS compute) or behind them. No call keeps them past its return, so every layer of
  // this size on the domain shares them. Overlapped segments (cuda_overlap.cc) keep two segments' rows in
  // flight (only when there is more than one segment to overlap).
  layer->out_rows_bytes_ = static_cast<size_t>(OwnerOutputRowSets(config, l.S) * std::max<int64_t>(MaxSegmentRows(config, l), 1) *
                                               s.hidden) * sizeof(__nv_bfloat16);
  RDEP_ASSIGN_OR_RETURN(layer->out_rows_, domain.AcquireShared("owner.out_rows", layer->out_rows_bytes_));
  if (config.expert_compute == ExpertComputeKind::kCutlass) {  // its SwiGLU scratch (z, then dz) lives within a call too
    const kernels::ExpertMlpDesc any{1, s.hidden, s.ffn, std::max<int64_t>(MaxSegmentRows(config, l), 1)};
    const size_t bytes = kernels::CutlassExpertScratchBytes(any);
    RDEP_ASSIGN_OR_RETURN(const bool own, ExpertScratchOfItsOwnRequested());
    layer->scratch_in_return_ = !own && ScratchInReturnRegion(config, l, bytes);  // W = 1: the return region, idle meanwhile
    if (!layer->scratch_in_return_) {
      layer->expert_scratch_bytes_ = bytes;
      RDEP_ASSIGN_OR_RETURN(layer->expert_scratch_, domain.AcquireShared("expert.scratch", layer->expert_scratch_bytes_));
    }
  }
  RDEP_RETURN_IF_ERROR(layer->AcquireStash());  // LayerConfig::stash_rows (cuda_stash.cc)
  if (config.replica_slots() > 0) {  // redundant slots, per rank: [N_slot][w1 | w2], bf16 weights and fp32 gradients,
                                     // shared with every balanced layer of the same slot size on the domain
    const auto per_slot = static_cast<size_t>(config.replica_slots()) * static_cast<size_t>(3 * s.hidden * s.ffn);
    RDEP_ASSIGN_OR_RETURN(layer->replica_w_, domain.AcquireShared("replica.weights", per_slot * sizeof(__nv_bfloat16)));
    RDEP_ASSIGN_OR_RETURN(layer->replica_g_, domain.AcquireShared("replica.grads", per_slot * sizeof(float)));
  }

  const int64_t T = s.tokens, K = s.topk, H = s.hidden, F = s.ffn, W = s.ranks;
  const auto n1 = static_cast<size_t>(H * 2 * F), n2 = static_cast<size_t>(F * H);
  for (int32_t q = 0; q < W; ++q) {
    if (!domain.is_local(q)) {
      layer->ranks_.push_back(nullptr);  // another process drives rank q
      continue;
    }
    auto st = std::make_unique<RankState>();
    st->device = domain.device(q);
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st->device));
    const int32_t L = ownership.num_local(q);
    st->num_local = L;
    std::vector<int32_t> l2g(static_cast<size_t>(std::max(L, 1)), 0);
    for (int32_t j = 0; j < L; ++j) l2g[static_cast<size_t>(j)] = ownership.global_expert(q, j);
    st->w1_count = static_cast<size_t>(L) * n1;
    st->w2_count = static_cast<size_t>(L) * n2;
    if (weights) RDEP_RETURN_IF_ERROR(layer->UploadWeights(*st, ownership, q, *weights));
    RDEP_RETURN_IF_ERROR(st->owner.Reserve(static_cast<size_t>(s.experts)));
    RDEP_RETURN_IF_ERROR(st->local.Reserve(static_cast<size_t>(s.experts)));
    RDEP_RETURN_IF_ERROR(st->local_to_global.Reserve(l2g.size()));
    std::vector<int32_t> locals(static_cast<size_t>(s.experts));
    for (int32_t e = 0; e < s.experts; ++e) locals[static_cast<size_t>(e)] = ownership.local_index(e);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st->owner.ptr, ownership.owners().data(), locals.size() * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st->local.ptr, locals.data(), locals.size() * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st->local_to_global.ptr, l2g.data(), l2g.size() * 4, cudaMemcpyHostToDevice));
    // Workspaces for up to T tokens.
    const auto nk = static_cast<size_t>(std::max<int64_t>(T * K, 1));
    RDEP_RETURN_IF_ERROR(st->scratch.Reserve(nk));
    RDEP_RETURN_IF_ERROR(st->rank_in_expert.Reserve(nk));
    const int32_t phys = layer->physical_experts(*st);  // L, or with balancing the layout's L (slots last)
    RDEP_RETURN_IF_ERROR(st->seg_counts.Reserve(static_cast<size_t>(std::max(phys, 1))));
    RDEP_RETURN_IF_ERROR(st->count_scratch.Reserve(
        static_cast<size_t>(std::max(dispatch::CountScratchInts(l, T), dispatch::WindowPlanScratchInts(l, T)))));
    RDEP_RETURN_IF_ERROR(st->expand_scratch.Reserve(static_cast<size_t>(dispatch::ExpandScratchInts(l, std::max(phys, 1)))));
    void* pinned = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, sizeof(int64_t) * static_cast<size_t>(std::max(L, phys) + W + 1), cudaHostAllocPortable));
    st->host_counts = static_cast<int64_t*>(pinned);
    // Per-segment owner buffers (grouped rows of one segment: MaxSegmentRows, at most S * min(K, E_loc + N_slot)).
    const int64_t seg_rows = MaxSegmentRows(config, l);
    if (config.gate_in_expert) RDEP_RETURN_IF_ERROR(st->row_dgates.Reserve(static_cast<size_t>(std::max<int64_t>(seg_rows, 1))));
    if (L > 0) {
      const kernels::ExpertMlpDesc desc{L, H, F, std::max<int64_t>(seg_rows, 1), config.gate_up};
      if (config.expert_compute == ExpertComputeKind::kCutlass) {
        // RDEP_CUTLASS_TILES: every CUTLASS layer's tiles, for tuning without a rebuild (names and format as
        // `rdep bench gemm --path cutlass:SPEC`); unset or empty = each GEMM's default.
        kernels::CutlassTiles tiles;
        const char* env = std::getenv("RDEP_CUTLASS_TILES");
        const std::string env_tiles = env != nullptr ? env : "";
        if (!env_tiles.empty()) {
          RDEP_ASSIGN_OR_RETURN(tiles, kernels::ParseCutlassTileSpec(env_tiles, "RDEP_CUTLASS_TILES"));
        }
        if (config.overlap_segments && config.transport_sms > 0) {  // the GEMMs leave the transport its SMs
          int sms = 0;
          RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, st->device));
          if (2 * config.transport_sms > sms)
            return InvalidArgument("transport_sms: " + std::to_string(config.transport_sms) + " with overlap_segments would leave the expert GEMMs " +
                                   std::to_string(std::max(0, sms - config.transport_sms)) + " of GPU " + std::to_string(st->device) +
                                   "'s " + std::to_string(sms) + " SMs; give the transport at most half (" + std::to_string(sms / 2) + ")");
          tiles.gemm_sms = (sms - config.transport_sms) & ~1;  // even: the clustered tiles run CTA pairs
        }
        void* scratch = domain.region(q, layer->scratch_in_return_ ? layer->regions_.ret : layer->expert_scratch_);
        auto cutlass = kernels::MakeCutlassExpertCompute(desc, st->device, tiles, scratch);
        if (!cutlass.ok())
          return Status(cutlass.status().code(), "cuda layer: expert compute cutlass: " + cutlass.status().message() +
                                                     (env_tiles.empty() ? "" : " (tiles from RDEP_CUTLASS_TILES = '" + env_tiles + "')"));
        st->mlp = std::move(*cutlass);
        if (DxOverDout(config) && !st->mlp->dx_may_alias_dout())  // the output rows hold one set (OwnerOutputRowSets)
          return InternalError(std::string("cuda layer: expert compute ") + st->mlp->name() + " cannot write dx over dout");
      } else {
        RDEP_ASSIGN_OR_RETURN(st->mlp, kernels::MakeCublasLtExpertCompute(desc, st->device));
      }
    }
    if (config.balance.enabled()) RDEP_RETURN_IF_ERROR(layer->CreateBalancing(*st));
    if (config.overlap_segments) RDEP_RETURN_IF_ERROR(layer->CreateOverlap(*st));
    // The copies and memsets above (the ownership maps, the weights, their zeroed gradients) ran on the legacy stream, which
    // the rank's non-blocking stream does not wait for.
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st->device));
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
    layer->ranks_.push_back(std::move(st));
    // The own context's buffers now (a warm cache for calls without a context) when the layer holds its
    // weights. A layer without weights is the C API's (rdep.torch's), whose calls bring pooled contexts:
    // its own context is made at its first call without one, if any (a context holds a segment's worth of
    // saved rows: x, h and the returned rows, ~170 MB at hidden 1024 and 4096 tokens top-6).
    if (weights)
      RDEP_RETURN_IF_ERROR(ContextAccess::BeginForward<Saved>(layer->ranks_.back()->own_context, layer->id_, q,
                                                              [&] { return layer->NewSaved(q); }).status());
  }
  return layer;
}

// The layer's own copy of rank q's experts, converted to bf16 on the host; fp32 gradients zeroed.
Status CudaMoELayer::UploadWeights(RankState& st, const OwnershipMap& ownership, int32_t q, const MoEWeights& weights) {
  const size_t n1 = weights.w1_per_expert(), n2 = weights.w2_per_expert();
  std::vector<uint16_t> b1(st.w1_count), b2(st.w2_count);
  for (int32_t j = 0; j < st.num_local; ++j) {
    const auto e = static_cast<size_t>(ownership.global_expert(q, j));
    for (size_t i = 0; i < n1; ++i) b1[static_cast<size_t>(j) * n1 + i] = FloatToBf16Bits(weights.w1[e * n1 + i]);
    for (size_t i = 0; i < n2; ++i) b2[static_cast<size_t>(j) * n2 + i] = FloatToBf16Bits(weights.w2[e * n2 + i]);
  }
  RDEP_RETURN_IF_ERROR(st.w1.Reserve(b1.size()));
  RDEP_RETURN_IF_ERROR(st.w2.Reserve(b2.size()));
  RDEP_RETURN_IF_ERROR(st.dw1.Reserve(b1.size()));
  RDEP_RETURN_IF_ERROR(st.dw2.Reserve(b2.size()));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st.w1.ptr, b1.data(), b1.size() * 2, cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st.w2.ptr, b2.data(), b2.size() * 2, cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(st.dw1.ptr, 0, b1.size() * sizeof(float)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(st.dw2.ptr, 0, b2.size() * sizeof(float)));
  st.own_weights = true;
  return Status::Ok();
}

Status CudaMoELayer::ApplySgd(int32_t rank, float lr) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  if (!st.own_weights || st.bound.w1)
    return FailedPrecondition("ApplySgd on rank " + std::to_string(rank) +
                              ": only for the layer's own weights (bound weights belong to the caller's optimizer)");
  RDEP_RETURN_IF_ERROR(LaunchSgdBf16(st.w1.ptr, st.dw1.ptr, st.w1.count, lr, domain_.stream(rank)));
  return LaunchSgdBf16(st.w2.ptr, st.dw2.ptr, st.w2.count, lr, domain_.stream(rank));
}

StatusOr<std::vector<float>> CudaMoELayer::CopyWeights(int32_t rank, bool second) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  if (!st.has_weights()) return FailedPrecondition("CopyWeights: rank " + std::to_string(rank) + " has no weights");
  const __nv_bfloat16* b = second ? st.weights().w2 : st.weights().w1;
  const size_t n = second ? st.w2_count : st.w1_count;
  std::vector<uint16_t> bits(n);
  if (n) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(bits.data(), b, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = Bf16BitsToFloat(bits[i]);
  return out;
}

float* CudaMoELayer::dw1(int32_t r) const { return ranks_[static_cast<size_t>(r)]->grads().dw1; }
float* CudaMoELayer::dw2(int32_t r) const { return ranks_[static_cast<size_t>(r)]->grads().dw2; }
const CudaMoELayer::Saved* CudaMoELayer::last(int32_t rank) const {
  return ContextAccess::Peek<Saved>(ranks_[static_cast<size_t>(rank)]->own_context, id_, rank);
}

bool CudaMoELayer::overlapped(int32_t r) const {
  const Saved* saved = last(r);
  return saved && saved->overlapped;
}
bool CudaMoELayer::overlapped(const ForwardContext& ctx, int32_t r) const {
  const Saved* saved = ContextAccess::Peek<Saved>(ctx, id_, r);
  return saved && saved->overlapped;
}
bool CudaMoELayer::source_windows(const ForwardContext& ctx, int32_t r) const {
  const Saved* saved = ContextAccess::Peek<Saved>(ctx, id_, r);
  return saved && saved->windowed;
}
bool CudaMoELayer::combined_in_place(int32_t r) const {
  const Saved* saved = last(r);
  return saved && saved->combine_rows != nullptr;
}
int64_t CudaMoELayer::segments(int32_t r) const {
  const Saved* saved = last(r);
  return saved ? saved->num_segments : 0;
}

Status CudaMoELayer::Forward(int32_t rank, const int32_t* experts, const float* gates, int64_t num_tokens,
                             const __nv_bfloat16* x, __nv_bfloat16* y) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  return Forward(rank, ranks_[static_cast<size_t>(rank)]->own_context, experts, gates, num_tokens, x, y);
}

Status CudaMoELayer::Backward(int32_t rank, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* dgates) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  return Backward(rank, ranks_[static_cast<size_t>(rank)]->own_context, dy, dx, dgates);
}

Status CudaMoELayer::Forward(int32_t rank, ForwardContext& ctx, const int32_t* experts, const float* gates,
                             int64_t num_tokens, const __nv_bfloat16* x, __nv_bfloat16* y) {
  const Status planned = PlanFor(rank, ctx, experts, gates, num_tokens, /*windows_allowed=*/true);
  if (!ctx.planned()) return planned;  // not bound, or a CUDA error: the collective cannot go on
  const Status ran = Run(rank, ctx, x, y);
  return planned.ok() ? ran : planned;
}

Status CudaMoELayer::Plan(int32_t rank, ForwardContext& ctx, const int32_t* experts, const float* gates, int64_t num_tokens) {
  return PlanFor(rank, ctx, experts, gates, num_tokens, /*windows_allowed=*/false);
}

bool CudaMoELayer::SourceWindows() const {
  return config_.source_windows && config_.capacity.dropless() && !config_.balance.enabled() && config_.nodes.nodes <= 1 &&
         layout_.E_load == 0 && layout_.S >= layout_.W * layout_.T;
}

Status CudaMoELayer::PlanWindowed(int32_t rank, RankState& st, Saved& sv, const int32_t* experts, const float* gates) {
  return dispatch::LaunchWindowPlan(experts, gates, sv.num_tokens, layout_, dispatch::OwnerMapView{st.owner.ptr, st.local.ptr},
                                    static_cast<int32_t>(config_.shape.experts), rank, sv.experts.ptr, sv.gates.ptr, sv.tok_index.ptr,
                                    sv.window_tokens.ptr, sv.accepted.ptr, sv.effective.ptr, sv.control.ptr,
                                    reinterpret_cast<unsigned long long*>(sv.dropped.ptr + 1), sv.fault_dev, /*zero=*/sv.dropped.ptr,
                                    st.count_scratch.ptr, static_cast<int64_t>(st.count_scratch.count), domain_.stream(rank));
}

Status CudaMoELayer::PlanFor(int32_t rank, ForwardContext& ctx, const int32_t* experts, const float* gates, int64_t num_tokens,
                             bool windows_allowed) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  if (Stashing(st)) RDEP_RETURN_IF_ERROR(RefuseStashInCapture(rank, "forward"));  // before the collective
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginForward<Saved>(ctx, id_, rank, [&] { return NewSaved(rank); }));
  Saved& sv = *saved;
  sv.combine_rows = nullptr;  // a new plan: no call's rows yet (set again by its exchange)
  const LayerShape& s = config_.shape;
  const int64_t K = s.topk, W = s.ranks;
  // A bad token count still takes part in the collective with no tokens (the other ranks finish), then fails.
  const bool count_ok = num_tokens >= 0 && num_tokens <= s.tokens;
  const bool arrays_ok = num_tokens <= 0 || (experts != nullptr && gates != nullptr);  // null routing: taken as no tokens
  const int64_t n = count_ok && arrays_ok ? num_tokens : 0;
  RDEP_RETURN_IF_ERROR(domain_.CheckErrors(rank));
  // A plan after another one's (not yet run) waits until every rank has copied that plan's control words,
  // before this one's phase 1 rewrites them; a windowed plan writes no peer memory and sets nothing pending.
  const bool windowed = windows_allowed && SourceWindows();
  if (st.plan_copy_pending && !windowed) RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kPlanStart));
  if (!windowed) st.plan_copy_pending = true;
  cudaStream_t stream = domain_.stream(rank);
  auto control_of = reinterpret_cast<int64_t* const*>(domain_.peer_table(rank, regions_.control));
  auto* my_control = static_cast<int64_t*>(domain_.region(rank, regions_.control));
  const dispatch::OwnerMapView own{st.owner.ptr, st.local.ptr};
  sv.num_tokens = n;
  sv.have_recv_counts = false;
  sv.windowed = windowed;
  if (!OwnersTakeDgateDots(config_)) RDEP_RETURN_IF_ERROR(ReserveSavedF(st, sv));  // a no-op unless ReleaseRows gave them back
  // The check copies the caller's routing into the context's (sv.experts, sv.gates) as it reads it; with no
  // tokens (or bad input, which takes part with none) the caller's arrays are not read.
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkStart));
  if (windowed)  // the check, the positions and the acceptance in two kernels, nothing exchanged
    RDEP_RETURN_IF_ERROR(PlanWindowed(rank, st, sv, n > 0 ? experts : nullptr, n > 0 ? gates : nullptr));
  else
    RDEP_RETURN_IF_ERROR(dispatch::LaunchValidateRouting(sv.experts.ptr, sv.gates.ptr, n, K, static_cast<int32_t>(s.experts),
                                                         reinterpret_cast<unsigned long long*>(sv.dropped.ptr + 1), sv.fault_dev,
                                                         stream, /*zero=*/sv.dropped.ptr,  // also zeroes the drop count
                                                         n > 0 ? experts : nullptr, n > 0 ? gates : nullptr));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(sv.fault_copied, stream));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  sv.fault_in_capture = capture != cudaStreamCaptureStatusNone;
  // Ranks within each expert decide capacity acceptance and the balancer's instance assignment; a
  // dropless layer without balancing admits every row and needs none.
  const bool need_ranks = config_.balance.enabled() || !config_.capacity.dropless();
  if (need_ranks)
    RDEP_RETURN_IF_ERROR(dispatch::LaunchExpertRank(sv.experts.ptr, n, K, static_cast<int32_t>(s.experts), st.rank_in_expert.ptr, stream));
  if (windowed) {
    if (routing_detail_) RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkRouteLocal));  // all of it: nothing to wait for
  } else if (config_.balance.enabled()) {
    // The balancer's plan decides acceptance and each row's physical instance (cuda_balance.cc); it
    // ends with the control words copied into the context, as Accept does below.
    RDEP_RETURN_IF_ERROR(PlanBalanced(rank, st, sv));
  } else {
    // Phase 1: counts into every owner's recv tables.
    RDEP_RETURN_IF_ERROR(dispatch::LaunchCountAndPublish(sv.experts.ptr, n, layout_, own, rank, sv.tok_index.ptr, control_of,
                                                         st.count_scratch.ptr, static_cast<int64_t>(st.count_scratch.count), stream));
    RDEP_RETURN_IF_ERROR(dispatch::LaunchPublishLoadRow(sv.experts.ptr, n, layout_, rank, control_of, stream));
    if (routing_detail_) RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkRouteLocal));
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchCounts));
    if (routing_detail_) RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkRouteCounts));
    // Phase 2: owner scan, capacity, bases published back.
    RDEP_RETURN_IF_ERROR(dispatch::LaunchOwnerScan(layout_, rank, st.num_local, config_.capacity.ExpertCapacity(s), control_of,
                                                   sv.rows_per_expert.ptr, stream));
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchOffsets));
    if (routing_detail_) RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkRouteScan));
    // Accept also copies the control words into the context: from here on the forward reads its own
    // copy (backward reads the same copy; the live region belongs to the next forward).
    RDEP_RETURN_IF_ERROR(dispatch::LaunchAccept(sv.experts.ptr, sv.gates.ptr, need_ranks ? st.rank_in_expert.ptr : nullptr, n,
                                                layout_, own, my_control, sv.control.ptr, sv.accepted.ptr, sv.effective.ptr,
                                                sv.dropped.ptr, stream));
  }
  if (layout_.S >= W * s.tokens) {
    sv.num_segments = 1;  // worst-case-sized segment: every owner's stream fits, no sync needed
  } else if (SyncFree(st)) {
    sv.num_segments = SyncFreeSegments();  // the worst case's count: the host never learns the owners' streams
  } else {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.host_counts, sv.control.ptr + layout_.owner_tokens(0), sizeof(int64_t) * static_cast<size_t>(W),
                                              cudaMemcpyDeviceToHost, stream));
    RDEP_RETURN_IF_ERROR(domain_.Synchronize(rank));
    int64_t mx = 0;
    for (int64_t p = 0; p < W; ++p) mx = std::max(mx, st.host_counts[p]);
    sv.num_segments = (mx + layout_.S - 1) / layout_.S;
  }
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkRouting));
  ContextAccess::FinishPlan(ctx);  // runnable even when the count was bad: the other ranks' run needs this rank
  if (!count_ok)
    return InvalidArgument("forward on rank " + std::to_string(rank) + ": num_tokens " + std::to_string(num_tokens) +
                           " outside [0, T=" + std::to_string(s.tokens) + "]; the rank took part with no tokens");
  if (!arrays_ok)
    return InvalidArgument("forward on rank " + std::to_string(rank) + ": " + (experts ? "gates" : "experts") + " is null for " +
                           std::to_string(num_tokens) + " tokens; the rank took part with no tokens");
  return Status::Ok();
}

Status CudaMoELayer::Run(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* x, __nv_bfloat16* y) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  if (kind_ == ExpertKind::kSwiGLU && !st.has_weights())
    return FailedPrecondition("forward on rank " + std::to_string(rank) +
                              ": the layer was created without weights and none are bound (BindExpertWeights)");
  if (kind_ == ExpertKind::kSentinel && config_.owner_reduce)
    return FailedPrecondition("forward on rank " + std::to_string(rank) +
                              ": the sentinel expert's rows carry identities, which owner_reduce would sum; use it without");
  if (kind_ != ExpertKind::kSwiGLU && config_.gate_in_expert)
    return FailedPrecondition("forward on rank " + std::to_string(rank) +
                              ": gate_in_expert needs the SwiGLU expert (its compute applies the gates); use the test experts without it");
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginRun<Saved>(ctx, id_, rank));
  Saved& sv = *saved;
  RDEP_RETURN_IF_ERROR(domain_.CheckErrors(rank));
  st.plan_copy_pending = false;
  if (config_.nodes.nodes > 1) return RunTwoPhase(rank, ctx, st, sv, x, y);  // cuda_two_phase.cc
  RDEP_RETURN_IF_ERROR(StreamReplicas(rank, st, sv, /*backward=*/false));  // before any replica computes: the first segment barrier
  RDEP_RETURN_IF_ERROR(Exchange(rank, st, sv, /*backward=*/false, x));  // with the paged stash, the rows into its pages
  if (config_.owner_reduce)
    RDEP_RETURN_IF_ERROR(CombineReduced(rank, sv, /*backward=*/false, y));
  else if (config_.gate_in_expert)  // the rows came back weighted: weights 1, nothing kept for dgate
    RDEP_RETURN_IF_ERROR(FrontCombine(rank, sv, nullptr, y, nullptr));
  else
    RDEP_RETURN_IF_ERROR(FrontCombine(rank, sv, sv.effective.ptr, y, sv.saved_f.ptr));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkCombine));
  RDEP_RETURN_IF_ERROR(CheckRoutingInput(rank, sv, /*wait=*/!sv.counts_on_device));
  RDEP_RETURN_IF_ERROR(ArmForward(rank, sv));
  ContextAccess::FinishForward(ctx);
  return Status::Ok();
}

bool CudaMoELayer::CombinesInPlace(const Saved& sv) const { return w1_in_place_ && sv.num_segments == 1; }

// The owner's rows in place (W = 1: the rows this call's segment left, read through the forward's slot map; bounded by
// the segment's device total's bound when sync-free, else its host count), or the return region.
Status CudaMoELayer::FrontCombine(int32_t rank, const Saved& sv, const float* weights, __nv_bfloat16* out, __nv_bfloat16* save) {
  const int64_t rows = sv.counts_on_device ? MaxSegmentRows(config_, layout_) : sv.total_rows;
  return CombineFrom(rank, sv, sv.combine_rows, rows, weights, out, save);
}

// The front-end's combine into out of `rows` rows in place, read through sv.slot_rows, or (in_place null) of the return
// region every owner wrote into by row identity.
Status CudaMoELayer::CombineFrom(int32_t rank, const Saved& sv, const __nv_bfloat16* in_place, int64_t rows, const float* weights,
                                 __nv_bfloat16* out, __nv_bfloat16* save) {
  const LayerShape& s = config_.shape;
  const bf16_bits* from = in_place ? Bits(in_place) : static_cast<const bf16_bits*>(domain_.region(rank, regions_.ret));
  return dispatch::LaunchCombine(from, sv.accepted.ptr, weights, sv.num_tokens, s.topk, s.hidden, Bits(out), save ? Bits(save) : nullptr,
                                 domain_.stream(rank), in_place ? sv.slot_rows.ptr : nullptr, rows);
}

// The plan's device check of the routing (LaunchValidateRouting) as a Status naming rank, token,
// slot and value. The forward has synchronized its stream by now (segment counts), so the wait on
// the copy's event returns at once. A plan recorded in a stream capture left a graph node, not an
// event the host can wait on or query: the wait is then on the rank's stream (after replays), and
// the non-blocking read leaves the check for later.
Status CudaMoELayer::CheckRoutingInput(int32_t rank, Saved& sv, bool wait) {
  if (wait && sv.fault_in_capture) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  } else if (wait) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(sv.fault_copied));
  } else {  // sync-free: read the record only if the device already wrote it (never inside a graph capture)
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(domain_.stream(rank), &capture));
    const bool queryable = capture == cudaStreamCaptureStatusNone && !sv.fault_in_capture;
    const cudaError_t ready = queryable ? cudaEventQuery(sv.fault_copied) : cudaErrorNotReady;
    if (ready == cudaErrorNotReady) {
      if (queryable) (void)cudaGetLastError();  // "not ready" is no error: leave none for the next launch's check
      sv.fault_unchecked = true;
      return Status::Ok();
    }
    RDEP_CUDA_RETURN_IF_ERROR(ready);
  }
  sv.fault_unchecked = false;
  const volatile dispatch::RoutingFault* v = sv.host_fault;  // written by the device through the mapping
  const dispatch::RoutingFault f{v->key, v->expert, v->gate};
  if (f.key == ~0ull) {
    if (sv.host_plan_misc && static_cast<const volatile int64_t*>(sv.host_plan_misc)[3] != 0)
      return InternalError("forward on rank " + std::to_string(rank) +
                           ": the device balance plan is inconsistent (its reroute found residual demand above residual quota)");
    return Status::Ok();
  }
  const auto i = static_cast<int64_t>(f.key >> 2), K = config_.shape.topk;
  return InvalidArgument("forward on rank " + std::to_string(rank) + ": routing " +
                         DescribeRouteSlotFault(static_cast<RouteSlotFault>(f.key & 3), i / K, i % K, f.expert, f.gate,
                                                config_.shape.experts) +
                         " (the token ran with zero gates so that every rank finished the call)");
}

Status CudaMoELayer::Backward(int32_t rank, ForwardContext& ctx, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* dgates) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  if (kind_ != ExpertKind::kSwiGLU) return FailedPrecondition("backward needs the SwiGLU expert kind");
  if (!ranks_[static_cast<size_t>(rank)]->has_weights() || !ranks_[static_cast<size_t>(rank)]->has_grads())
    return FailedPrecondition("backward on rank " + std::to_string(rank) +
                              ": the layer was created without weights and no weights and gradients are bound");
  if (ranks_[static_cast<size_t>(rank)]->grads().bf16() && config_.balance.enabled())
    return FailedPrecondition("backward on rank " + std::to_string(rank) + " with balancing (" + BalanceKindName(config_.balance.kind) +
                              "): bf16 weight gradients are not supported (replica gradients reduce into fp32 ones); bind fp32 gradients");
  if (ranks_[static_cast<size_t>(rank)]->grads().bf16()) {
    const Saved* peek = ContextAccess::Peek<Saved>(ctx, id_, rank);
    if (peek && peek->num_segments > 1)
      return FailedPrecondition("backward on rank " + std::to_string(rank) + ": bf16 weight gradients need the forward in one segment (it ran in " +
                                std::to_string(peek->num_segments) + "; use segment_tokens = 0, the default, or bind fp32 gradients)");
  }
  RDEP_RETURN_IF_ERROR(CheckOwnWeightsInGrads(rank));  // ctx kept
  if (Stashing(*ranks_[static_cast<size_t>(rank)])) RDEP_RETURN_IF_ERROR(RefuseStashInCapture(rank, "backward"));  // ctx kept
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginBackward<Saved>(ctx, id_, rank));
  Saved& sv = *saved;
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_RETURN_IF_ERROR(domain_.CheckErrors(rank));
  RDEP_RETURN_IF_ERROR(domain_.TakeForward(rank, sv.armed.ptr));  // a replayed backward without its forward: recorded, trapped
  st.plan_copy_pending = false;
  if (config_.nodes.nodes > 1) return BackwardTwoPhase(rank, st, sv, dy, dx, dgates);  // cuda_two_phase.cc
  const LayerShape& s = config_.shape;
  cudaStream_t stream = domain_.stream(rank);
  RDEP_RETURN_IF_ERROR(Mark(rank, st, true, kMarkStart));
  if (Stashing(st)) RDEP_RETURN_IF_ERROR(UnstashSaved(rank, st, sv, dx, dgates));  // an overflow anywhere: every rank fails here
  if (!OwnersTakeDgateDots(config_))  // else from the owners' dots after the exchange
    RDEP_RETURN_IF_ERROR(dispatch::LaunchDgate(Bits(dy), Bits(sv.saved_f.ptr), sv.gates.ptr, sv.accepted.ptr, sv.num_tokens, s.topk,
                                               s.hidden, st.scratch.ptr, dgates, stream));
  // The weight gradients are written by the first segment's expert compute (overwrite; later segments
  // add to them), or zeroed there when this owner has no rows in it: no pass over them here.
  if (sv.num_segments == 0) RDEP_RETURN_IF_ERROR(FillWeightGrads(st, 0, stream));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, true, kMarkRouting));
  RDEP_RETURN_IF_ERROR(StreamReplicas(rank, st, sv, /*backward=*/true));  // another call may have used the slots since forward
  RDEP_RETURN_IF_ERROR(Exchange(rank, st, sv, /*backward=*/true, dy));
  RDEP_RETURN_IF_ERROR(ReduceReplicas(rank, st, sv));  // after backward.done: every replica's gradient is final
  if (config_.owner_reduce) {
    RDEP_RETURN_IF_ERROR(DgatesFromDots(rank, st, sv, dgates));
    RDEP_RETURN_IF_ERROR(CombineReduced(rank, sv, /*backward=*/true, dx));
  } else {
    if (config_.gate_in_expert) RDEP_RETURN_IF_ERROR(DgatesFromDots(rank, st, sv, dgates));
    RDEP_RETURN_IF_ERROR(FrontCombine(rank, sv, nullptr, dx, nullptr));
  }
  RDEP_RETURN_IF_ERROR(Mark(rank, st, true, kMarkCombine));
  // A sync-free forward whose routing check had not completed reports it here (after the collective).
  return sv.fault_unchecked ? CheckRoutingInput(rank, sv, /*wait=*/false) : Status::Ok();
}

// The context holds a completed forward (its backward's TakeForward takes it): on the rank's stream, so a captured
// forward's replays set it too.
Status CudaMoELayer::ArmForward(int32_t rank, Saved& sv) {
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(sv.armed.ptr, 1, sizeof(int32_t), domain_.stream(rank)));
  return Status::Ok();
}

dispatch::RouteTargets CudaMoELayer::Targets(const RankState& st, const Saved& sv) const {
  const dispatch::OwnerMapView own{st.owner.ptr, st.local.ptr};
  return config_.balance.enabled() ? dispatch::RouteTargets{own, sv.dest_rank.ptr, sv.dest_local.ptr} : dispatch::RouteTargets{own};
}

// Phase 3 per segment: scatter this rank's tokens in each owner's window, barrier, then the owner
// work on this rank's own segment and the return of its rows; the final barrier after which every
// returned row has landed. Forward records the owner's grouped rows per segment into the context.
Status CudaMoELayer::Exchange(int32_t rank, RankState& st, Saved& sv, bool backward, const __nv_bfloat16* payload) {
  if (!backward) sv.overlapped = Overlapped(st, sv, backward);
  sv.combine_rows = nullptr;  // set by the owner's segment when the combine reads its rows in place
  if (Overlapped(st, sv, backward)) return ExchangeOverlapped(rank, st, sv, backward, payload);  // cuda_overlap.cc
  const int64_t S = layout_.S;
  cudaStream_t stream = domain_.stream(rank);
  const dispatch::RouteTargets targets = Targets(st, sv);
  if (!backward) {
    sv.seg_rows.assign(static_cast<size_t>(sv.num_segments), {});
    sv.seg_base.assign(static_cast<size_t>(sv.num_segments), 0);
    sv.total_rows = 0;
  }
  for (int64_t seg = 0; seg < sv.num_segments; ++seg) {
    const auto buf = static_cast<int32_t>(seg % 2);
    const int64_t lo = seg * S;
    RDEP_RETURN_IF_ERROR(dispatch::LaunchScatter(Bits(payload), sv.experts.ptr, sv.accepted.ptr, sv.effective.ptr, sv.tok_index.ptr,
                                                 sv.num_tokens, layout_, targets, rank, sv.control.ptr, lo, buf,
                                                 domain_.peer_table(rank, regions_.payload), domain_.peer_table(rank, regions_.sideband), stream,
                                                 sv.windowed ? sv.window_tokens.ptr : nullptr));
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardSegment : Phase::kDispatchSegment));
    RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkDispatch));
    const auto* seg_payload = static_cast<const bf16_bits*>(domain_.region(rank, regions_.payload)) + static_cast<int64_t>(buf) * S * config_.shape.hidden;
    if (!backward) RDEP_RETURN_IF_ERROR(OwnerForwardSegment(rank, st, sv, seg, seg_payload));
    else RDEP_RETURN_IF_ERROR(OwnerBackwardSegment(rank, st, sv, seg, seg_payload));
  }
  return FinishExchange(rank, st, sv, backward);
}

// The exchange's final barrier, after which every returned row has landed. A forward with the paged
// stash takes its pages before it and tells every rank its outcome; after it, copies its rows into the
// pages and sends every rank's outcome to the host for the backward (cuda_stash.cc).
Status CudaMoELayer::FinishExchange(int32_t rank, RankState& st, Saved& sv, bool backward) {
  const bool stash = !backward && Stashing(st);
  if (stash) RDEP_RETURN_IF_ERROR(StashSaved(rank, st, sv));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardDone : Phase::kReturnDone));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkReturnWait));
  return stash ? StashOutcomeAfterBarrier(rank, st, sv) : Status::Ok();  // profiled with the combine, as before
}

// Owner, forward, one segment: expand into expert-grouped rows (the GEMMs need the per-expert counts
// on the host), gather, expert MLP (or the sentinel echo), return rows to their front-ends.
Status CudaMoELayer::OwnerForwardSegment(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload) {
  if (SyncFree(st)) return OwnerForwardSyncFree(rank, st, sv, seg, seg_payload);
  sv.counts_on_device = false;
  const LayerShape& s = config_.shape;
  const int64_t H = s.hidden, S = layout_.S;
  cudaStream_t stream = domain_.stream(rank);
  const auto buf = static_cast<int32_t>(seg % 2);
  const int64_t base = sv.total_rows;
  RDEP_RETURN_IF_ERROR(sv.grouped.Grow(static_cast<size_t>(base + MaxSegmentRows(config_, layout_)), static_cast<size_t>(base), stream));
  const bool reduce = config_.owner_reduce;
  if (reduce)
    RDEP_RETURN_IF_ERROR(sv.inv.Grow(static_cast<size_t>((seg + 1) * S * layout_.slots_per_token),
                                     static_cast<size_t>(seg * S * layout_.slots_per_token), stream));
  const int32_t phys = physical_experts(st);  // local experts, with balancing then the redundant slots
  RDEP_RETURN_IF_ERROR(dispatch::LaunchExpand(domain_.region(rank, regions_.sideband), buf, seg * S, layout_, sv.control.ptr,
                                              phys, st.seg_counts.ptr, sv.grouped.ptr + base, MaxSegmentRows(config_, layout_),
                                              st.expand_scratch.ptr, stream,
                                              reduce ? SegmentInv(sv, seg) : nullptr, CombinesInPlace(sv) ? sv.slot_rows.ptr : nullptr));
  if (phys > 0)
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.host_counts, st.seg_counts.ptr, sizeof(int64_t) * static_cast<size_t>(phys),
                                              cudaMemcpyDeviceToHost, stream));
  RDEP_RETURN_IF_ERROR(domain_.Synchronize(rank));
  std::vector<int64_t> counts(st.host_counts, st.host_counts + phys);
  int64_t m = 0;
  for (int64_t c : counts) m += c;
  if (m > MaxSegmentRows(config_, layout_))  // the capacity rule bounds it; grouped rows were sized by it
    return InternalError("rank " + std::to_string(rank) + " segment " + std::to_string(seg) + ": " + std::to_string(m) +
                         " rows received, more than the " + std::to_string(MaxSegmentRows(config_, layout_)) + " the capacity allows");
  sv.seg_rows[static_cast<size_t>(seg)] = counts;
  sv.seg_base[static_cast<size_t>(seg)] = base;
  sv.total_rows += m;
  RDEP_RETURN_IF_ERROR(sv.x_rows.Grow(static_cast<size_t>(sv.total_rows * H), static_cast<size_t>(base * H), stream));
  RDEP_RETURN_IF_ERROR(sv.h_rows.Grow(static_cast<size_t>(sv.total_rows * 2 * s.ffn), static_cast<size_t>(base * 2 * s.ffn), stream));
  const bool keep = OwnerKeepsOutputs(config_);  // owner_reduce keeps f_k for dgate (not with gate_in_expert)
  if (keep) RDEP_RETURN_IF_ERROR(sv.f_rows.Grow(static_cast<size_t>(sv.total_rows * H), static_cast<size_t>(base * H), stream));
  __nv_bfloat16* out = keep ? sv.f_rows.ptr + base * H : OutRows(rank);
  __nv_bfloat16* xr = sv.x_rows.ptr + base * H;
  RDEP_RETURN_IF_ERROR(dispatch::LaunchGatherRows(seg_payload, sv.grouped.ptr + base, m, H, false, Bits(xr), stream));
  if (kind_ == ExpertKind::kSentinel) {
    const int32_t* expert_of = config_.balance.enabled() ? sv.phys_global.ptr : st.local_to_global.ptr;  // physical -> logical
    RDEP_RETURN_IF_ERROR(dispatch::LaunchSentinelEcho(Bits(xr), sv.grouped.ptr + base, m, H, rank, expert_of,
                                                      Bits(OutRows(rank)), stream));
  } else if (kind_ == ExpertKind::kIdentity) {  // f(x) = x (forward only): the rows as gathered
    if (m > 0)
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, xr, static_cast<size_t>(m * H) * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, stream));
  } else if (m > 0) {
    for (const ExpertCall& c : ExpertCalls(rank, st, st.seg_counts.ptr, counts))  // the counts are on the host already
      RDEP_RETURN_IF_ERROR(c.mlp->Forward(c.counts, xr + c.first * H, c.weights, sv.h_rows.ptr + (base + c.first) * 2 * s.ffn,
                                          out + c.first * H, stream));
  }
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkExpert));
  if (reduce) RDEP_RETURN_IF_ERROR(ReturnReduced(rank, out, sv, seg, base, /*backward=*/false));
  else if (CombinesInPlace(sv)) sv.combine_rows = out;
  else RDEP_RETURN_IF_ERROR(ReturnRows(rank, out, sv, base, m, stream));
  return Mark(rank, st, false, kMarkReturn);
}

// This rank's weights may lie in its own gradients only where the backward reads each weight before
// writing its gradient (weights_in_grads.h). Other local ranks' bindings are not read here (each rank's
// thread binds its own); the C ABI, which holds every local rank's arrays, checks across ranks too.
Status CudaMoELayer::CheckOwnWeightsInGrads(int32_t rank) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  const kernels::ExpertWeightsView w = st.weights();
  const kernels::ExpertGradsView g = st.grads();
  const size_t ge = g.bf16() ? 2 : sizeof(float);
  const ExpertByteRanges r{w.w1, st.w1_count * 2, w.w2, st.w2_count * 2,
                           g.bf16() ? static_cast<const void*>(g.dw1_bf16) : g.dw1, st.w1_count * ge,
                           g.bf16() ? static_cast<const void*>(g.dw2_bf16) : g.dw2, st.w2_count * ge};
  return CheckWeightsInGrads(config_, /*cuda=*/true, {&r, 1}, rank);
}

// Sets every byte of this rank's main-expert weight gradients (fp32 or bf16): 0 for a backward whose expert
// compute will not write them (no rows at this owner in the first segment, or no segment at all), 0xFF
// (NaN) for a backward that fails before its exchange.
Status CudaMoELayer::FillWeightGrads(RankState& st, int byte, cudaStream_t stream) {
  if (!st.w1_count) return Status::Ok();
  const kernels::ExpertGradsView g = st.grads();
  const size_t elem = g.bf16() ? 2 : sizeof(float);
  void* dw1 = g.bf16() ? static_cast<void*>(g.dw1_bf16) : static_cast<void*>(g.dw1);
  void* dw2 = g.bf16() ? static_cast<void*>(g.dw2_bf16) : static_cast<void*>(g.dw2);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dw1, byte, st.w1_count * elem, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dw2, byte, st.w2_count * elem, stream));
  return Status::Ok();
}

// Owner, backward, one segment: dout rows = gate * dy in the forward's grouped order, dgrad and
// wgrad (accumulated over segments), dx rows back to their front-ends.
Status CudaMoELayer::OwnerBackwardSegment(int32_t rank, RankState& st, Saved& sv, int64_t seg, const uint16_t* seg_payload) {
  if (sv.counts_on_device) return OwnerBackwardSyncFree(rank, st, sv, seg, seg_payload);
  const LayerShape& s = config_.shape;
  const int64_t H = s.hidden;
  cudaStream_t stream = domain_.stream(rank);
  const int64_t base = sv.seg_base[static_cast<size_t>(seg)];
  const auto& counts = sv.seg_rows[static_cast<size_t>(seg)];
  int64_t m = 0;
  for (int64_t c : counts) m += c;
  RDEP_RETURN_IF_ERROR(dispatch::LaunchGatherRows(seg_payload, sv.grouped.ptr + base, m, H, true, Bits(OutRows(rank)), stream));
  if (seg == 0 && replica_g_ >= 0)  // this call's replica gradients accumulate from here (after the segment barrier:
                                    // the owners' reductions of the previous backward read them before it)
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(domain_.region(rank, replica_g_), 0,
                                              static_cast<size_t>(config_.replica_slots()) * static_cast<size_t>(3 * H * s.ffn) * sizeof(float),
                                              stream));
  const int64_t dx_at = DxOverDout(config_) ? 0 : m;  // dx rows over the dout rows, or right behind them
  if (m > 0) {
    const int64_t* dev_counts = nullptr;  // counts saved by forward on the host; a compute that reads them on the
    if (st.mlp && st.mlp->graph_safe()) {  // device gets them back there (stream-ordered, staged by the copy)
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.seg_counts.ptr, counts.data(), counts.size() * sizeof(int64_t),
                                                cudaMemcpyHostToDevice, stream));
      dev_counts = st.seg_counts.ptr;
    }
    int64_t main_rows = 0;
    for (int32_t j = 0; j < st.num_local && static_cast<size_t>(j) < counts.size(); ++j) main_rows += counts[static_cast<size_t>(j)];
    if (seg == 0 && main_rows == 0) RDEP_RETURN_IF_ERROR(FillWeightGrads(st, 0, stream));  // no call will write them
    // dx over dout (dx_at 0) only where Create checked the compute's dx_may_alias_dout().
    for (const ExpertCall& c : ExpertCalls(rank, st, dev_counts, counts, /*first_segment=*/seg == 0)) {
      RDEP_RETURN_IF_ERROR(c.mlp->Backward(c.counts, sv.x_rows.ptr + (base + c.first) * H, sv.h_rows.ptr + (base + c.first) * 2 * s.ffn,
                                           OutRows(rank) + c.first * H, c.weights, OutRows(rank) + (dx_at + c.first) * H, c.grads,
                                           c.accumulate, stream));
    }
  } else if (seg == 0) {  // no rows at this owner in the first segment: its gradients are zero so far
    RDEP_RETURN_IF_ERROR(FillWeightGrads(st, 0, stream));
  }
  RDEP_RETURN_IF_ERROR(Mark(rank, st, true, kMarkExpert));
  if (config_.owner_reduce) {
    if (OwnerKeepsOutputs(config_))  // with gate_in_expert only a rank without experts (no rows, no f) comes here
      RDEP_RETURN_IF_ERROR(OwnerDots(rank, seg_payload, sv, base, m, nullptr));
    RDEP_RETURN_IF_ERROR(ReturnReduced(rank, OutRows(rank) + dx_at * H, sv, seg, base, /*backward=*/true));
  } else if (CombinesInPlace(sv)) {
    sv.combine_rows = OutRows(rank) + dx_at * H;
  } else {
    RDEP_RETURN_IF_ERROR(ReturnRows(rank, OutRows(rank) + dx_at * H, sv, base, m, stream));
  }
  return Mark(rank, st, true, kMarkReturn);
}

StatusOr<RankAcceptance> CudaMoELayer::CopyAcceptance(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  const Saved* sv = last(rank);
  if (!sv) return FailedPrecondition("rank " + std::to_string(rank) + ": no completed forward in the layer's own context");
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  const auto nk = static_cast<size_t>(sv->num_tokens * config_.shape.topk);
  RankAcceptance a;
  a.accepted.resize(nk);
  a.effective_gates.resize(nk);
  if (nk) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(a.accepted.data(), sv->accepted.ptr, nk, cudaMemcpyDeviceToHost));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(a.effective_gates.data(), sv->effective.ptr, nk * 4, cudaMemcpyDeviceToHost));
  }
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(&a.dropped, sv->dropped.ptr, sizeof(int64_t), cudaMemcpyDeviceToHost));
  return a;
}

StatusOr<std::vector<int64_t>> CudaMoELayer::CopyLoadMatrix(const ForwardContext& ctx) const {
  const int32_t rank = ctx.rank();
  if (!config_.load_matrix) return FailedPrecondition("load matrix: the layer was created without LayerConfig::load_matrix");
  const Saved* sv = CheckLocalRank(rank).ok() ? ContextAccess::Peek<Saved>(ctx, id_, rank) : nullptr;
  if (!sv) return FailedPrecondition("load matrix: the context holds no plan of this layer");
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  std::vector<int64_t> lambda(static_cast<size_t>(layout_.W * layout_.E_load));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(lambda.data(), sv->control.ptr + layout_.load(0, 0), lambda.size() * sizeof(int64_t),
                                       cudaMemcpyDeviceToHost));
  return lambda;
}

StatusOr<std::vector<OwnerTraceEntry>> CudaMoELayer::CopyOwnerTrace(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  const Saved* sv = last(rank);
  if (!sv) return FailedPrecondition("rank " + std::to_string(rank) + ": no completed forward in the layer's own context");
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  std::vector<int64_t> dev;  // a sync-free forward left its counts (per segment, phys and their total) on the device
  if (sv->counts_on_device) {
    RDEP_ASSIGN_OR_RETURN(dev, DeviceCounts(rank, *sv));
  }
  const auto stride = static_cast<size_t>(physical_experts(*ranks_[static_cast<size_t>(rank)])) + 1;
  std::vector<OwnerTraceEntry> trace;
  for (int64_t seg = 0; seg < sv->num_segments; ++seg) {
    int64_t m = sv->counts_on_device ? dev[static_cast<size_t>(seg + 1) * stride - 1] : 0;
    for (int64_t c : sv->seg_rows[static_cast<size_t>(seg)]) m += c;
    const int64_t base = sv->seg_base[static_cast<size_t>(seg)];
    std::vector<GroupedRow> rows(static_cast<size_t>(m));
    if (m > 0)
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(rows.data(), sv->grouped.ptr + base, rows.size() * sizeof(GroupedRow), cudaMemcpyDeviceToHost));
    for (int64_t g = 0; g < m; ++g) {
      const GroupedRow& r = rows[static_cast<size_t>(g)];
      trace.push_back({r.row_id, r.local_expert, static_cast<int32_t>(seg), g});
    }
  }
  return trace;
}

std::vector<int64_t> CudaMoELayer::owner_rows_per_expert(int32_t rank) const {
  const Saved* sv = CheckLocalRank(rank).ok() ? last(rank) : nullptr;
  std::vector<int64_t> total(sv ? static_cast<size_t>(physical_experts(*ranks_[static_cast<size_t>(rank)])) : 0, 0);
  if (sv && sv->counts_on_device) {  // a sync-free forward: the counts are on the device (this waits)
    auto c = DeviceCounts(rank, *sv);
    if (c.ok())
      for (size_t at = 0; at < c->size(); at += total.size() + 1)
        for (size_t j = 0; j < total.size(); ++j) total[j] += (*c)[at + j];
    return total;
  }
  if (sv)
    for (const auto& seg : sv->seg_rows)
      for (size_t j = 0; j < seg.size() && j < total.size(); ++j) total[j] += seg[j];
  return total;
}

StatusOr<std::vector<float>> CudaMoELayer::CopyExpertOutputs(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  if (config_.nodes.nodes > 1) return CopyExpertOutputsTwoPhase(rank);  // the rows stayed at the relays
  if (OwnersTakeDgateDots(config_))
    return FailedPrecondition("rank " + std::to_string(rank) + ": with " + (config_.owner_reduce ? "owner_reduce" : "gate_in_expert") +
                              " the front-end keeps no expert outputs");
  const Saved* sv = last(rank);
  if (!sv) return FailedPrecondition("rank " + std::to_string(rank) + ": no completed forward in the layer's own context");
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  const auto count = static_cast<size_t>(sv->num_tokens * config_.shape.topk * config_.shape.hidden);
  std::vector<uint16_t> bits(count);
  if (count) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(bits.data(), sv->saved_f.ptr, count * 2, cudaMemcpyDeviceToHost));
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = Bf16BitsToFloat(bits[i]);
  return out;
}

}  // namespace rdep
