// The two-phase exchange's traffic as `rdep check --nodes N` and `rdep bench dispatch --nodes N` print
// it: per rank and phase, the measured rows and bytes beside rdep model's prediction for the same
// routing (rdep/model/two_phase_traffic.h) and their ratio.
#pragma once

#include <cstddef>
#include <vector>

#include "rdep/layer/host_moe_layer.h"  // NodeTraffic
#include "rdep/model/two_phase_traffic.h"

namespace rdep::cli {

std::vector<model::RankPhaseTraffic> TrafficCounts(const std::vector<NodeTraffic>& traffic);

// One line per (rank, phase) for the first max_ranks ranks (then a line saying how many are left out).
void PrintTwoPhaseTraffic(const std::vector<model::RankPhaseTraffic>& measured, const std::vector<model::RankPhaseTraffic>& predicted,
                          size_t max_ranks);

}  // namespace rdep::cli
