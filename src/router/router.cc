// Host reference router: scores, limited top-k, gates, balancing losses, and their exact backward.
// Everything is computed in double; Route() rounds the gates to fp32 for the RankRouting it returns.
#include "rdep/router/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>

namespace rdep {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

size_t Idx(int64_t i) { return static_cast<size_t>(i); }

// Sorts ids by value descending; equal values keep the lower id first (deterministic tie-break).
void SortDescending(std::vector<int32_t>& ids, const double* value) {
  std::stable_sort(ids.begin(), ids.end(), [value](int32_t a, int32_t b) {
    if (value[a] != value[b]) return value[a] > value[b];
    return a < b;
  });
}

void Softmax(const double* l, int64_t e, double* out) {
  double mx = kNegInf;
  for (int64_t i = 0; i < e; ++i) mx = std::max(mx, l[i]);
  double sum = 0;
  for (int64_t i = 0; i < e; ++i) sum += (out[i] = std::exp(l[i] - mx));
  for (int64_t i = 0; i < e; ++i) out[i] /= sum;
}

double LogSumExp(const double* l, int64_t e) {
  double mx = kNegInf;
  for (int64_t i = 0; i < e; ++i) mx = std::max(mx, l[i]);
  double sum = 0;
  for (int64_t i = 0; i < e; ++i) sum += std::exp(l[i] - mx);
  return mx + std::log(sum);
}

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Probabilities used by the aux losses: softmax, or sigmoid normalized to sum 1 per token.
std::vector<double> AuxProbs(const RouterConfig& c, const std::vector<double>& scores, int64_t n) {
  const int64_t e = c.num_experts;
  std::vector<double> p(scores);
  if (c.score_function == ScoreFunction::kSigmoid) {
    for (int64_t t = 0; t < n; ++t) {
      double sum = 0;
      for (int64_t i = 0; i < e; ++i) sum += p[Idx(t * e + i)];
      for (int64_t i = 0; i < e; ++i) p[Idx(t * e + i)] /= sum;
    }
  }
  return p;
}

// Sum of the two largest entries of sel over ids that pass `allowed` (one entry if only one).
double TopTwoSum(const std::vector<int32_t>& ids, const double* sel, const std::vector<char>& allowed) {
  double a = kNegInf, b = kNegInf;
  for (int32_t i : ids) {
    if (!allowed[Idx(i)]) continue;
    const double v = sel[i];
    if (v > a) {
      b = a;
      a = v;
    } else if (v > b) {
      b = v;
    }
  }
  if (a == kNegInf) return kNegInf;
  return b == kNegInf ? a : a + b;
}

// Keeps the `keep` best of the given expert sets (ranked by top-2 sum of sel), masking the others.
void KeepBestSets(const std::vector<std::vector<int32_t>>& sets, int64_t keep, const double* sel,
                  std::vector<char>& allowed) {
  const auto num_sets = static_cast<int32_t>(sets.size());
  std::vector<double> score(sets.size());
  std::vector<int32_t> order(sets.size());
  for (int32_t s = 0; s < num_sets; ++s) {
    score[Idx(s)] = TopTwoSum(sets[Idx(s)], sel, allowed);
    order[Idx(s)] = s;
  }
  SortDescending(order, score.data());
  for (size_t r = static_cast<size_t>(keep); r < order.size(); ++r)
    for (int32_t e : sets[Idx(order[r])]) allowed[Idx(e)] = 0;
}

template <typename T>
StatusOr<RouterOutput> RouteImpl(const RouterConfig& c, std::span<const T> logits_in, int64_t n,
                                 std::span<const float> bias) {
  RDEP_RETURN_IF_ERROR(c.Validate());
  const int64_t e = c.num_experts, k = c.topk;
  if (n < 0) return InvalidArgument("router: num_tokens must be >= 0, got " + std::to_string(n));
  if (static_cast<int64_t>(logits_in.size()) != n * e)
    return InvalidArgument("router: logits has " + std::to_string(logits_in.size()) + " values, expected num_tokens*E = " +
                           std::to_string(n) + "*" + std::to_string(e));
  if (!bias.empty() && static_cast<int64_t>(bias.size()) != e)
    return InvalidArgument("router: expert_bias has " + std::to_string(bias.size()) + " values, expected E = " +
                           std::to_string(e));
  if (!bias.empty() && c.sinkhorn)
    return InvalidArgument("router: expert_bias and sinkhorn are two different balancers; use one");
  if (c.seq_aux_loss_coeff > 0 && n % c.seq_length != 0)
    return InvalidArgument("router: seq_length (" + std::to_string(c.seq_length) + ") does not divide num_tokens (" +
                           std::to_string(n) + ")");
  std::vector<double> logits(logits_in.begin(), logits_in.end());
  for (int64_t i = 0; i < n * e; ++i)
    if (!std::isfinite(logits[Idx(i)]))
      return InvalidArgument("router: logit of token " + std::to_string(i / e) + ", expert " + std::to_string(i % e) +
                             " is not finite");
  for (size_t i = 0; i < bias.size(); ++i)
    if (!std::isfinite(bias[i])) return InvalidArgument("router: expert_bias[" + std::to_string(i) + "] is not finite");

  RouterOutput out;
  out.scores.assign(Idx(n * e), 0.0);
  for (int64_t t = 0; t < n; ++t) {
    const double* l = &logits[Idx(t * e)];
    double* s = &out.scores[Idx(t * e)];
    if (c.score_function == ScoreFunction::kSoftmax) {
      Softmax(l, e, s);
    } else {
      for (int64_t i = 0; i < e; ++i) s[i] = Sigmoid(l[i]);
    }
  }

  // Selection scores.
  std::vector<double> sel(out.scores);
  if (c.sinkhorn && n > 0) {
    RDEP_ASSIGN_OR_RETURN(sel, Sinkhorn(logits, n, e, c.sinkhorn_tolerance, c.sinkhorn_max_iters));
  } else if (!bias.empty()) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < e; ++i) sel[Idx(t * e + i)] += static_cast<double>(bias[Idx(i)]);
  }

  // Expert sets for the group and node limits.
  std::vector<std::vector<int32_t>> groups, nodes;
  if (c.num_groups > 1) {
    const int64_t gs = e / c.num_groups;
    groups.resize(Idx(c.num_groups));
    for (int64_t i = 0; i < e; ++i) groups[Idx(i / gs)].push_back(static_cast<int32_t>(i));
  }
  if (c.max_nodes > 0) {
    const auto max_node = *std::max_element(c.node_of_expert.begin(), c.node_of_expert.end());
    nodes.resize(Idx(max_node + 1));
    for (int64_t i = 0; i < e; ++i) nodes[Idx(c.node_of_expert[Idx(i)])].push_back(static_cast<int32_t>(i));
  }

  out.routing.num_tokens = n;
  out.routing.topk = k;
  out.routing.experts.resize(Idx(n * k));
  out.routing.gates.resize(Idx(n * k));
  out.gates_f64.resize(Idx(n * k));
  out.tokens_per_expert.assign(Idx(e), 0);
  std::vector<char> allowed(Idx(e));
  std::vector<int32_t> ids(Idx(e));
  for (int64_t t = 0; t < n; ++t) {
    const double* st = &sel[Idx(t * e)];
    std::fill(allowed.begin(), allowed.end(), 1);
    if (!groups.empty()) KeepBestSets(groups, c.topk_groups, st, allowed);
    if (!nodes.empty()) KeepBestSets(nodes, c.max_nodes, st, allowed);
    ids.clear();
    for (int64_t i = 0; i < e; ++i)
      if (allowed[Idx(i)]) ids.push_back(static_cast<int32_t>(i));
    if (static_cast<int64_t>(ids.size()) < k)
      return InvalidArgument("router: token " + std::to_string(t) + " keeps only " + std::to_string(ids.size()) +
                             " experts after the group/node limits, fewer than topk = " + std::to_string(k));
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [st](int32_t a, int32_t b) {
      if (st[a] != st[b]) return st[a] > st[b];
      return a < b;
    });
    const double* s = &out.scores[Idx(t * e)];
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += s[ids[Idx(j)]];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t ex = ids[Idx(j)];
      double g = s[ex];
      if (c.normalize_topk) g /= sum;
      g *= c.scaling_factor;
      out.routing.experts[Idx(t * k + j)] = ex;
      out.gates_f64[Idx(t * k + j)] = g;
      out.routing.gates[Idx(t * k + j)] = static_cast<float>(g);
      out.tokens_per_expert[Idx(ex)] += 1;
    }
  }

  // Losses.
  if (n > 0 && (c.aux_loss_coeff != 0 || c.seq_aux_loss_coeff != 0)) {
    const std::vector<double> p = AuxProbs(c, out.scores, n);
    const double de = static_cast<double>(e), dk = static_cast<double>(k), dn = static_cast<double>(n);
    if (c.aux_loss_coeff != 0) {
      double acc = 0;
      for (int64_t i = 0; i < e; ++i) {
        double pe = 0;
        for (int64_t t = 0; t < n; ++t) pe += p[Idx(t * e + i)];
        acc += static_cast<double>(out.tokens_per_expert[Idx(i)]) * pe;
      }
      out.losses.aux = c.aux_loss_coeff * de * acc / (dn * dn * dk);
    }
    if (c.seq_aux_loss_coeff != 0) {
      const int64_t sl = c.seq_length, m = n / sl;
      const double ds = static_cast<double>(sl);
      double total = 0;
      std::vector<double> cnt(Idx(e)), pe(Idx(e));
      for (int64_t j = 0; j < m; ++j) {
        std::fill(cnt.begin(), cnt.end(), 0.0);
        std::fill(pe.begin(), pe.end(), 0.0);
        for (int64_t t = j * sl; t < (j + 1) * sl; ++t) {
          for (int64_t q = 0; q < k; ++q) cnt[Idx(out.routing.experts[Idx(t * k + q)])] += 1;
          for (int64_t i = 0; i < e; ++i) pe[Idx(i)] += p[Idx(t * e + i)];
        }
        double acc = 0;
        for (int64_t i = 0; i < e; ++i) acc += cnt[Idx(i)] * pe[Idx(i)];
        total += de * acc / (ds * ds * dk);
      }
      out.losses.seq_aux = c.seq_aux_loss_coeff * total / static_cast<double>(m);
    }
  }
  if (n > 0 && c.z_loss_coeff != 0) {
    double acc = 0;
    for (int64_t t = 0; t < n; ++t) {
      const double lse = LogSumExp(&logits[Idx(t * e)], e);
      acc += lse * lse;
    }
    out.losses.z = c.z_loss_coeff * acc / static_cast<double>(n);
  }
  return out;
}

}  // namespace

const char* ScoreFunctionName(ScoreFunction f) { return f == ScoreFunction::kSoftmax ? "softmax" : "sigmoid"; }

int64_t RouterConfig::num_nodes() const {
  if (max_nodes <= 0 || node_of_expert.empty()) return 0;
  return static_cast<int64_t>(std::set<int32_t>(node_of_expert.begin(), node_of_expert.end()).size());
}

Status RouterConfig::Validate() const {
  const std::string p = "router config: ";
  if (num_experts <= 0) return InvalidArgument(p + "num_experts must be > 0, got " + std::to_string(num_experts));
  if (topk <= 0) return InvalidArgument(p + "topk must be > 0, got " + std::to_string(topk));
  if (topk > num_experts)
    return InvalidArgument(p + "topk (" + std::to_string(topk) + ") exceeds num_experts (" +
                           std::to_string(num_experts) + ")");
  if (!std::isfinite(scaling_factor) || scaling_factor <= 0)
    return InvalidArgument(p + "scaling_factor must be finite and > 0");
  if (num_groups <= 0) return InvalidArgument(p + "num_groups must be >= 1, got " + std::to_string(num_groups));
  if (num_experts % num_groups != 0)
    return InvalidArgument(p + "num_groups (" + std::to_string(num_groups) + ") does not divide num_experts (" +
                           std::to_string(num_experts) + ")");
  if (topk_groups <= 0 || topk_groups > num_groups)
    return InvalidArgument(p + "topk_groups must be in [1, num_groups=" + std::to_string(num_groups) + "], got " +
                           std::to_string(topk_groups));
  if (num_groups > 1 && topk > topk_groups * (num_experts / num_groups))
    return InvalidArgument(p + "topk (" + std::to_string(topk) + ") exceeds the experts in topk_groups kept groups (" +
                           std::to_string(topk_groups * (num_experts / num_groups)) + ")");
  if (max_nodes < 0) return InvalidArgument(p + "max_nodes must be >= 0 (0 = off), got " + std::to_string(max_nodes));
  if (max_nodes > 0) {
    if (static_cast<int64_t>(node_of_expert.size()) != num_experts)
      return InvalidArgument(p + "node-limited routing needs node_of_expert with num_experts (" +
                             std::to_string(num_experts) + ") entries, got " + std::to_string(node_of_expert.size()));
    for (size_t i = 0; i < node_of_expert.size(); ++i)
      if (node_of_expert[i] < 0)
        return InvalidArgument(p + "node_of_expert[" + std::to_string(i) + "] is negative");
    const int64_t nn = num_nodes();
    if (max_nodes > nn)
      return InvalidArgument(p + "max_nodes (" + std::to_string(max_nodes) + ") is larger than the number of nodes (" +
                             std::to_string(nn) + ")");
    // Worst case: the kept nodes are the smallest ones.
    std::vector<int64_t> sizes(Idx(*std::max_element(node_of_expert.begin(), node_of_expert.end()) + 1), 0);
    for (int32_t nd : node_of_expert) sizes[Idx(nd)] += 1;
    sizes.erase(std::remove(sizes.begin(), sizes.end(), 0), sizes.end());
    std::sort(sizes.begin(), sizes.end());
    const int64_t fit = std::accumulate(sizes.begin(), sizes.begin() + max_nodes, int64_t{0});
    if (fit < topk)
      return InvalidArgument(p + "topk (" + std::to_string(topk) + ") exceeds the experts on the " +
                             std::to_string(max_nodes) + " smallest nodes (" + std::to_string(fit) +
                             "); raise max_nodes");
  }
  if (sinkhorn && (!(sinkhorn_tolerance > 0) || sinkhorn_max_iters <= 0))
    return InvalidArgument(p + "sinkhorn needs sinkhorn_tolerance > 0 and sinkhorn_max_iters > 0");
  if (!std::isfinite(aux_loss_coeff) || aux_loss_coeff < 0)
    return InvalidArgument(p + "aux_loss_coeff must be finite and >= 0");
  if (!std::isfinite(seq_aux_loss_coeff) || seq_aux_loss_coeff < 0)
    return InvalidArgument(p + "seq_aux_loss_coeff must be finite and >= 0");
  if (!std::isfinite(z_loss_coeff) || z_loss_coeff < 0) return InvalidArgument(p + "z_loss_coeff must be finite and >= 0");
  if (seq_aux_loss_coeff > 0 && seq_length <= 0)
    return InvalidArgument(p + "seq_aux_loss_coeff > 0 needs seq_length > 0 (tokens per sequence)");
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const RouterConfig& c) {
  os << "RouterConfig{E=" << c.num_experts << " K=" << c.topk << " score=" << ScoreFunctionName(c.score_function)
     << " normalize_topk=" << (c.normalize_topk ? "yes" : "no") << " scale=" << c.scaling_factor;
  if (c.num_groups > 1) os << " groups=" << c.topk_groups << "/" << c.num_groups;
  if (c.max_nodes > 0) os << " max_nodes=" << c.max_nodes << "/" << c.num_nodes();
  if (c.sinkhorn) os << " sinkhorn(tol=" << c.sinkhorn_tolerance << ")";
  if (c.aux_loss_coeff > 0) os << " aux=" << c.aux_loss_coeff;
  if (c.seq_aux_loss_coeff > 0) os << " seq_aux=" << c.seq_aux_loss_coeff << "@" << c.seq_length;
  if (c.z_loss_coeff > 0) os << " z=" << c.z_loss_coeff;
  return os << "}";
}

std::ostream& operator<<(std::ostream& os, const RouterLosses& l) {
  return os << "aux=" << l.aux << " seq_aux=" << l.seq_aux << " z=" << l.z << " total=" << l.total();
}

StatusOr<std::vector<int32_t>> ExpertNodeMap(const OwnershipMap& ownership, int64_t ranks_per_node) {
  const int64_t w = ownership.num_ranks();
  if (ranks_per_node <= 0)
    return InvalidArgument("ranks_per_node must be > 0, got " + std::to_string(ranks_per_node));
  if (w % ranks_per_node != 0)
    return InvalidArgument("ranks_per_node (" + std::to_string(ranks_per_node) + ") does not divide the ranks (" +
                           std::to_string(w) + ")");
  std::vector<int32_t> node(Idx(ownership.num_experts()));
  for (int32_t e = 0; e < ownership.num_experts(); ++e)
    node[Idx(e)] = static_cast<int32_t>(ownership.owner(e) / ranks_per_node);
  return node;
}

StatusOr<RouterOutput> Route(const RouterConfig& config, std::span<const float> logits, int64_t num_tokens,
                             std::span<const float> expert_bias) {
  return RouteImpl<float>(config, logits, num_tokens, expert_bias);
}

StatusOr<RouterOutput> RouteF64(const RouterConfig& config, std::span<const double> logits, int64_t num_tokens,
                                std::span<const float> expert_bias) {
  return RouteImpl<double>(config, logits, num_tokens, expert_bias);
}

StatusOr<std::vector<double>> RouterBackward(const RouterConfig& c, std::span<const double> logits, int64_t n,
                                             const RouterOutput& fwd, std::span<const float> dgates) {
  RDEP_RETURN_IF_ERROR(c.Validate());
  const int64_t e = c.num_experts, k = c.topk;
  if (n < 0 || static_cast<int64_t>(logits.size()) != n * e)
    return InvalidArgument("router backward: logits has " + std::to_string(logits.size()) +
                           " values, expected num_tokens*E = " + std::to_string(n) + "*" + std::to_string(e));
  if (fwd.routing.num_tokens != n || static_cast<int64_t>(fwd.scores.size()) != n * e ||
      static_cast<int64_t>(fwd.routing.experts.size()) != n * k)
    return InvalidArgument("router backward: the forward output does not match num_tokens=" + std::to_string(n) +
                           ", E=" + std::to_string(e) + ", K=" + std::to_string(k));
  if (!dgates.empty() && static_cast<int64_t>(dgates.size()) != n * k)
    return InvalidArgument("router backward: dgates has " + std::to_string(dgates.size()) +
                           " values, expected num_tokens*K = " + std::to_string(n * k));

  std::vector<double> dl(Idx(n * e), 0.0);
  const std::vector<double>& s = fwd.scores;
  // dL/ds from the gates, then through the score function.
  if (!dgates.empty()) {
    std::vector<double> ds(Idx(e));
    for (int64_t t = 0; t < n; ++t) {
      std::fill(ds.begin(), ds.end(), 0.0);
      const double* st = &s[Idx(t * e)];
      const int32_t* ex = &fwd.routing.experts[Idx(t * k)];
      if (c.normalize_topk) {
        double z = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) z += st[ex[j]];
        for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(dgates[Idx(t * k + j)]) * st[ex[j]];
        for (int64_t j = 0; j < k; ++j)
          ds[Idx(ex[j])] = c.scaling_factor * (static_cast<double>(dgates[Idx(t * k + j)]) / z - dot / (z * z));
      } else {
        for (int64_t j = 0; j < k; ++j) ds[Idx(ex[j])] = c.scaling_factor * static_cast<double>(dgates[Idx(t * k + j)]);
      }
      double* d = &dl[Idx(t * e)];
      if (c.score_function == ScoreFunction::kSoftmax) {
        double dot = 0;
        for (int64_t i = 0; i < e; ++i) dot += st[i] * ds[Idx(i)];
        for (int64_t i = 0; i < e; ++i) d[i] += st[i] * (ds[Idx(i)] - dot);
      } else {
        for (int64_t i = 0; i < e; ++i) d[i] += ds[Idx(i)] * st[i] * (1 - st[i]);
      }
    }
  }

  // Aux losses: dL/dp_t,e, then through the aux probabilities.
  if (n > 0 && (c.aux_loss_coeff != 0 || c.seq_aux_loss_coeff != 0)) {
    const double de = static_cast<double>(e), dk = static_cast<double>(k), dn = static_cast<double>(n);
    std::vector<double> dp(Idx(n * e), 0.0);
    if (c.aux_loss_coeff != 0) {
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < e; ++i)
          dp[Idx(t * e + i)] += c.aux_loss_coeff * de * static_cast<double>(fwd.tokens_per_expert[Idx(i)]) / (dn * dn * dk);
    }
    if (c.seq_aux_loss_coeff != 0) {
      const int64_t sl = c.seq_length, m = n / sl;
      const double ds = static_cast<double>(sl);
      std::vector<double> cnt(Idx(e));
      for (int64_t j = 0; j < m; ++j) {
        std::fill(cnt.begin(), cnt.end(), 0.0);
        for (int64_t t = j * sl; t < (j + 1) * sl; ++t)
          for (int64_t q = 0; q < k; ++q) cnt[Idx(fwd.routing.experts[Idx(t * k + q)])] += 1;
        for (int64_t t = j * sl; t < (j + 1) * sl; ++t)
          for (int64_t i = 0; i < e; ++i)
            dp[Idx(t * e + i)] += c.seq_aux_loss_coeff / static_cast<double>(m) * de * cnt[Idx(i)] / (ds * ds * dk);
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const double* st = &s[Idx(t * e)];
      const double* dpt = &dp[Idx(t * e)];
      double* d = &dl[Idx(t * e)];
      if (c.score_function == ScoreFunction::kSoftmax) {
        double dot = 0;
        for (int64_t i = 0; i < e; ++i) dot += st[i] * dpt[i];
        for (int64_t i = 0; i < e; ++i) d[i] += st[i] * (dpt[i] - dot);
      } else {
        // p = sigma / sum(sigma): dsigma_i = (dp_i - sum_j dp_j p_j) / sum(sigma).
        double sum = 0, dot = 0;
        for (int64_t i = 0; i < e; ++i) sum += st[i];
        for (int64_t i = 0; i < e; ++i) dot += dpt[i] * st[i] / sum;
        for (int64_t i = 0; i < e; ++i) d[i] += (dpt[i] - dot) / sum * st[i] * (1 - st[i]);
      }
    }
  }
  if (n > 0 && c.z_loss_coeff != 0) {
    std::vector<double> p(Idx(e));
    for (int64_t t = 0; t < n; ++t) {
      const double* l = &logits[Idx(t * e)];
      const double lse = LogSumExp(l, e);
      Softmax(l, e, p.data());
      for (int64_t i = 0; i < e; ++i)
        dl[Idx(t * e + i)] += c.z_loss_coeff * 2.0 * lse * p[Idx(i)] / static_cast<double>(n);
    }
  }
  return dl;
}

Status UpdateExpertBias(std::vector<float>& bias, std::span<const int64_t> loads, double rate) {
  if (bias.size() != loads.size())
    return InvalidArgument("expert bias update: bias has " + std::to_string(bias.size()) + " entries but loads has " +
                           std::to_string(loads.size()));
  if (!std::isfinite(rate) || rate < 0) return InvalidArgument("expert bias update: rate must be finite and >= 0");
  if (loads.empty()) return Status::Ok();
  double mean = 0;
  for (int64_t x : loads) mean += static_cast<double>(x);
  mean /= static_cast<double>(loads.size());
  for (size_t i = 0; i < bias.size(); ++i) {
    const double diff = mean - static_cast<double>(loads[i]);
    const double sign = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
    bias[i] = static_cast<float>(static_cast<double>(bias[i]) + rate * sign);
  }
  return Status::Ok();
}

StatusOr<std::vector<double>> Sinkhorn(std::span<const double> cost, int64_t rows, int64_t cols, double tolerance,
                                       int64_t max_iters) {
  if (rows <= 0 || cols <= 0)
    return InvalidArgument("sinkhorn: rows and cols must be > 0, got " + std::to_string(rows) + "x" + std::to_string(cols));
  if (static_cast<int64_t>(cost.size()) != rows * cols)
    return InvalidArgument("sinkhorn: cost has " + std::to_string(cost.size()) + " values, expected rows*cols");
  if (!(tolerance > 0) || max_iters <= 0) return InvalidArgument("sinkhorn: tolerance and max_iters must be > 0");
  // exp(cost - max): the normalized result is invariant to a global scale, and this cannot overflow.
  double mx = kNegInf;
  for (double x : cost) {
    if (!std::isfinite(x)) return InvalidArgument("sinkhorn: cost has a non-finite entry");
    mx = std::max(mx, x);
  }
  std::vector<double> m(cost.size());
  for (size_t i = 0; i < cost.size(); ++i) m[i] = std::exp(cost[i] - mx);
  constexpr double kEps = 1e-300;
  std::vector<double> d0(Idx(rows), 1.0), d1(Idx(cols), 1.0), d1_old(d1);
  const double inv_r = 1.0 / static_cast<double>(rows), inv_c = 1.0 / static_cast<double>(cols);
  for (int64_t it = 0; it < max_iters; ++it) {
    for (int64_t r = 0; r < rows; ++r) {
      double acc = 0;
      for (int64_t q = 0; q < cols; ++q) acc += d1[Idx(q)] * m[Idx(r * cols + q)];
      d0[Idx(r)] = inv_r / (acc + kEps);
    }
    std::vector<double> acc(Idx(cols), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t q = 0; q < cols; ++q) acc[Idx(q)] += d0[Idx(r)] * m[Idx(r * cols + q)];
    double err = 0, mag = 0;
    for (int64_t q = 0; q < cols; ++q) {
      d1[Idx(q)] = inv_c / (acc[Idx(q)] + kEps);
      err += std::abs(d1[Idx(q)] - d1_old[Idx(q)]);
      mag += std::abs(d1[Idx(q)]);
    }
    d1_old = d1;
    if (err <= tolerance * mag) break;  // relative change of the column scale
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t q = 0; q < cols; ++q) m[Idx(r * cols + q)] *= d0[Idx(r)] * d1[Idx(q)];
  return m;
}

}  // namespace rdep
