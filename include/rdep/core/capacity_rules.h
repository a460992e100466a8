// The capacity rules of the protocol, one inline definition each, callable from host and device
// code (the rule itself is stated in rdep/core/capacity.h):
//   SourceOrderAdmission      owner admission: capacity handed out to sources in source order
//   RenormalizeTokenGates     one token's effective gates g' from its gates and accepted mask
//   RenormalizeTokenGatesBackward  the chain rule of the above: dL/dg from dL/dg'
// Callers: the host side (rdep::AdmitBySourceOrder, RenormalizeGates, RenormalizeGatesBackward in
// src/core/capacity.cc, used by the host backend and the reference) and the CUDA kernels
// (OwnerScanKernel, AcceptKernel, DgateKernel in src/dispatch/dispatch_kernels.cu). The other rules
// live beside these: route-row identity in rdep/core/row_id.h (RowIdCodec, also used by the
// kernels), routing-slot validity in rdep/core/route_rules.h (CheckRouteSlot).
//
// The CUDA layer's routing metadata (accepted mask, effective gates) is checked bit for bit against
// the host backend, so each function fixes its arithmetic: double sums in slot order, one division
// order. Raw pointers and scalars only (no allocation), so a device thread can run them.
#pragma once

#include <cstdint>

#include "rdep/core/route_rules.h"  // RDEP_HOST_DEVICE

namespace rdep {

// Owner admission for one expert: walk the sources in order, each gets
//   admitted[s] = clamp(left, 0, count[s]),  left -= admitted[s],  left starting at the capacity.
struct SourceOrderAdmission {
  int64_t left = 0;  // capacity not yet handed to an earlier source

  // Rows admitted from the next source, which has `count` candidate rows for this expert.
  RDEP_HOST_DEVICE int64_t Admit(int64_t count) {
    const int64_t admitted = left < 0 ? 0 : (left < count ? left : count);
    left -= admitted;
    return admitted;
  }
};

// One token's K slots: effective[k] = g_k * S / A for accepted k (S = sum of all gates, A = sum of
// the accepted ones, both double sums in slot order); g_k itself when S == A (nothing of weight
// dropped: bitwise the input gate); 0 for dropped slots and for every slot when A == 0.
RDEP_HOST_DEVICE inline void RenormalizeTokenGates(const float* gates, const uint8_t* accepted, int64_t K,
                                                   float* effective) {
  double S = 0, A = 0;
  for (int64_t k = 0; k < K; ++k) {
    S += gates[k];
    if (accepted[k]) A += gates[k];
  }
  for (int64_t k = 0; k < K; ++k) {
    if (!accepted[k] || A == 0) effective[k] = 0.f;
    else effective[k] = (S == A) ? gates[k] : static_cast<float>(static_cast<double>(gates[k]) * S / A);
  }
}

// Chain rule through RenormalizeTokenGates for one token: d_gates[k] = dL/dg_k from
// d_effective[k] = dL/dg'_k. The math is in double whatever the element types (the host passes
// double in and out, the dgate kernel float in and out):
//   A == 0: 0;  S == A: d_effective on accepted slots, 0 on dropped ones (the forward is the identity);
//   else, with P = sum_{accepted} d_effective_j g_j:
//     d_gates[k] = [k accepted] (d_effective_k S/A - P S/A^2) + P/A.
template <typename DEffective, typename DGate>
RDEP_HOST_DEVICE inline void RenormalizeTokenGatesBackward(const float* gates, const uint8_t* accepted, int64_t K,
                                                           const DEffective* d_effective, DGate* d_gates) {
  double S = 0, A = 0, P = 0;
  for (int64_t k = 0; k < K; ++k) {
    S += gates[k];
    if (accepted[k]) {
      A += gates[k];
      P += static_cast<double>(d_effective[k]) * gates[k];
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    double d;
    if (A == 0) d = 0;
    else if (S == A) d = accepted[k] ? static_cast<double>(d_effective[k]) : 0.0;
    else d = (accepted[k] ? static_cast<double>(d_effective[k]) * S / A - P * S / (A * A) : 0.0) + P / A;
    d_gates[k] = static_cast<DGate>(d);
  }
}

}  // namespace rdep
