#include "rdep/core/shape.h"

#include <limits>
#include <sstream>

namespace rdep {

Status LayerShape::Validate() const {
  auto bad = [&](const std::string& what) {
    std::ostringstream os;
    os << "invalid layer shape (" << *this << "): " << what;
    return InvalidArgument(os.str());
  };
  if (ranks < 1) return bad("ranks W must be >= 1");
  if (tokens < 0) return bad("tokens T must be >= 0");
  if (hidden < 1) return bad("hidden H must be >= 1");
  if (ffn < 1) return bad("ffn D_ff must be >= 1");
  if (experts < 1) return bad("experts E must be >= 1");
  if (topk < 1) return bad("topk K must be >= 1");
  if (topk > experts) return bad("topk K must be <= experts E (experts per token are distinct)");
  if (experts > std::numeric_limits<int32_t>::max()) return bad("experts E must fit in int32");
  // row_id = ((r*T)+t)*K+k must fit in a signed 64-bit value.
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  if (tokens > 0 && ranks > kMax / tokens) return bad("W*T overflows 64-bit row identities");
  if (tokens > 0 && ranks * tokens > kMax / topk) return bad("W*T*K overflows 64-bit row identities");
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const LayerShape& s) {
  return os << "W=" << s.ranks << " T=" << s.tokens << " H=" << s.hidden << " D_ff=" << s.ffn
            << " E=" << s.experts << " K=" << s.topk;
}

}  // namespace rdep
