// The validation matrix of `rdep check` (seeds 000 Table 18) for one configuration, on any backend:
//   smoke              domain bootstrap, peer-visible stores, phase barrier
//   dispatch           sentinel payloads: every accepted row lands exactly once in its owner's span
//                      for its local expert and returns to its own front-end slot; the accepted set
//                      equals the reference rule; counts add up (sum_e M_e = W*T*K - drops)
//   host agreement     (non-host backends) accepted set, gates, owner placement and counts equal
//                      the host backend's bit for bit
//   forward parity     y against the double-precision reference operator
//   gradient parity    dx, dgates, dW1, dW2 against the reference
//   finite             every output and gradient is finite on every rank
//   two-phase traffic  (nodes > 1) every rank's rows and bytes per phase equal rdep model's prediction
//                      for the same routing and accepted set (rdep/model/two_phase_traffic.h)
//   segment invariance the same results with another segment size (host: bitwise; GPU: routing
//                      bitwise, values within the parity tolerance, since GEMM tiling may change)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rdep/core/capacity.h"
#include "rdep/core/footprint.h"
#include "rdep/core/ownership.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/layer/host_moe_layer.h"
#include "rdep/layer/layer_config.h"
#include "rdep/status.h"

namespace rdep {

struct ValidationOptions {
  LayerConfig layer;
  RoutingSpec routing;          // family, seed, optional empty rank
  uint64_t seed = 1;            // weights and activations
  double barrier_timeout_s = 30;
  // Host (fp32) criterion: max_i |out - ref| / (atol + rtol*|ref|) <= 1, atol = atol_scale * max|ref|.
  double rtol = 1e-4;
  double atol_scale = 2e-5;
  // bf16 backends' criterion: ||out - ref|| / ||ref|| <= rel_l2 (inputs rounded to bf16 for the reference).
  double rel_l2 = 1e-2;
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
  std::string transport;
  std::vector<CheckResult> checks;
  int64_t dropped_rows = 0;
  int64_t accepted_rows = 0;
  int64_t segments = 0;
  int64_t segment_size = 0;
  size_t symmetric_bytes_per_rank = 0;
  bool balanced = false;        // LayerConfig::balance was on: `balance` holds what it did
  BalanceTelemetry balance;
  std::vector<NodeTraffic> traffic;  // LayerConfig::nodes > 1: what each rank's two-phase forward moved
  std::vector<model::RankPhaseTraffic> traffic_model;  // [W] rdep model's prediction for the same routing
  int64_t inter_rows_expected = 0;   // the model's inter-node dispatch rows, summed over ranks
  bool passed() const;
  std::string ToJson(const ValidationOptions& options) const;
};

// What one sentinel forward produced, gathered over ranks.
struct SentinelRun {
  std::vector<RankAcceptance> acceptance;                 // [W]
  std::vector<std::vector<OwnerTraceEntry>> traces;       // [W] owner-grouped rows
  std::vector<std::vector<int64_t>> rows_per_expert;      // [W][E_loc]
  std::vector<std::vector<float>> expert_out;             // [W][n*K*H] returned rows
  int64_t segments = 0;
  int64_t segment_size = 0;
  size_t symmetric_bytes_per_rank = 0;
};

// What one forward + backward produced, gathered over ranks (weights in the global [E] layout).
struct LayerRun {
  std::vector<std::vector<float>> y, dx, dgates;
  std::vector<float> dw1, dw2;
  int64_t segments = 0;
  BalanceTelemetry balance;                 // with LayerConfig::balance on
  std::vector<int32_t> instances;           // [E] instances per expert (main + replicas); empty when off
  std::vector<NodeTraffic> traffic;         // [W] with LayerConfig::nodes > 1
  model::TwoPhaseWire wire;                 // with LayerConfig::nodes > 1: the layer's record sizes
};

// A backend the matrix can drive. Inputs are host data; a backend moves them to its devices.
class ValidationBackend {
 public:
  virtual ~ValidationBackend() = default;
  virtual std::string name() const = 0;
  virtual std::string transport() const = 0;
  virtual bool bf16() const = 0;  // activations and weights travel as bf16
  virtual Status Smoke(std::string* detail) = 0;
  virtual StatusOr<SentinelRun> Sentinel(const LayerConfig& cfg, const OwnershipMap& own, const MoEWeights& w,
                                         const Routing& routing, const std::vector<std::vector<float>>& x) = 0;
  virtual StatusOr<LayerRun> ForwardBackward(const LayerConfig& cfg, const OwnershipMap& own, const MoEWeights& w,
                                             const Routing& routing, const std::vector<std::vector<float>>& x,
                                             const std::vector<std::vector<float>>& dy) = 0;
};

StatusOr<std::unique_ptr<ValidationBackend>> MakeHostBackend(int64_t num_ranks, double barrier_timeout_s);

// Runs every check. A configuration that cannot be built (bad shape, bad capacity factor) is an error
// Status; a check that fails is a failed row of the report.
StatusOr<ValidationReport> RunValidation(const ValidationOptions& options, ValidationBackend& backend);
StatusOr<ValidationReport> RunHostValidation(const ValidationOptions& options);

// What RunValidation will allocate (host memory of the process; with device_backend, the memory of
// one GPU too) and compute, from the options alone: the check command refuses a configuration whose
// estimate exceeds the machine before anything is allocated. A valid config is assumed (Validate
// first); the terms are upper-range estimates (dropless, the largest owner), not exact counts.
Footprint EstimateValidationFootprint(const ValidationOptions& options, bool device_backend);

// Largest normalized error max_i |a_i - r_i| / (atol + rtol*|r_i|) with atol = atol_scale * max|r|;
// a NaN in `a` gives +inf. <= 1 passes.
double NormalizedError(const std::vector<float>& a, const std::vector<double>& r, double rtol, double atol_scale);
// ||a - r|| / ||r|| (0 when both are 0; +inf on a NaN or a size mismatch).
double RelativeL2Error(const std::vector<float>& a, const std::vector<double>& r);

}  // namespace rdep
