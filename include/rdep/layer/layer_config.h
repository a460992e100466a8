// LayerConfig: how one MoE layer runs (shape, capacity policy, segment size), printable and
// validated up front.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>

#include "rdep/core/capacity.h"
#include "rdep/core/ownership.h"
#include "rdep/core/shape.h"
#include "rdep/status.h"
#include "rdep/transport/region_layout.h"

namespace rdep {

struct LayerConfig {
  LayerShape shape;
  CapacityPolicy capacity;         // dropless by default
  int64_t segment_tokens = 0;      // S: token rows an owner receives per segment; 0 = the backend's
                                   // default (host: T; CUDA: W*T, so one segment and no host sync)

  Status Validate() const;
  int64_t segment() const { return segment_tokens > 0 ? segment_tokens : (shape.tokens > 0 ? shape.tokens : 1); }
};

std::ostream& operator<<(std::ostream& os, const LayerConfig& c);

// The region layout of this config (rdep/transport/region_layout.h) for elements of elem_bytes.
RegionLayout MakeRegionLayout(const LayerConfig& c, const OwnershipMap& m, size_t elem_bytes);

}  // namespace rdep
