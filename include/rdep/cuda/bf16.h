// bf16 on the host: round-to-nearest-even conversion matching __float2bfloat16 on the device, so
// host references quantize inputs exactly as the GPU sees them.
#pragma once

#include <cstdint>
#include <cstring>

namespace rdep {

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float Bf16BitsToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounds a float to the nearest bf16 value (kept as float).
inline float RoundToBf16(float f) { return Bf16BitsToFloat(FloatToBf16Bits(f)); }

}  // namespace rdep
