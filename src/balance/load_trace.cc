// Load traces: synthetic power-law loads, recording from routings, and the text file format.
#include "rdep/balance/load_trace.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <sstream>

#include "rdep/core/random.h"

namespace rdep {
namespace {

size_t Z(int64_t v) { return static_cast<size_t>(v); }

// Caps probabilities at `cap` and renormalizes the rest (water filling). Sum stays 1.
void CapProbabilities(std::vector<double>& p, double cap) {
  for (int it = 0; it < 64; ++it) {
    double capped = 0, free_mass = 0;
    int over = 0;
    for (double v : p) {
      if (v >= cap) {
        capped += cap;
        over += (v > cap);
      } else {
        free_mass += v;
      }
    }
    if (over == 0 || free_mass <= 0) break;
    const double scale = (1.0 - capped) / free_mass;
    for (double& v : p) v = v >= cap ? cap : v * scale;
  }
}

// Integer counts summing to `total` in proportion to p (floor plus largest remainder, ties low index).
void Apportion(const std::vector<double>& p, int64_t total, int64_t* out) {
  const size_t n = p.size();
  std::vector<double> rem(n);
  int64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = p[i] * static_cast<double>(total);
    out[i] = static_cast<int64_t>(std::floor(x));
    rem[i] = x - static_cast<double>(out[i]);
    sum += out[i];
  }
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return rem[a] > rem[b]; });
  for (size_t k = 0; sum < total && n > 0; k = (k + 1) % n, ++sum) out[idx[k]]++;
}

}  // namespace

Status WriteLoadTrace(const LoadTrace& t, const std::string& path) {
  std::ofstream f(path);
  if (!f) return InvalidArgument("load trace: cannot open '" + path + "' for writing");
  f << "rdep-load-trace v1 experts=" << t.num_experts << " ranks=" << t.num_ranks << " steps=" << t.steps.size()
    << "\n";
  for (size_t s = 0; s < t.steps.size(); ++s) {
    if (t.steps[s].size() != Z(t.num_ranks) * Z(t.num_experts))
      return InvalidArgument("load trace: step " + std::to_string(s) + " has the wrong size");
    f << "step " << s << "\n";
    for (int32_t r = 0; r < t.num_ranks; ++r) {
      for (int32_t e = 0; e < t.num_experts; ++e)
        f << (e ? "," : "") << t.steps[s][Z(r) * Z(t.num_experts) + Z(e)];
      f << "\n";
    }
  }
  if (!f) return InvalidArgument("load trace: write to '" + path + "' failed");
  return Status::Ok();
}

namespace {

// Reads lines up to and including the header; `ln` is the header's line number.
StatusOr<LoadTraceHeader> ReadHeader(std::istream& f, const std::string& path, int64_t& ln) {
  auto bad = [&](const std::string& m) { return InvalidArgument("load trace " + path + ":" + std::to_string(ln) + ": " + m); };
  std::string line;
  LoadTraceHeader h;
  long long steps = -1, experts = 0, ranks = 0;
  while (std::getline(f, line)) {
    ++ln;
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind("rdep-load-trace v1", 0) != 0) return bad("expected header 'rdep-load-trace v1 ...'");
    if (std::sscanf(line.c_str(), "rdep-load-trace v1 experts=%lld ranks=%lld steps=%lld", &experts, &ranks, &steps) != 3)
      return bad("malformed header");
    break;
  }
  if (steps < 0) return InvalidArgument("load trace " + path + ": missing header");
  const long long kMax = std::numeric_limits<int32_t>::max();
  if (experts < 1 || ranks < 1) return bad("experts and ranks must be >= 1");
  if (experts > kMax || ranks > kMax) return bad("experts and ranks must fit in int32");
  h.num_experts = static_cast<int32_t>(experts);
  h.num_ranks = static_cast<int32_t>(ranks);
  h.num_steps = steps;
  return h;
}

}  // namespace

StatusOr<LoadTraceHeader> ReadLoadTraceHeader(const std::string& path) {
  std::ifstream f(path);
  if (!f) return InvalidArgument("load trace: cannot open '" + path + "'");
  int64_t ln = 0;
  return ReadHeader(f, path, ln);
}

StatusOr<LoadTrace> ReadLoadTrace(const std::string& path, double max_bytes) {
  std::ifstream f(path);
  if (!f) return InvalidArgument("load trace: cannot open '" + path + "'");
  auto bad = [&](int64_t line, const std::string& m) {
    return InvalidArgument("load trace " + path + ":" + std::to_string(line) + ": " + m);
  };
  std::string line;
  int64_t ln = 0;
  RDEP_ASSIGN_OR_RETURN(LoadTraceHeader h, ReadHeader(f, path, ln));
  if (!(h.bytes() <= max_bytes)) {
    std::ostringstream os;
    os << "header says " << h.num_steps << " steps of " << h.num_ranks << " x " << h.num_experts << " loads: "
       << h.bytes() << " bytes, more than the limit of " << max_bytes;
    return bad(ln, os.str());
  }
  LoadTrace t;
  t.num_experts = h.num_experts;
  t.num_ranks = h.num_ranks;
  const int64_t steps = h.num_steps;
  std::vector<int64_t>* cur = nullptr;
  int32_t rows = 0;
  while (std::getline(f, line)) {
    ++ln;
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind("step", 0) == 0) {
      if (cur && rows != t.num_ranks) return bad(ln, "previous step has " + std::to_string(rows) + " rows");
      if (static_cast<int64_t>(t.steps.size()) >= steps)
        return bad(ln, "more steps than the header's " + std::to_string(steps));
      t.steps.emplace_back(Z(t.num_ranks) * Z(t.num_experts), 0);
      cur = &t.steps.back();
      rows = 0;
      continue;
    }
    if (!cur) return bad(ln, "data before the first 'step' line");
    if (rows >= t.num_ranks) return bad(ln, "more than R rows in a step");
    std::stringstream ss(line);
    std::string cell;
    int32_t e = 0;
    while (std::getline(ss, cell, ',')) {
      if (e >= t.num_experts) return bad(ln, "more than E entries");
      char* end = nullptr;
      const long long v = std::strtoll(cell.c_str(), &end, 10);
      if (end == cell.c_str() || v < 0) return bad(ln, "entry '" + cell + "' is not a non-negative integer");
      (*cur)[Z(rows) * Z(t.num_experts) + Z(e)] = v;
      ++e;
    }
    if (e != t.num_experts) return bad(ln, "expected " + std::to_string(t.num_experts) + " entries");
    ++rows;
  }
  if (cur && rows != t.num_ranks) return bad(ln, "last step has " + std::to_string(rows) + " rows");
  if (static_cast<int64_t>(t.steps.size()) != steps)
    return InvalidArgument("load trace " + path + ": header says " + std::to_string(steps) + " steps, found " +
                           std::to_string(t.steps.size()));
  return t;
}

StatusOr<LoadTrace> GenerateSyntheticLoads(const SyntheticLoadSpec& s, int32_t num_steps) {
  if (s.experts < 1 || s.ranks < 1) return InvalidArgument("synthetic loads: need E >= 1 and R >= 1");
  if (s.topk < 1 || s.topk > s.experts) return InvalidArgument("synthetic loads: need 1 <= K <= E");
  if (s.tokens < 0 || num_steps < 1) return InvalidArgument("synthetic loads: need tokens >= 0 and steps >= 1");
  Rng rng(s.seed, 0x10AD);
  const size_t E = Z(s.experts);
  std::vector<int32_t> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = E; i > 1; --i) std::swap(perm[i - 1], perm[Z(static_cast<int64_t>(rng.below(i)))]);
  LoadTrace t;
  t.num_experts = s.experts;
  t.num_ranks = s.ranks;
  const double cap = 1.0 / s.topk;
  std::vector<double> p(E), pr(E);
  for (int32_t step = 0; step < num_steps; ++step) {
    for (int32_t k = 0; k < s.swaps_per_step; ++k)
      std::swap(perm[Z(static_cast<int64_t>(rng.below(E)))], perm[Z(static_cast<int64_t>(rng.below(E)))]);
    double sum = 0;
    for (size_t e = 0; e < E; ++e) {
      p[e] = std::pow(static_cast<double>(perm[e]) + 1.0, -s.alpha) * std::exp(s.sigma * rng.normal());
      sum += p[e];
    }
    for (double& v : p) v /= sum;
    std::vector<int64_t> m(Z(s.ranks) * E);
    for (int32_t r = 0; r < s.ranks; ++r) {
      double rs = 0;
      for (size_t e = 0; e < E; ++e) {
        pr[e] = p[e] * std::exp(s.rank_sigma * rng.normal());
        rs += pr[e];
      }
      for (double& v : pr) v /= rs;
      CapProbabilities(pr, cap);
      Apportion(pr, s.tokens * s.topk, &m[Z(r) * E]);
    }
    t.steps.push_back(std::move(m));
  }
  return t;
}

StatusOr<LoadTrace> RecordRoutingLoads(const LayerShape& shape, const RoutingSpec& spec, int32_t num_steps) {
  RDEP_RETURN_IF_ERROR(shape.Validate());
  if (num_steps < 1) return InvalidArgument("record: steps must be >= 1");
  LoadTrace t;
  t.num_experts = static_cast<int32_t>(shape.experts);
  t.num_ranks = static_cast<int32_t>(shape.ranks);
  for (int32_t s = 0; s < num_steps; ++s) {
    RoutingSpec sp = spec;
    sp.seed = spec.seed + static_cast<uint64_t>(s);
    RDEP_ASSIGN_OR_RETURN(Routing routing, GenerateRouting(shape, sp));
    t.steps.push_back(LoadMatrix(routing, shape.experts));
  }
  return t;
}

}  // namespace rdep
