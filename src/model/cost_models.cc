// Closed-form cost models (seeds 000 section 4 / Appendix B, seeds 004): formulas and input checks.
#include "rdep/model/cost_models.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <string>

#include "rdep/core/stats.h"

namespace rdep::model {

namespace {

Status Positive(const char* name, int64_t v) {
  if (v <= 0) return InvalidArgument(std::string(name) + " must be > 0, got " + std::to_string(v));
  return Status::Ok();
}
Status NonNegative(const char* name, int64_t v) {
  if (v < 0) return InvalidArgument(std::string(name) + " must be >= 0, got " + std::to_string(v));
  return Status::Ok();
}
Status PositiveReal(const char* name, double v) {
  if (!std::isfinite(v) || v <= 0) return InvalidArgument(std::string(name) + " must be finite and > 0, got " + std::to_string(v));
  return Status::Ok();
}
double D(int64_t v) { return static_cast<double>(v); }

}  // namespace

StatusOr<PoolingLaw> Pooling(int64_t dp, int64_t tokens, int64_t topk, int64_t experts) {
  RDEP_RETURN_IF_ERROR(Positive("dp", dp));
  RDEP_RETURN_IF_ERROR(Positive("tokens", tokens));
  RDEP_RETURN_IF_ERROR(Positive("topk", topk));
  RDEP_RETURN_IF_ERROR(Positive("experts", experts));
  if (topk > experts)
    return InvalidArgument("topk (" + std::to_string(topk) + ") exceeds experts (" + std::to_string(experts) + ")");
  PoolingLaw p;
  const double frac = D(topk) / D(experts);
  p.mu_single = D(tokens) * frac;
  p.mu = D(dp) * p.mu_single;
  p.cv = std::sqrt((1 - frac) / p.mu);
  p.cv_single = std::sqrt((1 - frac) / p.mu_single);
  return p;
}

StatusOr<double> ChernoffOverflowBound(int64_t experts, double mu, double beta) {
  RDEP_RETURN_IF_ERROR(Positive("experts", experts));
  RDEP_RETURN_IF_ERROR(PositiveReal("mu", mu));
  if (!std::isfinite(beta) || beta < 0) return InvalidArgument("beta must be finite and >= 0, got " + std::to_string(beta));
  return std::min(1.0, D(experts) * std::exp(-mu * beta * beta / 3.0));
}

StatusOr<double> ChernoffSlack(int64_t experts, double mu, double p) {
  RDEP_RETURN_IF_ERROR(Positive("experts", experts));
  RDEP_RETURN_IF_ERROR(PositiveReal("mu", mu));
  if (!(p > 0 && p < 1)) return InvalidArgument("target overflow probability must be in (0, 1), got " + std::to_string(p));
  return std::sqrt(3.0 * std::log(D(experts) / p) / mu);
}

StatusOr<double> GroupedLaunchInflation(std::span<const int64_t> counts) {
  if (counts.empty()) return InvalidArgument("counts must name at least one local expert");
  for (size_t i = 0; i < counts.size(); ++i)
    if (counts[i] < 0) return InvalidArgument("count " + std::to_string(i) + " is negative (" + std::to_string(counts[i]) + ")");
  return PaddingRatio(std::vector<int64_t>(counts.begin(), counts.end()));
}

StatusOr<double> RoutingContextBytes(int64_t moe_layers, int64_t dp, int64_t tokens, int64_t topk,
                                     int64_t bytes_per_row) {
  RDEP_RETURN_IF_ERROR(Positive("moe layers", moe_layers));
  RDEP_RETURN_IF_ERROR(Positive("dp", dp));
  RDEP_RETURN_IF_ERROR(NonNegative("tokens", tokens));
  RDEP_RETURN_IF_ERROR(Positive("topk", topk));
  RDEP_RETURN_IF_ERROR(Positive("bytes per row", bytes_per_row));
  return D(bytes_per_row) * D(moe_layers) * D(dp) * D(tokens) * D(topk);
}

StatusOr<PayloadMemory> SymmetricPayloadMemory(const PayloadMemoryArgs& a) {
  RDEP_RETURN_IF_ERROR(Positive("capacity rows", a.capacity_rows));
  RDEP_RETURN_IF_ERROR(Positive("segment rows", a.segment_rows));
  RDEP_RETURN_IF_ERROR(Positive("hidden", a.hidden));
  RDEP_RETURN_IF_ERROR(Positive("bytes per element", a.bytes_per_element));
  RDEP_RETURN_IF_ERROR(Positive("layers", a.layers));
  RDEP_RETURN_IF_ERROR(Positive("tensors", a.tensors));
  RDEP_RETURN_IF_ERROR(Positive("buffers per segment", a.buffers_per_segment));
  const double row = D(a.hidden) * D(a.bytes_per_element);
  PayloadMemory m;
  m.bulk_bytes_per_layer = D(a.tensors) * D(a.capacity_rows) * row;
  m.segmented_bytes_per_layer = D(a.tensors) * D(a.buffers_per_segment) * D(a.segment_rows) * row;
  m.bulk_bytes = m.bulk_bytes_per_layer * D(a.layers);
  m.segmented_bytes = m.segmented_bytes_per_layer * D(a.layers);
  return m;
}

StatusOr<double> DenseLowerBound(int64_t vocab, int64_t hidden, int64_t layers, int64_t dense_layers,
                                 int64_t dense_ffn) {
  RDEP_RETURN_IF_ERROR(Positive("vocab", vocab));
  RDEP_RETURN_IF_ERROR(Positive("hidden", hidden));
  RDEP_RETURN_IF_ERROR(Positive("layers", layers));
  RDEP_RETURN_IF_ERROR(NonNegative("dense layers", dense_layers));
  RDEP_RETURN_IF_ERROR(NonNegative("dense ffn", dense_ffn));
  if (dense_layers > layers)
    return InvalidArgument("dense layers (" + std::to_string(dense_layers) + ") exceed layers (" + std::to_string(layers) + ")");
  if (dense_layers > 0 && dense_ffn == 0) return InvalidArgument("dense ffn must be > 0 when dense layers > 0");
  const double h = D(hidden);
  return D(vocab) * h + 4.0 * D(layers) * h * h + 3.0 * D(dense_layers) * h * D(dense_ffn);
}

StatusOr<BarrierBudget> Barrier(int64_t width, double lo, double hi, int64_t barriers) {
  RDEP_RETURN_IF_ERROR(Positive("width", width));
  RDEP_RETURN_IF_ERROR(PositiveReal("ns per peer (min)", lo));
  RDEP_RETURN_IF_ERROR(PositiveReal("ns per peer (max)", hi));
  RDEP_RETURN_IF_ERROR(Positive("barriers per segment", barriers));
  if (hi < lo) return InvalidArgument("ns per peer: max (" + std::to_string(hi) + ") is below min (" + std::to_string(lo) + ")");
  BarrierBudget b;
  b.barrier_min_s = D(width) * lo * 1e-9;
  b.barrier_max_s = D(width) * hi * 1e-9;
  b.segment_min_s = b.barrier_min_s * D(barriers);
  b.segment_max_s = b.barrier_max_s * D(barriers);
  return b;
}

StatusOr<double> ExpectedDistinctNodes(int64_t nodes, int64_t topk) {
  RDEP_RETURN_IF_ERROR(Positive("nodes", nodes));
  RDEP_RETURN_IF_ERROR(Positive("topk", topk));
  const double n = D(nodes);
  return n * (1.0 - std::pow(1.0 - 1.0 / n, D(topk)));
}

StatusOr<CrossNode> CrossNodeDispatch(const CrossNodeArgs& a) {
  RDEP_ASSIGN_OR_RETURN(const double distinct, ExpectedDistinctNodes(a.nodes, a.topk));
  RDEP_RETURN_IF_ERROR(NonNegative("tokens", a.tokens));
  RDEP_RETURN_IF_ERROR(Positive("hidden", a.hidden));
  RDEP_RETURN_IF_ERROR(Positive("bytes per element", a.bytes_per_element));
  RDEP_RETURN_IF_ERROR(NonNegative("max nodes", a.max_nodes));
  if (a.max_nodes > a.nodes)
    return InvalidArgument("max nodes (" + std::to_string(a.max_nodes) + ") is larger than nodes (" + std::to_string(a.nodes) + ")");
  RDEP_RETURN_IF_ERROR(PositiveReal("ib bandwidth", a.ib_gbps));
  RDEP_RETURN_IF_ERROR(PositiveReal("nvlink bandwidth", a.nvlink_gbps));
  CrossNode c;
  c.distinct_nodes = a.max_nodes > 0 ? std::min(distinct, D(a.max_nodes)) : distinct;
  c.remote_nodes = c.distinct_nodes - 1.0;
  const double row = D(a.hidden) * D(a.bytes_per_element);
  c.ib_rows = D(a.tokens) * c.remote_nodes;
  c.ib_bytes = c.ib_rows * row;
  c.ib_round_trip_bytes = 2.0 * c.ib_bytes;
  c.nvlink_rows = D(a.tokens) * (D(a.topk) - c.remote_nodes);
  c.nvlink_round_trip_bytes = 2.0 * c.nvlink_rows * row;
  c.ib_time_s = c.ib_round_trip_bytes / (a.ib_gbps * 1e9);
  c.nvlink_time_s = c.nvlink_round_trip_bytes / (a.nvlink_gbps * 1e9);
  c.wall_time_s = std::max(c.ib_time_s, c.nvlink_time_s);
  c.naive_ib_bytes = D(a.tokens) * D(a.topk) * (1.0 - 1.0 / D(a.nodes)) * row;
  return c;
}

StatusOr<int64_t> NodeCapForBudget(CrossNodeArgs args, double budget_s) {
  if (!std::isfinite(budget_s) || budget_s < 0) return InvalidArgument("budget must be finite and >= 0");
  for (int64_t m = args.nodes; m >= 1; --m) {
    args.max_nodes = m;
    RDEP_ASSIGN_OR_RETURN(const CrossNode c, CrossNodeDispatch(args));
    if (c.ib_time_s <= budget_s) return m;
  }
  return InvalidArgument("nodes must be > 0, got " + std::to_string(args.nodes));
}

std::ostream& operator<<(std::ostream& os, const CrossNode& c) {
  const auto flags = os.flags();
  const auto prec = os.precision();
  os << std::fixed << std::setprecision(2) << "  distinct nodes/token " << c.distinct_nodes << " (remote "
     << c.remote_nodes << ")\n"
     << std::setprecision(0) << "  IB rows/dispatch     " << c.ib_rows << "\n"
     << std::setprecision(1) << "  IB bytes/dispatch    " << c.ib_bytes / 1e6 << " MB (round trip "
     << c.ib_round_trip_bytes / 1e6 << " MB)\n"
     << std::setprecision(0) << "  NVLink rows/dispatch " << c.nvlink_rows << "\n"
     << std::setprecision(3) << "  IB time              " << c.ib_time_s * 1e3 << " ms (round trip)\n"
     << "  NVLink time          " << c.nvlink_time_s * 1e3 << " ms (round trip)\n"
     << "  wall time            " << c.wall_time_s * 1e3 << " ms (max of the two links)\n";
  os.flags(flags);
  os.precision(prec);
  return os;
}

StatusOr<TransportFloor> IntraDomainTransport(const TransportArgs& a) {
  RDEP_RETURN_IF_ERROR(Positive("ranks", a.ranks));
  RDEP_RETURN_IF_ERROR(Positive("experts", a.experts));
  RDEP_RETURN_IF_ERROR(Positive("topk", a.topk));
  RDEP_RETURN_IF_ERROR(NonNegative("tokens", a.tokens));
  RDEP_RETURN_IF_ERROR(Positive("hidden", a.hidden));
  RDEP_RETURN_IF_ERROR(Positive("bytes per element", a.bytes_per_element));
  RDEP_RETURN_IF_ERROR(PositiveReal("peer bandwidth", a.peer_gbps));
  if (a.topk > a.experts)
    return InvalidArgument("topk (" + std::to_string(a.topk) + ") is larger than experts (" + std::to_string(a.experts) + ")");
  if (a.ranks > (int64_t{1} << 20)) return InvalidArgument("ranks must be <= 2^20, got " + std::to_string(a.ranks));
  // Owners hold E/W or E/W + 1 experts; P(no expert of a token on an owner of e experts) is the
  // product over the K picks of (E - e - i) / (E - i).
  auto miss = [&](int64_t owned) {
    double p = 1;
    for (int64_t i = 0; i < a.topk; ++i) p *= std::max(0.0, D(a.experts - owned - i) / D(a.experts - i));
    return p;
  };
  const int64_t base = a.experts / a.ranks, more = a.experts % a.ranks;
  TransportFloor t;
  t.owners_per_token = D(more) * (1 - miss(base + 1)) + D(a.ranks - more) * (1 - miss(base));
  const double remote_share = D(a.ranks - 1) / D(a.ranks);
  t.remote_owners_per_token = remote_share * t.owners_per_token;
  const double row = D(a.hidden) * D(a.bytes_per_element), T = D(a.tokens);
  t.dispatch_rows = T * t.remote_owners_per_token;
  t.dispatch_bytes = t.dispatch_rows * row;
  t.slot_rows = T * D(a.topk) * remote_share;
  t.sideband_bytes = 8 * t.dispatch_rows + 16 * t.slot_rows;
  t.combine_slot_bytes = t.slot_rows * row;
  t.combine_reduced_bytes = t.dispatch_rows * row;
  const double bw = a.peer_gbps * 1e9;
  t.dispatch_time_s = t.dispatch_bytes / bw;
  t.combine_slot_time_s = t.combine_slot_bytes / bw;
  t.combine_reduced_time_s = t.combine_reduced_bytes / bw;
  t.dedup_saving = t.dispatch_rows > 0 ? t.slot_rows / t.dispatch_rows : 1;
  return t;
}

std::ostream& operator<<(std::ostream& os, const TransportFloor& t) {
  const auto flags = os.flags();
  const auto prec = os.precision();
  os << std::fixed << std::setprecision(2) << "  owners per token               " << t.owners_per_token << " (remote "
     << t.remote_owners_per_token << ")\n"
     << std::setprecision(0) << "  dispatch rows / rank           " << t.dispatch_rows << " (remote slots " << t.slot_rows
     << std::setprecision(2) << ": deduplication sends " << t.dedup_saving << "x fewer rows)\n"
     << std::setprecision(1) << "  dispatch bytes / rank          " << t.dispatch_bytes / 1e6 << " MB (+ sideband "
     << t.sideband_bytes / 1e6 << " MB), floor " << t.dispatch_time_s * 1e6 << " us\n"
     << "  combine, one row per slot      " << t.combine_slot_bytes / 1e6 << " MB, floor " << t.combine_slot_time_s * 1e6
     << " us\n"
     << "  combine, owner reduces first   " << t.combine_reduced_bytes / 1e6 << " MB, floor "
     << t.combine_reduced_time_s * 1e6 << " us\n";
  os.flags(flags);
  os.precision(prec);
  return os;
}

}  // namespace rdep::model
