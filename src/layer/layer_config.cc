#include "rdep/layer/layer_config.h"

#include <algorithm>

namespace rdep {

Status LayerConfig::Validate() const {
  RDEP_RETURN_IF_ERROR(shape.Validate());
  RDEP_RETURN_IF_ERROR(capacity.Validate());
  if (segment_tokens < 0) return InvalidArgument("segment size S must be >= 0 (0 = T), got " + std::to_string(segment_tokens));
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const LayerConfig& c) {
  os << c.shape << " capacity=";
  if (c.capacity.dropless()) os << "dropless";
  else os << c.capacity.capacity_factor;
  if (c.segment_tokens > 0) return os << " S=" << c.segment_tokens;
  return os << " S=auto";  // the backend's default (host: T; CUDA: W*T, the worst case)
}

RegionLayout MakeRegionLayout(const LayerConfig& c, const OwnershipMap& m, size_t elem_bytes) {
  RegionLayout l;
  l.W = c.shape.ranks;
  l.L = std::max<int64_t>(1, m.max_local());
  l.S = c.segment();
  l.H = c.shape.hidden;
  l.T = c.shape.tokens;
  l.K = c.shape.topk;
  l.slots_per_token = std::max<int64_t>(1, std::min<int64_t>(c.shape.topk, m.max_local()));
  l.elem_bytes = static_cast<int64_t>(elem_bytes);
  return l;
}

}  // namespace rdep
