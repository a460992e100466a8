// LayerConfig::owner_reduce on the CUDA layer (docs/architecture.md, "The owner reduces first"): the
// owner sums a token's rows into the return row of its lead slot on that owner, takes dgate's dot
// products in backward from the expert outputs it kept (Saved::f_rows; with gate_in_expert the expert
// compute's SwiGLU' pass gives them instead and nothing is kept), and the front-end sums the lead rows.
// The kernels: owner_reduce_kernels.cu.
#include "layer/context_access.h"
#include "layer/cuda_layer_state.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {

using cuda_layer::Bits;
using dispatch::bf16_bits;

// The segment's slice of the context's inverse index ([S][slots_per_token] per segment).
int32_t* CudaMoELayer::SegmentInv(const Saved& sv, int64_t seg) const {
  return sv.inv.ptr + seg * layout_.S * layout_.slots_per_token;
}

// Front-end: forward marks the lead slots (from the targets the plan chose: replicas count as the rank
// they compute on); both directions sum the lead rows in slot order (weights 1, no saved rows).
Status CudaMoELayer::CombineReduced(int32_t rank, Saved& sv, bool backward, __nv_bfloat16* out) {
  const LayerShape& s = config_.shape;
  cudaStream_t stream = domain_.stream(rank);
  if (!backward)
    RDEP_RETURN_IF_ERROR(dispatch::LaunchLeadSlots(sv.experts.ptr, sv.accepted.ptr, sv.num_tokens, s.topk,
                                                   Targets(*ranks_[static_cast<size_t>(rank)], sv), sv.lead.ptr, stream));
  return dispatch::LaunchCombine(static_cast<const bf16_bits*>(domain_.region(rank, regions_.ret)), sv.lead.ptr, nullptr, sv.num_tokens,
                                 s.topk, s.hidden, Bits(out), nullptr, stream);
}

// Front-end, backward, after the backward's final barrier: every accepted slot's dot is in the dots region.
Status CudaMoELayer::DgatesFromDots(int32_t rank, RankState& st, const Saved& sv, float* dgates) {
  const LayerShape& s = config_.shape;
  return dispatch::LaunchDgate(nullptr, nullptr, sv.gates.ptr, sv.accepted.ptr, sv.num_tokens, s.topk, s.hidden, st.scratch.ptr, dgates,
                               domain_.stream(rank), static_cast<const float*>(domain_.region(rank, regions_.dots)));
}

// Owner: the segment's token sums (forward: gate-weighted f_k, weighted by the compute with gate_in_expert;
// backward: dx_k) into the lead rows.
Status CudaMoELayer::ReturnReduced(int32_t rank, const __nv_bfloat16* rows, const Saved& sv, int64_t seg, int64_t base, bool backward) {
  return dispatch::LaunchReduceReturnRows(Bits(rows), sv.grouped.ptr + base, SegmentInv(sv, seg),
                                          domain_.region(rank, regions_.sideband), static_cast<int32_t>(seg % 2), seg * layout_.S, layout_,
                                          sv.control.ptr, /*scale_by_gate=*/!backward && !config_.gate_in_expert,
                                          domain_.peer_table(rank, regions_.ret),
                                          domain_.region(rank, regions_.ret), domain_.stream(rank));
}

// Owner, backward: <dy_t, f_k> of the segment's rows (grouped [base, base + m), or the device count),
// into their front-ends' dots.
Status CudaMoELayer::OwnerDots(int32_t rank, const uint16_t* seg_dy, const Saved& sv, int64_t base, int64_t m, const int64_t* device_rows) {
  const __nv_bfloat16* f = SavedOwnerRows(rank, *ranks_[static_cast<size_t>(rank)], sv).f;  // the pool's rows are back by now
  return dispatch::LaunchOwnerDots(seg_dy, Bits(f + base * config_.shape.hidden), sv.grouped.ptr + base, m, layout_,
                                   domain_.peer_table(rank, regions_.dots), domain_.stream(rank), device_rows);
}

}  // namespace rdep
