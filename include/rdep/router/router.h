// Host reference router (seeds 002 sections 1 and 9, seeds 004 node-limited routing): fp32 logits
// [n, E] -> scores -> (group / node limited) top-k -> gates, plus the balancing losses and the exact
// backward with respect to the logits. The GPU router kernels are checked against this reference.
//
// Forward, per token t with logits l_t in R^E:
//   s_t      = softmax(l_t) or sigmoid(l_t)                      (ScoreFunction)
//   sel_t,e  = s_t,e + b_e  (aux-loss-free expert bias b; b = 0 when absent)
//              or, with Sinkhorn routing, Sinkhorn(l)_t,e (no bias)
//   mask     = group-limited (keep topk_groups of num_groups contiguous groups by the sum of their
//              top-2 sel) and node-limited (keep max_nodes nodes by the sum of their top-2 sel)
//   I_t      = top-K of sel over the unmasked experts, descending; ties go to the lower expert id
//   g_t,k    = c * s_t,I_k / sum_j s_t,I_j   (normalize_topk)   or   c * s_t,I_k   (c = scaling_factor)
// Gates always come from the unbiased scores; selection never carries a gradient.
//
// Losses (each is zero when its coefficient is zero; all equal their coefficient at perfect balance):
//   aux (Switch/GShard):  a * E * sum_e f_e * P_e,  f_e = rows to e / (n*K),  P_e = mean_t p_t,e
//   seq aux (DeepSeek-V3): a_seq * mean over sequences of the same sum computed per sequence
//   z-loss:               a_z * mean_t logsumexp(l_t)^2
// where p_t is softmax(l_t) (softmax scores) or sigmoid(l_t) normalized to sum 1 (sigmoid scores).
#pragma once

#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "rdep/core/ownership.h"
#include "rdep/core/routing.h"
#include "rdep/status.h"

namespace rdep {

enum class ScoreFunction { kSoftmax, kSigmoid };
const char* ScoreFunctionName(ScoreFunction f);

// How the router is configured (what it computes; the problem is the logits it is given).
struct RouterConfig {
  int64_t num_experts = 0;  // E
  int64_t topk = 0;         // K
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  bool normalize_topk = true;   // gates of a token renormalized to sum to 1 before scaling
  double scaling_factor = 1.0;  // c: multiplies every gate

  // Group-limited top-k: E split into num_groups contiguous groups; keep topk_groups of them.
  // num_groups = 1 (and topk_groups = 1) disables it.
  int64_t num_groups = 1;
  int64_t topk_groups = 1;

  // Node-limited routing (seeds 004): a token reaches experts on at most max_nodes nodes.
  // max_nodes = 0 disables it; otherwise node_of_expert[E] must be set (see ExpertNodeMap).
  int64_t max_nodes = 0;
  std::vector<int32_t> node_of_expert;

  // Sinkhorn routing (seeds 002 section 9): selection on the Sinkhorn-balanced logits.
  bool sinkhorn = false;
  double sinkhorn_tolerance = 1e-4;  // stop when mean |d1_new - d1_old| falls below this
  int64_t sinkhorn_max_iters = 1000;

  // Loss coefficients. seq_length (tokens per sequence) is required when seq_aux_loss_coeff > 0 and
  // must divide the token count.
  double aux_loss_coeff = 0.0;
  double seq_aux_loss_coeff = 0.0;
  int64_t seq_length = 0;
  double z_loss_coeff = 0.0;

  // Rejects topk > E, num_groups not dividing E, max_nodes larger than the nodes, etc.
  Status Validate() const;
  int64_t num_nodes() const;  // distinct nodes in node_of_expert (0 when node-limited is off)
};

std::ostream& operator<<(std::ostream& os, const RouterConfig& c);

// Node of each expert when a node is a contiguous block of ranks_per_node ranks:
// node(e) = owner(e) / ranks_per_node. W must be divisible by ranks_per_node.
StatusOr<std::vector<int32_t>> ExpertNodeMap(const OwnershipMap& ownership, int64_t ranks_per_node);

struct RouterLosses {
  double aux = 0;      // already multiplied by aux_loss_coeff
  double seq_aux = 0;  // already multiplied by seq_aux_loss_coeff
  double z = 0;        // already multiplied by z_loss_coeff
  double total() const { return aux + seq_aux + z; }
};

std::ostream& operator<<(std::ostream& os, const RouterLosses& l);

// What one forward pass decided and what backward needs.
struct RouterOutput {
  RankRouting routing;               // experts [n*K] (descending selection score) and fp32 gates
  std::vector<double> gates_f64;     // [n*K] the same gates before rounding to fp32
  std::vector<double> scores;        // [n*E] unbiased scores s (softmax or sigmoid)
  std::vector<int64_t> tokens_per_expert;  // [E] rows routed to each expert
  RouterLosses losses;
};

// Runs the router on fp32 logits [n, E] (row-major). expert_bias is empty or [E] (aux-loss-free
// balancing: it shifts selection only). n may be 0.
StatusOr<RouterOutput> Route(const RouterConfig& config, std::span<const float> logits, int64_t num_tokens,
                             std::span<const float> expert_bias = {});
// The same in double precision (the reference that finite-difference checks use).
StatusOr<RouterOutput> RouteF64(const RouterConfig& config, std::span<const double> logits, int64_t num_tokens,
                                std::span<const float> expert_bias = {});

// Gradient of  sum_{t,k} dgates[t,k] * g_t,k + losses.total()  with respect to the logits [n, E],
// for the selection saved in forward. dgates is [n*K] (empty means zero). The loss coefficients come
// from the config (the losses enter with weight 1). Sinkhorn and the bias carry no gradient.
StatusOr<std::vector<double>> RouterBackward(const RouterConfig& config, std::span<const double> logits,
                                             int64_t num_tokens, const RouterOutput& forward,
                                             std::span<const float> dgates);

// Aux-loss-free bias update (seeds 002 section 9): b_e <- b_e + rate * sign(mean load - load_e).
Status UpdateExpertBias(std::vector<float>& bias, std::span<const int64_t> tokens_per_expert, double rate);

// Sinkhorn normalization of exp(cost) [n, E] (Megatron-Core's form): alternately rescale rows and
// columns until the column scale changes by less than tolerance (mean absolute change). At the fixed
// point every row sums to 1/n and every column to 1/E. Returns the normalized matrix.
StatusOr<std::vector<double>> Sinkhorn(std::span<const double> cost, int64_t rows, int64_t cols, double tolerance,
                                       int64_t max_iters);

}  // namespace rdep
