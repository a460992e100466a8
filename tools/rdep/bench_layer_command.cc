// `rdep bench layer`: the whole MoE layer on the CUDA backend, forward and forward+backward, W GPUs
// of this machine (one process). Measurement protocol of DESIGN.md: a device barrier aligns the ranks
// before each iteration; CUDA events on each rank's stream; per iteration the max over ranks;
// p50/p99 over --iters after --warmup; useful TFLOP/s count accepted rows only; a phase breakdown from
// extra profiled iterations; the baseline's receipt (torch EP, run in the same device call) gives
// the ratio. Example:
//   rdep bench layer --tokens 4096 --hidden 2048 --ffn 1408 --experts 64 --topk 6 --json layer.json
//                    --baseline-json torch.json
//   rdep bench layer --routing zipf:1 --balance ultraep --slots 2   (replicas of hot experts: owner
//                    max/mean before and after, replicas, bytes streamed, plan and streaming times)
#include <iostream>

#include "cli.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <utility>

#include "bench_layer_stack.h"
#include "bench_util.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/router/telemetry.h"
#endif

namespace {

constexpr const char* kHelp = R"(usage: rdep bench layer [flags]

The whole MoE layer (router output -> dispatch -> expert MLP -> return -> combine, and backward) on
W GPUs of this machine. Reports max-rank p50/p99 of forward and forward+backward, useful TFLOP/s per
GPU (accepted rows only: forward 6*rows*H*D_ff FLOPs, backward twice that), a per-phase breakdown,
the device memory the layer holds (and with the caller's tensors: weights and gradients it binds,
inputs, outputs and their gradients, as a baseline's peak counts them), and the ratio to a baseline
receipt.

flags [defaults: the Moonlight shape]:
  --ranks W            ranks [all GPUs, at most 8]                --tokens T   tokens per rank [4096]
  --gpus N             ranks round-robin over N local GPUs [min(W, GPUs)]; N < W: ranks share GPUs
                       (the placement is printed; such timings do not measure NVLink)
  --hidden H [2048]    --ffn F [1408]            --experts E [64]    --topk K [6]
  --routing R          uniform | zipf:ALPHA [uniform]
  --capacity-factor C  0 = dropless [0]          --segment S  token rows per segment; 0 = W*T [0]
  --balance B          off | ultraep | eplb | eplb-exact: replicas of hot experts in redundant slots [off];
                       reports owner max/mean before and after, replicas, weight bytes streamed, and the
                       plan, streaming and gradient-reduction times (CUDA events)
  --slots N            with --balance: redundant slots per rank, N_slot in [0, E] [2]
  --min-quota U        with --balance ultraep: rows a replica carries at least [1]
  --min-gain G         with --balance ultraep: no replicas unless each takes at least G rows off the
                       busiest rank (the gain gate); 0 = off [0]
  --expert-compute X   cublaslt | cutlass: cutlass reads the per-expert counts on the GPU, so the layer
                       never waits on the host (any --segment, no balancing) [cublaslt]
  --grads G            fp32 | bf16: the expert weight gradients backward writes [fp32]; bf16 makes the
                       layer without weights of its own and binds bf16 weights with bf16 gradients, as
                       rdep.torch does for bf16 parameters (needs one segment and no --balance)
  --owner-reduce       the owner sums a token's rows before they cross back (one row per (token, owner)
                       instead of one per slot) and takes dgate's dot products in backward [off]
  --gate-in-expert     the gate multiplied before W2: the experts weight their rows, the front-end keeps no
                       expert outputs and the owners take dgate; with --owner-reduce the owner keeps none
                       either (needs --expert-compute cutlass and no --balance) [off]
  --gate-up L          split | interleaved8: where W1 holds the gate and up columns; interleaved8 (blocks of 8)
                       is the layout GEMM1's SwiGLU epilogue needs (rdep bench gemm --path cutlass-fused); the
                       layer runs the SwiGLU kernel with either [split]
  --transport-sms N    SM budget of the kernels that store into peer memory (scatter, return): N blocks,
                       so at most N SMs; 0 = grids sized by the work, every SM [0]
  --no-source-windows  the three phases of dispatch for every forward (LayerConfig::source_windows off); by
                       default a dropless forward in one segment without --balance places each source's
                       tokens in a fixed window of every owner's stream and its plan exchanges nothing
  --overlap            run the segments as a pipeline: the dispatch of segment s+1 and the return of s-1 beside
                       the experts' compute of s (a second stream per rank; same bits as without); needs
                       --expert-compute cutlass, no --balance or --owner-reduce, and --segment below W*T to
                       have two segments; with --transport-sms N the expert GEMMs leave N SMs free [off]
  --stash-rows N       the paged stash: a forward's saved owner rows move into pages of a pool of N rows
                       per rank, shared by the domain's layers of the shape, and back at backward, so a
                       context holds only the rows that arrived (needs --expert-compute cutlass and no
                       --balance; not with --graph); a forward that overflows the pool fails its
                       backward naming the rows; 0 = off [0]
  --layers N           also stack N such layers on the domain (own weights and gradients each, a context
                       per layer), run forward 1..N then backward N..1, and report the per-rank device
                       memory (layers, contexts, the GPU's use) and the pass's time (p50 over min(--iters,
                       10) passes) [1: one layer only; not with --grads bf16]
  --graph              also capture one forward (and one forward+backward) of every rank as one CUDA graph
                       and time its replays beside the eager calls (needs --expert-compute cutlass; ranks on GPUs
                       of their own are captured too: their barriers are kernels counting epochs on the device)
  --warmup N [20]      --iters N [200]           --seed N [1]
  --json FILE          write the receipt
  --routing-out FILE   write the routing (the draw the times were taken under) to FILE (--ranks 1), or rank r's
                       to FILE.rank<r> (--ranks W > 1): int64 tokens, int64 topk, int32 experts [tokens*topk], fp32
                       gates [tokens*topk], little-endian; bench/torch_layer_bench.py --routing-from FILE times the
                       binding on the same draw (under torchrun, each process reads its rank's file)
  --max-memory-gib G   host memory limit [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]; the
                       layer's estimated device memory must also fit each GPU (checked before allocating)
  -h, --help           this page
  --baseline-json FILE a baseline receipt with fwd_p50_ms / fwdbwd_p50_ms (torch_ep_moe.py --json)
)";

#if defined(RDEP_HAVE_CUDA)

using rdep::Status;

int Fail(const Status& s) {
  std::cerr << "rdep bench layer: " << s.message() << "\n";
  return 1;
}

// A refused flag or size: the message, exit 2.
int Refuse(const std::string& message) {
  std::cerr << "rdep bench layer: " << message << "\n";
  return 2;
}

// ---- setup -----------------------------------------------------------------------------------------

// What the flags ask for, checked.
struct LayerBenchOptions {
  rdep::LayerConfig cfg;
  rdep::RoutingSpec spec;  // seeded with `seed`
  int64_t use_gpus = 0;    // ranks round-robin over this many GPUs
  int64_t warmup = 0, iters = 0;
  uint64_t seed = 0;
  std::string json, baseline;  // receipt to write, baseline receipt to read ("" = none)
  std::string routing_out;     // --routing-out: the ranks' routing written there ("" = none; FILE.rank<r> at W > 1)
  bool graph = false;          // also time CUDA-graph replays
  bool bf16_grads = false;     // --grads bf16: bind bf16 weights with bf16 gradients (rdep.torch's case)
  int32_t layers = 1;          // --layers N: also the memory and time of N such layers on the domain
  rdep::cli::Limits limits;
};

// --balance, --slots, --min-quota, --min-gain into cfg.balance; 0 when good, else 2 naming the flag.
int ReadBalanceFlags(const std::string& name, bool slots_given, bool min_quota_given, int64_t slots, rdep::LayerConfig& cfg) {
  auto kind = rdep::ParseBalanceKind(name);
  if (!kind.ok()) return Refuse("--balance: " + kind.status().message());
  if (cfg.balance.min_gain != 0 && *kind != rdep::BalanceKind::kUltraEp) return Refuse("--min-gain applies to --balance ultraep only");
  if (cfg.balance.min_gain < 0) return Refuse("--min-gain must be >= 0 (0 = off), got " + std::to_string(cfg.balance.min_gain));
  cfg.balance.kind = *kind;
  if (!cfg.balance.enabled() && (slots_given || min_quota_given))
    return Refuse(std::string(slots_given ? "--slots" : "--min-quota") + " needs --balance ultraep, eplb or eplb-exact");
  if (min_quota_given && cfg.balance.kind != rdep::BalanceKind::kUltraEp) return Refuse("--min-quota applies to --balance ultraep only");
  if (slots < 0 || slots > cfg.shape.experts)
    return Refuse("--slots must be in [0, E=" + std::to_string(cfg.shape.experts) + "], got " + std::to_string(slots));
  cfg.balance.num_slots = static_cast<int32_t>(slots);
  if (cfg.balance.min_quota < 1) return Refuse("--min-quota must be >= 1, got " + std::to_string(cfg.balance.min_quota));
  return 0;
}

// Reads and checks the flags in the command's fixed order; 0 when `o` is good, else the exit code
// (2: a refused flag or size, estimate included; 1: an unknown routing).
int ParseLayerBenchOptions(const rdep::cli::Args& args, LayerBenchOptions& o) {
  rdep::cli::Flags f(args);
  const int gpus = rdep::cuda::DeviceCount();
  auto& s = o.cfg.shape;
  s.ranks = f.get_int("ranks", std::min(gpus, 8));
  o.use_gpus = f.get_int("gpus", std::min<int64_t>(s.ranks, gpus));
  s.tokens = f.get_int("tokens", 4096);
  s.hidden = f.get_int("hidden", 2048);
  s.ffn = f.get_int("ffn", 1408);
  s.experts = f.get_int("experts", 64);
  s.topk = f.get_int("topk", 6);
  const std::string routing_name = f.get_string("routing", "uniform");
  o.cfg.capacity.capacity_factor = f.get_double("capacity-factor", 0);
  o.cfg.segment_tokens = f.get_int("segment", 0);
  o.warmup = f.get_int("warmup", 20);
  o.iters = f.get_int("iters", 200);
  o.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  o.json = f.get_string("json", "");
  o.routing_out = f.get_string("routing-out", "");
  o.baseline = f.get_string("baseline-json", "");
  const std::string balance = f.get_string("balance", "off");
  const bool slots_given = f.has("slots"), min_quota_given = f.has("min-quota");
  const int64_t slots = f.get_int("slots", 2);
  o.cfg.balance.min_quota = f.get_int("min-quota", 1);
  o.cfg.balance.min_gain = f.get_int("min-gain", 0);
  const std::string expert_compute = f.get_string("expert-compute", "cublaslt");
  o.graph = f.get_bool("graph");
  o.cfg.owner_reduce = f.get_bool("owner-reduce");
  o.cfg.stash_rows = f.get_int("stash-rows", 0);
  o.cfg.overlap_segments = f.get_bool("overlap");
  o.cfg.gate_in_expert = f.get_bool("gate-in-expert");
  o.cfg.source_windows = !f.get_bool("no-source-windows");
  auto gate_up = rdep::ParseGateUp(f.get_string("gate-up", "split"));
  auto transport_sms = rdep::bench::ReadTransportSms(f);
  const std::string grads = f.get_string("grads", "fp32");
  const int64_t layers = f.get_int("layers", 1);
  auto limits = rdep::cli::ReadLimits(f);
  if (Status st = rdep::bench::CheckBenchFlags(f, limits, o.warmup, o.iters, gpus); !st.ok()) return Refuse(st.message());
  if (!transport_sms.ok()) return Refuse(transport_sms.status().message());
  if (!gate_up.ok()) return Refuse("--gate-up: " + gate_up.status().message());
  o.cfg.gate_up = *gate_up;
  o.cfg.transport_sms = *transport_sms;
  if (int rc = ReadBalanceFlags(balance, slots_given, min_quota_given, slots, o.cfg); rc != 0) return rc;
  auto compute = rdep::ParseExpertCompute(expert_compute);
  if (!compute.ok()) return Refuse("--expert-compute: " + compute.status().message());
  o.cfg.expert_compute = *compute;
  if (grads != "fp32" && grads != "bf16") return Refuse("--grads must be fp32 or bf16, got '" + grads + "'");
  o.bf16_grads = grads == "bf16";
  if (o.bf16_grads && (o.cfg.balance.enabled() || (o.cfg.segment_tokens > 0 && o.cfg.segment_tokens < s.ranks * s.tokens)))
    return Refuse("--grads bf16 needs one segment (--segment 0 or >= W*T) and no --balance (replica gradients reduce into fp32 ones)");
  if (o.graph && (o.cfg.expert_compute != rdep::ExpertComputeKind::kCutlass || o.cfg.balance.enabled()))
    return Refuse("--graph needs --expert-compute cutlass and no --balance (the layer must not wait on the host)");
  if (o.graph && o.cfg.stash_rows > 0)
    return Refuse("--graph with --stash-rows: the paged stash checks its pool's overflow on the host, so it is not captured");
  if (o.warmup < 0 || o.iters < 1) return Refuse("--warmup must be >= 0 and --iters >= 1");
  if (layers < 1 || layers > 1000) return Refuse("--layers must be in [1, 1000], got " + std::to_string(layers));
  if (layers > 1 && o.bf16_grads) return Refuse("--layers with --grads bf16 is not supported (the stack's layers keep fp32 gradients)");
  o.layers = static_cast<int32_t>(layers);
  if (o.use_gpus < 1 || o.use_gpus > gpus)
    return Refuse("--gpus must be in [1, " + std::to_string(gpus) + "] on this machine, got " + std::to_string(o.use_gpus));
  auto spec = rdep::RoutingSpec::Parse(routing_name);
  if (!spec.ok()) return Fail(spec.status());
  spec->seed = o.seed;
  o.spec = *spec;
  o.limits = *limits;
  // Estimate before allocating; open the receipt before the work.
  if (Status st = rdep::bench::CheckLayerBenchPlan(o.cfg, o.warmup + o.iters, static_cast<int>(o.use_gpus), o.limits, o.json,
                                                   o.bf16_grads, o.layers);
      !st.ok())
    return Refuse(st.message());
  return 0;
}

// One rank's device inputs and outputs, and its events: per iteration i, 4i / 4i+1 around the forward
// pass, 4i+2 / 4i+3 around the forward+backward pass.
struct RankBuffers {
  int32_t* experts = nullptr;
  float *gates = nullptr, *dgates = nullptr;
  __nv_bfloat16 *x = nullptr, *y = nullptr, *dy = nullptr, *dx = nullptr;
  // --grads bf16: bf16 copies of the rank's expert weights and their bf16 gradients, bound to the rank.
  __nv_bfloat16 *w1 = nullptr, *w2 = nullptr, *dw1 = nullptr, *dw2 = nullptr;
  std::vector<cudaEvent_t> ev;
  size_t io_bytes = 0;      // x, y, dy, dx, experts, gates, dgates
  size_t weight_bytes = 0;  // w1, w2, dw1, dw2 (--grads bf16)
};

// On rank r's thread: allocates `b`, uploads the routing and the activations (bf16), dy = 0.01 and
// creates 4 events per iteration (`total` = warmup + iters).
Status UploadRankBuffers(RankBuffers& b, const rdep::RankRouting& rr, const std::vector<float>& x, const rdep::LayerShape& s,
                         int64_t total) {
  const size_t nk = static_cast<size_t>(s.tokens * s.topk), nh = static_cast<size_t>(s.tokens * s.hidden);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.experts, nk * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.gates, nk * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.dgates, nk * 4));
  for (auto** p : {&b.x, &b.y, &b.dy, &b.dx}) RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(p, nh * 2));
  b.io_bytes = 3 * nk * 4 + 4 * nh * 2;
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.experts, rr.experts.data(), rr.experts.size() * 4, cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.gates, rr.gates.data(), rr.gates.size() * 4, cudaMemcpyHostToDevice));
  std::vector<uint16_t> bits(nh);
  for (size_t i = 0; i < bits.size() && i < x.size(); ++i) bits[i] = rdep::FloatToBf16Bits(x[i]);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.x, bits.data(), nh * 2, cudaMemcpyHostToDevice));
  for (auto& v : bits) v = rdep::FloatToBf16Bits(0.01f);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.dy, bits.data(), nh * 2, cudaMemcpyHostToDevice));
  // The copies ran on the legacy stream (a pageable copy may return before its DMA lands), which the ranks'
  // non-blocking streams do not wait for.
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  b.ev.resize(static_cast<size_t>(4 * total));
  for (auto& e : b.ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  return Status::Ok();
}

// --grads bf16, on rank r's thread: bf16 copies of the rank's experts from the host weights (the layer
// was created without weights of its own, as rdep.torch's is), bound with bf16 gradient buffers
// (ExternalWeights<bf16, bf16>), so backward writes bf16 gradients once.
Status BindBf16Grads(rdep::CudaMoELayer& layer, int32_t r, RankBuffers& b, const rdep::MoEWeights& weights,
                     const rdep::OwnershipMap& ownership) {
  const int32_t local = ownership.num_local(r);
  for (int which = 0; which < 2; ++which) {
    const size_t per = which ? weights.w2_per_expert() : weights.w1_per_expert();
    const std::vector<float>& w = which ? weights.w2 : weights.w1;
    std::vector<uint16_t> bits(static_cast<size_t>(local) * per);
    for (int32_t j = 0; j < local; ++j) {
      const auto e = static_cast<size_t>(ownership.global_expert(r, j));
      for (size_t i = 0; i < per; ++i) bits[static_cast<size_t>(j) * per + i] = rdep::FloatToBf16Bits(w[e * per + i]);
    }
    __nv_bfloat16** dst = which ? &b.w2 : &b.w1;
    __nv_bfloat16** grad = which ? &b.dw2 : &b.dw1;
    const size_t bytes = std::max<size_t>(bits.size(), 1) * 2;
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(dst, bytes));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(grad, bytes));
    b.weight_bytes += 2 * bytes;
    if (!bits.empty()) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(*dst, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  }
  // The copies ran on the legacy stream (a pageable copy may return before its DMA lands), which the ranks'
  // non-blocking streams do not wait for.
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  return layer.BindExpertWeights(r, rdep::ExternalWeights<__nv_bfloat16, __nv_bfloat16>{b.w1, b.w2, b.dw1, b.dw2});
}

void FreeRankBuffers(rdep::CudaDomain& domain, std::vector<RankBuffers>& bufs) {
  for (size_t r = 0; r < bufs.size(); ++r) {
    cudaSetDevice(domain.device(static_cast<int32_t>(r)));
    for (void* p : {static_cast<void*>(bufs[r].experts), static_cast<void*>(bufs[r].gates), static_cast<void*>(bufs[r].dgates),
                    static_cast<void*>(bufs[r].x), static_cast<void*>(bufs[r].y), static_cast<void*>(bufs[r].dy), static_cast<void*>(bufs[r].dx),
                    static_cast<void*>(bufs[r].w1), static_cast<void*>(bufs[r].w2), static_cast<void*>(bufs[r].dw1), static_cast<void*>(bufs[r].dw2)})
      cudaFree(p);
    for (auto e : bufs[r].ev) cudaEventDestroy(e);
  }
}

// ---- run -------------------------------------------------------------------------------------------

// Raw times per rank and what is derived from them.
struct LayerBenchResults {
  std::vector<std::vector<double>> fwd, fwdbwd;                // [rank][iteration after warmup], ms
  std::vector<std::vector<double>> host_fwd, host_fwdbwd;      // host time in the layer's calls, issued on an idle stream, ms
  std::vector<std::vector<double>> graph_fwd, graph_fwdbwd;    // with --graph: replays of the captured calls, ms
  rdep::Summary graph_sf, graph_sfb;
  std::vector<std::vector<rdep::PhaseTimes>> prof_f, prof_b;  // [rank][profiled iteration]
  std::vector<size_t> bytes;                                   // layer device bytes per rank
  // Per rank, the caller's device tensors: inputs, outputs and their gradients, and with --grads bf16
  // the bound bf16 weights and gradients (what the baseline's peak also counts beside its activations).
  std::vector<size_t> caller_bytes;
  int64_t accepted_rows = 0;                                   // over all ranks
  std::vector<double> f_max, fb_max;                           // per iteration, max over ranks
  rdep::Summary sf, sfb;
  rdep::PhaseTimes bf, bb;  // max over ranks of each phase's median
  double tflops_f = 0, tflops_fb = 0;
  size_t max_bytes = 0;
  size_t max_rank_bytes = 0;  // max over ranks of bytes + caller_bytes
  rdep::BalanceTelemetry balance;  // with --balance: what the last profiled forward's plan did
};

// Rank r's timed loop: pass 0 forward only, pass 1 forward + backward; each iteration a device barrier
// (ranks start together), an event, the layer, an event; after Synchronize the times past the warmup.
Status TimeRankPasses(rdep::CudaDomain& domain, rdep::CudaMoELayer& layer, int32_t r, RankBuffers& b, int64_t n,
                      int64_t warmup, int64_t total, std::vector<double>& fwd, std::vector<double>& fwdbwd) {
  cudaStream_t stream = domain.stream(r);
  for (int pass = 0; pass < 2; ++pass) {  // 0: forward only, 1: forward + backward
    for (int64_t i = 0; i < total; ++i) {
      RDEP_RETURN_IF_ERROR(domain.Barrier(r, rdep::Phase::kTest));  // ranks start together
      cudaEvent_t e0 = b.ev[static_cast<size_t>(4 * i + 2 * pass)], e1 = b.ev[static_cast<size_t>(4 * i + 2 * pass + 1)];
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(e0, stream));
      RDEP_RETURN_IF_ERROR(layer.Forward(r, b.experts, b.gates, n, b.x, b.y));
      if (pass == 1) RDEP_RETURN_IF_ERROR(layer.Backward(r, b.dy, b.dx, b.dgates));
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(e1, stream));
    }
    RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
    for (int64_t i = warmup; i < total; ++i) {
      float ms = 0;
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, b.ev[static_cast<size_t>(4 * i + 2 * pass)], b.ev[static_cast<size_t>(4 * i + 2 * pass + 1)]));
      (pass ? fwdbwd : fwd).push_back(ms);
    }
  }
  return Status::Ok();
}

// Rank r's host time per call: `iters` forwards, then forward + backward pairs, each issued with the rank's
// stream idle (synchronized before it, outside the time), so the wall time of the layer's calls is what the
// host spends issuing them, not the back-pressure of a full launch queue, which paces a back-to-back loop at
// the device's rate. A layer that waits on the device inside a call (the cuBLASLt compute's count read, a
// plan that reads the segment counts on the host: any layer but the sync-free one) has that wait, and the
// device work before it, in its host time. Runs after the timed passes and before the graph and profiled ones.
Status HostRankPasses(rdep::CudaDomain& domain, rdep::CudaMoELayer& layer, int32_t r, RankBuffers& b, int64_t n, int64_t iters,
                      std::vector<double>& host_fwd, std::vector<double>& host_fwdbwd) {
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t i = 0; i < iters; ++i) {
      RDEP_RETURN_IF_ERROR(domain.Barrier(r, rdep::Phase::kTest));
      RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
      const auto h0 = std::chrono::steady_clock::now();
      RDEP_RETURN_IF_ERROR(layer.Forward(r, b.experts, b.gates, n, b.x, b.y));
      if (pass == 1) RDEP_RETURN_IF_ERROR(layer.Backward(r, b.dy, b.dx, b.dgates));
      (pass ? host_fwdbwd : host_fwd).push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count());
    }
  }
  return domain.Synchronize(r);
}

// With --graph: one forward, then one forward + backward, of every rank captured as CUDA graphs
// (CudaDomain::BeginCapture / EndCapture: the ranks' streams joined to the first rank's capture; the layer
// must not wait on the host inside, or the capture fails). Both are captured before any replay, so the other
// ranks return at once and no rank waits at a capture rendezvous while replays run. The first rank then times
// `total` replays of each with events on its stream, as TimeRankPasses times the eager calls: each replay runs
// every rank's work, so these times are the whole layer's (max-rank), and the other ranks record none.
Status TimeGraphPasses(rdep::CudaDomain& domain, rdep::CudaMoELayer& layer, int32_t r, RankBuffers& b, int64_t n,
                       int64_t warmup, int64_t total, std::vector<double>& fwd, std::vector<double>& fwdbwd) {
  cudaGraph_t graphs[2] = {nullptr, nullptr};
  const auto destroy = [&graphs] {
    for (cudaGraph_t& g : graphs)
      if (g) cudaGraphDestroy(std::exchange(g, nullptr));
  };
  for (int pass = 0; pass < 2; ++pass) {
    if (Status st = domain.BeginCapture(r); !st.ok()) {
      destroy();
      return st;
    }
    Status captured = layer.Forward(r, b.experts, b.gates, n, b.x, b.y);
    if (captured.ok() && pass == 1) captured = layer.Backward(r, b.dy, b.dx, b.dgates);
    auto graph = domain.EndCapture(r);  // collective: every rank ends the capture
    if (graph.ok()) graphs[pass] = *graph;
    if (!captured.ok() || !graph.ok()) {
      destroy();
      return captured.ok() ? graph.status() : captured;  // the layer's own error first: it names the cause
    }
  }
  if (graphs[0] == nullptr) return Status::Ok();  // another rank holds the graphs and launches them
  cudaStream_t stream = domain.stream(r);
  for (int pass = 0; pass < 2; ++pass) {
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graphs[pass], 0);
    if (inst != cudaSuccess) destroy();
    RDEP_CUDA_RETURN_IF_ERROR(inst);
    Status launched = Status::Ok();
    for (int64_t i = 0; i < total && launched.ok(); ++i) {
      cudaEvent_t e0 = b.ev[static_cast<size_t>(4 * i + 2 * pass)], e1 = b.ev[static_cast<size_t>(4 * i + 2 * pass + 1)];
      launched = rdep::cuda::CudaStatus(cudaEventRecord(e0, stream), "cudaEventRecord", __FILE__, __LINE__);
      if (launched.ok()) launched = rdep::cuda::CudaStatus(cudaGraphLaunch(exec, stream), "cudaGraphLaunch", __FILE__, __LINE__);
      if (launched.ok()) launched = rdep::cuda::CudaStatus(cudaEventRecord(e1, stream), "cudaEventRecord", __FILE__, __LINE__);
    }
    Status done = domain.Synchronize(r);
    for (int32_t q : domain.local_ranks())
      if (done.ok()) done = domain.CheckErrors(q);  // a barrier of another rank's branch
    cudaGraphExecDestroy(exec);
    if (!launched.ok() || !done.ok()) {
      destroy();
      return launched.ok() ? done : launched;
    }
    for (int64_t i = warmup; i < total; ++i) {
      float ms = 0;
      const cudaError_t e = cudaEventElapsedTime(&ms, b.ev[static_cast<size_t>(4 * i + 2 * pass)], b.ev[static_cast<size_t>(4 * i + 2 * pass + 1)]);
      if (e != cudaSuccess) destroy();
      RDEP_CUDA_RETURN_IF_ERROR(e);
      (pass ? fwdbwd : fwd).push_back(ms);
    }
  }
  destroy();
  return Status::Ok();
}

// Rank r's phase breakdown: 10 profiled forward+backward iterations after the timed ones; returns the
// rows this rank accepted.
rdep::StatusOr<int64_t> ProfileRank(rdep::CudaDomain& domain, rdep::CudaMoELayer& layer, int32_t r, RankBuffers& b, int64_t n,
                                    std::vector<rdep::PhaseTimes>& prof_f, std::vector<rdep::PhaseTimes>& prof_b) {
  for (int i = 0; i < 10; ++i) {
    RDEP_RETURN_IF_ERROR(domain.Barrier(r, rdep::Phase::kTest));
    RDEP_RETURN_IF_ERROR(layer.Forward(r, b.experts, b.gates, n, b.x, b.y));
    RDEP_RETURN_IF_ERROR(layer.Backward(r, b.dy, b.dx, b.dgates));
    RDEP_ASSIGN_OR_RETURN(auto pf, layer.LastPhaseTimes(r, false));
    RDEP_ASSIGN_OR_RETURN(auto pb, layer.LastPhaseTimes(r, true));
    prof_f.push_back(pf);
    prof_b.push_back(pb);
  }
  RDEP_ASSIGN_OR_RETURN(auto acc, layer.CopyAcceptance(r));
  int64_t a = 0;
  for (auto v : acc.accepted) a += v;
  return a;
}

rdep::PhaseTimes MedianPhaseTimes(const std::vector<rdep::PhaseTimes>& v) {
  rdep::PhaseTimes m;
  auto med = [&](double rdep::PhaseTimes::*field) {
    std::vector<double> xs;
    for (const auto& p : v) xs.push_back(p.*field);
    return rdep::Percentile(xs, 50);
  };
  m.routing_ms = med(&rdep::PhaseTimes::routing_ms);
  m.dispatch_ms = med(&rdep::PhaseTimes::dispatch_ms);
  m.expert_ms = med(&rdep::PhaseTimes::expert_ms);
  m.return_ms = med(&rdep::PhaseTimes::return_ms);
  m.combine_ms = med(&rdep::PhaseTimes::combine_ms);
  m.plan_ms = med(&rdep::PhaseTimes::plan_ms);
  m.stream_ms = med(&rdep::PhaseTimes::stream_ms);
  m.reduce_ms = med(&rdep::PhaseTimes::reduce_ms);
  return m;
}

// The statistics of the raw times: max over ranks per iteration, p50/p99, useful TFLOP/s per GPU
// (6*accepted_rows*H*D_ff forward, 3x that forward+backward), the max-rank phase medians.
void DeriveLayerStatistics(const rdep::LayerShape& s, LayerBenchResults& res) {
  for (size_t r = 0; r < res.prof_f.size(); ++r) {
    const auto pf = MedianPhaseTimes(res.prof_f[r]), pb = MedianPhaseTimes(res.prof_b[r]);
    for (auto [dst, src] : {std::pair{&res.bf, &pf}, std::pair{&res.bb, &pb}}) {
      dst->routing_ms = std::max(dst->routing_ms, src->routing_ms);
      dst->dispatch_ms = std::max(dst->dispatch_ms, src->dispatch_ms);
      dst->expert_ms = std::max(dst->expert_ms, src->expert_ms);
      dst->return_ms = std::max(dst->return_ms, src->return_ms);
      dst->combine_ms = std::max(dst->combine_ms, src->combine_ms);
      dst->plan_ms = std::max(dst->plan_ms, src->plan_ms);
      dst->stream_ms = std::max(dst->stream_ms, src->stream_ms);
      dst->reduce_ms = std::max(dst->reduce_ms, src->reduce_ms);
    }
  }
  const auto W = static_cast<double>(s.ranks);
  res.f_max = rdep::MaxOverRanks(res.fwd);
  res.fb_max = rdep::MaxOverRanks(res.fwdbwd);
  res.sf = rdep::Summarize(res.f_max);
  res.sfb = rdep::Summarize(res.fb_max);
  const double flops_fwd = 6.0 * static_cast<double>(res.accepted_rows) * static_cast<double>(s.hidden) * static_cast<double>(s.ffn);
  res.tflops_f = flops_fwd / W / (res.sf.p50 * 1e-3) / 1e12;
  res.tflops_fb = 3 * flops_fwd / W / (res.sfb.p50 * 1e-3) / 1e12;
  for (size_t r = 0; r < res.bytes.size(); ++r) {
    res.max_bytes = std::max(res.max_bytes, res.bytes[r]);
    res.max_rank_bytes = std::max(res.max_rank_bytes, res.bytes[r] + res.caller_bytes[r]);
  }
}

// The timed passes on every rank, then the profiled iterations, then the statistics.
Status RunLayerTimings(const LayerBenchOptions& o, rdep::bench::LayerBenchSetup& setup, std::vector<RankBuffers>& bufs,
                       LayerBenchResults& res) {
  const rdep::Routing& routing = setup.routing;
  rdep::CudaDomain& domain = *setup.domain;
  rdep::CudaMoELayer& layer = *setup.layer;
  const auto W = static_cast<size_t>(o.cfg.shape.ranks);
  const int64_t total = o.warmup + o.iters;
  res.fwd.assign(W, {});
  res.fwdbwd.assign(W, {});
  res.host_fwd.assign(W, {});
  res.host_fwdbwd.assign(W, {});
  res.bytes.assign(W, 0);
  res.caller_bytes.assign(W, 0);
  RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
    const auto sr = static_cast<size_t>(r);
    RDEP_RETURN_IF_ERROR(UploadRankBuffers(bufs[sr], routing[sr], setup.x[sr], o.cfg.shape, total));
    if (o.bf16_grads) RDEP_RETURN_IF_ERROR(BindBf16Grads(layer, r, bufs[sr], setup.weights, setup.ownership));
    RDEP_RETURN_IF_ERROR(TimeRankPasses(domain, layer, r, bufs[sr], routing[sr].num_tokens, o.warmup, total, res.fwd[sr],
                                        res.fwdbwd[sr]));
    RDEP_RETURN_IF_ERROR(HostRankPasses(domain, layer, r, bufs[sr], routing[sr].num_tokens, std::min<int64_t>(o.iters, 50),
                                        res.host_fwd[sr], res.host_fwdbwd[sr]));
    res.bytes[sr] = layer.device_bytes(r) + layer.shared_bytes();  // one layer: the shared slots are all its own
    res.caller_bytes[sr] = bufs[sr].io_bytes + bufs[sr].weight_bytes;
    return Status::Ok();
  }));
  if (o.graph) {
    res.graph_fwd.assign(W, {});
    res.graph_fwdbwd.assign(W, {});
    RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
      const auto sr = static_cast<size_t>(r);
      return TimeGraphPasses(domain, layer, r, bufs[sr], routing[sr].num_tokens, o.warmup, total, res.graph_fwd[sr],
                             res.graph_fwdbwd[sr]);
    }));
    // One graph ran every rank's work: only the rank that launched it has times.
    std::erase_if(res.graph_fwd, [](const std::vector<double>& v) { return v.empty(); });
    std::erase_if(res.graph_fwdbwd, [](const std::vector<double>& v) { return v.empty(); });
    res.graph_sf = rdep::Summarize(rdep::MaxOverRanks(res.graph_fwd));
    res.graph_sfb = rdep::Summarize(rdep::MaxOverRanks(res.graph_fwdbwd));
  }
  // Phase breakdown: a few profiled iterations after the timed ones (medians per rank, then max).
  RDEP_RETURN_IF_ERROR(layer.EnableProfiling(true));
  res.prof_f.assign(W, {});
  res.prof_b.assign(W, {});
  std::mutex mu;
  RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
    const auto sr = static_cast<size_t>(r);
    RDEP_ASSIGN_OR_RETURN(int64_t a, ProfileRank(domain, layer, r, bufs[sr], routing[sr].num_tokens, res.prof_f[sr], res.prof_b[sr]));
    std::lock_guard<std::mutex> lock(mu);
    res.accepted_rows += a;
    return Status::Ok();
  }));
  if (o.cfg.balance.enabled()) {
    RDEP_ASSIGN_OR_RETURN(res.balance, layer.balance_telemetry(domain.local_ranks().front()));
  }
  DeriveLayerStatistics(o.cfg.shape, res);
  return Status::Ok();
}

// ---- report ----------------------------------------------------------------------------------------

// The baseline receipt's numbers (NaN where absent or without --baseline-json) and the load this
// routing puts on the experts and their owners (what skew the times were taken under).
struct LayerBenchContext {
  double base_f = NAN, base_fb = NAN, base_mem = NAN;
  rdep::RoutingTelemetry tel;
  double owner_max_over_mean = 0;
};

rdep::StatusOr<LayerBenchContext> ReadLayerBenchContext(const LayerBenchOptions& o, const rdep::bench::LayerBenchSetup& setup) {
  LayerBenchContext c;
  const std::string& baseline = o.baseline;
  c.base_f = baseline.empty() ? NAN : rdep::bench::ReadJsonNumber(baseline, "fwd_p50_ms");
  c.base_fb = baseline.empty() ? NAN : rdep::bench::ReadJsonNumber(baseline, "fwdbwd_p50_ms");
  c.base_mem = baseline.empty() ? NAN : rdep::bench::ReadJsonNumber(baseline, "peak_alloc_gib");
  RDEP_ASSIGN_OR_RETURN(c.tel, rdep::ComputeTelemetry(setup.routing, setup.ownership));
  const double owner_mean = static_cast<double>(c.tel.total_rows) / static_cast<double>(o.cfg.shape.ranks);
  const double owner_max = static_cast<double>(*std::max_element(c.tel.owner_loads.begin(), c.tel.owner_loads.end()));
  c.owner_max_over_mean = owner_mean > 0 ? owner_max / owner_mean : 0.0;
  return c;
}

// What balancing did and cost: the plan's telemetry and the max-rank medians of the plan, the replica
// weight streaming (forward, and again in backward) and the gradient reduction.
void PrintBalance(const rdep::LayerConfig& cfg, const LayerBenchResults& res) {
  const rdep::BalanceTelemetry& t = res.balance;
  const double mib = static_cast<double>(t.weight_bytes) / (1024.0 * 1024.0);
  std::ostringstream name;
  name << cfg.balance;
  std::printf("  balance %s: owner max/mean %.3f before -> %.3f after, %d replicas in %d slots%s, %.3f MiB of weights streamed "
              "per forward (and per backward)\n",
              name.str().c_str(), t.imbalance_before, t.imbalance_after, t.replicas, t.slots,
              t.slot_limited ? " (every slot used)" : "", mib);
  const double gbps = res.bf.stream_ms > 0 ? static_cast<double>(t.weight_bytes) / (res.bf.stream_ms * 1e-3) / 1e9 : 0.0;
  std::printf("  balance times (ms, max-rank median): plan %.3f, streaming %.3f forward (%.1f GB/s all replicas) + %.3f backward, "
              "gradient reduction %.3f\n",
              res.bf.plan_ms, res.bf.stream_ms, gbps, res.bb.stream_ms, res.bb.reduce_ms);
}

void PrintLayerTable(const LayerBenchOptions& o, const rdep::bench::LayerBenchSetup& setup, const LayerBenchResults& res,
                     const LayerBenchContext& c) {
  const auto& s = o.cfg.shape;
  const auto& cfg = o.cfg;
  const auto& tel = c.tel;
  const auto &sf = res.sf, &sfb = res.sfb;
  const auto &bf = res.bf, &bb = res.bb;
  std::printf("rdep bench layer: %s, routing %s, capacity %s, S=%lld, warmup %lld, iters %lld\n",
              [&] { std::ostringstream os; os << s; return os.str(); }().c_str(), o.spec.name().c_str(),
              cfg.capacity.dropless() ? "dropless" : std::to_string(cfg.capacity.capacity_factor).c_str(),
              static_cast<long long>(setup.layer->layout().S), static_cast<long long>(o.warmup), static_cast<long long>(o.iters));
  std::printf("  placement: %s\n", setup.domain->placement().c_str());
  rdep::bench::PrintTransportSms(cfg.transport_sms);
  if (cfg.overlap_segments) {
    const long long S = setup.layer->layout().S, segs = (s.ranks * s.tokens + S - 1) / S;
    std::printf("  segments: %lld per call, %s\n", segs,
                segs > 1 ? "overlapped (dispatch of s+1 and return of s-1 beside the compute of s; breakdown = the transport stream's path)"
                         : "one: nothing to overlap, run in sequence");
  }
  if (o.bf16_grads)
    std::printf("  weight gradients: bf16 (the layer holds no weights; bf16 weights and gradients bound, as rdep.torch's bf16 parameters)\n");
  if (cfg.expert_compute != rdep::ExpertComputeKind::kCublasLt)
    std::printf("  expert compute: %s (the counts read on the GPU: no host wait in the layer)\n",
                rdep::ExpertComputeName(cfg.expert_compute));
  std::printf("  load: expert max/mean %.2f (CV %.1f%%, %lld of %lld experts active), owner max/mean %.2f\n",
              tel.max_over_mean, 100 * tel.cv, static_cast<long long>(tel.active_experts),
              static_cast<long long>(tel.num_experts), c.owner_max_over_mean);
  std::printf("  %-18s %10s %10s %14s %12s %8s\n", "", "p50 ms", "p99 ms", "TFLOP/s/GPU", "baseline ms", "speedup");
  std::printf("  %-18s %10.3f %10.3f %14.1f %12.3f %7.2fx\n", "forward", sf.p50, sf.p99, res.tflops_f, c.base_f, c.base_f / sf.p50);
  std::printf("  %-18s %10.3f %10.3f %14.1f %12.3f %7.2fx\n", "forward+backward", sfb.p50, sfb.p99, res.tflops_fb, c.base_fb,
              c.base_fb / sfb.p50);
  if (o.graph) {
    std::printf("  %-18s %10.3f %10.3f %14.1f %12.3f %7.2fx\n", "graph forward", res.graph_sf.p50, res.graph_sf.p99,
                res.tflops_f * sf.p50 / res.graph_sf.p50, c.base_f, c.base_f / res.graph_sf.p50);
    std::printf("  %-18s %10.3f %10.3f %14.1f %12.3f %7.2fx\n", "graph fwd+bwd", res.graph_sfb.p50, res.graph_sfb.p99,
                res.tflops_fb * sfb.p50 / res.graph_sfb.p50, c.base_fb, c.base_fb / res.graph_sfb.p50);
  }
  std::printf("  host time in the layer's calls, each issued on an idle stream (ms, max-rank p50; with the layer's own waits "
              "on the device, if any): forward %.3f, forward+backward %.3f\n",
              rdep::Summarize(rdep::MaxOverRanks(res.host_fwd)).p50, rdep::Summarize(rdep::MaxOverRanks(res.host_fwdbwd)).p50);
  std::printf("  breakdown (ms, max-rank median)  routing  dispatch  expert  return  combine\n");
  std::printf("    forward                      %7.3f  %8.3f  %6.3f  %6.3f  %7.3f\n", bf.routing_ms, bf.dispatch_ms, bf.expert_ms, bf.return_ms, bf.combine_ms);
  std::printf("    backward (routing = dgate)   %7.3f  %8.3f  %6.3f  %6.3f  %7.3f\n", bb.routing_ms, bb.dispatch_ms, bb.expert_ms, bb.return_ms, bb.combine_ms);
  std::printf("  layer device memory per rank (max): %.3f GiB; with the caller's tensors (%s): %.3f GiB; baseline peak "
              "allocated: %.3f GiB\n",
              static_cast<double>(res.max_bytes) / (1 << 30),
              o.bf16_grads ? "bf16 weights and gradients, inputs, outputs and their gradients" : "inputs, outputs and their gradients",
              static_cast<double>(res.max_rank_bytes) / (1 << 30), c.base_mem);
  if (cfg.balance.enabled()) PrintBalance(cfg, res);
}

void WriteLayerReceipt(const LayerBenchOptions& o, const rdep::bench::LayerBenchSetup& setup, const LayerBenchResults& res,
                       const LayerBenchContext& c, const rdep::bench::StackResult* stack) {
  const auto& s = o.cfg.shape;
  const auto& tel = c.tel;
  const auto &bf = res.bf, &bb = res.bb;
  rdep::JsonWriter j;
  j.begin_object().field("tool", "rdep bench layer");
  rdep::bench::WriteEnvironment(j, static_cast<int>(s.ranks));
  j.key("workload").begin_object().field("ranks", s.ranks).field("placement", setup.domain->placement()).field("ranks_share_gpus", setup.domain->shares_gpus()).field("tokens", s.tokens).field("hidden", s.hidden);
  j.field("ffn", s.ffn).field("experts", s.experts).field("topk", s.topk).field("routing", o.spec.name());
  j.field("capacity_factor", o.cfg.capacity.capacity_factor).field("segment", setup.layer->layout().S).field("owner_reduce", o.cfg.owner_reduce).field("transport_sms", static_cast<int64_t>(o.cfg.transport_sms)).field("stash_rows", o.cfg.stash_rows).field("overlap_segments", o.cfg.overlap_segments).field("gate_in_expert", o.cfg.gate_in_expert).field("source_windows", o.cfg.source_windows).field("source_windows_applied", setup.layer->SourceWindows()).field("gate_up", rdep::mlp::GateUpName(o.cfg.gate_up)).field("seed", static_cast<int64_t>(o.seed));
  j.field("warmup", o.warmup).field("iters", o.iters).end_object();
  j.field("normalization", "max over ranks per iteration; useful FLOPs = 6*accepted_rows*H*D_ff (fwd), x3 (fwd+bwd), per GPU");
  j.field("accepted_rows", res.accepted_rows);
  j.key("routing_load").begin_object().field("expert_max_over_mean", tel.max_over_mean).field("expert_cv", tel.cv);
  j.field("active_experts", tel.active_experts).field("owner_max_over_mean", c.owner_max_over_mean);
  j.key("owner_rows").value(std::vector<double>(tel.owner_loads.begin(), tel.owner_loads.end())).end_object();
  rdep::bench::WriteSummary(j, "forward", res.f_max);
  rdep::bench::WriteSummary(j, "forward_backward", res.fb_max);
  rdep::bench::WriteSummary(j, "host_forward", rdep::MaxOverRanks(res.host_fwd));  // the host's time in the calls
  rdep::bench::WriteSummary(j, "host_forward_backward", rdep::MaxOverRanks(res.host_fwdbwd));
  j.field("expert_compute", rdep::ExpertComputeName(o.cfg.expert_compute)).field("weight_grads", o.bf16_grads ? "bf16" : "fp32");
  if (o.graph) {
    rdep::bench::WriteSummary(j, "graph_forward", rdep::MaxOverRanks(res.graph_fwd));
    rdep::bench::WriteSummary(j, "graph_forward_backward", rdep::MaxOverRanks(res.graph_fwdbwd));
  }
  j.field("forward_tflops_per_gpu", res.tflops_f).field("forward_backward_tflops_per_gpu", res.tflops_fb);
  j.key("breakdown_forward_ms").begin_object().field("routing", bf.routing_ms).field("dispatch", bf.dispatch_ms);
  j.field("expert", bf.expert_ms).field("return", bf.return_ms).field("combine", bf.combine_ms).end_object();
  j.key("breakdown_backward_ms").begin_object().field("dgate", bb.routing_ms).field("dispatch", bb.dispatch_ms);
  j.field("expert", bb.expert_ms).field("return", bb.return_ms).field("combine", bb.combine_ms).end_object();
  j.field("layer_device_bytes_max_rank", static_cast<int64_t>(res.max_bytes));
  j.field("rank_device_bytes_max", static_cast<int64_t>(res.max_rank_bytes));  // with the caller's tensors
  if (o.cfg.balance.enabled()) {
    const rdep::BalanceTelemetry& t = res.balance;
    j.key("balance").begin_object().field("balancer", rdep::BalanceKindName(o.cfg.balance.kind));
    j.field("slots_per_rank", static_cast<int64_t>(o.cfg.balance.num_slots)).field("min_quota", o.cfg.balance.min_quota);
    j.field("min_gain", o.cfg.balance.min_gain);
    j.field("owner_max_over_mean_before", t.imbalance_before).field("max_over_mean_after", t.imbalance_after);
    j.field("replicas", static_cast<int64_t>(t.replicas)).field("slots", static_cast<int64_t>(t.slots)).field("slot_limited", t.slot_limited);
    j.field("weight_bytes_streamed_per_forward", t.weight_bytes).field("plan_ms", res.bf.plan_ms);
    j.field("stream_forward_ms", res.bf.stream_ms).field("stream_backward_ms", res.bb.stream_ms).field("reduce_ms", res.bb.reduce_ms);
    j.end_object();
  }
  j.key("baseline").begin_object().field("receipt", o.baseline).field("fwd_p50_ms", c.base_f).field("fwdbwd_p50_ms", c.base_fb);
  j.field("peak_alloc_gib", c.base_mem).field("speedup_fwd", c.base_f / res.sf.p50).field("speedup_fwdbwd", c.base_fb / res.sfb.p50).end_object();
  if (stack) rdep::bench::WriteLayerStack(j, *stack);
  j.end_object();
  if (!rdep::bench::WriteFile(o.json, j.str())) std::cerr << "rdep bench layer: could not write " << o.json << "\n";
}

// --layers N: the stack pass on the bench's buffers (bench_layer_stack.h).
rdep::StatusOr<rdep::bench::StackResult> RunStack(const LayerBenchOptions& o, rdep::bench::LayerBenchSetup& setup,
                                                  const std::vector<RankBuffers>& bufs) {
  std::vector<rdep::bench::StackRankIo> io(bufs.size());
  for (size_t r = 0; r < bufs.size(); ++r)
    io[r] = {bufs[r].experts, bufs[r].gates, bufs[r].x, bufs[r].y, bufs[r].dy, bufs[r].dx, bufs[r].dgates,
             setup.routing[r].num_tokens};
  RDEP_RETURN_IF_ERROR(setup.layer->EnableProfiling(false));  // the stack's layers are timed alike
  return rdep::bench::RunLayerStack(*setup.domain, *setup.layer, o.cfg, setup.ownership, o.seed, o.layers,
                                    std::clamp<int64_t>(o.iters, 1, 10), io);
}

// --routing-out: one rank's tokens and topk (int64), experts (int32) and gates (fp32), as --help says.
Status WriteRouting(const std::string& path, const rdep::RankRouting& rr) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return rdep::InvalidArgument("--routing-out: cannot open '" + path + "' for writing");
  const int64_t head[2] = {rr.num_tokens, rr.topk};
  bool ok = std::fwrite(head, sizeof(head), 1, f) == 1;
  ok = ok && std::fwrite(rr.experts.data(), sizeof(int32_t), rr.experts.size(), f) == rr.experts.size();
  ok = ok && std::fwrite(rr.gates.data(), sizeof(float), rr.gates.size(), f) == rr.gates.size();
  ok = std::fclose(f) == 0 && ok;
  return ok ? Status::Ok() : rdep::InvalidArgument("--routing-out: writing '" + path + "' failed");
}

// ---- the command -----------------------------------------------------------------------------------

int RunLayerBench(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  LayerBenchOptions o;
  if (int rc = ParseLayerBenchOptions(args, o); rc != 0) return rc;
  auto setup = rdep::bench::SetupLayerBench(o.cfg, o.spec, o.seed, static_cast<int>(o.use_gpus), /*own_weights=*/!o.bf16_grads);
  if (!setup.ok()) return Fail(setup.status());
  const int64_t W = o.cfg.shape.ranks;
  for (int64_t r = 0; r < W && !o.routing_out.empty(); ++r) {
    const std::string path = W == 1 ? o.routing_out : o.routing_out + ".rank" + std::to_string(r);
    if (Status st = WriteRouting(path, setup->routing[static_cast<size_t>(r)]); !st.ok()) return Fail(st);
  }
  std::vector<RankBuffers> bufs(static_cast<size_t>(o.cfg.shape.ranks));
  LayerBenchResults res;
  if (Status st = RunLayerTimings(o, *setup, bufs, res); !st.ok()) return Fail(st);
  auto context = ReadLayerBenchContext(o, *setup);
  if (!context.ok()) return Fail(context.status());
  PrintLayerTable(o, *setup, res, *context);
  std::optional<rdep::bench::StackResult> stack;
  Status stack_status = Status::Ok();
  if (o.layers > 1) {
    auto got = RunStack(o, *setup, bufs);
    if (got.ok()) {
      stack = *got;
      rdep::bench::PrintLayerStack(*stack);
    } else {
      stack_status = got.status();
    }
  }
  if (!o.json.empty()) WriteLayerReceipt(o, *setup, res, *context, stack ? &*stack : nullptr);  // the one layer's results stand
  FreeRankBuffers(*setup->domain, bufs);
  return stack_status.ok() ? 0 : Fail(stack_status);
}

#else

int RunLayerBench(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  std::cerr << "rdep bench layer: this build has no CUDA backend\n";
  return 2;
}

#endif

const bool kRegistered = rdep::cli::RegisterBench({"layer", "the whole MoE layer, fwd and fwd+bwd, max-rank p50/p99", &RunLayerBench});

}  // namespace
