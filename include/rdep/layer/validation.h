// The validation matrix of `rdep check` (seeds 000 Table 18) for one configuration:
//   smoke              domain bootstrap, peer-visible stores, phase barrier
//   dispatch           sentinel payloads: every accepted row lands exactly once in its owner's span
//                      for its local expert and returns to its own front-end slot; the accepted set
//                      equals the reference rule; counts add up (sum_e M_e = W*T*K - drops)
//   forward parity     y against the double-precision reference operator
//   gradient parity    dx, dgates, dW1, dW2 against the reference
//   finite             every output and gradient is finite on every rank
//   segment invariance y, dx, dgates, dW bitwise equal with a different segment size
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rdep/core/routing.h"
#include "rdep/layer/layer_config.h"
#include "rdep/status.h"

namespace rdep {

struct ValidationOptions {
  LayerConfig layer;
  RoutingSpec routing;          // family, seed, optional empty rank
  uint64_t seed = 1;            // weights and activations
  double barrier_timeout_s = 30;
  double rtol = 1e-4;           // |out - ref| <= atol + rtol*|ref|, atol = atol_scale * max|ref|
  double atol_scale = 2e-5;   // fp32 host backend vs fp64 reference
};

struct CheckResult {
  std::string name;
  bool passed = false;
  bool skipped = false;
  std::string detail;
  double seconds = 0;
};

struct ValidationReport {
  std::string backend;
  std::vector<CheckResult> checks;
  int64_t dropped_rows = 0;
  int64_t accepted_rows = 0;
  int64_t segments = 0;
  size_t symmetric_bytes_per_rank = 0;
  bool passed() const;
  std::string ToJson(const ValidationOptions& options) const;
};

// Runs every check on the host backend. A configuration that cannot be built (bad shape, bad
// capacity factor) is an error Status; a check that fails is a failed row of the report.
StatusOr<ValidationReport> RunHostValidation(const ValidationOptions& options);

// Largest normalized error max_i |a_i - r_i| / (atol + rtol*|r_i|) with atol = atol_scale * max|r|;
// a NaN in `a` gives +inf. <= 1 passes.
double NormalizedError(const std::vector<float>& a, const std::vector<double>& r, double rtol, double atol_scale);

}  // namespace rdep
