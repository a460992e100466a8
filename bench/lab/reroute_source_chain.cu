// Lab (GPU planner, docs/perf-notes.md round 3): SM cycles per source of the replicated-expert reroute
// loop in its round-2 form (one warp per expert, shared exchange buffer), alone and with concurrent
// warps, storing route rows to global or not at all; skip 1 replaces the division, skip 2 the
// exchange reads, skip 3 both (wrong results, timing only).
//   nvcc -O3 -arch=sm_90a -o /tmp/rr bench/lab/reroute_source_chain.cu && /tmp/rr
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ __forceinline__ int DivModFast32(int64_t a, int D, double inv_d, int* rem) {
  int q = static_cast<int>(static_cast<double>(a) * inv_d);
  int r = static_cast<int>(static_cast<uint32_t>(a) - static_cast<uint32_t>(q) * static_cast<uint32_t>(D));
  const bool under = r < 0, over = r >= D;
  q += over ? 1 : (under ? -1 : 0);
  r += under ? D : (over ? -D : 0);
  *rem = r;
  return q;
}

// mode 0: global store per source, 1: shared store, 2: no store (sum kept)
__global__ void Reroute(int busy, int mode, int skip, int k, const int* load, int64_t* route, long long* cyc, int* sink) {
  __shared__ __align__(16) uint2 xb[32][64];
  __shared__ int64_t sroute[64 * 40];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int R = 64, I = 300;
  const long long c0 = clock64();
  int acc = 0;
  if (warp < busy) {
    const int e = warp, b = warp * 13;
    const bool valid = lane < k;
    // quotas: total demand = sum over sources of load[r][e]; split over k instances
    int total = 0;
    for (int r = lane; r < R; r += 32) total += load[r * 32 + e];
    total = __reduce_add_sync(0xffffffffu, total);
    int quota = valid ? total / k + (lane < total % k ? 1 : 0) : 0;
    int ru = quota, D = total;
    uint2* xbuf = xb[warp];
    int parity = 0;
    for (int r0 = 0; r0 < R; r0 += 32) {
      const int src = r0 + lane;
      const int dsrc = load[src * 32 + e];
      int before = dsrc;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, before, off);
        if (lane >= off) before += v;
      }
      before -= dsrc;
      const int d_at = D - before;
      const double inv_at = __drcp_rn(static_cast<double>(d_at > 0 ? d_at : 1));
      for (int j = 0; j < 32; ++j) {
        const int r = r0 + j;
        const int d = __shfl_sync(0xffffffffu, dsrc, j);
        const double inv = __shfl_sync(0xffffffffu, inv_at, j);
        int take = 0;
        if (d != 0) {
          int rem = 0;
          int base;
          if (skip & 1) { const int64_t a_ = static_cast<int64_t>(d) * ru; base = static_cast<int>(a_ >> 12); rem = static_cast<int>(a_ & 4095); }
          else base = DivModFast32(static_cast<int64_t>(d) * ru, D, inv, &rem);
          const uint32_t key = valid ? (static_cast<uint32_t>(rem) << 5) | static_cast<uint32_t>(31 - lane) : 0u;
          uint2* buf = xbuf + 32 * parity;
          parity ^= 1;
          buf[lane] = make_uint2(key, static_cast<uint32_t>(base));
          __syncwarp();
          const uint4* b4 = reinterpret_cast<const uint4*>(buf);
          int sum = 0, ahead = 0;
          if (skip & 2) { sum = base * k; ahead = lane; } else
          for (int u = 0; u < (k + 1) / 2; ++u) {
            const uint4 p = b4[u];
            sum += static_cast<int>(p.y + p.w);
            ahead += (p.x > key ? 1 : 0) + (p.z > key ? 1 : 0);
          }
          const int bump = ahead < d - sum ? 1 : 0;
          take = valid ? base + bump : 0;
          ru -= take;
          D -= d;
        }
        if (valid) {
          if (mode == 0) route[static_cast<size_t>(r) * I + b + lane] = take;
          else if (mode == 1) sroute[(r & 63) * 40 + lane] = take;
          else acc += take;
        }
      }
    }
    acc += ru;
  } else if (mode == 0) {
    // table warps: single-instance routes
    for (int r = warp - busy; r < R; r += 32 - busy)
      for (int x = lane; x < 236; x += 32) route[static_cast<size_t>(r) * I + 60 + x] = load[r * 32 + (x & 31)];
  }
  const long long c1 = clock64();
  if (lane == 0) cyc[warp] = c1 - c0;
  if (mode != 0) sink[threadIdx.x] = acc + static_cast<int>(sroute[lane]);
}

int main() {
  int* load; int64_t* route; long long* cyc; int* sink;
  int hload[64 * 32];
  for (int i = 0; i < 64 * 32; ++i) hload[i] = 200 + (i * 7919) % 3000;
  CK(cudaMalloc(&load, sizeof(hload))); CK(cudaMemcpy(load, hload, sizeof(hload), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&route, 64 * 300 * 8)); CK(cudaMalloc(&cyc, 32 * 8)); CK(cudaMalloc(&sink, 4096));
  const char* modes[] = {"global store", "shared store", "no store"};
  for (int skip = 0; skip < 4; ++skip)
  for (int mode = 0; mode < 3; mode += 2)
    for (int busy : {1, 20})
      for (int threads : {busy * 32, 1024}) {
        if (threads < busy * 32) continue;
        Reroute<<<1, threads>>>(busy, mode, skip, 12, load, route, cyc, sink);
        Reroute<<<1, threads>>>(busy, mode, skip, 12, load, route, cyc, sink);
        CK(cudaDeviceSynchronize());
        long long h[32]; CK(cudaMemcpy(h, cyc, 32 * 8, cudaMemcpyDeviceToHost));
        long long mx = 0; for (int w = 0; w < busy; ++w) mx = h[w] > mx ? h[w] : mx;
        printf("reroute skip %d %-12s busy %2d threads %4d: %.1f cycles/source (k=12)\n", skip, modes[mode], busy, threads, double(mx) / 64);
      }
  return 0;
}
