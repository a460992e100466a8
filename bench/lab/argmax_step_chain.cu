// Lab (GPU planner, docs/perf-notes.md round 3): SM cycles per step of the greedy oracle's step in its
// warp form (redux.sync argmax over 64 ranks, divergent or predicated owner update, or a shuffle
// argmax) and in the thread form (a scalar step over a shared main list and a sorted register set),
// with 1..32 warps doing the same independent work.
//   nvcc -O3 -arch=sm_90a -o /tmp/chain bench/lab/argmax_step_chain.cu && /tmp/chain
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ __forceinline__ uint32_t Key(int slk, int used, int S, int t) {
  return slk > 0 && used < S ? (static_cast<uint32_t>(slk) << 6) | static_cast<uint32_t>(63 - t) : 0u;
}

// variant 0: divergent owner update with shared record store (the product's form)
// variant 1: predicated update, record stored by lane 0 (uniform)
// variant 2: predicated, shfl-xor reduction instead of redux
// variant 3: redux only chain (x = redux(x ^ lane))
// variant 4: scalar per-thread chain: max of a shared-memory head and a register key, min3, update
__global__ void Chain(int steps, int variant, long long* cyc, unsigned* sink) {
  __shared__ uint64_t rec[32][64];
  __shared__ uint32_t list[1024 + 64];
  extern __shared__ __align__(16) char dyn[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < 1024 + 64; i += blockDim.x) list[i] = (1u << 20) - i * 7;
  __syncthreads();
  const int t0 = lane, t1 = lane + 32, S = 1 << 30, u = 3;
  int slk0 = (1 << 19) + (lane * 7919) % 4096, slk1 = (1 << 19) + (lane * 104729) % 4096, used0 = 0, used1 = 0;
  uint32_t key0 = Key(slk0, used0, S, t0), key1 = Key(slk1, used1, S, t1);
  int exc = 5, cap = 1 << 30, acc = 0;
  bool dup0 = false, dup1 = false;
  unsigned x = lane;
  __syncwarp();
  const long long c0 = clock64();
  if (variant == 0) {
    for (int i = 0; i < steps; ++i) {
      const uint32_t c0_ = dup0 ? 0u : key0, c1_ = dup1 ? 0u : key1;
      const uint32_t best = __reduce_max_sync(0xffffffffu, c0_ > c1_ ? c0_ : c1_);
      if (best == 0) break;
      const int bs = static_cast<int>(best >> 6), bt = 63 - static_cast<int>(best & 63u);
      int d = exc > u ? exc : u; d = d < bs ? d : bs; d = d < cap ? d : cap;
      if (d < u) break;
      if (bt == t0) { rec[warp][i & 63] = d; slk0 -= d; ++used0; key0 = Key(slk0, used0, S, t0); dup0 = (i % 3) != 2; }
      else if (bt == t1) { rec[warp][i & 63] = d; slk1 -= d; ++used1; key1 = Key(slk1, used1, S, t1); dup1 = (i % 3) != 2; }
      if ((i % 3) == 2) { dup0 = dup1 = false; }
      cap -= d;
    }
  } else if (variant == 1) {
    for (int i = 0; i < steps; ++i) {
      const uint32_t c0_ = dup0 ? 0u : key0, c1_ = dup1 ? 0u : key1;
      const uint32_t best = __reduce_max_sync(0xffffffffu, c0_ > c1_ ? c0_ : c1_);
      if (best == 0) break;
      const int bs = static_cast<int>(best >> 6);
      int d = exc > u ? exc : u; d = min(min(d, bs), cap);
      if (d < u) break;
      const uint32_t low = best & 63u;
      const bool h0 = low == static_cast<uint32_t>(63 - t0), h1 = low == static_cast<uint32_t>(63 - t1);
      if (lane == 0) rec[warp][i & 63] = (static_cast<uint64_t>(best) << 32) | d;
      slk0 -= h0 ? d : 0; used0 += h0; key0 = Key(slk0, used0, S, t0);
      slk1 -= h1 ? d : 0; used1 += h1; key1 = Key(slk1, used1, S, t1);
      const bool nv = (i % 3) == 2;
      dup0 = !nv && (dup0 || h0); dup1 = !nv && (dup1 || h1);
      cap -= d;
    }
  } else if (variant == 2) {
    for (int i = 0; i < steps; ++i) {
      const uint32_t c0_ = dup0 ? 0u : key0, c1_ = dup1 ? 0u : key1;
      uint32_t best = c0_ > c1_ ? c0_ : c1_;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, off));
      if (best == 0) break;
      const int bs = static_cast<int>(best >> 6);
      int d = exc > u ? exc : u; d = min(min(d, bs), cap);
      if (d < u) break;
      const uint32_t low = best & 63u;
      const bool h0 = low == static_cast<uint32_t>(63 - t0), h1 = low == static_cast<uint32_t>(63 - t1);
      if (lane == 0) rec[warp][i & 63] = (static_cast<uint64_t>(best) << 32) | d;
      slk0 -= h0 ? d : 0; used0 += h0; key0 = Key(slk0, used0, S, t0);
      slk1 -= h1 ? d : 0; used1 += h1; key1 = Key(slk1, used1, S, t1);
      const bool nv = (i % 3) == 2;
      dup0 = !nv && (dup0 || h0); dup1 = !nv && (dup1 || h1);
      cap -= d;
    }
  } else if (variant == 3) {
    for (int i = 0; i < steps; ++i) x = __reduce_max_sync(0xffffffffu, x ^ static_cast<unsigned>(lane));
    acc = static_cast<int>(x);

  } else if (variant == 5 || variant == 6 || variant == 7) {
    // 5: branch-free chain (no exits, no record); 6: + uniform exits; 7: + record store (dynamic smem ptr)
    uint64_t* drec = reinterpret_cast<uint64_t*>(dyn) + warp * 64;
    for (int i = 0; i < steps; ++i) {
      const uint32_t c0_ = dup0 ? 0u : key0, c1_ = dup1 ? 0u : key1;
      const uint32_t best = __reduce_max_sync(0xffffffffu, c0_ > c1_ ? c0_ : c1_);
      const int bs = static_cast<int>(best >> 6);
      int d = exc > u ? exc : u; d = min(min(d, bs), cap);
      if (variant >= 6) { if (best == 0 || d < u) break; }
      const uint32_t low = best & 63u;
      const bool h0 = low == static_cast<uint32_t>(63 - t0), h1 = low == static_cast<uint32_t>(63 - t1);
      if (variant == 7 && lane == 0) drec[i & 63] = (static_cast<uint64_t>(best) << 32) | d;
      slk0 -= h0 ? d : 0; used0 += h0; key0 = Key(slk0, used0, S, t0);
      slk1 -= h1 ? d : 0; used1 += h1; key1 = Key(slk1, used1, S, t1);
      dup0 = dup0 != h0; dup1 = dup1 != h1;
      cap -= d;
    }
  } else if (variant == 8) {
    // scalar thread step with a 4-entry sorted partial set in registers
    int head = threadIdx.x & 63;
    uint32_t p0 = 1u << 19, p1 = 0, p2 = 0, p3 = 0, mk = list[head];
    for (int i = 0; i < steps; ++i) {
      const uint32_t best = mk > p0 ? mk : p0;
      const int bs = static_cast<int>(best >> 6);
      int d = exc > u ? exc : u; d = min(min(d, bs), cap);
      if (best == 0 || d < u) break;
      const bool fm = best == mk;
      head += fm ? 1 : 0;
      // pop p0 when taken from the partial set
      uint32_t q0 = fm ? p0 : p1, q1 = fm ? p1 : p2, q2 = fm ? p2 : p3, q3 = fm ? p3 : 0u;
      const uint32_t nk = (i & 1) ? ((static_cast<uint32_t>(bs - d) << 6) | (best & 63u)) : 0u;
      // sorted insert of nk
      const bool g0 = nk > q0, g1 = nk > q1, g2 = nk > q2, g3 = nk > q3;
      p0 = g0 ? nk : q0; p1 = g0 ? q0 : (g1 ? nk : q1); p2 = g1 ? q1 : (g2 ? nk : q2); p3 = g2 ? q2 : (g3 ? nk : q3);
      mk = list[head & 1023];
      cap -= d;
    }
    acc = static_cast<int>(p0 + p1 + p2 + p3 + mk);
  } else {
    // scalar: head pointer into a shared list, one register partial key
    int head = threadIdx.x & 63;
    uint32_t pk = 1u << 19, mk = list[head];
    for (int i = 0; i < steps; ++i) {
      const uint32_t best = mk > pk ? mk : pk;
      const int bs = static_cast<int>(best >> 6);
      int d = exc > u ? exc : u; d = min(min(d, bs), cap);
      if (d < u) break;
      const bool fm = best == mk;
      head += fm ? 1 : 0;
      const uint32_t nk = (static_cast<uint32_t>(bs - d) << 6) | (best & 63u);
      pk = fm ? (pk > nk ? pk : nk) : nk;
      mk = list[head & 1023];
      cap -= d;
    }
    acc = static_cast<int>(pk + mk);
  }
  const long long c1 = clock64();
  if (lane == 0) cyc[warp] = c1 - c0;
  sink[threadIdx.x] = key0 + key1 + static_cast<unsigned>(acc) + static_cast<unsigned>(cap) + static_cast<unsigned>(rec[warp][lane & 63]);
}

int main() {
  long long* cyc; unsigned* sink;
  CK(cudaMalloc(&cyc, 32 * sizeof(long long))); CK(cudaMalloc(&sink, 1024 * 4));
  const int steps = 2000;
  const char* names[] = {"divergent+redux", "predicated+redux", "predicated+shfl", "redux only", "scalar thread", "chain no exits", "chain + exits", "chain + exits + rec", "thread + 4 partials"};
  for (int v = 3; v < 9; ++v)
    for (int warps : {1, 4, 8, 16, 32}) {
      if (v == 6 || v == 7) continue;  // these variants leave their loop early (dup toggling): not a measurement
      Chain<<<1, warps * 32, 32 * 64 * 8>>>(steps, v, cyc, sink);
      Chain<<<1, warps * 32, 32 * 64 * 8>>>(steps, v, cyc, sink);
      CK(cudaDeviceSynchronize());
      long long h[32]; CK(cudaMemcpy(h, cyc, warps * sizeof(long long), cudaMemcpyDeviceToHost));
      long long mx = 0; for (int w = 0; w < warps; ++w) mx = h[w] > mx ? h[w] : mx;
      printf("chain %-18s warps %2d: %.1f cycles/step\n", names[v], warps, double(mx) / steps);
    }
  return 0;
}
