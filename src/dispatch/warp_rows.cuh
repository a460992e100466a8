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

// A warp's row copy in two steps, for a row whose destination comes out of a chain of dependent loads (a
// stream position, a row id, an owner): Load issues the first 32 * kCopyUnroll 16-byte vectors of the
// source (a whole 2048-wide bf16 row) before the chain, so they are in flight while it resolves; Store
// writes them to the destination and copies the rest. A warp that finds nothing to send drops the loads.
// The vector path needs H % 8 == 0 and both rows 16-byte aligned; Load sees only the source, so Store
// falls back to 2-byte elements from the source when the destination is not aligned.
struct WarpRowHead {
  static constexpr int64_t kVectors = 32 * kCopyUnroll;
  int4 v[kCopyUnroll];
  bool vec = false;

  __device__ __forceinline__ void Load(const uint16_t* src, int64_t H) {
    const int lane = static_cast<int>(threadIdx.x & 31);
    vec = (H % 8) == 0 && (reinterpret_cast<uintptr_t>(src) % 16) == 0;
    if (!vec) return;
    const auto* s = reinterpret_cast<const int4*>(src);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = u * 32 + lane;
      if (i < H / 8) v[u] = __ldg(s + i);
    }
  }

  __device__ __forceinline__ void Store(const uint16_t* src, uint16_t* dst, int64_t H) const {
    const int lane = static_cast<int>(threadIdx.x & 31);
    if (!vec || (reinterpret_cast<uintptr_t>(dst) % 16) != 0) {
      for (int64_t i = lane; i < H; i += 32) dst[i] = src[i];
      return;
    }
    auto* d = reinterpret_cast<int4*>(dst);
    const int64_t n16 = H / 8;
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = u * 32 + lane;
      if (i < n16) d[i] = v[u];
    }
    if (n16 > kVectors) WarpCopyVec16(reinterpret_cast<const int4*>(src) + kVectors, d + kVectors, n16 - kVectors);
  }
};

// dst = w * src for one row of H bf16 by a warp, each element rounded to bf16 once, the element-wise form's
// bits: 16-byte vectors with kCopyUnroll loads in flight per lane (as WarpCopyVec16) when aligned, else
// 2-byte elements.
__device__ __forceinline__ void WarpScaleRow(const uint16_t* src, uint16_t* dst, int64_t H, float w) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  if ((H % 8) != 0 || (reinterpret_cast<uintptr_t>(src) % 16) != 0 || (reinterpret_cast<uintptr_t>(dst) % 16) != 0) {
    for (int64_t i = lane; i < H; i += 32) dst[i] = ToBf(w * Bf(src[i]));
    return;
  }
  const auto* __restrict__ s = reinterpret_cast<const int4*>(src);
  auto* __restrict__ d = reinterpret_cast<int4*>(dst);
  const int64_t n16 = H / 8;
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
      if (i >= n16) continue;
      auto* e = reinterpret_cast<uint16_t*>(&v[u]);
#pragma unroll
      for (int j = 0; j < 8; ++j) e[j] = ToBf(w * Bf(e[j]));
      d[i] = v[u];
    }
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

// The grid of a kernel that stores into peer memory, one warp per item: under an SM budget
// (l.transport_sms > 0) that many blocks of kTransportThreads (fewer when the items need fewer), so at most
// that many SMs; else WarpBlocks of 256 threads. The kernels are grid-stride loops
// over warps, correct for either shape, and carry __launch_bounds__(kTransportThreads).
struct TransportGrid {
  unsigned blocks, threads;
};
inline TransportGrid TransportGridFor(int64_t items, const RegionLayout& l) {
  if (l.transport_sms <= 0) return {static_cast<unsigned>(WarpBlocks(items)), 256u};
  const int64_t needed = (items * 32 + kTransportThreads - 1) / kTransportThreads;
  const int64_t blocks = needed < l.transport_sms ? (needed < 1 ? 1 : needed) : l.transport_sms;
  return {static_cast<unsigned>(blocks), static_cast<unsigned>(kTransportThreads)};
}

// Tokens in an owner's segment window [lo, lo + S) of its stream (the stream's length from the control
// words every source published).
__device__ __forceinline__ int64_t SegmentTokens(const RegionLayout& l, const int64_t* my_control, int64_t lo) {
  int64_t total = 0;
  for (int64_t s = 0; s < l.W; ++s) total += my_control[l.recv_tokens(s)];
  const int64_t rest = total - lo;
  return rest < 0 ? 0 : (rest < l.S ? rest : l.S);
}

// <a, b> over H bf16 values by a full warp, in one fixed order whatever the alignment: lane l takes the
// 8-column chunks l, l + 32, ..., each chunk's columns in order into one fp32 accumulator (fused
// multiply-adds), then an xor butterfly; every lane returns the same value. Aligned rows with H % 8 == 0
// are read as 16-byte vectors, 4 chunks of each row in flight per lane.
__device__ __forceinline__ void FmaDotBf16x8(float& dot, const uint4& a, const uint4& b) {
  const auto* x = reinterpret_cast<const uint16_t*>(&a);
  const auto* y = reinterpret_cast<const uint16_t*>(&b);
#pragma unroll
  for (int j = 0; j < 8; ++j) dot = __fmaf_rn(Bf(x[j]), Bf(y[j]), dot);
}

__device__ __forceinline__ float WarpDotBf16(const uint16_t* a, const uint16_t* b, int64_t H) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  float dot = 0.f;
  const int64_t chunks = (H + 7) / 8;
  if ((H % 8) == 0 && (reinterpret_cast<uintptr_t>(a) % 16) == 0 && (reinterpret_cast<uintptr_t>(b) % 16) == 0) {
    const auto* a16 = reinterpret_cast<const uint4*>(a);
    const auto* b16 = reinterpret_cast<const uint4*>(b);
    constexpr int kU = 4;
    for (int64_t base = 0; base < chunks; base += 32 * kU) {
      uint4 va[kU], vb[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t c = base + u * 32 + lane;
        if (c < chunks) va[u] = __ldg(a16 + c), vb[u] = __ldg(b16 + c);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (base + u * 32 + lane < chunks) FmaDotBf16x8(dot, va[u], vb[u]);
    }
  } else {
    for (int64_t c = lane; c < chunks; c += 32)
      for (int64_t i = c * 8; i < c * 8 + 8 && i < H; ++i) dot = __fmaf_rn(Bf(a[i]), Bf(b[i]), dot);
  }
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, o);
  return dot;
}

}  // namespace rdep::dispatch::detail
