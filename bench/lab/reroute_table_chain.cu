// Lab (GPU planner, docs/perf-notes.md round 5): SM cycles per source of the per-instance reroute loop
// (one thread per instance, two cumulative-quota chains W_lo, W_hi through R = 64 sources; W -= floor(d *
// W / D)) in four forms, 3 busy warps, the take stored to global per source:
//   0  round 4's loop: d read from a staged [R][E] int32 matrix, the reciprocal of the next D computed in
//      the loop (__drcp_rn), floor by the double product d*W*inv, corrected both ways;
//   1  a per-source table {d, max(D, 1), 1/D} (int4 in shared memory, computed beforehand), same floor;
//   2  a table {d, max(D, 1), f = d * (1/D)}: q = trunc(double(W) * f), then one upward correction
//      (the estimate is floor or floor - 1), all on 32-bit integers;
//   3  as 2 with the W chains kept in double (trunc, fma remainder, compare, add).
// Every form is checked against int64 division on the host. Each variant also runs with the loop
// unrolled by 4 (u4).
//   nvcc -O3 -arch=sm_90a -o /tmp/rt bench/lab/reroute_table_chain.cu && /tmp/rt
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      printf("%s: %s\n", #x, cudaGetErrorString(e_));                      \
      return 1;                                                            \
    }                                                                      \
  } while (0)

constexpr int R = 64, E = 256, M = 48, J = 96, I = 320;  // M replicated experts, J instances (2 per expert)

__device__ __forceinline__ int FloorDivFast32(int64_t a, int D, double inv_d) {
  const int q = static_cast<int>(static_cast<double>(a) * inv_d);
  const int r = static_cast<int>(static_cast<uint32_t>(a) - static_cast<uint32_t>(q) * static_cast<uint32_t>(D));
  return q + (r >= D ? 1 : (r < 0 ? -1 : 0));
}

template <int kVariant, int kUnroll>
__global__ void Reroute(const int* load, const int* e_of_m, const int* wlo_in, const int* whi_in, const int* total,
                        int64_t* route, long long* cyc) {
  extern __shared__ __align__(16) char smem[];
  int* stage = reinterpret_cast<int*>(smem);                      // [R][E]
  int4* table = reinterpret_cast<int4*>(smem + R * E * 4);        // [M][R]
  for (int i = threadIdx.x; i < R * E; i += blockDim.x) stage[i] = load[i];
  __syncthreads();
  // The table: one warp per expert, two sources per lane, D_r = total - exclusive prefix.
  if (kVariant != 0) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int m = warp; m < M; m += blockDim.x / 32) {
      const int e = e_of_m[m];
      const int d0 = stage[(2 * lane) * E + e], d1 = stage[(2 * lane + 1) * E + e];
      int inc = d0 + d1;
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inc, off);
        if (lane >= off) inc += v;
      }
      const int D0 = total[m] - (inc - d0 - d1), D1 = D0 - d0;
      const double i0 = __drcp_rn(static_cast<double>(D0 > 0 ? D0 : 1)), i1 = __drcp_rn(static_cast<double>(D1 > 0 ? D1 : 1));
      const double v0 = kVariant == 1 ? i0 : static_cast<double>(d0) * i0, v1 = kVariant == 1 ? i1 : static_cast<double>(d1) * i1;
      table[m * R + 2 * lane] = make_int4(d0, max(D0, 1), __double2loint(v0), __double2hiint(v0));
      table[m * R + 2 * lane + 1] = make_int4(d1, max(D1, 1), __double2loint(v1), __double2hiint(v1));
    }
  }
  __syncthreads();
  const int j = threadIdx.x;
  if (j >= J) return;
  const int m = j / 2, e = e_of_m[m];
  long long c0 = clock64();
  int64_t* out = route + j;
  if (kVariant == 0) {
    int d = stage[e], Dc = total[m], wl = wlo_in[j], wh = whi_in[j];
    double inv = __drcp_rn(static_cast<double>(Dc > 0 ? Dc : 1));
#pragma unroll kUnroll
    for (int r = 0; r < R; ++r) {
      const int dn = r + 1 < R ? stage[(r + 1) * E + e] : 0, Dn = Dc - d;
      const double invn = __drcp_rn(static_cast<double>(Dn > 0 ? Dn : 1));
      const bool live = d > 0 && Dc >= d;
      const int ql = live ? FloorDivFast32(static_cast<int64_t>(d) * wl, Dc, inv) : 0;
      const int qh = live ? FloorDivFast32(static_cast<int64_t>(d) * wh, Dc, inv) : 0;
      *out = static_cast<int64_t>(qh - ql);
      out += I;
      wl -= ql;
      wh -= qh;
      d = dn;
      Dc = Dn;
      inv = invn;
    }
  } else if (kVariant == 1) {
    const int4* t = table + m * R;
    int wl = wlo_in[j], wh = whi_in[j];
#pragma unroll kUnroll
    for (int r = 0; r < R; ++r) {
      const int4 v = t[r];
      const double inv = __hiloint2double(v.w, v.z);
      const int ql = FloorDivFast32(static_cast<int64_t>(v.x) * wl, v.y, inv);
      const int qh = FloorDivFast32(static_cast<int64_t>(v.x) * wh, v.y, inv);
      *out = static_cast<int64_t>(qh - ql);
      out += I;
      wl -= ql;
      wh -= qh;
    }
  } else if (kVariant == 2) {
    const int4* t = table + m * R;
    int wl = wlo_in[j], wh = whi_in[j];
#pragma unroll kUnroll
    for (int r = 0; r < R; ++r) {
      const int4 v = t[r];
      const double f = __hiloint2double(v.w, v.z);
      const uint32_t d = static_cast<uint32_t>(v.x), D = static_cast<uint32_t>(v.y);
      const int el = static_cast<int>(static_cast<double>(wl) * f), eh = static_cast<int>(static_cast<double>(wh) * f);
      const uint32_t rl = d * static_cast<uint32_t>(wl) - static_cast<uint32_t>(el) * D;
      const uint32_t rh = d * static_cast<uint32_t>(wh) - static_cast<uint32_t>(eh) * D;
      const int ql = el + (rl >= D ? 1 : 0), qh = eh + (rh >= D ? 1 : 0);
      *out = static_cast<int64_t>(qh - ql);
      out += I;
      wl -= ql;
      wh -= qh;
    }
  } else {
    const int4* t = table + m * R;
    double wl = wlo_in[j], wh = whi_in[j];
#pragma unroll kUnroll
    for (int r = 0; r < R; ++r) {
      const int4 v = t[r];
      const double f = __hiloint2double(v.w, v.z), d = v.x, D = v.y;
      const double el = trunc(wl * f), eh = trunc(wh * f);
      const double rl = fma(-el, D, d * wl), rh = fma(-eh, D, d * wh);
      const double ql = el + (rl >= D ? 1.0 : 0.0), qh = eh + (rh >= D ? 1.0 : 0.0);
      *out = static_cast<int64_t>(qh - ql);
      out += I;
      wl -= ql;
      wh -= qh;
    }
  }
  const long long c1 = clock64();
  cyc[j] = c1 - c0;
}

template <int kVariant, int kUnroll>
int Run(const char* name, int* dload, int* dem, int* dwl, int* dwh, int* dtot, int64_t* droute, long long* dcyc,
        const std::vector<int64_t>& ref) {
  const size_t smem = static_cast<size_t>(R) * E * 4 + static_cast<size_t>(M) * R * 16;
  CK(cudaFuncSetAttribute(Reroute<kVariant, kUnroll>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  long long best = 1LL << 60;
  for (int it = 0; it < 20; ++it) {
    CK(cudaMemset(droute, 0xff, sizeof(int64_t) * R * I));
    Reroute<kVariant, kUnroll><<<1, 1024, smem>>>(dload, dem, dwl, dwh, dtot, droute, dcyc);
    CK(cudaDeviceSynchronize());
    std::vector<long long> cyc(J);
    CK(cudaMemcpy(cyc.data(), dcyc, sizeof(long long) * J, cudaMemcpyDeviceToHost));
    long long mx = 0;
    for (long long c : cyc) mx = c > mx ? c : mx;
    best = mx < best ? mx : best;
  }
  std::vector<int64_t> got(static_cast<size_t>(R) * I);
  CK(cudaMemcpy(got.data(), droute, sizeof(int64_t) * R * I, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) bad += got[static_cast<size_t>(r) * I + j] != ref[static_cast<size_t>(r) * I + j];
  printf("variant %d %-28s unroll %d: %6lld cycles, %5.1f per source, %s\n", kVariant, name, kUnroll, best,
         static_cast<double>(best) / R, bad ? "WRONG" : "exact");
  return bad ? 1 : 0;
}

int main() {
  srand(7);
  std::vector<int> load(static_cast<size_t>(R) * E), em(M), wl(J), wh(J), tot(M);
  for (auto& v : load) v = rand() % 4000;
  for (int m = 0; m < M; ++m) {
    em[m] = (m * 5 + 3) % E;
    for (int r = 0; r < R; ++r) load[static_cast<size_t>(r) * E + em[m]] = rand() % (1 << 18);  // hot: D up to 2^24
    if (m % 7 == 0) load[static_cast<size_t>(m % R) * E + em[m]] = 0;
    int64_t s = 0;
    for (int r = 0; r < R; ++r) s += load[static_cast<size_t>(r) * E + em[m]];
    tot[m] = static_cast<int>(s);
    const int cut = static_cast<int>(static_cast<int64_t>(rand()) % (s + 1));
    wl[2 * m] = 0, wh[2 * m] = cut, wl[2 * m + 1] = cut, wh[2 * m + 1] = static_cast<int>(s);
  }
  std::vector<int64_t> ref(static_cast<size_t>(R) * I, -1);
  for (int j = 0; j < J; ++j) {
    const int m = j / 2, e = em[m];
    int64_t a = wl[j], b = wh[j], D = tot[m];
    for (int r = 0; r < R; ++r) {
      const int64_t d = load[static_cast<size_t>(r) * E + e];
      const int64_t qa = D > 0 ? d * a / D : 0, qb = D > 0 ? d * b / D : 0;
      ref[static_cast<size_t>(r) * I + j] = qb - qa;
      a -= qa, b -= qb, D -= d;
    }
  }
  int *dload, *dem, *dwl, *dwh, *dtot;
  int64_t* droute;
  long long* dcyc;
  CK(cudaMalloc(&dload, load.size() * 4));
  CK(cudaMalloc(&dem, M * 4));
  CK(cudaMalloc(&dwl, J * 4));
  CK(cudaMalloc(&dwh, J * 4));
  CK(cudaMalloc(&dtot, M * 4));
  CK(cudaMalloc(&droute, sizeof(int64_t) * R * I));
  CK(cudaMalloc(&dcyc, sizeof(long long) * J));
  CK(cudaMemcpy(dload, load.data(), load.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dem, em.data(), M * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dwl, wl.data(), J * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dwh, wh.data(), J * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dtot, tot.data(), M * 4, cudaMemcpyHostToDevice));
  int bad = 0;
  bad += Run<0, 1>("round 4 (drcp in loop)", dload, dem, dwl, dwh, dtot, droute, dcyc, ref);
  bad += Run<1, 1>("table {d, D, 1/D}", dload, dem, dwl, dwh, dtot, droute, dcyc, ref);
  bad += Run<1, 4>("table {d, D, 1/D}", dload, dem, dwl, dwh, dtot, droute, dcyc, ref);
  bad += Run<2, 1>("table {d, D, d/D}, int W", dload, dem, dwl, dwh, dtot, droute, dcyc, ref);
  bad += Run<2, 4>("table {d, D, d/D}, int W", dload, dem, dwl, dwh, dtot, droute, dcyc, ref);
  bad += Run<3, 1>("table {d, D, d/D}, double W", dload, dem, dwl, dwh, dtot, droute, dcyc, ref);
  bad += Run<3, 4>("table {d, D, d/D}, double W", dload, dem, dwl, dwh, dtot, droute, dcyc, ref);
  return bad ? 1 : 0;
}
