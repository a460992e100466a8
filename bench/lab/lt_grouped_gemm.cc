// Lab: cuBLASLt's grouped matmul (CUBLASLT_BATCH_MODE_GROUPED, experimental in cuBLAS 13: each group's rows,
// columns and leading dimension and each operand's pointer read from DEVICE arrays, so no host sync) against
// rdep's CUTLASS grouped GEMMs (src/experts/grouped_gemm_sm90.h, each GEMM's default tile), one GEMM of the
// expert MLP at a time, alternated in one process, at the same per-expert row counts (a multinomial draw over
// the experts, as `rdep bench gemm` draws them). Also a dense cuBLASLt GEMM with every row in one problem (the
// ceiling for the role's total size). Prints p50 microseconds and useful TFLOP/s (2*m*n*k over real rows) and
// the largest difference between the two grouped outputs relative to the largest output.
//   build-dev/bench/lab/lt_grouped_gemm [--experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072
//                                        --iters 50 --warmup 10 --rounds 2 --roles g1,g2,dz,dx,dw2,dw1
//                                        --algos 8 --routing uniform|equal]
// --algos: how many of cuBLASLt's heuristic answers to time (the fastest is printed beside the first answer's).
// The grouped mode needs a cuBLASLt that has it (the library loaded at run time, not the headers built with):
// preload a newer libcublasLt.so.13 (for example the nvidia-cublas wheel's) if the toolkit's lacks it. When the
// library refuses the grouped layout (cuBLAS 13.1 does), the lab says why once per GEMM and times the rest.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// cuBLAS 13.2+'s grouped-layout enumerators, by value, so that the lab builds against an older header and
// asks the library loaded at run time (which refuses them if it predates them).
constexpr int kBatchModeGrouped = 2;              // cublasLtBatchMode_t CUBLASLT_BATCH_MODE_GROUPED
constexpr int kLayoutRowsArray = 9;               // CUBLASLT_GROUPED_MATRIX_LAYOUT_ROWS_ARRAY
constexpr int kLayoutColsArray = 10;              // CUBLASLT_GROUPED_MATRIX_LAYOUT_COLS_ARRAY
constexpr int kLayoutLdArray = 11;                // CUBLASLT_GROUPED_MATRIX_LAYOUT_LD_ARRAY
constexpr int kLayoutRowsColsWidth = 12;          // ..._ROWS_COLS_ARRAY_INTEGER_WIDTH
constexpr int kLayoutLdWidth = 13;                // ..._LD_ARRAY_INTEGER_WIDTH
constexpr int kPrefAvgReduction = 13;             // CUBLASLT_MATMUL_PREF_GROUPED_AVERAGE_REDUCTION_DIM
constexpr int kPrefAvgRows = 14;                  // CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_ROWS
constexpr int kPrefAvgCols = 15;                  // CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_COLS
constexpr int32_t kIntegerWidth64 = 1;            // CUBLASLT_INTEGER_WIDTH_64

struct Options {
  int64_t E = 16, H = 2048, F = 1408;
  std::vector<int64_t> mus = {128, 384, 768, 1536, 3072};
  int iters = 50, warmup = 10, rounds = 2, algos = 8;
  std::vector<std::string> roles;
  bool equal = false;
};

using gemm_lab::Chosen;
using gemm_lab::SplitList;

[[noreturn]] void Usage(const char* what) {
  std::fprintf(stderr, "lt_grouped_gemm: %s\n", what);
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
    else if (k == "--algos") o.algos = std::atoi(v.c_str());
    else if (k == "--roles") o.roles = SplitList(v);
    else if (k == "--routing") {
      if (v != "uniform" && v != "equal") Usage("--routing: uniform or equal");
      o.equal = v == "equal";
    } else if (k == "--mu") {
      o.mus.clear();
      for (const std::string& p : SplitList(v)) o.mus.push_back(std::atoll(p.c_str()));
    } else {
      std::fprintf(stderr, "lt_grouped_gemm: unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (o.E < 1 || o.H < 8 || o.F < 8 || o.H % 8 || o.F % 8) Usage("need experts >= 1, hidden and ffn multiples of 8");
  if (o.iters < 1 || o.rounds < 1 || o.algos < 1 || o.mus.empty()) Usage("need iters, rounds, algos >= 1 and a mu");
  for (int64_t mu : o.mus)
    if (mu < 1) Usage("--mu: every value >= 1");
  for (const std::string& r : o.roles)
    if (!Chosen({"g1", "g2", "dz", "dx", "dw2", "dw1"}, r)) Usage("--roles: g1, g2, dz, dx, dw2, dw1");
  return o;
}

// Per-expert row counts summing to mu * E: equal, or a uniform multinomial draw (seeded per mu).
std::vector<int64_t> Counts(const Options& o, int64_t mu) { return gemm_lab::MultinomialCounts(o.E, mu, o.equal); }

// The MLP's operands, and the role's output from CUTLASS and from cuBLASLt, for the comparison.
struct Buffers {
  gemm_lab::MlpBuffers mlp;
  char *d_ref, *d_lt;
};

// One GEMM of the expert MLP in rdep's row-major terms (grouped_gemm_sm90.h): kind, leading dimensions, and
// which of the three sizes grows with the expert's rows.
struct Role {
  const char* name;
  GroupedGemmKind kind;
  GroupedGemmTile tile;  // the CUTLASS compute's default for this GEMM (cutlass_expert_compute.cu)
  int64_t lda, ldb, ldd;
  int out_bytes;
};

// The (m, n, k) and pointers of expert e with rows [off, off + m) for role r; d is the role's output buffer.
void Group(const Role& r, const Buffers& b, char* out, int64_t e, int64_t off, int64_t m, GemmProblem& p, const void*& a,
           const void*& bb, void*& d) {
  const gemm_lab::MlpProblem q = gemm_lab::MlpGroup(r.name, b.mlp, out, e, off, m);
  p = {q.m, q.n, q.k};
  a = q.a, bb = q.b, d = q.d;
}

template <class Fn>
double TimeIt(const Options& o, cudaStream_t s, Fn&& run) {
  return gemm_lab::P50Us(o.warmup, o.iters, s, run);
}

#define CHECK_LT(x)                                                                    \
  do {                                                                                 \
    cublasStatus_t st_ = (x);                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                \
      std::snprintf(err, sizeof(err), "%s: cublas status %d", #x, static_cast<int>(st_)); \
      return false;                                                                    \
    }                                                                                  \
  } while (0)

// A cuBLASLt matmul (grouped over the experts, or one dense problem) of a role in column-major terms: the
// row-major D[m][n] is the column-major n x m matrix, so cuBLASLt's A is rdep's B and its B is rdep's A.
struct LtCall {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
  ~LtCall() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};
char err[512];

// Column-major shapes of cuBLASLt's A, B and D for a role (rows, cols of each as stored; cols of B and D, or
// the reduction, are what vary per group). transa/transb as cuBLASLt applies them.
struct ColShapes {
  cublasOperation_t ta, tb;
  cudaDataType_t dtype;
};
ColShapes ShapesOf(const Role& r) {
  switch (r.kind) {
    case GroupedGemmKind::kNN: return {CUBLAS_OP_N, CUBLAS_OP_N, CUDA_R_16BF};
    case GroupedGemmKind::kNT: return {CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF};
    default: return {CUBLAS_OP_N, CUBLAS_OP_T, r.out_bytes == 4 ? CUDA_R_32F : CUDA_R_16BF};
  }
}

// Device arrays for a grouped call: per group the three matrices' rows, cols and ld (int64), and the pointers.
struct GroupedArrays {
  int64_t* dims = nullptr;  // 9 arrays of E: a_rows a_cols a_ld b_rows b_cols b_ld d_rows d_cols d_ld
  void** ptrs = nullptr;    // 3 arrays of E: A (rdep's B), B (rdep's A), D
  int64_t E = 0;
  int64_t* arr(int i) const { return dims + i * E; }
};

bool MakeLayout(cublasLtMatrixLayout_t* l, cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld, const GroupedArrays* g,
                int which) {
  CHECK_LT(cublasLtMatrixLayoutCreate(l, t, rows, cols, ld));
  if (!g) return true;
  const int32_t mode = kBatchModeGrouped, count = static_cast<int32_t>(g->E), w = kIntegerWidth64;
  CHECK_LT(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof(mode)));
  CHECK_LT(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  const void* rows_a = g->arr(3 * which), *cols_a = g->arr(3 * which + 1), *ld_a = g->arr(3 * which + 2);
  CHECK_LT(cublasLtMatrixLayoutSetAttribute(*l, static_cast<cublasLtMatrixLayoutAttribute_t>(kLayoutRowsArray), &rows_a, sizeof(void*)));
  CHECK_LT(cublasLtMatrixLayoutSetAttribute(*l, static_cast<cublasLtMatrixLayoutAttribute_t>(kLayoutColsArray), &cols_a, sizeof(void*)));
  CHECK_LT(cublasLtMatrixLayoutSetAttribute(*l, static_cast<cublasLtMatrixLayoutAttribute_t>(kLayoutLdArray), &ld_a, sizeof(void*)));
  CHECK_LT(cublasLtMatrixLayoutSetAttribute(*l, static_cast<cublasLtMatrixLayoutAttribute_t>(kLayoutRowsColsWidth), &w, sizeof(w)));
  CHECK_LT(cublasLtMatrixLayoutSetAttribute(*l, static_cast<cublasLtMatrixLayoutAttribute_t>(kLayoutLdWidth), &w, sizeof(w)));
  return true;
}

// Builds the call for role r: grouped (g given; sizes are the averages, for the heuristic) or dense (g null;
// m rows in one problem). mm, nn, kk: rdep's row-major (m, n, k).
bool BuildLt(cublasLtHandle_t lt, const Role& r, int64_t mm, int64_t nn, int64_t kk, const GroupedArrays* g, int algos,
             size_t workspace, LtCall* c) {
  const ColShapes cs = ShapesOf(r);
  CHECK_LT(cublasLtMatmulDescCreate(&c->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CHECK_LT(cublasLtMatmulDescSetAttribute(c->op, CUBLASLT_MATMUL_DESC_TRANSA, &cs.ta, sizeof(cs.ta)));
  CHECK_LT(cublasLtMatmulDescSetAttribute(c->op, CUBLASLT_MATMUL_DESC_TRANSB, &cs.tb, sizeof(cs.tb)));
  // cuBLASLt's A: rdep's B (row-major [k][n] = column-major n x k; NT: [n][k] = column-major k x n).
  const bool nt = r.kind == GroupedGemmKind::kNT;
  const bool tn = !nt && r.kind != GroupedGemmKind::kNN;
  if (!MakeLayout(&c->la, CUDA_R_16BF, nt ? kk : nn, nt ? nn : kk, r.ldb, g, 0)) return false;
  // cuBLASLt's B: rdep's A (row-major [m][k] = column-major k x m; TN: [k][m] = column-major m x k).
  if (!MakeLayout(&c->lb, CUDA_R_16BF, tn ? mm : kk, tn ? kk : mm, r.lda, g, 1)) return false;
  if (!MakeLayout(&c->ld, cs.dtype, nn, mm, r.ldd, g, 2)) return false;
  cublasLtMatmulPreference_t pref = nullptr;
  CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  if (g) {
    const uint32_t rows = static_cast<uint32_t>(nn), cols = static_cast<uint32_t>(mm), red = static_cast<uint32_t>(kk);
    cublasLtMatmulPreferenceSetAttribute(pref, static_cast<cublasLtMatmulPreferenceAttributes_t>(kPrefAvgRows), &rows, sizeof(rows));
    cublasLtMatmulPreferenceSetAttribute(pref, static_cast<cublasLtMatmulPreferenceAttributes_t>(kPrefAvgCols), &cols, sizeof(cols));
    cublasLtMatmulPreferenceSetAttribute(pref, static_cast<cublasLtMatmulPreferenceAttributes_t>(kPrefAvgReduction), &red, sizeof(red));
  }
  c->algos.resize(static_cast<size_t>(algos));
  int got = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, c->op, c->la, c->lb, c->ld, c->ld, pref, algos, c->algos.data(), &got);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || got == 0) {
    std::snprintf(err, sizeof(err), "no algorithm (status %d, %d answers)", static_cast<int>(st), got);
    return false;
  }
  c->algos.resize(static_cast<size_t>(got));
  return true;
}

// Fills the grouped arrays for role r at these counts; returns the role's useful FLOPs.
double FillGrouped(const Role& r, const Options& o, const Buffers& b, char* out, const std::vector<int64_t>& counts,
                   GroupedArrays& g, GroupedGemmSm90* cut) {
  const auto E = static_cast<size_t>(o.E);
  std::vector<int64_t> dims(9 * E);
  std::vector<void*> ptrs(3 * E);
  std::vector<GemmProblem> probs(E);
  std::vector<const void*> pa(E), pb(E);
  std::vector<void*> pd(E);
  const bool nt = r.kind == GroupedGemmKind::kNT, tn = !nt && r.kind != GroupedGemmKind::kNN;
  double flops = 0;
  int64_t off = 0;
  for (size_t e = 0; e < E; ++e) {
    const int64_t m = counts[e];
    Group(r, b, out, static_cast<int64_t>(e), off, m, probs[e], pa[e], pb[e], pd[e]);
    off += m;
    const int64_t mm = probs[e].m, nn = probs[e].n, kk = probs[e].k;
    flops += 2.0 * static_cast<double>(mm) * static_cast<double>(nn) * static_cast<double>(kk);
    if (m == 0) probs[e].m = 0;
    const int64_t v[9] = {nt ? kk : nn, nt ? nn : kk, r.ldb, tn ? mm : kk, tn ? kk : mm, r.lda, nn, mm, r.ldd};
    for (int i = 0; i < 9; ++i) dims[static_cast<size_t>(i) * E + e] = v[i];
    ptrs[e] = const_cast<void*>(pb[e]);
    ptrs[E + e] = const_cast<void*>(pa[e]);
    ptrs[2 * E + e] = pd[e];
  }
  CK(cudaMemcpy(g.dims, dims.data(), dims.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g.ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
  if (cut) {
    for (size_t e = 0; e < E; ++e) pd[e] = static_cast<char*>(pd[e]) - out + b.d_ref;  // CUTLASS writes d_ref
    CK(cudaMemcpy(cut->problems(), probs.data(), E * sizeof(GemmProblem), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(cut->ptr_a(), pa.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(cut->ptr_b(), pb.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(cut->ptr_d(), pd.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
  }
  return flops;
}

// max |lt - ref| / max |ref| over n outputs (bf16 or fp32).
double RelDiff(const char* ref, const char* lt, size_t n, int bytes) {
  std::vector<float> a(n), c(n);
  if (bytes == 4) {
    CK(cudaMemcpy(a.data(), ref, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(c.data(), lt, n * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<__nv_bfloat16> ha(n), hc(n);
    CK(cudaMemcpy(ha.data(), ref, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hc.data(), lt, n * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) a[i] = __bfloat162float(ha[i]), c[i] = __bfloat162float(hc[i]);
  }
  double mx = 0, d = 0;
  for (size_t i = 0; i < n; ++i) {
    mx = std::max(mx, static_cast<double>(std::fabs(a[i])));
    d = std::max(d, static_cast<double>(std::fabs(a[i] - c[i])));
    if (std::isnan(c[i]) || std::isnan(a[i])) return NAN;
  }
  return mx > 0 ? d / mx : d;
}

// cuBLASLt's configuration of an algorithm (ids of cublasLtMatmulTile_t, stages, cublasLtClusterShape_t, ...),
// as "algo A tile T stages S cluster C splitk K swizzle W" (decode the ids with cublasLt.h's enums).
std::string AlgoConfig(const cublasLtMatmulAlgo_t& a) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &written);
    return static_cast<unsigned>(v);
  };
  char buf[160];
  std::snprintf(buf, sizeof(buf), "algo %u tile %u stages %u cluster %u splitk %u swizzle %u", get(CUBLASLT_ALGO_CONFIG_ID),
                get(CUBLASLT_ALGO_CONFIG_TILE_ID), get(CUBLASLT_ALGO_CONFIG_STAGES_ID), get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM), get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  std::string why;
  if (!rdep::kernels::internal::GroupedGemmSm90Available(0, &why)) {
    std::printf("lt_grouped_gemm: skipped: %s\n", why.c_str());
    return 0;
  }
  const int64_t E = o.E, H = o.H, F = o.F, rows = *std::max_element(o.mus.begin(), o.mus.end()) * E;
  const auto R = static_cast<size_t>(rows), Hs = static_cast<size_t>(H), Fs = static_cast<size_t>(F), Es = static_cast<size_t>(E);
  Buffers b{};
  b.mlp = gemm_lab::AllocMlp(E, H, F, rows);
  const size_t out_bytes = std::max(R * 2 * Fs * 2, Es * Hs * 2 * Fs * 4);
  CK(cudaMalloc(&b.d_ref, out_bytes));
  CK(cudaMalloc(&b.d_lt, out_bytes));
  // Default tiles as in cutlass_expert_compute.cu; the weight gradients fp32 and overwritten (beta 0).
  const Role roles[] = {{"g1", GroupedGemmKind::kNN, GroupedGemmTile::kCoop128x256, H, 2 * F, 2 * F, 2},
                        {"g2", GroupedGemmKind::kNN, GroupedGemmTile::kCoop128x256, F, H, H, 2},
                        {"dz", GroupedGemmKind::kNT, GroupedGemmTile::kCoop128x128, H, H, F, 2},
                        {"dx", GroupedGemmKind::kNT, GroupedGemmTile::kCoop128x256, 2 * F, 2 * F, H, 2},
                        {"dw2", GroupedGemmKind::kTN_F32, GroupedGemmTile::kCoop128x256, F, H, H, 4},
                        {"dw1", GroupedGemmKind::kTN_F32, GroupedGemmTile::kPing128x128C2x1, H, 2 * F, 2 * F, 4}};
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) Usage("cublasLtCreate failed");
  const size_t ws_bytes = 32u << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  GroupedArrays g;
  g.E = E;
  CK(cudaMalloc(&g.dims, 9 * Es * sizeof(int64_t)));
  CK(cudaMalloc(reinterpret_cast<void**>(&g.ptrs), 3 * Es * sizeof(void*)));
  std::printf("lt_grouped_gemm: cuBLASLt %zu (headers %d), E=%lld H=%lld F=%lld, routing %s, p50 of %d iters, %d rounds;"
              " TFLOP/s = 2*m*n*k over real rows / p50\n",
              cublasLtGetVersion(), CUBLAS_VERSION, static_cast<long long>(E), static_cast<long long>(H), static_cast<long long>(F),
              o.equal ? "equal" : "uniform", o.iters, o.rounds);
  std::printf("%-4s %5s %5s %22s %22s %22s %22s %9s\n", "role", "mu", "round", "cutlass(default tile)", "lt grouped (1st algo)",
              "lt grouped (best algo)", "lt dense (all rows)", "rel.diff");
  const float one = 1.f, zero = 0.f;
  for (const Role& r : roles) {
    if (!Chosen(o.roles, r.name)) continue;
    for (int64_t mu : o.mus) {
      const std::vector<int64_t> counts = Counts(o, mu);
      int64_t total = 0;
      for (int64_t c : counts) total += c;
      auto made = GroupedGemmSm90::Create(r.kind, static_cast<int32_t>(E), r.lda, r.ldb, r.ldd, 0, r.tile);
      if (!made.ok()) {
        std::printf("%-4s %5lld cutlass: %s\n", r.name, static_cast<long long>(mu), made.status().message().c_str());
        continue;
      }
      GroupedGemmSm90& cut = **made;
      const double flops = FillGrouped(r, o, b, b.d_lt, counts, g, &cut);
      GemmProblem avg{};
      const void *pa0, *pb0;
      void* pd0;
      Group(r, b, b.d_lt, 0, 0, mu, avg, pa0, pb0, pd0);
      LtCall grouped, dense;
      const bool have_grouped = BuildLt(lt, r, avg.m, avg.n, avg.k, &g, o.algos, ws_bytes, &grouped);
      if (!have_grouped && mu == o.mus.front()) std::printf("%-4s lt grouped: %s\n", r.name, err);
      // Dense: every row in one problem (the weight gradients: one expert's shape with all rows reduced).
      GemmProblem all = avg;
      if (r.kind == GroupedGemmKind::kTN_F32) all.k = static_cast<int>(total);
      else all.m = static_cast<int>(total);
      const bool have_dense = BuildLt(lt, r, all.m, all.n, all.k, nullptr, 1, ws_bytes, &dense);
      auto run_lt = [&](size_t algo) {
        cublasLtMatmul(lt, grouped.op, &one, g.ptrs + Es, grouped.la, g.ptrs, grouped.lb, &zero, g.ptrs + 2 * Es, grouped.ld,
                       g.ptrs + 2 * Es, grouped.ld, &grouped.algos[algo].algo, ws, ws_bytes, s);
      };
      for (int round = 0; round < o.rounds; ++round) {
        const double t_cut = TimeIt(o, s, [&] { (void)cut.Run(0.f, s); });
        double t_first = -1, t_best = -1;
        size_t best = 0;
        if (have_grouped) {
          for (size_t a = 0; a < grouped.algos.size(); ++a) {
            const double t = TimeIt(o, s, [&] { run_lt(a); });
            if (a == 0) t_first = t;
            if (t_best < 0 || t < t_best) t_best = t, best = a;
          }
        }
        double t_dense = -1;
        if (have_dense)
          t_dense = TimeIt(o, s, [&] {
            cublasLtMatmul(lt, dense.op, &one, pb0, dense.la, pa0, dense.lb, &zero, b.d_lt, dense.ld, b.d_lt, dense.ld,
                           &dense.algos[0].algo, ws, ws_bytes, s);
          });
        auto tf = [&](double us) { return us > 0 ? flops / (us * 1e-6) / 1e12 : 0.0; };
        double rel = NAN;
        if (have_grouped && round == 0) {  // both grouped outputs of this mu, compared
          CK(cudaMemsetAsync(b.d_ref, 0xff, out_bytes, s));
          CK(cudaMemsetAsync(b.d_lt, 0xff, out_bytes, s));
          (void)cut.Run(0.f, s);
          run_lt(best);
          CK(cudaStreamSynchronize(s));
          const size_t n = r.out_bytes == 4 ? Es * static_cast<size_t>(avg.m) * static_cast<size_t>(avg.n)
                                            : static_cast<size_t>(total) * static_cast<size_t>(avg.n);
          rel = RelDiff(b.d_ref, b.d_lt, n, r.out_bytes);
        }
        std::printf("%-4s %5lld %5d %10.1fus %6.0fT %10.1fus %6.0fT %10.1fus %6.0fT %10.1fus %6.0fT %9.2e  algo %zu of %zu; dense: %s\n",
                    r.name, static_cast<long long>(mu), round, t_cut, tf(t_cut), t_first, tf(t_first), t_best, tf(t_best),
                    t_dense, tf(t_dense), rel, best, grouped.algos.size(),
                    have_dense ? AlgoConfig(dense.algos[0].algo).c_str() : "-");
        std::fflush(stdout);
      }
    }
  }
  cublasLtDestroy(lt);
  CK(cudaStreamDestroy(s));
  return 0;
}
