// What the GEMM labs share (grouped_gemm_tiles, lt_grouped_gemm, cutlass_dense_gemm): random device operands,
// the p50 of CUDA-event timings, flag lists, and the expert MLP's six GEMMs over one set of buffers (each
// expert's (m, n, k) and operand pointers in grouped_gemm_sm90.h's row-major layouts).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "lab_check.h"

namespace gemm_lab {

// elems elements of elem_bytes on the device: bf16 drawn uniformly from [-1, 1) (elem_bytes 2), else zeros.
inline void* Random(size_t elems, size_t elem_bytes, uint32_t seed) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(elems * elem_bytes, 256)));
  if (elem_bytes != 2) {
    CK(cudaMemset(p, 0, elems * elem_bytes));
    return p;
  }
  std::vector<__nv_bfloat16> host(elems);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& v : host) v = __float2bfloat16(u(rng));
  CK(cudaMemcpy(p, host.data(), elems * 2, cudaMemcpyHostToDevice));
  return p;
}

// run() `warmup` times, then `iters` times each between two events on s: the p50 in microseconds.
template <class Fn>
double P50Us(int warmup, int iters, cudaStream_t s, Fn&& run) {
  for (int i = 0; i < warmup; ++i) run();
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters));
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (size_t i = 0; i < static_cast<size_t>(iters); ++i) {
    CK(cudaEventRecord(ev[2 * i], s));
    run();
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<float> ms(static_cast<size_t>(iters));
  for (size_t i = 0; i < ms.size(); ++i) CK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return 1e3 * ms[ms.size() / 2];
}

// Rows per expert for E experts averaging mu: every one mu (equal), or a multinomial draw of mu * E rows over the
// experts (uniform routing), seeded by mu so that every lab draws the same counts.
inline std::vector<int64_t> MultinomialCounts(int64_t E, int64_t mu, bool equal) {
  std::vector<int64_t> c(static_cast<size_t>(E), equal ? mu : 0);
  if (equal) return c;
  std::mt19937_64 rng(static_cast<uint64_t>(mu) * 7919u + 1);
  std::uniform_int_distribution<int64_t> pick(0, E - 1);
  for (int64_t r = 0; r < mu * E; ++r) ++c[static_cast<size_t>(pick(rng))];
  return c;
}

// "a,b,c" as a list ("all" and empty entries dropped: an empty list means every one).
inline std::vector<std::string> SplitList(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream ss(v);
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty() && p != "all") out.push_back(p);
  return out;
}

inline bool Chosen(const std::vector<std::string>& list, const std::string& name) {
  return list.empty() || std::find(list.begin(), list.end(), name) != list.end();
}

// The expert MLP's operands for up to `rows` rows and E experts (bf16; the weight gradients fp32).
struct MlpBuffers {
  int64_t E = 0, H = 0, F = 0;
  char *x, *h, *z, *y, *dout, *dz, *dh, *dx, *w1, *w2, *dw1, *dw2;
};

inline MlpBuffers AllocMlp(int64_t E, int64_t H, int64_t F, int64_t rows) {
  const auto R = static_cast<size_t>(rows), Hs = static_cast<size_t>(H), Fs = static_cast<size_t>(F), Es = static_cast<size_t>(E);
  MlpBuffers b{};
  b.E = E, b.H = H, b.F = F;
  auto mk = [](size_t n, size_t bytes, uint32_t seed) { return static_cast<char*>(Random(n, bytes, seed)); };
  b.x = mk(R * Hs, 2, 1), b.h = mk(R * 2 * Fs, 2, 2), b.z = mk(R * Fs, 2, 3), b.y = mk(R * Hs, 2, 4);
  b.dout = mk(R * Hs, 2, 5), b.dz = mk(R * Fs, 2, 6), b.dh = mk(R * 2 * Fs, 2, 7), b.dx = mk(R * Hs, 2, 8);
  b.w1 = mk(Es * Hs * 2 * Fs, 2, 9), b.w2 = mk(Es * Fs * Hs, 2, 10);
  b.dw1 = mk(Es * Hs * 2 * Fs, 4, 11), b.dw2 = mk(Es * Fs * Hs, 4, 12);
  return b;
}

// One expert's problem of one GEMM ("g1" h = x.W1, "g2" y = z.W2, "dz" dout.W2^T, "dx" dh.W1^T, "dw2" z^T.dout,
// "dw1" x^T.dh): expert e with rows [off, off + m); its output goes to `out` (null: the role's own buffer). M, N, K as
// the grouped kernels take them (the weight gradients reduce over the rows).
struct MlpProblem {
  int32_t m = 0, n = 0, k = 0;
  const void *a = nullptr, *b = nullptr;
  void* d = nullptr;
};

inline MlpProblem MlpGroup(const std::string& role, const MlpBuffers& b, char* out, int64_t e, int64_t off, int64_t m) {
  const int64_t H = b.H, F = b.F;
  auto at = [](char* base, int64_t elems, int64_t bytes) { return static_cast<void*>(base + elems * bytes); };
  auto o = [&](char* own) { return out ? out : own; };
  auto mn = [](int64_t v) { return static_cast<int32_t>(v); };
  if (role == "g1") return {mn(m), mn(2 * F), mn(H), at(b.x, off * H, 2), at(b.w1, e * H * 2 * F, 2), at(o(b.h), off * 2 * F, 2)};
  if (role == "g2") return {mn(m), mn(H), mn(F), at(b.z, off * F, 2), at(b.w2, e * F * H, 2), at(o(b.y), off * H, 2)};
  if (role == "dz") return {mn(m), mn(F), mn(H), at(b.dout, off * H, 2), at(b.w2, e * F * H, 2), at(o(b.dz), off * F, 2)};
  if (role == "dx") return {mn(m), mn(H), mn(2 * F), at(b.dh, off * 2 * F, 2), at(b.w1, e * H * 2 * F, 2), at(o(b.dx), off * H, 2)};
  if (role == "dw2") return {mn(F), mn(H), mn(m), at(b.z, off * F, 2), at(b.dout, off * H, 2), at(o(b.dw2), e * F * H, 4)};
  return {mn(H), mn(2 * F), mn(m), at(b.x, off * H, 2), at(b.dh, off * 2 * F, 2), at(o(b.dw1), e * H * 2 * F, 4)};  // dw1
}

}  // namespace gemm_lab
