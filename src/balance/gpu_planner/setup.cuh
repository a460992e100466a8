// Phase 0: the expert sums and the staged load matrix in one pass over global memory.
// Part of the GPU quota planner, included by src/balance/gpu_planner.cu alone (docs/balance.md).
#pragma once

#include "state.cuh"

namespace rdep {
namespace gpu_planner_detail {

// Phase 0's pass over the load matrix: thread idx = g * (E / V) + p reads experts p*V .. p*V + V - 1 (V = 2:
// 16-byte loads) of the rows r = g (mod groups), 64 bytes in flight; lanes run along the experts, so
// the loads are coalesced and the int32 stores into the stage conflict-free. Each thread leaves its
// partial expert sums in part[g][e] (PartialSums: the thread search's overflow area or the reroute
// arrays, whichever is larger; both are free until the search, at least 3 E int64, so groups * E fits).
// Also copies the owner map into shared memory.
__device__ inline int64_t* PartialSums(const KernelArgs& a, const Shared& s, int v, int* groups) {
  const size_t reroute = 3 * (static_cast<size_t>(a.E) + static_cast<size_t>(a.R) * static_cast<size_t>(a.S));
  const size_t overflow = static_cast<size_t>(a.pt) * static_cast<size_t>(a.R) / 2;  // int32 words -> int64
  const size_t scratch = overflow > reroute ? overflow : reroute;
  const int by_threads = kThreads / (a.E / v), by_scratch = static_cast<int>(scratch / static_cast<size_t>(a.E));
  *groups = max(1, min(by_threads, by_scratch));
  return overflow > reroute ? reinterpret_cast<int64_t*>(s.ovf) : s.mi_local;
}
template <int V>
__device__ void StageAndSumExperts(const KernelArgs& a, const Shared& s, int groups, int64_t* part) {
  using Vec = typename std::conditional<V == 2, longlong2, long long>::type;
  constexpr int kUnroll = 8 / V;  // 64 bytes in flight per thread
  const int R = a.R, E = a.E, P = E / V;
  for (int idx = threadIdx.x; idx < groups * P; idx += kThreads) {
    const int p = idx % P, g = idx / P, e = p * V;
    if (g == 0)
      for (int v = 0; v < V; ++v) s.owner[e + v] = a.owner[e + v];
    int64_t sum[V] = {};
    for (int r0 = g; r0 < R; r0 += kUnroll * groups) {
      Vec x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int r = r0 + u * groups;
        if (r < R) x[u] = __ldg(reinterpret_cast<const Vec*>(a.load + static_cast<size_t>(r) * E + e));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int r = r0 + u * groups;
        if (r >= R) break;
        int32_t* st = s.stage + static_cast<size_t>(r) * StageStride(E) + e;
        if constexpr (V == 2) {
          sum[0] += x[u].x;
          sum[1] += x[u].y;
          if (a.staged) *reinterpret_cast<int2*>(st) = make_int2(static_cast<int>(x[u].x), static_cast<int>(x[u].y));
        } else {
          sum[0] += x[u];
          if (a.staged) *st = static_cast<int32_t>(x[u]);
        }
      }
    }
    for (int v = 0; v < V; ++v) part[static_cast<size_t>(g) * E + e + v] = sum[v];
  }
}

}  // namespace gpu_planner_detail
}  // namespace rdep
