#include "rdep/core/routing.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <sstream>

#include "rdep/core/node_rules.h"
#include "rdep/core/random.h"
#include "rdep/core/route_rules.h"

namespace rdep {

Status RankRouting::Validate(const LayerShape& shape) const {
  auto bad = [&](const std::string& what) { return InvalidArgument("routing: " + what); };
  if (num_tokens < 0 || num_tokens > shape.tokens)
    return bad("num_tokens " + std::to_string(num_tokens) + " outside [0, T=" + std::to_string(shape.tokens) + "]");
  if (topk != shape.topk) return bad("topk " + std::to_string(topk) + " != shape K=" + std::to_string(shape.topk));
  const auto n = static_cast<size_t>(num_tokens * topk);
  if (experts.size() != n || gates.size() != n)
    return bad("expected " + std::to_string(n) + " expert ids and gates (num_tokens*K), got " +
               std::to_string(experts.size()) + " and " + std::to_string(gates.size()));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const auto row = static_cast<size_t>(t * topk);
    for (int64_t k = 0; k < topk; ++k) {
      const RouteSlotFault fault = CheckRouteSlot(experts.data() + row, gates.data() + row, k, shape.experts);
      if (fault != RouteSlotFault::kNone)
        return bad(DescribeRouteSlotFault(fault, t, k, experts[row + static_cast<size_t>(k)], gates[row + static_cast<size_t>(k)],
                                          shape.experts));
    }
  }
  return Status::Ok();
}

Status CheckNodeLimit(const RankRouting& r, const std::vector<int32_t>& node_of_expert, int64_t max_nodes) {
  std::vector<int32_t> seen;
  const auto node_of = [&](int32_t e) { return static_cast<int64_t>(node_of_expert[static_cast<size_t>(e)]); };
  for (int64_t t = 0; t < r.num_tokens; ++t) {
    if (CountTokenNodes(r.experts.data() + t * r.topk, r.topk, node_of) <= max_nodes) continue;  // the rule (node_rules.h)
    seen.clear();
    for (int64_t k = 0; k < r.topk; ++k) {
      const int32_t node = node_of_expert[static_cast<size_t>(r.experts[static_cast<size_t>(t * r.topk + k)])];
      if (std::find(seen.begin(), seen.end(), node) == seen.end()) seen.push_back(node);
    }
    if (static_cast<int64_t>(seen.size()) > max_nodes) {
      std::ostringstream os;
      os << "routing: token " << t << " has experts on " << seen.size() << " nodes (";
      for (size_t i = 0; i < seen.size(); ++i) os << (i ? "," : "") << seen[i];
      os << "), more than the node cap M=" << max_nodes;
      return InvalidArgument(os.str());
    }
  }
  return Status::Ok();
}

Status LimitRoutingNodes(Routing& routing, const std::vector<int32_t>& node_of_expert, int64_t max_nodes) {
  const auto E = static_cast<int32_t>(node_of_expert.size());
  std::vector<int32_t> kept;
  std::vector<uint8_t> has(static_cast<size_t>(E));
  for (RankRouting& r : routing) {
    for (int64_t t = 0; t < r.num_tokens; ++t) {
      int32_t* ex = r.experts.data() + t * r.topk;
      kept.clear();
      for (int64_t k = 0; k < r.topk; ++k) {
        const int32_t node = node_of_expert[static_cast<size_t>(ex[k])];
        if (std::find(kept.begin(), kept.end(), node) == kept.end() && static_cast<int64_t>(kept.size()) < max_nodes)
          kept.push_back(node);
      }
      std::fill(has.begin(), has.end(), 0);
      for (int64_t k = 0; k < r.topk; ++k)
        if (std::find(kept.begin(), kept.end(), node_of_expert[static_cast<size_t>(ex[k])]) != kept.end()) has[static_cast<size_t>(ex[k])] = 1;
      int32_t next = 0;
      for (int64_t k = 0; k < r.topk; ++k) {
        if (std::find(kept.begin(), kept.end(), node_of_expert[static_cast<size_t>(ex[k])]) != kept.end()) continue;
        while (next < E && (has[static_cast<size_t>(next)] ||
                            std::find(kept.begin(), kept.end(), node_of_expert[static_cast<size_t>(next)]) == kept.end()))
          ++next;
        if (next == E)
          return InvalidArgument("node-limited routing: K=" + std::to_string(r.topk) + " experts do not fit on M=" +
                                 std::to_string(max_nodes) + " nodes");
        ex[k] = next;
        has[static_cast<size_t>(next)] = 1;
      }
    }
  }
  return Status::Ok();
}

std::string DescribeRouteSlotFault(RouteSlotFault fault, int64_t token, int64_t slot, int32_t expert, float gate,
                                   int64_t num_experts) {
  std::ostringstream os;
  os << "token " << token << " slot " << slot << ": ";
  switch (fault) {
    case RouteSlotFault::kNone: os << "valid"; break;
    case RouteSlotFault::kExpertOutOfRange: os << "expert " << expert << " outside [0, E=" << num_experts << ")"; break;
    case RouteSlotFault::kBadGate: os << "gate " << gate << " is negative or not finite"; break;
    case RouteSlotFault::kRepeatedExpert: os << "expert " << expert << " chosen twice (an earlier slot of the token has it)"; break;
  }
  return os.str();
}

std::vector<int64_t> ExpertLoads(const Routing& routing, int64_t num_experts) {
  std::vector<int64_t> load(static_cast<size_t>(num_experts), 0);
  for (const auto& rr : routing)
    for (int32_t e : rr.experts) ++load[static_cast<size_t>(e)];
  return load;
}

std::vector<int64_t> LoadMatrix(const Routing& routing, int64_t num_experts) {
  std::vector<int64_t> m(routing.size() * static_cast<size_t>(num_experts), 0);
  for (size_t r = 0; r < routing.size(); ++r)
    for (int32_t e : routing[r].experts) ++m[r * static_cast<size_t>(num_experts) + static_cast<size_t>(e)];
  return m;
}

StatusOr<RoutingSpec> RoutingSpec::Parse(const std::string& text) {
  RoutingSpec s;
  if (text == "uniform") {
    s.family = Family::kUniform;
  } else if (text == "one-expert") {
    s.family = Family::kOneExpert;
  } else if (text == "sparse") {
    s.family = Family::kSparse;
  } else if (text.rfind("zipf:", 0) == 0) {
    s.family = Family::kZipf;
    const std::string a = text.substr(5);
    char* end = nullptr;
    s.alpha = std::strtod(a.c_str(), &end);
    if (a.empty() || *end != '\0' || !std::isfinite(s.alpha) || s.alpha < 0)
      return InvalidArgument("routing: zipf exponent must be a finite number >= 0, got '" + a + "'");
  } else {
    return InvalidArgument("routing: unknown family '" + text + "' (expected uniform, zipf:ALPHA, one-expert, sparse)");
  }
  return s;
}

std::string RoutingSpec::name() const {
  switch (family) {
    case Family::kUniform: return "uniform";
    case Family::kOneExpert: return "one-expert";
    case Family::kSparse: return "sparse";
    case Family::kZipf: {
      std::ostringstream os;
      os << "zipf:" << alpha;
      return os.str();
    }
  }
  return "?";
}

StatusOr<Routing> GenerateRouting(const LayerShape& shape, const RoutingSpec& spec) {
  RDEP_RETURN_IF_ERROR(shape.Validate());
  const int64_t E = shape.experts, K = shape.topk;
  // Log-popularity per expert; -inf marks an expert that receives no traffic.
  std::vector<double> logp(static_cast<size_t>(E), 0.0);
  if (spec.family == RoutingSpec::Family::kZipf) {
    std::vector<int64_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    Rng prng(spec.seed, 0xFFFF);
    for (int64_t i = E - 1; i > 0; --i) std::swap(perm[static_cast<size_t>(i)], perm[prng.below(static_cast<uint64_t>(i + 1))]);
    for (int64_t i = 0; i < E; ++i) logp[static_cast<size_t>(perm[static_cast<size_t>(i)])] = -spec.alpha * std::log(static_cast<double>(i + 1));
  } else if (spec.family == RoutingSpec::Family::kSparse) {
    int64_t active = 0;
    for (int64_t e = 0; e < E; ++e) {
      const bool on = (e % 2 == 0) || (E - e <= K - active);  // keep at least K experts active
      logp[static_cast<size_t>(e)] = on ? 0.0 : -INFINITY;
      active += on;
    }
  }
  Routing routing(static_cast<size_t>(shape.ranks));
  std::vector<std::pair<double, int32_t>> keys(static_cast<size_t>(E));
  for (int64_t r = 0; r < shape.ranks; ++r) {
    RankRouting& rr = routing[static_cast<size_t>(r)];
    rr.topk = K;
    rr.num_tokens = (r == spec.empty_rank) ? 0 : shape.tokens;
    rr.experts.resize(static_cast<size_t>(rr.num_tokens * K));
    rr.gates.resize(rr.experts.size());
    Rng rng(spec.seed, static_cast<uint64_t>(r));
    for (int64_t t = 0; t < rr.num_tokens; ++t) {
      int32_t* ex = rr.experts.data() + t * K;
      if (spec.family == RoutingSpec::Family::kOneExpert) {
        for (int64_t k = 0; k < K; ++k) ex[k] = static_cast<int32_t>(k);
      } else {
        // Gumbel top-K: K draws without replacement, proportional to popularity.
        for (int64_t e = 0; e < E; ++e)
          keys[static_cast<size_t>(e)] = {logp[static_cast<size_t>(e)] + rng.gumbel(), static_cast<int32_t>(e)};
        std::partial_sort(keys.begin(), keys.begin() + K, keys.end(),
                          [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
        for (int64_t k = 0; k < K; ++k) ex[k] = keys[static_cast<size_t>(k)].second;
      }
      float* g = rr.gates.data() + t * K;
      double mx = -INFINITY;
      std::vector<double> z(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) mx = std::max(mx, z[static_cast<size_t>(k)] = rng.normal());
      double sum = 0;
      for (auto& v : z) sum += (v = std::exp(v - mx));
      for (int64_t k = 0; k < K; ++k) g[k] = static_cast<float>(z[static_cast<size_t>(k)] / sum);
    }
  }
  return routing;
}

}  // namespace rdep
