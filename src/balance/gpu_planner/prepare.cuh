// Phase 4's preparation of one replicated expert (PrepareExpert): instances, locality, residual quotas
// and its per-source reroute table.
// Part of the GPU quota planner, included by src/balance/gpu_planner.cu alone (docs/balance.md).
#pragma once

#include "reroute.cuh"
#include "state.cuh"

namespace rdep {
namespace gpu_planner_detail {

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

}  // namespace gpu_planner_detail
}  // namespace rdep
