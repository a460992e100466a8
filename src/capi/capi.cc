// rdep's C ABI (rdep/capi.h): layer handles on domain handles (capi_domain.cc), pooled contexts,
// argument checks naming the field and rank, and errors as codes plus a per-thread message. No C++
// exception crosses the ABI.
#include "rdep/capi.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "capi/capi_internal.h"
#include "capi/layer_adapter.h"
#include "capi/row_arena.h"
#include "layer/weights_in_grads.h"
#include "rdep/cuda/device_count.h"

namespace {

using rdep::capi::Fail;
using rdep::capi::FailInvalid;
using rdep::capi::Guard;

// A layer spec of another header version is refused before any field is read: 0 when its size fits.
// Every version that changes the spec changes its size (version 6 added transport_sms and reserved: 144 ->
// 152 bytes; versions 7 and 8 added functions only; version 9 added balance_min_gain: 160 bytes; version 10
// stash_rows: 168 bytes; version 11 overlap_segments: 176 bytes; version 12 gate_in_expert: 184 bytes; version 20
// no_source_windows: 192 bytes).
static_assert(sizeof(rdep_layer_spec) == 192, "rdep_layer_spec changed: bump RDEP_CAPI_VERSION and make the size differ");
int CheckStructSize(const rdep_layer_spec& spec) {
  if (spec.struct_size == static_cast<int32_t>(sizeof(rdep_layer_spec))) return 0;
  return FailInvalid("layer spec: struct_size " + std::to_string(spec.struct_size) + " != " + std::to_string(sizeof(rdep_layer_spec)) +
                     " (caller built against another rdep/capi.h)");
}

// A forward's saved state for each local rank; pooled, its id = slot * 2^32 + generation.
struct ContextSlot {
  uint32_t generation = 1;
  bool in_use = false;
  bool holds_forward = false;  // a forward completed into it since it was acquired, and no backward yet
  bool forward_ran = false;    // a forward completed into it since it was acquired (its backward may have run)
  std::vector<int64_t> plan_tokens;  // per local rank: num_tokens of the last rdep_layer_plan (empty: none)
  std::vector<rdep::ForwardContext> per_rank;  // memory kept across reuses of the slot
};

}  // namespace

namespace rdep::capi {
const char* RowsStepName(LayerAdapter::RowsStep step) {
  switch (step) {
    case LayerAdapter::RowsStep::kDispatch: return "dispatch";
    case LayerAdapter::RowsStep::kCombine: return "combine";
    case LayerAdapter::RowsStep::kCombineBackward: return "combine backward";
    case LayerAdapter::RowsStep::kDispatchBackward: return "dispatch backward";
  }
  return "rows step";
}
}  // namespace rdep::capi

struct rdep_layer {
  rdep_layer_spec spec{};
  rdep::LayerConfig config;
  rdep::OwnershipMap ownership;
  rdep_domain* domain = nullptr;  // a reference held (released after the adapter is gone)
  std::unique_ptr<rdep::capi::LayerAdapter> adapter;
  std::vector<int32_t> ranks;
  std::mutex mu;  // contexts
  std::deque<ContextSlot> slots;  // a deque: slots stay put while others are added
  struct {
    rdep_alloc_fn alloc = nullptr;
    rdep_free_fn free = nullptr;
    void* user = nullptr;
  } rows;  // the caller's row allocator (rdep_layer_set_row_allocator), put back after an arena forward

  rdep_layer() = default;
  rdep_layer(const rdep_layer&) = delete;
  rdep_layer& operator=(const rdep_layer&) = delete;
  ~rdep_layer() {
    if (adapter) {  // the layer frees its regions (and drops its hold on shared ones) between the domain's calls
      std::lock_guard<std::mutex> call(domain->call_mu);
      slots.clear();  // the contexts first, while their layer lives (a paged stash's pages go back to its pool)
      adapter.reset();
      --domain->layers;
    }
    rdep::capi::ReleaseDomain(domain);
  }

  // One collective on the layer's domain at a time (binding and collective): calls of any of its layers.
  std::mutex& call_mu() { return domain->call_mu; }

  // The slot of a live id, or null.
  ContextSlot* Find(int64_t id) {
    const uint64_t slot = static_cast<uint64_t>(id) >> 32;
    const auto gen = static_cast<uint32_t>(static_cast<uint64_t>(id) & 0xffffffffu);
    if (id <= 0 || slot >= slots.size() || slots[slot].generation != gen || !slots[slot].in_use) return nullptr;
    return &slots[slot];
  }
};

namespace {

rdep::Status CheckSpec(const rdep_layer_spec& s) {
  using rdep::InvalidArgument;
  if (s.backend < RDEP_BACKEND_HOST || s.backend > RDEP_BACKEND_CUDA_PER_PROCESS)
    return InvalidArgument("layer spec: backend " + std::to_string(s.backend) + " is not 0 (host), 1 (cuda, one process) or 2 (cuda, per process)");
  if (s.world_size < 1) return InvalidArgument("layer spec: world_size must be >= 1, got " + std::to_string(s.world_size));
  if (s.backend == RDEP_BACKEND_CUDA_PER_PROCESS && (s.process_rank < 0 || s.process_rank >= s.world_size))
    return InvalidArgument("layer spec: process_rank " + std::to_string(s.process_rank) + " outside [0, world_size=" +
                           std::to_string(s.world_size) + ")");
  if (s.segment_tokens < 0) return InvalidArgument("layer spec: segment_tokens must be >= 0 (0 = the default)");
  if (!(s.barrier_timeout_s >= 0) || !std::isfinite(s.barrier_timeout_s))
    return InvalidArgument("layer spec: barrier_timeout_s must be finite and >= 0 (0 = the default)");
  if (s.balance < RDEP_BALANCE_OFF || s.balance > RDEP_BALANCE_EPLB_EXACT)
    return InvalidArgument("layer spec: balance " + std::to_string(s.balance) +
                           " is not 0 (off), 1 (ultraep), 2 (eplb) or 3 (eplb-exact)");
  if (s.balance_min_quota < 0) return InvalidArgument("layer spec: balance_min_quota must be >= 0 (0 = 1)");
  if (s.balance_min_gain < 0) return InvalidArgument("layer spec: balance_min_gain must be >= 0 (0 = off)");
  if (s.balance_min_gain > 0 && s.balance != RDEP_BALANCE_ULTRAEP)
    return InvalidArgument("layer spec: balance_min_gain is UltraEP's gain gate; set balance = 1 (ultraep) or leave it 0");
  if (s.stash_rows < 0) return InvalidArgument("layer spec: stash_rows must be >= 0 (0 = no paged stash)");
  if (s.stash_rows > 0 && s.backend != RDEP_BACKEND_HOST && s.expert_compute != 1)
    return InvalidArgument("layer spec: stash_rows (the paged stash) needs expert_compute = 1 (CUTLASS: the sync-free layer)");
  if (s.balance_relay_above < -1) return InvalidArgument("layer spec: balance_relay_above must be >= -1 (-1 = the default)");
  if (s.nodes < 0) return InvalidArgument("layer spec: nodes must be >= 0 (0 = one domain)");
  if (s.expert_compute < 0 || s.expert_compute > 1)
    return InvalidArgument("layer spec: expert_compute " + std::to_string(s.expert_compute) + " is not 0 (cublaslt) or 1 (cutlass)");
  if (s.owner_reduce != 0 && s.owner_reduce != 1)
    return InvalidArgument("layer spec: owner_reduce " + std::to_string(s.owner_reduce) + " is not 0 (off) or 1 (on)");
  if (s.reserved != 0) return InvalidArgument("layer spec: reserved must be 0, got " + std::to_string(s.reserved));
  if (s.overlap_segments != 0 && s.overlap_segments != 1)
    return InvalidArgument("layer spec: overlap_segments " + std::to_string(s.overlap_segments) + " is not 0 (off) or 1 (on)");
  if (s.gate_in_expert != 0 && s.gate_in_expert != 1)
    return InvalidArgument("layer spec: gate_in_expert " + std::to_string(s.gate_in_expert) + " is not 0 (off) or 1 (on)");
  if (s.no_source_windows != 0 && s.no_source_windows != 1)
    return InvalidArgument("layer spec: no_source_windows " + std::to_string(s.no_source_windows) +
                           " is not 0 (per-source windows where they apply) or 1 (the three phases)");
  return rdep::Status::Ok();
}

// The pointers a call needs for local rank r (io), checked before any rank starts the collective.
rdep::Status CheckIo(const rdep_layer& l, const rdep_rank_io& a, int32_t rank, bool backward) {
  const auto& s = l.config.shape;
  auto missing = [&](const char* field) {
    return rdep::InvalidArgument(std::string(backward ? "backward" : "forward") + " on rank " + std::to_string(rank) + ": " +
                                 field + " is null");
  };
  if (a.num_tokens < 0 || a.num_tokens > s.tokens)
    return rdep::InvalidArgument("rank " + std::to_string(rank) + ": num_tokens " + std::to_string(a.num_tokens) +
                                 " outside [0, T=" + std::to_string(s.tokens) + "]");
  const bool rows = a.num_tokens > 0, experts = l.ownership.num_local(rank) > 0;
  if (experts && !a.w1) return missing("w1");
  if (experts && !a.w2) return missing("w2");
  if (a.reserved != 0) return rdep::InvalidArgument("rank " + std::to_string(rank) + ": reserved must be 0");
  if (l.spec.backend != RDEP_BACKEND_HOST) {  // the expert GEMMs need 16-byte aligned weights and gradients
    for (const auto& [p, name] : {std::pair<const void*, const char*>{a.w1, "w1"}, {a.w2, "w2"}, {a.dw1, "dw1"}, {a.dw2, "dw2"}})
      if (reinterpret_cast<uintptr_t>(p) % 16 != 0 && (backward || name[0] == 'w'))
        return rdep::InvalidArgument("rank " + std::to_string(rank) + ": " + name + " must be 16-byte aligned");
  }
  if (a.grad_bf16 != 0 && a.grad_bf16 != 1)
    return rdep::InvalidArgument("rank " + std::to_string(rank) + ": grad_bf16 must be 0 or 1, got " + std::to_string(a.grad_bf16));
  if (backward && a.grad_bf16 && l.spec.backend == RDEP_BACKEND_HOST)  // forward ignores it
    return rdep::InvalidArgument("rank " + std::to_string(rank) + ": grad_bf16 (bf16 weight gradients) is for the CUDA backend");
  if (backward && a.grad_bf16 && l.spec.segment_tokens > 0 && l.spec.segment_tokens < s.ranks * s.tokens)
    return rdep::InvalidArgument("rank " + std::to_string(rank) + ": grad_bf16 needs one segment per forward (segment_tokens 0 or >= W*T = " +
                                 std::to_string(s.ranks * s.tokens) + ", got " + std::to_string(l.spec.segment_tokens) + ")");
  if (!backward) {
    if (rows && !a.experts) return missing("experts");
    if (rows && !a.gates) return missing("gates");
    if (rows && !a.x) return missing("x");
    if (rows && !a.y) return missing("y");
  } else {
    if (rows && !a.dy) return missing("dy");
    if (rows && !a.dx) return missing("dx");
    if (rows && !a.dgates) return missing("dgates");
    if (experts && !a.dw1) return missing("dw1");
    if (experts && !a.dw2) return missing("dw2");
  }
  return rdep::Status::Ok();
}

// The routing a plan reads (num_tokens, experts, gates), checked before the collective.
rdep::Status CheckPlanIo(const rdep_layer& l, const rdep_rank_io& a, int32_t rank) {
  const auto& s = l.config.shape;
  const std::string who = "plan on rank " + std::to_string(rank) + ": ";
  if (a.num_tokens < 0 || a.num_tokens > s.tokens)
    return rdep::InvalidArgument(who + "num_tokens " + std::to_string(a.num_tokens) + " outside [0, T=" + std::to_string(s.tokens) + "]");
  if (a.num_tokens > 0 && !a.experts) return rdep::InvalidArgument(who + "experts is null");
  if (a.num_tokens > 0 && !a.gates) return rdep::InvalidArgument(who + "gates is null");
  if (a.reserved != 0) return rdep::InvalidArgument(who + "reserved must be 0");
  return rdep::Status::Ok();
}

// One local rank's rows of a dispatch/combine step, checked before the collective (the layer checks
// the row counts against the plan).
rdep::Status CheckRows(const rdep_rank_rows& a, int32_t rank, rdep::capi::LayerAdapter::RowsStep step) {
  const std::string who = std::string(rdep::capi::RowsStepName(step)) + " on rank " + std::to_string(rank) + ": ";
  if (a.in_rows < 0 || a.out_rows < 0)
    return rdep::InvalidArgument(who + "in_rows and out_rows must be >= 0, got " + std::to_string(a.in_rows) + ", " +
                                 std::to_string(a.out_rows));
  if (a.in_rows > 0 && !a.in) return rdep::InvalidArgument(who + "in is null with in_rows " + std::to_string(a.in_rows));
  if (a.out_rows > 0 && !a.out) return rdep::InvalidArgument(who + "out is null with out_rows " + std::to_string(a.out_rows));
  if (step == rdep::capi::LayerAdapter::RowsStep::kCombineBackward && a.in_rows > 0 && !a.dgates)
    return rdep::InvalidArgument(who + "dgates is null");
  if (a.reserved != 0) return rdep::InvalidArgument(who + "reserved must be 0");
  return rdep::Status::Ok();
}

// Finds ctx's slot (under the contexts' lock).
ContextSlot* FindSlot(rdep_layer* l, int64_t ctx) {
  std::lock_guard<std::mutex> lock(l->mu);
  return l->Find(ctx);
}

rdep::Status NoSlot(int64_t ctx) {
  return rdep::InvalidArgument("context " + std::to_string(ctx) + " is not a live context of this layer (released or never acquired)");
}

// The index of `rank` among the process's local ranks, or -1.
int32_t LocalIndex(const rdep_layer& l, int32_t rank) {
  for (size_t i = 0; i < l.ranks.size(); ++i)
    if (l.ranks[i] == rank) return static_cast<int32_t>(i);
  return -1;
}

// Every local rank's row counts against its plan (n tokens, M received rows), before the collective:
// a mismatch on one rank would otherwise leave the others waiting at the step's barriers.
rdep::Status CheckRowCounts(rdep_layer& l, ContextSlot& slot, const rdep_rank_rows* rows, rdep::capi::LayerAdapter::RowsStep step) {
  using Step = rdep::capi::LayerAdapter::RowsStep;
  if (slot.plan_tokens.size() != l.ranks.size()) return rdep::Status::Ok();  // no plan: the layer names the missing step
  const bool tokens_in = step == Step::kDispatch || step == Step::kCombineBackward;
  for (size_t i = 0; i < l.ranks.size(); ++i) {
    const rdep::ForwardContext& c = slot.per_rank[i];
    if (step == Step::kDispatch ? !c.planned() : !c.rows_forward()) return rdep::Status::Ok();  // the layer names the step
    auto counts = l.adapter->RecvCounts(slot.per_rank[i], l.ranks[i]);
    if (!counts.ok()) return rdep::Status::Ok();  // the layer reports the context's state
    int64_t M = 0;
    for (int64_t rows_e : *counts) M += rows_e;
    const int64_t n = slot.plan_tokens[i];
    const int64_t want_in = tokens_in ? n : M, want_out = tokens_in ? M : n;
    const std::string who = std::string(rdep::capi::RowsStepName(step)) + " on rank " + std::to_string(l.ranks[i]) + ": ";
    auto what = [&](bool tokens) { return tokens ? "the plan's num_tokens" : "the rows the rank receives (sum of its recv counts)"; };
    if (rows[i].in_rows != want_in)
      return rdep::InvalidArgument(who + "in_rows " + std::to_string(rows[i].in_rows) + " != " + what(tokens_in) + " = " + std::to_string(want_in));
    if (rows[i].out_rows != want_out)
      return rdep::InvalidArgument(who + "out_rows " + std::to_string(rows[i].out_rows) + " != " + what(!tokens_in) + " = " +
                                   std::to_string(want_out));
  }
  return rdep::Status::Ok();
}

int RowsCall(rdep_layer* l, int64_t ctx, const rdep_rank_rows* rows, int32_t count, rdep::capi::LayerAdapter::RowsStep step) {
  if (!l) return FailInvalid("layer is null");
  if (!rows) return FailInvalid("rows is null");
  if (count != static_cast<int32_t>(l->ranks.size()))
    return FailInvalid("rows has " + std::to_string(count) + " entries; this process drives " + std::to_string(l->ranks.size()) +
                       " ranks");
  return Guard([&]() -> rdep::Status {
    for (int32_t i = 0; i < count; ++i) RDEP_RETURN_IF_ERROR(CheckRows(rows[i], l->ranks[static_cast<size_t>(i)], step));
    std::lock_guard<std::mutex> call(l->call_mu());
    ContextSlot* slot = FindSlot(l, ctx);
    if (!slot) return NoSlot(ctx);
    RDEP_RETURN_IF_ERROR(CheckRowCounts(*l, *slot, rows, step));
    slot->holds_forward = false;  // a plain backward never follows these steps
    slot->forward_ran = false;
    return l->adapter->Rows(step, slot->per_rank, rows);
  });
}

// A backward's weights against the gradients it writes, over every local rank (weights_in_grads.h):
// w1 may lie in the same rank's dw1 and w2 in its dw2 where the backward reads each weight first.
rdep::Status CheckWeightsInGradsIo(const rdep_layer& l, const rdep_rank_io* io, int32_t count) {
  const auto& s = l.config.shape;
  const bool cuda = l.spec.backend != RDEP_BACKEND_HOST;
  const size_t welem = cuda ? 2 : sizeof(float);
  std::vector<rdep::ExpertByteRanges> r(static_cast<size_t>(count));
  for (int32_t i = 0; i < count; ++i) {
    const auto e = static_cast<size_t>(l.ownership.num_local(l.ranks[static_cast<size_t>(i)]));
    const size_t n1 = e * static_cast<size_t>(s.hidden * 2 * s.ffn), n2 = e * static_cast<size_t>(s.ffn * s.hidden);
    const size_t gelem = cuda && io[i].grad_bf16 ? 2 : sizeof(float);
    r[static_cast<size_t>(i)] = {io[i].w1, n1 * welem, io[i].w2, n2 * welem, io[i].dw1, n1 * gelem, io[i].dw2, n2 * gelem};
  }
  return rdep::CheckWeightsInGrads(l.config, cuda, r, l.ranks.empty() ? 0 : l.ranks.front());
}

// The caller's arena of one forward (rdep_layer_forward_arena): base, bytes, and where the bytes taken go.
struct ArenaArgs {
  void* base = nullptr;
  size_t bytes = 0;
  size_t* used = nullptr;
};

int Call(rdep_layer* l, int64_t ctx, const rdep_rank_io* io, int32_t count, bool backward, const ArenaArgs* arena = nullptr) {
  if (!l) return FailInvalid("layer is null");
  if (!io) return FailInvalid("io is null");
  if (count != static_cast<int32_t>(l->ranks.size()))
    return FailInvalid("io has " + std::to_string(count) + " entries; this process drives " + std::to_string(l->ranks.size()) +
                       " ranks");
  return Guard([&]() -> rdep::Status {
    for (int32_t i = 0; i < count; ++i) RDEP_RETURN_IF_ERROR(CheckIo(*l, io[i], l->ranks[static_cast<size_t>(i)], backward));
    if (backward) RDEP_RETURN_IF_ERROR(CheckWeightsInGradsIo(*l, io, count));
    std::lock_guard<std::mutex> call(l->call_mu());
    ContextSlot* slot;
    {
      std::lock_guard<std::mutex> lock(l->mu);
      slot = l->Find(ctx);
    }
    if (!slot) return rdep::InvalidArgument("context " + std::to_string(ctx) + " is not a live context of this layer (released or never acquired)");
    if (backward && !slot->holds_forward)
      return rdep::FailedPrecondition("backward: context " + std::to_string(ctx) + " holds no forward (none ran since it was acquired, or its backward already ran)");
    slot->holds_forward = false;
    slot->plan_tokens.clear();
    if (backward) return l->adapter->Backward(slot->per_rank, io);
    slot->forward_ran = false;  // until this forward completes
    if (arena && arena->base && l->rows.alloc) {  // the buffers reserved in this call take pieces of the arena
      rdep::capi::RowArena pieces(arena->base, arena->bytes);
      RDEP_RETURN_IF_ERROR(l->adapter->SetRowAllocator(&rdep::capi::RowArena::Alloc, &rdep::capi::RowArena::Free, &pieces));
      const rdep::Status s = l->adapter->Forward(slot->per_rank, io);
      const rdep::Status back = l->adapter->SetRowAllocator(l->rows.alloc, l->rows.free, l->rows.user);
      if (arena->used) *arena->used = pieces.used();
      RDEP_RETURN_IF_ERROR(s);
      RDEP_RETURN_IF_ERROR(back);
    } else {
      RDEP_RETURN_IF_ERROR(l->adapter->Forward(slot->per_rank, io));
    }
    slot->holds_forward = true;
    slot->forward_ran = true;
    return rdep::Status::Ok();
  });
}

// The layer's configuration from spec, checked.
rdep::Status ConfigOf(const rdep_layer_spec& spec, rdep::LayerConfig& c) {
  c.shape = {.tokens = spec.tokens, .hidden = spec.hidden, .ffn = spec.ffn, .experts = spec.experts,
             .topk = spec.topk, .ranks = spec.world_size};
  c.capacity.capacity_factor = spec.capacity_factor;
  c.segment_tokens = spec.segment_tokens;
  c.balance.kind = static_cast<rdep::BalanceKind>(spec.balance);
  c.balance.num_slots = spec.balance_slots;
  c.balance.min_quota = spec.balance_min_quota > 0 ? spec.balance_min_quota : 1;
  c.balance.min_gain = spec.balance_min_gain;
  c.stash_rows = spec.backend == RDEP_BACKEND_HOST ? 0 : spec.stash_rows;  // the host backend ignores it
  c.overlap_segments = spec.backend != RDEP_BACKEND_HOST && spec.overlap_segments == 1;  // so does this
  c.gate_in_expert = spec.backend != RDEP_BACKEND_HOST && spec.gate_in_expert == 1;      // and this
  c.source_windows = spec.no_source_windows == 0;  // the host backend never takes the windows
  if (spec.balance_relay_above >= 0) c.balance.relay_above = spec.balance_relay_above;
  c.nodes = rdep::NodeConfig{spec.nodes > 0 ? spec.nodes : 1, spec.max_nodes};
  c.expert_compute = spec.expert_compute == 1 ? rdep::ExpertComputeKind::kCutlass : rdep::ExpertComputeKind::kCublasLt;
  c.owner_reduce = spec.owner_reduce == 1;
  c.transport_sms = spec.transport_sms;  // its range checked by Validate, naming the field
  return c.Validate();
}

// A layer of spec (checked, matching d) on domain d, holding one more reference to it. The layer is
// made between the domain's calls (its regions are allocated outside any Run).
rdep::Status CreateOn(rdep_domain* d, const rdep_layer_spec& spec, rdep_layer** out) {
  auto l = std::make_unique<rdep_layer>();
  l->spec = spec;
  RDEP_RETURN_IF_ERROR(ConfigOf(spec, l->config));
  RDEP_ASSIGN_OR_RETURN(l->ownership, rdep::OwnershipMap::Contiguous(spec.experts, spec.world_size));
  rdep::capi::RetainDomain(d);
  l->domain = d;  // from here l's destructor releases the reference
  {
    std::lock_guard<std::mutex> call(d->call_mu);
    if (spec.backend == RDEP_BACKEND_HOST) {
      RDEP_ASSIGN_OR_RETURN(l->adapter, rdep::capi::MakeHostAdapter(*d->domain, l->config, l->ownership));
    } else {
      RDEP_ASSIGN_OR_RETURN(l->adapter, rdep::capi::MakeCudaAdapter(*d->domain, l->config, l->ownership));
    }
    ++d->layers;
  }
  l->ranks = l->adapter->local_ranks();
  *out = l.release();
  return rdep::Status::Ok();
}

}  // namespace

extern "C" {

int32_t rdep_capi_version(void) { return RDEP_CAPI_VERSION; }
const char* rdep_last_error(void) { return rdep::capi::LastError().c_str(); }
int32_t rdep_built_with_cuda(void) {
#if defined(RDEP_HAVE_CUDA)
  return 1;
#else
  return 0;
#endif
}
int32_t rdep_cuda_device_count(void) {
#if defined(RDEP_HAVE_CUDA)
  return rdep::CudaDeviceCount();
#else
  return 0;
#endif
}

int32_t rdep_cutlass_available(int32_t device) {
  const rdep::Status s = rdep::capi::CutlassComputeAvailable(device);
  if (s.ok()) return 1;
  rdep::capi::LastError() = s.message();
  return 0;
}

int rdep_layer_create(const rdep_layer_spec* spec, rdep_layer** out) {
  if (!spec || !out) return FailInvalid("spec and out must not be null");
  *out = nullptr;
  if (const int rc = CheckStructSize(*spec)) return rc;
  return Guard([&]() -> rdep::Status {
    RDEP_RETURN_IF_ERROR(CheckSpec(*spec));
    rdep::LayerConfig config;
    RDEP_RETURN_IF_ERROR(ConfigOf(*spec, config));  // before the domain: a bad shape costs no bootstrap
    RDEP_ASSIGN_OR_RETURN(rdep_domain * d, rdep::capi::CreateDomain(rdep::capi::DomainSpecOf(*spec), "layer spec"));
    const rdep::Status s = CreateOn(d, *spec, out);
    rdep::capi::ReleaseDomain(d);  // the layer holds the domain's only reference (none on failure)
    return s;
  });
}

int rdep_layer_create_on(rdep_domain* domain, const rdep_layer_spec* spec, rdep_layer** out) {
  if (!domain || !spec || !out) return FailInvalid("domain, spec and out must not be null");
  *out = nullptr;
  if (const int rc = CheckStructSize(*spec)) return rc;
  return Guard([&]() -> rdep::Status {
    RDEP_RETURN_IF_ERROR(CheckSpec(*spec));
    RDEP_RETURN_IF_ERROR(rdep::capi::CheckLayerOnDomain(*spec, *domain));
    return CreateOn(domain, *spec, out);
  });
}

int rdep_layer_domain(rdep_layer* l, rdep_domain** domain) {
  if (!l || !domain) return FailInvalid("layer and domain must not be null");
  rdep::capi::RetainDomain(l->domain);
  *domain = l->domain;
  return 0;
}

int rdep_layer_replica_slot_bytes(const rdep_layer* l, size_t* bytes) {
  if (!l || !bytes) return FailInvalid("layer and bytes must not be null");
  *bytes = l->adapter->replica_slot_bytes();
  return 0;
}

int rdep_layer_row_allocator_bytes(const rdep_layer* l, size_t* bytes) {
  if (!l || !bytes) return FailInvalid("layer and bytes must not be null");
  *bytes = l->adapter->row_allocator_bytes();
  return 0;
}

int rdep_layer_shared_row_bytes(const rdep_layer* l, size_t* bytes) {
  if (!l || !bytes) return FailInvalid("layer and bytes must not be null");
  *bytes = l->adapter->shared_row_bytes();
  return 0;
}

int rdep_layer_set_row_allocator(rdep_layer* l, rdep_alloc_fn alloc, rdep_free_fn free_fn, void* user) {
  if (!l) return FailInvalid("layer is null");
  if ((alloc == nullptr) != (free_fn == nullptr)) return FailInvalid("row allocator: alloc and free must both be set or both be null");
  std::lock_guard<std::mutex> call(l->call_mu());
  std::lock_guard<std::mutex> lock(l->mu);
  for (const auto& s : l->slots)
    if (s.in_use) return Fail(rdep::FailedPrecondition("row allocator: set it while no context of the layer is acquired"));
  return Guard([&]() -> rdep::Status {
    RDEP_RETURN_IF_ERROR(l->adapter->SetRowAllocator(alloc, free_fn, user));
    l->rows = {alloc, free_fn, user};
    return rdep::Status::Ok();
  });
}

void rdep_layer_destroy(rdep_layer* layer) {
  try {
    delete layer;
  } catch (...) {
  }
}

int rdep_layer_local_ranks(const rdep_layer* l, int32_t* first, int32_t* count) {
  if (!l || !first || !count) return FailInvalid("layer, first and count must not be null");
  *first = l->ranks.empty() ? 0 : l->ranks.front();
  *count = static_cast<int32_t>(l->ranks.size());
  return 0;
}

int rdep_layer_owned_experts(const rdep_layer* l, int32_t rank, int64_t* first, int64_t* count) {
  if (!l || !first || !count) return FailInvalid("layer, first and count must not be null");
  if (rank < 0 || rank >= l->config.shape.ranks)
    return FailInvalid("rank " + std::to_string(rank) + " outside [0, W=" + std::to_string(l->config.shape.ranks) + ")");
  *count = l->ownership.num_local(rank);
  *first = *count > 0 ? l->ownership.global_expert(rank, 0) : 0;
  return 0;
}

int rdep_layer_device(const rdep_layer* l, int32_t rank, int32_t* device) {
  if (!l || !device) return FailInvalid("layer and device must not be null");
  for (int32_t r : l->ranks)
    if (r == rank) {
      *device = l->adapter->device(rank);
      return 0;
    }
  return FailInvalid("rank " + std::to_string(rank) + " is not driven by this process");
}

int rdep_layer_describe(const rdep_layer* l, char* buf, size_t cap, size_t* needed) {
  if (!l) return FailInvalid("layer is null");
  return Guard([&]() -> rdep::Status {
    std::ostringstream os;
    os << l->config << "; " << l->adapter->placement();
    // The environment's tile override (src/layer/cuda_moe_layer.cc) changes the layer's speed: say so where it applies.
    if (const char* env = std::getenv("RDEP_CUTLASS_TILES");
        env != nullptr && *env != '\0' && l->config.expert_compute == rdep::ExpertComputeKind::kCutlass)
      os << "; CUTLASS tiles from RDEP_CUTLASS_TILES=" << env;
    rdep::capi::CopyOutString(os.str(), buf, cap, needed);
    return rdep::Status::Ok();
  });
}

int rdep_context_acquire(rdep_layer* l, int64_t* ctx) {
  if (!l || !ctx) return FailInvalid("layer and ctx must not be null");
  return Guard([&]() -> rdep::Status {
    std::lock_guard<std::mutex> lock(l->mu);
    size_t i = 0;
    while (i < l->slots.size() && l->slots[i].in_use) ++i;
    if (i == l->slots.size()) {
      l->slots.emplace_back();
      l->slots.back().per_rank.resize(l->ranks.size());
    }
    ContextSlot& s = l->slots[i];
    s.in_use = true;
    *ctx = static_cast<int64_t>((static_cast<uint64_t>(i) << 32) | s.generation);
    return rdep::Status::Ok();
  });
}

int rdep_context_release(rdep_layer* l, int64_t ctx) {
  if (!l) return FailInvalid("layer is null");
  std::lock_guard<std::mutex> lock(l->mu);
  ContextSlot* s = l->Find(ctx);
  if (!s) return 0;  // stale: already released
  l->adapter->ReleaseRows(s->per_rank);  // rows from the caller's allocator go back to it (CUDA, version 8)
  s->in_use = false;
  s->holds_forward = false;
  s->forward_ran = false;
  s->plan_tokens.clear();
  if (++s->generation == 0) s->generation = 1;
  return 0;
}

int rdep_context_check_routing(rdep_layer* l, int64_t ctx) {
  if (!l) return FailInvalid("layer is null");
  std::lock_guard<std::mutex> lock(l->mu);
  ContextSlot* s = l->Find(ctx);
  if (!s) return FailInvalid("context " + std::to_string(ctx) + " is not a live context of this layer");
  if (!s->holds_forward)
    return Fail(rdep::FailedPrecondition("context " + std::to_string(ctx) + " holds no forward (none ran into it, or its backward did)"));
  return Guard([&]() -> rdep::Status { return l->adapter->CheckRoutingFaults(s->per_rank); });
}

int rdep_context_rearm(rdep_layer* l, int64_t ctx) {
  if (!l) return FailInvalid("layer is null");
  return Guard([&]() -> rdep::Status {
    std::lock_guard<std::mutex> call(l->call_mu());  // the calls write the slot's flags and the contexts under it
    std::lock_guard<std::mutex> lock(l->mu);
    ContextSlot* s = l->Find(ctx);
    if (!s) return NoSlot(ctx);
    if (s->holds_forward) return rdep::Status::Ok();
    const auto none = [&] {
      return rdep::FailedPrecondition("context " + std::to_string(ctx) +
                                      " holds no completed forward of the layer's experts to run a backward again");
    };
    if (!s->forward_ran || s->per_rank.empty()) return none();
    for (const auto& c : s->per_rank)
      if (!c.rearmable()) return none();
    for (auto& c : s->per_rank) c.RearmBackward();
    s->holds_forward = true;
    return rdep::Status::Ok();
  });
}

int rdep_context_rebase_rows(rdep_layer* l, int64_t ctx, const void* old_rows, size_t row_bytes, void* new_rows) {
  if (!l) return FailInvalid("layer is null");
  if (!new_rows || reinterpret_cast<uintptr_t>(new_rows) % rdep::capi::RowArena::kAlign != 0)
    return FailInvalid("new_rows must be a non-null, " + std::to_string(rdep::capi::RowArena::kAlign) + "-byte aligned address");
  std::lock_guard<std::mutex> lock(l->mu);
  ContextSlot* s = l->Find(ctx);
  if (!s) return FailInvalid("context " + std::to_string(ctx) + " is not a live context of this layer");
  if (!s->holds_forward)
    return Fail(rdep::FailedPrecondition("context " + std::to_string(ctx) + " holds no forward (none ran into it, or its backward did)"));
  return Guard([&]() -> rdep::Status {
    l->adapter->RebaseRows(s->per_rank, old_rows, row_bytes, new_rows);
    return rdep::Status::Ok();
  });
}

int rdep_layer_check_errors(rdep_layer* l) {
  if (!l) return FailInvalid("layer is null");
  std::lock_guard<std::mutex> lock(l->mu);
  return Guard([&]() -> rdep::Status { return l->adapter->CheckDeviceErrors(); });
}

int rdep_context_bytes(const rdep_layer* l, int64_t ctx, size_t* bytes) {
  if (!l || !bytes) return FailInvalid("layer and bytes must not be null");
  auto* m = const_cast<rdep_layer*>(l);
  std::lock_guard<std::mutex> lock(m->mu);
  ContextSlot* s = m->Find(ctx);
  if (!s) return FailInvalid("context " + std::to_string(ctx) + " is not a live context of this layer");
  size_t b = 0;
  for (const auto& c : s->per_rank) b += c.bytes();
  *bytes = b;
  return 0;
}

int rdep_layer_forward(rdep_layer* l, int64_t ctx, const rdep_rank_io* io, int32_t count) {
  return Call(l, ctx, io, count, /*backward=*/false);
}

int rdep_layer_forward_arena(rdep_layer* l, int64_t ctx, const rdep_rank_io* io, int32_t count, void* rows, size_t row_bytes,
                             size_t* used) {
  if (used) *used = 0;
  if (reinterpret_cast<uintptr_t>(rows) % rdep::capi::RowArena::kAlign != 0)
    return FailInvalid("rows: the arena must be " + std::to_string(rdep::capi::RowArena::kAlign) + "-byte aligned");
  const ArenaArgs arena{rows, row_bytes, used};
  return Call(l, ctx, io, count, /*backward=*/false, &arena);
}

int rdep_layer_backward(rdep_layer* l, int64_t ctx, const rdep_rank_io* io, int32_t count) {
  return Call(l, ctx, io, count, /*backward=*/true);
}

int rdep_layer_plan(rdep_layer* l, int64_t ctx, const rdep_rank_io* io, int32_t count) {
  if (!l) return FailInvalid("layer is null");
  if (!io) return FailInvalid("io is null");
  if (count != static_cast<int32_t>(l->ranks.size()))
    return FailInvalid("io has " + std::to_string(count) + " entries; this process drives " + std::to_string(l->ranks.size()) +
                       " ranks");
  return Guard([&]() -> rdep::Status {
    for (int32_t i = 0; i < count; ++i) RDEP_RETURN_IF_ERROR(CheckPlanIo(*l, io[i], l->ranks[static_cast<size_t>(i)]));
    std::lock_guard<std::mutex> call(l->call_mu());
    ContextSlot* slot = FindSlot(l, ctx);
    if (!slot) return NoSlot(ctx);
    slot->holds_forward = false;
    slot->forward_ran = false;
    slot->plan_tokens.clear();
    RDEP_RETURN_IF_ERROR(l->adapter->Plan(slot->per_rank, io));
    for (int32_t i = 0; i < count; ++i) slot->plan_tokens.push_back(io[i].num_tokens);
    return rdep::Status::Ok();
  });
}

int rdep_context_recv_counts(rdep_layer* l, int64_t ctx, int32_t rank, int64_t* counts, int64_t num_counts) {
  if (!l) return FailInvalid("layer is null");
  const int32_t i = LocalIndex(*l, rank);
  if (i < 0) return FailInvalid("rank " + std::to_string(rank) + " is not driven by this process");
  const int64_t want = l->ownership.num_local(rank);
  if (num_counts != want)
    return FailInvalid("recv counts: num_counts " + std::to_string(num_counts) + " != the " + std::to_string(want) +
                       " experts rank " + std::to_string(rank) + " owns");
  if (want > 0 && !counts) return FailInvalid("recv counts: counts is null");
  return Guard([&]() -> rdep::Status {
    std::lock_guard<std::mutex> call(l->call_mu());
    ContextSlot* slot = FindSlot(l, ctx);
    if (!slot) return NoSlot(ctx);
    RDEP_ASSIGN_OR_RETURN(std::vector<int64_t> c, l->adapter->RecvCounts(slot->per_rank[static_cast<size_t>(i)], rank));
    if (static_cast<int64_t>(c.size()) != want) return rdep::InternalError("recv counts: the layer gave " + std::to_string(c.size()));
    std::copy(c.begin(), c.end(), counts);
    return rdep::Status::Ok();
  });
}

int rdep_context_recv_row_ids(rdep_layer* l, int64_t ctx, int32_t rank, int64_t* ids, int64_t num_ids) {
  if (!l) return FailInvalid("layer is null");
  const int32_t i = LocalIndex(*l, rank);
  if (i < 0) return FailInvalid("rank " + std::to_string(rank) + " is not driven by this process");
  return Guard([&]() -> rdep::Status {
    std::lock_guard<std::mutex> call(l->call_mu());
    ContextSlot* slot = FindSlot(l, ctx);
    if (!slot) return NoSlot(ctx);
    RDEP_ASSIGN_OR_RETURN(std::vector<uint64_t> v, l->adapter->RecvRowIds(slot->per_rank[static_cast<size_t>(i)], rank));
    if (num_ids != static_cast<int64_t>(v.size()))
      return rdep::InvalidArgument("recv row ids: num_ids " + std::to_string(num_ids) + " != the " + std::to_string(v.size()) +
                                   " rows rank " + std::to_string(rank) + " received");
    if (!v.empty() && !ids) return rdep::InvalidArgument("recv row ids: ids is null");
    for (size_t k = 0; k < v.size(); ++k) ids[k] = static_cast<int64_t>(v[k]);
    return rdep::Status::Ok();
  });
}

int rdep_layer_dispatch(rdep_layer* l, int64_t ctx, const rdep_rank_rows* rows, int32_t count) {
  return RowsCall(l, ctx, rows, count, rdep::capi::LayerAdapter::RowsStep::kDispatch);
}
int rdep_layer_combine(rdep_layer* l, int64_t ctx, const rdep_rank_rows* rows, int32_t count) {
  return RowsCall(l, ctx, rows, count, rdep::capi::LayerAdapter::RowsStep::kCombine);
}
int rdep_layer_combine_backward(rdep_layer* l, int64_t ctx, const rdep_rank_rows* rows, int32_t count) {
  return RowsCall(l, ctx, rows, count, rdep::capi::LayerAdapter::RowsStep::kCombineBackward);
}
int rdep_layer_dispatch_backward(rdep_layer* l, int64_t ctx, const rdep_rank_rows* rows, int32_t count) {
  return RowsCall(l, ctx, rows, count, rdep::capi::LayerAdapter::RowsStep::kDispatchBackward);
}

}  // extern "C"
