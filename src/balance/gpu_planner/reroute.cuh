// The reroute of one instance of a replicated expert, by one thread: from the per-source table
// (RerouteFromTable) or by the per-thread chains (RerouteInstance).
// Part of the GPU quota planner, included by src/balance/gpu_planner.cu alone (docs/balance.md).
#pragma once

#include "state.cuh"

namespace rdep {
namespace gpu_planner_detail {

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

}  // namespace gpu_planner_detail
}  // namespace rdep
