// The reference MoE operator (seeds 000 eq. 4 with the dropped-and-renormalized gates of
// capacity.h): a plain sequential MoE in double precision with no transport. Every backend's
// forward and backward are checked against it.
#pragma once

#include <cstdint>
#include <vector>

#include "rdep/core/capacity.h"
#include "rdep/core/expert_mlp.h"
#include "rdep/core/routing.h"
#include "rdep/core/shape.h"
#include "rdep/status.h"

namespace rdep {

// All experts' weights (fp32 storage), layout of expert_mlp.h:
//   w1 [E][H][2F] (gate and up columns placed by gate_up), w2 [E][F][H].
struct MoEWeights {
  int64_t experts = 0, hidden = 0, ffn = 0;
  std::vector<float> w1, w2;
  mlp::GateUp gate_up = mlp::GateUp::kSplit;

  // The same weights with w1's columns placed by `layout` (a copy; the reference's results do not change).
  // InvalidArgument when either layout is kInterleaved8 and ffn is not a positive multiple of 8.
  StatusOr<MoEWeights> InLayout(mlp::GateUp layout) const;
  size_t w1_per_expert() const { return static_cast<size_t>(hidden * 2 * ffn); }
  size_t w2_per_expert() const { return static_cast<size_t>(ffn * hidden); }
  Status Validate(const LayerShape& shape) const;
};

// Weights ~ N(0, 1) * scale (scale 0 picks 1/sqrt(fan_in) per matrix), seeded.
MoEWeights RandomWeights(const LayerShape& shape, uint64_t seed, double scale = 0.0);
// Activations for every rank: x[r] is [num_tokens_r][H], ~ N(0, 1) * scale, seeded.
std::vector<std::vector<float>> RandomActivations(const LayerShape& shape, const Routing& routing, uint64_t seed,
                                                  double scale = 1.0);

struct ReferenceForwardResult {
  std::vector<std::vector<double>> y;             // [W][n_r*H]
  std::vector<std::vector<double>> expert_out;    // [W][n_r*K*H] f_{I_tk}(x_t) (0 for dropped slots)
  std::vector<RankAcceptance> acceptance;         // accepted set and effective gates
};

struct ReferenceGradients {
  std::vector<std::vector<double>> dx;      // [W][n_r*H]
  std::vector<std::vector<double>> dgates;  // [W][n_r*K] w.r.t. the router's (pre-capacity) gates
  std::vector<double> dw1, dw2;             // like MoEWeights
};

StatusOr<ReferenceForwardResult> ReferenceForward(const LayerShape& shape, const MoEWeights& w, const Routing& routing,
                                                  const CapacityPolicy& policy,
                                                  const std::vector<std::vector<float>>& x);

StatusOr<ReferenceGradients> ReferenceBackward(const LayerShape& shape, const MoEWeights& w, const Routing& routing,
                                               const CapacityPolicy& policy, const std::vector<std::vector<float>>& x,
                                               const std::vector<std::vector<float>>& dy);

}  // namespace rdep
