// Device helpers on bf16 rows shared by the protocol kernels (dispatch_kernels.cu, owner_reduce_kernels.cu)
// and the two-phase kernels (two_phase_kernels.cu): conversions, a warp's row copy, a segment's token
// count, and a warp's dot product, whose
// summation order is part of the exactness contract (the relay's dgate dot products equal the
// one-domain DgateKernel's bit for bit only because both call WarpDotBf16). Internal to dispatch.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "rdep/dispatch/region_layout.h"

namespace rdep::dispatch::detail {

__device__ __forceinline__ float Bf(uint16_t b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
__device__ __forceinline__ uint16_t ToBf(float f) { return __bfloat16_as_ushort(__float2bfloat16(f)); }

// Copies n16 16-byte vectors by a warp, kUnroll loads per lane issued before their stores, so a warp
// keeps 32 * kUnroll * 16 bytes (4 KiB: a whole 2048-wide bf16 row) in flight instead of one load at a
// time (a plain loop cannot hoist the next load above a store that may alias it). The source is read
// through the non-coherent path: every caller's source is read-only while its kernel runs.
constexpr int kCopyUnroll = 8;
__device__ __forceinline__ void WarpCopyVec16(const int4* __restrict__ s, int4* __restrict__ d, int64_t n16) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (int64_t base = 0; base < n16; base += 32 * kCopyUnroll) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) v[u] = __ldg(s + i);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) d[i] = v[u];
    }
  }
}

// Copies one row of H bf16 by a warp: 16-byte vectors when aligned, else 2-byte elements.
__device__ __forceinline__ void WarpCopyRow(const uint16_t* src, uint16_t* dst, int64_t H) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  if ((H % 8) == 0 && (reinterpret_cast<uintptr_t>(src) % 16) == 0 && (reinterpret_cast<uintptr_t>(dst) % 16) == 0) {
    WarpCopyVec16(reinterpret_cast<const int4*>(src), reinterpret_cast<int4*>(dst), H / 8);
  } else {
    for (int64_t i = lane; i < H; i += 32) dst[i] = src[i];
  }
}

// acc[j] += w * (the j-th bf16 of v), one fused multiply-add each (the combine's and the owner's sums).
__device__ __forceinline__ void FmaBf16x8(float (&acc)[8], float w, const uint4& v) {
  const auto* b = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = __fmaf_rn(w, Bf(b[j]), acc[j]);
}

// Eight fp32 values rounded to bf16, as one 16-byte vector.
__device__ __forceinline__ uint4 PackBf16x8(const float (&acc)[8]) {
  uint4 out;
  auto* o = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = ToBf(acc[j]);
  return out;
}

// Blocks of 256 threads for one warp per item, at most 4096 (the kernels loop over the rest).
inline int WarpBlocks(int64_t items) {
  const int64_t blocks = (items * 32 + 255) / 256;
  return static_cast<int>(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);
}

// Tokens in an owner's segment window [lo, lo + S) of its stream (the stream's length from the control
// words every source published).
__device__ __forceinline__ int64_t SegmentTokens(const RegionLayout& l, const int64_t* my_control, int64_t lo) {
  int64_t total = 0;
  for (int64_t s = 0; s < l.W; ++s) total += my_control[l.recv_tokens(s)];
  const int64_t rest = total - lo;
  return rest < 0 ? 0 : (rest < l.S ? rest : l.S);
}

// <a, b> over H bf16 values by a full warp: lane-strided fp32 partial sums, then an xor butterfly;
// every lane returns the same value.
__device__ __forceinline__ float WarpDotBf16(const uint16_t* a, const uint16_t* b, int64_t H) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  float dot = 0.f;
  for (int64_t c = lane; c < H; c += 32) dot += Bf(a[c]) * Bf(b[c]);
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, o);
  return dot;
}

}  // namespace rdep::dispatch::detail
