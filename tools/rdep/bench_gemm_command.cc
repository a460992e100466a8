// `rdep bench gemm`: expert compute alone (the owner's SwiGLU expert MLP over expert-grouped rows), the
// useful TFLOP/s and padding ratio rho over a sweep of mu (mean rows per local expert), beside the
// dense-GEMM ceiling measured in the same run.
//   rdep bench gemm --experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072 --json gemm.json
// Normalization: forward FLOPs = 2*M*H*2F + 2*M*F*H = 6*M*H*F, forward+backward = 3x that, M = real rows
// (no padding). Times are CUDA events around each call on one stream (p50/p99 over --iters after
// --warmup). Per-expert counts are a multinomial draw of M = mu*E rows (rdep::Rng) over the experts,
// uniform or Zipf(A) (p_e ~ 1/(e+1)^A).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench_dense_gemm.h"
#include "build_commit.h"
#include "cli.h"

#if defined(RDEP_HAVE_CUDA)
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "rdep/core/json.h"
#include "rdep/core/random.h"
#include "rdep/core/stats.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/experts/expert_mlp.h"
#endif

namespace {

using rdep::cli::Args;
using rdep::cli::Flags;

constexpr const char* kHelp =
    "usage: rdep bench gemm [--experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072]\n"
    "         [--routing uniform|zipf:A] [--path auto,lt,grouped,cutlass] [--streams 8] [--workspace-mib 8]\n"
    "         [--no-backward] [--grads fp32|bf16] [--gate-up split|interleaved8]\n"
    "         [--warmup 20 --iters 200 --dense 8192 --seed 1 --json FILE]\n"
    "Expert compute alone (SwiGLU expert MLP over expert-grouped rows), useful TFLOP/s counting\n"
    "real rows only: forward 6*M*H*F FLOPs, forward+backward 3x; M = mu*experts rows drawn by a\n"
    "multinomial over the experts. The dense ceiling is one n^3 bf16 cuBLASLt GEMM; rows% is the forward's two\n"
    "GEMMs as dense cuBLASLt GEMMs on the same rows (one expert's weights) over the path's forward. CUDA builds only.\n"
    "--path cutlass:SPEC picks the CUTLASS kernels' tiles: all (one run per tile), TILE (every GEMM) or\n"
    "G1/G2/DZ/DX/DW2/DW1 (a tile per GEMM, empty = its default), e.g. cutlass:////coop_128x256/.\n"
    "--grads: the expert weight gradients backward writes (overwritten): fp32 [default], or bf16 as\n"
    "rdep.torch's bf16 parameters and torch._grouped_mm's autograd have them.\n"
    "--gate-up: where W1's columns hold the gate and up projections: split (gate | up) [default] or\n"
    "interleaved8 (blocks of 8); with it, path cutlass-fused[:SPEC] takes the SwiGLU in GEMM1's epilogue\n"
    "(CutlassTiles::swiglu_epilogue; GEMM1 on coop_128x128, coop_128x256 or ping_128x128) instead of a pass.\n"
    "Device memory is estimated before allocating and must fit the GPU; --max-memory-gib G bounds host\n"
    "memory [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]; -h, --help: this page.\n";

int Fail(const rdep::Status& s) {
  std::cerr << "rdep bench gemm: " << s << "\n";
  return s.code() == rdep::StatusCode::kInvalidArgument ? 2 : 1;
}

#if defined(RDEP_HAVE_CUDA)

using rdep::cli::ParseList;

// A device allocation freed on scope exit.
struct DeviceMem {
  void* p = nullptr;
  DeviceMem() = default;
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  ~DeviceMem() {
    if (p) cudaFree(p);
  }
  rdep::Status Alloc(size_t bytes) { RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(bytes, 256))); return rdep::Status::Ok(); }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// Uniform [-scale, scale) bf16 values, generated on the host from a seeded stream and uploaded.
rdep::Status FillBf16(void* dst, size_t n, double scale, uint64_t seed) {
  rdep::Rng rng(seed);
  std::vector<uint16_t> host(std::min<size_t>(n, size_t{1} << 24));
  for (auto& b : host) b = rdep::FloatToBf16Bits(static_cast<float>(scale * (2.0 * rng.uniform() - 1.0)));
  for (size_t done = 0; done < n; done += host.size()) {
    const size_t k = std::min(host.size(), n - done);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(static_cast<uint16_t*>(dst) + done, host.data(), k * 2, cudaMemcpyHostToDevice));
  }
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));  // a pageable copy's DMA, before a non-blocking stream reads
  return rdep::Status::Ok();
}

// Per-expert counts: a multinomial draw of `rows` over E experts.
std::vector<int64_t> DrawCounts(int64_t E, int64_t rows, double zipf_alpha, uint64_t seed) {
  std::vector<double> cdf(static_cast<size_t>(E));
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) {
    acc += zipf_alpha > 0 ? std::pow(static_cast<double>(e + 1), -zipf_alpha) : 1.0;
    cdf[static_cast<size_t>(e)] = acc;
  }
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  rdep::Rng rng(seed, 17);
  for (int64_t r = 0; r < rows; ++r) {
    const double u = rng.uniform() * acc;
    const auto it = std::upper_bound(cdf.begin(), cdf.end(), u);
    ++counts[static_cast<size_t>(std::min<int64_t>(it - cdf.begin(), E - 1))];
  }
  return counts;
}

// Times `fn` (which enqueues work on `stream`) per iteration with CUDA events; microseconds.
template <typename Fn>
rdep::StatusOr<std::vector<double>> TimeIters(int warmup, int iters, cudaStream_t stream, Fn fn) {
  for (int i = 0; i < warmup; ++i) RDEP_RETURN_IF_ERROR(fn());
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters));
  for (auto& e : ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  rdep::Status st;
  for (int i = 0; i < iters && st.ok(); ++i) {
    st = rdep::cuda::CudaStatus(cudaEventRecord(ev[2 * static_cast<size_t>(i)], stream), "cudaEventRecord", __FILE__, __LINE__);
    if (st.ok()) st = fn();
    if (st.ok()) st = rdep::cuda::CudaStatus(cudaEventRecord(ev[2 * static_cast<size_t>(i) + 1], stream), "cudaEventRecord", __FILE__, __LINE__);
  }
  std::vector<double> us;
  if (st.ok()) st = rdep::cuda::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __FILE__, __LINE__);
  for (int i = 0; i < iters && st.ok(); ++i) {
    float ms = 0;
    st = rdep::cuda::CudaStatus(cudaEventElapsedTime(&ms, ev[2 * static_cast<size_t>(i)], ev[2 * static_cast<size_t>(i) + 1]),
                                "cudaEventElapsedTime", __FILE__, __LINE__);
    us.push_back(1000.0 * ms);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  if (!st.ok()) return st;
  return us;
}

constexpr size_t kDenseWorkspace = size_t{32} << 20;  // cuBLASLt's workspace for the dense GEMMs

// The ceiling: one dense bf16 GEMM (fp32 accumulate, bf16 out) of n x n x n through cuBLASLt.
struct DensePeak {
  int64_t n = 0;
  std::vector<double> us;
  double tflops = 0;
};
rdep::StatusOr<DensePeak> MeasureDensePeak(int64_t n, int warmup, int iters, cudaStream_t stream) {
  DensePeak out;
  out.n = n;
  DeviceMem a, b, c, ws;
  const size_t elems = static_cast<size_t>(n * n);
  RDEP_RETURN_IF_ERROR(a.Alloc(elems * 2));
  RDEP_RETURN_IF_ERROR(b.Alloc(elems * 2));
  RDEP_RETURN_IF_ERROR(c.Alloc(elems * 2));
  RDEP_RETURN_IF_ERROR(ws.Alloc(kDenseWorkspace));
  RDEP_RETURN_IF_ERROR(FillBf16(a.p, elems, 1.0, 101));
  RDEP_RETURN_IF_ERROR(FillBf16(b.p, elems, 1.0, 102));
  rdep::cli::DenseGemm gemm;
  RDEP_RETURN_IF_ERROR(gemm.Init(n, n, n, kDenseWorkspace));
  RDEP_ASSIGN_OR_RETURN(out.us, TimeIters(warmup, iters, stream, [&] { return gemm.Run(a.p, b.p, c.p, ws.p, stream); }));
  out.tflops = gemm.flops() / (rdep::Summarize(out.us).p50 * 1e-6) / 1e12;
  return out;
}

void WriteSummary(rdep::JsonWriter& j, const std::string& k, const std::vector<double>& us) {
  const rdep::Summary s = rdep::Summarize(us);
  j.key(k).begin_object();
  j.field("p50_us", s.p50).field("p99_us", s.p99).field("min_us", s.min).field("max_us", s.max).field("mean_us", s.mean);
  j.field("stddev_us", s.stddev).field("count", s.count).field("times_us", us);
  j.end_object();
}

// ---- setup -----------------------------------------------------------------------------------------

// One implementation under test: an ExpertMlp GEMM path (host counts), or the CUTLASS expert compute
// (MakeCutlassExpertCompute: counts read on the device, no host round trip).
struct BenchPath {
  std::string name;
  bool cutlass = false;
  rdep::kernels::GemmPath gemm = rdep::kernels::GemmPath::kAuto;
  rdep::kernels::CutlassTiles tiles;  // cutlass: each role's tile ("" = default)
};

// What the flags ask for, checked.
struct GemmBenchOptions {
  int64_t E = 0, H = 0, F = 0;
  std::vector<int64_t> mus;
  std::string routing;  // "uniform" or "zipf:A"
  double alpha = 0;     // A; 0 = uniform
  std::string paths_text;
  std::vector<BenchPath> paths;
  int streams = 0;
  int64_t workspace_mib = 0;
  bool no_backward = false;
  bool bf16_grads = false;  // --grads bf16
  rdep::mlp::GateUp gate_up = rdep::mlp::GateUp::kSplit;  // --gate-up
  int warmup = 0, iters = 0;
  int64_t dense_n = 0;
  uint64_t seed = 0;
  std::string json;
  rdep::cli::Limits limits;
};

// --routing: uniform (0) or zipf:A with A > 0 (A).
rdep::StatusOr<double> ParseZipfAlpha(const std::string& routing) {
  double alpha = 0;
  if (routing.rfind("zipf:", 0) == 0) {
    std::stringstream is(routing.substr(5));
    if (!(is >> alpha) || !is.eof() || alpha <= 0) return rdep::InvalidArgument("--routing zipf:A needs A > 0");
  } else if (routing != "uniform") {
    return rdep::InvalidArgument("--routing must be uniform or zipf:A");
  }
  return alpha;
}

// cutlass:SPEC of --path: SPEC = all (one path per tile, every GEMM), TILE (every GEMM) or six tiles
// G1/G2/DZ/DX/DW2/DW1 (one per GEMM, CutlassTiles' order; an empty field keeps that GEMM's default).
rdep::StatusOr<std::vector<BenchPath>> ParseCutlassPath(const std::string& spec) {
  const std::vector<std::string> known = rdep::kernels::CutlassTileNames();
  std::vector<BenchPath> paths;
  if (spec == "all") {
    for (const std::string& t : known) paths.push_back({"cutlass:" + t, true, {}, {t, t, t, t, t, t}});
    if (paths.empty()) return rdep::InvalidArgument("--path cutlass:all: this build has no CUTLASS tiles");
    return paths;
  }
  RDEP_ASSIGN_OR_RETURN(const rdep::kernels::CutlassTiles tiles, rdep::kernels::ParseCutlassTileSpec(spec, "--path cutlass:SPEC"));
  for (const std::string* t : {&tiles.gemm1, &tiles.gemm2, &tiles.dgrad_z, &tiles.dgrad_x, &tiles.wgrad_w2, &tiles.wgrad_w1})
    // names are checked again by MakeCutlassExpertCompute; here for an early exit 2
    if (!t->empty() && !known.empty() && std::find(known.begin(), known.end(), *t) == known.end())
      return rdep::InvalidArgument("--path cutlass:" + spec + ": unknown tile '" + *t + "'");
  paths.push_back({"cutlass:" + spec, true, {}, tiles});
  return paths;
}

// --path: a comma list of auto, lt, grouped (ExpertMlp's GEMM paths), cutlass and cutlass:SPEC.
rdep::StatusOr<std::vector<BenchPath>> ParseGemmPaths(const std::string& paths_text) {
  using rdep::kernels::GemmPath;
  std::vector<BenchPath> paths;
  std::stringstream ss(paths_text);
  std::string p;
  while (std::getline(ss, p, ',')) {
    if (p == "auto") paths.push_back({"auto", false, GemmPath::kAuto, {}});
    else if (p == "lt") paths.push_back({rdep::kernels::GemmPathName(GemmPath::kLtPerExpert), false, GemmPath::kLtPerExpert, {}});
    else if (p == "grouped") paths.push_back({rdep::kernels::GemmPathName(GemmPath::kGrouped), false, GemmPath::kGrouped, {}});
    else if (p == "cutlass") paths.push_back({"cutlass", true, {}, {}});
    else if (p == "cutlass-fused" || p.rfind("cutlass-fused:", 0) == 0) {
      std::vector<BenchPath> fused{{"cutlass", true, {}, {}}};
      if (p != "cutlass-fused") {
        RDEP_ASSIGN_OR_RETURN(fused, ParseCutlassPath(p.substr(14)));
      }
      for (BenchPath& b : fused) {
        b.name = "fused" + b.name.substr(7);  // fused, fused:SPEC
        b.tiles.swiglu_epilogue = true;
      }
      paths.insert(paths.end(), fused.begin(), fused.end());
    } else if (p.rfind("cutlass:", 0) == 0) {
      RDEP_ASSIGN_OR_RETURN(std::vector<BenchPath> more, ParseCutlassPath(p.substr(8)));
      paths.insert(paths.end(), more.begin(), more.end());
    } else return rdep::InvalidArgument("--path: '" + p + "' is not auto, lt, grouped, cutlass, cutlass:TILES, cutlass-fused or cutlass-fused:TILES");
  }
  if (paths.empty()) return rdep::InvalidArgument("--path: empty list");
  return paths;
}

// Reads and checks the flags in the command's fixed order (no device needed).
rdep::Status ParseGemmBenchOptions(const Args& args, GemmBenchOptions& o) {
  Flags f(args);
  o.E = f.get_int("experts", 16);
  o.H = f.get_int("hidden", 2048);
  o.F = f.get_int("ffn", 1408);
  auto mus = ParseList<int64_t>("mu", f.get_string("mu", "128,384,768,1536,3072"));
  o.routing = f.get_string("routing", "uniform");
  o.paths_text = f.get_string("path", "auto");
  const rdep::kernels::ExpertMlpConfig defaults;
  o.streams = static_cast<int>(f.get_int("streams", defaults.num_streams));
  o.workspace_mib = f.get_int("workspace-mib", static_cast<int64_t>(defaults.lt_workspace_bytes >> 20));
  o.no_backward = f.get_bool("no-backward");
  const std::string grads = f.get_string("grads", "fp32");
  const std::string gate_up = f.get_string("gate-up", "split");
  o.warmup = static_cast<int>(f.get_int("warmup", 20));
  o.iters = static_cast<int>(f.get_int("iters", 200));
  o.dense_n = f.get_int("dense", 8192);
  o.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  o.json = f.get_string("json", "");
  auto limits = rdep::cli::ReadLimits(f);
  RDEP_RETURN_IF_ERROR(f.Finish());
  if (!limits.ok()) return limits.status();
  if (!mus.ok()) return mus.status();
  if (o.E < 1 || o.H < 1 || o.F < 1 || o.dense_n < 1)
    return rdep::InvalidArgument("--experts, --hidden, --ffn and --dense must be >= 1");
  if (o.iters < 1 || o.warmup < 0) return rdep::InvalidArgument("--iters must be >= 1 and --warmup >= 0");
  if (grads != "fp32" && grads != "bf16") return rdep::InvalidArgument("--grads must be fp32 or bf16, got '" + grads + "'");
  o.bf16_grads = grads == "bf16";
  if (gate_up != "split" && gate_up != "interleaved8")
    return rdep::InvalidArgument("--gate-up must be split or interleaved8, got '" + gate_up + "'");
  o.gate_up = gate_up == "split" ? rdep::mlp::GateUp::kSplit : rdep::mlp::GateUp::kInterleaved8;
  for (int64_t mu : *mus)
    if (mu < 0) return rdep::InvalidArgument("--mu: values must be >= 0");
  RDEP_ASSIGN_OR_RETURN(o.alpha, ParseZipfAlpha(o.routing));
  RDEP_ASSIGN_OR_RETURN(o.paths, ParseGemmPaths(o.paths_text));
  for (const BenchPath& p : o.paths)
    if (p.tiles.swiglu_epilogue && o.gate_up != rdep::mlp::GateUp::kInterleaved8)
      return rdep::InvalidArgument("--path " + p.name + " (the SwiGLU in GEMM1's epilogue) needs --gate-up interleaved8");
  o.mus = *mus;
  o.limits = *limits;
  return rdep::Status::Ok();
}

int64_t MaxMu(const std::vector<int64_t>& mus) {
  int64_t top_mu = 0;
  for (int64_t mu : mus) top_mu = std::max(top_mu, mu);
  return top_mu;
}

// Estimate before allocating (in double: no size_t overflow), and open the receipt first.
rdep::Status CheckGemmBenchFootprint(const GemmBenchOptions& o, const cudaDeviceProp& prop) {
  const int64_t top_mu = MaxMu(o.mus);
  const auto Ed = static_cast<double>(o.E), Hd = static_cast<double>(o.H), Fd = static_cast<double>(o.F),
             N = static_cast<double>(o.dense_n), Md = static_cast<double>(top_mu) * Ed;
  rdep::Footprint fp;
  fp.device.push_back({"expert weights (bf16) and gradients (fp32), E*3*H*D_ff", {{"experts", Ed}, {"hidden", Hd}, {"ffn", Fd}},
                       18 * Ed * Hd * Fd});
  fp.device.push_back({"rows (mu*E rows of H and 2*D_ff bf16 values)",
                       {{"mu", static_cast<double>(top_mu)}, {"experts", Ed}, {"hidden", Hd}, {"ffn", Fd}}, Md * (10 * Hd + 4 * Fd)});
  fp.device.push_back({"dense ceiling GEMM (three n x n bf16 matrices)", {{"dense", N}}, 6 * N * N});
  fp.device.push_back({"cuBLASLt workspace of the dense GEMMs", {}, static_cast<double>(kDenseWorkspace)});
  fp.host.push_back({"per-expert counts and per-iteration times", {{"experts", Ed}, {"iters", static_cast<double>(o.iters)}},
                     64 * Ed + 64.0 * static_cast<double>(o.iters + o.warmup) * static_cast<double>(o.mus.size() * o.paths.size())});
  rdep::cli::Limits limits = o.limits;
  limits.device_bytes = static_cast<double>(prop.totalGlobalMem);
  RDEP_RETURN_IF_ERROR(rdep::cli::CheckFootprint(fp, limits));
  return rdep::cli::CheckOutputPath("json", o.json);
}

// The GPU the benchmark runs on and what it had free before the benchmark allocated.
struct GemmBenchEnv {
  cudaDeviceProp prop{};
  int runtime = 0, driver = 0;
  size_t free0 = 0, total = 0;
};

// The buffers every mu shares, sized for the largest: weights, weight gradients, activations.
struct GemmBuffers {
  size_t w1n = 0, w2n = 0;  // elements of W1 [E][H][2F] and W2 [E][F][H]
  DeviceMem w1, w2, dw1, dw2, x, h, y, dout, dx, counts;
  DeviceMem dense_ws;  // the dense GEMMs on the same rows (MeasureDenseRows)
};

rdep::Status AllocateGemmBuffers(const GemmBenchOptions& o, GemmBuffers& b) {
  const int64_t E = o.E, H = o.H, F = o.F;
  const int64_t max_rows = MaxMu(o.mus) * E;
  b.w1n = static_cast<size_t>(E * H * 2 * F);
  b.w2n = static_cast<size_t>(E * F * H);
  const size_t w1n = b.w1n, w2n = b.w2n;
  const size_t rows = static_cast<size_t>(max_rows), Hs = static_cast<size_t>(H), Fs = static_cast<size_t>(F);
  for (auto [mem, bytes] : {std::pair{&b.w1, w1n * 2}, {&b.w2, w2n * 2}, {&b.dw1, w1n * 4}, {&b.dw2, w2n * 4},
                            {&b.x, rows * Hs * 2}, {&b.h, rows * 2 * Fs * 2}, {&b.y, rows * Hs * 2}, {&b.dout, rows * Hs * 2},
                            {&b.dx, rows * Hs * 2}, {&b.counts, static_cast<size_t>(E) * 8}, {&b.dense_ws, kDenseWorkspace}}) {
    RDEP_RETURN_IF_ERROR(mem->Alloc(bytes));
  }
  for (auto [mem, n, scale, s] : {std::tuple{&b.w1, w1n, 1.0 / std::sqrt(static_cast<double>(H)), o.seed + 1},
                                  {&b.w2, w2n, 1.0 / std::sqrt(static_cast<double>(F)), o.seed + 2},
                                  {&b.x, rows * Hs, 1.0, o.seed + 3}, {&b.dout, rows * Hs, 1.0, o.seed + 4}}) {
    RDEP_RETURN_IF_ERROR(FillBf16(mem->p, n, scale, s));
  }
  return rdep::Status::Ok();
}

// ---- run -------------------------------------------------------------------------------------------

// One (mu, path) point of the sweep: raw per-iteration times and what is derived from them.
struct Row {
  int64_t mu = 0, M = 0;
  std::string path;
  std::vector<int64_t> counts;
  double rho = 0;
  std::vector<double> fwd_us, fb_us;
  double fwd_p50 = 0, fb_p50 = 0;  // fb_p50 = 0 with --no-backward
  double tflops_fwd = 0, tflops_fb = 0;
  size_t workspace = 0, live = 0, device_used = 0;
  std::vector<double> dense_rows_us;  // this mu's MeasureDenseRows (the same for every path); empty for M = 0
};

// The forward's two GEMMs as dense cuBLASLt GEMMs on the same M rows, every row through expert 0's weights
// (h = x.W1: M x 2F x H, then y = z.W2: M x H x F, z read from h's first M*F values), back to back in one timed
// call: the same FLOPs as the grouped forward's GEMMs, without its grouping, tile tails or SwiGLU.
rdep::StatusOr<std::vector<double>> MeasureDenseRows(const GemmBenchOptions& o, int64_t M, const GemmBuffers& b,
                                                     cudaStream_t stream) {
  rdep::cli::DenseGemm g1, g2;
  RDEP_RETURN_IF_ERROR(g1.Init(M, 2 * o.F, o.H, kDenseWorkspace));
  RDEP_RETURN_IF_ERROR(g2.Init(M, o.H, o.F, kDenseWorkspace));
  return TimeIters(o.warmup, o.iters, stream, [&]() -> rdep::Status {
    RDEP_RETURN_IF_ERROR(g1.Run(b.x.p, b.w1.p, b.h.p, b.dense_ws.p, stream));
    return g2.Run(b.h.p, b.w2.p, b.y.p, b.dense_ws.p, stream);
  });
}

// Times one (mu, path): the forward, then (unless --no-backward) forward+backward, each with
// TimeIters on `stream`; then the memory it holds and the useful TFLOP/s. Updates env.total.
// The forward and forward+backward of one path as callables, and what it holds; `counts_dev` holds
// the counts on the device (the CUTLASS path reads only those).
struct PathUnderTest {
  std::unique_ptr<rdep::kernels::ExpertMlp> mlp;
  std::unique_ptr<rdep::kernels::ExpertCompute> compute;
  std::function<rdep::Status()> fwd, fb;
  size_t workspace = 0;
};

rdep::StatusOr<PathUnderTest> MakePath(const GemmBenchOptions& o, int64_t M, const std::vector<int64_t>& counts,
                                       const int64_t* counts_dev, const BenchPath& path, const GemmBuffers& b, cudaStream_t stream) {
  using B = __nv_bfloat16;
  const bool bf16 = o.bf16_grads;
  PathUnderTest t;
  if (path.cutlass) {
    RDEP_ASSIGN_OR_RETURN(t.compute,
                          rdep::kernels::MakeCutlassExpertCompute({o.E, o.H, o.F, std::max<int64_t>(M, 1), o.gate_up}, 0, path.tiles));
    rdep::kernels::ExpertCompute* c = t.compute.get();
    const rdep::kernels::ExpertRows rows{counts_dev, M, nullptr};
    const rdep::kernels::ExpertWeightsView w{b.w1.as<B>(), b.w2.as<B>()};
    t.fwd = [=, &b]() { return c->Forward(rows, b.x.as<B>(), w, b.h.as<B>(), b.y.as<B>(), stream); };
    t.fb = [=, &b]() -> rdep::Status {
      RDEP_RETURN_IF_ERROR(c->Forward(rows, b.x.as<B>(), w, b.h.as<B>(), b.y.as<B>(), stream));
      const rdep::kernels::ExpertGradsView g =
          bf16 ? rdep::kernels::ExpertGradsView{nullptr, nullptr, b.dw1.as<B>(), b.dw2.as<B>()}
               : rdep::kernels::ExpertGradsView{b.dw1.as<float>(), b.dw2.as<float>()};
      return c->Backward(rows, b.x.as<B>(), b.h.as<B>(), b.dout.as<B>(), w, b.dx.as<B>(), g, false, stream);
    };
    t.workspace = c->workspace_bytes();
    return t;
  }
  rdep::kernels::ExpertMlpConfig cfg;
  cfg.path = path.gemm;
  cfg.num_streams = o.streams;
  cfg.lt_workspace_bytes = static_cast<size_t>(o.workspace_mib) << 20;
  RDEP_ASSIGN_OR_RETURN(t.mlp, rdep::kernels::ExpertMlp::Create({o.E, o.H, o.F, M, o.gate_up}, 0, cfg));
  rdep::kernels::ExpertMlp* mlp = t.mlp.get();
  const int64_t* hc = counts.data();
  t.fwd = [=, &b]() { return mlp->Forward(b.x.as<B>(), hc, b.w1.as<B>(), b.w2.as<B>(), b.h.as<B>(), b.y.as<B>(), stream); };
  t.fb = [=, &b]() -> rdep::Status {
    RDEP_RETURN_IF_ERROR(mlp->Forward(b.x.as<B>(), hc, b.w1.as<B>(), b.w2.as<B>(), b.h.as<B>(), b.y.as<B>(), stream));
    if (bf16)  // the gradient buffers are sized for fp32: bf16 ones fit
      return mlp->Backward(b.x.as<B>(), b.h.as<B>(), b.dout.as<B>(), hc, b.w1.as<B>(), b.w2.as<B>(), b.dx.as<B>(), b.dw1.as<B>(),
                           b.dw2.as<B>(), stream);
    return mlp->Backward(b.x.as<B>(), b.h.as<B>(), b.dout.as<B>(), hc, b.w1.as<B>(), b.w2.as<B>(), b.dx.as<B>(),
                         b.dw1.as<float>(), b.dw2.as<float>(), false, stream);
  };
  t.workspace = mlp->workspace_bytes();
  return t;
}

rdep::StatusOr<Row> MeasureGemmRow(const GemmBenchOptions& o, int64_t mu, const std::vector<int64_t>& counts,
                                   const BenchPath& path, const GemmBuffers& b, cudaStream_t stream, GemmBenchEnv& env) {
  const int64_t M = mu * o.E;
  Row r;
  r.mu = mu;
  r.M = M;
  r.path = path.name;
  r.counts = counts;
  r.rho = rdep::PaddingRatio(counts);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.counts.p, counts.data(), counts.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));  // a pageable copy's DMA, before a non-blocking stream reads
  RDEP_ASSIGN_OR_RETURN(PathUnderTest t, MakePath(o, M, counts, b.counts.as<int64_t>(), path, b, stream));
  RDEP_ASSIGN_OR_RETURN(r.fwd_us, TimeIters(o.warmup, o.iters, stream, t.fwd));
  if (!o.no_backward) {
    RDEP_ASSIGN_OR_RETURN(r.fb_us, TimeIters(o.warmup, o.iters, stream, t.fb));
  }
  size_t free1 = 0;
  cudaMemGetInfo(&free1, &env.total);
  r.device_used = env.free0 - free1;
  r.workspace = t.workspace;
  // What this mu holds live: weights + grads (fp32 or bf16) + x, h, y, dout, dx of M rows + workspace.
  const size_t Hs = static_cast<size_t>(o.H), Fs = static_cast<size_t>(o.F);
  r.live = (b.w1n + b.w2n) * (o.bf16_grads ? 4 : 6) + static_cast<size_t>(M) * (Hs * 2 * 4 + 2 * Fs * 2) + r.workspace;
  const double flops = 6.0 * static_cast<double>(M) * static_cast<double>(o.H) * static_cast<double>(o.F);
  r.fwd_p50 = rdep::Summarize(r.fwd_us).p50;
  r.tflops_fwd = M > 0 ? flops / (r.fwd_p50 * 1e-6) / 1e12 : 0;
  r.fb_p50 = r.fb_us.empty() ? 0 : rdep::Summarize(r.fb_us).p50;
  r.tflops_fb = M > 0 && r.fb_p50 > 0 ? 3 * flops / (r.fb_p50 * 1e-6) / 1e12 : 0;
  return r;
}

// ---- report ----------------------------------------------------------------------------------------

void PrintGemmHeader(const GemmBenchOptions& o, const GemmBenchEnv& env, const DensePeak& dense, double weight_bytes,
                     bool l2_exceeded) {
  const cudaDeviceProp& prop = env.prop;
  std::cout << "rdep bench gemm: " << prop.name << ", CUDA runtime " << env.runtime << ", E_loc=" << o.E << " H=" << o.H
            << " F=" << o.F << ", routing " << o.routing << ", weight gradients " << (o.bf16_grads ? "bf16" : "fp32") << ", "
            << o.warmup << " warmup + " << o.iters << " iters\n";
  std::cout << "dense ceiling: " << o.dense_n << "^3 bf16 cuBLASLt GEMM p50 " << std::fixed << std::setprecision(1)
            << rdep::Summarize(dense.us).p50 << " us = " << dense.tflops << " TFLOP/s\n";
  std::cout << "rows%: the dense GEMMs on the same rows (cuBLASLt, h = x.W1 then y = z.W2, every row through one "
               "expert's weights, no SwiGLU) as a share of the path's forward time\n";
  std::cout << "L2: " << (l2_exceeded ? "no input rotation: the weights alone (" : "WARNING: working set may fit L2 (")
            << weight_bytes / 1e6 << " MB) exceed 2x L2 (" << prop.l2CacheSize / 1e6 << " MB)\n";
  std::cout << std::setw(6) << "mu" << std::setw(16) << "path" << std::setw(8) << "M" << std::setw(7) << "rho"
            << std::setw(11) << "fwd p50" << std::setw(11) << "fwd p99" << std::setw(10) << "TFLOP/s" << std::setw(8)
            << "%dense" << std::setw(7) << "rows%" << std::setw(12) << "f+b p50" << std::setw(10) << "TFLOP/s" << std::setw(11) << "peak MiB"
            << "\n";
}

// One table row, printed as soon as it is measured (std::cout keeps the header's std::fixed).
void PrintGemmRow(const Row& r, const DensePeak& dense) {
  std::cout << std::setw(6) << r.mu << std::setw(16) << r.path << std::setw(8) << r.M << std::setw(7)
            << std::setprecision(2) << r.rho << std::setprecision(1) << std::setw(11) << r.fwd_p50 << std::setw(11)
            << rdep::Summarize(r.fwd_us).p99 << std::setw(10) << r.tflops_fwd << std::setw(8)
            << 100.0 * r.tflops_fwd / dense.tflops << std::setw(7)
            << (r.dense_rows_us.empty() ? 0.0 : 100.0 * rdep::Summarize(r.dense_rows_us).p50 / r.fwd_p50) << std::setw(12) << r.fb_p50 << std::setw(10) << r.tflops_fb
            << std::setw(11) << static_cast<double>(r.live) / (1 << 20) << "\n";
}

// The receipt's head: the workload, the hardware and software, the normalization, the dense ceiling.
void WriteGemmHead(rdep::JsonWriter& j, const GemmBenchOptions& o, const GemmBenchEnv& env, const DensePeak& dense,
                   bool l2_exceeded) {
  const cudaDeviceProp& prop = env.prop;
  j.key("benchmark").value("rdep bench gemm");
  j.key("workload").begin_object();
  j.field("experts_local", o.E).field("hidden", o.H).field("ffn", o.F).field("routing", o.routing);
  j.field("seed", static_cast<int64_t>(o.seed)).field("warmup", o.warmup).field("iters", o.iters).field("streams", o.streams);
  j.field("paths", o.paths_text).field("weight_gradients", o.bf16_grads ? "bf16" : "fp32");
  j.field("gate_up", rdep::mlp::GateUpName(o.gate_up));
  j.end_object();
  j.key("hardware").begin_object();
  j.field("gpu", std::string(prop.name)).field("sm_count", prop.multiProcessorCount);
  j.field("l2_bytes", static_cast<int64_t>(prop.l2CacheSize)).field("memory_bytes", static_cast<int64_t>(env.total));
  j.end_object();
  j.key("software").begin_object();
  j.field("cuda_runtime", env.runtime).field("cuda_driver", env.driver);
  j.field("cublaslt", static_cast<int64_t>(cublasLtGetVersion()));
  j.end_object();
  j.field("git_commit", rdep::cli::kBuildCommit);
  j.field("normalization",
          "useful TFLOP/s = 6*M*H*F (forward) or 18*M*H*F (forward+backward) over the p50 time; M = real rows "
          "(sum of per-expert counts), no padding; rho = E_loc*max_e m_e / M");
  j.field("l2_rotation", l2_exceeded ? "none: the weights alone exceed 2x L2" : "none (working set may fit L2)");
  j.key("dense_peak").begin_object();
  j.field("n", dense.n).field("tflops", dense.tflops);
  WriteSummary(j, "time", dense.us);
  j.end_object();
}

rdep::Status WriteGemmReceipt(const GemmBenchOptions& o, const GemmBenchEnv& env, const DensePeak& dense, bool l2_exceeded,
                              const std::vector<Row>& results) {
  rdep::JsonWriter j;
  j.begin_object();
  WriteGemmHead(j, o, env, dense, l2_exceeded);
  j.key("results").begin_array();
  for (const Row& r : results) {
    j.begin_object();
    j.field("mu", r.mu).field("path", r.path).field("rows", r.M).field("rho", r.rho);
    j.key("counts").begin_array();
    for (int64_t c : r.counts) j.value(c);
    j.end_array();
    WriteSummary(j, "forward", r.fwd_us);
    if (!r.fb_us.empty()) WriteSummary(j, "forward_backward", r.fb_us);
    j.field("tflops_forward", r.tflops_fwd).field("tflops_forward_backward", r.tflops_fb);
    j.field("fraction_of_dense_forward", r.tflops_fwd / dense.tflops);
    if (!r.dense_rows_us.empty()) {
      WriteSummary(j, "dense_same_rows", r.dense_rows_us);
      j.field("fraction_dense_same_rows_of_forward", rdep::Summarize(r.dense_rows_us).p50 / r.fwd_p50);
    }
    j.field("workspace_bytes", static_cast<int64_t>(r.workspace)).field("live_bytes", static_cast<int64_t>(r.live));
    j.field("device_used_bytes", static_cast<int64_t>(r.device_used));
    j.end_object();
  }
  j.end_array();
  j.end_object();
  std::ofstream out(o.json);
  if (!out) return rdep::InvalidArgument("cannot open '" + o.json + "'");
  out << j.str() << "\n";
  std::cout << "wrote " << o.json << "\n";
  return rdep::Status::Ok();
}

// ---- the command -----------------------------------------------------------------------------------

// Setup: the options checked, the device queried, the estimate within the limits.
rdep::Status SetupGemmBench(const Args& args, GemmBenchOptions& o, GemmBenchEnv& env) {
  RDEP_RETURN_IF_ERROR(ParseGemmBenchOptions(args, o));
  if (rdep::cuda::DeviceCount() == 0) return rdep::Unavailable("no CUDA device");
  if (cudaGetDeviceProperties(&env.prop, 0) != cudaSuccess) return rdep::Unavailable("cannot query device 0");
  RDEP_RETURN_IF_ERROR(CheckGemmBenchFootprint(o, env.prop));
  cudaRuntimeGetVersion(&env.runtime);
  cudaDriverGetVersion(&env.driver);
  return rdep::Status::Ok();
}

int RunGemmBench(const Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  GemmBenchOptions o;
  GemmBenchEnv env;
  if (auto st = SetupGemmBench(args, o, env); !st.ok()) return Fail(st);
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return Fail(rdep::Unavailable("stream"));

  cudaMemGetInfo(&env.free0, &env.total);
  auto dense = MeasureDensePeak(o.dense_n, o.warmup, std::min(o.iters, 100), stream);
  if (!dense.ok()) return Fail(dense.status());
  GemmBuffers bufs;
  if (auto st = AllocateGemmBuffers(o, bufs); !st.ok()) return Fail(st);
  const double weight_bytes = static_cast<double>((bufs.w1n + bufs.w2n) * 2);
  const bool l2_exceeded = weight_bytes > 2.0 * env.prop.l2CacheSize;

  PrintGemmHeader(o, env, *dense, weight_bytes, l2_exceeded);
  std::vector<Row> results;
  for (int64_t mu : o.mus) {
    const std::vector<int64_t> counts = DrawCounts(o.E, mu * o.E, o.alpha, o.seed + static_cast<uint64_t>(mu));
    std::vector<double> dense_rows;
    if (mu > 0) {
      auto d = MeasureDenseRows(o, mu * o.E, bufs, stream);
      if (!d.ok()) return Fail(d.status());
      dense_rows = std::move(*d);
    }
    for (auto path : o.paths) {
      auto row = MeasureGemmRow(o, mu, counts, path, bufs, stream, env);
      if (!row.ok()) return Fail(row.status());
      row->dense_rows_us = dense_rows;
      PrintGemmRow(*row, *dense);
      results.push_back(std::move(*row));
    }
  }
  std::cout << "(times in us, CUDA events on one stream; TFLOP/s useful: real rows only; peak = live bytes of this mu)\n";
  if (!o.json.empty())
    if (auto st = WriteGemmReceipt(o, env, *dense, l2_exceeded, results); !st.ok()) return Fail(st);
  cudaStreamDestroy(stream);
  return 0;
}

#else  // !RDEP_HAVE_CUDA

int RunGemmBench(const Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  Fail(rdep::Unavailable("this rdep was built without CUDA (reconfigure with a CUDA compiler)"));
  return 2;
}

#endif

const bool kReg = rdep::cli::RegisterBench({"gemm", "expert compute alone: SwiGLU expert MLP TFLOP/s and rho over mu", &RunGemmBench});

}  // namespace
