// Rules of a valid routing slot, one definition for host and device code: the host backend's and
// the reference's input validation (RankRouting::Validate) and the CUDA layer's device-side check
// before phase 1 (dispatch::LaunchValidateRouting) both call CheckRouteSlot, in the same order, so
// both name the same first fault for the same input. The protocol's other shared rules: route-row
// identity in rdep/core/row_id.h, admission and gate renormalization in rdep/core/capacity_rules.h.
#pragma once

#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define RDEP_HOST_DEVICE __host__ __device__
#else
#define RDEP_HOST_DEVICE
#endif

namespace rdep {

enum class RouteSlotFault : uint32_t {
  kNone = 0,
  kExpertOutOfRange = 1,  // expert id outside [0, E)
  kBadGate = 2,           // gate negative, NaN or infinite
  kRepeatedExpert = 3,    // an earlier slot of the same token chose the same expert
};

// Slot k of one token (its K expert ids and gates at token_experts / token_gates). Checks in this
// order: range, gate, repeat (against slots 0..k-1).
RDEP_HOST_DEVICE inline RouteSlotFault CheckRouteSlot(const int32_t* token_experts, const float* token_gates, int64_t k,
                                                      int64_t num_experts) {
  const int32_t e = token_experts[k];
  if (e < 0 || e >= num_experts) return RouteSlotFault::kExpertOutOfRange;
  const float g = token_gates[k];
  if (!(g >= 0.f) || g > 3.4028234663852886e38f) return RouteSlotFault::kBadGate;  // NaN fails g >= 0
  for (int64_t j = 0; j < k; ++j)
    if (token_experts[j] == e) return RouteSlotFault::kRepeatedExpert;
  return RouteSlotFault::kNone;
}

// "token 3 slot 1: expert 64 outside [0, E=64)" and the like, for an error message.
std::string DescribeRouteSlotFault(RouteSlotFault fault, int64_t token, int64_t slot, int32_t expert, float gate,
                                   int64_t num_experts);

}  // namespace rdep
