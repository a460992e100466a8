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
#include "gemm_lab.h"

namespace {

using rdep::kernels::internal::GemmProblem;
using rdep::kernels::internal::GroupedGemmKind;
using rdep::kernels::internal::GroupedGemmSm90;
using rdep::kernels::internal::GroupedGemmTile;

struct Options {
  int64_t E = 16, H = 2048, F = 1408;
  std::vector<int64_t> mus = {128, 384, 768, 1536, 3072};
  int iters = 50, warmup = 10;
  std::vector<std::string> roles, tiles;  // empty: all
  float wgrad_beta = 1.f;
};

using gemm_lab::Chosen;
using gemm_lab::SplitList;

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

// One GEMM of the expert MLP: its kind, leading dimensions and per-expert (m, n, k) and operands.
struct Role {
  const char* name;
  GroupedGemmKind kind;
  int64_t lda, ldb, ldd;
  float beta;
};

double TimeRole(const Role& r, GroupedGemmTile tile, const Options& o, const gemm_lab::MlpBuffers& b, int64_t mu, cudaStream_t s,
                double* flops) {
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
    const gemm_lab::MlpProblem q = gemm_lab::MlpGroup(r.name, b, nullptr, e, e * mu, mu);
    probs[i] = {q.m, q.n, q.k};
    pa[i] = q.a, pb[i] = q.b, pd[i] = q.d;
    if (mu == 0) probs[i].m = 0;  // an empty group gets m = 0 (grouped_gemm_sm90.h)
    *flops += 2.0 * probs[i].m * static_cast<double>(probs[i].n) * probs[i].k;
  }
  CK(cudaMemcpy(g.problems(), probs.data(), probs.size() * sizeof(GemmProblem), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g.ptr_a(), pa.data(), pa.size() * sizeof(void*), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g.ptr_b(), pb.data(), pb.size() * sizeof(void*), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g.ptr_d(), pd.data(), pd.size() * sizeof(void*), cudaMemcpyHostToDevice));
  bool ok = true;
  const double us = gemm_lab::P50Us(o.warmup, o.iters, s, [&] { ok = g.Run(r.beta, s).ok() && ok; });
  return ok ? us : -1;  // p50, microseconds
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
  const gemm_lab::MlpBuffers b = gemm_lab::AllocMlp(E, H, F, rows);
  const Role roles[] = {{"g1", GroupedGemmKind::kNN, H, 2 * F, 2 * F, 0.f},   {"g2", GroupedGemmKind::kNN, F, H, H, 0.f},
                        {"dz", GroupedGemmKind::kNT, H, H, F, 0.f},           {"dx", GroupedGemmKind::kNT, 2 * F, 2 * F, H, 0.f},
                        {"dw2", GroupedGemmKind::kTN_F32, F, H, H, o.wgrad_beta},
                        {"dw1", GroupedGemmKind::kTN_F32, H, 2 * F, 2 * F, o.wgrad_beta}};
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
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
  CK(cudaStreamDestroy(s));
  return 0;
}
