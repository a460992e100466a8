// The two-phase exchange's traffic for a GIVEN routing (seeds 004; the layers' src/layer/*_two_phase.cc):
// what every rank sends in each phase of one forward, predicted from the per-token expert lists (after
// node limiting) and the accepted set (after capacity), exactly as the protocol counts it. `rdep check
// --nodes N` and `rdep bench dispatch --nodes N` compare the layers' measured NodeTraffic with it
// integer for integer. The uniform-routing closed form is CrossNodeDispatch (cost_models.h).
//
// W = N*G ranks form N nodes of G consecutive ranks; source r's relay in node b is rank b*G + r%G.
// Per source token t, the owners q holding an accepted row of it (rows(t, q) of them) and their nodes:
//   inter-node dispatch  source r: one row (bundle) per (t, remote node b with an accepted row);
//                        bytes per bundle = bundle + entry * (owners of t on b) + row * (rows of t on b)
//   intra-node dispatch  relay b*G + r%G: one row per (t, owner q on b), home node included;
//                        bytes = pair + intra_row * rows(t, q)   (payload row + count + sidebands)
//   intra-node return    owner q: rows(t, q) rows back to the relay; bytes = return_row * rows(t, q)
//   inter-node combine   relay on remote node b: one reduced row per bundle; bytes = combine each
// The byte sizes of each backend's records (its wire format) come from the layer that sends them
// (HostMoELayer::two_phase_wire, CudaMoELayer::two_phase_wire).
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "rdep/core/capacity.h"
#include "rdep/core/ownership.h"
#include "rdep/core/routing.h"
#include "rdep/status.h"

namespace rdep::model {

// Bytes of one backend's two-phase records, as linear terms of the counts above.
struct TwoPhaseWire {
  int64_t bundle = 0;      // per inter-node bundle: its fixed part (header, payload row, padding)
  int64_t entry = 0;       // per (token, owner) entry inside a bundle (owner, row count, stream position)
  int64_t row = 0;         // per accepted route row inside a bundle (its sideband)
  int64_t combine = 0;     // per reduced row sent back across nodes
  int64_t pair = 0;        // per (token, owner) scattered inside a node: payload row + 8-byte row count
  int64_t intra_row = 0;   // per route row's sideband scattered inside a node (16: row_id, expert, gate)
  int64_t return_row = 0;  // per row an owner returns to a relay
};

// One rank's traffic in one forward, per phase (the fields of rdep::NodeTraffic that are counted).
struct RankPhaseTraffic {
  int64_t inter_dispatch_rows = 0, inter_dispatch_bytes = 0;  // as a source, to remote nodes
  int64_t intra_dispatch_rows = 0, intra_dispatch_bytes = 0;  // as a relay, to the owners of its node
  int64_t intra_return_rows = 0, intra_return_bytes = 0;      // as an owner, back to the relays
  int64_t inter_combine_rows = 0, inter_combine_bytes = 0;    // as a relay, back to remote sources
  bool operator==(const RankPhaseTraffic&) const = default;
};

// The phases in report order: name, rows field and bytes field of RankPhaseTraffic.
struct PhaseField {
  const char* name;
  int64_t RankPhaseTraffic::*rows;
  int64_t RankPhaseTraffic::*bytes;
};
inline constexpr PhaseField kTwoPhaseFields[] = {
    {"inter-node dispatch", &RankPhaseTraffic::inter_dispatch_rows, &RankPhaseTraffic::inter_dispatch_bytes},
    {"intra-node dispatch", &RankPhaseTraffic::intra_dispatch_rows, &RankPhaseTraffic::intra_dispatch_bytes},
    {"intra-node return", &RankPhaseTraffic::intra_return_rows, &RankPhaseTraffic::intra_return_bytes},
    {"inter-node combine", &RankPhaseTraffic::inter_combine_rows, &RankPhaseTraffic::inter_combine_bytes},
};

// [W] per-rank traffic of one forward. routing and accepted are [W] (accepted[r].accepted [n*K]);
// nodes must divide W = routing.size(); experts of the routing must be owned by `own`.
StatusOr<std::vector<RankPhaseTraffic>> PredictTwoPhaseTraffic(const Routing& routing, const std::vector<RankAcceptance>& accepted,
                                                               const OwnershipMap& own, int64_t nodes, const TwoPhaseWire& wire);

// "" when measured == predicted for every rank, else the first difference: rank, phase, rows or
// bytes, measured and predicted.
std::string FirstTrafficMismatch(const std::vector<RankPhaseTraffic>& measured, const std::vector<RankPhaseTraffic>& predicted);

std::ostream& operator<<(std::ostream& os, const RankPhaseTraffic& t);

}  // namespace rdep::model
