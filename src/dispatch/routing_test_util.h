// Routings for the protocol kernels' tests (routing_kernels_test.cc, window_plan_test.cc): random valid ones
// and the faults the routing check must name.
#pragma once

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "rdep/core/random.h"

namespace rdep::dispatch::test_util {

// n tokens of K distinct experts in [0, E), gates in [0, 1).
inline void RandomRouting(int64_t n, int64_t K, int64_t E, uint64_t seed, std::vector<int32_t>& experts, std::vector<float>& gates) {
  Rng rng(seed);
  experts.assign(static_cast<size_t>(n * K), 0);
  gates.assign(static_cast<size_t>(n * K), 0.f);
  std::vector<int32_t> pool(static_cast<size_t>(E));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) pool[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    for (int64_t k = 0; k < K; ++k) {  // partial Fisher-Yates: K distinct ids
      const auto j = static_cast<size_t>(k + static_cast<int64_t>(rng.below(static_cast<uint64_t>(E - k))));
      std::swap(pool[static_cast<size_t>(k)], pool[j]);
      experts[static_cast<size_t>(t * K + k)] = pool[static_cast<size_t>(k)];
      gates[static_cast<size_t>(t * K + k)] = static_cast<float>(rng.uniform());
    }
  }
}

// Token bad_tokens[b] gets a fault of kind b % 4 in a middle slot (so earlier slots are checked first): expert E,
// expert -1, a NaN gate, a repeat of an earlier expert (K = 1: a negative gate).
inline void InjectRoutingFaults(const std::vector<int64_t>& bad_tokens, int64_t K, int64_t E, std::vector<int32_t>& experts,
                                std::vector<float>& gates) {
  for (size_t b = 0; b < bad_tokens.size(); ++b) {
    const int64_t t = bad_tokens[b], k = (K - 1) / 2;
    const auto i = static_cast<size_t>(t * K + k);
    switch (b % 4) {
      case 0: experts[i] = static_cast<int32_t>(E); break;
      case 1: experts[i] = -1; break;
      case 2: gates[i] = std::numeric_limits<float>::quiet_NaN(); break;
      default: if (K > 1) experts[i] = experts[static_cast<size_t>(t * K + (k == 0 ? 1 : 0))]; else gates[i] = -1.f;
    }
  }
}

}  // namespace rdep::dispatch::test_util
