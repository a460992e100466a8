// The shared capacity rules (rdep/core/capacity_rules.h) against brute-force definitions on random
// inputs: admission against a row-by-row walk in row_id order, renormalization bit for bit against
// the arithmetic the CUDA AcceptKernel / DgateKernel spelled out before they called the shared
// functions, the backward against central finite differences in double.
#include "rdep/core/capacity_rules.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "rdep/core/capacity.h"
#include "rdep/core/random.h"

namespace rdep {
namespace {

// Brute force: the sources' candidate rows one at a time in source order; a row is admitted while
// fewer than `capacity` rows are.
std::vector<int64_t> AdmitRowByRow(const std::vector<int64_t>& counts, int64_t capacity) {
  std::vector<int64_t> admitted(counts.size(), 0);
  int64_t used = 0;
  for (size_t s = 0; s < counts.size(); ++s)
    for (int64_t r = 0; r < counts[s]; ++r)
      if (used < capacity) {
        ++admitted[s];
        ++used;
      }
  return admitted;
}

TEST(CapacityRules, SourceOrderAdmissionMatchesRowByRowWalk) {
  Rng rng(13);
  for (int trial = 0; trial < 2000; ++trial) {
    const auto num_src = static_cast<int64_t>(1 + rng.below(9));
    std::vector<int64_t> counts(static_cast<size_t>(num_src));
    int64_t total = 0;
    for (auto& c : counts) {
      c = rng.below(4) == 0 ? 0 : static_cast<int64_t>(rng.below(20));
      total += c;
    }
    int64_t capacity;
    switch (trial % 4) {
      case 0: capacity = 0; break;
      case 1: capacity = std::numeric_limits<int64_t>::max(); break;  // dropless
      case 2: capacity = total; break;
      default: capacity = static_cast<int64_t>(rng.below(static_cast<uint64_t>(total) + 5)); break;
    }
    const std::vector<int64_t> want = AdmitRowByRow(counts, capacity);
    SourceOrderAdmission admission{capacity};
    std::vector<int64_t> host(static_cast<size_t>(num_src));
    AdmitBySourceOrder(counts.data(), num_src, capacity, host.data());
    for (size_t s = 0; s < counts.size(); ++s) {
      EXPECT_EQ(admission.Admit(counts[s]), want[s]) << "trial " << trial << " source " << s;
      EXPECT_EQ(host[s], want[s]) << "trial " << trial << " source " << s;
    }
  }
}

// Random gates for one token: mostly in (0, 1], some exact zeros and repeats; a random accept mask
// with all-dropped and all-accepted tokens forced now and then.
struct Token {
  std::vector<float> gates;
  std::vector<uint8_t> accepted;
};

Token RandomToken(Rng& rng, int trial, bool positive_gates) {
  const auto K = static_cast<size_t>(1 + rng.below(8));
  Token tok{std::vector<float>(K), std::vector<uint8_t>(K)};
  for (size_t k = 0; k < K; ++k) {
    const uint64_t kind = rng.below(8);
    if (!positive_gates && kind == 0) tok.gates[k] = 0.f;
    else if (kind == 1 && k > 0) tok.gates[k] = tok.gates[k - 1];
    else tok.gates[k] = static_cast<float>(0.05 + rng.uniform());
    tok.accepted[k] = rng.below(3) != 0;
  }
  if (trial % 7 == 0) std::fill(tok.accepted.begin(), tok.accepted.end(), uint8_t{0});
  if (trial % 7 == 1) std::fill(tok.accepted.begin(), tok.accepted.end(), uint8_t{1});
  return tok;
}

// The forward as the CUDA AcceptKernel wrote it out by hand before it called RenormalizeTokenGates
// (the host's RenormalizeGates had the same arithmetic).
void RenormalizeAsKernelDid(const float* gates, const uint8_t* accepted, int64_t K, float* effective) {
  double S = 0, A = 0;
  for (int64_t k = 0; k < K; ++k) {
    S += gates[k];
    if (accepted[k]) A += gates[k];
  }
  for (int64_t k = 0; k < K; ++k) {
    if (!accepted[k] || A == 0) effective[k] = 0.f;
    else effective[k] = (S == A) ? gates[k] : static_cast<float>(static_cast<double>(gates[k]) * S / A);
  }
}

TEST(CapacityRules, RenormalizeIsBitwiseTheKernelsArithmetic) {
  Rng rng(17);
  int all_dropped = 0, nothing_dropped_by_weight = 0, rescaled = 0;
  for (int trial = 0; trial < 5000; ++trial) {
    const Token tok = RandomToken(rng, trial, /*positive_gates=*/false);
    const auto K = static_cast<int64_t>(tok.gates.size());
    std::vector<float> shared(tok.gates.size()), host(tok.gates.size()), want(tok.gates.size());
    RenormalizeTokenGates(tok.gates.data(), tok.accepted.data(), K, shared.data());
    RenormalizeGates(tok.gates.data(), tok.accepted.data(), K, host.data());
    RenormalizeAsKernelDid(tok.gates.data(), tok.accepted.data(), K, want.data());
    double S = 0, A = 0, sum_eff = 0;
    for (int64_t k = 0; k < K; ++k) {
      S += tok.gates[static_cast<size_t>(k)];
      if (tok.accepted[static_cast<size_t>(k)]) A += tok.gates[static_cast<size_t>(k)];
    }
    for (size_t k = 0; k < tok.gates.size(); ++k) {
      EXPECT_EQ(std::bit_cast<uint32_t>(shared[k]), std::bit_cast<uint32_t>(want[k])) << "trial " << trial << " k " << k;
      EXPECT_EQ(std::bit_cast<uint32_t>(host[k]), std::bit_cast<uint32_t>(want[k])) << "trial " << trial << " k " << k;
      if (!tok.accepted[k] || A == 0) {
        EXPECT_EQ(std::bit_cast<uint32_t>(shared[k]), 0u);
      }
      if (tok.accepted[k] && S == A) {
        EXPECT_EQ(shared[k], tok.gates[k]);  // bitwise the input gate
      }
      sum_eff += shared[k];
    }
    if (A == 0) ++all_dropped;
    else if (S == A) ++nothing_dropped_by_weight;
    else ++rescaled;
    if (A > 0) {
      EXPECT_NEAR(sum_eff, S, 1e-6 * S) << "trial " << trial;  // the token's gate sum is kept
    }
  }
  EXPECT_GT(all_dropped, 100);  // every case was exercised
  EXPECT_GT(nothing_dropped_by_weight, 100);
  EXPECT_GT(rescaled, 100);
}

// d L / d g by central differences in double of L(g) = sum_k w_k g'_k, with g'_k = g_k S / A
// computed in double (gates > 0 and A > 0 keep g away from the rule's branches).
std::vector<double> FiniteDifferenceGrad(const std::vector<float>& gates, const std::vector<uint8_t>& accepted,
                                         const std::vector<double>& w) {
  auto loss = [&](const std::vector<double>& g) {
    double S = 0, A = 0;
    for (size_t k = 0; k < g.size(); ++k) {
      S += g[k];
      if (accepted[k]) A += g[k];
    }
    double l = 0;
    for (size_t k = 0; k < g.size(); ++k)
      if (accepted[k]) l += w[k] * g[k] * S / A;
    return l;
  };
  std::vector<double> grad(gates.size());
  for (size_t j = 0; j < gates.size(); ++j) {
    std::vector<double> gp(gates.begin(), gates.end()), gm(gates.begin(), gates.end());
    const double h = 1e-6;
    gp[j] += h;
    gm[j] -= h;
    grad[j] = (loss(gp) - loss(gm)) / (2 * h);
  }
  return grad;
}

TEST(CapacityRules, BackwardMatchesFiniteDifferencesInDouble) {
  Rng rng(19);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const Token tok = RandomToken(rng, trial, /*positive_gates=*/true);
    const auto K = static_cast<int64_t>(tok.gates.size());
    std::vector<double> d_eff(tok.gates.size()), d_g(tok.gates.size()), host(tok.gates.size());
    for (auto& d : d_eff) d = rng.normal();
    RenormalizeTokenGatesBackward(tok.gates.data(), tok.accepted.data(), K, d_eff.data(), d_g.data());
    RenormalizeGatesBackward(tok.gates.data(), tok.accepted.data(), K, d_eff.data(), host.data());
    bool any = false;
    for (uint8_t a : tok.accepted) any |= a != 0;
    for (size_t k = 0; k < tok.gates.size(); ++k) {
      EXPECT_EQ(std::bit_cast<uint64_t>(host[k]), std::bit_cast<uint64_t>(d_g[k]));
      if (!any) {
        EXPECT_EQ(d_g[k], 0.0);  // A == 0: no gradient
      }
    }
    if (!any) continue;
    const std::vector<double> fd = FiniteDifferenceGrad(tok.gates, tok.accepted, d_eff);
    for (size_t k = 0; k < tok.gates.size(); ++k)
      EXPECT_NEAR(d_g[k], fd[k], 1e-7 * (1 + std::abs(fd[k]))) << "trial " << trial << " k " << k;
    ++checked;
  }
  EXPECT_GT(checked, 2000);
}

// The dgate kernel's chain rule as it was written out by hand (float in, double math, float out).
void BackwardAsKernelDid(const float* gates, const uint8_t* accepted, int64_t K, const float* scratch, float* dgates) {
  double S = 0, A = 0, P = 0;
  for (int64_t k = 0; k < K; ++k) {
    S += gates[k];
    if (accepted[k]) {
      A += gates[k];
      P += static_cast<double>(scratch[k]) * gates[k];
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    double d;
    if (A == 0) d = 0;
    else if (S == A) d = accepted[k] ? scratch[k] : 0.0;
    else d = (accepted[k] ? scratch[k] * S / A - P * S / (A * A) : 0.0) + P / A;
    dgates[k] = static_cast<float>(d);
  }
}

TEST(CapacityRules, FloatBackwardIsTheKernelsArithmeticAndTheHostsRounded) {
  Rng rng(23);
  for (int trial = 0; trial < 5000; ++trial) {
    const Token tok = RandomToken(rng, trial, /*positive_gates=*/false);
    const auto K = static_cast<int64_t>(tok.gates.size());
    std::vector<float> d_eff(tok.gates.size()), shared(tok.gates.size()), want(tok.gates.size());
    std::vector<double> d_eff_wide(tok.gates.size()), host(tok.gates.size());
    for (size_t k = 0; k < d_eff.size(); ++k) {
      d_eff[k] = static_cast<float>(rng.normal());
      d_eff_wide[k] = d_eff[k];
    }
    RenormalizeTokenGatesBackward(tok.gates.data(), tok.accepted.data(), K, d_eff.data(), shared.data());
    BackwardAsKernelDid(tok.gates.data(), tok.accepted.data(), K, d_eff.data(), want.data());
    RenormalizeGatesBackward(tok.gates.data(), tok.accepted.data(), K, d_eff_wide.data(), host.data());
    for (size_t k = 0; k < tok.gates.size(); ++k) {
      EXPECT_EQ(std::bit_cast<uint32_t>(shared[k]), std::bit_cast<uint32_t>(want[k])) << "trial " << trial << " k " << k;
      // Same double math on the same inputs: the float result is the host's double result rounded.
      EXPECT_EQ(std::bit_cast<uint32_t>(shared[k]), std::bit_cast<uint32_t>(static_cast<float>(host[k])));
    }
  }
}

}  // namespace
}  // namespace rdep
