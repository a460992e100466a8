#include "rdep/layer/layer_config.h"

#include <algorithm>
#include <string>
#include <utility>

namespace rdep {

const char* ExpertComputeName(ExpertComputeKind k) {
  return k == ExpertComputeKind::kCutlass ? "cutlass" : "cublaslt";
}

StatusOr<mlp::GateUp> ParseGateUp(const std::string& name) {
  for (mlp::GateUp l : {mlp::GateUp::kSplit, mlp::GateUp::kInterleaved8})
    if (name == mlp::GateUpName(l)) return l;
  return InvalidArgument("gate_up '" + name + "' is not split or interleaved8");
}

StatusOr<ExpertComputeKind> ParseExpertCompute(const std::string& name) {
  if (name == "cublaslt") return ExpertComputeKind::kCublasLt;
  if (name == "cutlass") return ExpertComputeKind::kCutlass;
  return InvalidArgument("expert compute: '" + name + "' is not cublaslt or cutlass");
}

namespace {
// The CUDA layer's sync-free owner path (overlap_segments and gate_in_expert need it; the pipeline also the
// per-slot return).
bool SyncFree(const LayerConfig& c) {
  return c.expert_compute == ExpertComputeKind::kCutlass && !c.balance.enabled() && c.nodes.nodes <= 1;
}
}  // namespace

Status LayerConfig::Validate() const {
  RDEP_RETURN_IF_ERROR(shape.Validate());
  RDEP_RETURN_IF_ERROR(capacity.Validate());
  if (segment_tokens < 0) return InvalidArgument("segment size S must be >= 0 (0 = T), got " + std::to_string(segment_tokens));
  if (has_load_matrix() && shape.experts > kMaxLoadMatrixExperts)
    return InvalidArgument(std::string(load_matrix ? "load_matrix" : "balance") + ": E=" + std::to_string(shape.experts) +
                           " exceeds " + std::to_string(kMaxLoadMatrixExperts) + " (the load matrix's limit)");
  RDEP_RETURN_IF_ERROR(balance.Validate(static_cast<int32_t>(shape.experts)));
  RDEP_RETURN_IF_ERROR(nodes.Validate(shape.ranks));
  if (nodes.nodes > 1 && balance.enabled())
    return InvalidArgument("balance: replicas across nodes (N=" + std::to_string(nodes.nodes) +
                           ") are not supported yet; use balancing with one node");
  if (transport_sms < 0 || transport_sms > kMaxTransportSms)
    return InvalidArgument("transport_sms: " + std::to_string(transport_sms) + " is outside [0, " + std::to_string(kMaxTransportSms) +
                           "] (0 = every SM; else the SMs the peer-storing kernels may use)");
  if (transport_sms > 0 && nodes.nodes > 1)
    return InvalidArgument("transport_sms: not with nodes (N=" + std::to_string(nodes.nodes) +
                           ") yet: the two-phase exchange's kernels take no SM budget; use transport_sms 0");
  if (owner_reduce && nodes.nodes > 1)
    return InvalidArgument("owner_reduce: with nodes (N=" + std::to_string(nodes.nodes) +
                           ") the relays already reduce each node's rows; use owner_reduce with one node");
  if (stash_rows < 0) return InvalidArgument("stash_rows: " + std::to_string(stash_rows) + " must be >= 0 (0 = no stash)");
  if (stash_rows > 0 && (expert_compute != ExpertComputeKind::kCutlass || balance.enabled() || nodes.nodes > 1))
    return InvalidArgument("stash_rows: " + std::to_string(stash_rows) +
                           " needs the sync-free layer: expert_compute cutlass, no balancing and one node (got expert_compute " +
                           ExpertComputeName(expert_compute) + ", balance " + BalanceKindName(balance.kind) + ", nodes " +
                           std::to_string(nodes.nodes) + ")");
  const std::string got = "(got expert_compute " + std::string(ExpertComputeName(expert_compute)) + ", balance " +
                          BalanceKindName(balance.kind) + ", nodes " + std::to_string(nodes.nodes) + ", owner_reduce " +
                          (owner_reduce ? "on" : "off") + ")";
  if (overlap_segments && !(SyncFree(*this) && !owner_reduce))
    return InvalidArgument("overlap_segments: needs the sync-free layer with the per-slot return: expert_compute cutlass, "
                           "no balancing, one node and owner_reduce off " + got);
  if (gate_in_expert && !SyncFree(*this))
    return InvalidArgument("gate_in_expert: needs the sync-free layer: expert_compute cutlass, no balancing and one node " + got);
  if (gate_up != mlp::GateUp::kSplit && gate_up != mlp::GateUp::kInterleaved8)
    return InvalidArgument("gate_up: " + std::to_string(static_cast<int>(gate_up)) + " is not kSplit (0) or kInterleaved8 (1)");
  if (gate_up == mlp::GateUp::kInterleaved8 && shape.ffn % 8 != 0)
    return InvalidArgument("gate_up interleaved8: ffn " + std::to_string(shape.ffn) + " must be a multiple of 8 (blocks of 8 features)");
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const LayerConfig& c) {
  os << c.shape << " capacity=";
  if (c.capacity.dropless()) os << "dropless";
  else os << c.capacity.capacity_factor;
  if (c.segment_tokens > 0) os << " S=" << c.segment_tokens;
  else os << " S=auto";
  if (c.balance.enabled()) os << " balance=" << c.balance;
  if (c.nodes.nodes > 1) os << " nodes " << c.nodes;
  if (c.expert_compute != ExpertComputeKind::kCublasLt) os << " experts=" << ExpertComputeName(c.expert_compute);
  if (c.owner_reduce) os << " owner-reduce";
  if (c.transport_sms > 0) os << " transport-sms=" << c.transport_sms;
  if (c.stash_rows > 0) os << " stash-rows=" << c.stash_rows;
  if (c.overlap_segments) os << " overlap";
  if (c.gate_in_expert) os << " gate-in-expert";
  if (!c.source_windows) os << " no-source-windows";
  if (c.gate_up != mlp::GateUp::kSplit) os << " gate-up=" << mlp::GateUpName(c.gate_up);
  return c.load_matrix ? os << " load-matrix" : os;  // the backend's default (host: T; CUDA: W*T, the worst case)
}

Status ValidateLayerInputs(const LayerConfig& c, int64_t domain_ranks, const OwnershipMap& m, const MoEWeights& w) {
  RDEP_RETURN_IF_ERROR(ValidateLayerInputs(c, domain_ranks, m));
  if (w.gate_up != c.gate_up)
    return InvalidArgument(std::string("weights: w1 is in the ") + mlp::GateUpName(w.gate_up) + " layout, the layer's gate_up is " +
                           mlp::GateUpName(c.gate_up) + " (MoEWeights::InLayout moves the columns)");
  return w.Validate(c.shape);
}

Status ValidateLayerInputs(const LayerConfig& c, int64_t domain_ranks, const OwnershipMap& m) {
  RDEP_RETURN_IF_ERROR(c.Validate());
  const LayerShape& s = c.shape;
  if (s.ranks != domain_ranks)
    return InvalidArgument("layer has W=" + std::to_string(s.ranks) + " but the domain has " + std::to_string(domain_ranks) +
                           " ranks");
  if (m.num_experts() != s.experts || m.num_ranks() != s.ranks)
    return InvalidArgument("ownership map is for E=" + std::to_string(m.num_experts()) + ", W=" + std::to_string(m.num_ranks()) +
                           "; the layer has E=" + std::to_string(s.experts) + ", W=" + std::to_string(s.ranks));
  return Status::Ok();
}

RegionLayout MakeRegionLayout(const LayerConfig& c, const OwnershipMap& m, size_t elem_bytes) {
  RegionLayout l;
  l.W = c.shape.ranks;
  l.L = std::max<int64_t>(1, m.max_local()) + c.replica_slots();  // main experts, then the redundant slots
  l.S = c.segment();
  l.H = c.shape.hidden;
  l.T = c.shape.tokens;
  l.K = c.shape.topk;
  l.slots_per_token = std::max<int64_t>(1, std::min<int64_t>(c.shape.topk, m.max_local() + c.replica_slots()));
  l.elem_bytes = static_cast<int64_t>(elem_bytes);
  l.E_load = c.has_load_matrix() ? c.shape.experts : 0;
  l.N = c.nodes.nodes;
  l.transport_sms = c.transport_sms;
  l.buffers = l.S >= l.W * l.T ? 1 : 2;  // one segment a call uses buffer 0 only
  return l;
}

int64_t MaxSegmentRows(const LayerConfig& c, const RegionLayout& l) {
  int64_t rows = l.S * l.slots_per_token;
  if (!c.capacity.dropless() && l.L > 0) {
    const int64_t cap = c.capacity.ExpertCapacity(c.shape);
    if (cap <= rows / l.L) rows = l.L * cap;  // (compared by division: cap may be huge)
  }
  return std::max<int64_t>(rows, 1);
}

bool ScratchInReturnRegion(const LayerConfig& c, const RegionLayout& l, size_t scratch_bytes) {
  return c.shape.ranks == 1 && c.expert_compute == ExpertComputeKind::kCutlass && c.nodes.nodes <= 1 && !c.balance.enabled() &&
         l.S >= l.W * l.T && scratch_bytes <= l.return_bytes();
}

bool DxOverDout(const LayerConfig& c) { return c.expert_compute == ExpertComputeKind::kCutlass && !c.balance.enabled(); }

int64_t OwnerOutputRowSets(const LayerConfig& c, int64_t S) {
  const bool pipelined = c.overlap_segments && c.shape.ranks * c.shape.tokens > S;  // overlap needs the CUTLASS compute
  return pipelined ? 2 : (DxOverDout(c) ? 1 : 2);
}

}  // namespace rdep
