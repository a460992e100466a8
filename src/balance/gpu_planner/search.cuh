// The thread-probe binary search on the threshold: the speculative rounds' shape and ThreadSearch.
// Part of the GPU quota planner, included by src/balance/gpu_planner.cu alone (docs/balance.md).
#pragma once

#include "oracle.cuh"
#include "state.cuh"

namespace rdep {
namespace gpu_planner_detail {

// The thread-probe search (R <= 64, loads < 2^26). A round probes, one thread each, nodes of the
// binary-search tree below the round's root (heap order from 1; node n's interval comes from walking
// its bits from the root, 0 = left = feasible: hi = tau). Its shape is a full tree of pb levels rooted
// at node 2^c, below a chain of c nodes down the leftmost path (nodes 1, 2, 4, ..., 2^(c-1));
// c + 2^pb - 1 <= the probe threads. The tree takes slots 0..2^pb - 2 in order of threshold (in-order),
// so that a warp's 32 probes run neighbouring thresholds, whose greedy runs take nearly the same
// branches (heap order measured ~10% slower for the first round); the chain takes the slots after it.
// Only the first round has a chain: the solved threshold sits close above the mean rank load, where
// the search starts, so its first decisions are "feasible"; the chain holds the leading nodes whose
// threshold is at least lo + lo / 2^chain_shift (1/32 by default: 3%; the simulation grid's thresholds
// at N_slot >= 2 and R >= 32 are within 1.7% of the mean). A round resolves c + pb levels when the path
// follows the chain and fewer when it turns early; the next round (a full tree) starts where the path
// left the probed nodes, so only the time depends on the guess, never the result. Warp 0 then
// follows the host's path through the results. The probes in slots 0..63 record their transfers; when
// the round's last feasible node on the path is one of them, warp 0 unpacks its records before the
// round's last barrier (the next round's probes reuse the buffers). Otherwise Phase 3 re-runs the solved threshold with
// recording.
__device__ __forceinline__ int ProbeNodeOfSlot(int t, int c, int pb) {
  const int tree = (1 << pb) - 1;
  if (t >= tree) return 1 << (t - tree);                 // the chain: slots after the tree
  const int j = t + 1, tz = __ffs(j) - 1, du = pb - 1 - tz;  // in-order index t: depth du in the tree
  return ((1 << c) << du) | (j >> (tz + 1));
}
// The round's shape (every thread computes the same): the chain, the leading nodes of the leftmost
// path whose threshold is at least lo + lo >> shift (0: none), leaving at least half the probe threads
// to the tree; the tree's levels, as many as the threads allow but no more than a search below the
// chain can take (so that when they are at most 6, every probe of the last round records).
__device__ __forceinline__ void RoundShape(int64_t lo, int64_t hi, int shift, int pt, int* c_out, int* pb_out) {
  int c = 0;
  if (shift > 0) {
    const int64_t bar = lo + (lo >> shift);
    const int cmax = min(pt - (pt + 1) / 2, 24);
    while (lo < hi && c < cmax) {
      const int64_t tau = lo + (hi - lo) / 2;
      if (tau < bar) break;
      hi = tau;
      ++c;
    }
  }
  const int depth = lo < hi ? 64 - __clzll(static_cast<unsigned long long>(hi - lo)) : 1;  // probes below
  *c_out = c;
  *pb_out = min(min(31 - __clz(pt - c + 1), 30 - c), depth);  // 2^pb - 1 <= pt - c
}

__device__ void ThreadSearch(const KernelArgs& a, const Shared& s, int umin) {
  const int tid = threadIdx.x;
  const int R = a.R, S = a.S, pt = a.pt;
  const size_t rs = static_cast<size_t>(R) * S;
  // Two barriers a round: after the probes, and after warp 0 has followed the host's path through the
  // results (in registers: no shared read-modify-write per node) and unpacked the records it lands on.
  for (int round = 0;; ++round) {
    int64_t lo = s.misc64[0], hi = s.misc64[1];
    if (lo >= hi) break;
    int c = 0, pb = 0;
    RoundShape(lo, hi, round == 0 ? a.chain_shift : 0, pt, &c, &pb);
    if (tid < c + (1 << pb) - 1) {
      const int n = ProbeNodeOfSlot(tid, c, pb);
      int64_t l = lo, h = hi;
      for (int b = 30 - __clz(n); b >= 0 && l < h; --b) {
        const int64_t tau = l + (h - l) / 2;
        if ((n >> b) & 1) l = tau + 1;
        else h = tau;
      }
      if (l < h) {
        const int tau = static_cast<int>(l + (h - l) / 2);
        uint32_t* ov = s.ovf + static_cast<size_t>(tid) * R;
        uint8_t* used = s.used8 + static_cast<size_t>(tid) * R;
        uint64_t* rec = s.trec + static_cast<size_t>(tid) * rs;
        int nrec = 0;
        bool f;
        if (tid < kRecordingProbes)  // warps 0-1: whole warps take the recording form
          f = S <= 2 ? ThreadProbe<true, true>(s, tau, R, S, umin, ov, used, rec, &nrec)
                     : ThreadProbe<true, false>(s, tau, R, S, umin, ov, used, rec, &nrec);
        else
          f = S <= 2 ? ThreadProbe<false, true>(s, tau, R, S, umin, ov, used, rec, &nrec)
                     : ThreadProbe<false, false>(s, tau, R, S, umin, ov, used, rec, &nrec);
        s.feas[tid] = f ? 1 : 0;
        if (tid < kRecordingProbes) s.wnrec[tid] = nrec;
      }
    }
    if (round < 3) RDEP_FINE_MAX(8 + 3 * round);
    __syncthreads();
    if (tid < 32) {
      int probes = s.misc32[kNumProbes];
      bool any = s.misc32[kAnyFeasible] != 0, rerun = s.misc32[kNeedRerun] != 0;
      int from = 0;  // recording slot + 1 of the round's last feasible node on the path, 0 = none
      // 32-bit walk (thresholds < 2^26): node (1 << d) | x at depth d; the inverse of ProbeNodeOfSlot.
      int l = static_cast<int>(lo), h = static_cast<int>(hi);
      for (int d = 0, x = 0; l < h; ++d) {
        int slot;
        if (d < c) {
          if (x != 0) break;  // the path left the chain: the next round starts here
          slot = (1 << pb) - 1 + d;
        } else {
          const int du = d - c;
          if (du >= pb || (x >> du) != 0) break;  // below the tree, or off it
          slot = ((2 * x + 1) << (pb - 1 - du)) - 1;
        }
        const int tau = l + (h - l) / 2;
        ++probes;
        if (s.feas[slot]) {
          h = tau;
          any = true;
          rerun = slot >= kRecordingProbes;
          from = rerun ? 0 : slot + 1;
          x = 2 * x;
        } else {
          l = tau + 1;
          x = 2 * x + 1;
        }
      }
      lo = l;
      hi = h;
      if (from != 0) {  // warp 0 unpacks the records (the next round's probes may overwrite them)
        const int n = s.wnrec[from - 1];
        const uint64_t* src = s.trec + static_cast<size_t>(from - 1) * rs;
        for (int k = tid; k < n; k += 32) UnpackRecord(s, src, k);
      }
      if (tid == 0) {  // the next round's interval and, for phase 3, the search's state
        s.misc64[0] = lo;
        s.misc64[1] = hi;
        s.misc32[kNumProbes] = probes;
        s.misc32[kAnyFeasible] = any ? 1 : 0;
        s.misc32[kNeedRerun] = rerun ? 1 : 0;
        if (from != 0) s.misc32[kNumRec] = s.wnrec[from - 1];
      }
    }
    if (round < 3) RDEP_FINE_MAX(9 + 3 * round);
    __syncthreads();
  }
}

}  // namespace gpu_planner_detail
}  // namespace rdep
