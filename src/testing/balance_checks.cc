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

}  // namespace

CheckResult BalancingExactness(const LayerRun& on, const LayerRun& off, const LayerShape& s) {
  CheckResult c{"balancing exactness", false, false, "", 0};
  std::string bad;
  if (!Bitwise(on.y, off.y)) bad = "y";
  else if (!Bitwise(on.dx, off.dx)) bad = "dx";
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
    os << "y, dx, dgate bitwise equal to balancing off; dW bitwise for " << exact << " experts, for the " << replicated
       << " replicated within 1e-5 (max |diff|/max|dW| " << worst << ")";
  }
  c.passed = bad.empty();
  c.detail = os.str();
  return c;
}

}  // namespace rdep
