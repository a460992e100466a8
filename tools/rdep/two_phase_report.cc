// Printing of the two-phase traffic table (see two_phase_report.h).
#include "two_phase_report.h"

#include <cstdio>

namespace rdep::cli {

std::vector<model::RankPhaseTraffic> TrafficCounts(const std::vector<NodeTraffic>& traffic) {
  std::vector<model::RankPhaseTraffic> out;
  out.reserve(traffic.size());
  for (const auto& t : traffic) out.push_back(t.Counts());
  return out;
}

void PrintTwoPhaseTraffic(const std::vector<model::RankPhaseTraffic>& measured, const std::vector<model::RankPhaseTraffic>& predicted,
                          size_t max_ranks) {
  std::printf("    %4s  %-20s %8s %8s %12s %12s %7s\n", "rank", "phase", "rows", "model", "bytes", "model", "ratio");
  for (size_t r = 0; r < measured.size() && r < max_ranks; ++r)
    for (const model::PhaseField& f : model::kTwoPhaseFields) {
      const auto& m = measured[r];
      const bool have = r < predicted.size();
      const long long pr = have ? predicted[r].*f.rows : -1, pb = have ? predicted[r].*f.bytes : -1;
      const double ratio = pb > 0 ? static_cast<double>(m.*f.bytes) / static_cast<double>(pb) : (m.*f.bytes == pb ? 1.0 : 0.0);
      std::printf("    %4zu  %-20s %8lld %8lld %12lld %12lld %7.3f%s\n", r, f.name, static_cast<long long>(m.*f.rows), pr,
                  static_cast<long long>(m.*f.bytes), pb, ratio, (m.*f.rows == pr && m.*f.bytes == pb) ? "" : "  DIFFERS");
    }
  if (measured.size() > max_ranks)
    std::printf("    (%zu more ranks: see the --json receipt)\n", measured.size() - max_ranks);
}

}  // namespace rdep::cli
