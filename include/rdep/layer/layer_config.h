// LayerConfig: how one MoE layer runs (shape, capacity policy, segment size), printable and
// validated up front.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

#include "rdep/core/capacity.h"
#include "rdep/core/ownership.h"
#include "rdep/core/reference.h"
#include "rdep/core/shape.h"
#include "rdep/dispatch/region_layout.h"
#include "rdep/status.h"
#include "rdep/transport/domain.h"

namespace rdep {

inline constexpr int64_t kMaxLoadMatrixExperts = 8192;  // one rank's row is counted in shared memory

struct LayerConfig {
  LayerShape shape;
  CapacityPolicy capacity;         // dropless by default
  int64_t segment_tokens = 0;      // S: token rows an owner receives per segment; 0 = the backend's
                                   // default (host: T; CUDA: W*T, so one segment and no host sync)
  bool load_matrix = false;        // phase 1 also gives every rank the full load matrix Lambda[W][E]
                                   // (the balancer needs it; W*E words per rank; E <= kMaxLoadMatrixExperts)

  Status Validate() const;
  int64_t segment() const { return segment_tokens > 0 ? segment_tokens : (shape.tokens > 0 ? shape.tokens : 1); }
};

std::ostream& operator<<(std::ostream& os, const LayerConfig& c);

// The region layout of this config (rdep/dispatch/region_layout.h) for elements of elem_bytes.
RegionLayout MakeRegionLayout(const LayerConfig& c, const OwnershipMap& m, size_t elem_bytes);

// What every backend's layer checks at Create: a valid config, a domain of W ranks, an ownership
// map and (when given) weights of the layer's shape.
Status ValidateLayerInputs(const LayerConfig& c, int64_t domain_ranks, const OwnershipMap& m);
Status ValidateLayerInputs(const LayerConfig& c, int64_t domain_ranks, const OwnershipMap& m, const MoEWeights& w);

// The caller's expert weights for one rank, bound to a layer instead of its own copy (the PyTorch
// binding's parameters): w1 [E_loc][H][2F], w2 [E_loc][F][H] for the rank's experts in local order
// (MoEWeights' layout per expert), and dw1, dw2 of the same shapes, written (not accumulated) by
// backward. Weights and gradients each come as a pair or not at all; all null = the layer's own.
template <typename Wt, typename G>
struct ExternalWeights {
  const Wt* w1 = nullptr;
  const Wt* w2 = nullptr;
  G* dw1 = nullptr;
  G* dw2 = nullptr;

  Status Validate(int32_t rank) const {
    if ((w1 == nullptr) != (w2 == nullptr) || (dw1 == nullptr) != (dw2 == nullptr))
      return InvalidArgument("expert weights bound to rank " + std::to_string(rank) +
                             ": w1 and w2 (and dw1 and dw2) must be given together");
    if (w1 == nullptr && dw1 != nullptr)
      return InvalidArgument("expert weights bound to rank " + std::to_string(rank) + ": gradients without weights");
    return Status::Ok();
  }
};

// The protocol's four symmetric regions on a domain (host or CUDA), allocated by layout.
struct LayerRegions {
  RegionId control = -1, payload = -1, sideband = -1, ret = -1;

  static StatusOr<LayerRegions> Allocate(Domain& d, const RegionLayout& l) {
    LayerRegions r;
    RDEP_ASSIGN_OR_RETURN(r.control, d.AllocateSymmetric(l.control_bytes(), "control"));
    RDEP_ASSIGN_OR_RETURN(r.payload, d.AllocateSymmetric(l.payload_bytes(), "segment.payload"));
    RDEP_ASSIGN_OR_RETURN(r.sideband, d.AllocateSymmetric(l.sideband_bytes(), "segment.sideband"));
    RDEP_ASSIGN_OR_RETURN(r.ret, d.AllocateSymmetric(l.return_bytes(), "return"));
    return r;
  }
  void Free(Domain& d) const {
    for (RegionId id : {control, payload, sideband, ret}) d.FreeSymmetric(id);
  }
};

}  // namespace rdep
