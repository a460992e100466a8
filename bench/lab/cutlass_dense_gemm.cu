// Lab: is the gap between rdep's grouped expert GEMMs and cuBLAS's dense GEMM on the same rows the grouping
// (the ptr-array kernel's per-group descriptors, the tile tails) or the CUTLASS main loop itself? Times one
// CUTLASS 3 dense (non-grouped) sm_90a GEMM configuration, chosen at compile time (LAB_TILE_M/N, LAB_CLUSTER_M/N,
// LAB_PINGPONG; src/experts/CMakeLists.txt builds one executable per configuration), on the expert MLP's
// forward GEMMs with every row in one problem, alternated in one process with cuBLASLt's dense GEMM on the same
// operands; prints p50 microseconds, TFLOP/s (2*m*n*k / p50) and the largest difference of the two outputs
// relative to the largest output.
//   build-dev/bench/lab/cutlass_dense_gemm_coop_128x256_c1x1 [--rows 24576 --hidden 2048 --ffn 1408 --iters 30
//                                                            --warmup 5 --rounds 2 --raster heuristic|m|n --swizzle 1]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "gemm_lab.h"

#ifndef LAB_TILE_M
#define LAB_TILE_M 128
#define LAB_TILE_N 256
#define LAB_CLUSTER_M 1
#define LAB_CLUSTER_N 1
#define LAB_PINGPONG 0
#endif

namespace {

#define CHECK_LT(x)                                                                          \
  do {                                                                                       \
    cublasStatus_t s_ = (x);                                                                 \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                       \
      std::fprintf(stderr, "%s:%d: %s: cublas status %d\n", __FILE__, __LINE__, #x, int(s_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

using TileShape = cute::Shape<cute::Int<LAB_TILE_M>, cute::Int<LAB_TILE_N>, cute::_64>;
using ClusterShape = cute::Shape<cute::Int<LAB_CLUSTER_M>, cute::Int<LAB_CLUSTER_N>, cute::_1>;
using MainloopSchedule = cute::conditional_t<LAB_PINGPONG != 0, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                             cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
using EpilogueSchedule = cute::conditional_t<LAB_PINGPONG != 0, cutlass::epilogue::TmaWarpSpecialized,
                                             cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
    float, float, void, RowMajor, 8, Bf16, RowMajor, 8, EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<Bf16, float, void, float>>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, 8, Bf16, RowMajor, 8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

struct Options {
  int64_t rows = 24576, H = 2048, F = 1408;
  int iters = 30, warmup = 5, rounds = 2, swizzle = 1;
  std::string raster = "heuristic";
};

[[noreturn]] void Usage(const char* what) {
  std::fprintf(stderr, "cutlass_dense_gemm: %s\n", what);
  std::exit(2);
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) Usage("every flag takes a value");
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rows") o.rows = std::atoll(v.c_str());
    else if (k == "--hidden") o.H = std::atoll(v.c_str());
    else if (k == "--ffn") o.F = std::atoll(v.c_str());
    else if (k == "--iters") o.iters = std::atoi(v.c_str());
    else if (k == "--warmup") o.warmup = std::atoi(v.c_str());
    else if (k == "--rounds") o.rounds = std::atoi(v.c_str());
    else if (k == "--swizzle") o.swizzle = std::atoi(v.c_str());
    else if (k == "--raster") o.raster = v;
    else Usage(("unknown flag " + k).c_str());
  }
  if (o.rows < 1 || o.H % 8 || o.F % 8 || o.iters < 1 || o.rounds < 1) Usage("need rows >= 1, hidden/ffn multiples of 8, iters/rounds >= 1");
  if (o.raster != "heuristic" && o.raster != "m" && o.raster != "n") Usage("--raster: heuristic, m or n");
  return o;
}

Bf16* Random(size_t n, uint32_t seed) { return static_cast<Bf16*>(gemm_lab::Random(n, 2, seed)); }

template <class Fn>
double P50Us(const Options& o, cudaStream_t s, Fn&& run) {
  return gemm_lab::P50Us(o.warmup, o.iters, s, run);
}

// D[m][n] = A[m][k] . B[k][n], all row-major bf16, through CUTLASS (this configuration) and cuBLASLt.
struct Problem {
  int m, n, k;
  Bf16 *a, *b, *d_cut, *d_lt;
};

double RelDiff(const Problem& p) {
  const size_t n = static_cast<size_t>(p.m) * static_cast<size_t>(p.n);
  std::vector<__nv_bfloat16> x(n), y(n);
  CK(cudaMemcpy(x.data(), p.d_cut, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(y.data(), p.d_lt, n * 2, cudaMemcpyDeviceToHost));
  double mx = 0, d = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = __bfloat162float(x[i]), b = __bfloat162float(y[i]);
    if (std::isnan(a) || std::isnan(b)) return NAN;
    mx = std::max(mx, std::fabs(b));
    d = std::max(d, std::fabs(a - b));
  }
  return mx > 0 ? d / mx : d;
}

void RunProblem(const char* name, const Problem& p, const Options& o, cublasLtHandle_t lt, void* ws, size_t ws_bytes, cudaStream_t s) {
  // CUTLASS
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {p.m, p.n, p.k, 1},
                                {p.a, cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(p.m, p.k, 1)), p.b,
                                 cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(p.n, p.k, 1))},
                                {{1.0f, 0.0f}, nullptr, {}, p.d_cut, cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(p.m, p.n, 1))},
                                cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(0)};
  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = o.raster == "m" ? Raster::AlongM : o.raster == "n" ? Raster::AlongN : Raster::Heuristic;
  args.scheduler.max_swizzle_size = o.swizzle;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) Usage("CUTLASS cannot implement the problem");
  void* cws = nullptr;
  CK(cudaMalloc(&cws, std::max<size_t>(Gemm::get_workspace_size(args), 16)));
  if (gemm.initialize(args, cws, s) != cutlass::Status::kSuccess) Usage("CUTLASS initialize failed");
  // cuBLASLt, column-major: D^T (n x m) = B^T (n x k) . A^T (k x m).
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, ld;
  CHECK_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CHECK_LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, p.n, p.k, p.n));
  CHECK_LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, p.k, p.m, p.k));
  CHECK_LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, p.n, p.m, p.n));
  cublasLtMatmulPreference_t pref;
  CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
  CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t h{};
  int got = 0;
  CHECK_LT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &h, &got));
  if (got == 0) Usage("cuBLASLt has no algorithm");
  const float one = 1.f, zero = 0.f;
  auto run_cut = [&] {
    if (gemm.run(s) != cutlass::Status::kSuccess) Usage("CUTLASS run failed");
  };
  auto run_lt = [&] { CHECK_LT(cublasLtMatmul(lt, op, &one, p.b, la, p.a, lb, &zero, p.d_lt, ld, p.d_lt, ld, &h.algo, ws, ws_bytes, s)); };
  const double flops = 2.0 * p.m * static_cast<double>(p.n) * p.k;
  CK(cudaMemsetAsync(p.d_cut, 0xff, static_cast<size_t>(p.m) * p.n * 2, s));
  run_cut();
  run_lt();
  CK(cudaStreamSynchronize(s));
  const double rel = RelDiff(p);
  for (int r = 0; r < o.rounds; ++r) {
    const double tc = P50Us(o, s, run_cut), tl = P50Us(o, s, run_lt);
    std::printf("%-3s m=%d n=%d k=%d round %d: cutlass %8.1f us %5.0f T   cublasLt %8.1f us %5.0f T   cutlass/cublasLt %.3f   rel.diff %.2e\n",
                name, p.m, p.n, p.k, r, tc, flops / tc / 1e6, tl, flops / tl / 1e6, tc / tl, rel);
    std::fflush(stdout);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(op);
  cudaFree(cws);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  int dev = 0, major = 0;
  if (cudaGetDeviceCount(&dev) != cudaSuccess || dev == 0) {
    std::printf("cutlass_dense_gemm: skipped: no CUDA device\n");
    return 0;
  }
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9) {
    std::printf("cutlass_dense_gemm: skipped: needs sm_90 (compute capability %d.x)\n", major);
    return 0;
  }
  const size_t R = static_cast<size_t>(o.rows), H = static_cast<size_t>(o.H), F = static_cast<size_t>(o.F);
  Bf16* x = Random(R * H, 1);
  Bf16* w1 = Random(H * 2 * F, 2);
  Bf16* z = Random(R * F, 3);
  Bf16* w2 = Random(F * H, 4);
  Bf16 *d_cut = nullptr, *d_lt = nullptr;
  CK(cudaMalloc(&d_cut, R * 2 * F * 2));
  CK(cudaMalloc(&d_lt, R * 2 * F * 2));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  const size_t ws_bytes = 32u << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  std::printf("cutlass_dense_gemm: %s %dx%d cluster %dx%d, raster %s, swizzle %d; p50 of %d iters\n", LAB_PINGPONG ? "pingpong" : "cooperative",
              LAB_TILE_M, LAB_TILE_N, LAB_CLUSTER_M, LAB_CLUSTER_N, o.raster.c_str(), o.swizzle, o.iters);
  RunProblem("g1", {static_cast<int>(o.rows), static_cast<int>(2 * o.F), static_cast<int>(o.H), x, w1, d_cut, d_lt}, o, lt, ws, ws_bytes, s);
  RunProblem("g2", {static_cast<int>(o.rows), static_cast<int>(o.H), static_cast<int>(o.F), z, w2, d_cut, d_lt}, o, lt, ws, ws_bytes, s);
  cublasLtDestroy(lt);
  return 0;
}
