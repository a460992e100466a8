// Tuner for the CUTLASS grouped GEMMs (src/experts/grouped_gemm_sm90.h): times each GEMM of the expert
// MLP alone, for every tile configuration built, at each mu (rows per local expert, every expert
// equal), and prints useful TFLOP/s (2*m*n*k over real rows) so that each role's default tile can be
// chosen from one run. Operands are random bf16 (a uniform draw per element); the tables are filled
// from the host once per (role, mu), so only the kernel is timed (CUDA events around each Run).
//   build-dev/bench/lab/grouped_gemm_tiles [--experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072
//                                          --iters 50 --warmup 10 --roles g1,g2,dz,dx,dw2,dw1 --tiles all
//                                          --wgrad-beta 1]
// --roles, --tiles: only these GEMMs, only these tiles (names as printed; all: every tile built).
// --wgrad-beta: the weight gradients' beta, 1 (accumulate into D: reads and writes the fp32 gradient) or 0
// (overwrite: writes it only, as the first micro-batch of a step does).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "experts/grouped_gemm_sm90.h"

namespace {

using rdep::kernels::internal::GemmProblem;
using rdep::kernels::internal::GroupedGemmKind;
using rdep::kernels::internal::GroupedGemmSm90;
using rdep::kernels::internal::GroupedGemmTile;

#define CHECK_CUDA(x)                                                                            \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

struct Options {
  int64_t E = 16, H = 2048, F = 1408;
  std::vector<int64_t> mus = {128, 384, 768, 1536, 3072};
  int iters = 50, warmup = 10;
  std::vector<std::string> roles, tiles;  // empty: all
  float wgrad_beta = 1.f;
};

std::vector<std::string> SplitList(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream ss(v);
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty() && p != "all") out.push_back(p);
  return out;
}

bool Chosen(const std::vector<std::string>& list, const std::string& name) {
  return list.empty() || std::find(list.begin(), list.end(), name) != list.end();
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--experts") o.E = std::atoll(v.c_str());
    else if (k == "--hidden") o.H = std::atoll(v.c_str());
    else if (k == "--ffn") o.F = std::atoll(v.c_str());
    else if (k == "--iters") o.iters = std::atoi(v.c_str());
    else if (k == "--warmup") o.warmup = std::atoi(v.c_str());
    else if (k == "--roles") o.roles = SplitList(v);
    else if (k == "--tiles") o.tiles = SplitList(v);
    else if (k == "--wgrad-beta") o.wgrad_beta = static_cast<float>(std::atof(v.c_str()));
    else if (k == "--mu") {
      o.mus.clear();
      std::stringstream ss(v);
      for (std::string p; std::getline(ss, p, ',');) o.mus.push_back(std::atoll(p.c_str()));
    } else {
      std::fprintf(stderr, "grouped_gemm_tiles: unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (o.E < 1 || o.H < 8 || o.F < 8 || o.H % 8 || o.F % 8 || o.iters < 1) {
    std::fprintf(stderr, "grouped_gemm_tiles: need experts >= 1, hidden and ffn multiples of 8, iters >= 1\n");
    std::exit(2);
  }
  if (o.wgrad_beta != 0.f && o.wgrad_beta != 1.f) {
    std::fprintf(stderr, "grouped_gemm_tiles: --wgrad-beta: 0 or 1\n");
    std::exit(2);
  }
  for (const std::string& r : o.roles)
    if (!Chosen({"g1", "g2", "dz", "dx", "dw2", "dw1"}, r)) {
      std::fprintf(stderr, "grouped_gemm_tiles: --roles: unknown GEMM %s (g1, g2, dz, dx, dw2, dw1)\n", r.c_str());
      std::exit(2);
    }
  for (const std::string& t : o.tiles)
    if (!rdep::kernels::internal::ParseGroupedGemmTile(t).ok()) {
      std::fprintf(stderr, "grouped_gemm_tiles: --tiles: unknown tile %s\n", t.c_str());
      std::exit(2);
    }
  return o;
}

void* Random(size_t elems, size_t elem_bytes, uint32_t seed) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(elems * elem_bytes, 256)));
  std::vector<__nv_bfloat16> host(elems);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& v : host) v = __float2bfloat16(u(rng));
  if (elem_bytes == 2) CHECK_CUDA(cudaMemcpy(p, host.data(), elems * 2, cudaMemcpyHostToDevice));
  else CHECK_CUDA(cudaMemset(p, 0, elems * elem_bytes));
  return p;
}

// One GEMM of the expert MLP: its kind, leading dimensions and per-expert (m, n, k) and operands.
struct Role {
  const char* name;
  GroupedGemmKind kind;
  int64_t lda, ldb, ldd;
  float beta;
};

struct Buffers {
  char *x, *h, *z, *y, *dout, *dz, *dh, *dx, *w1, *w2, *dw1, *dw2;
};

// The (m, n, k) and pointers of expert e with rows [off, off + m) for role r (grouped_gemm_sm90.h's layouts).
void Group(const Role& r, const Options& o, const Buffers& b, int64_t e, int64_t off, int64_t m, GemmProblem& p, const void*& a,
           const void*& bb, void*& d) {
  const int64_t H = o.H, F = o.F;
  auto at = [](char* base, int64_t elems, int64_t bytes) { return static_cast<void*>(base + elems * bytes); };
  const std::string n = r.name;
  if (n == "g1") { p = {int(m), int(2 * F), int(H)}; a = at(b.x, off * H, 2); bb = at(b.w1, e * H * 2 * F, 2); d = at(b.h, off * 2 * F, 2); }
  if (n == "g2") { p = {int(m), int(H), int(F)}; a = at(b.z, off * F, 2); bb = at(b.w2, e * F * H, 2); d = at(b.y, off * H, 2); }
  if (n == "dz") { p = {int(m), int(F), int(H)}; a = at(b.dout, off * H, 2); bb = at(b.w2, e * F * H, 2); d = at(b.dz, off * F, 2); }
  if (n == "dx") { p = {int(m), int(H), int(2 * F)}; a = at(b.dh, off * 2 * F, 2); bb = at(b.w1, e * H * 2 * F, 2); d = at(b.dx, off * H, 2); }
  if (n == "dw2") { p = {int(F), int(H), int(m)}; a = at(b.z, off * F, 2); bb = at(b.dout, off * H, 2); d = at(b.dw2, e * F * H, 4); }
  if (n == "dw1") { p = {int(H), int(2 * F), int(m)}; a = at(b.x, off * H, 2); bb = at(b.dh, off * 2 * F, 2); d = at(b.dw1, e * H * 2 * F, 4); }
  if (m == 0) p.m = 0;  // an empty group gets m = 0 (grouped_gemm_sm90.h)
}

double TimeRole(const Role& r, GroupedGemmTile tile, const Options& o, const Buffers& b, int64_t mu, cudaStream_t s, double* flops) {
  auto made = GroupedGemmSm90::Create(r.kind, static_cast<int32_t>(o.E), r.lda, r.ldb, r.ldd, 0, tile);
  if (!made.ok()) {
    std::fprintf(stderr, "%s %s: %s\n", r.name, rdep::kernels::internal::GroupedGemmTileName(tile), made.status().message().c_str());
    return -1;
  }
  GroupedGemmSm90& g = **made;
  std::vector<GemmProblem> probs(static_cast<size_t>(o.E));
  std::vector<const void*> pa(static_cast<size_t>(o.E)), pb(static_cast<size_t>(o.E));
  std::vector<void*> pd(static_cast<size_t>(o.E));
  *flops = 0;
  for (int64_t e = 0; e < o.E; ++e) {
    const auto i = static_cast<size_t>(e);
    Group(r, o, b, e, e * mu, mu, probs[i], pa[i], pb[i], pd[i]);
    *flops += 2.0 * probs[i].m * static_cast<double>(probs[i].n) * probs[i].k;
  }
  CHECK_CUDA(cudaMemcpy(g.problems(), probs.data(), probs.size() * sizeof(GemmProblem), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(g.ptr_a(), pa.data(), pa.size() * sizeof(void*), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(g.ptr_b(), pb.data(), pb.size() * sizeof(void*), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(g.ptr_d(), pd.data(), pd.size() * sizeof(void*), cudaMemcpyHostToDevice));
  for (int i = 0; i < o.warmup; ++i)
    if (!g.Run(r.beta, s).ok()) return -1;
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(o.iters));
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < o.iters; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[2 * static_cast<size_t>(i)], s));
    if (!g.Run(r.beta, s).ok()) return -1;
    CHECK_CUDA(cudaEventRecord(ev[2 * static_cast<size_t>(i) + 1], s));
  }
  CHECK_CUDA(cudaStreamSynchronize(s));
  std::vector<float> ms(static_cast<size_t>(o.iters));
  for (int i = 0; i < o.iters; ++i) CHECK_CUDA(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], ev[2 * static_cast<size_t>(i)], ev[2 * static_cast<size_t>(i) + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return 1e3 * ms[ms.size() / 2];  // p50, microseconds
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  std::string why;
  if (!rdep::kernels::internal::GroupedGemmSm90Available(0, &why)) {
    std::printf("grouped_gemm_tiles: skipped: %s\n", why.c_str());
    return 0;
  }
  const int64_t E = o.E, H = o.H, F = o.F, rows = *std::max_element(o.mus.begin(), o.mus.end()) * E;
  const auto R = static_cast<size_t>(rows), Hs = static_cast<size_t>(H), Fs = static_cast<size_t>(F), Es = static_cast<size_t>(E);
  Buffers b{};
  b.x = static_cast<char*>(Random(R * Hs, 2, 1));
  b.h = static_cast<char*>(Random(R * 2 * Fs, 2, 2));
  b.z = static_cast<char*>(Random(R * Fs, 2, 3));
  b.y = static_cast<char*>(Random(R * Hs, 2, 4));
  b.dout = static_cast<char*>(Random(R * Hs, 2, 5));
  b.dz = static_cast<char*>(Random(R * Fs, 2, 6));
  b.dh = static_cast<char*>(Random(R * 2 * Fs, 2, 7));
  b.dx = static_cast<char*>(Random(R * Hs, 2, 8));
  b.w1 = static_cast<char*>(Random(Es * Hs * 2 * Fs, 2, 9));
  b.w2 = static_cast<char*>(Random(Es * Fs * Hs, 2, 10));
  b.dw1 = static_cast<char*>(Random(Es * Hs * 2 * Fs, 4, 11));
  b.dw2 = static_cast<char*>(Random(Es * Fs * Hs, 4, 12));
  const Role roles[] = {{"g1", GroupedGemmKind::kNN, H, 2 * F, 2 * F, 0.f},   {"g2", GroupedGemmKind::kNN, F, H, H, 0.f},
                        {"dz", GroupedGemmKind::kNT, H, H, F, 0.f},           {"dx", GroupedGemmKind::kNT, 2 * F, 2 * F, H, 0.f},
                        {"dw2", GroupedGemmKind::kTN_F32, F, H, H, o.wgrad_beta},
                        {"dw1", GroupedGemmKind::kTN_F32, H, 2 * F, 2 * F, o.wgrad_beta}};
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreate(&s));
  std::printf("grouped_gemm_tiles: E=%lld H=%lld F=%lld, wgrad beta %g, p50 of %d iters; TFLOP/s = 2*m*n*k over real rows / p50\n",
              static_cast<long long>(E), static_cast<long long>(H), static_cast<long long>(F), o.wgrad_beta, o.iters);
  std::vector<GroupedGemmTile> tiles;
  for (GroupedGemmTile t : rdep::kernels::internal::kGroupedGemmTiles)
    if (Chosen(o.tiles, rdep::kernels::internal::GroupedGemmTileName(t))) tiles.push_back(t);
  std::printf("%-5s %6s", "role", "mu");
  for (GroupedGemmTile t : tiles) std::printf(" %18s", rdep::kernels::internal::GroupedGemmTileName(t));
  std::printf("   best\n");
  for (const Role& r : roles) {
    if (!Chosen(o.roles, r.name)) continue;
    for (int64_t mu : o.mus) {
      std::printf("%-5s %6lld", r.name, static_cast<long long>(mu));
      double best = 0;
      const char* best_name = "-";
      for (GroupedGemmTile t : tiles) {
        double flops = 0;
        const double us = TimeRole(r, t, o, b, mu, s, &flops);
        const double tf = us > 0 ? flops / (us * 1e-6) / 1e12 : 0;
        std::printf(" %9.1fus %6.0fT", us, tf);
        if (tf > best) best = tf, best_name = rdep::kernels::internal::GroupedGemmTileName(t);
      }
      std::printf("   %s\n", best_name);
    }
  }
  CHECK_CUDA(cudaStreamDestroy(s));
  return 0;
}
