// The GPU UltraEP quota planner (see gpu_planner.h): one thread block of 1024 threads, state in shared
// memory, bitwise the same plan as the host planner (quota_planner.cc). Any change to the oracle,
// tie-breaking or rounding there must be mirrored here; GpuPlanner.MatchesHost* checks it.
#include "rdep/balance/gpu_planner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace rdep {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 1024;
constexpr int kDefaultProbeWarps = 31;  // warp search: 2^d - 1 warps, d levels of the binary search per round
constexpr int kDefaultProbeLevels = 7;  // thread search: 2^7 - 1 = 127 probes per round, the full tree ...
constexpr int kDefaultProbeExtend = 7;  // ... plus 7 more levels under its leftmost leaf (126 probes)
constexpr int kRecordingProbes = 32;    // thread search: warp 0's probes record their transfers

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
  size_t vinfo = 0, lam = 0, ell = 0, ell_sorted = 0, vlam = 0, slk = 0, node_lo = 0, node_hi = 0, rec_amount = 0,
         wrec_amount = 0, trec = 0, mi_local = 0, mi_w = 0, mi_total = 0, misc64 = 0, n64 = 0;
  // int32 offsets (in elements of int32, after the int64 block)
  size_t owner = 0, cnt = 0, expert_first = 0, grp = 0, gidx = 0, rank_order = 0, rank_pos = 0, vfirst = 0, vexp = 0,
         used = 0, feas = 0, rec_e = 0, rec_t = 0, rec_s = 0, wrec_e = 0, wrec_t = 0, wrec_s = 0, wnrec = 0,
         rep_first = 0, rep_count = 0, inst_off = 0, multi = 0, mi_e = 0, mi_i = 0, mi_host = 0, misc32 = 0, asc = 0,
         ovf = 0, used8 = 0, stage = 0,
         n32 = 0;
  Layout() = default;
  // staged: the load matrix is copied into shared memory as int32 (entries < 2^31 checked on host).
  // pt: threads of the one-thread-per-threshold search (0 when R > 64: only the warp search exists).
  __host__ __device__ Layout(int R, int E, int S, int pw, int pt, bool staged) {
    const size_t r = static_cast<size_t>(R), e = static_cast<size_t>(E), rs = r * static_cast<size_t>(S);
    size_t o = 0;
    vinfo = o; o += pt > 0 ? 2 * (e + 2) : 0;        // [E+2] int4 visit data of the thread search (16-byte aligned)
    lam = o; o += e;                                 // [E] expert loads
    ell = o; o += r;                                 // [R] rank loads
    ell_sorted = o; o += r;                          // [R] rank loads in visit order
    vlam = o; o += e;                                // [E] expert loads in visit order
    slk = o; o += static_cast<size_t>(pw) * r;       // [pw][R] generic probe: per-warp slack
    node_lo = o; o += kWarps + 1;                    // search-tree node intervals (1-based heap order)
    node_hi = o; o += kWarps + 1;
    rec_amount = o; o += rs;                         // recorded transfers of the solved threshold
    wrec_amount = o; o += static_cast<size_t>(pw) * rs;  // [pw][R*S] transfers of each probe warp
    trec = o; o += static_cast<size_t>(pt < kRecordingProbes ? pt : kRecordingProbes) * rs;  // thread-search records
    const size_t imax = e + rs;                      // most instances a plan can have
    mi_local = o; o += imax;                         // replicated experts' instances (reroute): local rows,
    mi_w = o; o += imax;                             //   residual quota of the expert's instances before it,
    mi_total = o; o += imax;                         //   the expert's residual total
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
    feas = o; o += (pt > kWarps ? pt : kWarps) + 1;  // probe result per search-tree node
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
    mi_e = o; o += imax;                             // replicated experts' instances: expert, index, host
    mi_i = o; o += imax;
    mi_host = o; o += imax;
    misc32 = o; o += 16;                             // see kAnyFeasible...
    asc = o; o += pt > 0 ? r + 2 : 0;                // [R+2] load << 6 | 63 - rank, ascending; 2 sentinels
    ovf = o; o += static_cast<size_t>(pt) * r;       // [pt][R] partial-set overflow of each thread probe
    used8 = o; o += pt > 0 && S > 2 ? (static_cast<size_t>(pt) * r + 3) / 4 : 0;  // [pt][R] bytes: replicas
    o += o & 1;                                      // stage: 8-byte aligned (int2 stores)
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
              kCopyFrom = 6,  // probe warp + 1 whose records hold the latest feasible threshold, 0 = none
              kNumMultiInst = 7,  // instances of replicated experts (the reroute's threads)
              kNeedRerun = 8;  // thread search: the solved threshold's records must be re-run

struct KernelArgs {
  const int64_t* load;   // [R*E]
  const int32_t* owner;  // [E]
  int R, E, S, pw, pt, staged;  // pt: thread-probe search threads, 0 = warp search only
  int pa, pb;                   // thread search: full levels per round, extension levels (pt = 2^pa - 1 + 2^pb - 2)
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
  int64_t* demand;          // [R*E]: replicated experts' residual demand when the load is not staged
  Layout layout;            // shared-memory offsets, computed on the host (kernel parameters stay in the
                            // constant bank, so the compiler rematerializes pointers instead of spilling)
};

struct Shared {
  int64_t *lam, *ell, *ell_sorted, *vlam, *slk, *node_lo, *node_hi, *rec_amount, *wrec_amount, *mi_local, *mi_w,
      *mi_total, *misc64;
  uint64_t* trec;
  int32_t *owner, *cnt, *expert_first, *grp, *gidx, *rank_order, *rank_pos, *vfirst, *vexp, *used, *feas, *rec_e,
      *rec_t, *rec_s, *wrec_e, *wrec_t, *wrec_s, *wnrec, *rep_first, *rep_count, *inst_off, *multi, *mi_e, *mi_i,
      *mi_host, *misc32, *stage;
  uint32_t *asc, *ovf;
  int4* vinfo;
  uint8_t* used8;
};

__device__ Shared Carve(char* base, const Layout& L) {
  Shared s;
  int64_t* b64 = reinterpret_cast<int64_t*>(base);
  int32_t* b32 = reinterpret_cast<int32_t*>(b64 + L.n64);
  s.lam = b64 + L.lam; s.ell = b64 + L.ell; s.ell_sorted = b64 + L.ell_sorted; s.vlam = b64 + L.vlam;
  s.slk = b64 + L.slk; s.node_lo = b64 + L.node_lo; s.node_hi = b64 + L.node_hi; s.rec_amount = b64 + L.rec_amount;
  s.wrec_amount = b64 + L.wrec_amount; s.misc64 = b64 + L.misc64;
  s.vinfo = reinterpret_cast<int4*>(b64 + L.vinfo);
  s.mi_local = b64 + L.mi_local; s.mi_w = b64 + L.mi_w; s.mi_total = b64 + L.mi_total;
  s.mi_e = b32 + L.mi_e; s.mi_i = b32 + L.mi_i; s.mi_host = b32 + L.mi_host;
  s.trec = reinterpret_cast<uint64_t*>(b64 + L.trec);
  s.owner = b32 + L.owner; s.cnt = b32 + L.cnt; s.expert_first = b32 + L.expert_first; s.grp = b32 + L.grp;
  s.gidx = b32 + L.gidx; s.rank_order = b32 + L.rank_order; s.rank_pos = b32 + L.rank_pos; s.vfirst = b32 + L.vfirst;
  s.vexp = b32 + L.vexp; s.used = b32 + L.used; s.feas = b32 + L.feas; s.rec_e = b32 + L.rec_e;
  s.rec_t = b32 + L.rec_t; s.rec_s = b32 + L.rec_s; s.rep_first = b32 + L.rep_first; s.rep_count = b32 + L.rep_count;
  s.wrec_e = b32 + L.wrec_e; s.wrec_t = b32 + L.wrec_t; s.wrec_s = b32 + L.wrec_s; s.wnrec = b32 + L.wnrec;
  s.inst_off = b32 + L.inst_off; s.multi = b32 + L.multi; s.misc32 = b32 + L.misc32; s.stage = b32 + L.stage;
  s.asc = reinterpret_cast<uint32_t*>(b32 + L.asc); s.ovf = reinterpret_cast<uint32_t*>(b32 + L.ovf);
  s.used8 = reinterpret_cast<uint8_t*>(b32 + L.used8);
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

// The whole block unpacks n packed records into the shared record arrays.
__device__ void UnpackRecords(const Shared& s, const uint64_t* src, int n) {
  for (int k = threadIdx.x; k < n; k += kThreads) {
    const uint64_t v = src[k];
    const uint32_t lo = static_cast<uint32_t>(v), hi = static_cast<uint32_t>(v >> 32);
    s.rec_e[k] = static_cast<int>(hi & ((1u << kRecExpertBits) - 1));
    s.rec_s[k] = static_cast<int>(hi >> kRecExpertBits);
    s.rec_t[k] = static_cast<int>(lo >> kRecAmountBits);
    s.rec_amount[k] = static_cast<int64_t>(lo & ((1u << kRecAmountBits) - 1));
  }
}


// kSmallS: N_slot <= 2, so a rank in the partial set always has exactly one replica (and a rank taken
// from it never returns). Otherwise the per-probe used[] bytes in shared memory hold each rank's
// replica count. kRecord writes the transfers, packed (PackRecord), to rec.
// The step is one straight-line block (a warp runs 32 thresholds: branches would serialize, and with
// one warp per scheduler every instruction's latency is on the clock): the transfer is predicated on
// ok, and only the visit transition and the overflow paths branch. The visit state is the position
// k in s.vinfo, whose next entry (k + 1: the rank's next expert) and the next rank's first entry
// (kend) are prefetched as int4s, so a transition is a few selects; shared loads are issued at least
// one step before their values are needed.
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
  bool feasible = true;
#if defined(RDEP_GPU_PLANNER_STEP_STAMPS)
  int nst = 0;  // measurement build: the clock and (transfers, visit position, overflow keys) at every step
#endif
  while (true) {
#if defined(RDEP_GPU_PLANNER_STEP_STAMPS)
    if (kRecord && stamps != nullptr && nst < 2 * 255) {
      stamps[nst++] = static_cast<uint32_t>(clock());
      stamps[nst++] = (static_cast<uint32_t>(nrec) & 0xffu) | ((static_cast<uint32_t>(k) & 0xfffu) << 8) |
                      ((static_cast<uint32_t>(min(nov, 15))) << 28);
    }
#endif
    const uint32_t best = max(mk, p[0]);
    const int bs = static_cast<int>(best >> kFastRankBits);
    if (bs < umin) {  // no admissible target with u_min of slack, now or later
      feasible = false;
      break;
    }
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
    // Main list: advance on a main pick (the raw entries shift; the new load is needed two picks later).
    if (fm) {
      mk = key_of(raw1);
      raw1 = raw2;
      raw2 = asc[min(head + 3, R + 1)];
      ++head;
    }
    // Partial set: drop the head on a partial pick, then insert the target again if it stays admissible.
    uint32_t q[kPartialRegs];
#pragma unroll
    for (int i = 0; i < kPartialRegs; ++i) q[i] = fp ? (i + 1 < kPartialRegs ? p[i + 1] : ovmax) : p[i];
    if (fp && nov > 0) {  // the overflow maximum moved into the registers: remove it, rescan
      int pos = 0;
      for (int i = 0; i < nov; ++i) pos = ov[i] == ovmax ? i : pos;
      ov[pos] = ov[--nov];
      uint32_t m = 0;
      for (int i = 0; i < nov; ++i) m = max(m, ov[i]);
      ovmax = m;
    }
    const int s2 = bs - d;
    const uint32_t nk = ok && s2 > 0 && ut + 1 < S ? (static_cast<uint32_t>(s2) << kFastRankBits) | (best & 63u) : 0u;
    bool g[kPartialRegs];
#pragma unroll
    for (int i = 0; i < kPartialRegs; ++i) g[i] = nk > q[i];
#pragma unroll
    for (int i = kPartialRegs - 1; i > 0; --i) p[i] = g[i - 1] ? q[i - 1] : (g[i] ? nk : q[i]);
    p[0] = g[0] ? nk : q[0];
    const uint32_t out = min(nk, q[kPartialRegs - 1]);  // the key that leaves the registers (0: none)
    if (out != 0) {
      ov[nov++] = out;
      ovmax = max(ovmax, out);
    }
    if (ok) {
      exc = max(exc - d, 0);
      cap -= d;
      if (exc > 0 && cap > 0) continue;
    }
    // The visit is over: the expert is drained (or below u_min), or the rank's excess is shed.
    if (exc > 0) {  // the rank's next expert
      if (++k == kend) {
        feasible = false;
        break;
      }
      cap = nx.x;
      e = nx.y;
      nx = vi[k + 1];
    } else {  // the next rank (the sentinel past the last one has load 0)
      if (nr.w <= tau) break;
      exc = nr.w - tau;
      cap = nr.x;
      e = nr.y;
      k = kend;
      kend = nr.z;
      nx = vi[k + 1];
      nr = vi[kend];
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

// floor(a / D) for a reroute step, a = d * W < 2^50 (d, W <= D < 2^25), from a double reciprocal of D: the
// estimate (exact product, relative error ~2^-52) is within one of the quotient and one correction step
// makes it exact. The quotient is at most d and the estimate's remainder lies in (-D, 2D), so both fit
// 32 bits and the correction runs in 32-bit arithmetic (the product's low word is all it needs).
__device__ __forceinline__ int FloorDivFast32(int64_t a, int D, double inv_d) {
  const int q = static_cast<int>(static_cast<double>(a) * inv_d);
  const int r = static_cast<int>(static_cast<uint32_t>(a) - static_cast<uint32_t>(q) * static_cast<uint32_t>(D));
  return q + (r >= D ? 1 : (r < 0 ? -1 : 0));
}

// Experts with a load below this take the 32-bit chain (products d * W < 2^50); others the int64 one.
constexpr int64_t kFastRerouteLoadLimit = int64_t{1} << 25;

// The reroute of one instance i of a replicated expert e, by one thread (SolveReroute's math): it
// carries the two cumulative residual quotas around its instance, W_i and W_{i+1}, through the
// sources; each evolves on its own (W -= floor(d * W / D)), and the instance's take from source r is
// the difference of the two floors. d comes from dcol (the residual demand: the locality pass already
// took the local rows out), D = the residual total, its reciprocal computed a source ahead so that
// only the W chains are on the critical path. Writes the instance's route column (take, plus the local
// rows on its host).
template <bool kWide, typename Demand>
__device__ void RerouteInstance(const KernelArgs& a, Demand dcol, int I, int col, int host, int64_t local,
                                int64_t wlo, int64_t whi, int64_t D) {
  const int R = a.R;
  int64_t* out = a.route + col;
  if (kWide) {
    int64_t d = dcol(0), Dc = D;
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      const int64_t dn = r + 1 < R ? dcol(r + 1) : 0;
      if (d != 0 && Dc < d) a.out_misc[3] = 1;  // residual demand above residual quota
      const bool live = d > 0 && Dc >= d;
      const int64_t qlo = live ? d * wlo / Dc : 0, qhi = live ? d * whi / Dc : 0;
      *out = (qhi - qlo) + (r == host ? local : 0);
      out += I;
      wlo -= qlo;
      whi -= qhi;
      Dc -= d;
      d = dn;
    }
  } else {
    int d = static_cast<int>(dcol(0)), Dc = static_cast<int>(D);
    int wl = static_cast<int>(wlo), wh = static_cast<int>(whi);
    double inv = __drcp_rn(static_cast<double>(Dc > 0 ? Dc : 1));
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      const int dn = r + 1 < R ? static_cast<int>(dcol(r + 1)) : 0, Dn = Dc - d;
      const double invn = __drcp_rn(static_cast<double>(Dn > 0 ? Dn : 1));
      if (d != 0 && Dc < d) a.out_misc[3] = 1;  // residual demand above residual quota
      const bool live = d > 0 && Dc >= d;
      const int ql = live ? FloorDivFast32(static_cast<int64_t>(d) * wl, Dc, inv) : 0;
      const int qh = live ? FloorDivFast32(static_cast<int64_t>(d) * wh, Dc, inv) : 0;
      *out = static_cast<int64_t>(qh - ql) + (r == host ? local : 0);
      out += I;
      wl -= ql;
      wh -= qh;
      d = dn;
      Dc = Dn;
      inv = invn;
    }
  }
}

// The thread-probe search (R <= 64, loads < 2^26). A round probes, one thread each, the nodes of the
// binary-search tree below the round's root (heap order from 1; node n's interval comes from walking
// its bits from the root, 0 = left = feasible: hi = tau): the full tree of pa levels (slots
// 0..2^pa - 2 = nodes 1..2^pa - 1) and, when pb > 1, a tree of pb levels rooted at that tree's
// leftmost leaf (node 2^(pa-1), already probed; its 2^pb - 2 other nodes take the slots from 2^pa - 1
// on). The solved threshold sits within ~1% of the mean rank load while the search starts from
// [mean, max], so the path's first pa - 1 decisions are "feasible" in practice and a round resolves
// pa + pb - 1 levels; when the path leaves the probed nodes the next round
// starts where it left. Thread 0 then follows the host's path through the results. The probes in
// slots 0..31 (the round's first five levels) record their transfers; when the round's last feasible
// node on the path is one of them, its records are unpacked at the top of the next round (before the
// buffers are reused). Otherwise Phase 3 re-runs the solved threshold with recording.
__device__ __forceinline__ int ProbeNodeOfSlot(int t, int pa) {
  const int full = (1 << pa) - 1;
  if (t < full) return t + 1;
  const int u = t - full + 2, du = 31 - __clz(u);  // local heap index (>= 2) under the leftmost leaf
  return ((1 << (pa - 1)) << du) | (u - (1 << du));
}
__device__ __forceinline__ int ProbeSlotOfNode(int n, int pa, int pb) {  // -1: not probed this round
  const int dn = 31 - __clz(n);
  if (dn < pa) return n - 1;
  const int du = dn - (pa - 1);
  if (du >= pb || (n >> du) != (1 << (pa - 1))) return -1;
  return (1 << pa) - 1 + ((1 << du) | (n & ((1 << du) - 1))) - 2;
}

__device__ void ThreadSearch(const KernelArgs& a, const Shared& s, int umin) {
  const int tid = threadIdx.x;
  const int R = a.R, S = a.S, pt = a.pt;
  const size_t rs = static_cast<size_t>(R) * S;
  while (true) {
    if (const int from = s.misc32[kCopyFrom]; from != 0)
      UnpackRecords(s, s.trec + static_cast<size_t>(from - 1) * rs, s.wnrec[from - 1]);
    __syncthreads();
    const int64_t lo0 = s.misc64[0], hi0 = s.misc64[1];
    if (lo0 >= hi0) break;
    if (tid < pt) {
      const int n = ProbeNodeOfSlot(tid, a.pa);
      int64_t lo = lo0, hi = hi0;
      for (int b = 30 - __clz(n); b >= 0 && lo < hi; --b) {
        const int64_t tau = lo + (hi - lo) / 2;
        if ((n >> b) & 1) lo = tau + 1;
        else hi = tau;
      }
      if (lo < hi) {
        const int tau = static_cast<int>(lo + (hi - lo) / 2);
        uint32_t* ov = s.ovf + static_cast<size_t>(tid) * R;
        uint8_t* used = s.used8 + static_cast<size_t>(tid) * R;
        uint64_t* rec = s.trec + static_cast<size_t>(tid) * rs;
        int nrec = 0;
        bool f;
        if (tid < kRecordingProbes)  // warp 0: a whole warp takes the recording form
          f = S <= 2 ? ThreadProbe<true, true>(s, tau, R, S, umin, ov, used, rec, &nrec)
                     : ThreadProbe<true, false>(s, tau, R, S, umin, ov, used, rec, &nrec);
        else
          f = S <= 2 ? ThreadProbe<false, true>(s, tau, R, S, umin, ov, used, rec, &nrec)
                     : ThreadProbe<false, false>(s, tau, R, S, umin, ov, used, rec, &nrec);
        s.feas[tid] = f ? 1 : 0;
        if (tid < kRecordingProbes) s.wnrec[tid] = nrec;
      }
    }
    __syncthreads();
    if (tid == 0) {
      int64_t lo = lo0, hi = hi0;
      s.misc32[kCopyFrom] = 0;
      for (int n = 1; lo < hi;) {
        const int slot = ProbeSlotOfNode(n, a.pa, a.pb);
        if (slot < 0) break;
        const int64_t tau = lo + (hi - lo) / 2;
        s.misc32[kNumProbes] += 1;
        if (s.feas[slot]) {
          hi = tau;
          s.misc32[kAnyFeasible] = 1;
          const bool recorded = slot < kRecordingProbes;
          s.misc32[kCopyFrom] = recorded ? slot + 1 : 0;
          s.misc32[kNeedRerun] = recorded ? 0 : 1;
          if (recorded) s.misc32[kNumRec] = s.wnrec[slot];
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
}

#if defined(RDEP_GPU_PLANNER_STEP_STAMPS)
__device__ int g_stamp_prints = 0;
#endif

__global__ void __launch_bounds__(kThreads, 1) QuotaPlanKernel(KernelArgs a) {
  extern __shared__ __align__(16) char smem[];
  const Shared s = Carve(smem, a.layout);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int R = a.R, E = a.E;
  auto stamp = [&](int i) {
    if (a.out_phase != nullptr && tid == 0) a.out_phase[i] = clock64();
  };
  stamp(0);
  // Phase 0: stage the load matrix (row-major [R][E]) into shared memory when it fits: 16-byte loads,
  // kStageUnroll in flight per thread before their stores.
  if (a.staged) {
    constexpr int kStageUnroll = 8;
    const size_t n = static_cast<size_t>(R) * E, n2 = n / 2;
    const longlong2* src = reinterpret_cast<const longlong2*>(a.load);
    int2* dst = reinterpret_cast<int2*>(s.stage);
    for (size_t base = tid; base < n2; base += static_cast<size_t>(kThreads) * kStageUnroll) {
      longlong2 v[kStageUnroll];
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u) {
        const size_t i = base + static_cast<size_t>(u) * kThreads;
        if (i < n2) v[u] = src[i];
      }
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u) {
        const size_t i = base + static_cast<size_t>(u) * kThreads;
        if (i < n2) dst[i] = make_int2(static_cast<int>(v[u].x), static_cast<int>(v[u].y));
      }
    }
    if ((n & 1) != 0 && tid == 0) s.stage[n - 1] = static_cast<int32_t>(a.load[n - 1]);
  }
  for (int r = tid; r < R; r += kThreads) {
    s.ell[r] = 0;
    s.cnt[r] = 0;
  }
  if (tid < 16) s.misc32[tid] = 0;
  if (tid == 0) a.out_misc[3] = 0;
  __syncthreads();
  auto ld = [&](int r, int e) -> int64_t {
    const size_t k = static_cast<size_t>(r) * E + e;
    return a.staged ? static_cast<int64_t>(s.stage[k]) : a.load[k];
  };

  // Phase 1: expert loads (tpe threads per expert, a power of two <= 32), rank loads, the visiting order.
  {
    int tpe = 1;
    while (tpe < 32 && tpe * 2 * E <= kThreads) tpe *= 2;
    const int sub = lane & (tpe - 1), total = E * tpe;
    for (int base = 0; base < total; base += kThreads) {  // uniform trip count: every lane shuffles
      const int idx = base + tid, e0 = idx / tpe;
      int64_t sum = 0;
      if (idx < total)
        for (int r = sub; r < R; r += tpe) sum += ld(r, e0);
      for (int off = tpe / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off, tpe);
      if (idx < total && sub == 0) {
        const int o = a.owner[e0];
        s.owner[e0] = o;
        s.lam[e0] = sum;
        atomicAdd(reinterpret_cast<unsigned long long*>(s.ell + o), static_cast<unsigned long long>(sum));
        s.gidx[e0] = atomicAdd(s.cnt + o, 1);
      }
    }
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
      s.misc32[kFastProbe] = (a.pt > 0 && R <= 64 && hi < kFastLoadLimit && E < (1 << 24) && a.S <= 256) ? 1 : 0;
    }
  } else {
    // Rank order: one warp per rank counts the ranks ahead of it (descending load, ascending id) and,
    // for the thread search's main list, behind it (ascending load, ascending id).
    for (int r = warp - 1; r < R; r += kWarps - 1) {
      const int64_t lr = s.ell[r];
      unsigned ahead = 0, below = 0;
      for (int q = lane; q < R; q += 32) {
        ahead += (s.ell[q] > lr || (s.ell[q] == lr && q < r)) ? 1u : 0u;
        below += (s.ell[q] < lr || (s.ell[q] == lr && q < r)) ? 1u : 0u;
      }
      ahead = __reduce_add_sync(0xffffffffu, ahead);
      below = __reduce_add_sync(0xffffffffu, below);
      if (lane == 0) {
        s.rank_order[ahead] = r;
        s.rank_pos[r] = static_cast<int>(ahead);
        if (a.pt > 0 && lr < kFastLoadLimit)
          s.asc[below] = (static_cast<uint32_t>(lr) << kFastRankBits) | static_cast<uint32_t>(63 - (r & 63));
      }
    }
    if (a.pt > 0 && tid >= 32 && tid < 34) s.asc[R + tid - 32] = 0xffffffffu;  // sentinels: no slack for any tau
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
    const int ri = s.rank_pos[s.owner[e]], k = s.vfirst[ri] + s.gidx[e];
    s.vexp[k] = e;
    s.vlam[k] = s.lam[e];
    // The thread search's visit data: the expert's load, the expert, its rank's end, the rank's load
    // (both loads below 2^26 whenever the thread search runs).
    if (a.pt > 0) s.vinfo[k] = make_int4(static_cast<int>(s.lam[e]), e, s.vfirst[ri + 1], static_cast<int>(s.ell[s.owner[e]]));
  }
  if (a.pt > 0 && tid < 2) s.vinfo[E + tid] = make_int4(0, 0, E, 0);  // sentinels: no rank left
  __syncthreads();
  stamp(1);
  const bool fast = s.misc32[kFastProbe] != 0;
  const int umin32 = static_cast<int>(a.umin < (int64_t{1} << 30) ? a.umin : (int64_t{1} << 30));

  // Phase 2: the binary search on tau, evaluated speculatively.
  if (fast) {
    ThreadSearch(a, s, umin32);
  } else {
    // Warp search (any R, int64 loads): node n (1-based heap order) holds the interval the host's
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
          s.rec_e[k] = s.wrec_e[base + k];
          s.rec_t[k] = s.wrec_t[base + k];
          s.rec_s[k] = s.wrec_s[base + k];
          s.rec_amount[k] = s.wrec_amount[base + k];
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
          const bool f = WarpProbe(s, tau, R, a.S, a.umin, s.slk + static_cast<size_t>(warp) * R,
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
  }
  stamp(2);

  // Phase 3: the solved threshold's transfers. Both searches unpacked or copied them at the top of
  // their last round, except when the thread search's solved threshold came from a probe that did
  // not record (below warp 0's levels): that one is re-run here with recording.
#if defined(RDEP_GPU_PLANNER_STEP_STAMPS)
  // Measurement build: always re-run the solved threshold, stamping every step, and print the first two.
  if (fast && s.misc32[kAnyFeasible] != 0) {
    if (tid == 0) {
      int nrec = 0;
      const int tau = static_cast<int>(s.misc64[1]);
      uint32_t* st = s.ovf + R;  // the other probes' overflow areas are free now
      const uint32_t t0 = static_cast<uint32_t>(clock());
      if (a.S <= 2) ThreadProbe<true, true>(s, tau, R, a.S, umin32, s.ovf, s.used8, s.trec, &nrec, st);
      else ThreadProbe<true, false>(s, tau, R, a.S, umin32, s.ovf, s.used8, s.trec, &nrec, st);
      const uint32_t t1 = static_cast<uint32_t>(clock());
      s.misc32[kNumRec] = nrec;
      if (atomicAdd(&g_stamp_prints, 1) < 2) {
        printf("stamps tau=%d nrec=%d total=%u cycles\n", tau, nrec, t1 - t0);
        for (int i = 0; i + 3 < 2 * 256 && st[i + 1] != 0xffffffffu; i += 2)
          printf("step %d dt %u rec %u k %u nov %u\n", i / 2, st[i + 2] - st[i], st[i + 1] & 0xffu,
                 (st[i + 1] >> 8) & 0xfffu, st[i + 1] >> 28);
      }
    }
#else
  if (fast && s.misc32[kAnyFeasible] != 0 && s.misc32[kNeedRerun] != 0) {
    if (tid == 0) {
      int nrec = 0;
      const int tau = static_cast<int>(s.misc64[1]);
      if (a.S <= 2) ThreadProbe<true, true>(s, tau, R, a.S, umin32, s.ovf, s.used8, s.trec, &nrec);
      else ThreadProbe<true, false>(s, tau, R, a.S, umin32, s.ovf, s.used8, s.trec, &nrec);
      s.misc32[kNumRec] = nrec;
    }
#endif
    __syncthreads();
    UnpackRecords(s, s.trec, s.misc32[kNumRec]);
  }
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
  // Each replicated expert (one thread) claims a range of the replicated-instance list and fills it:
  // instance, host, local rows (locality: the host's own rows up to the quota), the cumulative residual
  // quota before it (W_i) and the residual total. Then it takes the local rows out of the demand: in
  // place in the staged load (only this thread touches these entries; single-instance experts' columns
  // are never changed), or in a copy of its column in the global scratch when the load is not staged.
  for (int e = tid; e < E; e += kThreads) {
    const int nr = s.rep_count[e];
    if (nr == 0) continue;
    s.multi[atomicAdd(s.misc32 + kNumMulti, 1)] = e;
    const int k = nr + 1, f = s.rep_first[e], j0 = atomicAdd(s.misc32 + kNumMultiInst, k);
    int64_t moved = 0;
    for (int c = 0; c < nr; ++c) moved += s.rec_amount[f + c];
    int64_t w = 0;
    for (int i = 0; i < k; ++i) {
      const int host = i == 0 ? s.owner[e] : s.rec_t[f + i - 1];
      const int64_t quota = i == 0 ? s.lam[e] - moved : s.rec_amount[f + i - 1];
      const int64_t l = a.locality ? min(ld(host, e), quota) : 0;
      s.mi_e[j0 + i] = e;
      s.mi_i[j0 + i] = i;
      s.mi_host[j0 + i] = host;
      s.mi_local[j0 + i] = l;
      s.mi_w[j0 + i] = w;
      w += quota - l;
    }
    for (int i = 0; i < k; ++i) s.mi_total[j0 + i] = w;
    if (a.staged) {
      for (int i = 0; i < k; ++i) {
        const size_t at = static_cast<size_t>(s.mi_host[j0 + i]) * E + e;
        s.stage[at] -= static_cast<int32_t>(s.mi_local[j0 + i]);
      }
    } else {
      for (int r = 0; r < R; ++r) a.demand[static_cast<size_t>(r) * E + e] = a.load[static_cast<size_t>(r) * E + e];
      for (int i = 0; i < k; ++i) a.demand[static_cast<size_t>(s.mi_host[j0 + i]) * E + e] -= s.mi_local[j0 + i];
    }
  }
  if (tid == 0) s.misc64[2] = s.misc64[3] = 0;  // latest end of the replicated / single-instance work
  __syncthreads();
  stamp(4);
  const int I = s.inst_off[E];
  const int num_mi = s.misc32[kNumMultiInst];
  // Warps 0..busy-1 reroute the replicated experts' instances, one thread each (the long sequential
  // part: R sources); when at least 4 warps are left over, they alone write the instance tables and the
  // single-instance routes meanwhile.
  const int need = (num_mi + 31) / 32;
  const int busy = need < kWarps ? need : kWarps;
  const bool split = kWarps - busy >= 4;
  auto mark_end = [&](int slot) {
    if (a.out_phase != nullptr && lane == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(s.misc64 + slot), static_cast<unsigned long long>(clock64()));
  };

  // Phase 4: the reroute (same math as SolveReroute) and the instance tables.
  if (warp < busy) {
    const int nt = split ? busy * 32 : kThreads;
    for (int j = tid; j < num_mi; j += nt) {
      const int e = s.mi_e[j], col = s.inst_off[e] + s.mi_i[j];
      const int64_t wlo = s.mi_w[j];
      const int64_t whi = j + 1 < num_mi && s.mi_e[j + 1] == e ? s.mi_w[j + 1] : s.mi_total[j];
      // One typed accessor per home of the demand, not one with a branch inside: that measured 20.5K ->
      // 26.2K cycles for the replicated reroute (docs/perf-notes.md, round 4).
      if (a.staged) {
        auto dcol = [&](int r) -> int64_t { return s.stage[static_cast<size_t>(r) * E + e]; };
        if (s.lam[e] < kFastRerouteLoadLimit)
          RerouteInstance<false>(a, dcol, I, col, s.mi_host[j], s.mi_local[j], wlo, whi, s.mi_total[j]);
        else
          RerouteInstance<true>(a, dcol, I, col, s.mi_host[j], s.mi_local[j], wlo, whi, s.mi_total[j]);
      } else {
        auto dcol = [&](int r) -> int64_t { return a.demand[static_cast<size_t>(r) * E + e]; };
        if (s.lam[e] < kFastRerouteLoadLimit)
          RerouteInstance<false>(a, dcol, I, col, s.mi_host[j], s.mi_local[j], wlo, whi, s.mi_total[j]);
        else
          RerouteInstance<true>(a, dcol, I, col, s.mi_host[j], s.mi_local[j], wlo, whi, s.mi_total[j]);
      }
    }
    mark_end(2);
  }
  // Instance tables (one thread per expert) and experts without replicas (every source's rows go to
  // the main instance), on the warps without a replicated instance when there are enough of them.
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
    for (int r = wi; r < R; r += nw) {
      int64_t* row = a.route + static_cast<size_t>(r) * I;
#pragma unroll 4
      for (int e = lane; e < E; e += 32)
        if (s.rep_count[e] == 0) row[s.inst_off[e]] = ld(r, e);
    }
    mark_end(3);
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
  int64_t *route = nullptr, *demand = nullptr, *phase = nullptr;
  ~DeviceBuffers() {
    for (void* p : {static_cast<void*>(load), static_cast<void*>(owner), static_cast<void*>(misc),
                    static_cast<void*>(tr_expert), static_cast<void*>(tr_rank), static_cast<void*>(tr_slot),
                    static_cast<void*>(tr_amount), static_cast<void*>(inst_offsets), static_cast<void*>(inst_expert),
                    static_cast<void*>(inst_rank), static_cast<void*>(inst_slot), static_cast<void*>(inst_quota),
                    static_cast<void*>(slot_expert), static_cast<void*>(route), static_cast<void*>(demand),
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
  // Measurement knobs: RDEP_GPU_PLANNER_PROBE_LEVELS = the thread search's full levels per round (pa,
  // 1..10, default 7), RDEP_GPU_PLANNER_PROBE_EXTEND = the levels of the tree under its leftmost leaf
  // (pb, 0..8, default 7; 0 or 1 = none), RDEP_GPU_PLANNER_PROBE_WARPS caps the warp search's probe warps.
  int levels = kDefaultProbeLevels, extend = kDefaultProbeExtend;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_PROBE_LEVELS"); env != nullptr && std::atoi(env) >= 1)
    levels = std::min(10, std::atoi(env));
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_PROBE_EXTEND"); env != nullptr && std::atoi(env) >= 0)
    extend = std::min(8, std::atoi(env));
  int max_pw = kDefaultProbeWarps;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_PROBE_WARPS"); env != nullptr && std::atoi(env) >= 1)
    max_pw = std::min(31, std::atoi(env));
  // The thread search exists for R <= 64; with it, the warp search only runs for loads >= 2^26. When
  // shared memory is short, the extension goes first, then levels.
  for (int pa = num_ranks <= 64 ? levels : 0, pb = extend;; pb > 0 ? pb = 0 : --pa) {
    const int pt = pa <= 0 ? 0 : (1 << pa) - 1 + (pb > 1 ? (1 << pb) - 2 : 0);
    for (bool staged : {true, false}) {
      if (staged && !stage_ok) continue;
      for (int pw = 31; pw >= 1; pw = (pw - 1) / 2) {  // 31, 15, 7, 3, 1 warps: 5..1 levels per round
        if (pw > max_pw) continue;
        const size_t bytes = Layout(num_ranks, num_experts, num_slots, pw, pt, staged).bytes();
        if (bytes <= static_cast<size_t>(optin))
          return GpuPlannerConfig{bytes, pw, pt, pt > 0 ? pa : 0, pt > 0 && pb > 1 ? pb : 0, staged};
      }
    }
    if (pa <= 0) break;
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
  RDEP_RETURN_IF_ERROR(Alloc(&b.demand, p->cfg.staged_load ? 0 : R * E));
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
  a.pt = p->cfg.probe_threads;
  a.pa = p->cfg.probe_levels;
  a.pb = p->cfg.probe_extend;
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
  a.demand = b.demand;
  a.layout = Layout(a.R, a.E, a.S, a.pw, a.pt, a.staged != 0);
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
