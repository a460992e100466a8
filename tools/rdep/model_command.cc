// `rdep model <subcommand>`: the closed-form cost models of the RDEP paper (seeds 000: section 4, Appendix B)
// and the cross-node EP notes (seeds 004), printed with their formulas. Defaults are the seeds' worked examples, so
// `rdep model context-memory` prints the paper's 42 MB. Try: rdep model cross-node --max-nodes 4
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "rdep/model/cost_models.h"

namespace {

using rdep::cli::Args;
using rdep::cli::Flags;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Sub {
  std::string summary;
  std::string help;  // flags and formula
  std::function<int(Flags&)> run;
};

int Fail(const std::string& sub, const std::string& msg) {
  std::cerr << "rdep model " << sub << ": " << msg << "\n";
  return 2;
}

// Returns an error naming the flag when v <= 0 (or < 0 when zero_ok).
std::string CheckInt(const char* flag, int64_t v, bool zero_ok = false) {
  if (v > 0 || (zero_ok && v == 0)) return "";
  return std::string("--") + flag + " must be " + (zero_ok ? ">= 0" : "> 0") + ", got " + std::to_string(v);
}
std::string CheckReal(const char* flag, double v) {
  if (std::isfinite(v) && v > 0) return "";
  std::ostringstream os;
  os << "--" << flag << " must be a finite number > 0, got " << v;
  return os.str();
}
std::string FirstError(std::initializer_list<std::string> errors) {
  for (const auto& e : errors)
    if (!e.empty()) return e;
  return "";
}

std::string Bytes(double b) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  if (b >= kGiB) os << b / kGiB << " GiB (" << b / 1e9 << " GB)";
  else if (b >= 1024.0 * 1024.0) os << b / (1024.0 * 1024.0) << " MiB (" << b / 1e6 << " MB)";
  else os << b << " B";
  return os.str();
}

int Pooling(Flags& f) {
  const int64_t dp = f.get_int("dp", 8), t = f.get_int("tokens", 4096), k = f.get_int("topk", 6),
                e = f.get_int("experts", 64);
  if (auto s = f.Finish(); !s.ok()) return Fail("pooling", s.message());
  if (auto m = FirstError({CheckInt("dp", dp), CheckInt("tokens", t), CheckInt("topk", k), CheckInt("experts", e)});
      !m.empty())
    return Fail("pooling", m);
  if (k > e) return Fail("pooling", "--topk (" + std::to_string(k) + ") exceeds --experts (" + std::to_string(e) + ")");
  auto p = rdep::model::Pooling(dp, t, k, e);
  if (!p.ok()) return Fail("pooling", p.status().message());
  std::cout << std::fixed << std::setprecision(4) << "pooling law (the RDEP paper, eq. 14), DP=" << dp << " T=" << t
            << " K=" << k << " E=" << e << "\n"
            << "  mu = DP*T*K/E            " << std::setprecision(1) << p->mu << " rows per expert\n"
            << "  mu at DP=1 (T*K/E)       " << p->mu_single << "\n"
            << std::setprecision(4) << "  CV = sqrt((1-K/E)/mu)    " << p->cv << "\n"
            << "  CV at DP=1               " << p->cv_single << "  (falls by 1/sqrt(DP))\n";
  return 0;
}

int Capacity(Flags& f) {
  const int64_t e = f.get_int("experts", 64);
  const int64_t dp = f.get_int("dp", 8), t = f.get_int("tokens", 4096), k = f.get_int("topk", 6);
  const bool has_mu = f.has("mu");
  double mu = f.get_double("mu", 0);
  const bool has_beta = f.has("beta");
  const double beta = f.get_double("beta", 0);
  const double p = f.get_double("overflow-prob", 0.01);
  if (auto s = f.Finish(); !s.ok()) return Fail("capacity", s.message());
  if (auto m = FirstError({CheckInt("experts", e), CheckInt("dp", dp), CheckInt("tokens", t), CheckInt("topk", k)});
      !m.empty())
    return Fail("capacity", m);
  if (has_mu) {
    if (auto m = CheckReal("mu", mu); !m.empty()) return Fail("capacity", m);
  } else {
    if (k > e) return Fail("capacity", "--topk exceeds --experts");
    mu = static_cast<double>(dp) * static_cast<double>(t) * static_cast<double>(k) / static_cast<double>(e);
  }
  if (has_beta && !(std::isfinite(beta) && beta >= 0)) return Fail("capacity", "--beta must be a finite number >= 0");
  if (!(p > 0 && p < 1)) return Fail("capacity", "--overflow-prob must be in (0, 1)");
  std::cout << std::setprecision(6) << "capacity slack (the RDEP paper, eq. 16): Pr(max_e M_e > (1+beta)mu) <= E*exp(-mu*beta^2/3)\n"
            << "  E = " << e << ", mu = " << mu << (has_mu ? "" : " (= DP*T*K/E)") << "\n";
  auto slack = rdep::model::ChernoffSlack(e, mu, p);
  if (!slack.ok()) return Fail("capacity", slack.status().message());
  std::cout << "  for overflow probability <= " << p << ": beta = sqrt(3*ln(E/p)/mu) = " << *slack
            << "  (capacity factor " << 1 + *slack << ", " << std::ceil((1 + *slack) * mu) << " rows per expert)\n";
  if (has_beta) {
    auto b = rdep::model::ChernoffOverflowBound(e, mu, beta);
    if (!b.ok()) return Fail("capacity", b.status().message());
    std::cout << "  at beta = " << beta << ": overflow probability <= " << *b << "\n";
  }
  return 0;
}

int Padding(Flags& f) {
  const std::string text = f.get_string("counts", "");
  if (auto s = f.Finish(); !s.ok()) return Fail("padding", s.message());
  if (text.empty()) return Fail("padding", "--counts is required: per-local-expert row counts, e.g. --counts 384,400,350,512");
  std::vector<int64_t> counts;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0') return Fail("padding", "--counts: '" + item + "' is not an integer");
    if (v < 0) return Fail("padding", "--counts: count " + std::to_string(counts.size()) + " is negative (" + item + ")");
    if (v > (int64_t{1} << 40))  // keeps E_loc * max and the sum exact in int64
      return Fail("padding", "--counts: count " + std::to_string(counts.size()) + " is above 2^40 rows (" + item + ")");
    if (counts.size() >= (size_t{1} << 20)) return Fail("padding", "--counts: more than 2^20 counts");
    counts.push_back(v);
  }
  auto rho = rdep::model::GroupedLaunchInflation(counts);
  if (!rho.ok()) return Fail("padding", rho.status().message());
  int64_t sum = 0, mx = 0;
  for (auto c : counts) {
    sum += c;
    mx = std::max(mx, c);
  }
  std::cout << std::fixed << std::setprecision(4)
            << "grouped-launch inflation (the RDEP paper, eq. 19/31): rho = E_loc * max_j m_j / sum_j m_j\n"
            << "  E_loc = " << counts.size() << ", max = " << mx << ", sum = " << sum << "\n"
            << "  rho = " << *rho << "  (launched rows " << static_cast<int64_t>(counts.size()) * mx << " for " << sum
            << " useful)\n";
  return 0;
}

int ContextMemory(Flags& f) {
  const int64_t l = f.get_int("layers", 27), dp = f.get_int("dp", 8), t = f.get_int("tokens", 4096),
                k = f.get_int("topk", 6), b = f.get_int("bytes-per-row", 8);
  if (auto s = f.Finish(); !s.ok()) return Fail("context-memory", s.message());
  if (auto m = FirstError({CheckInt("layers", l), CheckInt("dp", dp), CheckInt("tokens", t, true), CheckInt("topk", k),
                           CheckInt("bytes-per-row", b)});
      !m.empty())
    return Fail("context-memory", m);
  auto bytes = rdep::model::RoutingContextBytes(l, dp, t, k, b);
  if (!bytes.ok()) return Fail("context-memory", bytes.status().message());
  std::cout << "routing-context memory (the RDEP paper, eq. 20): M_ctx = " << b << " * L_moe * DP * T * K bytes per GPU\n"
            << "  L_moe=" << l << " DP=" << dp << " T=" << t << " K=" << k << "\n"
            << "  M_ctx = " << Bytes(*bytes) << "\n";
  return 0;
}

int PayloadMemory(Flags& f) {
  rdep::model::PayloadMemoryArgs a;
  a.capacity_rows = f.get_int("capacity-rows", a.capacity_rows);
  a.segment_rows = f.get_int("segment-rows", a.segment_rows);
  a.hidden = f.get_int("hidden", a.hidden);
  a.bytes_per_element = f.get_int("bytes-per-element", a.bytes_per_element);
  a.layers = f.get_int("layers", a.layers);
  a.tensors = f.get_int("tensors", a.tensors);
  a.buffers_per_segment = f.get_int("buffers", a.buffers_per_segment);
  if (auto s = f.Finish(); !s.ok()) return Fail("payload-memory", s.message());
  if (auto m = FirstError({CheckInt("capacity-rows", a.capacity_rows), CheckInt("segment-rows", a.segment_rows),
                           CheckInt("hidden", a.hidden), CheckInt("bytes-per-element", a.bytes_per_element),
                           CheckInt("layers", a.layers), CheckInt("tensors", a.tensors),
                           CheckInt("buffers", a.buffers_per_segment)});
      !m.empty())
    return Fail("payload-memory", m);
  auto r = rdep::model::SymmetricPayloadMemory(a);
  if (!r.ok()) return Fail("payload-memory", r.status().message());
  std::cout << "symmetric payload memory per GPU (the RDEP paper, section 4.4, Table 4)\n"
            << "  bulk:      tensors * M_cap * H * b           = " << a.tensors << " * " << a.capacity_rows << " * "
            << a.hidden << " * " << a.bytes_per_element << "\n"
            << "  segmented: tensors * buffers * S * H * b     = " << a.tensors << " * " << a.buffers_per_segment
            << " * " << a.segment_rows << " * " << a.hidden << " * " << a.bytes_per_element << "\n"
            << "  mode        per layer                  x " << a.layers << " layers\n"
            << "  bulk        " << std::left << std::setw(26) << Bytes(r->bulk_bytes_per_layer) << " " << Bytes(r->bulk_bytes)
            << "\n"
            << "  segmented   " << std::setw(26) << Bytes(r->segmented_bytes_per_layer) << " " << Bytes(r->segmented_bytes)
            << std::right << "\n"
            << std::fixed << std::setprecision(1) << "  bulk / segmented = " << r->bulk_bytes / r->segmented_bytes
            << "x\n";
  return 0;
}

int DenseBound(Flags& f) {
  const int64_t v = f.get_int("vocab", 201088), h = f.get_int("hidden", 2880), l = f.get_int("layers", 24),
                ld = f.get_int("dense-layers", 0), d = f.get_int("dense-ffn", 0);
  if (auto s = f.Finish(); !s.ok()) return Fail("dense-bound", s.message());
  if (auto m = FirstError({CheckInt("vocab", v), CheckInt("hidden", h), CheckInt("layers", l),
                           CheckInt("dense-layers", ld, true), CheckInt("dense-ffn", d, true)});
      !m.empty())
    return Fail("dense-bound", m);
  if (ld > l) return Fail("dense-bound", "--dense-layers (" + std::to_string(ld) + ") exceeds --layers (" + std::to_string(l) + ")");
  if (ld > 0 && d == 0) return Fail("dense-bound", "--dense-ffn must be > 0 when --dense-layers > 0");
  auto p = rdep::model::DenseLowerBound(v, h, l, ld, d);
  if (!p.ok()) return Fail("dense-bound", p.status().message());
  std::cout << "replicated dense lower bound (the RDEP paper, eq. 21): P = V*H + 4*L*H^2 + 3*L_dense*H*D_dense\n"
            << "  V=" << v << " H=" << h << " L=" << l << " L_dense=" << ld << " D_dense=" << d << "\n"
            << std::fixed << std::setprecision(3) << "  P >= " << *p / 1e9 << "B parameters ("
            << Bytes(2.0 * *p) << " in bf16)\n";
  return 0;
}

int BarrierCmd(Flags& f) {
  const int64_t w = f.get_int("width", 72), n = f.get_int("barriers", 4);
  const double lo = f.get_double("ns-per-peer-min", 50), hi = f.get_double("ns-per-peer-max", 100);
  if (auto s = f.Finish(); !s.ok()) return Fail("barrier", s.message());
  if (auto m = FirstError({CheckInt("width", w), CheckInt("barriers", n), CheckReal("ns-per-peer-min", lo),
                           CheckReal("ns-per-peer-max", hi)});
      !m.empty())
    return Fail("barrier", m);
  if (hi < lo) return Fail("barrier", "--ns-per-peer-max is below --ns-per-peer-min");
  auto b = rdep::model::Barrier(w, lo, hi, n);
  if (!b.ok()) return Fail("barrier", b.status().message());
  std::cout << std::fixed << std::setprecision(2)
            << "barrier budget (the RDEP paper, section 4.5): one barrier = W * t_peer, one segment = barriers * that\n"
            << "  W=" << w << ", t_peer = " << lo << "-" << hi << " ns, " << n << " barriers per segment\n"
            << "  one barrier   " << b->barrier_min_s * 1e6 << "-" << b->barrier_max_s * 1e6 << " us\n"
            << "  one segment   " << b->segment_min_s * 1e6 << "-" << b->segment_max_s * 1e6 << " us\n";
  return 0;
}

int CrossNodeCmd(Flags& f) {
  rdep::model::CrossNodeArgs a;
  a.nodes = f.get_int("nodes", a.nodes);
  a.topk = f.get_int("topk", a.topk);
  a.tokens = f.get_int("tokens", a.tokens);
  a.hidden = f.get_int("hidden", a.hidden);
  a.bytes_per_element = f.get_int("bytes-per-element", a.bytes_per_element);
  const int64_t cap = f.get_int("max-nodes", 4);
  a.ib_gbps = f.get_double("ib-gbps", a.ib_gbps);
  a.nvlink_gbps = f.get_double("nvlink-gbps", a.nvlink_gbps);
  const bool has_budget = f.has("budget-ms");
  const double budget_ms = f.get_double("budget-ms", 10);
  if (auto s = f.Finish(); !s.ok()) return Fail("cross-node", s.message());
  if (auto m = FirstError({CheckInt("nodes", a.nodes), CheckInt("topk", a.topk), CheckInt("tokens", a.tokens, true),
                           CheckInt("hidden", a.hidden), CheckInt("bytes-per-element", a.bytes_per_element),
                           CheckInt("max-nodes", cap, true), CheckReal("ib-gbps", a.ib_gbps),
                           CheckReal("nvlink-gbps", a.nvlink_gbps)});
      !m.empty())
    return Fail("cross-node", m);
  if (cap > a.nodes)
    return Fail("cross-node", "--max-nodes (" + std::to_string(cap) + ") is larger than --nodes (" + std::to_string(a.nodes) + ")");
  if (has_budget && !(std::isfinite(budget_ms) && budget_ms >= 0)) return Fail("cross-node", "--budget-ms must be >= 0");
  auto free_routing = rdep::model::CrossNodeDispatch(a);
  if (!free_routing.ok()) return Fail("cross-node", free_routing.status().message());
  std::cout << "cross-node dispatch (the cross-node EP notes): N=" << a.nodes << " k=" << a.topk << " T=" << a.tokens
            << " d=" << a.hidden << " b=" << a.bytes_per_element << ", IB " << a.ib_gbps << " GB/s, NVLink "
            << a.nvlink_gbps << " GB/s per GPU\n"
            << "  E[distinct nodes] = N*(1-(1-1/N)^k); R_IB = T*(distinct-1); B_IB = R_IB*d*b; round trip 2*B_IB\n"
            << "  with a node cap M: distinct <= M, so R_IB <= T*(M-1)\n\n"
            << "unconstrained:\n"
            << *free_routing;
  if (cap > 0) {
    a.max_nodes = cap;
    auto capped = rdep::model::CrossNodeDispatch(a);
    if (!capped.ok()) return Fail("cross-node", capped.status().message());
    std::cout << "\nnode-limited, M = " << cap << ":\n"
              << *capped << std::fixed << std::setprecision(1) << "  IB time saved        "
              << 100.0 * (1.0 - capped->ib_time_s / free_routing->ib_time_s) << "%\n";
    a.max_nodes = 0;
  }
  if (has_budget) {
    auto m = rdep::model::NodeCapForBudget(a, budget_ms * 1e-3);
    if (!m.ok()) return Fail("cross-node", m.status().message());
    std::cout << "\nleast restrictive cap with round-trip IB time <= " << budget_ms << " ms: M = " << *m << "\n";
  }
  return 0;
}

int TransportCmd(Flags& f) {
  rdep::model::TransportArgs a;
  a.ranks = f.get_int("ranks", a.ranks);
  a.experts = f.get_int("experts", a.experts);
  a.topk = f.get_int("topk", a.topk);
  a.tokens = f.get_int("tokens", a.tokens);
  a.hidden = f.get_int("hidden", a.hidden);
  a.bytes_per_element = f.get_int("bytes-per-element", a.bytes_per_element);
  a.peer_gbps = f.get_double("peer-gbps", a.peer_gbps);
  if (auto s = f.Finish(); !s.ok()) return Fail("transport", s.message());
  if (auto m = FirstError({CheckInt("ranks", a.ranks), CheckInt("experts", a.experts), CheckInt("topk", a.topk),
                           CheckInt("tokens", a.tokens, true), CheckInt("hidden", a.hidden),
                           CheckInt("bytes-per-element", a.bytes_per_element), CheckReal("peer-gbps", a.peer_gbps)});
      !m.empty())
    return Fail("transport", m);
  auto t = rdep::model::IntraDomainTransport(a);
  if (!t.ok()) return Fail("transport", t.status().message());
  std::cout << "transport floor inside one NVLink domain (uniform routing, owner deduplication): W=" << a.ranks << " E="
            << a.experts << " K=" << a.topk << " T=" << a.tokens << " H=" << a.hidden << " b=" << a.bytes_per_element << ", "
            << a.peer_gbps << " GB/s egress per GPU\n"
            << "  P_q = 1 - C(E-E_q, K)/C(E, K); dispatch rows = T*(W-1)/W*sum_q P_q; bytes = rows*H*b; floor = bytes/bandwidth\n\n"
            << *t;
  return 0;
}

const std::map<std::string, Sub>& Subs() {
  static const std::map<std::string, Sub> subs = {
      {"pooling",
       {"mean rows per expert and its CV (the RDEP paper, eq. 14)",
        "rdep model pooling [--dp 8] [--tokens 4096] [--topk 6] [--experts 64]\n"
        "  mu = DP*T*K/E;  CV(M_e) = sqrt((1 - K/E) / mu) under tokenwise-independent uniform routing\n"
        "  (M_e ~ Binomial(DP*T, K/E)), the RDEP paper, section 4.1 eq. 13-14.",
        &Pooling}},
      {"capacity",
       {"Chernoff capacity slack beta for a target overflow probability (the RDEP paper, eq. 16)",
        "rdep model capacity [--experts 64] [--dp 8 --tokens 4096 --topk 6 | --mu M] [--overflow-prob 0.01] [--beta B]\n"
        "  Pr(max_e M_e > (1+beta)*mu) <= E*exp(-mu*beta^2/3)  (the RDEP paper, eq. 16, Proposition B.3);\n"
        "  beta for probability p: sqrt(3*ln(E/p)/mu). --beta also prints the bound at that slack.",
        &Capacity}},
      {"padding",
       {"grouped-launch inflation rho for per-expert counts (the RDEP paper, eq. 31)",
        "rdep model padding --counts m1,m2,...\n"
        "  rho = E_loc * max_j m_j / sum_j m_j  (the RDEP paper, eq. 19 / 31); 1 is the equal-load optimum.",
        &Padding}},
      {"context-memory",
       {"saved routing-context bytes per GPU (the RDEP paper, eq. 20)",
        "rdep model context-memory [--layers 27] [--dp 8] [--tokens 4096] [--topk 6] [--bytes-per-row 8]\n"
        "  M_ctx = 8 * L_moe * DP * T * K bytes (the RDEP paper, eq. 20 / 32). Paper: 42 MB at these defaults,\n"
        "  9.1 GB at --layers 60 --dp 72 --tokens 32768 --topk 8.",
        &ContextMemory}},
      {"payload-memory",
       {"bulk vs segmented symmetric payload memory per GPU (the RDEP paper, Table 4)",
        "rdep model payload-memory [--capacity-rows 196608] [--segment-rows 4096] [--hidden 2048]\n"
        "                          [--bytes-per-element 2] [--layers 27] [--tensors 4] [--buffers 2]\n"
        "  bulk = tensors * M_cap * H * b per layer; segmented = tensors * buffers * S * H * b per layer\n"
        "  (the RDEP paper, section 4.4 and Table 4: ~84 GiB bulk vs ~3.4 GiB segmented over 27 layers).\n"
        "  tensors: dispatch send/recv and return send/recv; buffers: 2 = double buffering.",
        &PayloadMemory}},
      {"dense-bound",
       {"replicated dense parameter lower bound (the RDEP paper, eq. 21)",
        "rdep model dense-bound [--vocab 201088] [--hidden 2880] [--layers 24] [--dense-layers 0] [--dense-ffn 0]\n"
        "  P = V*H + 4*L*H^2 + 3*L_dense*H*D_dense (the RDEP paper, eq. 21 / 33): embeddings, attention and\n"
        "  dense FFN weights only. Paper: 1.38B (L=24) to 1.77B (L=36) at H=2880; 10.47B at H=7168, L=42,\n"
        "  D_dense=18432 (reproduced with --dense-layers 1 and the same vocabulary).",
        &DenseBound}},
      {"barrier",
       {"phase-barrier time budget at width W (the RDEP paper, section 4.5)",
        "rdep model barrier [--width 72] [--ns-per-peer-min 50] [--ns-per-peer-max 100] [--barriers 4]\n"
        "  one barrier = W * t_peer (a Theta(W) publish/acquire sweep); one segment = barriers * that\n"
        "  (the RDEP paper, section 4.5, Proposition B.7: 3.6-7.2 us and 14-29 us at W = 72).",
        &BarrierCmd}},
      {"cross-node",
       {"IB/NVLink rows, bytes and time per dispatch, with and without a node cap M (the cross-node EP notes)",
        "rdep model cross-node [--nodes 8] [--topk 8] [--tokens 4096] [--hidden 7168] [--bytes-per-element 2]\n"
        "                      [--max-nodes 4] [--ib-gbps 50] [--nvlink-gbps 600] [--budget-ms MS]\n"
        "  E[distinct nodes] = N*(1-(1-1/N)^k); R_IB = T*(distinct - 1); B_IB = R_IB*d*b per dispatch,\n"
        "  2*B_IB round trip; with cap M, distinct <= M so R_IB <= T*(M-1). NVLink rows = T*(k - remote).\n"
        "  Time = round-trip bytes / bandwidth; wall = max of the links. --budget-ms prints the least\n"
        "  restrictive M (scanning down from N) whose IB time fits. --max-nodes 0 skips the capped case.",
        &CrossNodeCmd}},
      {"transport",
       {"dispatch and combine bytes and floor time per GPU inside one NVLink domain (DESIGN.md's targets)",
        "rdep model transport [--ranks 4] [--experts 64] [--topk 6] [--tokens 4096] [--hidden 2048]\n"
        "                     [--bytes-per-element 2] [--peer-gbps 386]\n"
        "  Uniform routing, K distinct experts of E over W owners (contiguous ownership). A token crosses to\n"
        "  owner q once when any of its experts lives there: P_q = 1 - C(E - E_q, K)/C(E, K). Per rank:\n"
        "  dispatch rows = T*(W-1)/W*sum_q P_q, bytes = rows*H*b, floor = bytes / egress bandwidth; combine\n"
        "  returns one row per remote slot (T*K*(W-1)/W rows) or, when the owner reduces first, the dispatch's\n"
        "  rows. Defaults: the Moonlight shape at W = 4, 386 GB/s (a copy between two H200s, measured).",
        &TransportCmd}},
  };
  return subs;
}

int Usage(std::ostream& os) {
  os << "usage: rdep model <subcommand> [flags]   (rdep model <subcommand> --help for its formula and flags)\n\n";
  for (const auto& [name, sub] : Subs()) os << "  " << std::left << std::setw(16) << name << sub.summary << "\n";
  os << std::right << "\nDefaults reproduce the worked examples of the RDEP paper and the cross-node EP notes.\n";
  return 0;
}

int RunModel(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") return Usage(std::cout);
  auto it = Subs().find(args[0]);
  if (it == Subs().end()) {
    std::cerr << "rdep model: unknown subcommand '" << args[0] << "'\n";
    Usage(std::cerr);
    return 2;
  }
  const Args rest(args.begin() + 1, args.end());
  if (rdep::cli::WantsHelp(rest)) {  // the usage line, then the formula and its source
    std::cout << "usage: " << it->second.help << "\n\n" << it->second.summary << ".\n";
    return 0;
  }
  Flags flags(rest);
  if (!flags.positional().empty())
    return Fail(args[0], "unexpected argument '" + flags.positional().front() + "' (flags look like --name VALUE)");
  return it->second.run(flags);
}

const bool kRegistered = rdep::cli::Register({"model", "cost models: pooling, capacity, padding, memory, dense bound, barrier, cross-node, transport", &RunModel});

}  // namespace
