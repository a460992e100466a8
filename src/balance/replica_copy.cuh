// The store loop of the replica weight streaming (stream_replicas.cu: owners, stage 1; relay_replicas.cu:
// relays, stage 2): one block copies a byte span of an expert's slot image ([w1 | w2], slot_bytes) to
// the same offset in one or several replicas' slots, reading each source byte once.
#pragma once

#include <cstdint>

#include "rdep/balance/gpu_planner.h"

namespace rdep::replica_copy {

constexpr int kThreads = 256;

// Where a span goes: the replica `only` (>= 0), or every active replica (slot >= 0, quota > 0) of
// instances [first, last) except `skip`.
struct Targets {
  int32_t first = 0, last = 0, only = -1, skip = -1;
};

__device__ __forceinline__ bool Takes(const DevicePlanView& p, Targets t, int32_t i) {
  if (t.only >= 0) return i == t.only;
  return i != t.skip && p.instance_slot[i] >= 0 && p.instance_quota[i] > 0;
}

__device__ __forceinline__ unsigned char* SlotAt(const DevicePlanView& p, unsigned char* const* slots_of, int64_t slot_bytes,
                                                 int32_t i, int64_t offset) {
  return slots_of[p.instance_rank[i]] + static_cast<int64_t>(p.instance_slot[i]) * slot_bytes + offset;
}

// Bytes [0, n) of src to offset dst_off of every target's slot (16-byte vectors where every address
// and the length allow). Called by all threads of a block.
__device__ __forceinline__ void CopySpan(const DevicePlanView& p, unsigned char* const* slots_of, int64_t slot_bytes, Targets t,
                                         const unsigned char* src, int64_t n, int64_t dst_off) {
  if (n <= 0) return;
  const int32_t lo = t.only >= 0 ? t.only : t.first, hi = t.only >= 0 ? t.only + 1 : t.last;
  bool vec = (reinterpret_cast<uintptr_t>(src) % 16 == 0) && n % 16 == 0 && dst_off % 16 == 0 && slot_bytes % 16 == 0;
  for (int32_t i = lo; i < hi && vec; ++i) vec = reinterpret_cast<uintptr_t>(slots_of[p.instance_rank[i]]) % 16 == 0;
  if (vec) {
    for (int64_t v = threadIdx.x; v < n / 16; v += kThreads) {
      const uint4 x = reinterpret_cast<const uint4*>(src)[v];
      for (int32_t i = lo; i < hi; ++i)
        if (Takes(p, t, i)) reinterpret_cast<uint4*>(SlotAt(p, slots_of, slot_bytes, i, dst_off))[v] = x;
    }
  } else {
    for (int64_t b = threadIdx.x; b < n; b += kThreads) {
      const unsigned char x = src[b];
      for (int32_t i = lo; i < hi; ++i)
        if (Takes(p, t, i)) SlotAt(p, slots_of, slot_bytes, i, dst_off)[b] = x;
    }
  }
}

}  // namespace rdep::replica_copy
