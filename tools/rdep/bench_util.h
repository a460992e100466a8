// Shared pieces of the `rdep bench` commands: the receipt header (hardware, software, commit) and
// small helpers. CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_receipt.h"
#include "build_commit.h"
#include "cli.h"
#include "rdep/core/json.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/core/stats.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/testing/validation.h"

namespace rdep::bench {

inline void WriteEnvironment(JsonWriter& j, int num_gpus) {
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  j.key("hardware").begin_object().field("gpu", std::string(p.name)).field("gpus", num_gpus);
  j.field("sms", p.multiProcessorCount).field("memory_gib", static_cast<double>(p.totalGlobalMem) / (1 << 30)).end_object();
  j.key("software").begin_object().field("cuda_runtime", runtime).field("cuda_driver", driver);
  j.field("rdep_commit", rdep::cli::kBuildCommit).end_object();
}

inline void CUDART_CB HostSleep(void* us) { std::this_thread::sleep_for(std::chrono::microseconds(*static_cast<const int64_t*>(us))); }

// Blocks `stream` for `*us` microseconds (host function), so the rank's host thread enqueues the
// iteration while the GPU waits. `us` must outlive the call; nothing when *us <= 0.
inline Status LaunchAhead(cudaStream_t stream, const int64_t* us) {
  if (*us <= 0) return Status::Ok();
  RDEP_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(stream, HostSleep, const_cast<int64_t*>(us)));
  return Status::Ok();
}

// The table's line for LayerConfig::transport_sms (printed by bench layer and bench dispatch).
inline void PrintTransportSms(int32_t sms) {
  if (sms > 0)
    std::printf("  transport SMs: %d (peer-storing kernels: %d blocks of %d threads, on at most that many SMs)\n", sms, sms,
                kTransportThreads);
  else
    std::printf("  transport SMs: every SM (peer-storing kernels' grids sized by the work)\n");
}

// The --transport-sms flag's value, range-checked as given (before any narrowing), naming the flag.
inline StatusOr<int32_t> ReadTransportSms(cli::Flags& f) {
  const int64_t v = f.get_int("transport-sms", 0);
  if (v < 0 || v > kMaxTransportSms)
    return InvalidArgument("--transport-sms must be in [0, " + std::to_string(kMaxTransportSms) + "] (0 = every SM), got " +
                           std::to_string(v));
  return static_cast<int32_t>(v);
}

// Reads a number field `"key": value` from a small JSON file (the baselines' receipts); NaN if absent.
inline double ReadJsonNumber(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const auto at = text.find("\"" + key + "\"");
  if (at == std::string::npos) return NAN;
  const auto colon = text.find(':', at);
  return colon == std::string::npos ? NAN : std::strtod(text.c_str() + colon + 1, nullptr);
}

// What a layer benchmark runs on: a seeded routing, weights and inputs, a one-process CUDA domain
// of W ranks round-robin over `num_gpus` GPUs (fewer GPUs than ranks: ranks share them) and the layer.
struct LayerBenchSetup {
  OwnershipMap ownership;
  Routing routing;
  std::vector<std::vector<float>> x;
  std::unique_ptr<CudaDomain> domain;
  std::unique_ptr<CudaMoELayer> layer;
  MoEWeights weights;  // kept only for a layer without weights of its own (the caller binds copies)
};

// own_weights = false: the layer is created without weights (as rdep.torch's, whose parameters are the
// caller's) and `weights` stays in the setup for the caller to copy and bind (BindExpertWeights).
inline StatusOr<LayerBenchSetup> SetupLayerBench(const LayerConfig& cfg, const RoutingSpec& spec, uint64_t seed, int num_gpus,
                                                 bool own_weights = true) {
  RDEP_RETURN_IF_ERROR(cfg.Validate());
  const LayerShape& s = cfg.shape;
  LayerBenchSetup b{*OwnershipMap::Contiguous(1, 1), {}, {}, nullptr, nullptr, {}};
  RDEP_ASSIGN_OR_RETURN(b.ownership, OwnershipMap::Contiguous(s.experts, s.ranks));
  RDEP_ASSIGN_OR_RETURN(b.routing, GenerateRouting(s, spec));
  MoEWeights weights = RandomWeights(s, seed);
  weights.gate_up = cfg.gate_up;  // i.i.d. draws: read in the layer's layout they are as random (no copy to move them)
  b.x = RandomActivations(s, b.routing, seed + 1);
  RDEP_ASSIGN_OR_RETURN(b.domain, CudaDomain::CreateSingleProcess(s.ranks, {.barrier_timeout_s = 10.0,
                                                                            .devices = RoundRobinDevices(s.ranks, num_gpus)}));
  if (own_weights) {
    RDEP_ASSIGN_OR_RETURN(b.layer, CudaMoELayer::Create(*b.domain, cfg, b.ownership, weights));
  } else {
    RDEP_ASSIGN_OR_RETURN(b.layer, CudaMoELayer::Create(*b.domain, cfg, b.ownership));
    b.weights = std::move(weights);
  }
  return b;
}

// What a layer benchmark allocates, estimated before SetupLayerBench: the host's fp32 weights, routing
// and inputs, the benchmark's events, and on each GPU the layer (the validation estimate's device
// terms, times the ranks that share a GPU when W ranks run on num_gpus). Refuses (InvalidArgument
// naming the flags) what exceeds the limits or the smallest of the GPUs used.
// bf16_grads: `rdep bench layer --grads bf16` holds bf16 copies of each rank's expert weights and their
// bf16 gradients on its GPU instead of the layer's own weights (the estimate still counts those: high). layers > 1 (`--layers N`): N layers, each with its own context, and N
// more contexts (the stack's): the estimate's terms named "context: ..." count 2N times, the activations
// and replica slots, the owner's output rows and the CUTLASS scratch (shared) once, every other term N times; and one more set
// of fp32 host weights.
inline Status CheckLayerBenchFootprint(const LayerConfig& cfg, int64_t iterations, int num_gpus, cli::Limits limits,
                                       bool bf16_grads = false, int32_t layers = 1) {
  ValidationOptions vo;
  vo.layer = cfg;
  const Footprint est = EstimateValidationFootprint(vo, /*device_backend=*/true);
  const LayerShape& s = cfg.shape;
  const auto W = static_cast<double>(s.ranks), T = static_cast<double>(s.tokens), H = static_cast<double>(s.hidden),
             F = static_cast<double>(s.ffn), E = static_cast<double>(s.experts), K = static_cast<double>(s.topk);
  Footprint fp;
  fp.device = est.device;
  const double per_gpu = std::ceil(W / static_cast<double>(std::max(num_gpus, 1)));  // ranks sharing one GPU
  if (per_gpu > 1)
    for (auto& term : fp.device) {
      term.amount *= per_gpu;
      term.what += " x " + std::to_string(static_cast<int64_t>(per_gpu)) + " ranks per GPU";
      term.factors.push_back({"gpus", static_cast<double>(num_gpus)});
    }
  if (layers > 1)
    for (auto& term : fp.device) {
      const bool context = term.what.rfind("context:", 0) == 0;
      const bool shared = term.what.rfind("activations", 0) == 0 || term.what.rfind("replica slots", 0) == 0 ||
                          term.what.rfind("shared ", 0) == 0;
      if (shared) continue;
      term.amount *= static_cast<double>(context ? 2 * layers : layers);
      term.what += context ? " x 2*layers (own and stack contexts)" : " x layers";
      term.factors.push_back({"layers", static_cast<double>(layers)});
    }
  if (bf16_grads) {
    const double e_loc = std::ceil(E / W);
    fp.device.push_back({"bf16 expert weights and gradients of --grads bf16 (E_loc*3*H*D_ff*2*2 x ranks per GPU)",
                         {{"local experts", e_loc}, {"hidden", H}, {"ffn", F}, {"ranks per GPU", per_gpu}},
                         4 * e_loc * 3 * H * F * per_gpu});
  }
  fp.host.push_back({"expert weights (E*3*H*D_ff fp32 and bf16)", {{"experts", E}, {"hidden", H}, {"ffn", F}}, 8 * E * 3 * H * F});
  if (layers > 1)
    fp.host.push_back({"the stack's expert weights (E*3*H*D_ff fp32, --layers)", {{"experts", E}, {"hidden", H}, {"ffn", F}}, 4 * E * 3 * H * F});
  fp.host.push_back({"routing and activations (W*T tokens)", {{"ranks", W}, {"tokens", T}, {"hidden", H}, {"topk", K}},
                     W * T * (8 * H + 16 * K)});
  fp.host.push_back({"CUDA events (4 per iteration per rank)", {{"ranks", W}, {"warmup+iters", static_cast<double>(iterations)}},
                     4 * W * static_cast<double>(iterations) * 256});
  double smallest = 0;
  for (int d = 0; d < num_gpus; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    const auto b = static_cast<double>(p.totalGlobalMem);
    if (smallest == 0 || b < smallest) smallest = b;
  }
  limits.device_bytes = smallest;
  return cli::CheckFootprint(fp, limits);
}

// The first checks of `rdep bench layer` and `rdep bench dispatch`, in their order: the flags parsed
// (Flags::Finish), the limits read, --warmup and --iters at most 1000000, a CUDA device present. The
// caller prints the message and exits 2.
inline Status CheckBenchFlags(const cli::Flags& f, const StatusOr<cli::Limits>& limits, int64_t warmup, int64_t iters, int gpus) {
  RDEP_RETURN_IF_ERROR(f.Finish());
  if (!limits.ok()) return limits.status();
  if (warmup > 1000000 || iters > 1000000) return InvalidArgument("--warmup and --iters must be <= 1000000");
  if (gpus == 0) return InvalidArgument("no CUDA device is present");
  return Status::Ok();
}

// The last checks of a layer benchmark before it allocates: the shape valid, the estimate within the
// limits (CheckLayerBenchFootprint) and the receipt's path open for writing. The caller exits 2.
inline Status CheckLayerBenchPlan(const LayerConfig& cfg, int64_t iterations, int num_gpus, const cli::Limits& limits,
                                  const std::string& json, bool bf16_grads = false, int32_t layers = 1) {
  RDEP_RETURN_IF_ERROR(cfg.Validate());
  RDEP_RETURN_IF_ERROR(CheckLayerBenchFootprint(cfg, iterations, num_gpus, limits, bf16_grads, layers));
  return cli::CheckOutputPath("json", json);
}

}  // namespace rdep::bench
