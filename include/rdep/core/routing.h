// Routing: what the router decided for each rank's tokens (ordered top-K experts and gate weights),
// plus seeded generators for the benchmark and validation families.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "rdep/core/shape.h"
#include "rdep/status.h"

namespace rdep {

// One rank's routing. Token t's slot k chose experts[t*K+k] with gate gates[t*K+k]; the K experts of
// a token are distinct. num_tokens may be below the shape's T (a rank with fewer or zero tokens).
struct RankRouting {
  int64_t num_tokens = 0;
  int64_t topk = 0;
  std::vector<int32_t> experts;  // [num_tokens * K]
  std::vector<float> gates;      // [num_tokens * K], finite and >= 0

  // Checks sizes against the shape, expert ids in [0, E), distinct experts per token, finite gates.
  Status Validate(const LayerShape& shape) const;
};

using Routing = std::vector<RankRouting>;  // [W]

// Per-expert row counts of a routing, summed over ranks: the global load M_e.
std::vector<int64_t> ExpertLoads(const Routing& routing, int64_t num_experts);
// Load matrix Lambda[r][e]: rows rank r sends to expert e (row-major [W][E]).
std::vector<int64_t> LoadMatrix(const Routing& routing, int64_t num_experts);

// Node-limited routing (seeds 004): node_of_expert[e] is the node of expert e's owner.
// CheckNodeLimit: every token's experts lie on at most max_nodes distinct nodes; otherwise
// InvalidArgument naming the token and its nodes.
Status CheckNodeLimit(const RankRouting& routing, const std::vector<int32_t>& node_of_expert, int64_t max_nodes);
// Makes a generated routing node-limited: per token, the first max_nodes distinct nodes in slot order
// are kept, and a slot on another node takes the lowest-id expert of the kept nodes that the token
// does not hold yet (its gate unchanged). InvalidArgument when the kept nodes hold fewer than K experts.
Status LimitRoutingNodes(Routing& routing, const std::vector<int32_t>& node_of_expert, int64_t max_nodes);

// Families of seeded synthetic routings (seeds 000 section 5, Table 18).
struct RoutingSpec {
  enum class Family {
    kUniform,    // uniform_distinct: K distinct experts uniformly at random
    kZipf,       // zipf_distinct(alpha): popularity ~ 1/(rank+1)^alpha over a seeded permutation
    kOneExpert,  // every token chooses experts 0..K-1 in that order: all traffic to one expert set
    kSparse,     // only the even-numbered experts (at least K of them) receive traffic: empty experts
  };
  Family family = Family::kUniform;
  double alpha = 1.0;    // Zipf exponent
  uint64_t seed = 1;
  int64_t empty_rank = -1;  // if in [0, W): that rank holds zero tokens

  // Parses "uniform", "zipf:ALPHA", "one-expert", "sparse".
  static StatusOr<RoutingSpec> Parse(const std::string& text);
  std::string name() const;
};

// Generates W ranks of routing: K distinct experts per token (sampling without replacement), gates
// a softmax of standard-normal logits over the chosen slots (so each token's gates sum to 1).
StatusOr<Routing> GenerateRouting(const LayerShape& shape, const RoutingSpec& spec);

}  // namespace rdep
