// Lab: the CUTLASS grouped GEMMs with their TMA descriptors rewritten in the kernel at each change of group
// (GroupedGemmMaps::kInKernel, CUTLASS's ptr-array kernels) against every group's descriptors built before the
// launch (kPrebuilt, src/experts/grouped_gemm_sm90_group_maps.cuh), each GEMM of the expert MLP with its default
// tile, alternated in one process on the same operands and row counts. Each (GEMM, mu) first runs both once into
// poisoned outputs and requires the same bits (and, for the weight gradients with --wgrad-beta 1, the same bits
// again when both add into equal gradients); then it times them round by round. Prints p50 microseconds (the
// prebuilt side includes its descriptors' kernel), useful TFLOP/s (2*m*n*k over real rows) and prebuilt/kernel.
//   build-dev/bench/lab/group_maps_ab [--experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072
//                                      --iters 50 --warmup 10 --rounds 3 --roles g1,g2,dz,dx,dw2,dw1
//                                      --routing uniform|equal --wgrad-beta 0|1]
// Exit status 1 when the two disagree anywhere.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "experts/grouped_gemm_sm90.h"
#include "gemm_lab.h"

namespace {

using rdep::kernels::internal::GemmProblem;
using rdep::kernels::internal::GroupedGemmKind;
using rdep::kernels::internal::GroupedGemmMaps;
using rdep::kernels::internal::GroupedGemmSm90;
using rdep::kernels::internal::GroupedGemmTile;

struct Options {
  int64_t E = 16, H = 2048, F = 1408;
  std::vector<int64_t> mus = {128, 384, 768, 1536, 3072};
  int iters = 50, warmup = 10, rounds = 3;
  std::vector<std::string> roles;
  bool equal = false;
  float wgrad_beta = 0.f;
};

[[noreturn]] void Usage(const std::string& what) {
  std::fprintf(stderr, "group_maps_ab: %s\n", what.c_str());
  std::exit(2);
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) Usage("every flag takes a value");
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--experts") o.E = std::atoll(v.c_str());
    else if (k == "--hidden") o.H = std::atoll(v.c_str());
    else if (k == "--ffn") o.F = std::atoll(v.c_str());
    else if (k == "--iters") o.iters = std::atoi(v.c_str());
    else if (k == "--warmup") o.warmup = std::atoi(v.c_str());
    else if (k == "--rounds") o.rounds = std::atoi(v.c_str());
    else if (k == "--roles") o.roles = gemm_lab::SplitList(v);
    else if (k == "--routing") {
      if (v != "uniform" && v != "equal") Usage("--routing: uniform or equal");
      o.equal = v == "equal";
    } else if (k == "--wgrad-beta") {
      if (v != "0" && v != "1") Usage("--wgrad-beta: 0 or 1");
      o.wgrad_beta = v == "1" ? 1.f : 0.f;
    } else if (k == "--mu") {
      o.mus.clear();
      for (const std::string& p : gemm_lab::SplitList(v)) o.mus.push_back(std::atoll(p.c_str()));
    } else {
      Usage("unknown flag " + k);
    }
  }
  if (o.E < 1 || o.H < 8 || o.F < 8 || o.H % 8 || o.F % 8 || o.iters < 1 || o.rounds < 1 || o.mus.empty())
    Usage("need experts >= 1, hidden and ffn multiples of 8, iters and rounds >= 1, a --mu list");
  for (int64_t mu : o.mus)
    if (mu < 0) Usage("--mu: every value >= 0");
  for (const std::string& r : o.roles)
    if (!gemm_lab::Chosen({"g1", "g2", "dz", "dx", "dw2", "dw1"}, r)) Usage("--roles: g1, g2, dz, dx, dw2, dw1");
  return o;
}

// One GEMM of the expert MLP with cutlass_expert_compute.cu's default tile.
struct Role {
  const char* name;
  GroupedGemmKind kind;
  GroupedGemmTile tile;
  int64_t lda, ldb, ldd;
  size_t out_bytes;       // per element of D
  int64_t wgrad_rows = 0;  // the weight gradients: D's rows per expert (F for dW2, H for dW1)
};

// A grouped GEMM of `maps` with the role's tables filled for these counts, its outputs in `out` (null: the role's
// own buffer).
std::unique_ptr<GroupedGemmSm90> Make(const Role& r, GroupedGemmMaps maps, const Options& o, const gemm_lab::MlpBuffers& b,
                                      char* out, const std::vector<int64_t>& counts, double* flops) {
  auto made = GroupedGemmSm90::Create(r.kind, static_cast<int32_t>(o.E), r.lda, r.ldb, r.ldd, 0, r.tile, &maps);
  if (!made.ok()) Usage(std::string(r.name) + ": " + made.status().message());
  std::unique_ptr<GroupedGemmSm90> g = std::move(*made);
  const auto E = static_cast<size_t>(o.E);
  std::vector<GemmProblem> probs(E);
  std::vector<const void*> pa(E), pb(E);
  std::vector<void*> pd(E);
  *flops = 0;
  int64_t off = 0;
  for (size_t e = 0; e < E; ++e) {
    const gemm_lab::MlpProblem q = gemm_lab::MlpGroup(r.name, b, out, static_cast<int64_t>(e), off, counts[e]);
    probs[e] = {q.m, q.n, q.k};
    if (counts[e] == 0) probs[e].m = 0;  // an empty group gets m = 0 ("a group with m, n or k = 0", grouped_gemm_sm90.h)
    pa[e] = q.a, pb[e] = q.b, pd[e] = q.d;
    *flops += 2.0 * probs[e].m * static_cast<double>(probs[e].n) * probs[e].k;
    off += counts[e];
  }
  CK(cudaMemcpy(g->problems(), probs.data(), E * sizeof(GemmProblem), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g->ptr_a(), pa.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g->ptr_b(), pb.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g->ptr_d(), pd.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
  return g;
}

bool SameBytes(const void* a, const void* b, size_t n) {
  std::vector<unsigned char> ha(n), hb(n);
  CK(cudaMemcpy(ha.data(), a, n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb.data(), b, n, cudaMemcpyDeviceToHost));
  return std::memcmp(ha.data(), hb.data(), n) == 0;
}

void RunOrDie(GroupedGemmSm90& g, float beta, cudaStream_t s, const char* what) {
  const rdep::Status st = g.Run(beta, s);
  if (!st.ok()) Usage(std::string(what) + ": " + st.message());
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  std::string why;
  if (!rdep::kernels::internal::GroupedGemmSm90Available(0, &why)) {
    std::printf("group_maps_ab: skipped: %s\n", why.c_str());
    return 0;
  }
  const int64_t E = o.E, H = o.H, F = o.F;
  int64_t rows = 1;
  for (int64_t mu : o.mus) {
    int64_t t = 0;
    for (int64_t c : gemm_lab::MultinomialCounts(E, mu, o.equal)) t += c;
    rows = std::max(rows, t);
  }
  const gemm_lab::MlpBuffers b = gemm_lab::AllocMlp(E, H, F, rows);
  const auto R = static_cast<size_t>(rows), Hs = static_cast<size_t>(H), Fs = static_cast<size_t>(F), Es = static_cast<size_t>(E);
  const size_t out_bytes = std::max({R * 2 * Fs * 2, R * Hs * 2, Es * Hs * 2 * Fs * 4});  // h or dz, y or dx, dW1 or dW2
  char* out_b = nullptr;  // the prebuilt side's outputs
  CK(cudaMalloc(&out_b, out_bytes));
  const Role roles[] = {{"g1", GroupedGemmKind::kNN, GroupedGemmTile::kCoop128x256, H, 2 * F, 2 * F, 2},
                        {"g2", GroupedGemmKind::kNN, GroupedGemmTile::kCoop128x256, F, H, H, 2},
                        {"dz", GroupedGemmKind::kNT, GroupedGemmTile::kCoop128x128, H, H, F, 2},
                        {"dx", GroupedGemmKind::kNT, GroupedGemmTile::kCoop128x256, 2 * F, 2 * F, H, 2},
                        {"dw2", GroupedGemmKind::kTN_F32, GroupedGemmTile::kCoop128x256, F, H, H, 4, F},
                        {"dw1", GroupedGemmKind::kTN_F32, GroupedGemmTile::kPing128x128C2x1, H, 2 * F, 2 * F, 4, H}};
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  std::printf("group_maps_ab: E=%lld H=%lld F=%lld, routing %s, wgrad beta %g, p50 of %d iters, %d rounds; "
              "TFLOP/s = 2*m*n*k over real rows / p50\n",
              static_cast<long long>(E), static_cast<long long>(H), static_cast<long long>(F), o.equal ? "equal" : "uniform",
              o.wgrad_beta, o.iters, o.rounds);
  std::printf("%-4s %5s %5s %18s %18s %9s %s\n", "role", "mu", "round", "kernel maps", "prebuilt maps", "pre/kern", "bits");
  int failures = 0;
  for (const Role& r : roles) {
    if (!gemm_lab::Chosen(o.roles, r.name)) continue;
    const bool wgrad = r.kind == GroupedGemmKind::kTN_F32;
    const float beta = wgrad ? o.wgrad_beta : 0.f;
    for (int64_t mu : o.mus) {
      const std::vector<int64_t> counts = gemm_lab::MultinomialCounts(E, mu, o.equal);
      int64_t total = 0;
      for (int64_t c : counts) total += c;
      double flops = 0;
      auto ka = Make(r, GroupedGemmMaps::kInKernel, o, b, nullptr, counts, &flops);
      auto kb = Make(r, GroupedGemmMaps::kPrebuilt, o, b, out_b, counts, &flops);
      char* out_a = static_cast<char*>(gemm_lab::MlpGroup(r.name, b, nullptr, 0, 0, 0).d);
      const size_t n = wgrad ? Es * static_cast<size_t>(r.wgrad_rows * r.ldd) * r.out_bytes
                             : static_cast<size_t>(total) * static_cast<size_t>(r.ldd) * r.out_bytes;
      // The same bits: into poison (beta 0), then, for the weight gradients with beta 1, added to equal gradients.
      CK(cudaMemset(out_a, 0xff, n));
      CK(cudaMemset(out_b, 0xff, n));
      RunOrDie(*ka, 0.f, s, "kernel maps");
      RunOrDie(*kb, 0.f, s, "prebuilt maps");
      CK(cudaStreamSynchronize(s));
      bool same = SameBytes(out_a, out_b, n);
      if (beta != 0.f) {
        RunOrDie(*ka, beta, s, "kernel maps");
        RunOrDie(*kb, beta, s, "prebuilt maps");
        CK(cudaStreamSynchronize(s));
        same = same && SameBytes(out_a, out_b, n);
      }
      if (!same) ++failures;
      for (int round = 0; round < o.rounds; ++round) {
        const double ta = gemm_lab::P50Us(o.warmup, o.iters, s, [&] { RunOrDie(*ka, beta, s, "kernel maps"); });
        const double tb = gemm_lab::P50Us(o.warmup, o.iters, s, [&] { RunOrDie(*kb, beta, s, "prebuilt maps"); });
        auto tf = [&](double us) { return us > 0 ? flops / (us * 1e-6) / 1e12 : 0.0; };
        std::printf("%-4s %5lld %5d %9.1fus %6.0fT %9.1fus %6.0fT %9.3f %s\n", r.name, static_cast<long long>(mu), round, ta,
                    tf(ta), tb, tf(tb), ta > 0 ? tb / ta : 0.0, same ? "same" : "DIFFER");
        std::fflush(stdout);
      }
    }
  }
  CK(cudaStreamDestroy(s));
  if (failures) std::printf("group_maps_ab: %d (GEMM, mu) pairs differ\n", failures);
  return failures ? 1 : 0;
}
