#include "testing/balance_checks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <sstream>

#include "rdep/balance/layer_balance.h"

namespace rdep {

StatusOr<RowPlacement> ExpectedPlacement(const LayerConfig& cfg, const OwnershipMap& own, const Routing& routing,
                                         const std::vector<RankAcceptance>& reference) {
  const LayerShape& s = cfg.shape;
  const auto W = static_cast<size_t>(s.ranks), E = static_cast<size_t>(s.experts);
  const int32_t slot_base = std::max(1, own.max_local()), slots = cfg.replica_slots();
  std::optional<BalancePlan> plan;
  if (cfg.balance.enabled()) {
    std::vector<int64_t> admitted(W * E, 0);
    for (size_t r = 0; r < W; ++r)
      for (size_t i = 0; i < routing[r].experts.size(); ++i)
        if (reference[r].accepted[i]) ++admitted[r * E + static_cast<size_t>(routing[r].experts[i])];
    RDEP_ASSIGN_OR_RETURN(plan, SolveLayerPlan(cfg.balance, admitted, own, {}));
  }
  RowPlacement p;
  p.rank.resize(W), p.local.resize(W), p.expert_at.resize(W);
  for (size_t q = 0; q < W; ++q) {
    auto& at = p.expert_at[q];
    at.assign(static_cast<size_t>(plan ? slot_base + slots : own.num_local(static_cast<int32_t>(q))), -1);
    for (int32_t j = 0; j < own.num_local(static_cast<int32_t>(q)); ++j) at[static_cast<size_t>(j)] = own.global_expert(static_cast<int32_t>(q), j);
    if (plan)
      for (int32_t sl = 0; sl < slots; ++sl)
        at[static_cast<size_t>(slot_base + sl)] = plan->slot_expert[q * static_cast<size_t>(slots) + static_cast<size_t>(sl)];
  }
  for (size_t r = 0; r < W; ++r) {
    const size_t n = routing[r].experts.size();
    p.rank[r].assign(n, -1);
    p.local[r].assign(n, -1);
    std::vector<int64_t> taken(E, 0);
    for (size_t i = 0; i < n; ++i) {
      if (!reference[r].accepted[i]) continue;
      const int32_t e = routing[r].experts[i];
      const int64_t j = taken[static_cast<size_t>(e)]++;
      if (!plan) {
        p.rank[r][i] = own.owner(e);
        p.local[r][i] = own.local_index(e);
        continue;
      }
      const int32_t inst = InstanceForRow(*plan, static_cast<int32_t>(r), e, j);
      if (inst < 0) return InternalError("expected placement: the plan has no instance for a row of expert " + std::to_string(e));
      const int32_t slot = plan->instance_slot[static_cast<size_t>(inst)];
      p.rank[r][i] = plan->instance_rank[static_cast<size_t>(inst)];
      p.local[r][i] = slot < 0 ? own.local_index(e) : slot_base + slot;
    }
  }
  return p;
}

namespace {

bool Bitwise(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t r = 0; r < a.size(); ++r)
    if (a[r].size() != b[r].size() || (!a[r].empty() && std::memcmp(a[r].data(), b[r].data(), a[r].size() * sizeof(float)) != 0))
      return false;
  return true;
}

// Per expert: bitwise unless replicated; replicated ones within 1e-5 of the tensor's max |value|
// plus 1e-5 relative. Returns the largest |diff| / max|off| seen and counts experts by kind.
bool GradsMatch(const std::vector<float>& on, const std::vector<float>& off, size_t per_expert, const std::vector<int32_t>& instances,
                double* worst, int* replicated, int* exact) {
  if (on.size() != off.size() || per_expert == 0 || instances.size() * per_expert != off.size()) return false;
  float scale = 0;
  for (float v : off) scale = std::max(scale, std::abs(v));
  bool ok = true;
  for (size_t e = 0; e < instances.size(); ++e) {
    const float* a = on.data() + e * per_expert;
    const float* b = off.data() + e * per_expert;
    if (instances[e] <= 1) {
      ++*exact;
      ok &= std::memcmp(a, b, per_expert * sizeof(float)) == 0;
      continue;
    }
    ++*replicated;
    for (size_t c = 0; c < per_expert; ++c) {
      const float d = std::abs(a[c] - b[c]);
      ok &= d <= 1e-5f * scale + 1e-5f * std::abs(b[c]);
      if (scale > 0) *worst = std::max(*worst, static_cast<double>(d / scale));
    }
  }
  return ok;
}

// Sums of (a - b)^2 and b^2 over n values, added to num and den.
void AddSquares(const float* a, const float* b, size_t n, double* num, double* den) {
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    *num += d * d;
    *den += static_cast<double>(b[i]) * b[i];
  }
}

// sqrt(num / den): 0 when both are zero, +inf on a NaN or when only num is nonzero.
double Ratio(double num, double den) {
  if (std::isnan(num) || std::isnan(den)) return INFINITY;
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// ||a - b|| / ||b|| over the ranks' values (+inf on a size mismatch).
double RelL2(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t r = 0; r < a.size(); ++r) {
    if (a[r].size() != b[r].size()) return INFINITY;
    AddSquares(a[r].data(), b[r].data(), b[r].size(), &num, &den);
  }
  return Ratio(num, den);
}

// Per expert: ||on_e - off_e|| / ||off_e|| <= rel_l2 (on_e bitwise zero where off_e is zero); the
// largest ratio seen goes to *worst.
bool GradsWithin(const std::vector<float>& on, const std::vector<float>& off, size_t per_expert, double rel_l2, double* worst) {
  if (on.size() != off.size() || per_expert == 0 || off.size() % per_expert != 0) return false;
  bool ok = true;
  for (size_t at = 0; at < off.size(); at += per_expert) {
    double num = 0, den = 0;
    AddSquares(on.data() + at, off.data() + at, per_expert, &num, &den);
    const double r = Ratio(num, den);
    *worst = std::max(*worst, r);
    ok &= r <= rel_l2;
  }
  return ok;
}

// The bf16 backends' form of BalancingExactness (rel_l2 > 0).
CheckResult BalancingWithinTolerance(const LayerRun& on, const LayerRun& off, const LayerShape& s, double rel_l2) {
  CheckResult c{"balancing exactness", false, false, "", 0};
  std::ostringstream os, exact;
  const std::pair<const char*, double> acts[] = {{"y", RelL2(on.y, off.y)}, {"dx", RelL2(on.dx, off.dx)}, {"dgates", RelL2(on.dgates, off.dgates)}};
  const bool bitwise[] = {Bitwise(on.y, off.y), Bitwise(on.dx, off.dx), Bitwise(on.dgates, off.dgates)};
  double worst_w = 0;
  const bool w1 = GradsWithin(on.dw1, off.dw1, static_cast<size_t>(2 * s.hidden * s.ffn), rel_l2, &worst_w);
  const bool w2 = GradsWithin(on.dw2, off.dw2, static_cast<size_t>(s.ffn * s.hidden), rel_l2, &worst_w);
  double worst_a = 0;
  for (size_t i = 0; i < 3; ++i) {
    worst_a = std::max(worst_a, acts[i].second);
    if (!(acts[i].second <= rel_l2) && os.str().empty())
      os << acts[i].first << " differs from the layer without balancing: ||on-off||/||off|| " << acts[i].second << " > " << rel_l2;
    if (bitwise[i]) exact << (exact.str().empty() ? "" : ", ") << acts[i].first;
  }
  if (os.str().empty() && !(w1 && w2))
    os << (w1 ? "dW2" : "dW1") << " of some expert differs from the layer without balancing (worst ||on-off||/||off|| " << worst_w << " > "
       << rel_l2 << ")";
  c.passed = os.str().empty();
  if (c.passed)
    os << "y, dx, dgate within " << worst_a << ", every expert's dW within " << worst_w << " of balancing off (relative L2, passes <= "
       << rel_l2 << "); bitwise equal: " << (exact.str().empty() ? "none" : exact.str());
  c.detail = os.str();
  return c;
}

}  // namespace

CheckResult BalancingExactness(const LayerRun& on, const LayerRun& off, const LayerShape& s, double rel_l2, double yx_rel_l2) {
  if (rel_l2 > 0) return BalancingWithinTolerance(on, off, s, rel_l2);
  CheckResult c{"balancing exactness", false, false, "", 0};
  const auto same = [&](const auto& a, const auto& b) { return yx_rel_l2 > 0 ? RelL2(a, b) <= yx_rel_l2 : Bitwise(a, b); };
  std::string bad;
  if (!same(on.y, off.y)) bad = "y";
  else if (!same(on.dx, off.dx)) bad = "dx";
  else if (!Bitwise(on.dgates, off.dgates)) bad = "dgates";
  double worst = 0;
  int replicated = 0, exact = 0, unused_r = 0, unused_e = 0;
  const auto n1 = static_cast<size_t>(2 * s.hidden * s.ffn), n2 = static_cast<size_t>(s.ffn * s.hidden);
  const bool w1 = GradsMatch(on.dw1, off.dw1, n1, on.instances, &worst, &replicated, &exact);
  const bool w2 = GradsMatch(on.dw2, off.dw2, n2, on.instances, &worst, &unused_r, &unused_e);
  if (bad.empty() && !w1) bad = "dW1";
  if (bad.empty() && !w2) bad = "dW2";
  std::ostringstream os;
  if (!bad.empty()) {
    os << bad << " differs from the layer without balancing";
  } else {
    if (yx_rel_l2 > 0)
      os << "y, dx within " << std::max(RelL2(on.y, off.y), RelL2(on.dx, off.dx)) << " (relative L2, passes <= " << yx_rel_l2
         << "), dgate bitwise equal to balancing off; dW bitwise for " << exact << " experts, for the " << replicated;
    else
      os << "y, dx, dgate bitwise equal to balancing off; dW bitwise for " << exact << " experts, for the " << replicated
       << " replicated within 1e-5 (max |diff|/max|dW| " << worst << ")";
  }
  c.passed = bad.empty();
  c.detail = os.str();
  return c;
}

}  // namespace rdep

namespace rdep {

std::vector<int32_t> NodeOfExpert(const OwnershipMap& own, const LayerConfig& cfg) {
  const int32_t G = cfg.nodes.ranks_per_node(cfg.shape.ranks);
  std::vector<int32_t> node(static_cast<size_t>(own.num_experts()));
  for (int32_t e = 0; e < own.num_experts(); ++e) node[static_cast<size_t>(e)] = own.owner(e) / G;
  return node;
}

CheckResult TwoPhaseTrafficCheck(const std::vector<NodeTraffic>& measured, const std::vector<model::RankPhaseTraffic>& predicted) {
  CheckResult c{"two-phase traffic = rdep model", false, false, "", 0};
  std::vector<model::RankPhaseTraffic> counts;
  for (const auto& t : measured) counts.push_back(t.Counts());
  c.detail = model::FirstTrafficMismatch(counts, predicted);
  c.passed = c.detail.empty();
  if (c.passed) c.detail = "rows and bytes of 4 phases on " + std::to_string(measured.size()) + " ranks equal the prediction for this routing";
  return c;
}

namespace {

// max |a - b| / max |b| over the ranks' concatenated values (0 when b is all zero and a equals it).
double MaxRelative(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double scale = 0, worst = 0;
  for (const auto& v : b)
    for (float x : v) scale = std::max(scale, static_cast<double>(std::abs(x)));
  for (size_t r = 0; r < a.size() && r < b.size(); ++r) {
    if (a[r].size() != b[r].size()) return INFINITY;
    for (size_t i = 0; i < a[r].size(); ++i) {
      const double d = std::abs(static_cast<double>(a[r][i]) - b[r][i]);
      if (std::isnan(d)) return INFINITY;
      worst = std::max(worst, d);
    }
  }
  return scale > 0 ? worst / scale : worst;
}

}  // namespace

CheckResult NodeAgreement(const LayerRun& two, const LayerRun& one, int64_t expected_inter_rows, double value_tol) {
  CheckResult c{"two-phase vs one domain", false, false, "", 0};
  std::ostringstream os;
  int64_t sent = 0, back = 0;
  for (const auto& t : two.traffic) {
    sent += t.inter_dispatch_rows;
    back += t.inter_combine_rows;
  }
  const double ey = MaxRelative(two.y, one.y), edx = MaxRelative(two.dx, one.dx);
  if (!Bitwise(two.dgates, one.dgates)) os << "dgates differ from the one-domain layer";
  else if (two.dw1 != one.dw1 || two.dw2 != one.dw2) os << "weight gradients differ from the one-domain layer";
  else if (!(ey <= value_tol) || !(edx <= value_tol))
    os << "y or dx beyond " << value_tol << " of the one-domain layer's (y " << ey << ", dx " << edx << ")";
  else if (sent != expected_inter_rows || back != expected_inter_rows)
    os << "inter-node rows: dispatch sent " << sent << ", combine returned " << back << ", the routing has " << expected_inter_rows;
  c.passed = os.str().empty();
  if (c.passed)
    os << "dgate, dW bitwise; y, dx within " << std::max(ey, edx) << " of max (<= " << value_tol << "); inter-node rows " << sent
       << " = one per (token, remote node) of the routing";
  c.detail = os.str();
  return c;
}

}  // namespace rdep
