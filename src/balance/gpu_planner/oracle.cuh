// The greedy feasibility oracle for one threshold: by one warp (any R, int64 loads: WarpProbe) or by one
// thread (R <= 64, loads < 2^26: ThreadProbe), and the thread probes' packed transfer records.
// Part of the GPU quota planner, included by src/balance/gpu_planner.cu alone (docs/balance.md).
#pragma once

#include "state.cuh"

namespace rdep {
namespace gpu_planner_detail {

// Whether the probe of this warp's search-tree node is no longer on any possible path (a finished
// ancestor decided the other way); its result would be discarded, so it stops.
__device__ __forceinline__ bool Dead(const Shared& s, uint32_t ancestors) {
  return (*reinterpret_cast<volatile int32_t*>(s.misc32 + kDeadMask) & static_cast<int32_t>(ancestors)) != 0;
}

// The greedy oracle for one threshold, run by one warp, in the generic form (any R <= 1024, int64
// loads). slk/used are this warp's [R] arrays; lane l owns ranks l, l+32, ... (reads and writes only
// those, so no intra-warp sync is needed for them). When record is set, transfers go to the shared
// record arrays and their count to *num_rec. Returns false when infeasible or aborted.
__device__ bool WarpProbe(const Shared& s, int64_t tau, int R, int S, int64_t umin, int64_t* slk, int32_t* used,
                          uint32_t ancestors, size_t rec_base, int* num_rec) {
  const int lane = threadIdx.x & 31;
  for (int t = lane; t < R; t += 32) {
    const int64_t v = tau - s.ell[t];
    slk[t] = v > 0 ? v : 0;
    used[t] = 0;
  }
  __syncwarp();
  int nrec = 0;
  bool feasible = true;
  for (int ri = 0; ri < R; ++ri) {
    const int64_t l = s.ell_sorted[ri];
    if (l <= tau) break;
    if (Dead(s, ancestors)) return false;
    const int r = s.rank_order[ri];
    int64_t exc = l - tau;
    for (int k = s.vfirst[ri]; k < s.vfirst[ri + 1] && exc > 0; ++k) {
      const int e = s.vexp[k];
      int64_t cap = s.vlam[k];
      unsigned dupmask = 0;  // bit j: rank lane + 32*j already hosts e
      while (exc > 0 && cap > 0) {
        long long best_s = 0;
        int best_t = INT_MAX;
        int j = 0;
        for (int t = lane; t < R; t += 32, ++j) {
          if (slk[t] > best_s && used[t] < S && t != r && !((dupmask >> j) & 1u)) {
            best_s = slk[t];
            best_t = t;
          }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          const long long os = __shfl_xor_sync(0xffffffffu, best_s, off);
          const int ot = __shfl_xor_sync(0xffffffffu, best_t, off);
          if (os > best_s || (os == best_s && ot < best_t)) {
            best_s = os;
            best_t = ot;
          }
        }
        if (best_t == INT_MAX) break;
        int64_t d = exc > umin ? exc : umin;  // shed at least u_min (same as the host oracle)
        d = d < best_s ? d : static_cast<int64_t>(best_s);
        d = d < cap ? d : cap;
        if (d < umin) break;
        if ((best_t & 31) == lane) {
          s.wrec_e[rec_base + nrec] = e;
          s.wrec_t[rec_base + nrec] = best_t;
          s.wrec_s[rec_base + nrec] = used[best_t];
          s.wrec_amount[rec_base + nrec] = d;
          slk[best_t] -= d;
          used[best_t] += 1;
          dupmask |= 1u << (best_t >> 5);
        }
        ++nrec;
        exc = exc > d ? exc - d : 0;
        cap -= d;
        __syncwarp();
      }
    }
    if (exc > 0) {
      feasible = false;
      break;
    }
  }
  *num_rec = nrec;
  return feasible;
}

// The same oracle for R <= 64 and rank loads below 2^26, run by ONE THREAD per threshold (so a round
// can probe as many search-tree nodes as it has threads; ThreadSearch picks them). It never searches
// for the target: candidates are keyed (slack << 6 | 63 - rank), larger = the host's choice (largest
// slack, lowest rank on ties), and they live in two ordered structures:
//  - the main list: ranks that have received no replica yet, ordered by ascending load (= descending
//    slack for every tau, the same order for all probes: s.asc, read-only). The greedy only ever takes
//    its head, so a probe keeps a head index.
//  - the partial set: ranks that received a replica and still have slack and a free slot. Within one
//    expert's visit every transfer but the last takes the target's whole slack (the shed amount is
//    min(max(exc, u_min), slack, cap) and exc or cap reaching zero ends the visit), so only a visit's
//    last target can stay admissible: the set grows by at most one key per visit. It is kept sorted
//    in registers (kPartialRegs keys); keys pushed out go to an unsorted per-probe overflow area in
//    shared memory that is always below every register key, with its maximum cached.
// The expert of the current visit never needs a no-duplicate test: a target it has taken is either
// out of both structures (slack 0) or the visit is over. When the best key's slack is below u_min (or
// there is none), no later search can succeed either (slack only shrinks), so the probe stops as
// infeasible at once; the host oracle reaches the same answer by failing every remaining expert.
constexpr int kFastRankBits = 6;
constexpr int64_t kFastLoadLimit = int64_t{1} << (32 - kFastRankBits);
// Partial-set keys held in registers. A build with -DRDEP_GPU_PLANNER_PARTIAL_REGS=2 drives the overflow
// path on almost every probe (configure with -DCMAKE_CUDA_FLAGS=-DRDEP_GPU_PLANNER_PARTIAL_REGS=2 and run the
// GpuPlanner tests; docs/perf-notes.md has the command).
#ifndef RDEP_GPU_PLANNER_PARTIAL_REGS
#define RDEP_GPU_PLANNER_PARTIAL_REGS 8
#endif
constexpr int kPartialRegs = RDEP_GPU_PLANNER_PARTIAL_REGS;
static_assert(kPartialRegs >= 1, "the partial set needs at least one register key");

// A thread probe's transfer record: amount (< 2^26) | rank << 26 in the low word, expert | slot << 24
// in the high word (the thread search requires E < 2^24 and N_slot <= 256).
constexpr int kRecAmountBits = 26, kRecExpertBits = 24;
__device__ __forceinline__ uint64_t PackRecord(int e, int slot, int t, int d) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(e) | (static_cast<uint32_t>(slot) << kRecExpertBits)) << 32) |
         (static_cast<uint32_t>(d) | (static_cast<uint32_t>(t) << kRecAmountBits));
}

// Unpacks packed record k into the shared record arrays; UnpackRecords: the whole block, n records.
__device__ __forceinline__ void UnpackRecord(const Shared& s, const uint64_t* src, int k) {
  const uint64_t v = src[k];
  const uint32_t lo = static_cast<uint32_t>(v), hi = static_cast<uint32_t>(v >> 32);
  s.rec_e[k] = static_cast<int>(hi & ((1u << kRecExpertBits) - 1));
  s.rec_s[k] = static_cast<int>(hi >> kRecExpertBits);
  s.rec_t[k] = static_cast<int>(lo >> kRecAmountBits);
  s.rec_amount[k] = static_cast<int64_t>(lo & ((1u << kRecAmountBits) - 1));
}
__device__ void UnpackRecords(const Shared& s, const uint64_t* src, int n) {
  for (int k = threadIdx.x; k < n; k += kThreads) UnpackRecord(s, src, k);
}


// kSmallS: N_slot <= 2, so a rank in the partial set always has exactly one replica (and a rank taken
// from it never returns). Otherwise the per-probe used[] bytes in shared memory hold each rank's
// replica count. kRecord writes the transfers, packed (PackRecord), to rec.
// The step is one straight-line block with a single exit branch at its end (a warp runs 32
// thresholds: branches would serialize, and with one warp per scheduler every branch's predicate
// latency is on the clock): the transfer, the main list's advance and the visit transition are all
// selects, the visit data for the next transition (positions k + 1 and kend as int4s) and the main
// list's next raw entry are loaded every step, unconditionally, a step before they are needed. Only
// the partial set's overflow (rare) branches.
template <bool kRecord, bool kSmallS>
__device__ bool ThreadProbe(const Shared& s, int tau, int R, int S, int umin, uint32_t* ov, uint8_t* used, uint64_t* rec,
                            int* num_rec, uint32_t* stamps = nullptr) {
  const int4* vi = s.vinfo;
  const int4 v0 = vi[0];
  if (v0.w <= tau) {
    *num_rec = 0;
    return true;
  }
  const uint32_t* asc = s.asc;
  const uint32_t utau = static_cast<uint32_t>(tau);
  const int last_raw = R + 1;  // the main list's second sentinel
  auto key_of = [&](uint32_t pk) -> uint32_t {  // main-list entry -> key at this tau (0: no slack)
    const uint32_t l = pk >> kFastRankBits;
    return l < utau && S > 0 ? ((utau - l) << kFastRankBits) | (pk & 63u) : 0u;
  };
  int head = 0;  // main list: entry head is the candidate (key mk); raw entries head+1, head+2 prefetched
  uint32_t mk = key_of(asc[0]), raw1 = asc[1], raw2 = asc[2];
  uint32_t p[kPartialRegs];  // the partial set's largest keys, descending (0 = empty)
#pragma unroll
  for (int i = 0; i < kPartialRegs; ++i) p[i] = 0;
  int nov = 0;          // keys in the overflow (each below every register key)
  uint32_t ovmax = 0;   // the overflow's largest key
  if (!kSmallS)
    for (int t = 0; t < R; ++t) used[t] = 0;
  int nrec = 0;
  int exc = v0.w - tau, cap = v0.x, e = v0.y, k = 0, kend = v0.z;
  int4 nx = vi[1], nr = vi[kend];  // positions k + 1 (the rank's next expert) and kend (the next rank's first)
  uint32_t best = max(mk, p[0]);   // the best candidate's key (slack << 6 | 63 - rank)
  bool feasible = false;
#if defined(RDEP_GPU_PLANNER_STEP_STAMPS)
  int nst = 0;  // measurement build: the clock and (transfers, visit position, overflow keys) at every step
#endif
  if (static_cast<int>(best >> kFastRankBits) >= umin) {  // else no admissible target with u_min of slack
    while (true) {
#if defined(RDEP_GPU_PLANNER_STEP_STAMPS)
      if (kRecord && stamps != nullptr && nst < 2 * 255) {
        stamps[nst++] = static_cast<uint32_t>(clock());
        stamps[nst++] = (static_cast<uint32_t>(nrec) & 0xffu) | ((static_cast<uint32_t>(k) & 0xfffu) << 8) |
                        ((static_cast<uint32_t>(min(nov, 15))) << 28);
      }
#endif
      const uint32_t raw3 = asc[min(head + 3, last_raw)];  // used at the step's end, if the main list advances
      const int bs = static_cast<int>(best >> kFastRankBits);
      const int d = min(min(max(exc, umin), bs), cap);
      const bool ok = d >= umin;  // else this expert's remaining load is below u_min
      const bool fm = ok && best == mk, fp = ok && best != mk;
      const int t = 63 - static_cast<int>(best & 63u);
      const int ut = fm ? 0 : (kSmallS ? 1 : static_cast<int>(used[t]));
      if (ok) {
        if (kRecord) rec[nrec] = PackRecord(e, ut, t, d);
        if (!kSmallS) used[t] = static_cast<uint8_t>(ut + 1);
      }
      nrec += ok ? 1 : 0;
      // Partial set: drop the head on a partial pick, then insert the target again if it stays admissible
      // (only a visit's last transfer can leave the target with slack: every other one takes all of it).
      const int s2 = bs - d;
      uint32_t out;  // the key that leaves the registers for the overflow (0: none)
      if (kSmallS) {
        // N_slot <= 2: a partial pick never re-inserts (its rank has used its slots), a main pick may.
        // Insertion into a descending array by min/max: slot i takes max(p[i], min(p[i-1], nk)), no
        // compare-and-select ladder (integer selects and compares issue every other cycle).
        const uint32_t nk = fm && S == 2 && s2 > 0 ? (static_cast<uint32_t>(s2) << kFastRankBits) | (best & 63u) : 0u;
        out = fp ? 0u : min(nk, p[kPartialRegs - 1]);
        uint32_t np[kPartialRegs];
#pragma unroll
        for (int i = 0; i < kPartialRegs; ++i)
          np[i] = fp ? (i + 1 < kPartialRegs ? p[i + 1] : ovmax) : max(p[i], i == 0 ? nk : min(p[i - 1], nk));
#pragma unroll
        for (int i = 0; i < kPartialRegs; ++i) p[i] = np[i];
      } else {  // pop, then insert into what is left (a partial pick can re-insert its rank)
        uint32_t q[kPartialRegs];
#pragma unroll
        for (int i = 0; i < kPartialRegs; ++i) q[i] = fp ? (i + 1 < kPartialRegs ? p[i + 1] : ovmax) : p[i];
        const uint32_t nk = ok && s2 > 0 && ut + 1 < S ? (static_cast<uint32_t>(s2) << kFastRankBits) | (best & 63u) : 0u;
#pragma unroll
        for (int i = 0; i < kPartialRegs; ++i) p[i] = max(q[i], i == 0 ? nk : min(q[i - 1], nk));
        out = min(nk, q[kPartialRegs - 1]);
      }
      if ((fp && nov > 0) || out != 0) {  // the overflow (rare): its maximum moved up, or a key moved down
        if (fp && nov > 0) {
          int pos = 0;
          for (int i = 0; i < nov; ++i) pos = ov[i] == ovmax ? i : pos;
          ov[pos] = ov[--nov];
          uint32_t m = 0;
          for (int i = 0; i < nov; ++i) m = max(m, ov[i]);
          ovmax = m;
        }
        if (out != 0) {
          ov[nov++] = out;
          ovmax = max(ovmax, out);
        }
      }
      // Main list: advance on a main pick (the raw entries shift; the new load is needed two picks later).
      mk = fm ? key_of(raw1) : mk;
      raw1 = fm ? raw2 : raw1;
      raw2 = fm ? raw3 : raw2;
      head += fm ? 1 : 0;
      // The visit: go on (the expert has load and the rank excess left), or the rank's next expert, or
      // the next rank (the sentinel past the last one has load 0: the probe is feasible).
      const int exc2 = ok ? max(exc - d, 0) : exc, cap2 = ok ? cap - d : cap;
      const bool cont = ok && exc2 > 0 && cap2 > 0;
      const bool next_expert = !cont && exc2 > 0, next_rank = !cont && exc2 <= 0;
      const int kn = next_expert ? k + 1 : kend;
      const bool fail = next_expert && kn == kend;  // the rank's experts are spent with excess left
      const bool done = next_rank && nr.w <= tau;
      exc = next_rank ? nr.w - tau : exc2;
      cap = cont ? cap2 : (next_expert ? nx.x : nr.x);
      e = cont ? e : (next_expert ? nx.y : nr.y);
      kend = next_rank ? nr.z : kend;
      k = cont ? k : kn;
      nx = vi[k + 1];  // both within the two sentinels at E, E + 1 even on the exit step
      nr = vi[kend];
      best = max(mk, p[0]);
      if (done || fail || static_cast<int>(best >> kFastRankBits) < umin) {
        feasible = done;
        break;
      }
    }
  }
  *num_rec = nrec;
#if defined(RDEP_GPU_PLANNER_STEP_STAMPS)
  if (kRecord && stamps != nullptr) {
    stamps[nst++] = static_cast<uint32_t>(clock());
    stamps[nst++] = 0xffffffffu;
  }
#endif
  return feasible;
}

}  // namespace gpu_planner_detail
}  // namespace rdep
