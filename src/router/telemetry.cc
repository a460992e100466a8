// Route-health telemetry: loads, CV, percentiles, active experts, entropies.
#include "rdep/router/telemetry.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <string>

#include "rdep/core/stats.h"

namespace rdep {

StatusOr<RoutingTelemetry> ComputeTelemetry(const Routing& routing, int64_t num_experts) {
  if (num_experts <= 0) return InvalidArgument("telemetry: num_experts must be > 0, got " + std::to_string(num_experts));
  RoutingTelemetry t;
  t.num_experts = num_experts;
  t.loads.assign(static_cast<size_t>(num_experts), 0);
  for (size_t r = 0; r < routing.size(); ++r) {
    const auto& rr = routing[r];
    for (size_t i = 0; i < rr.experts.size(); ++i) {
      const int32_t e = rr.experts[i];
      if (e < 0 || e >= num_experts)
        return InvalidArgument("telemetry: rank " + std::to_string(r) + " slot " + std::to_string(i) + " names expert " +
                               std::to_string(e) + ", outside [0, " + std::to_string(num_experts) + ")");
      t.loads[static_cast<size_t>(e)] += 1;
    }
  }
  std::vector<double> as_double(t.loads.begin(), t.loads.end());
  for (int64_t x : t.loads) t.total_rows += x;
  t.mean_rows = static_cast<double>(t.total_rows) / static_cast<double>(num_experts);
  t.cv = CoefficientOfVariation(t.loads);
  t.p10_rows = Percentile(as_double, 10);
  t.p50_rows = Percentile(as_double, 50);
  t.min_rows = *std::min_element(t.loads.begin(), t.loads.end());
  t.max_rows = *std::max_element(t.loads.begin(), t.loads.end());
  t.max_over_mean = t.mean_rows > 0 ? static_cast<double>(t.max_rows) / t.mean_rows : 0;
  for (int64_t x : t.loads) {
    if (x > 0) {
      ++t.active_experts;
      const double q = static_cast<double>(x) / static_cast<double>(t.total_rows);
      t.load_entropy -= q * std::log(q);
    }
  }
  return t;
}

StatusOr<RoutingTelemetry> ComputeTelemetry(const Routing& routing, const OwnershipMap& ownership) {
  RDEP_ASSIGN_OR_RETURN(RoutingTelemetry t, ComputeTelemetry(routing, ownership.num_experts()));
  t.owner_loads.assign(static_cast<size_t>(ownership.num_ranks()), 0);
  t.max_padding_ratio = 0;
  for (int32_t q = 0; q < ownership.num_ranks(); ++q) {
    std::vector<int64_t> local;
    for (int32_t j = 0; j < ownership.num_local(q); ++j) {
      const int64_t m = t.loads[static_cast<size_t>(ownership.global_expert(q, j))];
      local.push_back(m);
      t.owner_loads[static_cast<size_t>(q)] += m;
    }
    if (!local.empty()) t.max_padding_ratio = std::max(t.max_padding_ratio, PaddingRatio(local));
  }
  return t;
}

StatusOr<double> MeanScoreEntropy(std::span<const double> scores, int64_t n, int64_t e) {
  if (n < 0 || e <= 0) return InvalidArgument("score entropy: need num_tokens >= 0 and num_experts > 0");
  if (static_cast<int64_t>(scores.size()) != n * e)
    return InvalidArgument("score entropy: scores has " + std::to_string(scores.size()) +
                           " values, expected num_tokens*num_experts = " + std::to_string(n * e));
  if (n == 0) return 0.0;
  double total = 0;
  for (int64_t t = 0; t < n; ++t) {
    const double* s = &scores[static_cast<size_t>(t * e)];
    double sum = 0;
    for (int64_t i = 0; i < e; ++i) {
      if (!std::isfinite(s[i]) || s[i] < 0)
        return InvalidArgument("score entropy: score of token " + std::to_string(t) + ", expert " + std::to_string(i) +
                               " is negative or not finite");
      sum += s[i];
    }
    if (sum <= 0) return InvalidArgument("score entropy: scores of token " + std::to_string(t) + " sum to 0");
    for (int64_t i = 0; i < e; ++i) {
      const double p = s[i] / sum;
      if (p > 0) total -= p * std::log(p);
    }
  }
  return total / static_cast<double>(n);
}

std::ostream& operator<<(std::ostream& os, const RoutingTelemetry& t) {
  const auto flags = os.flags();
  const auto prec = os.precision();
  os << std::fixed << std::setprecision(3);
  os << "experts            " << t.num_experts << "\n"
     << "rows               " << t.total_rows << " (mean " << t.mean_rows << " per expert)\n"
     << "rows per expert    min " << t.min_rows << "  p10 " << t.p10_rows << "  p50 " << t.p50_rows << "  max "
     << t.max_rows << "  (max/mean " << t.max_over_mean << ")\n"
     << "CV                 " << t.cv << " (" << std::setprecision(1) << 100.0 * t.cv << "%)\n"
     << std::setprecision(3) << "active experts     " << t.active_experts << " / " << t.num_experts << "\n"
     << "load entropy       " << t.load_entropy << " nats (uniform: "
     << std::log(static_cast<double>(t.num_experts)) << ")\n";
  if (t.score_entropy) os << "score entropy      " << *t.score_entropy << " nats (mean per token)\n";
  if (!t.owner_loads.empty()) {
    os << "owner loads        ";
    for (size_t q = 0; q < t.owner_loads.size(); ++q) os << (q ? " " : "") << t.owner_loads[q];
    os << "\nmax padding ratio  " << t.max_padding_ratio << " (eq. 31, worst owner)\n";
  }
  os.flags(flags);
  os.precision(prec);
  return os;
}

}  // namespace rdep
