// Statistics used by benchmarks, telemetry and the balancer: percentiles, CV, padding ratio.
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

namespace rdep {

// Percentile p in [0, 100] by linear interpolation between closest ranks (numpy's default).
// An empty sample gives NaN.
double Percentile(std::vector<double> values, double p);

struct Summary {
  int64_t count = 0;
  double min = 0, p50 = 0, p99 = 0, max = 0, mean = 0, stddev = 0;
};
Summary Summarize(const std::vector<double>& values);
std::ostream& operator<<(std::ostream& os, const Summary& s);

// Coefficient of variation (population stddev / mean); 0 when the mean is 0.
double CoefficientOfVariation(const std::vector<int64_t>& counts);

// Grouped-launch inflation (seeds 000 eq. 31): rho = E_loc * max_j m_j / sum_j m_j; 1 when all are 0.
double PaddingRatio(const std::vector<int64_t>& counts_per_local_expert);

// Element-wise max over ranks of per-rank iteration times: a distributed step ends when its slowest
// rank does (the max-rank convention). times[r][i] is rank r's i-th iteration.
std::vector<double> MaxOverRanks(const std::vector<std::vector<double>>& times);

}  // namespace rdep
