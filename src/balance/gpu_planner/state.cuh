// The planner kernel's state: block shape, tuning defaults, the shared-memory layout (computed alike on
// host and device), the kernel arguments, the carved shared pointers, a warp scan and the measurement
// stamps (-DRDEP_GPU_PLANNER_FINE_STAMPS).
// Part of the GPU quota planner, included by src/balance/gpu_planner.cu alone (docs/balance.md).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <type_traits>

namespace rdep {
namespace gpu_planner_detail {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 1024;
constexpr int kDefaultProbeWarps = 31;  // warp search: 2^d - 1 warps, d levels of the binary search per round
constexpr int kDefaultProbeThreads = 128;  // thread search: one probe per thread, one warp per scheduler
constexpr int kDefaultChainShift = 5;      // first round: chain of nodes with tau >= lo + lo/2^5 (0 = none)
constexpr int kRecordingProbes = 64;       // thread search: warps 0-1's probes record their transfers

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
  int64_t min_gain;  // QuotaConfig::min_gain (0 = off)
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

}  // namespace gpu_planner_detail
}  // namespace rdep
