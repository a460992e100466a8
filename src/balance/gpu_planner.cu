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
#include <type_traits>

namespace rdep {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 1024;
constexpr int kDefaultProbeWarps = 31;  // warp search: 2^d - 1 warps, d levels of the binary search per round
constexpr int kDefaultProbeThreads = 128;  // thread search: one probe per thread, one warp per scheduler
constexpr int kDefaultChainShift = 5;      // first round: chain of nodes with tau >= lo + lo/2^5 (0 = none)
constexpr int kRecordingProbes = 64;       // thread search: warps 0-1's probes record their transfers

#define RDEP_CUDA_RETURN(expr)                                                                              \
  do {                                                                                                      \
    cudaError_t rdep_err_ = (expr);                                                                         \
    if (rdep_err_ != cudaSuccess) {                                                                         \
      (void)cudaGetLastError();                                                                             \
      return Status(StatusCode::kCudaError, std::string(#expr) + " failed at " + __FILE__ + ":" +           \
                                                std::to_string(__LINE__) + ": " + cudaGetErrorString(rdep_err_)); \
    }                                                                                                       \
  } while (0)

// Row stride of the staged load matrix in shared memory: a column read (lanes = sources) touches at
// most two lanes per bank (stride = 2 mod 4, even so that int2 stores stay aligned; odd when E is).
__host__ __device__ inline int StageStride(int E) { return E % 2 != 0 ? E + 2 : (E % 4 == 0 ? E + 2 : E + 4); }

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
         rep_first = 0, rep_count = 0, inst_off = 0, multi = 0, mt_first = 0, mi_e = 0, mi_i = 0, mi_host = 0, mi_m = 0,
         col_src = 0,
         misc32 = 0, asc = 0,
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
    misc64 = o; o += 4;                              // lo, hi, phase ends [2..3]
    n64 = o + (o & 1);                               // the int32 block starts 16-byte aligned
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
    multi = o; o += e;                               // experts with replicas (any order: multi index m)
    mt_first = o; o += e;                            // [m] first record of multi m
    mi_e = o; o += imax;                             // replicated experts' instances: expert, index, host, m
    mi_i = o; o += imax;
    mi_host = o; o += imax;
    mi_m = o; o += imax;
    col_src = o; o += imax;                          // [I] route column c: expert e >= 0 (its load) or -1 - tile column
    misc32 = o; o += 16;                             // see kAnyFeasible...
    asc = o; o += pt > 0 ? r + 2 : 0;                // [R+2] load << 6 | 63 - rank, ascending; 2 sentinels
    o += (4 - (o & 3)) & 3;                          // ovf: 16-byte aligned (after the search it holds the
    ovf = o; o += static_cast<size_t>(pt) * r;       // [pt][R] partial-set overflow of each thread probe
                                                     // reroute table: RerouteTableCapacity experts x [R] int4)
    used8 = o; o += pt > 0 && S > 2 ? (static_cast<size_t>(pt) * r + 3) / 4 : 0;  // [pt][R] bytes: replicas
    o += o & 1;                                      // stage: 8-byte aligned (int2 stores)
    stage = o; o += staged ? r * static_cast<size_t>(StageStride(E)) : 0;
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
  int chain_shift;              // thread search: first round's chain margin lo >> chain_shift (0 = no chain)
  int rtab_cap;                 // replicated experts whose per-source reroute table fits the ovf area
  int route_tile;               // the replicated columns go through a shared tile (whole-row route writes)
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
  int32_t* route;           // [R*I] with the plan's I (<= I_max = E + R*S); entries <= a load entry < 2^31
  int64_t* demand;          // [R*E]: replicated experts' residual demand when the load is not staged
  Layout layout;            // shared-memory offsets, computed on the host (kernel parameters stay in the
                            // constant bank, so the compiler rematerializes pointers instead of spilling)
};

struct Shared {
  int64_t *lam, *ell, *ell_sorted, *vlam, *slk, *node_lo, *node_hi, *rec_amount, *wrec_amount, *mi_local, *mi_w,
      *mi_total, *misc64;
  uint64_t* trec;
  int32_t *owner, *cnt, *expert_first, *grp, *gidx, *rank_order, *rank_pos, *vfirst, *vexp, *used, *feas, *rec_e,
      *rec_t, *rec_s, *wrec_e, *wrec_t, *wrec_s, *wnrec, *rep_first, *rep_count, *inst_off, *multi, *mt_first, *mi_e,
      *mi_i, *mi_host, *mi_m, *col_src, *misc32, *stage;
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
  s.mi_e = b32 + L.mi_e; s.mi_i = b32 + L.mi_i; s.mi_host = b32 + L.mi_host; s.mi_m = b32 + L.mi_m;
  s.mt_first = b32 + L.mt_first; s.col_src = b32 + L.col_src;
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
__device__ void RerouteInstance(const KernelArgs& a, Demand dcol, int32_t* out, int stride, int host, int64_t local,
                                int64_t wlo, int64_t whi, int64_t D) {
  const int R = a.R;
  if (kWide) {
    int64_t d = dcol(0), Dc = D;
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      const int64_t dn = r + 1 < R ? dcol(r + 1) : 0;
      if (d != 0 && Dc < d) a.out_misc[3] = 1;  // residual demand above residual quota
      const bool live = d > 0 && Dc >= d;
      const int64_t qlo = live ? d * wlo / Dc : 0, qhi = live ? d * whi / Dc : 0;
      *out = static_cast<int32_t>((qhi - qlo) + (r == host ? local : 0));
      out += stride;
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
      *out = (qh - ql) + (r == host ? static_cast<int32_t>(local) : 0);
      out += stride;
      wl -= ql;
      wh -= qh;
      d = dn;
      Dc = Dn;
      inv = invn;
    }
  }
}

// The same reroute from the expert's per-source table {d, max(D, 1), F} (built by PrepareExpert;
// experts below 2^25 rows), all in 32-bit integer arithmetic: F <= d * 2^32 / D < F + 3 is the fraction
// d / D in 0.32 fixed point (2^32 - 1 when d = D), so the high word of the 64-bit product W * F is
// within 3 W / 2^32 < 2^-6 below d * W / D, i.e. floor(d * W / D) or one less; the remainder
// d * W - q * D then lies in [0, 2D) < 2^26 and its low 32 bits decide the one upward correction.
// A source step is a wide multiply, a multiply-add, a compare and a subtraction on each W chain.
__device__ __forceinline__ void RerouteFromTable(const KernelArgs& a, const int4* tab, int32_t* out, int stride,
                                                 int host, int64_t local, int wl, int wh) {
  const int R = a.R;
  const int32_t loc = static_cast<int32_t>(local);
  uint32_t ul = static_cast<uint32_t>(wl), uh = static_cast<uint32_t>(wh);
  int4 v = tab[0];
#pragma unroll 4
  for (int r = 0; r < R; ++r) {
    const int4 vn = tab[r + 1 < R ? r + 1 : r];  // the next source's entry, loaded before this step's store
    const uint32_t d = static_cast<uint32_t>(v.x), D = static_cast<uint32_t>(v.y), F = static_cast<uint32_t>(v.z);
    const uint32_t el = __umulhi(ul, F), eh = __umulhi(uh, F);
    const uint32_t ql = el + (d * ul - el * D >= D ? 1u : 0u), qh = eh + (d * uh - eh * D >= D ? 1u : 0u);
    *out = static_cast<int32_t>(qh - ql) + (r == host ? loc : 0);
    out += stride;
    ul -= ql;
    uh -= qh;
    v = vn;
  }
}

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

// Measurement build (-DRDEP_GPU_PLANNER_FINE_STAMPS): every warp stamps clock64 into a slot (max) right
// before the block's barriers, so a slot holds the barrier's last arrival (thread 0's clock read after
// a barrier issues before the barrier releases: BAR.SYNC.DEFER_BLOCKING): setup steps, each search
// round, the preparation; phase 4's warps record their latest ends. One launch in 56 (the 30th of each
// Phases-test bench) prints the spans. Slots: see the RDEP_FINE calls.
#if defined(RDEP_GPU_PLANNER_FINE_STAMPS)
__device__ long long g_fine[32];
__device__ int g_fine_launch = 0;
#define RDEP_FINE(i)                                   \
  do {                                                 \
    if (threadIdx.x == 0) g_fine[i] = clock64();       \
  } while (0)
#define RDEP_FINE_MAX(i)                                                                              \
  do {                                                                                                \
    if ((threadIdx.x & 31) == 0)                                                                      \
      atomicMax(reinterpret_cast<unsigned long long*>(g_fine + (i)), static_cast<unsigned long long>(clock64())); \
  } while (0)
#else
#define RDEP_FINE(i) \
  do {               \
  } while (0)
#define RDEP_FINE_MAX(i) \
  do {                   \
  } while (0)
#endif

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

// Phase 4's preparation of replicated expert m, by one warp (lanes = its instances, then its sources):
// instance i (0 = the main one on the owner, i >= 1 = the expert's i-th transfer's replica) at j0 + i
// in the mi_* arrays, j0 = its first record + m; its local rows (locality: the host's own rows up to
// the quota); W_i = the residual quota of instances 0..i-1 and the residual total; the local rows taken
// out of the demand: in place in the staged load (one lane per host; single-instance experts' columns
// are never changed), or in a copy of the column in the global scratch when the load is not staged.
// With tab (and an expert below 2^25 rows) it then fills the per-source reroute table (lanes = sources):
// entry r = {d, max(D, 1), F, 0}, d the residual demand of source r, D the residual total before it and
// F the fraction d / D in 0.32 fixed point, rounded down (RerouteFromTable), so the instances' loop has
// no division and no demand scan on its chain.
__device__ void PrepareExpert(const KernelArgs& a, const Shared& s, int m, int4* tab) {
  const int lane = threadIdx.x & 31, R = a.R, E = a.E, ss = StageStride(E);
  const int e = s.multi[m], f = s.mt_first[m], nr = s.rep_count[e], k = nr + 1, j0 = f + m;
  const size_t col = static_cast<size_t>(e);
  int64_t moved = 0;
  for (int c = lane; c < nr; c += 32) moved += s.rec_amount[f + c];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) moved += __shfl_xor_sync(0xffffffffu, moved, off);
  int64_t carry = 0;
  for (int b = 0; b < k; b += 32) {  // uniform trip count: every lane shuffles
    const int i = b + lane;
    int host = 0;
    int64_t quota = 0, l = 0;
    if (i < k) {
      host = i == 0 ? s.owner[e] : s.rec_t[f + i - 1];
      quota = i == 0 ? s.lam[e] - moved : s.rec_amount[f + i - 1];
      l = a.locality ? min(a.staged ? static_cast<int64_t>(s.stage[static_cast<size_t>(host) * ss + col])
                                    : a.load[static_cast<size_t>(host) * E + col],
                           quota)
                     : 0;
    }
    const int64_t w = quota - l;
    int64_t inc = w;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t v = __shfl_up_sync(0xffffffffu, inc, off);
      if (lane >= off) inc += v;
    }
    if (i < k) {
      s.mi_e[j0 + i] = e;
      s.mi_i[j0 + i] = i;
      s.mi_host[j0 + i] = host;
      s.mi_m[j0 + i] = m;
      s.mi_local[j0 + i] = l;
      s.mi_w[j0 + i] = carry + inc - w;
    }
    carry += __shfl_sync(0xffffffffu, inc, 31);
  }
  for (int i = lane; i < k; i += 32) s.mi_total[j0 + i] = carry;
  if (!a.staged) {
    for (int r = lane; r < R; r += 32) a.demand[static_cast<size_t>(r) * E + col] = a.load[static_cast<size_t>(r) * E + col];
    __syncwarp();
  }
  for (int i = lane; i < k; i += 32) {
    const size_t host = static_cast<size_t>(s.mi_host[j0 + i]);
    if (a.staged) s.stage[host * ss + col] -= static_cast<int32_t>(s.mi_local[j0 + i]);
    else a.demand[host * E + col] -= s.mi_local[j0 + i];
  }
  __syncwarp();
  if (tab == nullptr || s.lam[e] >= kFastRerouteLoadLimit) return;  // the per-thread chains read the demand
  auto dem = [&](int r) -> int {
    return a.staged ? s.stage[static_cast<size_t>(r) * ss + col] : static_cast<int>(a.demand[static_cast<size_t>(r) * E + col]);
  };
  const int per = (R + 31) / 32, r0 = min(lane * per, R), r1 = min(r0 + per, R);
  int sum = 0;
  for (int r = r0; r < r1; ++r) sum += dem(r);
  int inc = sum;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += v;
  }
  int D = static_cast<int>(carry) - (inc - sum);
  bool bad = false;
  for (int r = r0; r < r1; ++r) {
    const int d = dem(r), Dp = max(D, 1);
    bad = bad || (d > 0 && D < d);  // residual demand above residual quota (the host's error)
    // q = d * 2^32 / D within two roundings (relative 2^-52, so within 2^-20 of it below 2^32): floor(q) - 1
    // is at most the exact quotient and more than it - 3.
    const double q = static_cast<double>(d) * 4294967296.0 * __drcp_rn(static_cast<double>(Dp));
    const double fq = fmin(fmax(floor(q) - 1.0, 0.0), 4294967295.0);
    tab[r] = make_int4(d, Dp, static_cast<int>(static_cast<uint32_t>(fq)), 0);
    D -= d;
  }
  if (__any_sync(0xffffffffu, bad) && lane == 0) a.out_misc[3] = 1;
}

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

#if defined(RDEP_GPU_PLANNER_STEP_STAMPS)
__device__ int g_stamp_prints = 0;
#endif

__global__ void __launch_bounds__(kThreads, 1) QuotaPlanKernel(KernelArgs a) {
  extern __shared__ __align__(16) char smem[];
  const Shared s = Carve(smem, a.layout);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int R = a.R, E = a.E;
#if defined(RDEP_GPU_PLANNER_FINE_STAMPS)
  // FINE_PASSES = 2 runs the whole solve twice in one launch (the second with warm instruction caches).
#ifndef RDEP_GPU_PLANNER_FINE_PASSES
#define RDEP_GPU_PLANNER_FINE_PASSES 1
#endif
#pragma unroll 1
  for (int pass = 0; pass < RDEP_GPU_PLANNER_FINE_PASSES; ++pass) {
  __syncthreads();
#endif
  auto stamp = [&](int i) {
    if (a.out_phase != nullptr && tid == 0) a.out_phase[i] = clock64();
  };
  stamp(0);
#if defined(RDEP_GPU_PLANNER_FINE_STAMPS)
  if (tid < 32) g_fine[tid] = 0;
  __syncthreads();
#endif
  RDEP_FINE(0);
  // Phase 0: expert loads and, when it fits, the load matrix staged into shared memory (int32), in one
  // pass over global memory (StageAndSumExperts).
  int sum_groups = 1;
  int64_t* const part = PartialSums(a, s, E % 2 == 0 ? 2 : 1, &sum_groups);
  if (E % 2 == 0) StageAndSumExperts<2>(a, s, sum_groups, part);
  else StageAndSumExperts<1>(a, s, sum_groups, part);
  for (int r = tid; r < R; r += kThreads) {
    s.ell[r] = 0;
    s.cnt[r] = 0;
  }
  if (tid < 16) s.misc32[tid] = 0;
  if (tid == 0) a.out_misc[3] = 0;
  RDEP_FINE_MAX(1);
  __syncthreads();
  const int ss = StageStride(E);
  auto ld = [&](int r, int e) -> int64_t {
    return a.staged ? static_cast<int64_t>(s.stage[static_cast<size_t>(r) * ss + e]) : a.load[static_cast<size_t>(r) * E + e];
  };

  // Phase 1: expert loads from the partial sums, rank loads, the visiting order.
  for (int e = tid; e < E; e += kThreads) {
    int64_t sum = 0;
    for (int g = 0; g < sum_groups; ++g) sum += part[static_cast<size_t>(g) * E + e];
    const int o = s.owner[e];
    s.lam[e] = sum;
    atomicAdd(reinterpret_cast<unsigned long long*>(s.ell + o), static_cast<unsigned long long>(sum));
    s.gidx[e] = atomicAdd(s.cnt + o, 1);
  }
  RDEP_FINE_MAX(2);
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
    // Rank order: Q lanes per rank (a power of two, R * Q <= the 992 threads of warps 1..31) count the
    // ranks ahead of it (descending load, ascending id) and, for the thread search's main list, behind
    // it (ascending load, ascending id).
    int Q = 1;
    while (Q < 32 && 2 * Q * R <= kThreads - 32) Q *= 2;
    const int t = tid - 32, sub = t & (Q - 1);
    for (int base = 0; base < R * Q; base += kThreads - 32) {  // uniform trip count: every lane shuffles
      const int idx = base + t, r = idx / Q;
      unsigned ahead = 0, below = 0;
      int64_t lr = 0;
      if (r < R) {
        lr = s.ell[r];
        for (int q = sub; q < R; q += Q) {
          const int64_t lq = s.ell[q];
          ahead += (lq > lr || (lq == lr && q < r)) ? 1u : 0u;
          below += (lq < lr || (lq == lr && q < r)) ? 1u : 0u;
        }
      }
      for (int off = Q / 2; off > 0; off >>= 1) {
        ahead += __shfl_xor_sync(0xffffffffu, ahead, off, Q);
        below += __shfl_xor_sync(0xffffffffu, below, off, Q);
      }
      if (r < R && sub == 0) {
        s.rank_order[ahead] = r;
        s.rank_pos[r] = static_cast<int>(ahead);
        if (a.pt > 0 && lr < kFastLoadLimit)
          s.asc[below] = (static_cast<uint32_t>(lr) << kFastRankBits) | static_cast<uint32_t>(63 - (r & 63));
      }
    }
    if (a.pt > 0 && tid >= 32 && tid < 34) s.asc[R + tid - 32] = 0xffffffffu;  // sentinels: no slack for any tau
  }
  RDEP_FINE_MAX(3);
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) s.grp[s.expert_first[s.owner[e]] + s.gidx[e]] = e;
  for (int ri = tid; ri < R; ri += kThreads) s.ell_sorted[ri] = s.ell[s.rank_order[ri]];
  RDEP_FINE_MAX(4);
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
  RDEP_FINE_MAX(5);
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
  RDEP_FINE_MAX(6);
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
  RDEP_FINE(16);

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
  RDEP_FINE_MAX(17);
  __syncthreads();
  stamp(3);
  const int nrec = s.misc32[kNumRec];
  if (tid == 0) {
    a.out_misc[0] = s.misc64[1];
    a.out_misc[1] = nrec;
    a.out_misc[2] = s.misc32[kNumProbes];
  }
  // Transfers of one expert are contiguous (each expert is visited once per probe).
  for (int k = tid; k < nrec; k += kThreads) {  // (the transfer list goes out in phase 4)
    const int e = s.rec_e[k];
    if (k == 0 || s.rec_e[k - 1] != e) s.rep_first[e] = k;
    atomicAdd(s.rep_count + e, 1);
  }
  for (int k = tid; k < R * a.S; k += kThreads) a.slot_expert[k] = -1;
  if (warp == 1) {
    // The replicated experts in record order: segment m of the records (one expert each) starts at
    // mt_first[m]; its instances will sit at f + m in the mi_* arrays (m main instances before it).
    int base = 0;
    for (int k0 = 0; k0 < nrec; k0 += 32) {
      const int k = k0 + lane;
      const bool start = k < nrec && (k == 0 || s.rec_e[k - 1] != s.rec_e[k]);
      const unsigned starts = __ballot_sync(0xffffffffu, start);
      if (start) {
        const int m = base + __popc(starts & ((1u << lane) - 1u));
        s.multi[m] = s.rec_e[k];
        s.mt_first[m] = k;
      }
      base += __popc(starts);
    }
    if (lane == 0) {
      s.misc32[kNumMulti] = base;
      s.misc32[kNumMultiInst] = nrec + base;
    }
  }
  RDEP_FINE_MAX(18);
  __syncthreads();
  // Warp 0 scans the instance offsets; warps 1..31 prepare one replicated expert each (PrepareExpert):
  // its instances, their locality, the cumulative residual quotas, the local rows out of the demand and
  // the per-source reroute table.
  const int num_multi = s.misc32[kNumMulti], num_mi = s.misc32[kNumMultiInst];
  int4* const rtab = reinterpret_cast<int4*>(s.ovf);  // the search's overflow area is free now
  const int tab_stride = R | 1;  // odd: different experts' entries of one source fall in different banks
  const int num_tab = min(num_multi, a.rtab_cap);
  if (tid == 0) s.misc64[2] = s.misc64[3] = 0;  // latest end of the replicated / single-instance work
  if (warp == 0) WarpExclusiveScan(E, [&](int e) { return 1 + s.rep_count[e]; }, s.inst_off);
  else
    for (int m = warp - 1; m < num_multi; m += kWarps - 1)
      PrepareExpert(a, s, m, m < num_tab ? rtab + static_cast<size_t>(m) * tab_stride : nullptr);
  RDEP_FINE_MAX(19);
  __syncthreads();
  stamp(4);
  const int I = s.inst_off[E];
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

  // Phase 4: the reroute (same math as SolveReroute) and the instance tables. The replicated instances'
  // route columns go to a tile in the records' area (free now: R rows of num_mi int32) when it holds
  // them, and the route is then written in whole rows once the reroute is done (straight to the route,
  // next to the single-instance entries written meanwhile, measured 3 us slower at the bench shape).
  const size_t tile_cap = (a.layout.mi_local - a.layout.trec) * 2 / static_cast<size_t>(R);
  const bool use_tile = a.route_tile && num_mi > 0 && static_cast<size_t>(num_mi) <= tile_cap;
  int32_t* const tile = reinterpret_cast<int32_t*>(s.trec);
  if (warp < busy) {
    const int nt = split ? busy * 32 : kThreads;
    for (int j = tid; j < num_mi; j += nt) {
      const int e = s.mi_e[j];
      const int64_t wlo = s.mi_w[j];
      const int64_t whi = j + 1 < num_mi && s.mi_e[j + 1] == e ? s.mi_w[j + 1] : s.mi_total[j];
      const int m = s.mi_m[j];
      // The output is either the shared tile or the global route, in separate calls: one pointer that
      // could be either makes every store generic and keeps the next source's load behind it.
      if (m < num_tab && s.lam[e] < kFastRerouteLoadLimit) {
        const int4* tab = rtab + static_cast<size_t>(m) * tab_stride;
        if (use_tile)
          RerouteFromTable(a, tab, tile + j, num_mi, s.mi_host[j], s.mi_local[j], static_cast<int>(wlo),
                           static_cast<int>(whi));
        else
          RerouteFromTable(a, tab, a.route + s.inst_off[e] + s.mi_i[j], I, s.mi_host[j], s.mi_local[j],
                           static_cast<int>(wlo), static_cast<int>(whi));
        continue;
      }
      // The per-thread chains (no table entry, or 2^25 rows and more: rare; a generic output pointer is
      // fine here). One typed accessor per home of the demand, not one with a branch inside: that
      // measured 20.5K -> 26.2K cycles for the replicated reroute (docs/perf-notes.md, round 4).
      int32_t* const out = use_tile ? tile + j : a.route + s.inst_off[e] + s.mi_i[j];
      const int stride = use_tile ? num_mi : I;
      if (a.staged) {
        auto dcol = [&](int r) -> int64_t { return s.stage[static_cast<size_t>(r) * ss + e]; };
        if (s.lam[e] < kFastRerouteLoadLimit)
          RerouteInstance<false>(a, dcol, out, stride, s.mi_host[j], s.mi_local[j], wlo, whi, s.mi_total[j]);
        else
          RerouteInstance<true>(a, dcol, out, stride, s.mi_host[j], s.mi_local[j], wlo, whi, s.mi_total[j]);
      } else {
        auto dcol = [&](int r) -> int64_t { return a.demand[static_cast<size_t>(r) * E + e]; };
        if (s.lam[e] < kFastRerouteLoadLimit)
          RerouteInstance<false>(a, dcol, out, stride, s.mi_host[j], s.mi_local[j], wlo, whi, s.mi_total[j]);
        else
          RerouteInstance<true>(a, dcol, out, stride, s.mi_host[j], s.mi_local[j], wlo, whi, s.mi_total[j]);
      }
    }
    mark_end(2);
    RDEP_FINE_MAX(20);
  }
  // Instance tables (one thread per expert), the transfer list and the route's column sources (or,
  // without the tile, the single-instance experts' route entries: every source's rows go to the main
  // instance), on the warps without a replicated instance when there are enough of them.
  // With fewer than 4 reroute warps, the others' work goes only to warps on the schedulers (warp % 4)
  // without one, so that the reroute's latency-bound chains never wait for an issue slot.
  const int iso = busy < 4 ? 4 - busy : 4;                  // schedulers free of reroute warps (or all)
  const bool helper = split && (busy >= 4 ? warp >= busy : (warp & 3) >= busy);
  if (!split || helper) {
    const int wi = split ? (busy >= 4 ? warp - busy : (warp >> 2) * iso + (warp & 3) - busy) : warp;
    const int nw = split ? (busy >= 4 ? kWarps - busy : (kWarps / 4) * iso) : kWarps;
    const int ti = wi * 32 + lane, nt = nw * 32;
    for (int e = ti; e <= E; e += nt) a.inst_offsets[e] = s.inst_off[e];
    for (int k = ti; k < nrec; k += nt) {
      a.tr_expert[k] = s.rec_e[k];
      a.tr_rank[k] = s.rec_t[k];
      a.tr_slot[k] = s.rec_s[k];
      a.tr_amount[k] = s.rec_amount[k];
    }
    for (int e = ti; e < E; e += nt) {
      const int b = s.inst_off[e], k = 1 + s.rep_count[e], f = s.rep_first[e];
      int64_t moved = 0;
      for (int c = 0; c < k - 1; ++c) moved += s.rec_amount[f + c];
      a.inst_expert[b] = e;
      a.inst_rank[b] = s.owner[e];
      a.inst_slot[b] = -1;
      a.inst_quota[b] = s.lam[e] - moved;
      if (k == 1) s.col_src[b] = e;  // column b of every route row: the expert's load entry
      for (int c = 0; c < k - 1; ++c) {
        a.inst_expert[b + 1 + c] = e;
        a.inst_rank[b + 1 + c] = s.rec_t[f + c];
        a.inst_slot[b + 1 + c] = s.rec_s[f + c];
        a.inst_quota[b + 1 + c] = s.rec_amount[f + c];
        a.slot_expert[s.rec_t[f + c] * a.S + s.rec_s[f + c]] = e;
      }
    }
    for (int j = ti; j < num_mi; j += nt) s.col_src[s.inst_off[s.mi_e[j]] + s.mi_i[j]] = -1 - j;  // tile column j
    RDEP_FINE_MAX(21);
    if (!use_tile) {
      for (int r = wi; r < R; r += nw) {
        int32_t* row = a.route + static_cast<size_t>(r) * I;
#pragma unroll 4
        for (int e = lane; e < E; e += 32)
          if (s.rep_count[e] == 0) row[s.inst_off[e]] = static_cast<int32_t>(ld(r, e));
      }
      mark_end(3);
    }
  }
  if (use_tile) {
    __syncthreads();
    for (int r = warp; r < R; r += kWarps) {
      int32_t* row = a.route + static_cast<size_t>(r) * I;
      const int32_t* trow = tile + static_cast<size_t>(r) * num_mi;
#pragma unroll 4
      for (int c = lane; c < I; c += 32) {  // both reads and a select: one store per lane, whole rows
        const int src = s.col_src[c];
        const int32_t from_load = static_cast<int32_t>(ld(r, max(src, 0))), from_tile = trow[max(-1 - src, 0)];
        row[c] = src >= 0 ? from_load : from_tile;
      }
    }
    mark_end(3);
  }
  RDEP_FINE_MAX(22);
#if defined(RDEP_GPU_PLANNER_FINE_STAMPS)
  RDEP_FINE_MAX(23);
  __syncthreads();
  if (tid == 0 && pass == RDEP_GPU_PLANNER_FINE_PASSES - 1 && atomicAdd(&g_fine_launch, 1) % 56 == 30) {
    const long long* f = g_fine;
    printf("fine (barrier = last warp's arrival): setup: stage+sums %lld, expert loads %lld, rank order %lld, groups %lld,"
           " expert order %lld, visit data %lld | search: round 0 probes %lld walk+unpack %lld, round 1 probes %lld"
           " walk+unpack %lld, round 2 probes %lld walk+unpack %lld | search total %lld | record %lld | outputs %lld |"
           " prep %lld | reroute %lld, tables %lld, rows %lld, end %lld | total %lld\n",
           f[1] - f[0], f[2] - f[1], f[3] - f[2], f[4] - f[3], f[5] - f[4], f[6] - f[5], f[8] - f[6], f[9] - f[8],
           f[11] ? f[11] - f[9] : 0, f[12] ? f[12] - f[11] : 0, f[14] ? f[14] - f[12] : 0, f[15] ? f[15] - f[14] : 0,
           f[16] - f[6], f[17] - f[16], f[18] - f[17], f[19] - f[18], f[20] ? f[20] - f[19] : 0, f[21] - f[19],
           f[22] - f[19], f[23] - f[19], f[23] - f[0]);
  }
#endif
  if (a.out_phase != nullptr) {
    __syncthreads();
    if (tid == 0) {
      a.out_phase[5] = s.misc64[2] != 0 ? static_cast<int64_t>(s.misc64[2]) : a.out_phase[4];
      a.out_phase[6] = s.misc64[3] != 0 ? static_cast<int64_t>(s.misc64[3]) : a.out_phase[4];
    }
    stamp(7);
  }
#if defined(RDEP_GPU_PLANNER_FINE_STAMPS)
  }  // pass
#endif
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
  int32_t* route = nullptr;
  int64_t *demand = nullptr, *phase = nullptr;
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
  // Measurement knobs: RDEP_GPU_PLANNER_PROBE_THREADS = the thread search's probes per round (1..1023,
  // default 128: one warp per scheduler), RDEP_GPU_PLANNER_CHAIN_SHIFT = its first round's chain margin
  // lo >> shift (default 5; 0 = no chain), RDEP_GPU_PLANNER_PROBE_WARPS caps the warp search's probe warps.
  int threads = kDefaultProbeThreads, chain_shift = kDefaultChainShift;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_PROBE_THREADS"); env != nullptr && std::atoi(env) >= 1)
    threads = std::min(kThreads - 1, std::atoi(env));
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_CHAIN_SHIFT"); env != nullptr && std::atoi(env) >= 0)
    chain_shift = std::min(30, std::atoi(env));
  int max_pw = kDefaultProbeWarps;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_PROBE_WARPS"); env != nullptr && std::atoi(env) >= 1)
    max_pw = std::min(31, std::atoi(env));
  // The thread search exists for R <= 64; with it, the warp search only runs for loads >= 2^26. When
  // shared memory is short, the probe threads halve.
  for (int pt = num_ranks <= 64 ? threads : 0;; pt /= 2) {
    for (bool staged : {true, false}) {
      if (staged && !stage_ok) continue;
      for (int pw = 31; pw >= 1; pw = (pw - 1) / 2) {  // 31, 15, 7, 3, 1 warps: 5..1 levels per round
        if (pw > max_pw) continue;
        const size_t bytes = Layout(num_ranks, num_experts, num_slots, pw, pt, staged).bytes();
        if (bytes <= static_cast<size_t>(optin))
          return GpuPlannerConfig{bytes, pw, pt, pt > 0 ? chain_shift : 0, staged};
      }
    }
    if (pt <= 0) break;
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
  // The device plan counts rows in int32 (a route entry is at most a load entry): every entry must fit.
  for (size_t i = 0; i < load.size(); ++i)
    if (load[i] > INT32_MAX)
      return InvalidArgument("GPU planner: load[" + std::to_string(i / static_cast<size_t>(owners.num_experts())) +
                             "][" + std::to_string(i % static_cast<size_t>(owners.num_experts())) + "] = " +
                             std::to_string(load[i]) + " rows exceeds 2^31 - 1 (the device plan counts rows in int32)");
  RDEP_ASSIGN_OR_RETURN(p->cfg, ChooseConfig(p->E, p->R, p->S, true));
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
  a.chain_shift = p->cfg.chain_shift;
  // The reroute table lives in the overflow area: pt * R int32 words hold (R | 1) int4 entries per expert.
  // RDEP_GPU_PLANNER_REROUTE_TABLE caps it (0: every expert takes the per-thread reciprocal chain).
  a.rtab_cap = a.pt * a.R / (4 * (a.R | 1));
  // RDEP_GPU_PLANNER_ROUTE_TILE=0: the reroute writes its columns straight to the route, next to the
  // single-instance entries written meanwhile (measurement knob).
  a.route_tile = 1;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_ROUTE_TILE"); env != nullptr) a.route_tile = std::atoi(env) != 0;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_REROUTE_TABLE"); env != nullptr && std::atoi(env) >= 0)
    a.rtab_cap = std::min(a.rtab_cap, std::atoi(env));
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
  std::vector<int32_t> route32(R * I);
  RDEP_CUDA_RETURN(cudaMemcpy(route32.data(), p.buf.route, R * I * 4, cudaMemcpyDeviceToHost));
  std::copy(route32.begin(), route32.end(), plan.route.begin());
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
