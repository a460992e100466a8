#include "rdep/testing/validation.h"

#include <atomic>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>

#include "rdep/core/json.h"
#include "rdep/core/row_id.h"
#include "rdep/cuda/bf16.h"
#include "rdep/transport/host_domain.h"
#include "testing/balance_checks.h"

namespace rdep {

bool ValidationReport::passed() const {
  for (const auto& c : checks)
    if (!c.passed && !c.skipped) return false;
  return !checks.empty();
}

double NormalizedError(const std::vector<float>& a, const std::vector<double>& r, double rtol, double atol_scale) {
  if (a.size() != r.size()) return std::numeric_limits<double>::infinity();
  double rmax = 0;
  for (double v : r) rmax = std::max(rmax, std::abs(v));
  const double atol = std::max(atol_scale * rmax, 1e-30);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - r[i]) / (atol + rtol * std::abs(r[i])));
  }
  return worst;
}

double RelativeL2Error(const std::vector<float>& a, const std::vector<double>& r) {
  if (a.size() != r.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    num += (a[i] - r[i]) * (a[i] - r[i]);
    den += r[i] * r[i];
  }
  if (den == 0) return num == 0 ? 0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

namespace {

using Clock = std::chrono::steady_clock;

template <typename T>
std::vector<T> Concat(const std::vector<std::vector<T>>& v) {
  std::vector<T> out;
  for (const auto& x : v) out.insert(out.end(), x.begin(), x.end());
  return out;
}

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

bool AllFinite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

std::string Fmt(double v) {
  std::ostringstream os;
  os.precision(3);
  os << v;
  return os.str();
}

// ---- the host backend -------------------------------------------------------------------------

class HostBackend final : public ValidationBackend {
 public:
  explicit HostBackend(std::unique_ptr<HostDomain> d) : domain_(std::move(d)) {}
  std::string name() const override { return "host"; }
  std::string transport() const override { return "threads (one process)"; }
  bool bf16() const override { return false; }

  Status Smoke(std::string* detail) override {
    const int32_t W = domain_->num_ranks();
    RDEP_ASSIGN_OR_RETURN(RegionId region, domain_->AllocateSymmetric(sizeof(int64_t) * static_cast<size_t>(W), "smoke"));
    std::atomic<int64_t> wrong{0};
    RDEP_RETURN_IF_ERROR(domain_->Run([&](int32_t r) -> Status {
      for (int32_t q = 0; q < W; ++q) domain_->region_as<int64_t>(q, region)[r] = 1000 * r + q;
      RDEP_RETURN_IF_ERROR(domain_->Barrier(r, Phase::kSmoke));
      for (int32_t p = 0; p < W; ++p)
        if (domain_->region_as<int64_t>(r, region)[p] != 1000 * p + r) ++wrong;
      return Status::Ok();
    }));
    if (wrong) return InternalError(std::to_string(wrong.load()) + " peer slots wrong after the barrier");
    *detail = std::to_string(W) + " ranks, peer stores visible after barrier";
    return Status::Ok();
  }

  StatusOr<SentinelRun> Sentinel(const LayerConfig& cfg, const OwnershipMap& own, const MoEWeights& w, const Routing& routing,
                                 const std::vector<std::vector<float>>& x) override {
    RDEP_ASSIGN_OR_RETURN(auto layer, HostMoELayer::Create(*domain_, cfg, own, w));
    layer->set_expert_kind(ExpertKind::kSentinel);
    layer->set_trace(true);
    const auto W = static_cast<size_t>(cfg.shape.ranks);
    std::vector<std::vector<float>> y(W);
    for (size_t r = 0; r < W; ++r) y[r].assign(static_cast<size_t>(routing[r].num_tokens * cfg.shape.hidden), 0.f);
    RDEP_RETURN_IF_ERROR(domain_->Run([&](int32_t r) {
      const auto i = static_cast<size_t>(r);
      return layer->Forward(r, routing[i], x[i], y[i]);
    }));
    SentinelRun run;
    for (int32_t q = 0; q < cfg.shape.ranks; ++q) {
      run.acceptance.push_back(layer->acceptance(q));
      run.traces.push_back(layer->owner_trace(q));
      run.rows_per_expert.push_back(layer->owner_rows_per_expert(q));
      run.expert_out.push_back(layer->expert_outputs(q));
      run.segments = std::max(run.segments, layer->segments(q));
    }
    run.segment_size = layer->layout().S;
    run.symmetric_bytes_per_rank = layer->layout().total_bytes();
    return run;
  }

  StatusOr<LayerRun> ForwardBackward(const LayerConfig& cfg, const OwnershipMap& own, const MoEWeights& w,
                                     const Routing& routing, const std::vector<std::vector<float>>& x,
                                     const std::vector<std::vector<float>>& dy) override {
    RDEP_ASSIGN_OR_RETURN(auto layer, HostMoELayer::Create(*domain_, cfg, own, w));
    const int64_t W = cfg.shape.ranks, H = cfg.shape.hidden, K = cfg.shape.topk;
    const float nan = std::numeric_limits<float>::quiet_NaN();  // poison: unwritten outputs fail
    LayerRun out;
    out.y.resize(static_cast<size_t>(W));
    out.dx.resize(static_cast<size_t>(W));
    out.dgates.resize(static_cast<size_t>(W));
    for (size_t r = 0; r < static_cast<size_t>(W); ++r) {
      out.y[r].assign(static_cast<size_t>(routing[r].num_tokens * H), nan);
      out.dx[r].assign(out.y[r].size(), nan);
      out.dgates[r].assign(static_cast<size_t>(routing[r].num_tokens * K), nan);
    }
    RDEP_RETURN_IF_ERROR(domain_->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      RDEP_RETURN_IF_ERROR(layer->Forward(r, routing[i], x[i], out.y[i]));
      return layer->Backward(r, dy[i], out.dx[i], out.dgates[i]);
    }));
    out.dw1.assign(w.w1.size(), nan);
    out.dw2.assign(w.w2.size(), nan);
    const size_t n1 = w.w1_per_expert(), n2 = w.w2_per_expert();
    if (cfg.balance.enabled()) {
      RDEP_ASSIGN_OR_RETURN(out.balance, layer->balance_telemetry(0));
      RDEP_ASSIGN_OR_RETURN(BalancePlan plan, layer->balance_plan(0));
      for (int32_t e = 0; e < plan.num_experts; ++e)
        out.instances.push_back(plan.instance_offsets[static_cast<size_t>(e) + 1] - plan.instance_offsets[static_cast<size_t>(e)]);
    }
    if (cfg.nodes.nodes > 1) {
      for (int32_t q = 0; q < W; ++q) out.traffic.push_back(layer->node_traffic(q));
      out.wire = layer->two_phase_wire();
    }
    for (int32_t q = 0; q < W; ++q) {
      out.segments = std::max(out.segments, layer->segments(q));
      for (int32_t j = 0; j < own.num_local(q); ++j) {
        const auto e = static_cast<size_t>(own.global_expert(q, j));
        std::copy_n(layer->dw1(q).data() + static_cast<size_t>(j) * n1, n1, out.dw1.data() + e * n1);
        std::copy_n(layer->dw2(q).data() + static_cast<size_t>(j) * n2, n2, out.dw2.data() + e * n2);
      }
    }
    return out;
  }

 private:
  std::unique_ptr<HostDomain> domain_;
};

// ---- the checks ---------------------------------------------------------------------------------

// Sentinel dispatch and return: exact checks of placement, identity, acceptance and counts.
CheckResult DispatchInvariants(const SentinelRun& run, const ValidationOptions& o, const OwnershipMap& own,
                               const Routing& routing, const std::vector<std::vector<float>>& x, ValidationReport& report) {
  CheckResult c{"dispatch invariants", false, false, "", 0};
  const LayerShape& s = o.layer.shape;
  const int64_t W = s.ranks, K = s.topk, H = s.hidden;
  auto ref = ApplyCapacity(s, routing, o.layer.capacity);
  if (!ref.ok()) {
    c.detail = ref.status().ToString();
    return c;
  }
  auto place = ExpectedPlacement(o.layer, own, routing, *ref);
  if (!place.ok()) {
    c.detail = place.status().ToString();
    return c;
  }
  const RowIdCodec codec{s.tokens, K};
  int64_t wrong = 0, dropped = 0, accepted = 0, rows_at_owners = 0;
  std::ostringstream first;
  auto fail = [&](const std::string& what) {
    if (wrong++ == 0) first << what;
  };
  // Acceptance: the protocol's accepted set and gates equal the reference rule, bit for bit.
  for (int32_t r = 0; r < W; ++r) {
    const auto& a = run.acceptance[static_cast<size_t>(r)];
    const auto& b = (*ref)[static_cast<size_t>(r)];
    if (a.accepted != b.accepted) fail("rank " + std::to_string(r) + ": accepted set differs from the reference rule");
    if (a.effective_gates != b.effective_gates) fail("rank " + std::to_string(r) + ": renormalized gates differ");
    if (a.dropped != b.dropped) fail("rank " + std::to_string(r) + ": dropped count differs");
    dropped += a.dropped;
  }
  // Owner side: every row exactly once, at the right owner (or, balanced, the replica the plan gives)
  // and local expert, grouped by expert.
  std::vector<std::vector<uint8_t>> seen(static_cast<size_t>(W));
  for (size_t r = 0; r < seen.size(); ++r) seen[r].assign(static_cast<size_t>(routing[r].num_tokens * K), 0);
  for (int32_t q = 0; q < W; ++q) {
    const auto& trace = run.traces[static_cast<size_t>(q)];
    const auto num_local = static_cast<int32_t>(place->expert_at[static_cast<size_t>(q)].size());  // physical
    std::vector<int64_t> per_expert(static_cast<size_t>(num_local), 0);
    for (size_t i = 0; i < trace.size(); ++i) {
      const auto& e = trace[i];
      const RowKey key = codec.decode(e.row_id);
      if (key.rank < 0 || key.rank >= W || key.token >= routing[static_cast<size_t>(key.rank)].num_tokens ||
          e.local_expert < 0 || e.local_expert >= num_local) {
        fail("owner " + std::to_string(q) + ": row " + std::to_string(e.row_id) + " decodes outside the domain");
        continue;
      }
      const auto idx = static_cast<size_t>(key.token * K + key.slot);
      const int32_t expert = routing[static_cast<size_t>(key.rank)].experts[idx];
      if (place->rank[static_cast<size_t>(key.rank)][idx] != q || place->local[static_cast<size_t>(key.rank)][idx] != e.local_expert)
        fail("row " + std::to_string(e.row_id) + " landed at owner " + std::to_string(q) + " expert " +
             std::to_string(e.local_expert) + ", routed to expert " + std::to_string(expert));
      if (!(*ref)[static_cast<size_t>(key.rank)].accepted[idx]) fail("dropped row " + std::to_string(e.row_id) + " reached its owner");
      if (seen[static_cast<size_t>(key.rank)][idx]++) fail("row " + std::to_string(e.row_id) + " landed twice");
      if (i > 0 && trace[i - 1].segment == e.segment && trace[i - 1].local_expert > e.local_expert)
        fail("owner " + std::to_string(q) + ": rows not grouped by local expert in segment " + std::to_string(e.segment));
      ++per_expert[static_cast<size_t>(e.local_expert)];
      ++rows_at_owners;
    }
    if (per_expert != run.rows_per_expert[static_cast<size_t>(q)])
      fail("owner " + std::to_string(q) + ": per-expert counts differ from its admitted counts");
  }
  // Front-end side: every accepted slot got back its own row (identity, owner, expert, payload).
  for (int32_t r = 0; r < W; ++r) {
    const auto& rr = routing[static_cast<size_t>(r)];
    const auto& f = run.expert_out[static_cast<size_t>(r)];
    if (f.size() != static_cast<size_t>(rr.num_tokens * K * H)) {
      fail("rank " + std::to_string(r) + ": returned rows have the wrong size");
      continue;
    }
    for (int64_t t = 0; t < rr.num_tokens; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const auto idx = static_cast<size_t>(t * K + k);
        const bool acc = (*ref)[static_cast<size_t>(r)].accepted[idx];
        if (acc && !seen[static_cast<size_t>(r)][idx])
          fail("accepted row " + std::to_string(codec.encode(r, t, k)) + " never reached its owner");
        if (!acc) continue;
        ++accepted;
        const uint64_t id = codec.encode(r, t, k);
        const int32_t e = rr.experts[idx];
        const float* row = f.data() + static_cast<int64_t>(idx) * H;
        bool ok = true;
        for (int64_t col = 0; col < H; ++col) {
          const float want = col < kSentinelFields ? SentinelField(id, place->rank[static_cast<size_t>(r)][idx], e, col)
                                                   : x[static_cast<size_t>(r)][static_cast<size_t>(t * H + col)];
          ok &= (row[col] == want);
        }
        if (!ok)
          fail("rank " + std::to_string(r) + " token " + std::to_string(t) + " slot " + std::to_string(k) +
               " got back a foreign or corrupted row");
      }
  }
  int64_t routed = 0;
  for (const auto& rr : routing) routed += rr.num_tokens * K;
  if (rows_at_owners + dropped != routed)
    fail("counts do not add up: rows at owners " + std::to_string(rows_at_owners) + " + dropped " + std::to_string(dropped) +
         " != routed rows " + std::to_string(routed));
  if (accepted != rows_at_owners) fail("returned rows != rows at owners");
  report.dropped_rows = dropped;
  report.accepted_rows = accepted;
  report.segments = run.segments;
  report.segment_size = run.segment_size;
  report.symmetric_bytes_per_rank = run.symmetric_bytes_per_rank;
  c.passed = (wrong == 0);
  c.detail = "rows " + std::to_string(routed) + " = accepted " + std::to_string(accepted) + " + dropped " +
             std::to_string(dropped) + ", segments " + std::to_string(run.segments);
  if (H <= kSentinelFields) c.detail += " (H <= 10: identity fields only)";
  if (wrong) c.detail = std::to_string(wrong) + " violation(s); first: " + first.str();
  return c;
}

// A non-host backend's routing context equals the host backend's at the same segment size.
CheckResult HostAgreement(const SentinelRun& run, const ValidationOptions& o, const OwnershipMap& own, const MoEWeights& w,
                          const Routing& routing, const std::vector<std::vector<float>>& x) {
  CheckResult c{"host agreement (bitwise)", false, false, "", 0};
  auto host = MakeHostBackend(o.layer.shape.ranks, o.barrier_timeout_s);
  if (!host.ok()) {
    c.detail = host.status().ToString();
    return c;
  }
  LayerConfig cfg = o.layer;
  cfg.segment_tokens = run.segment_size;
  cfg.owner_reduce = false;  // as the sentinel run it is compared with
  cfg.gate_in_expert = false;
  auto ref = (*host)->Sentinel(cfg, own, w, routing, x);
  if (!ref.ok()) {
    c.detail = "host run failed: " + ref.status().ToString();
    return c;
  }
  std::string diff;
  for (size_t r = 0; r < run.acceptance.size() && diff.empty(); ++r) {
    if (run.acceptance[r].accepted != ref->acceptance[r].accepted) diff = "accepted set of rank " + std::to_string(r);
    else if (run.acceptance[r].effective_gates != ref->acceptance[r].effective_gates) diff = "gates of rank " + std::to_string(r);
    else if (run.acceptance[r].dropped != ref->acceptance[r].dropped) diff = "drops of rank " + std::to_string(r);
    else if (run.rows_per_expert[r] != ref->rows_per_expert[r]) diff = "per-expert counts of owner " + std::to_string(r);
    else if (run.traces[r].size() != ref->traces[r].size()) diff = "row count at owner " + std::to_string(r);
    else
      for (size_t i = 0; i < run.traces[r].size() && diff.empty(); ++i) {
        const auto &a = run.traces[r][i], &b = ref->traces[r][i];
        if (a.row_id != b.row_id || a.local_expert != b.local_expert || a.segment != b.segment || a.group_position != b.group_position)
          diff = "placement at owner " + std::to_string(r) + " grouped row " + std::to_string(i) + " (row_id " +
                 std::to_string(a.row_id) + " vs host " + std::to_string(b.row_id) + ")";
      }
  }
  (void)own;
  c.passed = diff.empty();
  c.detail = c.passed ? "accepted set, gates, drops, per-expert counts and grouped placement equal the host's (S=" +
                            std::to_string(run.segment_size) + ")"
                      : "differs from host: " + diff;
  return c;
}

// The eight counts of one rank's traffic as fields PREFIX + "inter_dispatch_rows", ... (phase names
// with '_' for ' ' and '-').
void WriteTrafficCounts(JsonWriter& j, const std::string& prefix, const model::RankPhaseTraffic& t) {
  for (const model::PhaseField& f : model::kTwoPhaseFields) {
    std::string name = f.name;
    std::replace_if(name.begin(), name.end(), [](char c) { return c == ' ' || c == '-'; }, '_');
    j.field(prefix + name + "_rows", t.*f.rows).field(prefix + name + "_bytes", t.*f.bytes);
  }
}

}  // namespace

Footprint EstimateValidationFootprint(const ValidationOptions& o, bool device_backend) {
  const LayerShape& s = o.layer.shape;
  auto pos = [](int64_t v) { return static_cast<double>(v > 0 ? v : 0); };
  const double W = std::max(1.0, pos(s.ranks)), T = pos(s.tokens), H = pos(s.hidden), F = pos(s.ffn),
               E = std::max(1.0, pos(s.experts)), K = pos(s.topk);
  const double L = std::ceil(E / W);                   // most local experts on one rank
  const double slots = std::max(1.0, std::min(K, L + (o.layer.balance.enabled() ? pos(o.layer.balance.num_slots) : 0.0)));  // sideband slots per token
  const double S_host = o.layer.segment_tokens > 0 ? pos(o.layer.segment_tokens) : std::max(1.0, T);
  const double params = E * 3 * H * F;                 // W1 [H][2F] and W2 [F][H] per expert
  const double rows = W * T * K;                       // dropless route rows over the domain
  Footprint fp;
  // Host. Weights: the fp32 weights, the layer's copy and gradient, the fp32 gradients of two runs
  // (segment invariance keeps both), the fp64 reference gradients and slack: 32 bytes per parameter.
  fp.host.push_back({"expert weights and gradients (E*3*H*D_ff parameters)",
                     {{"experts", E}, {"hidden", H}, {"ffn", F}}, 32 * params});
  // Returned rows [W*T*K][H]: the sentinel run's copy, the layer's rows and return region, the
  // owners' saved activations (fp32) and the reference's fp64 rows.
  fp.host.push_back({"returned rows (W*T*K rows of H values)", {{"ranks", W}, {"tokens", T}, {"topk", K}, {"hidden", H}},
                     28 * rows * H});
  // Activations [W*T][H]: x, dy, y and dx of two runs, the fp64 reference y and dx, concatenations.
  fp.host.push_back({"activations (W*T tokens of H values)", {{"ranks", W}, {"tokens", T}, {"hidden", H}}, 64 * W * T * H});
  // Per route row: experts, gates, acceptance (reference, layer, sentinel), owner traces, gradients.
  fp.host.push_back({"routing and acceptance (W*T*K rows)", {{"ranks", W}, {"tokens", T}, {"topk", K}}, 96 * rows});
  // Per rank pair: control regions [W][2*W*L + 4*W] int64 and the forward context's copy of them,
  // barrier slots, per-peer token lists.
  fp.host.push_back({"control regions and barrier slots (W*W*L words)", {{"ranks", W}, {"experts", E}},
                     W * (32 * W * L + 64 * W) + 48 * W * W});
  // Segment payload and sideband on every rank: two buffers when a call can have several segments, else one
  // (RegionLayout::buffers: S >= W*T).
  const double seg_buffers = S_host >= W * T ? 1.0 : 2.0;
  fp.host.push_back({"segment buffers (W ranks x 1 or 2 buffers of S tokens: 2 when a call has several segments)",
                     {{"ranks", W}, {"segment", S_host}, {"buffers", seg_buffers}, {"hidden", H}},
                     W * seg_buffers * S_host * (4 * H + 8 + 16 * slots)});
  // Routing generator and ownership tables over E; rank threads (stack pages touched, bookkeeping).
  fp.host.push_back({"per-expert tables (E entries)", {{"experts", E}}, 96 * E});
  fp.host.push_back({"rank threads (W threads)", {{"ranks", W}}, 256.0 * 1024 * W});
  if (o.layer.nodes.nodes > 1) {  // two-phase: the return region holds N sources' rows; relays keep tokens and rows
    const double N = pos(o.layer.nodes.nodes);
    fp.host.push_back({"two-phase relay buffers and return regions (N*T*K rows of H values per rank)",
                       {{"nodes", N}, {"ranks", W}, {"tokens", T}, {"topk", K}, {"hidden", H}}, W * N * T * (K + 2) * H * 8 + W * N * T * K * 64});
  }
  if (o.layer.balance.enabled())  // replica slots: weights and gradients of N_slot experts per rank
    fp.host.push_back({"replica slots (W*N_slot experts' weights and gradients)",
                       {{"ranks", W}, {"slots", pos(o.layer.balance.num_slots)}, {"hidden", H}, {"ffn", F}},
                       W * pos(o.layer.balance.num_slots) * 3 * H * F * 8});
  if (device_backend) {
    // One GPU (one rank): bf16 regions with the CUDA default segment S = W*T, weights and fp32
    // gradients of its experts, per-row metadata, the saved expert outputs and the received rows'
    // activations and SwiGLU inputs (balanced: T*K rows per owner).
    const double S_dev = o.layer.segment_tokens > 0 ? pos(o.layer.segment_tokens) : std::max(1.0, W * T);
    fp.device.push_back({"expert weights and gradients of one rank (L*3*H*D_ff)", {{"experts", E}, {"ranks", W}, {"hidden", H}, {"ffn", F}},
                         12 * L * 3 * H * F});
    // On one domain the segment buffers and the return region are shared by the layers of their size
    // (LayerRegions::shared_transport): terms named "shared ..." (a stack's estimate counts them once).
    const bool one_domain = o.layer.nodes.nodes <= 1;
    const double dev_buffers = S_dev >= W * T ? 1.0 : 2.0;  // RegionLayout::buffers: one when a call is one segment
    fp.device.push_back({std::string(one_domain ? "shared " : "") +
                             "segment buffers (1 of S = W*T tokens by default; 2 when a call has several segments)",
                         {{"ranks", W}, {"tokens", T}, {"segment", S_dev}, {"buffers", dev_buffers}, {"hidden", H}},
                         dev_buffers * S_dev * (2 * H + 8 + 16 * slots)});
    // The owner's row buffers sized at Create for one segment's most rows (MaxSegmentRows: S*min(K, L +
    // N_slot), with a capacity at most (L + N_slot)*capacity): the output rows (OwnerOutputRowSets sets of H,
    // bf16) and the expert compute's workspace (CUTLASS: z, 2*D_ff bytes a row; cuBLASLt: z, dz, dh, 8*D_ff
    // bytes a row, and 64 MiB of workspace). What a
    // forward saves for its backward (terms named "context: ..."; CheckLayerBenchFootprint counts one per
    // context): the received rows' x and SwiGLU inputs by the rows received (T*K per owner, balanced), or,
    // on the sync-free path (CUTLASS, no balancing), by the segment bound times the segments; the front-end's
    // returned rows (not with owner_reduce or gate_in_expert).
    const double L_phys = L + (o.layer.balance.enabled() ? pos(o.layer.balance.num_slots) : 0.0);
    double seg_rows = std::max(1.0, S_dev * std::max(1.0, std::min(K, L_phys)));
    if (!o.layer.capacity.dropless())
      seg_rows = std::max(1.0, std::min(seg_rows, L_phys * static_cast<double>(o.layer.capacity.ExpertCapacity(s))));
    // Sync-free: CUTLASS, no balancing, and one segment or one node; ceil(W*T/S) segments of seg_rows each.
    const bool sync_free = o.layer.expert_compute == ExpertComputeKind::kCutlass && !o.layer.balance.enabled() &&
                           (S_dev >= W * T || o.layer.nodes.nodes <= 1);
    const double saved_rows = sync_free ? std::ceil(std::max(1.0, W * T) / S_dev) * seg_rows : T * K;
    // One set, two without the CUTLASS compute, with balancing or with overlapped segments (the segment-invariance
    // run at S/3 overlaps when the layer may, with rows a capacity may keep as large).
    const auto out_sets = o.layer.overlap_segments ? 2.0 : static_cast<double>(OwnerOutputRowSets(o.layer, static_cast<int64_t>(S_dev)));
    fp.device.push_back({"shared output rows of one owner segment (MaxSegmentRows rows of H, one set, two without the CUTLASS compute, "
                         "with balancing or with overlapped segments; one for every layer of the size)",
                         {{"segment", S_dev}, {"topk", K}, {"hidden", H}}, seg_rows * out_sets * 2 * H});
    if (o.layer.expert_compute == ExpertComputeKind::kCutlass) {  // its SwiGLU scratch is shared like the output rows
      fp.device.push_back({"shared expert scratch of one owner segment (MaxSegmentRows rows of D_ff; one set for every CUTLASS layer of the size)",
                           {{"segment", S_dev}, {"topk", K}, {"ffn", F}}, seg_rows * 2 * F});
      fp.device.push_back({"expert compute's tables and GEMM workspace", {{"experts", E}}, 64.0 * (1 << 20)});
    } else {
      fp.device.push_back({"expert workspace of one owner segment (MaxSegmentRows rows)",
                           {{"segment", S_dev}, {"topk", K}, {"ffn", F}}, seg_rows * 8 * F + 64.0 * (1 << 20)});
    }
    fp.device.push_back({std::string(one_domain ? "shared " : "") + "return region (T*K rows of H)", {{"tokens", T}, {"topk", K}, {"hidden", H}},
                         2 * T * K * H});
    // The paged stash (LayerConfig::stash_rows): the worst case once, as transient rows shared by the
    // domain's layers, and the pool's pages; a context then keeps only its page table.
    const bool stash = sync_free && o.layer.stash_rows > 0;
    const double f_bytes = OwnerKeepsOutputs(o.layer) ? 2 * H : 0.0;  // owner_reduce's kept outputs ride in the stash's rows
    if (stash) {
      fp.device.push_back({"shared stash transient rows, sync-free worst case (ceil(W*T/S) * MaxSegmentRows rows of H and 2*D_ff values, + H with owner_reduce without the gate)",
                           {{"tokens", T}, {"topk", K}, {"hidden", H}, {"ffn", F}}, saved_rows * (2 * H + 4 * F + f_bytes)});
      const double pool_rows = 64.0 * std::ceil(static_cast<double>(o.layer.stash_rows) / 64.0);
      fp.device.push_back({"shared stash pool (--stash-rows rows of H and 2*D_ff values, + H with owner_reduce without the gate)",
                           {{"stash rows", pool_rows}, {"hidden", H}, {"ffn", F}}, pool_rows * (2 * H + 4 * F + f_bytes) + 4 * pool_rows / 64 + 16});
      fp.device.push_back({"context: saved rows' index and page table", {{"tokens", T}, {"topk", K}}, saved_rows * 32 + 4 * saved_rows / 64});
    } else {
      fp.device.push_back({sync_free ? "context: saved rows, sync-free worst case (ceil(W*T/S) * MaxSegmentRows rows of H and 2*D_ff values)"
                                     : "context: saved rows of one rank (T*K rows of H and 2*D_ff values)",
                           {{"tokens", T}, {"topk", K}, {"hidden", H}, {"ffn", F}}, saved_rows * (2 * H + 4 * F + 32)});
    }
    if (!OwnersTakeDgateDots(o.layer))
      fp.device.push_back({"context: the front-end's returned rows (T*K rows of H)", {{"tokens", T}, {"topk", K}, {"hidden", H}},
                           2 * T * K * H});
    // Phase 1's count scratch (per 256-token block and owner, L + 1 words) and the expansion's (per
    // 32-position chunk, one word per physical expert).
    fp.device.push_back({"control region, token index and phase-1/expansion scratch (W*L words, W*T tokens)",
                         {{"ranks", W}, {"experts", E}, {"tokens", T}, {"segment", S_dev}},
                         16 * W * L + 32 * W + 4 * W * T + 16 * E + 4 * W * std::max(1.0, std::ceil(T / 256.0)) * (L_phys + 1) +
                             4 * std::ceil(S_dev / 32.0) * L_phys});
    fp.device.push_back({"activations of one rank (T tokens of H values)", {{"tokens", T}, {"hidden", H}}, 16 * T * H});
    if (o.layer.owner_reduce)  // the owner keeps its f_k rows for dgate (not with gate_in_expert); the dots region
      fp.device.push_back({"context: owner_reduce's kept expert outputs and dots (saved rows of H, T*K floats)",
                           {{"tokens", T}, {"topk", K}, {"hidden", H}},
                           (stash || !OwnerKeepsOutputs(o.layer) ? 0.0 : saved_rows * 2 * H) + T * K * 8});
    if (o.layer.gate_in_expert)  // one segment's per-row dgates, and the dots region unless owner_reduce counted it
      fp.device.push_back({"gate_in_expert's per-row dgates and dots region (MaxSegmentRows floats, T*K floats)",
                           {{"tokens", T}, {"topk", K}, {"segment", S_dev}}, seg_rows * 4 + (o.layer.owner_reduce ? 0.0 : T * K * 4)});
    if (o.layer.balance.enabled())  // redundant slots: bf16 weights, fp32 gradients; the slots' one-expert compute
      fp.device.push_back({"replica slots of one rank (N_slot experts' weights and gradients)",
                           {{"slots", pos(o.layer.balance.num_slots)}, {"hidden", H}, {"ffn", F}, {"segment", S_dev}},
                           pos(o.layer.balance.num_slots) * 3 * H * F * 6 + S_dev * (8 * F + 4 * H) + 8.0 * (1 << 20)});
  }
  // Work: Gumbel top-K routing draws one key per expert per token; the MLP is 6*H*D_ff flops per row
  // forward and twice that backward, run by the fp64 reference and by the layer twice (host) or by the
  // reference alone (device); the sentinel check reads every row; each phase barrier polls W slots on
  // W ranks, a few per segment, over five runs of the domain.
  if (o.routing.family == RoutingSpec::Family::kOneExpert)
    fp.work.push_back({"routing (W*T*K rows)", {{"ranks", W}, {"tokens", T}, {"topk", K}}, 8 * rows});
  else
    fp.work.push_back({"Gumbel top-K routing (one draw per expert per token)", {{"ranks", W}, {"tokens", T}, {"experts", E}}, 30 * W * T * E});
  fp.work.push_back({"expert MLP and reference (6*H*D_ff flops per row and pass)",
                     {{"ranks", W}, {"tokens", T}, {"topk", K}, {"hidden", H}, {"ffn", F}}, (device_backend ? 18.0 : 54.0) * rows * H * F});
  fp.work.push_back({"sentinel and parity checks (every row's H values)", {{"ranks", W}, {"tokens", T}, {"topk", K}, {"hidden", H}}, 40 * rows * H});
  const double segments = std::ceil(T * std::max(1.0, std::min(K, W)) / S_host);
  fp.work.push_back({"phase barriers (W ranks poll W slots, a few per segment) and rank threads", {{"ranks", W}, {"segment", S_host}},
                     5 * (6 + 4 * segments) * W * W * 16 + 5 * W * 100000});
  return fp;
}

StatusOr<std::unique_ptr<ValidationBackend>> MakeHostBackend(int64_t num_ranks, double barrier_timeout_s) {
  RDEP_ASSIGN_OR_RETURN(auto domain, HostDomain::Create(num_ranks, {.barrier_timeout_s = barrier_timeout_s}));
  return std::unique_ptr<ValidationBackend>(new HostBackend(std::move(domain)));
}

StatusOr<ValidationReport> RunHostValidation(const ValidationOptions& o) {
  RDEP_RETURN_IF_ERROR(o.layer.Validate());
  RDEP_ASSIGN_OR_RETURN(auto backend, MakeHostBackend(o.layer.shape.ranks, o.barrier_timeout_s));
  return RunValidation(o, *backend);
}

StatusOr<ValidationReport> RunValidation(const ValidationOptions& o, ValidationBackend& backend) {
  RDEP_RETURN_IF_ERROR(o.layer.Validate());
  const LayerShape& s = o.layer.shape;
  if (o.routing.empty_rank >= s.ranks)
    return InvalidArgument("empty rank " + std::to_string(o.routing.empty_rank) + " is outside [0, W=" + std::to_string(s.ranks) + ")");
  RDEP_ASSIGN_OR_RETURN(auto own, OwnershipMap::Contiguous(s.experts, s.ranks));
  RDEP_ASSIGN_OR_RETURN(auto routing, GenerateRouting(s, o.routing));
  if (o.layer.nodes.cap() < o.layer.nodes.nodes)  // node-limited: the first M nodes of each token are kept
    RDEP_RETURN_IF_ERROR(LimitRoutingNodes(routing, NodeOfExpert(own, o.layer), o.layer.nodes.cap()));
  RDEP_ASSIGN_OR_RETURN(MoEWeights w, RandomWeights(s, o.seed).InLayout(o.layer.gate_up));  // w1 in the layer's layout
  auto x = RandomActivations(s, routing, o.seed + 1);
  auto dy = RandomActivations(s, routing, o.seed + 2);
  if (backend.bf16()) {  // the reference sees exactly what the device sees
    for (auto* v : {&w.w1, &w.w2})
      for (float& f : *v) f = RoundToBf16(f);
    for (auto* t : {&x, &dy})
      for (auto& r : *t)
        for (float& f : r) f = RoundToBf16(f);
  }
  ValidationReport rep;
  rep.backend = backend.name();
  rep.transport = backend.transport();
  auto timed = [&](auto&& fn) {
    const auto t0 = Clock::now();
    CheckResult c = fn();
    c.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    rep.checks.push_back(std::move(c));
  };

  timed([&] {
    CheckResult c{"smoke", false, false, "", 0};
    Status st = backend.Smoke(&c.detail);
    c.passed = st.ok();
    if (!st.ok()) c.detail = st.ToString();
    return c;
  });
  std::optional<SentinelRun> sentinel;
  timed([&] {
    LayerConfig sentinel_cfg = o.layer;  // identities need a row per slot back: owner_reduce would sum them
    sentinel_cfg.owner_reduce = false;
    sentinel_cfg.gate_in_expert = false;  // the sentinel expert echoes identities: nothing to weight
    auto run = backend.Sentinel(sentinel_cfg, own, w, routing, x);
    if (!run.ok()) return CheckResult{"dispatch invariants", false, false, run.status().ToString(), 0};
    sentinel = std::move(*run);
    return DispatchInvariants(*sentinel, o, own, routing, x, rep);
  });
  if (backend.name() != "host") {
    timed([&] {
      if (!sentinel) return CheckResult{"host agreement (bitwise)", false, false, "no sentinel run to compare", 0};
      return HostAgreement(*sentinel, o, own, w, routing, x);
    });
  }

  auto ref_fwd = ReferenceForward(s, w, routing, o.layer.capacity, x);
  auto ref_bwd = ReferenceBackward(s, w, routing, o.layer.capacity, x, dy);
  if (!ref_fwd.ok()) return ref_fwd.status();
  if (!ref_bwd.ok()) return ref_bwd.status();
  const auto t0 = Clock::now();
  auto run = backend.ForwardBackward(o.layer, own, w, routing, x, dy);
  const double run_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!run.ok()) {
    for (const char* name : {"forward parity", "gradient parity", "finite outputs and gradients", "segment invariance"})
      rep.checks.push_back({name, false, false, run.status().ToString(), 0});
    return rep;
  }
  // The error metric, as a ratio to the tolerance (passes <= 1): max-normalized for fp32 backends,
  // relative L2 over its bound for bf16 ones.
  auto err = [&](const std::vector<float>& a, const std::vector<double>& r) {
    return backend.bf16() ? RelativeL2Error(a, r) / o.rel_l2 : NormalizedError(a, r, o.rtol, o.atol_scale);
  };
  const std::string metric = backend.bf16() ? "error/tolerance" : "normalized error";
  const std::string bound = backend.bf16() ? " (error/tolerance = (||out-ref||/||ref||) / " + Fmt(o.rel_l2) + "; passes <= 1)"
                                         : " (max |out-ref| / (" + Fmt(o.atol_scale) + "*max|ref| + " + Fmt(o.rtol) +
                                               "*|ref|); passes <= 1)";
  {
    const double e = err(Concat(run->y), Concat(ref_fwd->y));
    rep.checks.push_back({"forward parity", e <= 1.0, false, "y " + metric + " " + Fmt(e) + bound, run_s});
  }
  {
    const double edx = err(Concat(run->dx), Concat(ref_bwd->dx));
    const double edg = err(Concat(run->dgates), Concat(ref_bwd->dgates));
    const double ew1 = err(run->dw1, ref_bwd->dw1);
    const double ew2 = err(run->dw2, ref_bwd->dw2);
    const bool ok = edx <= 1 && edg <= 1 && ew1 <= 1 && ew2 <= 1;
    rep.checks.push_back({"gradient parity", ok, false,
                          metric + " dx " + Fmt(edx) + ", dgate " + Fmt(edg) + ", dW1 " + Fmt(ew1) + ", dW2 " + Fmt(ew2) +
                              " (passes <= 1)",
                          0});
  }
  {
    const bool ok = AllFinite(Concat(run->y)) && AllFinite(Concat(run->dx)) && AllFinite(Concat(run->dgates)) &&
                    AllFinite(run->dw1) && AllFinite(run->dw2);
    rep.checks.push_back({"finite outputs and gradients", ok, false,
                          ok ? "y, dx, dgate, dW1, dW2 finite on every rank" : "non-finite values", 0});
  }
  if (o.layer.nodes.nodes > 1) {
    rep.traffic = run->traffic;
    timed([&] {  // the prediction for this routing and accepted set, then the measured counts against it
      auto accepted = ApplyCapacity(s, routing, o.layer.capacity);
      if (!accepted.ok()) return CheckResult{"two-phase traffic = rdep model", false, false, accepted.status().ToString(), 0};
      auto predicted = model::PredictTwoPhaseTraffic(routing, *accepted, own, o.layer.nodes.nodes, run->wire);
      if (!predicted.ok()) return CheckResult{"two-phase traffic = rdep model", false, false, predicted.status().ToString(), 0};
      rep.traffic_model = std::move(*predicted);
      for (const auto& t : rep.traffic_model) rep.inter_rows_expected += t.inter_dispatch_rows;
      return TwoPhaseTrafficCheck(run->traffic, rep.traffic_model);
    });
    timed([&] {
      LayerConfig one = o.layer;
      one.nodes = NodeConfig{};
      auto plain = backend.ForwardBackward(one, own, w, routing, x, dy);
      if (!plain.ok()) return CheckResult{"two-phase vs one domain", false, false, "one-domain run: " + plain.status().ToString(), 0};
      // bf16 outputs: the per-node reassociation may move an element by one bf16 rounding (2^-8 of it).
      return NodeAgreement(*run, *plain, rep.inter_rows_expected, backend.bf16() ? 1e-2 : 1e-5);
    });
  }
  if (o.layer.balance.enabled()) {
    rep.balanced = true;
    rep.balance = run->balance;
    timed([&] {
      LayerConfig off = o.layer;
      off.balance = BalanceConfig{};
      auto plain = backend.ForwardBackward(off, own, w, routing, x, dy);
      if (!plain.ok()) return CheckResult{"balancing exactness", false, false, "run without balancing: " + plain.status().ToString(), 0};
      // owner_reduce sums a token's rows per computing rank, and replicas move rows between ranks: y and
      // dx are then reassociated (fp32: within 1e-5), the rest stays as without it.
      return BalancingExactness(*run, *plain, s, backend.bf16() ? o.rel_l2 : 0.0, o.layer.owner_reduce ? 1e-5 : 0.0);
    });
  }
  timed([&] {
    CheckResult c{"segment invariance", false, false, "", 0};
    LayerConfig other = o.layer;
    const int64_t S = sentinel ? sentinel->segment_size : o.layer.segment();
    other.segment_tokens = S > 1 ? std::max<int64_t>(1, S / 3) : 2;
    auto run2 = backend.ForwardBackward(other, own, w, routing, x, dy);
    if (!run2.ok()) {
      c.detail = run2.status().ToString();
      return c;
    }
    std::string how;
    if (!backend.bf16()) {
      c.passed = run2->y == run->y && run2->dx == run->dx && run2->dgates == run->dgates && run2->dw1 == run->dw1 &&
                 run2->dw2 == run->dw2;
      how = c.passed ? "bitwise equal" : "outputs differ";
    } else {
      const double e = std::max({err(Concat(run2->y), ToDouble(Concat(run->y))), err(Concat(run2->dx), ToDouble(Concat(run->dx))),
                                 err(run2->dw1, ToDouble(run->dw1)), err(run2->dw2, ToDouble(run->dw2))});
      c.passed = e <= 1.0;
      how = "max error/tolerance " + Fmt(e) + " (passes <= 1)";
    }
    c.detail = "S=" + std::to_string(S) + " (" + std::to_string(run->segments) + " segments) vs S=" +
               std::to_string(other.segment_tokens) + " (" + std::to_string(run2->segments) + " segments): " + how;
    return c;
  });
  return rep;
}

std::string ValidationReport::ToJson(const ValidationOptions& o) const {
  JsonWriter j;
  const LayerShape& s = o.layer.shape;
  j.begin_object();
  j.field("tool", "rdep check").field("backend", backend).field("transport", transport).field("passed", passed());
  j.key("config").begin_object();
  j.field("ranks", s.ranks).field("tokens", s.tokens).field("hidden", s.hidden).field("ffn", s.ffn);
  j.field("experts", s.experts).field("topk", s.topk).field("routing", o.routing.name());
  j.field("empty_rank", o.routing.empty_rank).field("capacity_factor", o.layer.capacity.capacity_factor);
  // The segment size and buffer bytes come from the dispatch run; null when it did not complete.
  const bool measured = symmetric_bytes_per_rank > 0;
  if (measured) j.field("segment", segment_size);
  else j.field("segment", std::nan(""));
  j.field("seed", static_cast<int64_t>(o.seed));
  j.field("routing_seed", static_cast<int64_t>(o.routing.seed)).field("rtol", o.rtol).field("atol_scale", o.atol_scale);
  j.field("rel_l2", o.rel_l2);
  j.field("balance", BalanceKindName(o.layer.balance.kind));
  j.field("nodes", static_cast<int64_t>(o.layer.nodes.nodes)).field("max_nodes", static_cast<int64_t>(o.layer.nodes.cap()));
  if (o.layer.balance.enabled()) j.field("slots", static_cast<int64_t>(o.layer.balance.num_slots)).field("min_quota", o.layer.balance.min_quota);
  j.end_object();
  if (!traffic.empty()) {
    j.key("two_phase").begin_object().field("inter_rows_expected", inter_rows_expected);
    j.key("per_rank").begin_array();  // measured beside rdep model's prediction for the same routing
    for (size_t r = 0; r < traffic.size(); ++r) {
      const auto& t = traffic[r];
      j.begin_object();
      WriteTrafficCounts(j, "", t.Counts());
      if (r < traffic_model.size()) WriteTrafficCounts(j, "model_", traffic_model[r]);
      j.field("dispatch_s", t.dispatch_s).field("intra_s", t.intra_s).field("combine_s", t.combine_s).end_object();
    }
    j.end_array().end_object();
  }
  if (balanced) {
    j.key("balance").begin_object();
    j.field("owner_max_over_mean_before", balance.imbalance_before).field("max_over_mean_after", balance.imbalance_after);
    j.field("replicas", static_cast<int64_t>(balance.replicas)).field("slots", static_cast<int64_t>(balance.slots));
    j.field("slot_limited", balance.slot_limited).field("weight_bytes_streamed", balance.weight_bytes);
    j.field("relayed_experts", static_cast<int64_t>(balance.relayed_experts));
    j.end_object();
  }
  if (measured) j.field("accepted_rows", accepted_rows).field("dropped_rows", dropped_rows).field("segments", segments);
  else j.field("accepted_rows", std::nan("")).field("dropped_rows", std::nan("")).field("segments", std::nan(""));
  if (measured) j.field("symmetric_bytes_per_rank", static_cast<int64_t>(symmetric_bytes_per_rank));
  else j.field("symmetric_bytes_per_rank", std::nan(""));
  j.key("checks").begin_array();
  for (const auto& c : checks) {
    j.begin_object().field("name", c.name).field("passed", c.passed).field("skipped", c.skipped);
    j.field("detail", c.detail).field("seconds", c.seconds).end_object();
  }
  j.end_array().end_object();
  return j.str();
}

}  // namespace rdep
