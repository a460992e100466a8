// `rdep plan`: the balancer's command. Subcommands:
//   rdep plan sim    [--experts 128,256 --ranks 32,64 --slots 1,2,4 --alpha 0.6,1.0,1.4 --steps 8 ...]
//                    [--trace FILE --slots 2] [--json FILE] [--png FILE]
//   rdep plan record --routing zipf:1.2 --experts 256 --ranks 64 --tokens 4096 --topk 8 --steps 8 --out FILE
//   rdep plan bench  --device host|gpu|both --experts 256 --ranks 64 --slots 2 [--json FILE]
//   rdep plan show   --experts 16 --ranks 4 --slots 1 --alpha 1.2     (prints one plan)
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
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

constexpr const char* kSimHelp = R"(usage: rdep plan sim [flags]

Runs every planner (none, ultraep, eplb, eplb-hier, eplb++) over a seeded synthetic grid of
(E, R, N_slot, alpha) or over a recorded load trace, and prints the UltraEP paper's Table 4 metrics
per planner (imbalance, solve time, redundant slots, max replica count, in-flight rows).

flags [defaults]:
  --experts E,E,...      experts per grid point [128,256]
  --ranks R,R,...        ranks [32,64]
  --slots N,N,...        redundant slots N_slot (0 <= N_slot <= E) [1,2,4]
  --alpha A,A,...        power-law exponents, finite and >= 0 [0.6,1.0,1.4]
  --steps N [8]          load matrices per grid point (>= 2; the first seeds EPLB's history)
  --tokens T [4096]      tokens per rank and step      --topk K [8]
  --umin-frac X [0.01]   u_min = max(1, floor(X * mean rank load)), X in [0, 1]
  --min-gain G [0]       UltraEP's gain gate: no replicas unless each takes G rows off the busiest rank
  --history N [4]        EPLB's window       --ranks-per-node N [8]       --seed N [1]
  --no-check             skip verifying every plan
  --trace FILE           use a recorded trace (rdep plan record) instead of the grid; one --slots value
  --json FILE            write the records; --png FILE  a box plot (both opened before the run)
  --max-memory-gib G     host memory limit [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]
  --max-gop N            work limit in 10^9 operations [$RDEP_MAX_GOP, else 2000]
  -h, --help             this page
)";

constexpr const char* kRecordHelp = R"(usage: rdep plan record --out FILE [flags]

Writes a load trace (rdep plan sim --trace) from --steps routings generated with seeds seed, seed+1, ...

flags [defaults]:
  --routing R            uniform | zipf:ALPHA | one-expert | sparse [zipf:1.2]
  --experts E [256]      --ranks R [64]      --tokens T [4096]      --topk K [8]
  --steps N [8]          --seed N [1]
  --out FILE             the trace to write (required; opened before the run)
  --max-memory-gib G     host memory limit [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]
  --max-gop N            work limit in 10^9 operations [$RDEP_MAX_GOP, else 2000]
  -h, --help             this page
)";

constexpr const char* kBenchHelp = R"(usage: rdep plan bench [flags]

Times the UltraEP quota planner on the host (one CPU thread) and on the GPU (one block), over
--matrices synthetic load matrices, and checks that the GPU plan equals the host plan bit for bit.

flags [defaults]:
  --device D             host | gpu | both [both]
  --experts E [256]      --ranks R [64]      --slots N [2]      --alpha A [1.0]
  --tokens T [4096]      --topk K [8]        --umin-frac X [0.01]
  --min-gain G [0]       the gain gate (no replicas unless each takes G rows off the busiest rank)
  --matrices N [8]       --warmup N [20]     --iters N [200]    --seed N [1]
  --json FILE            write the receipt (opened before the run)
  --max-memory-gib G     host memory limit [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]
  --max-gop N            work limit in 10^9 operations [$RDEP_MAX_GOP, else 2000]
  -h, --help             this page
)";

constexpr const char* kShowHelp = R"(usage: rdep plan show [flags]

Prints one UltraEP plan for a synthetic load matrix, beside no balancing.

flags [defaults]:
  --experts E [16]       --ranks R [4]       --slots N [1]      --alpha A [1.2]
  --tokens T [256]       --topk K [2]        --min-quota U [1]  --seed N [1]
  --min-gain G [0]       the gain gate: no replicas unless each takes G rows off the busiest rank
  --max-memory-gib G     host memory limit [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]
  -h, --help             this page
)";

void Usage(std::ostream& os) {
  os << "usage: rdep plan <sim|record|bench|show> [flags]\n\n"
        "The balancer's command: the UltraEP quota planner against EPLB (the UltraEP paper).\n"
        "  sim     run every planner over a seeded synthetic grid or a recorded load trace\n"
        "  record  write a load trace from generated routings\n"
        "  bench   planner solve time, host and GPU\n"
        "  show    print one UltraEP plan\n"
        "\n`rdep plan <subcommand> --help` (or `rdep help plan <subcommand>`) lists its flags.\n";
}

// An int flag that must lie in [lo, hi] (so a cast to int32 is safe); the error names the flag.
rdep::Status InRange(const char* flag, int64_t v, int64_t lo, int64_t hi) {
  if (v >= lo && v <= hi) return rdep::Status::Ok();
  return rdep::InvalidArgument(std::string("--") + flag + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                               "], got " + std::to_string(v));
}
constexpr int64_t kInt32Max = 2147483647;

// Host memory and work of the planners on R x E load matrices: `matrices` held at once, `solves`
// plans computed.
rdep::Footprint PlannerFootprint(double E, double R, double matrices, double solves) {
  rdep::Footprint fp;
  fp.host.push_back({"load matrices (R x E int64 each)", {{"ranks", R}, {"experts", E}}, 8 * matrices * R * E});
  fp.host.push_back({"planner state and plans (R x E)", {{"ranks", R}, {"experts", E}}, 256 * R * E});
  fp.work.push_back({"planner solves (about 200 operations per R x E entry)", {{"ranks", R}, {"experts", E}}, 200 * solves * R * E});
  return fp;
}

rdep::Status CheckOutputs(std::initializer_list<std::pair<const char*, const std::string*>> outs) {
  for (const auto& [flag, path] : outs) RDEP_RETURN_IF_ERROR(rdep::cli::CheckOutputPath(flag, *path));
  return rdep::Status::Ok();
}

// What `rdep plan sim` is asked for, checked.
struct SimOptions {
  rdep::SimConfig cfg;
  std::string trace, json, png;  // "" = synthetic grid / no receipt / no plot
  rdep::cli::Limits limits;
};

// Reads and checks the flags in the command's fixed order.
rdep::Status ParseSimOptions(const Args& args, SimOptions& o) {
  Flags f(args);
  rdep::SimConfig& cfg = o.cfg;
  auto experts = ParseList<int32_t>("experts", f.get_string("experts", "128,256"));
  auto ranks = ParseList<int32_t>("ranks", f.get_string("ranks", "32,64"));
  auto slots = ParseList<int32_t>("slots", f.get_string("slots", "1,2,4"));
  auto alphas = ParseList<double>("alpha", f.get_string("alpha", "0.6,1.0,1.4"));
  const int64_t steps = f.get_int("steps", cfg.steps);
  cfg.tokens = f.get_int("tokens", cfg.tokens);
  const int64_t topk = f.get_int("topk", cfg.topk);
  cfg.umin_frac = f.get_double("umin-frac", cfg.umin_frac);
  cfg.min_gain = f.get_int("min-gain", 0);
  const int64_t history = f.get_int("history", cfg.history);
  const int64_t ranks_per_node = f.get_int("ranks-per-node", cfg.ranks_per_node);
  cfg.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  cfg.check = !f.get_bool("no-check");
  o.trace = f.get_string("trace", "");
  o.json = f.get_string("json", "");
  o.png = f.get_string("png", "");
  auto limits = rdep::cli::ReadLimits(f);
  RDEP_RETURN_IF_ERROR(f.Finish());
  if (!f.positional().empty()) return rdep::InvalidArgument("sim: unexpected argument '" + f.positional().front() + "'");
  if (!limits.ok()) return limits.status();
  for (const auto* l : {&experts.status(), &ranks.status(), &slots.status(), &alphas.status()})
    if (!l->ok()) return *l;
  for (int32_t e : *experts)
    if (e < 1) return rdep::InvalidArgument("--experts: each value must be >= 1, got " + std::to_string(e));
  for (int32_t r : *ranks)
    if (r < 1) return rdep::InvalidArgument("--ranks: each value must be >= 1, got " + std::to_string(r));
  for (int32_t n : *slots)
    if (n < 0) return rdep::InvalidArgument("--slots: each value must be >= 0, got " + std::to_string(n));
  for (double a : *alphas)
    if (!(std::isfinite(a) && a >= 0)) {
      std::ostringstream os;
      os << "--alpha: each power-law exponent must be a finite number >= 0, got " << a;
      return rdep::InvalidArgument(os.str());
    }
  for (auto st : {InRange("steps", steps, 2, 1000000), InRange("topk", topk, 1, kInt32Max), InRange("history", history, 1, 1000000),
                  InRange("ranks-per-node", ranks_per_node, 1, kInt32Max), InRange("tokens", cfg.tokens, 0, int64_t{1} << 40)})
    RDEP_RETURN_IF_ERROR(st);
  if (!(cfg.umin_frac >= 0 && cfg.umin_frac <= 1)) return rdep::InvalidArgument("--umin-frac must be in [0, 1]");
  if (cfg.min_gain < 0) return rdep::InvalidArgument("--min-gain must be >= 0 (0 = off), got " + std::to_string(cfg.min_gain));
  cfg.steps = static_cast<int32_t>(steps);
  cfg.topk = static_cast<int32_t>(topk);
  cfg.history = static_cast<int32_t>(history);
  cfg.ranks_per_node = static_cast<int32_t>(ranks_per_node);
  cfg.experts = *experts;
  cfg.ranks = *ranks;
  cfg.slots = *slots;
  cfg.alphas = *alphas;
  o.limits = *limits;
  return rdep::Status::Ok();
}

// Estimate before allocating: the largest grid point's matrices, every point's solves (or the trace's,
// from its header, kept in `header`); then the outputs are opened.
rdep::Status CheckSimFootprint(const SimOptions& o, std::optional<rdep::LoadTraceHeader>& header) {
  const rdep::SimConfig& cfg = o.cfg;
  rdep::Footprint fp;
  if (!o.trace.empty()) {
    RDEP_ASSIGN_OR_RETURN(header, rdep::ReadLoadTraceHeader(o.trace));
    const auto E = static_cast<double>(header->num_experts), R = static_cast<double>(header->num_ranks),
               N = static_cast<double>(header->num_steps);
    fp = PlannerFootprint(E, R, N, 5 * N);
    for (auto* terms : {&fp.host, &fp.work})  // the sizes come from the trace's header, not from flags
      for (auto& term : *terms) term.factors = {{"trace ranks", R}, {"trace experts", E}};
    fp.host.front() = {"the trace's load matrices (its header: steps x ranks x experts int64)",
                       {{"trace steps", N}, {"trace ranks", R}, {"trace experts", E}}, header->bytes()};
  } else {
    const double E = *std::max_element(cfg.experts.begin(), cfg.experts.end());
    const double R = *std::max_element(cfg.ranks.begin(), cfg.ranks.end());
    const double points = static_cast<double>(cfg.experts.size() * cfg.ranks.size() * cfg.slots.size() * cfg.alphas.size());
    fp = PlannerFootprint(E, R, static_cast<double>(cfg.steps), 5 * points * cfg.steps);
    fp.host.push_back({"records (5 planners per step and grid point)", {{"steps", cfg.steps}}, 160 * points * cfg.steps});
  }
  if (auto st = rdep::cli::CheckFootprint(fp, o.limits); !st.ok()) {
    if (!o.trace.empty()) return rdep::InvalidArgument("--trace " + o.trace + ": " + st.message());
    return st;
  }
  return CheckOutputs({{"json", &o.json}, {"png", &o.png}});
}

// Every planner over the trace (one --slots value) or over the synthetic grid.
rdep::StatusOr<rdep::SimReport> RunSimulation(const SimOptions& o, const std::optional<rdep::LoadTraceHeader>& header) {
  if (o.trace.empty()) return rdep::RunSyntheticSim(o.cfg);
  if (o.cfg.slots.size() != 1) return rdep::InvalidArgument("--trace takes a single --slots value");
  RDEP_ASSIGN_OR_RETURN(auto t, rdep::ReadLoadTrace(o.trace, header->bytes()));
  return rdep::RunTraceSim(t, o.cfg.slots[0], o.cfg, o.trace);
}

// The table, its legend, then the receipt and the plot when asked for.
rdep::Status ReportSim(const SimOptions& o, const rdep::SimReport& rep) {
  rdep::PrintSimTable(rep, std::cout);
  std::cout << "imbalance = max/mean post-balance rank load; slots = sum_e(|H(e)|-1); max|H| = max_e |H(e)| "
               "(main included); inflight = rows not computed on their own rank; solve_us = host time\n";
  if (!o.json.empty()) {
    RDEP_RETURN_IF_ERROR(rdep::WriteSimJson(rep, o.json));
    std::cout << "wrote " << o.json << "\n";
  }
  if (!o.png.empty()) {
    RDEP_RETURN_IF_ERROR(rdep::WriteSimPng(rep, o.png));
    std::cout << "wrote " << o.png << "\n";
  }
  return rdep::Status::Ok();
}

int RunSim(const Args& args) {
  SimOptions o;
  if (auto st = ParseSimOptions(args, o); !st.ok()) return Fail(st);
  std::optional<rdep::LoadTraceHeader> header;
  if (auto st = CheckSimFootprint(o, header); !st.ok()) return Fail(st);
  auto rep = RunSimulation(o, header);
  if (!rep.ok()) return Fail(rep.status());
  if (auto st = ReportSim(o, *rep); !st.ok()) return Fail(st);
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
  const int64_t steps64 = f.get_int("steps", 8);
  const auto seed = static_cast<uint64_t>(f.get_int("seed", 1));
  const std::string out = f.get_string("out", "");
  auto limits = rdep::cli::ReadLimits(f);
  if (auto st = f.Finish(); !st.ok()) return Fail(st);
  if (!f.positional().empty()) return Fail(rdep::InvalidArgument("record: unexpected argument '" + f.positional().front() + "'"));
  if (!limits.ok()) return Fail(limits.status());
  if (out.empty()) return Fail(rdep::InvalidArgument("record: --out FILE is required"));
  if (auto st = InRange("steps", steps64, 1, 1000000); !st.ok()) return Fail(st);
  const auto steps = static_cast<int32_t>(steps64);
  if (auto st = shape.Validate(); !st.ok()) return Fail(st);
  if (auto st = InRange("experts", shape.experts, 1, kInt32Max); !st.ok()) return Fail(st);
  if (auto st = InRange("ranks", shape.ranks, 1, kInt32Max); !st.ok()) return Fail(st);
  auto spec = rdep::RoutingSpec::Parse(routing);
  if (!spec.ok()) return Fail(spec.status());
  spec->seed = seed;
  {  // Estimate before allocating: one step's routing and every step's load matrix.
    const auto W = static_cast<double>(shape.ranks), T = static_cast<double>(shape.tokens), K = static_cast<double>(shape.topk),
               E = static_cast<double>(shape.experts);
    rdep::Footprint fp = PlannerFootprint(E, W, steps, 0);
    fp.host.pop_back();
    fp.work.clear();
    fp.host.push_back({"one step's routing (W*T*K rows)", {{"ranks", W}, {"tokens", T}, {"topk", K}}, 16 * W * T * K});
    fp.host.push_back({"per-expert tables", {{"experts", E}}, 64 * E});
    fp.work.push_back({"routing draws (one per expert per token and step)", {{"steps", steps}, {"ranks", W}, {"tokens", T}, {"experts", E}},
                       30.0 * steps * W * T * E});
    if (auto st = rdep::cli::CheckFootprint(fp, *limits); !st.ok()) return Fail(st);
  }
  if (auto st = rdep::cli::CheckOutputPath("out", out); !st.ok()) return Fail(st);
  auto t = rdep::RecordRoutingLoads(shape, *spec, steps);
  if (!t.ok()) return Fail(t.status());
  if (auto st = rdep::WriteLoadTrace(*t, out); !st.ok()) return Fail(st);
  std::cout << "wrote " << out << ": " << steps << " steps of " << shape.ranks << "x" << shape.experts
            << " load matrices from routing " << spec->name() << "\n";
  return 0;
}

// What `rdep plan bench` is asked for, checked; qc.min_quota is set by SetupPlanBench.
struct PlanBenchOptions {
  std::string device;  // host | gpu | both
  int32_t E = 0, R = 0, topk = 0, matrices = 0, warmup = 0, iters = 0;
  double alpha = 0, umin_frac = 0;
  int64_t tokens = 0;
  uint64_t seed = 0;
  std::string json;
  rdep::QuotaConfig qc;
};

// Reads and checks the flags in the command's fixed order, then the estimate and the receipt's path.
rdep::Status ParsePlanBenchOptions(const Args& args, PlanBenchOptions& o) {
  Flags f(args);
  o.device = f.get_string("device", "both");
  const int64_t E64 = f.get_int("experts", 256), R64 = f.get_int("ranks", 64), slots64 = f.get_int("slots", 2);
  o.alpha = f.get_double("alpha", 1.0);
  o.tokens = f.get_int("tokens", 4096);
  const int64_t topk64 = f.get_int("topk", 8), matrices64 = f.get_int("matrices", 8), warmup64 = f.get_int("warmup", 20),
                iters64 = f.get_int("iters", 200);
  o.umin_frac = f.get_double("umin-frac", 0.01);
  o.qc.min_gain = f.get_int("min-gain", 0);
  o.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  o.json = f.get_string("json", "");
  auto limits = rdep::cli::ReadLimits(f);
  RDEP_RETURN_IF_ERROR(f.Finish());
  if (!f.positional().empty()) return rdep::InvalidArgument("bench: unexpected argument '" + f.positional().front() + "'");
  if (!limits.ok()) return limits.status();
  if (o.device != "host" && o.device != "gpu" && o.device != "both")
    return rdep::InvalidArgument("bench: --device must be host, gpu or both");
  for (auto st : {InRange("experts", E64, 1, kInt32Max), InRange("ranks", R64, 1, kInt32Max), InRange("slots", slots64, 0, E64),
                  InRange("topk", topk64, 1, kInt32Max), InRange("matrices", matrices64, 1, 1000000),
                  InRange("warmup", warmup64, 0, 1000000), InRange("iters", iters64, 1, 1000000),
                  InRange("tokens", o.tokens, 0, int64_t{1} << 40)})
    RDEP_RETURN_IF_ERROR(st);
  if (!(std::isfinite(o.alpha) && o.alpha >= 0)) return rdep::InvalidArgument("--alpha must be a finite number >= 0");
  if (!(o.umin_frac >= 0 && o.umin_frac <= 1)) return rdep::InvalidArgument("--umin-frac must be in [0, 1]");
  if (o.qc.min_gain < 0) return rdep::InvalidArgument("--min-gain must be >= 0 (0 = off), got " + std::to_string(o.qc.min_gain));
  o.E = static_cast<int32_t>(E64);
  o.R = static_cast<int32_t>(R64);
  o.topk = static_cast<int32_t>(topk64);
  o.matrices = static_cast<int32_t>(matrices64);
  o.warmup = static_cast<int32_t>(warmup64);
  o.iters = static_cast<int32_t>(iters64);
  o.qc.num_slots = static_cast<int32_t>(slots64);
  RDEP_RETURN_IF_ERROR(rdep::cli::CheckFootprint(
      PlannerFootprint(o.E, o.R, o.matrices, static_cast<double>(o.matrices) * (2.0 + o.iters + o.warmup / 4)), *limits));
  return rdep::cli::CheckOutputPath("json", o.json);
}

// The --matrices synthetic load matrices, the ownership, and u_min from the mean rank load.
rdep::Status SetupPlanBench(PlanBenchOptions& o, rdep::LoadTrace& trace, std::optional<rdep::OwnershipMap>& own) {
  rdep::SyntheticLoadSpec spec;
  spec.experts = o.E;
  spec.ranks = o.R;
  spec.alpha = o.alpha;
  spec.tokens = o.tokens;
  spec.topk = std::min(o.topk, o.E);
  spec.seed = o.seed;
  RDEP_ASSIGN_OR_RETURN(trace, rdep::GenerateSyntheticLoads(spec, o.matrices));
  RDEP_ASSIGN_OR_RETURN(own, rdep::OwnershipMap::Contiguous(o.E, o.R));
  const int64_t mean_rank = o.tokens * o.topk;  // every rank sends T*K rows, so the mean rank load is T*K
  o.qc.min_quota = std::max<int64_t>(1, static_cast<int64_t>(std::floor(o.umin_frac * static_cast<double>(mean_rank))));
  return o.qc.Validate(o.E);
}

// Raw solve times (every iteration of every matrix) and the GPU's agreement with the host.
struct PlanBenchResults {
  std::vector<double> host_us, imbalance;
  bool gpu_matches = true;
  std::string gpu_error;  // the first GPU failure; no GPU timing after it
  std::vector<double> gpu_us;
  std::string gpu_name;
};

// One matrix on the host: warmup/4 untimed solves, then `iters` solves timed one by one (steady_clock).
rdep::Status TimeHostSolves(const std::vector<int64_t>& load, const rdep::OwnershipMap& own, const PlanBenchOptions& o,
                            PlanBenchResults& res) {
  for (int32_t i = 0; i < o.warmup / 4; ++i) (void)rdep::SolveQuotaPlan(load, own, o.qc);
  for (int32_t i = 0; i < o.iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto p = rdep::SolveQuotaPlan(load, own, o.qc);
    const auto t1 = std::chrono::steady_clock::now();
    if (!p.ok()) return p.status();
    res.host_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return rdep::Status::Ok();
}

// One matrix on the GPU: the plan compared with the host's, then BenchQuotaPlanGpu's samples; a
// failure is recorded in res.gpu_error.
void TimeGpuSolves(const std::vector<int64_t>& load, const rdep::OwnershipMap& own, const PlanBenchOptions& o,
                   const rdep::BalancePlan& plan, PlanBenchResults& res) {
  auto g = rdep::SolveQuotaPlanGpu(load, own, o.qc);
  if (!g.ok()) {
    res.gpu_error = g.status().ToString();
    return;
  }
  res.gpu_matches = res.gpu_matches && g->route == plan.route && g->instance_rank == plan.instance_rank &&
                    g->instance_quota == plan.instance_quota && g->instance_slot == plan.instance_slot &&
                    g->instance_offsets == plan.instance_offsets && g->slot_expert == plan.slot_expert &&
                    g->threshold == plan.threshold;
  auto t = rdep::BenchQuotaPlanGpu(load, own, o.qc, o.warmup, o.iters);
  if (!t.ok()) {
    res.gpu_error = t.status().ToString();
    return;
  }
  res.gpu_us.insert(res.gpu_us.end(), t->samples_us.begin(), t->samples_us.end());
  res.gpu_name = t->device_name;
}

// Every matrix: the plan and its imbalance, the host timing (unless --device gpu), the GPU's (unless
// --device host, until the GPU fails).
rdep::Status RunPlanBenchTimings(const rdep::LoadTrace& trace, const rdep::OwnershipMap& own, const PlanBenchOptions& o,
                                 PlanBenchResults& res) {
  for (const auto& load : trace.steps) {
    auto plan = rdep::SolveQuotaPlan(load, own, o.qc);
    if (!plan.ok()) return plan.status();
    res.imbalance.push_back(rdep::ComputeMetrics(*plan).imbalance);
    if (o.device != "gpu") RDEP_RETURN_IF_ERROR(TimeHostSolves(load, own, o, res));
    if (o.device != "host" && res.gpu_error.empty()) TimeGpuSolves(load, own, o, *plan, res);
  }
  return rdep::Status::Ok();
}

void PrintPlanBench(const PlanBenchOptions& o, const PlanBenchResults& res) {
  std::cout << "UltraEP planner, E=" << o.E << " R=" << o.R << " N_slot=" << o.qc.num_slots << " u_min=" << o.qc.min_quota
            << (o.qc.min_gain > 0 ? " min_gain=" + std::to_string(o.qc.min_gain) : std::string()) << " alpha=" << o.alpha
            << ", " << o.matrices << " load matrices, mean imbalance "
            << rdep::Summarize(res.imbalance).mean << "\n";
  const rdep::Summary hs = rdep::Summarize(res.host_us), gs = rdep::Summarize(res.gpu_us);
  if (!res.host_us.empty())
    std::cout << "host solve (plan + reroute, 1 CPU thread): p50 " << hs.p50 << " us, p99 " << hs.p99 << " us over "
              << hs.count << " solves\n";
  if (!res.gpu_us.empty())
    std::cout << "gpu solve (" << res.gpu_name << ", CUDA events, kernel only): p50 " << gs.p50 << " us, p99 " << gs.p99
              << " us over " << gs.count << " solves; plan bitwise equal to host: " << (res.gpu_matches ? "yes" : "NO")
              << "\n";
}

rdep::Status WritePlanBenchReceipt(const PlanBenchOptions& o, const PlanBenchResults& res) {
  const rdep::Summary hs = rdep::Summarize(res.host_us), gs = rdep::Summarize(res.gpu_us);
  std::ofstream out(o.json);
  if (!out) return rdep::InvalidArgument("--json " + o.json + ": cannot open for writing: " + std::strerror(errno));
  out << "{\"rdep_commit\": \"" << rdep::cli::kBuildCommit << "\",\n \"workload\": {\"experts\": " << o.E << ", \"ranks\": " << o.R
      << ", \"slots\": " << o.qc.num_slots
      << ", \"alpha\": " << o.alpha << ", \"tokens\": " << o.tokens << ", \"topk\": " << o.topk
      << ", \"min_quota\": " << o.qc.min_quota << ", \"min_gain\": " << o.qc.min_gain << ", \"matrices\": " << o.matrices
      << ", \"warmup\": " << o.warmup
      << ", \"iters\": " << o.iters << "},\n \"imbalance_mean\": " << rdep::Summarize(res.imbalance).mean;
  if (!res.host_us.empty())
    out << ",\n \"host\": {\"p50_us\": " << hs.p50 << ", \"p99_us\": " << hs.p99 << ", \"mean_us\": " << hs.mean
        << ", \"count\": " << hs.count << "}";
  if (!res.gpu_us.empty())
    out << ",\n \"gpu\": {\"device\": \"" << res.gpu_name << "\", \"p50_us\": " << gs.p50 << ", \"p99_us\": " << gs.p99
        << ", \"mean_us\": " << gs.mean << ", \"count\": " << gs.count
        << ", \"matches_host\": " << (res.gpu_matches ? "true" : "false") << "}";
  if (!res.gpu_error.empty()) out << ",\n \"gpu_error\": \"" << res.gpu_error << "\"";
  out << "\n}\n";
  std::cout << "wrote " << o.json << "\n";
  return rdep::Status::Ok();
}

int RunBench(const Args& args) {
  PlanBenchOptions o;
  if (auto st = ParsePlanBenchOptions(args, o); !st.ok()) return Fail(st);
  rdep::LoadTrace trace;
  std::optional<rdep::OwnershipMap> own;
  if (auto st = SetupPlanBench(o, trace, own); !st.ok()) return Fail(st);
  PlanBenchResults res;
  if (auto st = RunPlanBenchTimings(trace, *own, o, res); !st.ok()) return Fail(st);
  PrintPlanBench(o, res);
  if (!o.json.empty())
    if (auto st = WritePlanBenchReceipt(o, res); !st.ok()) return Fail(st);
  if (!res.gpu_error.empty()) {
    std::cerr << "rdep plan bench: GPU planner unavailable: " << res.gpu_error << "\n";
    return 1;
  }
  if (!res.gpu_matches) {
    std::cerr << "rdep plan bench: GPU plan differs from the host plan\n";
    return 1;
  }
  return 0;
}

int RunShow(const Args& args) {
  Flags f(args);
  rdep::SyntheticLoadSpec spec;
  const int64_t E64 = f.get_int("experts", 16), R64 = f.get_int("ranks", 4), topk64 = f.get_int("topk", 2),
                slots64 = f.get_int("slots", 1);
  spec.alpha = f.get_double("alpha", 1.2);
  spec.tokens = f.get_int("tokens", 256);
  spec.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  rdep::QuotaConfig qc;
  qc.min_quota = f.get_int("min-quota", 1);
  qc.min_gain = f.get_int("min-gain", 0);
  auto limits = rdep::cli::ReadLimits(f);
  if (auto st = f.Finish(); !st.ok()) return Fail(st);
  if (!f.positional().empty()) return Fail(rdep::InvalidArgument("show: unexpected argument '" + f.positional().front() + "'"));
  if (!limits.ok()) return Fail(limits.status());
  for (auto st : {InRange("experts", E64, 1, kInt32Max), InRange("ranks", R64, 1, kInt32Max), InRange("topk", topk64, 1, E64),
                  InRange("slots", slots64, 0, E64), InRange("tokens", spec.tokens, 0, int64_t{1} << 40)})
    if (!st.ok()) return Fail(st);
  if (!(std::isfinite(spec.alpha) && spec.alpha >= 0)) return Fail(rdep::InvalidArgument("--alpha must be a finite number >= 0"));
  spec.experts = static_cast<int32_t>(E64);
  spec.ranks = static_cast<int32_t>(R64);
  spec.topk = static_cast<int32_t>(topk64);
  qc.num_slots = static_cast<int32_t>(slots64);
  if (auto st = rdep::cli::CheckFootprint(PlannerFootprint(spec.experts, spec.ranks, 1, 2), *limits); !st.ok()) return Fail(st);
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
  if (args.empty()) {
    Usage(std::cerr);
    return 2;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    // `rdep plan help sim` is `rdep plan sim --help`.
    if (args[0] == "help" && args.size() > 1) return RunPlan({args[1], "--help"});
    Usage(std::cout);
    return 0;
  }
  const Args rest(args.begin() + 1, args.end());
  const bool help = rdep::cli::WantsHelp(rest);
  if (args[0] == "sim") return help ? (std::cout << kSimHelp, 0) : RunSim(rest);
  if (args[0] == "record") return help ? (std::cout << kRecordHelp, 0) : RunRecord(rest);
  if (args[0] == "bench") return help ? (std::cout << kBenchHelp, 0) : RunBench(rest);
  if (args[0] == "show") return help ? (std::cout << kShowHelp, 0) : RunShow(rest);
  std::cerr << "rdep plan: unknown subcommand '" << args[0] << "'\n";
  Usage(std::cerr);
  return 2;
}

const bool kRegistered = rdep::cli::Register({"plan", "balancer: UltraEP quota planner vs EPLB (sim, record, bench, show)", &RunPlan});

}  // namespace
