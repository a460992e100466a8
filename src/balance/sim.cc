// The balancer simulation: every planner on the same loads, seeds 001 Table 4's metrics.
#include "rdep/balance/sim.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <map>

#include "rdep/balance/eplb.h"
#include "rdep/balance/plan.h"
#include "rdep/balance/png.h"
#include "rdep/balance/quota_planner.h"
#include "rdep/core/stats.h"

namespace rdep {
namespace {

size_t Z(int64_t v) { return static_cast<size_t>(v); }

double NowUs() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs every planner on steps[1..] of one sequence and appends the records.
Status SimSequence(const LoadTrace& t, int32_t S, double alpha, const SimConfig& cfg, SimReport* rep) {
  RDEP_ASSIGN_OR_RETURN(OwnershipMap own, OwnershipMap::Contiguous(t.num_experts, t.num_ranks));
  const size_t E = Z(t.num_experts);
  for (size_t s = 1; s < t.steps.size(); ++s) {
    const auto& load = t.steps[s];
    int64_t total = 0;
    for (int64_t v : load) total += v;
    std::vector<double> hist(E, 0);
    const size_t from = s > Z(cfg.history) ? s - Z(cfg.history) : 0;
    for (size_t h = from; h < s; ++h)
      for (size_t r = 0; r < Z(t.num_ranks); ++r)
        for (size_t e = 0; e < E; ++e) hist[e] += static_cast<double>(t.steps[h][r * E + e]);
    QuotaConfig qc;
    qc.num_slots = S;
    qc.min_quota = std::max<int64_t>(
        1, static_cast<int64_t>(std::floor(cfg.umin_frac * static_cast<double>(total) / t.num_ranks)));
    qc.min_gain = cfg.min_gain;
    EplbConfig ec;
    ec.num_slots = S;
    ec.ranks_per_node = cfg.ranks_per_node;
    for (const std::string& name : rep->planners) {
      StatusOr<BalancePlan> plan = Status(StatusCode::kInternal, "unset");
      const double t0 = NowUs();
      if (name == "none") {
        plan = NoBalancePlan(load, own);
      } else if (name == "ultraep") {
        plan = SolveQuotaPlan(load, own, qc);
      } else if (name == "eplb") {
        ec.hierarchical = false;
        plan = EplbPlan(hist, load, own, ec);
      } else if (name == "eplb-hier") {
        ec.hierarchical = t.num_ranks % cfg.ranks_per_node == 0;
        plan = EplbPlan(hist, load, own, ec);
      } else if (name == "eplb++") {
        ec.hierarchical = false;
        plan = EplbExactPlan(load, own, ec);
      }
      const double t1 = NowUs();
      if (!plan.ok()) return plan.status();
      if (cfg.check) {
        const Status st = CheckPlan(*plan, load, own, name == "ultraep" ? qc.min_quota : 0);
        if (!st.ok()) return InternalError("sim: " + name + " produced an invalid plan: " + st.message());
      }
      const PlanMetrics m = ComputeMetrics(*plan);
      SimRecord r;
      r.planner = name;
      r.experts = t.num_experts;
      r.ranks = t.num_ranks;
      r.slots = S;
      r.alpha = alpha;
      r.step = static_cast<int32_t>(s);
      r.imbalance = m.imbalance;
      r.solve_us = t1 - t0;
      r.inflight = m.inflight_ratio;
      r.replicas = m.replicas;
      r.max_hosts = m.max_hosts;
      rep->records.push_back(r);
    }
  }
  return Status::Ok();
}

std::map<std::string, std::vector<const SimRecord*>> ByPlanner(const SimReport& rep) {
  std::map<std::string, std::vector<const SimRecord*>> by;
  for (const auto& r : rep.records) by[r.planner].push_back(&r);
  return by;
}

}  // namespace

std::vector<std::string> SimPlanners() { return {"none", "ultraep", "eplb", "eplb-hier", "eplb++"}; }

StatusOr<SimReport> RunSyntheticSim(const SimConfig& cfg) {
  if (cfg.steps < 2) return InvalidArgument("sim: need --steps >= 2 (the first step seeds EPLB's history)");
  if (cfg.history < 1) return InvalidArgument("sim: history must be >= 1");
  SimReport rep;
  rep.planners = SimPlanners();
  rep.source = "synthetic grid";
  uint64_t point = 0;
  for (int32_t E : cfg.experts)
    for (int32_t R : cfg.ranks)
      for (int32_t S : cfg.slots)
        for (double a : cfg.alphas) {
          if (E < 1 || R < 1) return InvalidArgument("sim: E and R must be >= 1");
          if (S < 0 || S > E) return InvalidArgument("sim: N_slot must be in [0, E]");
          SyntheticLoadSpec spec;
          spec.experts = E;
          spec.ranks = R;
          spec.tokens = cfg.tokens;
          spec.topk = std::min(cfg.topk, E);
          spec.alpha = a;
          spec.seed = cfg.seed * 1000003ull + point++;
          RDEP_ASSIGN_OR_RETURN(LoadTrace t, GenerateSyntheticLoads(spec, cfg.steps));
          RDEP_RETURN_IF_ERROR(SimSequence(t, S, a, cfg, &rep));
        }
  return rep;
}

StatusOr<SimReport> RunTraceSim(const LoadTrace& trace, int32_t num_slots, const SimConfig& cfg,
                                const std::string& source) {
  if (trace.steps.size() < 2) return InvalidArgument("sim: a trace needs at least 2 steps");
  if (num_slots < 0 || num_slots > trace.num_experts) return InvalidArgument("sim: N_slot must be in [0, E]");
  SimReport rep;
  rep.planners = SimPlanners();
  rep.source = source;
  RDEP_RETURN_IF_ERROR(SimSequence(trace, num_slots, std::nan(""), cfg, &rep));
  return rep;
}

namespace {
// One planner's per-record metrics as series (for the table and the JSON summary).
struct Series {
  std::vector<double> imbalance, solve_us, replicas, max_hosts, inflight;
};
Series Collect(const std::vector<const SimRecord*>& records) {
  Series s;
  for (const SimRecord* r : records) {
    s.imbalance.push_back(r->imbalance);
    s.solve_us.push_back(r->solve_us);
    s.replicas.push_back(r->replicas);
    s.max_hosts.push_back(r->max_hosts);
    s.inflight.push_back(r->inflight);
  }
  return s;
}
}  // namespace

void PrintSimTable(const SimReport& rep, std::ostream& os) {
  const auto by = ByPlanner(rep);
  os << "# " << rep.source << ": " << rep.records.size() / std::max<size_t>(rep.planners.size(), 1)
     << " load matrices per planner\n";
  os << std::left << std::setw(11) << "planner" << std::right << std::setw(10) << "imb.mean" << std::setw(9)
     << "imb.p50" << std::setw(9) << "imb.p99" << std::setw(9) << "imb.max" << std::setw(11) << "solve_us"
     << std::setw(10) << "slots" << std::setw(9) << "max|H|" << std::setw(10) << "inflight" << "\n";
  os << std::fixed;
  for (const auto& name : rep.planners) {
    auto it = by.find(name);
    if (it == by.end()) continue;
    const Series series = Collect(it->second);
    const auto &imb = series.imbalance, &us = series.solve_us, &sl = series.replicas, &mh = series.max_hosts,
               &inf = series.inflight;
    const Summary si = Summarize(imb);
    os << std::left << std::setw(11) << name << std::right << std::setprecision(4) << std::setw(10) << si.mean
       << std::setw(9) << si.p50 << std::setw(9) << si.p99 << std::setw(9) << si.max << std::setprecision(1)
       << std::setw(11) << Summarize(us).mean << std::setw(10) << Summarize(sl).mean << std::setw(9)
       << Summarize(mh).mean << std::setprecision(2) << std::setw(9) << 100 * Summarize(inf).mean << "%\n";
  }
  os.unsetf(std::ios::fixed);
}

Status WriteSimJson(const SimReport& rep, const std::string& path) {
  std::ofstream f(path);
  if (!f) return InvalidArgument("sim: cannot open '" + path + "' for writing");
  const auto by = ByPlanner(rep);
  f << "{\n  \"source\": \"" << rep.source << "\",\n  \"summary\": {\n";
  bool first = true;
  for (const auto& name : rep.planners) {
    auto it = by.find(name);
    if (it == by.end()) continue;
    const Series series = Collect(it->second);
    const auto &imb = series.imbalance, &us = series.solve_us, &sl = series.replicas, &mh = series.max_hosts,
               &inf = series.inflight;
    const Summary si = Summarize(imb), su = Summarize(us);
    f << (first ? "" : ",\n") << "    \"" << name << "\": {\"count\": " << si.count << ", \"imbalance_mean\": " << si.mean
      << ", \"imbalance_p50\": " << si.p50 << ", \"imbalance_p99\": " << si.p99 << ", \"imbalance_max\": " << si.max
      << ", \"solve_us_mean\": " << su.mean << ", \"solve_us_p50\": " << su.p50 << ", \"solve_us_p99\": " << su.p99
      << ", \"replicas_mean\": " << Summarize(sl).mean << ", \"max_hosts_mean\": " << Summarize(mh).mean
      << ", \"inflight_ratio_mean\": " << Summarize(inf).mean << "}";
    first = false;
  }
  f << "\n  },\n  \"records\": [\n";
  for (size_t i = 0; i < rep.records.size(); ++i) {
    const auto& r = rep.records[i];
    f << "    {\"planner\": \"" << r.planner << "\", \"experts\": " << r.experts << ", \"ranks\": " << r.ranks
      << ", \"slots\": " << r.slots << ", \"alpha\": ";
    if (std::isnan(r.alpha))
      f << "null";
    else
      f << r.alpha;
    f << ", \"step\": " << r.step << ", \"imbalance\": " << r.imbalance << ", \"solve_us\": " << r.solve_us
      << ", \"replicas\": " << r.replicas << ", \"max_hosts\": " << r.max_hosts << ", \"inflight_ratio\": "
      << r.inflight << "}" << (i + 1 < rep.records.size() ? ",\n" : "\n");
  }
  f << "  ]\n}\n";
  if (!f) return InvalidArgument("sim: write to '" + path + "' failed");
  return Status::Ok();
}

Status WriteSimPng(const SimReport& rep, const std::string& path) {
  const auto by = ByPlanner(rep);
  std::vector<std::string> names;
  std::vector<std::vector<double>> series;
  double none_mean = 0;
  for (const auto& name : rep.planners) {
    auto it = by.find(name);
    if (it == by.end()) continue;
    std::vector<double> v;
    for (const SimRecord* r : it->second) v.push_back(r->imbalance);
    if (name == "none") {  // off the scale of the balancers: quoted in the title instead
      none_mean = Summarize(v).mean;
      continue;
    }
    names.push_back(name);
    series.push_back(std::move(v));
  }
  char title[128];
  std::snprintf(title, sizeof(title), "imbalance max/mean rank load (no balancing: mean %.2f)", none_mean);
  return WriteBoxPlotPng(path, title, names, series);
}

}  // namespace rdep
