// A named span of memory, and whether two spans share a byte: the argument checks that refuse arrays lying
// in one another (weights in gradients, an optimizer's arrays).
#pragma once

#include <cstddef>
#include <cstdint>

namespace rdep {

struct ByteRange {
  const char* name;
  const void* ptr;
  size_t bytes;
};

// A null or empty range overlaps nothing.
inline bool Overlap(const ByteRange& a, const ByteRange& b) {
  const auto x = reinterpret_cast<uintptr_t>(a.ptr), y = reinterpret_cast<uintptr_t>(b.ptr);
  if (x == 0 || y == 0 || a.bytes == 0 || b.bytes == 0) return false;
  return x < y + b.bytes && y < x + a.bytes;
}

}  // namespace rdep
