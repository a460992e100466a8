// Where a backward's expert weights may lie relative to the weight gradients it writes.
//
// The sync-free CUTLASS backward of one segment (cutlass_expert_compute.cu) reads w2 only in
// dz = dout.W2^T, before it writes dw2, and w1 only in dx = dh.W1^T, before it writes dw1; no other part
// of the layer's backward reads the weights when balancing is off and there is one node. So w1 may lie
// inside the same rank's dw1 bytes and w2 inside its dw2 bytes: a caller with fp32 master weights can
// cast their bf16 copies into the fp32 gradient buffers that the backward then overwrites, and hold no
// separate copy during the backward (rdep.torch does). Every other overlap is refused, as is any
// overlap where that order does not hold.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "rdep/layer/layer_config.h"
#include "rdep/status.h"

namespace rdep {

// One local rank's expert weights and weight gradients as byte ranges (null or 0 bytes: absent).
struct ExpertByteRanges {
  const void* w1 = nullptr;
  size_t w1_bytes = 0;
  const void* w2 = nullptr;
  size_t w2_bytes = 0;
  const void* dw1 = nullptr;
  size_t dw1_bytes = 0;
  const void* dw2 = nullptr;
  size_t dw2_bytes = 0;
};

// Whether config's backward reads each weight only before it writes that weight's gradient (above).
bool BackwardReadsWeightsBeforeGrads(const LayerConfig& config, bool cuda);

// OK when no rank's weights overlap any rank's gradients, or when the only overlaps are w1 with the
// same rank's dw1 and w2 with its dw2 and BackwardReadsWeightsBeforeGrads holds; InvalidArgument naming
// the rank, the two arrays and why otherwise. ranks[i] is local rank first_rank + i.
Status CheckWeightsInGrads(const LayerConfig& config, bool cuda, std::span<const ExpertByteRanges> ranks, int32_t first_rank);

}  // namespace rdep
