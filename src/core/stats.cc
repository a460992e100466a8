#include "rdep/core/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace rdep {

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  p = std::clamp(p, 0.0, 100.0);
  const double pos = p / 100.0 * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return v[lo] + (v[hi] - v[lo]) * frac;
}

Summary Summarize(const std::vector<double>& v) {
  Summary s;
  s.count = static_cast<int64_t>(v.size());
  if (v.empty()) return s;
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  s.p50 = Percentile(v, 50);
  s.p99 = Percentile(v, 99);
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  double var = 0;
  for (double x : v) var += (x - s.mean) * (x - s.mean);
  s.stddev = std::sqrt(var / static_cast<double>(v.size()));
  return s;
}

std::ostream& operator<<(std::ostream& os, const Summary& s) {
  return os << "n=" << s.count << " min=" << s.min << " p50=" << s.p50 << " p99=" << s.p99 << " max=" << s.max
            << " mean=" << s.mean;
}

double CoefficientOfVariation(const std::vector<int64_t>& c) {
  if (c.empty()) return 0;
  double mean = 0;
  for (auto x : c) mean += static_cast<double>(x);
  mean /= static_cast<double>(c.size());
  if (mean == 0) return 0;
  double var = 0;
  for (auto x : c) var += (static_cast<double>(x) - mean) * (static_cast<double>(x) - mean);
  return std::sqrt(var / static_cast<double>(c.size())) / mean;
}

double PaddingRatio(const std::vector<int64_t>& m) {
  int64_t sum = 0, mx = 0;
  for (auto x : m) {
    sum += x;
    mx = std::max(mx, x);
  }
  if (sum == 0) return 1.0;
  return static_cast<double>(m.size()) * static_cast<double>(mx) / static_cast<double>(sum);
}

std::vector<double> MaxOverRanks(const std::vector<std::vector<double>>& times) {
  std::vector<double> out;
  for (const auto& rank : times) {
    if (out.size() < rank.size()) out.resize(rank.size(), -std::numeric_limits<double>::infinity());
    for (size_t i = 0; i < rank.size(); ++i) out[i] = std::max(out[i], rank[i]);
  }
  return out;
}

}  // namespace rdep
