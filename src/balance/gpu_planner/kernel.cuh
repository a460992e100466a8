// The planner kernel: one block runs setup, the search, the records, the preparation and the reroute.
// Part of the GPU quota planner, included by src/balance/gpu_planner.cu alone (docs/balance.md).
#pragma once

#include "oracle.cuh"
#include "prepare.cuh"
#include "reroute.cuh"
#include "search.cuh"
#include "setup.cuh"
#include "state.cuh"

namespace rdep {
namespace gpu_planner_detail {

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
      s.misc64[2] = hi;  // the maximum rank load, for the gain gate (reused for phase ends from phase 4)
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
  // The gain gate (QuotaConfig::min_gain), as the host planner applies it (a.min_gain is uniform).
  if (a.min_gain > 0) {
    if (tid == 0 && s.misc32[kNumRec] > 0 && (s.misc64[2] - s.misc64[1]) / s.misc32[kNumRec] < a.min_gain) {
      s.misc32[kNumRec] = 0;
      s.misc64[1] = s.misc64[2];
    }
    __syncthreads();
  }
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

}  // namespace gpu_planner_detail
}  // namespace rdep
