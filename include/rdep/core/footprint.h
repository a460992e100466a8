// Footprint: what a run will allocate (host bytes, device bytes per GPU) and how much work it will do,
// estimated from its shape before anything is allocated, so a caller can refuse a run that would
// exhaust memory or run for hours (CUTLASS's workspace_bytes, asked before run). Every term names the
// shape fields it grows with, so a refusal can say which input to shrink. Sums are in double: an
// absurd shape gives a huge estimate, never an overflow.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace rdep {

struct FootprintTerm {
  std::string what;                                   // "expert weights and gradients"
  std::vector<std::pair<std::string, double>> factors;  // the shape fields it grows with: {"experts", 16}, ...
  double amount = 0;                                  // bytes, or operations for a work term
};

struct Footprint {
  std::vector<FootprintTerm> host;    // host memory of the whole process
  std::vector<FootprintTerm> device;  // device memory of one GPU (empty: the run uses no GPU)
  std::vector<FootprintTerm> work;    // operations: arithmetic, random draws, barrier polls, each one

  static double Sum(const std::vector<FootprintTerm>& terms) {
    double s = 0;
    for (const auto& t : terms) s += t.amount;
    return s;
  }
  double host_bytes() const { return Sum(host); }
  double device_bytes() const { return Sum(device); }
  double operations() const { return Sum(work); }
  // The largest term (the one to shrink); nullptr if there is none.
  static const FootprintTerm* Largest(const std::vector<FootprintTerm>& terms) {
    const FootprintTerm* best = nullptr;
    for (const auto& t : terms)
      if (!best || t.amount > best->amount) best = &t;
    return best;
  }
};

}  // namespace rdep
