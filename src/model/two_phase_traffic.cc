// Per-rank, per-phase traffic of the two-phase exchange for a given routing (see the header).
#include "rdep/model/two_phase_traffic.h"

#include <algorithm>
#include <string>

namespace rdep::model {

namespace {

Status CheckInputs(const Routing& routing, const std::vector<RankAcceptance>& accepted, const OwnershipMap& own, int64_t nodes) {
  const auto W = static_cast<int64_t>(routing.size());
  if (W < 1 || own.num_ranks() != W)
    return InvalidArgument("two-phase traffic: the routing has " + std::to_string(W) + " ranks, the ownership map " +
                           std::to_string(own.num_ranks()));
  if (nodes < 1 || W % nodes != 0)
    return InvalidArgument("two-phase traffic: nodes must divide W=" + std::to_string(W) + ", got " + std::to_string(nodes));
  if (accepted.size() != routing.size()) return InvalidArgument("two-phase traffic: accepted sets for " + std::to_string(accepted.size()) + " ranks, routing for " + std::to_string(W));
  for (size_t r = 0; r < routing.size(); ++r) {
    const RankRouting& rr = routing[r];
    const auto rows = static_cast<size_t>(rr.num_tokens * rr.topk);
    if (rr.experts.size() != rows || accepted[r].accepted.size() != rows)
      return InvalidArgument("two-phase traffic: rank " + std::to_string(r) + " has " + std::to_string(rr.experts.size()) +
                             " experts and " + std::to_string(accepted[r].accepted.size()) + " accepted flags for " +
                             std::to_string(rows) + " route rows");
    for (int32_t e : rr.experts)
      if (e < 0 || e >= own.num_experts())
        return InvalidArgument("two-phase traffic: rank " + std::to_string(r) + " routes to expert " + std::to_string(e) +
                               " outside [0, E=" + std::to_string(own.num_experts()) + ")");
  }
  return Status::Ok();
}

// One token of source r: its accepted rows per owner (owners sorted), added to every rank's count.
void AddToken(int64_t r, int64_t G, const std::vector<std::pair<int32_t, int64_t>>& rows_by_owner, const TwoPhaseWire& w,
              std::vector<RankPhaseTraffic>& out) {
  const int64_t home = r / G, local = r % G;
  for (size_t i = 0; i < rows_by_owner.size();) {  // owners of one node are consecutive (sorted ranks)
    const int64_t b = rows_by_owner[i].first / G, relay = b * G + local;
    int64_t owners = 0, rows = 0;
    for (; i < rows_by_owner.size() && rows_by_owner[i].first / G == b; ++i) {
      const auto [q, m] = rows_by_owner[i];
      ++owners;
      rows += m;
      RankPhaseTraffic& rl = out[static_cast<size_t>(relay)];
      ++rl.intra_dispatch_rows;
      rl.intra_dispatch_bytes += w.pair + w.intra_row * m;
      RankPhaseTraffic& ow = out[static_cast<size_t>(q)];
      ow.intra_return_rows += m;
      ow.intra_return_bytes += w.return_row * m;
    }
    if (b == home) continue;
    RankPhaseTraffic& src = out[static_cast<size_t>(r)];
    ++src.inter_dispatch_rows;
    src.inter_dispatch_bytes += w.bundle + w.entry * owners + w.row * rows;
    RankPhaseTraffic& rl = out[static_cast<size_t>(relay)];
    ++rl.inter_combine_rows;
    rl.inter_combine_bytes += w.combine;
  }
}

}  // namespace

StatusOr<std::vector<RankPhaseTraffic>> PredictTwoPhaseTraffic(const Routing& routing, const std::vector<RankAcceptance>& accepted,
                                                               const OwnershipMap& own, int64_t nodes, const TwoPhaseWire& wire) {
  RDEP_RETURN_IF_ERROR(CheckInputs(routing, accepted, own, nodes));
  const auto W = static_cast<int64_t>(routing.size());
  const int64_t G = W / nodes;
  std::vector<RankPhaseTraffic> out(static_cast<size_t>(W));
  std::vector<std::pair<int32_t, int64_t>> rows_by_owner;  // (owner, accepted rows of the token there)
  for (int64_t r = 0; r < W; ++r) {
    const RankRouting& rr = routing[static_cast<size_t>(r)];
    const std::vector<uint8_t>& acc = accepted[static_cast<size_t>(r)].accepted;
    for (int64_t t = 0; t < rr.num_tokens; ++t) {
      rows_by_owner.clear();
      for (int64_t k = 0; k < rr.topk; ++k) {
        const auto i = static_cast<size_t>(t * rr.topk + k);
        if (!acc[i]) continue;
        const int32_t q = own.owner(rr.experts[i]);
        auto it = std::find_if(rows_by_owner.begin(), rows_by_owner.end(), [q](const auto& p) { return p.first == q; });
        if (it == rows_by_owner.end()) rows_by_owner.emplace_back(q, 1);
        else ++it->second;
      }
      std::sort(rows_by_owner.begin(), rows_by_owner.end());
      AddToken(r, G, rows_by_owner, wire, out);
    }
  }
  return out;
}

std::string FirstTrafficMismatch(const std::vector<RankPhaseTraffic>& measured, const std::vector<RankPhaseTraffic>& predicted) {
  if (measured.size() != predicted.size())
    return "measured traffic of " + std::to_string(measured.size()) + " ranks, predicted for " + std::to_string(predicted.size());
  for (size_t r = 0; r < measured.size(); ++r)
    for (const PhaseField& f : kTwoPhaseFields)
      for (auto [what, field] : {std::pair{"rows", f.rows}, std::pair{"bytes", f.bytes}})
        if (measured[r].*field != predicted[r].*field)
          return "rank " + std::to_string(r) + ", " + f.name + ": " + what + " measured " + std::to_string(measured[r].*field) +
                 ", rdep model predicts " + std::to_string(predicted[r].*field);
  return "";
}

std::ostream& operator<<(std::ostream& os, const RankPhaseTraffic& t) {
  for (const PhaseField& f : kTwoPhaseFields) os << f.name << " " << t.*f.rows << " rows " << t.*f.bytes << " B; ";
  return os;
}

}  // namespace rdep::model
