#include "rdep/core/capacity.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "rdep/core/capacity_rules.h"

namespace rdep {

Status CapacityPolicy::Validate() const {
  if (!std::isfinite(capacity_factor) || capacity_factor < 0) {
    std::ostringstream os;
    os << "capacity factor must be finite and >= 0 (0 = dropless), got " << capacity_factor;
    return InvalidArgument(os.str());
  }
  return Status::Ok();
}

int64_t CapacityPolicy::ExpertCapacity(const LayerShape& shape) const {
  if (dropless()) return std::numeric_limits<int64_t>::max();
  const double c = std::ceil(capacity_factor * static_cast<double>(shape.total_rows()) / static_cast<double>(shape.experts));
  return c >= 9.0e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(c);
}

void AdmitBySourceOrder(const int64_t* counts, int64_t num_src, int64_t capacity, int64_t* admitted) {
  SourceOrderAdmission admission{capacity};
  for (int64_t s = 0; s < num_src; ++s) admitted[s] = admission.Admit(counts[s]);
}

void RenormalizeGates(const float* g, const uint8_t* acc, int64_t K, float* out) {
  RenormalizeTokenGates(g, acc, K, out);
}

void RenormalizeGatesBackward(const float* g, const uint8_t* acc, int64_t K, const double* dg_eff, double* dg) {
  RenormalizeTokenGatesBackward(g, acc, K, dg_eff, dg);
}

StatusOr<std::vector<RankAcceptance>> ApplyCapacity(const LayerShape& shape, const Routing& routing,
                                                    const CapacityPolicy& policy) {
  RDEP_RETURN_IF_ERROR(shape.Validate());
  RDEP_RETURN_IF_ERROR(policy.Validate());
  if (routing.size() != static_cast<size_t>(shape.ranks))
    return InvalidArgument("routing has " + std::to_string(routing.size()) + " ranks, shape has W=" + std::to_string(shape.ranks));
  for (const auto& rr : routing) RDEP_RETURN_IF_ERROR(rr.Validate(shape));
  const int64_t K = shape.topk, E = shape.experts, W = shape.ranks;
  const int64_t cap = policy.ExpertCapacity(shape);
  // Rows admitted so far per expert, walking sources (then tokens, then slots) in row_id order.
  std::vector<int64_t> used(static_cast<size_t>(E), 0);
  std::vector<RankAcceptance> out(static_cast<size_t>(W));
  for (int64_t r = 0; r < W; ++r) {
    const RankRouting& rr = routing[static_cast<size_t>(r)];
    RankAcceptance& a = out[static_cast<size_t>(r)];
    const auto n = static_cast<size_t>(rr.num_tokens * K);
    a.accepted.assign(n, 0);
    a.effective_gates.assign(n, 0.f);
    for (size_t i = 0; i < n; ++i) {
      auto& u = used[static_cast<size_t>(rr.experts[i])];
      if (u < cap) {
        a.accepted[i] = 1;
        ++u;
      } else {
        ++a.dropped;
      }
    }
    for (int64_t t = 0; t < rr.num_tokens; ++t)
      RenormalizeGates(rr.gates.data() + t * K, a.accepted.data() + t * K, K, a.effective_gates.data() + t * K);
  }
  return out;
}

}  // namespace rdep
