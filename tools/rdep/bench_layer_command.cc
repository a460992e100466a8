// `rdep bench layer`: the whole MoE layer on the CUDA backend, forward and forward+backward, W GPUs
// of this machine (one process). Measurement protocol of DESIGN.md: a device barrier aligns the ranks
// before each iteration; CUDA events on each rank's stream; per iteration the max over ranks;
// p50/p99 over --iters after --warmup; useful TFLOP/s count accepted rows only; a phase breakdown from
// extra profiled iterations; the baseline's receipt (torch EP, run in the same device call) gives
// the ratio. Example:
//   rdep bench layer --tokens 4096 --hidden 2048 --ffn 1408 --experts 64 --topk 6 --json layer.json
//                    --baseline-json torch.json
#include <iostream>

#include "cli.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <sstream>

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
the device memory the layer holds, and the ratio to a baseline receipt.

flags [defaults: the Moonlight shape]:
  --ranks W            ranks [all GPUs, at most 8]                --tokens T   tokens per rank [4096]
  --gpus N             ranks round-robin over N local GPUs [min(W, GPUs)]; N < W: ranks share GPUs
                       (the placement is printed; such timings do not measure NVLink)
  --hidden H [2048]    --ffn F [1408]            --experts E [64]    --topk K [6]
  --routing R          uniform | zipf:ALPHA [uniform]
  --capacity-factor C  0 = dropless [0]          --segment S  token rows per segment; 0 = W*T [0]
  --warmup N [20]      --iters N [200]           --seed N [1]
  --json FILE          write the receipt
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

int RunLayerBench(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  rdep::cli::Flags f(args);
  const int gpus = rdep::cuda::DeviceCount();
  rdep::LayerConfig cfg;
  auto& s = cfg.shape;
  s.ranks = f.get_int("ranks", std::min(gpus, 8));
  const int64_t use_gpus = f.get_int("gpus", std::min<int64_t>(s.ranks, gpus));
  s.tokens = f.get_int("tokens", 4096);
  s.hidden = f.get_int("hidden", 2048);
  s.ffn = f.get_int("ffn", 1408);
  s.experts = f.get_int("experts", 64);
  s.topk = f.get_int("topk", 6);
  const std::string routing_name = f.get_string("routing", "uniform");
  cfg.capacity.capacity_factor = f.get_double("capacity-factor", 0);
  cfg.segment_tokens = f.get_int("segment", 0);
  const int64_t warmup = f.get_int("warmup", 20), iters = f.get_int("iters", 200);
  const auto seed = static_cast<uint64_t>(f.get_int("seed", 1));
  const std::string json = f.get_string("json", ""), baseline = f.get_string("baseline-json", "");
  auto limits = rdep::cli::ReadLimits(f);
  if (Status st = f.Finish(); !st.ok()) {
    std::cerr << "rdep bench layer: " << st.message() << "\n";
    return 2;
  }
  if (!limits.ok()) {
    std::cerr << "rdep bench layer: " << limits.status().message() << "\n";
    return 2;
  }
  if (warmup > 1000000 || iters > 1000000) {
    std::cerr << "rdep bench layer: --warmup and --iters must be <= 1000000\n";
    return 2;
  }
  if (gpus == 0) {
    std::cerr << "rdep bench layer: no CUDA device is present\n";
    return 2;
  }
  if (warmup < 0 || iters < 1) {
    std::cerr << "rdep bench layer: --warmup must be >= 0 and --iters >= 1\n";
    return 2;
  }
  if (use_gpus < 1 || use_gpus > gpus) {
    std::cerr << "rdep bench layer: --gpus must be in [1, " << gpus << "] on this machine, got " << use_gpus << "\n";
    return 2;
  }
  auto spec = rdep::RoutingSpec::Parse(routing_name);
  if (!spec.ok()) return Fail(spec.status());
  spec->seed = seed;
  if (Status st = cfg.Validate(); !st.ok()) {
    std::cerr << "rdep bench layer: " << st.message() << "\n";
    return 2;
  }
  // Estimate before allocating; open the receipt before the work.
  if (Status st = rdep::bench::CheckLayerBenchFootprint(cfg, warmup + iters, static_cast<int>(use_gpus), *limits); !st.ok()) {
    std::cerr << "rdep bench layer: " << st.message() << "\n";
    return 2;
  }
  if (Status st = rdep::cli::CheckOutputPath("json", json); !st.ok()) {
    std::cerr << "rdep bench layer: " << st.message() << "\n";
    return 2;
  }
  auto setup = rdep::bench::SetupLayerBench(cfg, *spec, seed, static_cast<int>(use_gpus));
  if (!setup.ok()) return Fail(setup.status());
  const rdep::Routing& routing = setup->routing;
  const auto& x = setup->x;
  auto& domain = setup->domain;
  auto& layer = setup->layer;

  const auto W = static_cast<size_t>(s.ranks);
  const size_t nk = static_cast<size_t>(s.tokens * s.topk), nh = static_cast<size_t>(s.tokens * s.hidden);
  struct Bufs {
    int32_t* experts = nullptr;
    float *gates = nullptr, *dgates = nullptr;
    __nv_bfloat16 *x = nullptr, *y = nullptr, *dy = nullptr, *dx = nullptr;
    std::vector<cudaEvent_t> ev;
  };
  std::vector<Bufs> bufs(W);
  const int64_t total = warmup + iters;
  std::vector<std::vector<double>> fwd(W), fwdbwd(W);
  std::vector<rdep::PhaseTimes> phase_f(W), phase_b(W);
  std::vector<size_t> bytes(W);
  int64_t accepted_rows = 0;
  Status st = domain->Run([&](int32_t r) -> Status {
    Bufs& b = bufs[static_cast<size_t>(r)];
    const auto& rr = routing[static_cast<size_t>(r)];
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.experts, nk * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.gates, nk * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.dgates, nk * 4));
    for (auto** p : {&b.x, &b.y, &b.dy, &b.dx}) RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(p, nh * 2));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.experts, rr.experts.data(), rr.experts.size() * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.gates, rr.gates.data(), rr.gates.size() * 4, cudaMemcpyHostToDevice));
    std::vector<uint16_t> bits(nh);
    for (size_t i = 0; i < bits.size() && i < x[static_cast<size_t>(r)].size(); ++i) bits[i] = rdep::FloatToBf16Bits(x[static_cast<size_t>(r)][i]);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.x, bits.data(), nh * 2, cudaMemcpyHostToDevice));
    for (auto& v : bits) v = rdep::FloatToBf16Bits(0.01f);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.dy, bits.data(), nh * 2, cudaMemcpyHostToDevice));
    b.ev.resize(static_cast<size_t>(4 * total));
    for (auto& e : b.ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    cudaStream_t stream = domain->stream(r);
    const int64_t n = rr.num_tokens;
    for (int pass = 0; pass < 2; ++pass) {  // 0: forward only, 1: forward + backward
      for (int64_t i = 0; i < total; ++i) {
        RDEP_RETURN_IF_ERROR(domain->Barrier(r, rdep::Phase::kTest));  // ranks start together
        cudaEvent_t e0 = b.ev[static_cast<size_t>(4 * i + 2 * pass)], e1 = b.ev[static_cast<size_t>(4 * i + 2 * pass + 1)];
        RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(e0, stream));
        RDEP_RETURN_IF_ERROR(layer->Forward(r, b.experts, b.gates, n, b.x, b.y));
        if (pass == 1) RDEP_RETURN_IF_ERROR(layer->Backward(r, b.dy, b.dx, b.dgates));
        RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(e1, stream));
      }
      RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
      for (int64_t i = warmup; i < total; ++i) {
        float ms = 0;
        RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, b.ev[static_cast<size_t>(4 * i + 2 * pass)], b.ev[static_cast<size_t>(4 * i + 2 * pass + 1)]));
        (pass ? fwdbwd : fwd)[static_cast<size_t>(r)].push_back(ms);
      }
    }
    bytes[static_cast<size_t>(r)] = layer->device_bytes(r);
    return Status::Ok();
  });
  if (!st.ok()) return Fail(st);
  // Phase breakdown: a few profiled iterations after the timed ones (medians per rank, then max).
  if (Status pe = layer->EnableProfiling(true); !pe.ok()) return Fail(pe);
  std::vector<std::vector<rdep::PhaseTimes>> prof_f(W), prof_b(W);
  st = domain->Run([&](int32_t r) -> Status {
    Bufs& b = bufs[static_cast<size_t>(r)];
    for (int i = 0; i < 10; ++i) {
      RDEP_RETURN_IF_ERROR(domain->Barrier(r, rdep::Phase::kTest));
      RDEP_RETURN_IF_ERROR(layer->Forward(r, b.experts, b.gates, routing[static_cast<size_t>(r)].num_tokens, b.x, b.y));
      RDEP_RETURN_IF_ERROR(layer->Backward(r, b.dy, b.dx, b.dgates));
      RDEP_ASSIGN_OR_RETURN(auto pf, layer->LastPhaseTimes(r, false));
      RDEP_ASSIGN_OR_RETURN(auto pb, layer->LastPhaseTimes(r, true));
      prof_f[static_cast<size_t>(r)].push_back(pf);
      prof_b[static_cast<size_t>(r)].push_back(pb);
    }
    RDEP_ASSIGN_OR_RETURN(auto acc, layer->CopyAcceptance(r));
    int64_t a = 0;
    for (auto v : acc.accepted) a += v;
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    accepted_rows += a;
    return Status::Ok();
  });
  if (!st.ok()) return Fail(st);
  auto median_phase = [](std::vector<rdep::PhaseTimes> v) {
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
    return m;
  };
  rdep::PhaseTimes bf, bb;  // max over ranks of each phase's median
  for (size_t r = 0; r < W; ++r) {
    const auto pf = median_phase(prof_f[r]), pb = median_phase(prof_b[r]);
    for (auto [dst, src] : {std::pair{&bf, &pf}, std::pair{&bb, &pb}}) {
      dst->routing_ms = std::max(dst->routing_ms, src->routing_ms);
      dst->dispatch_ms = std::max(dst->dispatch_ms, src->dispatch_ms);
      dst->expert_ms = std::max(dst->expert_ms, src->expert_ms);
      dst->return_ms = std::max(dst->return_ms, src->return_ms);
      dst->combine_ms = std::max(dst->combine_ms, src->combine_ms);
    }
  }
  const auto f_max = rdep::MaxOverRanks(fwd), fb_max = rdep::MaxOverRanks(fwdbwd);
  const auto sf = rdep::Summarize(f_max), sfb = rdep::Summarize(fb_max);
  const double flops_fwd = 6.0 * static_cast<double>(accepted_rows) * static_cast<double>(s.hidden) * static_cast<double>(s.ffn);
  const double tflops_f = flops_fwd / static_cast<double>(W) / (sf.p50 * 1e-3) / 1e12;
  const double tflops_fb = 3 * flops_fwd / static_cast<double>(W) / (sfb.p50 * 1e-3) / 1e12;
  size_t max_bytes = 0;
  for (auto b : bytes) max_bytes = std::max(max_bytes, b);
  const double base_f = baseline.empty() ? NAN : rdep::bench::ReadJsonNumber(baseline, "fwd_p50_ms");
  const double base_fb = baseline.empty() ? NAN : rdep::bench::ReadJsonNumber(baseline, "fwdbwd_p50_ms");
  const double base_mem = baseline.empty() ? NAN : rdep::bench::ReadJsonNumber(baseline, "peak_alloc_gib");
  // The load this routing puts on the experts and their owners (what skew the times were taken under).
  auto tel = rdep::ComputeTelemetry(routing, setup->ownership);
  if (!tel.ok()) return Fail(tel.status());
  const double owner_mean = static_cast<double>(tel->total_rows) / static_cast<double>(W);
  const double owner_max = static_cast<double>(*std::max_element(tel->owner_loads.begin(), tel->owner_loads.end()));

  std::printf("rdep bench layer: %s, routing %s, capacity %s, S=%lld, warmup %lld, iters %lld\n",
              [&] { std::ostringstream os; os << s; return os.str(); }().c_str(), spec->name().c_str(),
              cfg.capacity.dropless() ? "dropless" : std::to_string(cfg.capacity.capacity_factor).c_str(),
              static_cast<long long>(layer->layout().S), static_cast<long long>(warmup), static_cast<long long>(iters));
  std::printf("  placement: %s\n", domain->placement().c_str());
  std::printf("  load: expert max/mean %.2f (CV %.1f%%, %lld of %lld experts active), owner max/mean %.2f\n",
              tel->max_over_mean, 100 * tel->cv, static_cast<long long>(tel->active_experts),
              static_cast<long long>(tel->num_experts), owner_mean > 0 ? owner_max / owner_mean : 0.0);
  std::printf("  %-18s %10s %10s %14s %12s %8s\n", "", "p50 ms", "p99 ms", "TFLOP/s/GPU", "baseline ms", "speedup");
  std::printf("  %-18s %10.3f %10.3f %14.1f %12.3f %7.2fx\n", "forward", sf.p50, sf.p99, tflops_f, base_f, base_f / sf.p50);
  std::printf("  %-18s %10.3f %10.3f %14.1f %12.3f %7.2fx\n", "forward+backward", sfb.p50, sfb.p99, tflops_fb, base_fb, base_fb / sfb.p50);
  std::printf("  breakdown (ms, max-rank median)  routing  dispatch  expert  return  combine\n");
  std::printf("    forward                      %7.3f  %8.3f  %6.3f  %6.3f  %7.3f\n", bf.routing_ms, bf.dispatch_ms, bf.expert_ms, bf.return_ms, bf.combine_ms);
  std::printf("    backward (routing = dgate)   %7.3f  %8.3f  %6.3f  %6.3f  %7.3f\n", bb.routing_ms, bb.dispatch_ms, bb.expert_ms, bb.return_ms, bb.combine_ms);
  std::printf("  layer device memory per rank (max): %.3f GiB; baseline peak allocated: %.3f GiB\n",
              static_cast<double>(max_bytes) / (1 << 30), base_mem);
  if (!json.empty()) {
    rdep::JsonWriter j;
    j.begin_object().field("tool", "rdep bench layer");
    rdep::bench::WriteEnvironment(j, static_cast<int>(s.ranks));
    j.key("workload").begin_object().field("ranks", s.ranks).field("placement", domain->placement()).field("ranks_share_gpus", domain->shares_gpus()).field("tokens", s.tokens).field("hidden", s.hidden);
    j.field("ffn", s.ffn).field("experts", s.experts).field("topk", s.topk).field("routing", spec->name());
    j.field("capacity_factor", cfg.capacity.capacity_factor).field("segment", layer->layout().S).field("seed", static_cast<int64_t>(seed));
    j.field("warmup", warmup).field("iters", iters).end_object();
    j.field("normalization", "max over ranks per iteration; useful FLOPs = 6*accepted_rows*H*D_ff (fwd), x3 (fwd+bwd), per GPU");
    j.field("accepted_rows", accepted_rows);
    j.key("routing_load").begin_object().field("expert_max_over_mean", tel->max_over_mean).field("expert_cv", tel->cv);
    j.field("active_experts", tel->active_experts).field("owner_max_over_mean", owner_mean > 0 ? owner_max / owner_mean : 0.0);
    j.key("owner_rows").value(std::vector<double>(tel->owner_loads.begin(), tel->owner_loads.end())).end_object();
    rdep::bench::WriteSummary(j, "forward", f_max);
    rdep::bench::WriteSummary(j, "forward_backward", fb_max);
    j.field("forward_tflops_per_gpu", tflops_f).field("forward_backward_tflops_per_gpu", tflops_fb);
    j.key("breakdown_forward_ms").begin_object().field("routing", bf.routing_ms).field("dispatch", bf.dispatch_ms);
    j.field("expert", bf.expert_ms).field("return", bf.return_ms).field("combine", bf.combine_ms).end_object();
    j.key("breakdown_backward_ms").begin_object().field("dgate", bb.routing_ms).field("dispatch", bb.dispatch_ms);
    j.field("expert", bb.expert_ms).field("return", bb.return_ms).field("combine", bb.combine_ms).end_object();
    j.field("layer_device_bytes_max_rank", static_cast<int64_t>(max_bytes));
    j.key("baseline").begin_object().field("receipt", baseline).field("fwd_p50_ms", base_f).field("fwdbwd_p50_ms", base_fb);
    j.field("peak_alloc_gib", base_mem).field("speedup_fwd", base_f / sf.p50).field("speedup_fwdbwd", base_fb / sfb.p50).end_object();
    j.end_object();
    if (!rdep::bench::WriteFile(json, j.str())) std::cerr << "rdep bench layer: could not write " << json << "\n";
  }
  for (size_t r = 0; r < W; ++r) {
    cudaSetDevice(domain->device(static_cast<int32_t>(r)));
    for (void* p : {static_cast<void*>(bufs[r].experts), static_cast<void*>(bufs[r].gates), static_cast<void*>(bufs[r].dgates),
                    static_cast<void*>(bufs[r].x), static_cast<void*>(bufs[r].y), static_cast<void*>(bufs[r].dy), static_cast<void*>(bufs[r].dx)})
      cudaFree(p);
    for (auto e : bufs[r].ev) cudaEventDestroy(e);
  }
  return 0;
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
