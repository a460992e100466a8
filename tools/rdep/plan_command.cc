// `rdep plan`: the balancer's command. Subcommands:
//   rdep plan sim    [--experts 128,256 --ranks 32,64 --slots 1,2,4 --alpha 0.6,1.0,1.4 --steps 8 ...]
//                    [--trace FILE --slots 2] [--json FILE] [--png FILE]
//   rdep plan record --routing zipf:1.2 --experts 256 --ranks 64 --tokens 4096 --topk 8 --steps 8 --out FILE
//   rdep plan bench  --device host|gpu|both --experts 256 --ranks 64 --slots 2 [--json FILE]
//   rdep plan show   --experts 16 --ranks 4 --slots 1 --alpha 1.2     (prints one plan)
#include <chrono>
#include <cmath>
#include <fstream>
#include <algorithm>
#include <iostream>
#include <sstream>

#include "build_commit.h"
#include "cli.h"
#include "rdep/balance/eplb.h"
#include "rdep/balance/gpu_planner.h"
#include "rdep/balance/load_trace.h"
#include "rdep/balance/plan.h"
#include "rdep/balance/quota_planner.h"
#include "rdep/balance/sim.h"
#include "rdep/core/stats.h"

namespace {

using rdep::cli::Args;
using rdep::cli::Flags;

int Fail(const rdep::Status& s) {
  std::cerr << "rdep plan: " << s << "\n";
  return s.code() == rdep::StatusCode::kInvalidArgument ? 2 : 1;
}

using rdep::cli::ParseList;

void Usage() {
  std::cout << "usage: rdep plan <sim|record|bench|show> [flags]\n"
               "  sim     run every planner (none, ultraep, eplb, eplb-hier, eplb++) over a seeded synthetic grid\n"
               "          --experts 128,256 --ranks 32,64 --slots 1,2,4 --alpha 0.6,1.0,1.4 --steps 8 --tokens 4096\n"
               "          --topk 8 --umin-frac 0.01 --history 4 --ranks-per-node 8 --seed 1\n"
               "          or over a recorded trace: --trace FILE --slots 2; outputs: --json FILE --png FILE\n"
               "  record  write a load trace from generated routings: --routing zipf:1.2 --experts 256 --ranks 64\n"
               "          --tokens 4096 --topk 8 --steps 8 --seed 1 --out FILE\n"
               "  bench   planner solve time: --device host|gpu|both --experts 256 --ranks 64 --slots 2 --alpha 1.0\n"
               "          --tokens 4096 --topk 8 --matrices 8 --warmup 20 --iters 200 --umin-frac 0.01 --json FILE\n"
               "  show    print one UltraEP plan: --experts 16 --ranks 4 --slots 1 --alpha 1.2 --seed 1\n";
}

int RunSim(const Args& args) {
  Flags f(args);
  rdep::SimConfig cfg;
  auto experts = ParseList<int32_t>("experts", f.get_string("experts", "128,256"));
  auto ranks = ParseList<int32_t>("ranks", f.get_string("ranks", "32,64"));
  auto slots = ParseList<int32_t>("slots", f.get_string("slots", "1,2,4"));
  auto alphas = ParseList<double>("alpha", f.get_string("alpha", "0.6,1.0,1.4"));
  cfg.steps = static_cast<int32_t>(f.get_int("steps", cfg.steps));
  cfg.tokens = f.get_int("tokens", cfg.tokens);
  cfg.topk = static_cast<int32_t>(f.get_int("topk", cfg.topk));
  cfg.umin_frac = f.get_double("umin-frac", cfg.umin_frac);
  cfg.history = static_cast<int32_t>(f.get_int("history", cfg.history));
  cfg.ranks_per_node = static_cast<int32_t>(f.get_int("ranks-per-node", cfg.ranks_per_node));
  cfg.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  cfg.check = !f.get_bool("no-check");
  const std::string trace = f.get_string("trace", "");
  const std::string json = f.get_string("json", "");
  const std::string png = f.get_string("png", "");
  if (auto st = f.Finish(); !st.ok()) return Fail(st);
  for (const auto* l : {&experts.status(), &ranks.status(), &slots.status(), &alphas.status()})
    if (!l->ok()) return Fail(*l);
  cfg.experts = *experts;
  cfg.ranks = *ranks;
  cfg.slots = *slots;
  cfg.alphas = *alphas;
  rdep::StatusOr<rdep::SimReport> rep = rdep::Status(rdep::StatusCode::kInternal, "unset");
  if (!trace.empty()) {
    auto t = rdep::ReadLoadTrace(trace);
    if (!t.ok()) return Fail(t.status());
    if (cfg.slots.size() != 1) return Fail(rdep::InvalidArgument("--trace takes a single --slots value"));
    rep = rdep::RunTraceSim(*t, cfg.slots[0], cfg, trace);
  } else {
    rep = rdep::RunSyntheticSim(cfg);
  }
  if (!rep.ok()) return Fail(rep.status());
  rdep::PrintSimTable(*rep, std::cout);
  std::cout << "imbalance = max/mean post-balance rank load; slots = sum_e(|H(e)|-1); max|H| = max_e |H(e)| "
               "(main included); inflight = rows not computed on their own rank; solve_us = host time\n";
  if (!json.empty()) {
    if (auto st = rdep::WriteSimJson(*rep, json); !st.ok()) return Fail(st);
    std::cout << "wrote " << json << "\n";
  }
  if (!png.empty()) {
    if (auto st = rdep::WriteSimPng(*rep, png); !st.ok()) return Fail(st);
    std::cout << "wrote " << png << "\n";
  }
  return 0;
}

int RunRecord(const Args& args) {
  Flags f(args);
  rdep::LayerShape shape;
  shape.experts = f.get_int("experts", 256);
  shape.ranks = f.get_int("ranks", 64);
  shape.tokens = f.get_int("tokens", 4096);
  shape.topk = f.get_int("topk", 8);
  shape.hidden = 1;
  shape.ffn = 1;
  const std::string routing = f.get_string("routing", "zipf:1.2");
  const auto steps = static_cast<int32_t>(f.get_int("steps", 8));
  const auto seed = static_cast<uint64_t>(f.get_int("seed", 1));
  const std::string out = f.get_string("out", "");
  if (auto st = f.Finish(); !st.ok()) return Fail(st);
  if (out.empty()) return Fail(rdep::InvalidArgument("record: --out FILE is required"));
  auto spec = rdep::RoutingSpec::Parse(routing);
  if (!spec.ok()) return Fail(spec.status());
  spec->seed = seed;
  auto t = rdep::RecordRoutingLoads(shape, *spec, steps);
  if (!t.ok()) return Fail(t.status());
  if (auto st = rdep::WriteLoadTrace(*t, out); !st.ok()) return Fail(st);
  std::cout << "wrote " << out << ": " << steps << " steps of " << shape.ranks << "x" << shape.experts
            << " load matrices from routing " << spec->name() << "\n";
  return 0;
}

int RunBench(const Args& args) {
  Flags f(args);
  const std::string device = f.get_string("device", "both");
  const auto E = static_cast<int32_t>(f.get_int("experts", 256));
  const auto R = static_cast<int32_t>(f.get_int("ranks", 64));
  rdep::QuotaConfig qc;
  qc.num_slots = static_cast<int32_t>(f.get_int("slots", 2));
  const double alpha = f.get_double("alpha", 1.0);
  const int64_t tokens = f.get_int("tokens", 4096);
  const auto topk = static_cast<int32_t>(f.get_int("topk", 8));
  const auto matrices = static_cast<int32_t>(f.get_int("matrices", 8));
  const auto warmup = static_cast<int32_t>(f.get_int("warmup", 20));
  const auto iters = static_cast<int32_t>(f.get_int("iters", 200));
  const double umin_frac = f.get_double("umin-frac", 0.01);
  const auto seed = static_cast<uint64_t>(f.get_int("seed", 1));
  const std::string json = f.get_string("json", "");
  if (auto st = f.Finish(); !st.ok()) return Fail(st);
  if (device != "host" && device != "gpu" && device != "both")
    return Fail(rdep::InvalidArgument("bench: --device must be host, gpu or both"));
  if (matrices < 1 || iters < 1 || warmup < 0) return Fail(rdep::InvalidArgument("bench: need matrices, iters >= 1"));
  rdep::SyntheticLoadSpec spec;
  spec.experts = E;
  spec.ranks = R;
  spec.alpha = alpha;
  spec.tokens = tokens;
  spec.topk = std::min(topk, E);
  spec.seed = seed;
  auto trace = rdep::GenerateSyntheticLoads(spec, matrices);
  if (!trace.ok()) return Fail(trace.status());
  auto own = rdep::OwnershipMap::Contiguous(E, R);
  if (!own.ok()) return Fail(own.status());
  const int64_t mean_rank = tokens * topk;  // every rank sends T*K rows, so the mean rank load is T*K
  qc.min_quota = std::max<int64_t>(1, static_cast<int64_t>(std::floor(umin_frac * static_cast<double>(mean_rank))));
  if (auto st = qc.Validate(E); !st.ok()) return Fail(st);

  std::vector<double> host_us, imbalance;
  bool gpu_matches = true;
  std::string gpu_error;
  std::vector<double> gpu_us;
  std::string gpu_name;
  for (const auto& load : trace->steps) {
    auto plan = rdep::SolveQuotaPlan(load, *own, qc);
    if (!plan.ok()) return Fail(plan.status());
    imbalance.push_back(rdep::ComputeMetrics(*plan).imbalance);
    if (device != "gpu") {
      for (int32_t i = 0; i < warmup / 4; ++i) (void)rdep::SolveQuotaPlan(load, *own, qc);
      for (int32_t i = 0; i < iters; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        auto p = rdep::SolveQuotaPlan(load, *own, qc);
        const auto t1 = std::chrono::steady_clock::now();
        if (!p.ok()) return Fail(p.status());
        host_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
    }
    if (device != "host" && gpu_error.empty()) {
      auto g = rdep::SolveQuotaPlanGpu(load, *own, qc);
      if (!g.ok()) {
        gpu_error = g.status().ToString();
        continue;
      }
      gpu_matches = gpu_matches && g->route == plan->route && g->instance_rank == plan->instance_rank &&
                    g->instance_quota == plan->instance_quota && g->instance_slot == plan->instance_slot &&
                    g->instance_offsets == plan->instance_offsets && g->slot_expert == plan->slot_expert &&
                    g->threshold == plan->threshold;
      auto t = rdep::BenchQuotaPlanGpu(load, *own, qc, warmup, iters);
      if (!t.ok()) {
        gpu_error = t.status().ToString();
        continue;
      }
      gpu_us.insert(gpu_us.end(), t->samples_us.begin(), t->samples_us.end());
      gpu_name = t->device_name;
    }
  }
  std::cout << "UltraEP planner, E=" << E << " R=" << R << " N_slot=" << qc.num_slots << " u_min=" << qc.min_quota
            << " alpha=" << alpha << ", " << matrices << " load matrices, mean imbalance "
            << rdep::Summarize(imbalance).mean << "\n";
  const rdep::Summary hs = rdep::Summarize(host_us), gs = rdep::Summarize(gpu_us);
  if (!host_us.empty())
    std::cout << "host solve (plan + reroute, 1 CPU thread): p50 " << hs.p50 << " us, p99 " << hs.p99 << " us over "
              << hs.count << " solves\n";
  if (!gpu_us.empty())
    std::cout << "gpu solve (" << gpu_name << ", CUDA events, kernel only): p50 " << gs.p50 << " us, p99 " << gs.p99
              << " us over " << gs.count << " solves; plan bitwise equal to host: " << (gpu_matches ? "yes" : "NO")
              << "\n";
  if (!json.empty()) {
    std::ofstream o(json);
    if (!o) return Fail(rdep::InvalidArgument("bench: cannot open '" + json + "'"));
    o << "{\"rdep_commit\": \"" << rdep::cli::kBuildCommit << "\",\n \"workload\": {\"experts\": " << E << ", \"ranks\": " << R
      << ", \"slots\": " << qc.num_slots
      << ", \"alpha\": " << alpha << ", \"tokens\": " << tokens << ", \"topk\": " << topk
      << ", \"min_quota\": " << qc.min_quota << ", \"matrices\": " << matrices << ", \"warmup\": " << warmup
      << ", \"iters\": " << iters << "},\n \"imbalance_mean\": " << rdep::Summarize(imbalance).mean;
    if (!host_us.empty())
      o << ",\n \"host\": {\"p50_us\": " << hs.p50 << ", \"p99_us\": " << hs.p99 << ", \"mean_us\": " << hs.mean
        << ", \"count\": " << hs.count << "}";
    if (!gpu_us.empty())
      o << ",\n \"gpu\": {\"device\": \"" << gpu_name << "\", \"p50_us\": " << gs.p50 << ", \"p99_us\": " << gs.p99
        << ", \"mean_us\": " << gs.mean << ", \"count\": " << gs.count
        << ", \"matches_host\": " << (gpu_matches ? "true" : "false") << "}";
    if (!gpu_error.empty()) o << ",\n \"gpu_error\": \"" << gpu_error << "\"";
    o << "\n}\n";
    std::cout << "wrote " << json << "\n";
  }
  if (!gpu_error.empty()) {
    std::cerr << "rdep plan bench: GPU planner unavailable: " << gpu_error << "\n";
    return 1;
  }
  if (!gpu_matches) {
    std::cerr << "rdep plan bench: GPU plan differs from the host plan\n";
    return 1;
  }
  return 0;
}

int RunShow(const Args& args) {
  Flags f(args);
  rdep::SyntheticLoadSpec spec;
  spec.experts = static_cast<int32_t>(f.get_int("experts", 16));
  spec.ranks = static_cast<int32_t>(f.get_int("ranks", 4));
  spec.alpha = f.get_double("alpha", 1.2);
  spec.tokens = f.get_int("tokens", 256);
  spec.topk = static_cast<int32_t>(f.get_int("topk", 2));
  spec.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  rdep::QuotaConfig qc;
  qc.num_slots = static_cast<int32_t>(f.get_int("slots", 1));
  qc.min_quota = f.get_int("min-quota", 1);
  if (auto st = f.Finish(); !st.ok()) return Fail(st);
  auto t = rdep::GenerateSyntheticLoads(spec, 1);
  if (!t.ok()) return Fail(t.status());
  auto own = rdep::OwnershipMap::Contiguous(spec.experts, spec.ranks);
  if (!own.ok()) return Fail(own.status());
  auto none = rdep::NoBalancePlan(t->steps[0], *own);
  auto plan = rdep::SolveQuotaPlan(t->steps[0], *own, qc);
  if (!plan.ok()) return Fail(plan.status());
  std::cout << qc << "\nno balancing: " << rdep::ComputeMetrics(*none) << "\nultraep:      "
            << rdep::ComputeMetrics(*plan) << "\n"
            << *plan;
  return 0;
}

int RunPlan(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "help") {
    Usage();
    return args.empty() ? 2 : 0;
  }
  const Args rest(args.begin() + 1, args.end());
  if (std::find(rest.begin(), rest.end(), "--help") != rest.end()) {  // the usage lists every subcommand's flags
    Usage();
    return 0;
  }
  if (args[0] == "sim") return RunSim(rest);
  if (args[0] == "record") return RunRecord(rest);
  if (args[0] == "bench") return RunBench(rest);
  if (args[0] == "show") return RunShow(rest);
  std::cerr << "rdep plan: unknown subcommand '" << args[0] << "'\n";
  Usage();
  return 2;
}

const bool kRegistered = rdep::cli::Register({"plan", "balancer: UltraEP quota planner vs EPLB (sim, record, bench, show)", &RunPlan});

}  // namespace
