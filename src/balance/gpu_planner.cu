// The GPU UltraEP quota planner (see gpu_planner.h): one thread block of 1024 threads, state in shared
// memory, bitwise the same plan as the host planner (quota_planner.cc). Any change to the oracle,
// tie-breaking or rounding there must be mirrored here; GpuPlanner.MatchesHost* checks it.
#include "rdep/balance/gpu_planner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>

namespace rdep {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 1024;
constexpr int kDefaultProbeWarps = 31;  // 2^d - 1: d levels of the binary search per round  // a lane owns ranks lane + 32*j, j < 32: one bit of a uint32 dup mask

#define RDEP_CUDA_RETURN(expr)                                                                              \
  do {                                                                                                      \
    cudaError_t rdep_err_ = (expr);                                                                         \
    if (rdep_err_ != cudaSuccess) {                                                                         \
      (void)cudaGetLastError();                                                                             \
      return Status(StatusCode::kCudaError, std::string(#expr) + " failed at " + __FILE__ + ":" +           \
                                                std::to_string(__LINE__) + ": " + cudaGetErrorString(rdep_err_)); \
    }                                                                                                       \
  } while (0)

// Shared-memory layout, computed identically on host (for the size) and device (for the pointers).
// int64 arrays first (8-byte aligned), then int32 arrays. "Visit order" = the order in which every
// probe walks the experts: ranks by descending load, each rank's main experts by descending load.
struct Layout {
  // int64 offsets (in elements of int64)
  size_t rr = 0, lam = 0, ell = 0, ell_sorted = 0, vlam = 0, slk = 0, node_lo = 0, node_hi = 0, rec_amount = 0,
         wrec_amount = 0, misc64 = 0, n64 = 0;
  // int32 offsets (in elements of int32, after the int64 block)
  size_t owner = 0, cnt = 0, expert_first = 0, grp = 0, gidx = 0, rank_order = 0, rank_pos = 0, vfirst = 0, vexp = 0,
         used = 0, feas = 0, rec_e = 0, rec_t = 0, rec_s = 0, wrec_e = 0, wrec_t = 0, wrec_s = 0, wnrec = 0,
         rep_first = 0, rep_count = 0, inst_off = 0, multi = 0, misc32 = 0, stage = 0, n32 = 0;
  Layout() = default;
  // staged: the load matrix is copied into shared memory as int32 (entries < 2^31 checked on host).
  __host__ __device__ Layout(int R, int E, int S, int pw, bool staged) {
    const size_t r = static_cast<size_t>(R), e = static_cast<size_t>(E), rs = r * static_cast<size_t>(S);
    size_t o = 0;
    rr = o; o += kWarps * 64;                        // [warp][2][32] reroute exchange (16-byte aligned)
    lam = o; o += e;                                 // [E] expert loads
    ell = o; o += r;                                 // [R] rank loads
    ell_sorted = o; o += r;                          // [R] rank loads in visit order
    vlam = o; o += e;                                // [E] expert loads in visit order
    slk = o; o += static_cast<size_t>(pw) * r;       // [pw][R] generic probe: per-warp slack
    node_lo = o; o += kWarps + 1;                    // search-tree node intervals (1-based heap order)
    node_hi = o; o += kWarps + 1;
    rec_amount = o; o += rs;                         // recorded transfers of the solved threshold
    wrec_amount = o; o += static_cast<size_t>(pw) * rs;  // [pw][R*S] transfers of each probe warp
    misc64 = o; o += 4;                              // lo, hi
    n64 = o;
    o = 0;
    owner = o; o += e;                               // [E] owner rank
    cnt = o; o += r;                                 // [R] main experts per rank
    expert_first = o; o += r + 1;                    // [R+1] owner groups in grp
    grp = o; o += e;                                 // [E] experts grouped by owner (unordered in a group)
    gidx = o; o += e;                                // [E] slot in the group, then position in the sorted group
    rank_order = o; o += r;                          // [R] ranks by descending load, ascending id
    rank_pos = o; o += r;                            // [R] inverse of rank_order
    vfirst = o; o += r + 1;                          // [R+1] visit position ri -> its experts in vexp
    vexp = o; o += e;                                // [E] experts in visit order
    used = o; o += static_cast<size_t>(pw) * r;      // [pw][R] generic probe: per-warp used slots
    feas = o; o += kWarps + 1;                       // probe result per search-tree node
    rec_e = o; o += rs;
    rec_t = o; o += rs;
    rec_s = o; o += rs;
    wrec_e = o; o += static_cast<size_t>(pw) * rs;   // [pw][R*S] per probe warp (expert, rank, slot)
    wrec_t = o; o += static_cast<size_t>(pw) * rs;
    wrec_s = o; o += static_cast<size_t>(pw) * rs;
    wnrec = o; o += kWarps + 1;                      // transfers recorded by each probe warp
    rep_first = o; o += e;                           // [E] first transfer of the expert
    rep_count = o; o += e;                           // [E] number of replicas
    inst_off = o; o += e + 1;                        // [E+1] plan instance offsets
    multi = o; o += e;                               // experts with replicas (any order)
    misc32 = o; o += 8;                              // see kAnyFeasible...
    stage = o; o += staged ? r * e : 0;
    n32 = o;
  }
  __host__ __device__ size_t bytes() const { return n64 * 8 + n32 * 4; }
};

// Thread 0's clock64 at: start, after setup, after the search, after recording, after the tables'
// preparation, the latest end of a replicated expert's reroute, the latest end of the instance tables
// and single-instance routes (both from the warps' own clocks), the end.
constexpr int kNumPhaseStamps = 8;

// misc32 slots.
constexpr int kAnyFeasible = 0, kNumRec = 1, kNumProbes = 2, kDeadMask = 3, kNumMulti = 4, kFastProbe = 5,
              kCopyFrom = 6;  // probe warp + 1 whose records hold the latest feasible threshold, 0 = none

struct KernelArgs {
  const int64_t* load;   // [R*E]
  const int32_t* owner;  // [E]
  int R, E, S, pw, staged;
  int64_t umin;
  int locality;
  int64_t* out_misc;        // [4]: tau, num transfers, num probes, error flag
  int64_t* out_phase;       // [8] clock64 at phase boundaries (thread 0), or null
  int32_t* tr_expert;       // [R*S]
  int32_t* tr_rank;         // [R*S]
  int32_t* tr_slot;         // [R*S]
  int64_t* tr_amount;       // [R*S]
  int32_t* inst_offsets;    // [E+1]
  int32_t* inst_expert;     // [I_max]
  int32_t* inst_rank;       // [I_max]
  int32_t* inst_slot;       // [I_max]
  int64_t* inst_quota;      // [I_max]
  int32_t* slot_expert;     // [R*S]
  int64_t* route;           // [R*I] with the plan's I (<= I_max = E + R*S)
  int64_t* scratch;         // [3*I_max]: residual quota, take, local rows per instance (fallback reroute)
  Layout layout;            // shared-memory offsets, computed on the host (kernel parameters stay in the
                            // constant bank, so the compiler rematerializes pointers instead of spilling)
};

struct Shared {
  int64_t *rr, *lam, *ell, *ell_sorted, *vlam, *slk, *node_lo, *node_hi, *rec_amount, *wrec_amount, *misc64;
  int32_t *owner, *cnt, *expert_first, *grp, *gidx, *rank_order, *rank_pos, *vfirst, *vexp, *used, *feas, *rec_e,
      *rec_t, *rec_s, *wrec_e, *wrec_t, *wrec_s, *wnrec, *rep_first, *rep_count, *inst_off, *multi, *misc32, *stage;
};

__device__ Shared Carve(char* base, const Layout& L) {
  Shared s;
  int64_t* b64 = reinterpret_cast<int64_t*>(base);
  int32_t* b32 = reinterpret_cast<int32_t*>(b64 + L.n64);
  s.rr = b64 + L.rr; s.lam = b64 + L.lam; s.ell = b64 + L.ell; s.ell_sorted = b64 + L.ell_sorted; s.vlam = b64 + L.vlam;
  s.slk = b64 + L.slk; s.node_lo = b64 + L.node_lo; s.node_hi = b64 + L.node_hi; s.rec_amount = b64 + L.rec_amount;
  s.wrec_amount = b64 + L.wrec_amount; s.misc64 = b64 + L.misc64;
  s.owner = b32 + L.owner; s.cnt = b32 + L.cnt; s.expert_first = b32 + L.expert_first; s.grp = b32 + L.grp;
  s.gidx = b32 + L.gidx; s.rank_order = b32 + L.rank_order; s.rank_pos = b32 + L.rank_pos; s.vfirst = b32 + L.vfirst;
  s.vexp = b32 + L.vexp; s.used = b32 + L.used; s.feas = b32 + L.feas; s.rec_e = b32 + L.rec_e;
  s.rec_t = b32 + L.rec_t; s.rec_s = b32 + L.rec_s; s.rep_first = b32 + L.rep_first; s.rep_count = b32 + L.rep_count;
  s.wrec_e = b32 + L.wrec_e; s.wrec_t = b32 + L.wrec_t; s.wrec_s = b32 + L.wrec_s; s.wnrec = b32 + L.wnrec;
  s.inst_off = b32 + L.inst_off; s.multi = b32 + L.multi; s.misc32 = b32 + L.misc32; s.stage = b32 + L.stage;
  return s;
}

// Exclusive scan by one whole warp: out[i] = sum of get(0..i-1) for i < n, out[n] = the total. Lane l
// scans a contiguous chunk; out may alias the array get reads (each element is read before written).
template <typename Get>
__device__ void WarpExclusiveScan(int n, Get get, int32_t* out) {
  const int lane = threadIdx.x & 31;
  const int per = (n + 31) / 32, begin = lane * per, end = begin + per < n ? begin + per : n;
  int sum = 0;
  for (int i = begin; i < end; ++i) sum += get(i);
  int inc = sum;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += v;
  }
  int run = inc - sum;
  for (int i = begin; i < end; ++i) {
    const int v = get(i);
    out[i] = run;
    run += v;
  }
  if (lane == 31) out[n] = inc;
}

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

// The same oracle for R <= 64 and rank loads below 2^26 (checked in the kernel): every rank's state
// lives in registers of the lane that owns it (ranks lane and lane+32), loads and slacks are int32,
// and the target search is one redux.sync over packed keys (slack << 6 | 63 - rank): the max key is
// the largest slack, lowest rank on ties, exactly the host's rule; key 0 = not admissible. The
// overloaded rank itself has slack 0, so "t != r" holds without a test.
constexpr int kFastRankBits = 6;
constexpr int64_t kFastLoadLimit = int64_t{1} << (32 - kFastRankBits);

// Fast-probe transfer record: amount (< 2^26, below the load limit) | rank << 26 in the low word,
// expert | slot << 24 in the high word (the fast probe also needs E < 2^24 and N_slot < 2^8).
constexpr int kFastAmountBits = 32 - kFastRankBits;
__device__ __forceinline__ uint64_t PackFastRecord(int e, int slot, uint32_t tbits, int d) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(e) | (static_cast<uint32_t>(slot) << 24)) << 32) |
         (tbits | static_cast<uint32_t>(d));
}

__device__ __forceinline__ uint32_t FastKey(int slk, int used, int S, int t) {
  return slk > 0 && used < S ? (static_cast<uint32_t>(slk) << kFastRankBits) | static_cast<uint32_t>(63 - t) : 0u;
}

__device__ bool WarpProbeFast(const Shared& s, int tau, int R, int S, int umin, uint32_t ancestors, size_t rec_base,
                              int* num_rec) {
  const int lane = threadIdx.x & 31;
  const int t0 = lane, t1 = lane + 32;
  int slk0 = t0 < R ? max(tau - static_cast<int>(s.ell[t0]), 0) : 0;
  int slk1 = t1 < R ? max(tau - static_cast<int>(s.ell[t1]), 0) : 0;
  int used0 = 0, used1 = 0;
  uint32_t key0 = FastKey(slk0, used0, S, t0), key1 = FastKey(slk1, used1, S, t1);
  // One packed 64-bit record per transfer (see PackFastRecord): one shared store on the step path.
  uint64_t* rec = reinterpret_cast<uint64_t*>(s.wrec_amount + rec_base);
  const uint32_t tbits0 = static_cast<uint32_t>(t0) << kFastAmountBits, tbits1 = static_cast<uint32_t>(t1) << kFastAmountBits;
  int nrec = 0;
  bool feasible = true;
  int l_next = R > 0 ? static_cast<int>(s.ell_sorted[0]) : 0;
  int k_next = s.vfirst[0];
  for (int ri = 0; ri < R; ++ri) {
    const int l = l_next;
    if (l <= tau) break;
    const int kbegin = k_next, kend = s.vfirst[ri + 1];
    // Prefetch the next rank's load; the dead flag is read once per rank.
    l_next = ri + 1 < R ? static_cast<int>(s.ell_sorted[ri + 1]) : 0;
    k_next = kend;
    if (Dead(s, ancestors)) return false;
    int exc = l - tau;
    int cap_next = kbegin < kend ? static_cast<int>(s.vlam[kbegin]) : 0;
    int e_next = kbegin < kend ? s.vexp[kbegin] : 0;
    for (int k = kbegin; k < kend && exc > 0; ++k) {
      int cap = cap_next;
      const int e = e_next;  // expert and load come from registers: no shared load on the step path
      cap_next = k + 1 < kend ? static_cast<int>(s.vlam[k + 1]) : 0;
      e_next = k + 1 < kend ? s.vexp[k + 1] : 0;
      bool dup0 = false, dup1 = false;  // rank t0 / t1 already hosts this expert
      while (exc > 0 && cap > 0) {
        const uint32_t c0 = dup0 ? 0u : key0, c1 = dup1 ? 0u : key1;
        const uint32_t best = __reduce_max_sync(0xffffffffu, c0 > c1 ? c0 : c1);
        if (best == 0) break;
        const int best_s = static_cast<int>(best >> kFastRankBits);
        const int best_t = 63 - static_cast<int>(best & 63u);
        int d = exc > umin ? exc : umin;  // shed at least u_min (same as the host oracle)
        d = d < best_s ? d : best_s;
        d = d < cap ? d : cap;
        if (d < umin) break;
        if (best_t == t0) {  // the target's lane records the transfer and updates its rank
          rec[nrec] = PackFastRecord(e, used0, tbits0, d);
          slk0 -= d;
          ++used0;
          key0 = FastKey(slk0, used0, S, t0);
          dup0 = true;
        } else if (best_t == t1) {
          rec[nrec] = PackFastRecord(e, used1, tbits1, d);
          slk1 -= d;
          ++used1;
          key1 = FastKey(slk1, used1, S, t1);
          dup1 = true;
        }
        ++nrec;
        exc = exc > d ? exc - d : 0;
        cap -= d;
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

// floor(a / D) and a mod D for a reroute step, a = d * ru < 2^50 (d, ru < 2^25), 1 <= D < 2^25, from a double
// reciprocal: the estimate (exact product, relative error ~2^-52) is within one of the quotient and one
// correction step makes it exact. The quotient is at most d
// (ru <= D) and the true remainder of the estimate lies in (-D, 2D), so both fit 32 bits and the
// correction can run in 32-bit arithmetic (the product's low word is all it needs).
__device__ __forceinline__ int DivModFast32(int64_t a, int D, double inv_d, int* rem) {
  int q = static_cast<int>(static_cast<double>(a) * inv_d);
  int r = static_cast<int>(static_cast<uint32_t>(a) - static_cast<uint32_t>(q) * static_cast<uint32_t>(D));
  const bool under = r < 0, over = r >= D;
  q += over ? 1 : (under ? -1 : 0);
  r += under ? D : (over ? -D : 0);
  *rem = r;
  return q;
}

// Experts with a replica: loads below this and at most 32 instances use the one-warp reroute.
constexpr int64_t kFastRerouteLoadLimit = int64_t{1} << 25;

// Reroute of one expert by one thread (the direct form of SolveReroute's loop), for experts the
// warp path cannot take. Route entries of the expert are zeroed first.
__device__ void RerouteOneThread(const KernelArgs& a, const Shared& s, int e, int I) {
  const int R = a.R, E = a.E;
  auto ld = [&](int r, int x) -> int64_t {
    const size_t k = static_cast<size_t>(r) * E + x;
    return a.staged ? static_cast<int64_t>(s.stage[k]) : a.load[k];
  };
  const int b = s.inst_off[e], k = 1 + s.rep_count[e], f = s.rep_first[e];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < k; ++i) a.route[static_cast<size_t>(r) * I + b + i] = 0;
  int64_t moved = 0;
  for (int c = 0; c < k - 1; ++c) moved += s.rec_amount[f + c];
  auto host = [&](int i) { return i == 0 ? s.owner[e] : s.rec_t[f + i - 1]; };
  auto quota = [&](int i) { return i == 0 ? s.lam[e] - moved : s.rec_amount[f + i - 1]; };
  const size_t imax = static_cast<size_t>(E) + static_cast<size_t>(R) * a.S;
  int64_t* ru = a.scratch + b;
  int64_t* take = a.scratch + imax + b;
  int64_t* local = a.scratch + 2 * imax + b;
  int64_t D = 0;
  for (int i = 0; i < k; ++i) {
    int64_t l = 0;
    if (a.locality) {
      const int64_t lr = ld(host(i), e), q = quota(i);
      l = lr < q ? lr : q;
    }
    local[i] = l;
    a.route[static_cast<size_t>(host(i)) * I + b + i] = l;
    ru[i] = quota(i) - l;
    D += ru[i];
  }
#pragma unroll 1
  for (int r = 0; r < R; ++r) {
    int64_t d = ld(r, e);
    for (int i = 0; i < k; ++i)
      if (host(i) == r) d -= local[i];
    if (d == 0) continue;
    if (D <= 0) {
      a.out_misc[3] = 1;
      break;
    }
    int64_t sum = 0;
    for (int i = 0; i < k; ++i) sum += d * ru[i] / D;
    const int64_t left = d - sum;
#pragma unroll 1
    for (int i = 0; i < k; ++i) {
      const int64_t ri = d * ru[i] % D;
      int64_t ahead = 0;
      for (int j2 = 0; j2 < k; ++j2) {
        const int64_t rj = d * ru[j2] % D;
        if (rj > ri || (rj == ri && j2 < i)) ++ahead;
      }
      take[i] = d * ru[i] / D + (ahead < left ? 1 : 0);
    }
#pragma unroll 1
    for (int i = 0; i < k; ++i) {
      a.route[static_cast<size_t>(r) * I + b + i] += take[i];
      ru[i] -= take[i];
    }
    D -= d;
  }
}

__global__ void __launch_bounds__(kThreads, 1) QuotaPlanKernel(KernelArgs a) {
  extern __shared__ __align__(16) char smem[];
  const Shared s = Carve(smem, a.layout);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int R = a.R, E = a.E;
  auto stamp = [&](int i) {
    if (a.out_phase != nullptr && tid == 0) a.out_phase[i] = clock64();
  };
  stamp(0);
  // Phase 0: stage the load matrix (row-major [R][E]) into shared memory when it fits.
  if (a.staged) {
    for (size_t k = tid; k < static_cast<size_t>(R) * E; k += kThreads) s.stage[k] = static_cast<int32_t>(a.load[k]);
  }
  for (int r = tid; r < R; r += kThreads) {
    s.ell[r] = 0;
    s.cnt[r] = 0;
  }
  if (tid < 8) s.misc32[tid] = 0;
  if (tid == 0) a.out_misc[3] = 0;
  __syncthreads();
  auto ld = [&](int r, int e) -> int64_t {
    const size_t k = static_cast<size_t>(r) * E + e;
    return a.staged ? static_cast<int64_t>(s.stage[k]) : a.load[k];
  };

  // Phase 1: expert loads, rank loads, the visiting order.
  for (int e = tid; e < E; e += kThreads) {
    const int o = a.owner[e];
    s.owner[e] = o;
    int64_t sum = 0;
    for (int r = 0; r < R; ++r) sum += ld(r, e);
    s.lam[e] = sum;
    atomicAdd(reinterpret_cast<unsigned long long*>(s.ell + o), static_cast<unsigned long long>(sum));
    s.gidx[e] = atomicAdd(s.cnt + o, 1);
  }
  __syncthreads();
  if (warp == 0) {
    WarpExclusiveScan(R, [&](int r) { return s.cnt[r]; }, s.expert_first);
    int64_t total = 0, hi = 0;
    for (int r = lane; r < R; r += 32) {
      total += s.ell[r];
      hi = s.ell[r] > hi ? s.ell[r] : hi;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      total += __shfl_xor_sync(0xffffffffu, total, off);
      const int64_t oh = __shfl_xor_sync(0xffffffffu, hi, off);
      hi = oh > hi ? oh : hi;
    }
    if (lane == 0) {
      s.misc64[0] = (total + R - 1) / R;  // lo
      s.misc64[1] = hi;
      s.misc32[kFastProbe] = (R <= 64 && hi < kFastLoadLimit && E < (1 << 24) && a.S < 256) ? 1 : 0;
    }
  } else {
    // Rank order: one warp per rank counts the ranks ahead of it.
    for (int r = warp - 1; r < R; r += kWarps - 1) {
      const int64_t lr = s.ell[r];
      unsigned ahead = 0;
      for (int q = lane; q < R; q += 32) ahead += (s.ell[q] > lr || (s.ell[q] == lr && q < r)) ? 1u : 0u;
      ahead = __reduce_add_sync(0xffffffffu, ahead);
      if (lane == 0) {
        s.rank_order[ahead] = r;
        s.rank_pos[r] = static_cast<int>(ahead);
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) s.grp[s.expert_first[s.owner[e]] + s.gidx[e]] = e;
  for (int ri = tid; ri < R; ri += kThreads) s.ell_sorted[ri] = s.ell[s.rank_order[ri]];
  __syncthreads();
  if (warp == 0) WarpExclusiveScan(R, [&](int ri) { return s.cnt[s.rank_order[ri]]; }, s.vfirst);
  for (int e = tid; e < E; e += kThreads) {
    // Position in the owner's group: descending load, ascending id.
    const int o = s.owner[e];
    const int64_t le = s.lam[e];
    int pos = 0;
    for (int g = s.expert_first[o]; g < s.expert_first[o + 1]; ++g) {
      const int f = s.grp[g];
      pos += (s.lam[f] > le || (s.lam[f] == le && f < e)) ? 1 : 0;
    }
    s.gidx[e] = pos;
  }
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) {
    const int k = s.vfirst[s.rank_pos[s.owner[e]]] + s.gidx[e];
    s.vexp[k] = e;
    s.vlam[k] = s.lam[e];
  }
  __syncthreads();
  stamp(1);
  const bool fast = s.misc32[kFastProbe] != 0;
  const int umin32 = static_cast<int>(a.umin < (int64_t{1} << 30) ? a.umin : (int64_t{1} << 30));

  // Phase 2: speculative binary search. Node n (1-based heap order) holds the interval the host's
  // binary search would have after the decisions on its path; left child = feasible (hi = tau).
  // Warp w probes node w+1; a finished probe marks the child it rules out as dead, and probes below
  // a dead node stop early (their results are never read). Every probe records its transfers in its
  // warp's buffer; after each round the buffer of the round's last feasible node on the path (the
  // threshold the search holds as hi) is copied out, so the solved threshold needs no re-run.
  const size_t rs_total = static_cast<size_t>(R) * a.S;
  uint32_t ancestors = 0;  // dead-mask bits of this warp's node and its ancestors below the root
  if (warp < a.pw)
    for (int n = warp + 1; n > 1; n >>= 1) ancestors |= 1u << n;
  while (true) {
    if (const int from = s.misc32[kCopyFrom]; from != 0) {
      const size_t base = static_cast<size_t>(from - 1) * rs_total;
      for (int k = tid; k < s.wnrec[from - 1]; k += kThreads) {
        if (fast) {
          const uint64_t v = static_cast<uint64_t>(s.wrec_amount[base + k]);
          const uint32_t lo = static_cast<uint32_t>(v), hi = static_cast<uint32_t>(v >> 32);
          s.rec_e[k] = static_cast<int>(hi & 0xffffffu);
          s.rec_t[k] = static_cast<int>(lo >> kFastAmountBits);
          s.rec_s[k] = static_cast<int>(hi >> 24);
          s.rec_amount[k] = static_cast<int64_t>(lo & ((1u << kFastAmountBits) - 1));
        } else {
          s.rec_e[k] = s.wrec_e[base + k];
          s.rec_t[k] = s.wrec_t[base + k];
          s.rec_s[k] = s.wrec_s[base + k];
          s.rec_amount[k] = s.wrec_amount[base + k];
        }
      }
    }
    if (tid == 0) {
      s.node_lo[1] = s.misc64[0];
      s.node_hi[1] = s.misc64[1];
      for (int n = 2; n <= a.pw; ++n) {
        const int64_t plo = s.node_lo[n / 2], phi = s.node_hi[n / 2];
        if (plo < phi) {
          const int64_t tau = plo + (phi - plo) / 2;
          s.node_lo[n] = (n & 1) ? tau + 1 : plo;
          s.node_hi[n] = (n & 1) ? phi : tau;
        } else {
          s.node_lo[n] = plo;
          s.node_hi[n] = phi;
        }
      }
      s.misc32[kDeadMask] = 0;
    }
    __syncthreads();
    if (s.misc64[0] >= s.misc64[1]) break;
    if (warp < a.pw) {
      const int n = warp + 1;
      const int64_t lo = s.node_lo[n], hi = s.node_hi[n];
      if (lo < hi) {
        const int64_t tau = lo + (hi - lo) / 2;
        const size_t rec_base = static_cast<size_t>(warp) * rs_total;
        int nrec = 0;
        const bool f = fast ? WarpProbeFast(s, static_cast<int>(tau), R, a.S, umin32, ancestors, rec_base, &nrec)
                            : WarpProbe(s, tau, R, a.S, a.umin, s.slk + static_cast<size_t>(warp) * R,
                                        s.used + static_cast<size_t>(warp) * R, ancestors, rec_base, &nrec);
        if (lane == 0) {
          s.feas[n] = f ? 1 : 0;
          s.wnrec[warp] = nrec;
          const int ruled_out = 2 * n + (f ? 1 : 0);
          if (ruled_out <= a.pw) atomicOr(s.misc32 + kDeadMask, static_cast<int>(1u << ruled_out));
        }
      }
    }
    __syncthreads();
    if (tid == 0) {
      int64_t lo = s.misc64[0], hi = s.misc64[1];
      int n = 1;
      s.misc32[kCopyFrom] = 0;
      while (n <= a.pw && lo < hi) {
        const int64_t tau = lo + (hi - lo) / 2;
        s.misc32[kNumProbes] += 1;
        if (s.feas[n]) {
          hi = tau;
          s.misc32[kAnyFeasible] = 1;
          s.misc32[kCopyFrom] = n;  // warp n-1 probed node n
          s.misc32[kNumRec] = s.wnrec[n - 1];
          n = 2 * n;
        } else {
          lo = tau + 1;
          n = 2 * n + 1;
        }
      }
      s.misc64[0] = lo;
      s.misc64[1] = hi;
    }
    __syncthreads();
  }
  stamp(2);

  // Phase 3: the solved threshold's transfers are in rec_* (copied at the top of the last round).
  for (int e = tid; e < E; e += kThreads) s.rep_count[e] = 0;
  __syncthreads();
  stamp(3);
  const int nrec = s.misc32[kNumRec];
  if (tid == 0) {
    a.out_misc[0] = s.misc64[1];
    a.out_misc[1] = nrec;
    a.out_misc[2] = s.misc32[kNumProbes];
  }
  // Transfers of one expert are contiguous (each expert is visited once per probe).
  for (int k = tid; k < nrec; k += kThreads) {
    const int e = s.rec_e[k];
    a.tr_expert[k] = e;
    a.tr_rank[k] = s.rec_t[k];
    a.tr_slot[k] = s.rec_s[k];
    a.tr_amount[k] = s.rec_amount[k];
    if (k == 0 || s.rec_e[k - 1] != e) s.rep_first[e] = k;
    atomicAdd(s.rep_count + e, 1);
  }
  for (int k = tid; k < R * a.S; k += kThreads) a.slot_expert[k] = -1;
  __syncthreads();
  if (warp == 0) WarpExclusiveScan(E, [&](int e) { return 1 + s.rep_count[e]; }, s.inst_off);
  for (int e = tid; e < E; e += kThreads)
    if (s.rep_count[e] > 0) s.multi[atomicAdd(s.misc32 + kNumMulti, 1)] = e;
  if (tid == 0) s.misc64[2] = s.misc64[3] = 0;  // latest end of the replicated / single-instance work
  __syncthreads();
  stamp(4);
  const int I = s.inst_off[E];
  const int num_multi = s.misc32[kNumMulti];
  // Warps 0..busy-1 each reroute a replicated expert (the long sequential part); when at least 4 warps
  // are left over, they alone write the instance tables and the single-instance routes meanwhile.
  const int busy = num_multi < kWarps ? num_multi : kWarps;
  const bool split = kWarps - busy >= 4;
  auto mark_end = [&](int slot) {
    if (a.out_phase != nullptr && lane == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(s.misc64 + slot), static_cast<unsigned long long>(clock64()));
  };

  // Phase 4: the reroute (same math as SolveReroute) and the instance tables.
  // Experts with replicas: one warp each. Lane i owns instance i (registers); per source (ascending)
  // the floors come from DivModFast32, the largest remainders from packed keys (rem << 5 | 31 - i):
  // a larger key = larger remainder, lower instance on ties, exactly the host's order. Sources come
  // in chunks of 32: lane j first computes source r0+j's residual demand (its rows minus the local
  // rows of an instance it hosts), then the warp walks the chunk reading it by shuffle.
  for (int m = warp; m < num_multi; m += kWarps) {
    const int e = s.multi[m];
    const int b = s.inst_off[e], k = 1 + s.rep_count[e], f = s.rep_first[e];
    if (k > 32 || s.lam[e] >= kFastRerouteLoadLimit) continue;  // fallback below
    const bool valid = lane < k;
    const int host = !valid ? -1 : lane == 0 ? s.owner[e] : s.rec_t[f + lane - 1];
    const int rq = valid && lane > 0 ? static_cast<int>(s.rec_amount[f + lane - 1]) : 0;
    const int moved = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(rq)));
    const int quota = lane == 0 ? static_cast<int>(s.lam[e]) - moved : rq;
    int local = 0;
    if (valid && a.locality) {
      const int lr = static_cast<int>(ld(host, e));
      local = lr < quota ? lr : quota;
    }
    int ru = quota - local;
    int D = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(ru)));
    bool error = false;
    uint2* xbuf = reinterpret_cast<uint2*>(s.rr) + 64 * warp;  // [2][32] (key, base) exchange buffers
    int parity = 0;
    for (int r0 = 0; r0 < R && !error; r0 += 32) {
      const int src = r0 + lane;
      int dsrc = src < R ? static_cast<int>(ld(src, e)) : 0;
      for (int i = 0; i < k; ++i) {
        const int hi_ = __shfl_sync(0xffffffffu, host, i), li = __shfl_sync(0xffffffffu, local, i);
        dsrc -= hi_ == src ? li : 0;
      }
      // The residual total before source r0+j does not depend on the takes: D minus the demands of
      // the chunk's earlier sources (a warp scan), so every lane precomputes its source's reciprocal.
      int before = dsrc;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, before, off);
        if (lane >= off) before += v;
      }
      before -= dsrc;
      const int d_at = D - before;
      const double inv_at = __drcp_rn(static_cast<double>(d_at > 0 ? d_at : 1));
      const int jend = R - r0 < 32 ? R - r0 : 32;
      for (int j = 0; j < jend; ++j) {
        const int r = r0 + j;
        const int d = __shfl_sync(0xffffffffu, dsrc, j);
        const double inv = __shfl_sync(0xffffffffu, inv_at, j);
        int take = 0;
        if (d != 0) {
          if (D <= 0) {
            if (lane == 0) a.out_misc[3] = 1;
            error = true;
            break;
          }
          int rem = 0;
          const int base = DivModFast32(static_cast<int64_t>(d) * ru, D, inv, &rem);
          // Largest remainders: instance i gets one more row if fewer than `left` = d - sum(base)
          // instances have a larger key (rem << 5 | 31 - i; distinct, larger = larger remainder, lower
          // instance on ties, the host's order). Every lane publishes (key, base) in this warp's
          // exchange buffer (two, alternating, so one __syncwarp per source suffices) and reads all k
          // back two at a time: no warp reduction on the per-source dependency chain.
          const uint32_t key = valid ? (static_cast<uint32_t>(rem) << 5) | static_cast<uint32_t>(31 - lane) : 0u;
          uint2* buf = xbuf + 32 * parity;
          parity ^= 1;
          buf[lane] = make_uint2(key, static_cast<uint32_t>(base));
          __syncwarp();
          const uint4* b4 = reinterpret_cast<const uint4*>(buf);
          int sum = 0, ahead = 0;
          for (int u = 0; u < (k + 1) / 2; ++u) {  // entry k (k odd) is (0, 0): not above a valid key, no rows
            const uint4 p = b4[u];
            sum += static_cast<int>(p.y + p.w);
            ahead += (p.x > key ? 1 : 0) + (p.z > key ? 1 : 0);
          }
          const int bump = ahead < d - sum ? 1 : 0;
          take = valid ? base + bump : 0;
          ru -= take;
          D -= d;
        }
        if (valid) a.route[static_cast<size_t>(r) * I + b + lane] = take + (host == r ? local : 0);
      }
    }
  }
  if (warp < busy) mark_end(2);
  // Instance tables (one thread per expert) and experts without replicas (every source's rows go to
  // the main instance), on the warps without a replicated expert when there are enough of them.
  if (!split || warp >= busy) {
    const int wi = split ? warp - busy : warp, nw = split ? kWarps - busy : kWarps;
    const int ti = wi * 32 + lane, nt = nw * 32;
    for (int e = ti; e <= E; e += nt) a.inst_offsets[e] = s.inst_off[e];
    for (int e = ti; e < E; e += nt) {
      const int b = s.inst_off[e], k = 1 + s.rep_count[e], f = s.rep_first[e];
      int64_t moved = 0;
      for (int c = 0; c < k - 1; ++c) moved += s.rec_amount[f + c];
      a.inst_expert[b] = e;
      a.inst_rank[b] = s.owner[e];
      a.inst_slot[b] = -1;
      a.inst_quota[b] = s.lam[e] - moved;
      for (int c = 0; c < k - 1; ++c) {
        a.inst_expert[b + 1 + c] = e;
        a.inst_rank[b + 1 + c] = s.rec_t[f + c];
        a.inst_slot[b + 1 + c] = s.rec_s[f + c];
        a.inst_quota[b + 1 + c] = s.rec_amount[f + c];
        a.slot_expert[s.rec_t[f + c] * a.S + s.rec_s[f + c]] = e;
      }
    }
    for (int r = wi; r < R; r += nw)
      for (int e = lane; e < E; e += 32)
        if (s.rep_count[e] == 0) a.route[static_cast<size_t>(r) * I + s.inst_off[e]] = ld(r, e);
    mark_end(3);
  }
  // Fallback (more than 32 instances or a load too large for the fast division): one thread each.
  for (int m = tid; m < num_multi; m += kThreads) {
    const int e = s.multi[m];
    if (s.rep_count[e] + 1 > 32 || s.lam[e] >= kFastRerouteLoadLimit) RerouteOneThread(a, s, e, I);
  }
  if (a.out_phase != nullptr) {
    __syncthreads();
    if (tid == 0) {
      a.out_phase[5] = s.misc64[2] != 0 ? static_cast<int64_t>(s.misc64[2]) : a.out_phase[4];
      a.out_phase[6] = s.misc64[3] != 0 ? static_cast<int64_t>(s.misc64[3]) : a.out_phase[4];
    }
    stamp(7);
  }
}

// Device buffers of one planner instance.
struct DeviceBuffers {
  int64_t* load = nullptr;
  int32_t* owner = nullptr;
  int64_t* misc = nullptr;
  int32_t *tr_expert = nullptr, *tr_rank = nullptr, *tr_slot = nullptr;
  int64_t* tr_amount = nullptr;
  int32_t *inst_offsets = nullptr, *inst_expert = nullptr, *inst_rank = nullptr, *inst_slot = nullptr;
  int64_t* inst_quota = nullptr;
  int32_t* slot_expert = nullptr;
  int64_t *route = nullptr, *scratch = nullptr, *phase = nullptr;
  ~DeviceBuffers() {
    for (void* p : {static_cast<void*>(load), static_cast<void*>(owner), static_cast<void*>(misc),
                    static_cast<void*>(tr_expert), static_cast<void*>(tr_rank), static_cast<void*>(tr_slot),
                    static_cast<void*>(tr_amount), static_cast<void*>(inst_offsets), static_cast<void*>(inst_expert),
                    static_cast<void*>(inst_rank), static_cast<void*>(inst_slot), static_cast<void*>(inst_quota),
                    static_cast<void*>(slot_expert), static_cast<void*>(route), static_cast<void*>(scratch),
                    static_cast<void*>(phase)})
      if (p) cudaFree(p);
  }
};

template <typename T>
Status Alloc(T** p, size_t n) {
  RDEP_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(p), std::max<size_t>(n, 1) * sizeof(T)));
  return Status::Ok();
}

StatusOr<GpuPlannerConfig> ChooseConfig(int32_t num_experts, int32_t num_ranks, int32_t num_slots, bool stage_ok) {
  if (num_experts < 1 || num_ranks < 1 || num_slots < 0)
    return InvalidArgument("GPU planner: need E >= 1, R >= 1, N_slot >= 0");
  if (num_ranks > kMaxRanks)
    return InvalidArgument("GPU planner: R=" + std::to_string(num_ranks) + " exceeds the one-block limit of " +
                           std::to_string(kMaxRanks));
  int dev = 0, optin = 0;
  RDEP_CUDA_RETURN(cudaGetDevice(&dev));
  RDEP_CUDA_RETURN(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  // RDEP_GPU_PLANNER_PROBE_WARPS caps the probe warps (for measuring the levels-per-round trade-off).
  int max_pw = kDefaultProbeWarps;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_PROBE_WARPS"); env != nullptr && std::atoi(env) >= 1)
    max_pw = std::min(31, std::atoi(env));
  for (int pw = 31; pw >= 1; pw = (pw - 1) / 2) {  // 31, 15, 7, 3, 1 warps: 5..1 levels per round
    if (pw > max_pw) continue;
    for (bool staged : {true, false}) {
      if (staged && !stage_ok) continue;
      const size_t bytes = Layout(num_ranks, num_experts, num_slots, pw, staged).bytes();
      if (bytes <= static_cast<size_t>(optin)) return GpuPlannerConfig{bytes, pw, staged};
    }
  }
  return InvalidArgument("GPU planner: E=" + std::to_string(num_experts) + ", R=" + std::to_string(num_ranks) +
                         ", N_slot=" + std::to_string(num_slots) + " does not fit one block's shared memory (" +
                         std::to_string(optin) + " bytes)");
}

struct Prepared {
  int R = 0, E = 0, S = 0;
  GpuPlannerConfig cfg;
  DeviceBuffers buf;
  KernelArgs args{};
};

Status Prepare(const std::vector<int64_t>& load, const OwnershipMap& owners, const QuotaConfig& config,
               Prepared* p) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  RDEP_RETURN_IF_ERROR(config.Validate(owners.num_experts()));
  std::string why;
  if (!GpuPlannerAvailable(&why)) return Unavailable("GPU planner: " + why);
  p->R = owners.num_ranks();
  p->E = owners.num_experts();
  p->S = config.num_slots;
  bool fits32 = true;
  for (int64_t v : load) fits32 = fits32 && v <= INT32_MAX;
  RDEP_ASSIGN_OR_RETURN(p->cfg, ChooseConfig(p->E, p->R, p->S, fits32));
  const size_t R = static_cast<size_t>(p->R), E = static_cast<size_t>(p->E), RS = R * static_cast<size_t>(p->S);
  const size_t imax = E + RS;
  DeviceBuffers& b = p->buf;
  RDEP_RETURN_IF_ERROR(Alloc(&b.load, R * E));
  RDEP_RETURN_IF_ERROR(Alloc(&b.owner, E));
  RDEP_RETURN_IF_ERROR(Alloc(&b.misc, 4));
  RDEP_RETURN_IF_ERROR(Alloc(&b.tr_expert, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.tr_rank, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.tr_slot, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.tr_amount, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_offsets, E + 1));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_expert, imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_rank, imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_slot, imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_quota, imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.slot_expert, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.route, R * imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.scratch, 3 * imax));
  RDEP_CUDA_RETURN(cudaMemcpy(b.load, load.data(), R * E * sizeof(int64_t), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN(cudaMemcpy(b.owner, owners.owners().data(), E * sizeof(int32_t), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN(cudaMemset(b.misc, 0, 4 * sizeof(int64_t)));
  RDEP_CUDA_RETURN(cudaFuncSetAttribute(QuotaPlanKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(p->cfg.shared_bytes)));
  KernelArgs& a = p->args;
  a.load = b.load;
  a.owner = b.owner;
  a.R = p->R;
  a.E = p->E;
  a.S = p->S;
  a.pw = p->cfg.probe_warps;
  a.staged = p->cfg.staged_load ? 1 : 0;
  a.umin = config.min_quota;
  a.locality = config.locality ? 1 : 0;
  a.out_misc = b.misc;
  a.tr_expert = b.tr_expert;
  a.tr_rank = b.tr_rank;
  a.tr_slot = b.tr_slot;
  a.tr_amount = b.tr_amount;
  a.inst_offsets = b.inst_offsets;
  a.inst_expert = b.inst_expert;
  a.inst_rank = b.inst_rank;
  a.inst_slot = b.inst_slot;
  a.inst_quota = b.inst_quota;
  a.slot_expert = b.slot_expert;
  a.route = b.route;
  a.scratch = b.scratch;
  a.layout = Layout(a.R, a.E, a.S, a.pw, a.staged != 0);
  return Status::Ok();
}

Status Launch(const Prepared& p, cudaStream_t stream) {
  QuotaPlanKernel<<<1, kThreads, p.cfg.shared_bytes, stream>>>(p.args);
  RDEP_CUDA_RETURN(cudaGetLastError());
#if defined(RDEP_DEBUG_SYNC)
  RDEP_CUDA_RETURN(cudaStreamSynchronize(stream));
#endif
  return Status::Ok();
}

}  // namespace

bool GpuPlannerAvailable(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(err) + ")";
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device present";
    return false;
  }
  return true;
}

StatusOr<GpuPlannerConfig> GpuPlannerCanImplement(int32_t num_experts, int32_t num_ranks, int32_t num_slots) {
  return ChooseConfig(num_experts, num_ranks, num_slots, true);
}


StatusOr<BalancePlan> SolveQuotaPlanGpu(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                        const QuotaConfig& config) {
  Prepared p;
  RDEP_RETURN_IF_ERROR(Prepare(load, owners, config, &p));
  RDEP_RETURN_IF_ERROR(Launch(p, nullptr));
  RDEP_CUDA_RETURN(cudaDeviceSynchronize());
  int64_t misc[4] = {0, 0, 0, 0};
  RDEP_CUDA_RETURN(cudaMemcpy(misc, p.buf.misc, sizeof(misc), cudaMemcpyDeviceToHost));
  if (misc[3] != 0) return InternalError("GPU planner: reroute found residual demand above residual quota");
  const size_t R = static_cast<size_t>(p.R), E = static_cast<size_t>(p.E), RS = R * static_cast<size_t>(p.S);
  BalancePlan plan;
  plan.num_experts = p.E;
  plan.num_ranks = p.R;
  plan.num_slots = p.S;
  plan.threshold = misc[0];
  plan.instance_offsets.resize(E + 1);
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_offsets.data(), p.buf.inst_offsets, (E + 1) * sizeof(int32_t),
                              cudaMemcpyDeviceToHost));
  const size_t I = static_cast<size_t>(plan.instance_offsets[E]);
  if (I < E || I > E + RS) return InternalError("GPU planner: instance count out of range");
  plan.instance_expert.resize(I);
  plan.instance_rank.resize(I);
  plan.instance_slot.resize(I);
  plan.instance_quota.resize(I);
  plan.slot_expert.resize(RS);
  plan.route.resize(R * I);
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_expert.data(), p.buf.inst_expert, I * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_rank.data(), p.buf.inst_rank, I * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_slot.data(), p.buf.inst_slot, I * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_quota.data(), p.buf.inst_quota, I * 8, cudaMemcpyDeviceToHost));
  if (RS > 0)
    RDEP_CUDA_RETURN(cudaMemcpy(plan.slot_expert.data(), p.buf.slot_expert, RS * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN(cudaMemcpy(plan.route.data(), p.buf.route, R * I * 8, cudaMemcpyDeviceToHost));
  return plan;
}

StatusOr<GpuPlannerTiming> BenchQuotaPlanGpu(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                             const QuotaConfig& config, int32_t warmup, int32_t iters) {
  if (iters < 1 || warmup < 0) return InvalidArgument("GPU planner bench: need iters >= 1 and warmup >= 0");
  Prepared p;
  RDEP_RETURN_IF_ERROR(Prepare(load, owners, config, &p));
  struct Resources {  // released on every return path
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Resources() {
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
      if (stream) cudaStreamDestroy(stream);
    }
  } res;
  RDEP_CUDA_RETURN(cudaStreamCreateWithFlags(&res.stream, cudaStreamNonBlocking));
  RDEP_CUDA_RETURN(cudaEventCreate(&res.start));
  RDEP_CUDA_RETURN(cudaEventCreate(&res.stop));
  for (int32_t i = 0; i < warmup; ++i) RDEP_RETURN_IF_ERROR(Launch(p, res.stream));
  RDEP_CUDA_RETURN(cudaStreamSynchronize(res.stream));
  // Phase boundaries (clock64 of thread 0) of every timed solve, averaged.
  RDEP_RETURN_IF_ERROR(Alloc(&p.buf.phase, kNumPhaseStamps));
  p.args.out_phase = p.buf.phase;
  // setup, search, record, tables + reroute, and of the last: preparation (instance offsets, transfer
  // output), the replicated experts' reroute (longest warp), tables + single-instance routes (longest warp).
  std::vector<double> phase_sum(7, 0.0);
  std::vector<double> us;
  for (int32_t i = 0; i < iters; ++i) {
    RDEP_CUDA_RETURN(cudaEventRecord(res.start, res.stream));
    RDEP_RETURN_IF_ERROR(Launch(p, res.stream));
    RDEP_CUDA_RETURN(cudaEventRecord(res.stop, res.stream));
    RDEP_CUDA_RETURN(cudaEventSynchronize(res.stop));
    float ms = 0;
    RDEP_CUDA_RETURN(cudaEventElapsedTime(&ms, res.start, res.stop));
    us.push_back(static_cast<double>(ms) * 1000.0);
    int64_t stamps[kNumPhaseStamps] = {};
    RDEP_CUDA_RETURN(cudaMemcpy(stamps, p.buf.phase, sizeof(stamps), cudaMemcpyDeviceToHost));
    const int64_t spans[7] = {stamps[1] - stamps[0], stamps[2] - stamps[1], stamps[3] - stamps[2], stamps[7] - stamps[3],
                              stamps[4] - stamps[3], stamps[5] - stamps[4], stamps[6] - stamps[4]};
    for (size_t k = 0; k < 7; ++k) phase_sum[k] += static_cast<double>(spans[k]);
  }
  int64_t err_flag = 0;
  RDEP_CUDA_RETURN(cudaMemcpy(&err_flag, p.buf.misc + 3, sizeof(err_flag), cudaMemcpyDeviceToHost));
  if (err_flag != 0) return InternalError("GPU planner: reroute found residual demand above residual quota");
  GpuPlannerTiming t;
  t.solve_us = Summarize(us);
  t.samples_us = us;
  t.config = p.cfg;
  for (double& c : phase_sum) c /= iters;
  t.phase_cycles = phase_sum;
  int dev = 0, khz = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) == cudaSuccess)
    t.clock_mhz = khz / 1000.0;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) t.device_name = prop.name;
  return t;
}

}  // namespace rdep
