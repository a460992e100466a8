// LayerConfig::owner_reduce on the host backend. The owner sums its rows of a token before they cross
// back: forward y_part = sum of g'_k f_k(x_t) over the token's rows on this owner, backward the sum of
// their dx rows; each lands in the return row of the token's lead slot on that owner (its first
// accepted slot there, which is the first row of the token's sideband), so one row per (token, owner)
// crosses instead of one per slot. dgate's dot products <dy_t, f_k(x_t)> are taken by the owner, which
// recomputes f_k in backward anyway, and cross back as one double per (token, slot) (the dots region).
#include <algorithm>
#include <cstring>

#include "rdep/core/row_id.h"
#include "layer/host_layer_state.h"

namespace rdep {

// The slot whose return row carries the owner's sum: accepted, and no earlier accepted slot of the
// token computes on the same rank.
bool HostMoELayer::IsLeadSlot(const Saved& st, int64_t t, int64_t k) const {
  const int64_t K = config_.shape.topk;
  const auto i = static_cast<size_t>(t * K + k);
  if (!st.acceptance.accepted[i]) return false;
  for (int64_t j = 0; j < k; ++j) {
    const auto ij = static_cast<size_t>(t * K + j);
    if (st.acceptance.accepted[ij] && st.dest_rank[ij] == st.dest_rank[i]) return false;
  }
  return true;
}

// Front-end, backward, after every owner wrote its dots: dL/dg'_k as ComputeDgates takes it (the same
// dot in double, from the same f_k), then through the capacity renormalization.
void HostMoELayer::DgatesFromDots(int32_t rank, const Saved& st, std::span<float> dgates) const {
  TestDelay(rank);
  const int64_t K = config_.shape.topk, n = st.num_tokens;
  const double* dots = domain_.region_as<double>(rank, regions_.dots);
  std::vector<double> d_eff(static_cast<size_t>(K)), d_g(static_cast<size_t>(K));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const auto i = static_cast<size_t>(t * K + k);
      d_eff[static_cast<size_t>(k)] = st.acceptance.accepted[i] ? dots[i] : 0.0;
    }
    RenormalizeGatesBackward(st.routing.gates.data() + t * K, st.acceptance.accepted.data() + t * K, K, d_eff.data(), d_g.data());
    for (int64_t k = 0; k < K; ++k) dgates[static_cast<size_t>(t * K + k)] = static_cast<float>(d_g[static_cast<size_t>(k)]);
  }
}

// Owner: the return row of the lead slot of the token at `position` of a received segment (its
// sideband's first row: rows are stored in slot order).
float* HostMoELayer::LeadRow(int32_t rank, const std::byte* sideband, int64_t position) const {
  const std::byte* hdr = sideband + static_cast<size_t>(position) * layout_.token_sideband_bytes();
  RowSideband first;
  std::memcpy(&first, hdr + sizeof(int64_t), sizeof(RowSideband));
  return ReturnRow(rank, first.row_id);
}

// Owner, before accumulating a segment: the lead rows of the segment's tokens start at zero.
void HostMoELayer::ZeroLeadRows(int32_t rank, const std::byte* sideband, int64_t n_seg) const {
  const int64_t H = config_.shape.hidden;
  for (int64_t p = 0; p < n_seg; ++p)
    if (SegmentTokenRows(sideband, layout_.token_sideband_bytes(), p) > 0) std::fill_n(LeadRow(rank, sideband, p), H, 0.f);
}

// Owner, backward: the dot product of one row, into its front-end's dots at (token, slot).
void HostMoELayer::WriteDot(uint64_t row_id, double dot) const {
  const int64_t K = config_.shape.topk;
  const RowKey key = RowIdCodec{config_.shape.tokens, K}.decode(row_id);
  domain_.region_as<double>(static_cast<int32_t>(key.rank), regions_.dots)[key.token * K + key.slot] = dot;
}

}  // namespace rdep
