// `rdep route`: route-health telemetry (the RDEP paper, Table 17) of a seeded routing, either a synthetic
// family (--routing uniform|zipf:A|one-expert|sparse) or the reference router run on seeded logits
// (--routing router). Try: rdep route --routing zipf:1.2   or   rdep route --routing router --node-cap 2
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "cli.h"
#include "rdep/core/ownership.h"
#include "rdep/core/random.h"
#include "rdep/core/routing.h"
#include "rdep/router/router.h"
#include "rdep/router/telemetry.h"

namespace {

constexpr const char* kHelp = R"(usage: rdep route [flags]

Route-health telemetry (the RDEP paper, Table 17) of a seeded routing: per-expert loads, CV, p10 rows
per expert, active experts, load entropy, owner loads and the worst grouped-launch inflation rho (the
RDEP paper, eq. 31). With --routing router the reference router runs on standard-normal logits (minus
skew*e/E for expert e) and the mean score entropy and distinct nodes per token are printed too.

flags [defaults]:
  --routing R          uniform | zipf:ALPHA | one-expert | sparse | router [uniform]
  --tokens T [4096]    --experts E [64]    --topk K [6]    --ranks W [8]    --seed N [1]
router only:
  --score S            softmax | sigmoid [softmax]
  --skew X             logit skew across experts, a finite number [0]
  --groups G [1]       --topk-groups G [1]
  --node-cap M         at most M nodes per token; 0 = no cap [0]    --ranks-per-node N [2]
  --no-normalize       do not renormalize the top-k scores          --scale X  scaling factor [1]
limits (refused before allocating, exit 2):
  --max-memory-gib G   host memory [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]
  --max-gop N          work in 10^9 operations [$RDEP_MAX_GOP, else 2000]
  -h, --help           this page
)";

int Fail(const std::string& msg) {
  std::cerr << "rdep route: " << msg << "\n";
  return 2;
}

int RunRoute(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  rdep::cli::Flags f(args);
  const std::string family = f.get_string("routing", "uniform");
  const int64_t t = f.get_int("tokens", 4096), e = f.get_int("experts", 64), k = f.get_int("topk", 6),
                w = f.get_int("ranks", 8);
  const auto seed = static_cast<uint64_t>(f.get_int("seed", 1));
  const std::string score = f.get_string("score", "softmax");
  const double skew = f.get_double("skew", 0.0), scale = f.get_double("scale", 1.0);
  const int64_t groups = f.get_int("groups", 1), topk_groups = f.get_int("topk-groups", 1);
  const int64_t node_cap = f.get_int("node-cap", 0), ranks_per_node = f.get_int("ranks-per-node", 2);
  const bool no_normalize = f.get_bool("no-normalize");
  auto limits = rdep::cli::ReadLimits(f);
  if (auto s = f.Finish(); !s.ok()) return Fail(s.message());
  if (!limits.ok()) return Fail(limits.status().message());
  if (!std::isfinite(skew)) return Fail("--skew must be a finite number, got " + f.get_string("skew", ""));
  if (!std::isfinite(scale) || !(scale > 0)) return Fail("--scale must be a finite number > 0, got " + f.get_string("scale", ""));
  if (!f.positional().empty()) return Fail("unexpected argument '" + f.positional().front() + "'");
  rdep::LayerShape shape{t, 1, 1, e, k, w};
  if (auto s = shape.Validate(); !s.ok()) return Fail("--tokens/--experts/--topk/--ranks: " + s.message());
  {  // Estimate before allocating: one rank's logits and scores, the routing, per-expert tables.
    const auto T = static_cast<double>(t), E = static_cast<double>(e), K = static_cast<double>(k), W = static_cast<double>(w);
    rdep::Footprint fp;
    if (family == "router") fp.host.push_back({"router logits and scores of one rank (T*E)", {{"tokens", T}, {"experts", E}}, 40 * T * E});
    fp.host.push_back({"routing (W*T*K rows)", {{"ranks", W}, {"tokens", T}, {"topk", K}}, 16 * W * T * K});
    fp.host.push_back({"per-expert and per-rank tables", {{"experts", E}, {"ranks", W}}, 96 * E + 64 * W});
    fp.work.push_back({"routing (one draw per expert per token)", {{"ranks", W}, {"tokens", T}, {"experts", E}}, 30 * W * T * E});
    if (auto s = rdep::cli::CheckFootprint(fp, *limits); !s.ok()) return Fail(s.message());
  }
  auto own = rdep::OwnershipMap::Contiguous(e, w);
  if (!own.ok()) return Fail(own.status().message());

  rdep::Routing routing;
  double score_entropy = -1, distinct_nodes = -1;
  if (family == "router") {
    rdep::RouterConfig c;
    c.num_experts = e;
    c.topk = k;
    if (score != "softmax" && score != "sigmoid") return Fail("--score must be softmax or sigmoid, got '" + score + "'");
    c.score_function = score == "softmax" ? rdep::ScoreFunction::kSoftmax : rdep::ScoreFunction::kSigmoid;
    c.normalize_topk = !no_normalize;
    c.scaling_factor = scale;
    c.num_groups = groups;
    c.topk_groups = topk_groups;
    c.max_nodes = node_cap;
    if (node_cap > 0) {
      auto nodes = rdep::ExpertNodeMap(*own, ranks_per_node);
      if (!nodes.ok()) return Fail("--ranks-per-node: " + nodes.status().message());
      c.node_of_expert = *nodes;
    }
    if (auto s = c.Validate(); !s.ok()) return Fail(s.message());
    std::cout << c << "\n";
    double entropy_sum = 0, nodes_sum = 0;
    for (int64_t r = 0; r < w; ++r) {
      rdep::Rng rng(seed, static_cast<uint64_t>(r));
      std::vector<float> logits(static_cast<size_t>(t * e));
      for (int64_t i = 0; i < t * e; ++i)
        logits[static_cast<size_t>(i)] = static_cast<float>(rng.normal() - skew * static_cast<double>(i % e) / static_cast<double>(e));
      auto out = rdep::Route(c, logits, t);
      if (!out.ok()) return Fail(out.status().message());
      auto h = rdep::MeanScoreEntropy(out->scores, t, e);
      if (!h.ok()) return Fail(h.status().message());
      entropy_sum += *h;
      if (node_cap > 0) {
        for (int64_t tok = 0; tok < t; ++tok) {
          std::vector<int32_t> seen;
          for (int64_t j = 0; j < k; ++j) {
            const int32_t nd = c.node_of_expert[static_cast<size_t>(out->routing.experts[static_cast<size_t>(tok * k + j)])];
            bool found = false;
            for (int32_t s : seen) found = found || s == nd;
            if (!found) seen.push_back(nd);
          }
          nodes_sum += static_cast<double>(seen.size());
        }
      }
      routing.push_back(std::move(out->routing));
    }
    score_entropy = entropy_sum / static_cast<double>(w);
    if (node_cap > 0) distinct_nodes = nodes_sum / static_cast<double>(w * t);
  } else {
    auto spec = rdep::RoutingSpec::Parse(family);
    if (!spec.ok()) return Fail("--routing: " + spec.status().message());
    spec->seed = seed;
    auto gen = rdep::GenerateRouting(shape, *spec);
    if (!gen.ok()) return Fail(gen.status().message());
    routing = std::move(*gen);
  }
  auto tel = rdep::ComputeTelemetry(routing, *own);
  if (!tel.ok()) return Fail(tel.status().message());
  if (score_entropy >= 0) tel->score_entropy = score_entropy;
  std::cout << "routing " << family << ", W=" << w << " T=" << t << " E=" << e << " K=" << k << " seed=" << seed << "\n"
            << *tel;
  if (distinct_nodes >= 0) std::cout << "distinct nodes     " << distinct_nodes << " per token (cap " << node_cap << ")\n";
  return 0;
}

const bool kRegistered = rdep::cli::Register({"route", "route-health telemetry of a seeded routing or of the reference router", &RunRoute});

}  // namespace
