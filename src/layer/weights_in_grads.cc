#include "layer/weights_in_grads.h"

#include <string>

#include "rdep/core/byte_range.h"

namespace rdep {

bool BackwardReadsWeightsBeforeGrads(const LayerConfig& config, bool cuda) {
  const int64_t S = config.segment_tokens, WT = config.shape.ranks * config.shape.tokens;
  const bool one_segment = S == 0 || S >= WT;
  return cuda && config.expert_compute == ExpertComputeKind::kCutlass && !config.balance.enabled() && config.nodes.nodes <= 1 &&
         one_segment;
}

Status CheckWeightsInGrads(const LayerConfig& config, bool cuda, std::span<const ExpertByteRanges> ranks, int32_t first_rank) {
  const bool ordered = BackwardReadsWeightsBeforeGrads(config, cuda);
  for (size_t i = 0; i < ranks.size(); ++i) {
    const ExpertByteRanges& w = ranks[i];
    const ByteRange weights[] = {{"w1", w.w1, w.w1_bytes}, {"w2", w.w2, w.w2_bytes}};
    for (size_t j = 0; j < ranks.size(); ++j) {
      const ExpertByteRanges& g = ranks[j];
      const ByteRange grads[] = {{"dw1", g.dw1, g.dw1_bytes}, {"dw2", g.dw2, g.dw2_bytes}};
      for (int a = 0; a < 2; ++a) {
        for (int b = 0; b < 2; ++b) {
          if (!Overlap(weights[a], grads[b])) continue;
          const std::string who = "backward on rank " + std::to_string(first_rank + static_cast<int32_t>(i)) + ": " + weights[a].name +
                                  " overlaps " + (i == j ? "its " : "rank " + std::to_string(first_rank + static_cast<int32_t>(j)) + "'s ") +
                                  grads[b].name;
          if (i != j) return InvalidArgument(who + " (a rank's weights may lie only in its own gradients)");
          if (a != b) return InvalidArgument(who + " (w1 may lie only in dw1, w2 only in dw2)");
          if (!ordered)
            return InvalidArgument(who + ": weights may lie in their gradients only with the CUDA backend, expert_compute cutlass, "
                                         "one segment per forward, no balancing and one node (the backward then reads each "
                                         "weight before it writes its gradient)");
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace rdep
