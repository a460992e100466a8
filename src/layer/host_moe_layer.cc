// The RDEP protocol on the host backend. Layout of the regions: rdep/layer/layer_config.h.
#include "rdep/layer/host_moe_layer.h"

#include <algorithm>
#include <cstring>

#include "rdep/core/expert_mlp.h"
#include "rdep/core/row_id.h"
#include "layer/context_access.h"

namespace rdep {

// The layer's own state per rank: this rank's experts (owner role), their gradients, and the
// context of calls made without one.
struct HostMoELayer::RankState {
  std::vector<float> w1, w2, dw1, dw2;  // the layer's own copy (empty for a layer created without weights)
  size_t w1_count = 0, w2_count = 0;    // E_loc * H * 2F, E_loc * F * H
  ExternalWeights<float, float> bound;  // the caller's, when bound
  ForwardContext own_context;

  const float* W1() const { return bound.w1 ? bound.w1 : w1.data(); }
  const float* W2() const { return bound.w2 ? bound.w2 : w2.data(); }
  float* DW1() { return bound.dw1 ? bound.dw1 : dw1.data(); }
  float* DW2() { return bound.dw2 ? bound.dw2 : dw2.data(); }
  bool has_weights() const { return bound.w1 || !w1.empty() || w1_count == 0; }
  bool has_grads() const { return bound.dw1 || !dw1.empty() || w1_count == 0; }
};

// What a forward saves for its backward on one rank (held by a ForwardContext).
struct HostMoELayer::Saved final : ForwardContext::State {
  // Front-end: the accepted route set and its placement.
  int64_t num_tokens = 0;
  RankRouting routing;
  RankAcceptance acceptance;
  std::vector<std::vector<int32_t>> tokens_to;  // [W] tokens with a slot on owner q, token order
  std::vector<int64_t> stream_base;             // [W] base of this rank's tokens in q's stream
  int64_t num_segments = 0;
  std::vector<float> expert_out;                // [n*K*H] returned rows f_k(x_t), 0 if dropped
  // Owner: the token stream this rank received.
  int64_t stream_tokens = 0;
  std::vector<float> saved_x;                   // [stream_tokens][H]
  std::vector<int64_t> rows_per_expert;         // [E_loc] admitted rows
  std::vector<OwnerTraceEntry> trace;
  std::vector<int64_t> load;                    // [W][E] the full load matrix (LayerConfig::load_matrix)
  size_t bytes() const override {
    size_t b = load.size() * 8 + routing.experts.size() * 4 + routing.gates.size() * 4 + acceptance.accepted.size() +
               acceptance.effective_gates.size() * 4 + (expert_out.size() + saved_x.size()) * 4 +
               (stream_base.size() + rows_per_expert.size()) * 8 + trace.size() * sizeof(OwnerTraceEntry);
    for (const auto& v : tokens_to) b += v.size() * 4;
    return b;
  }
};

HostMoELayer::HostMoELayer(HostDomain& domain, LayerConfig config, OwnershipMap ownership)
    : domain_(domain), config_(std::move(config)), ownership_(std::move(ownership)), id_(ContextAccess::NewLayerId()) {}

Status HostMoELayer::CheckRank(int32_t rank) const {
  if (rank < 0 || rank >= config_.shape.ranks)
    return InvalidArgument("rank " + std::to_string(rank) + " outside [0, W=" + std::to_string(config_.shape.ranks) + ")");
  return Status::Ok();
}

HostMoELayer::~HostMoELayer() {
  regions_.Free(domain_);
}

StatusOr<std::unique_ptr<HostMoELayer>> HostMoELayer::Create(HostDomain& domain, const LayerConfig& config,
                                                            const OwnershipMap& ownership, const MoEWeights& weights) {
  RDEP_RETURN_IF_ERROR(ValidateLayerInputs(config, domain.num_ranks(), ownership, weights));
  return CreateLayer(domain, config, ownership, &weights);
}

StatusOr<std::unique_ptr<HostMoELayer>> HostMoELayer::Create(HostDomain& domain, const LayerConfig& config,
                                                            const OwnershipMap& ownership) {
  RDEP_RETURN_IF_ERROR(ValidateLayerInputs(config, domain.num_ranks(), ownership));
  return CreateLayer(domain, config, ownership, nullptr);
}

StatusOr<std::unique_ptr<HostMoELayer>> HostMoELayer::CreateLayer(HostDomain& domain, const LayerConfig& config,
                                                                 const OwnershipMap& ownership, const MoEWeights* weights) {
  const LayerShape& s = config.shape;
  std::unique_ptr<HostMoELayer> layer(new HostMoELayer(domain, config, ownership));
  layer->layout_ = MakeRegionLayout(config, ownership, sizeof(float));
  const RegionLayout& l = layer->layout_;
  RDEP_ASSIGN_OR_RETURN(layer->regions_, LayerRegions::Allocate(domain, l));
  const auto n1 = static_cast<size_t>(s.hidden * 2 * s.ffn), n2 = static_cast<size_t>(s.ffn * s.hidden);
  for (int32_t q = 0; q < s.ranks; ++q) {
    auto st = std::make_unique<RankState>();
    const auto L = static_cast<size_t>(ownership.num_local(q));
    st->w1_count = L * n1;
    st->w2_count = L * n2;
    if (weights) {
      st->w1.resize(L * n1);
      st->w2.resize(L * n2);
      for (size_t j = 0; j < L; ++j) {
        const auto e = static_cast<size_t>(ownership.global_expert(q, static_cast<int32_t>(j)));
        std::copy_n(weights->w1.data() + e * n1, n1, st->w1.data() + j * n1);
        std::copy_n(weights->w2.data() + e * n2, n2, st->w2.data() + j * n2);
      }
      st->dw1.assign(st->w1.size(), 0.f);
      st->dw2.assign(st->w2.size(), 0.f);
    }
    layer->ranks_.push_back(std::move(st));
  }
  return layer;
}

Status HostMoELayer::BindExpertWeights(int32_t rank, const ExternalWeights<float, float>& w) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  RDEP_RETURN_IF_ERROR(w.Validate(rank));
  ranks_[static_cast<size_t>(rank)]->bound = w;
  return Status::Ok();
}

const HostMoELayer::Saved& HostMoELayer::last(int32_t r) const {
  static const Saved kEmpty;
  const Saved* saved = ContextAccess::Peek<Saved>(ranks_[static_cast<size_t>(r)]->own_context, id_, r);
  return saved ? *saved : kEmpty;
}

const RankAcceptance& HostMoELayer::acceptance(int32_t r) const { return last(r).acceptance; }
int64_t HostMoELayer::segments(int32_t r) const { return last(r).num_segments; }
const std::vector<OwnerTraceEntry>& HostMoELayer::owner_trace(int32_t r) const { return last(r).trace; }
const std::vector<int64_t>& HostMoELayer::owner_rows_per_expert(int32_t r) const { return last(r).rows_per_expert; }
const std::vector<float>& HostMoELayer::expert_outputs(int32_t r) const { return last(r).expert_out; }
StatusOr<std::vector<int64_t>> HostMoELayer::load_matrix(const ForwardContext& ctx) const {
  const Saved* saved = ctx.rank() >= 0 && ctx.rank() < config_.shape.ranks ? ContextAccess::Peek<Saved>(ctx, id_, ctx.rank()) : nullptr;
  if (!saved) return FailedPrecondition("load matrix: the context holds no completed forward of this layer");
  if (!config_.load_matrix) return FailedPrecondition("load matrix: the layer was created without LayerConfig::load_matrix");
  return saved->load;
}

std::span<const float> HostMoELayer::dw1(int32_t r) const {
  RankState& st = *ranks_[static_cast<size_t>(r)];
  return {st.DW1(), st.has_grads() ? st.w1_count : 0};
}
std::span<const float> HostMoELayer::dw2(int32_t r) const {
  RankState& st = *ranks_[static_cast<size_t>(r)];
  return {st.DW2(), st.has_grads() ? st.w2_count : 0};
}

namespace {

Status CheckSpan(const char* what, int32_t rank, size_t got, int64_t expect, const char* formula) {
  if (got == static_cast<size_t>(expect)) return Status::Ok();
  return InvalidArgument(std::string(what) + " on rank " + std::to_string(rank) + " has " + std::to_string(got) +
                         " values, expected " + formula + " = " + std::to_string(expect));
}

}  // namespace

Status HostMoELayer::Forward(int32_t rank, const RankRouting& routing, std::span<const float> x, std::span<float> y) {
  return Forward(rank, ranks_[static_cast<size_t>(rank)]->own_context, routing, x, y);
}

Status HostMoELayer::Backward(int32_t rank, std::span<const float> dy, std::span<float> dx, std::span<float> dgates) {
  return Backward(rank, ranks_[static_cast<size_t>(rank)]->own_context, dy, dx, dgates);
}

Status HostMoELayer::Forward(int32_t rank, ForwardContext& ctx, const RankRouting& routing, std::span<const float> x,
                             std::span<float> y) {
  const int64_t n = routing.num_tokens, H = config_.shape.hidden;
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  RDEP_RETURN_IF_ERROR(CheckSpan("forward input x", rank, x.size(), n * H, "num_tokens*H"));  // before the collective
  RDEP_RETURN_IF_ERROR(CheckSpan("forward output y", rank, y.size(), n * H, "num_tokens*H"));
  RDEP_RETURN_IF_ERROR(Plan(rank, ctx, routing));
  return Run(rank, ctx, x, y);
}

Status HostMoELayer::Plan(int32_t rank, ForwardContext& ctx, const RankRouting& routing) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginForward<Saved>(ctx, id_, rank, [] { return StatusOr<std::unique_ptr<Saved>>(std::make_unique<Saved>()); }));
  Saved& st = *saved;
  const LayerShape& s = config_.shape;
  const int64_t W = s.ranks, K = s.topk, H = s.hidden, L = layout_.L, n = routing.num_tokens;
  RDEP_RETURN_IF_ERROR(routing.Validate(s));
  auto ctrl = [&](int64_t q) { return domain_.region_as<int64_t>(static_cast<int32_t>(q), regions_.control); };
  st.tokens_to.resize(static_cast<size_t>(W));
  st.stream_base.assign(static_cast<size_t>(W), 0);

  // Front-end: rows per (owner, local expert) and the tokens that cross to each owner.
  st.num_tokens = n;
  st.routing = routing;
  std::vector<int64_t> rows(static_cast<size_t>(W * L), 0);
  for (auto& v : st.tokens_to) v.clear();
  std::vector<int64_t> last(static_cast<size_t>(W), -1);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = routing.experts[static_cast<size_t>(t * K + k)];
      const auto q = static_cast<size_t>(ownership_.owner(e));
      ++rows[q * static_cast<size_t>(L) + static_cast<size_t>(ownership_.local_index(e))];
      if (last[q] != t) {
        st.tokens_to[q].push_back(static_cast<int32_t>(t));
        last[q] = t;
      }
    }

  // Phase 1: publish counts into each owner's recv_counts_by_src[rank].
  for (int64_t q = 0; q < W; ++q) {
    int64_t* c = ctrl(q);
    for (int64_t j = 0; j < L; ++j) c[layout_.recv_counts(rank, j)] = rows[static_cast<size_t>(q * L + j)];
    c[layout_.recv_tokens(rank)] = static_cast<int64_t>(st.tokens_to[static_cast<size_t>(q)].size());
  }
  if (layout_.E_load > 0) {  // this rank's row of the load matrix, to every rank
    std::vector<int64_t> row(static_cast<size_t>(layout_.E_load), 0);
    for (int32_t e : routing.experts) ++row[static_cast<size_t>(e)];
    for (int64_t q = 0; q < W; ++q) std::copy(row.begin(), row.end(), ctrl(q) + layout_.load(rank, 0));
  }
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchCounts));
  if (layout_.E_load > 0) {
    const int64_t* lambda = ctrl(rank) + layout_.load(0, 0);
    st.load.assign(lambda, lambda + W * layout_.E_load);
  } else {
    st.load.clear();
  }

  // Phase 2 (owner): capacity per local expert in source order, token-stream bases, published back.
  int64_t* mine = ctrl(rank);
  const int32_t Lq = ownership_.num_local(rank);
  const int64_t cap = config_.capacity.ExpertCapacity(s);
  std::vector<int64_t> counts(static_cast<size_t>(W)), admitted(static_cast<size_t>(W));
  st.rows_per_expert.assign(static_cast<size_t>(Lq), 0);
  for (int32_t j = 0; j < Lq; ++j) {
    for (int64_t src = 0; src < W; ++src) counts[static_cast<size_t>(src)] = mine[layout_.recv_counts(src, j)];
    AdmitBySourceOrder(counts.data(), W, cap, admitted.data());
    for (int64_t src = 0; src < W; ++src) {
      ctrl(src)[layout_.send_admitted(rank, j)] = admitted[static_cast<size_t>(src)];
      st.rows_per_expert[static_cast<size_t>(j)] += admitted[static_cast<size_t>(src)];
    }
  }
  int64_t base = 0;
  for (int64_t src = 0; src < W; ++src) {
    mine[layout_.recv_offsets(src)] = base;
    ctrl(src)[layout_.send_offsets(rank)] = base;
    base += mine[layout_.recv_tokens(src)];
  }
  st.stream_tokens = base;
  for (int64_t p = 0; p < W; ++p) ctrl(p)[layout_.owner_tokens(rank)] = base;
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchOffsets));

  // Front-end: the accepted set is the first send_admitted rows of each (owner, expert) in token order.
  RankAcceptance& acc = st.acceptance;
  acc.accepted.assign(static_cast<size_t>(n * K), 0);
  acc.effective_gates.assign(static_cast<size_t>(n * K), 0.f);
  acc.dropped = 0;
  std::fill(rows.begin(), rows.end(), 0);  // reused as "taken so far"
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const auto i = static_cast<size_t>(t * K + k);
      const int32_t e = routing.experts[i];
      const int64_t q = ownership_.owner(e), j = ownership_.local_index(e);
      int64_t& taken = rows[static_cast<size_t>(q * L + j)];
      if (taken < mine[layout_.send_admitted(q, j)]) {
        acc.accepted[i] = 1;
        ++taken;
      } else {
        ++acc.dropped;
      }
    }
    RenormalizeGates(routing.gates.data() + t * K, acc.accepted.data() + t * K, K, acc.effective_gates.data() + t * K);
  }
  int64_t max_stream = 0;
  for (int64_t q = 0; q < W; ++q) {
    st.stream_base[static_cast<size_t>(q)] = mine[layout_.send_offsets(q)];
    max_stream = std::max(max_stream, mine[layout_.owner_tokens(q)]);
  }
  st.num_segments = (max_stream + layout_.S - 1) / layout_.S;
  st.saved_x.resize(static_cast<size_t>(st.stream_tokens * H));
  st.trace.clear();
  ContextAccess::FinishPlan(ctx);
  return Status::Ok();
}

Status HostMoELayer::Run(int32_t rank, ForwardContext& ctx, std::span<const float> x, std::span<float> y) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  if (kind_ == ExpertKind::kSwiGLU && !ranks_[static_cast<size_t>(rank)]->has_weights())
    return FailedPrecondition("forward on rank " + std::to_string(rank) +
                              ": the layer was created without weights and none are bound (BindExpertWeights)");
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginRun<Saved>(ctx, id_, rank));
  Saved& st = *saved;
  const int64_t K = config_.shape.topk, H = config_.shape.hidden, n = st.num_tokens;
  RDEP_RETURN_IF_ERROR(CheckSpan("forward input x", rank, x.size(), n * H, "num_tokens*H"));
  RDEP_RETURN_IF_ERROR(CheckSpan("forward output y", rank, y.size(), n * H, "num_tokens*H"));
  const RankAcceptance& acc = st.acceptance;
  RDEP_RETURN_IF_ERROR(Exchange(rank, st, /*backward=*/false, x));

  // Combine in fixed slot order, fp32 accumulation; keep f_k(x_t) for dgate in backward.
  const float* ret = domain_.region_as<float>(rank, regions_.ret);
  st.expert_out.assign(static_cast<size_t>(n * K * H), 0.f);
  for (int64_t t = 0; t < n; ++t) {
    float* yt = y.data() + t * H;
    std::fill(yt, yt + H, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const auto i = static_cast<size_t>(t * K + k);
      if (!acc.accepted[i]) continue;
      const float g = acc.effective_gates[i];
      const float* f = ret + static_cast<int64_t>(i) * H;
      std::copy_n(f, H, st.expert_out.data() + static_cast<int64_t>(i) * H);
      for (int64_t c = 0; c < H; ++c) yt[c] += g * f[c];
    }
  }
  ContextAccess::FinishForward(ctx);
  return Status::Ok();
}

Status HostMoELayer::Backward(int32_t rank, ForwardContext& ctx, std::span<const float> dy, std::span<float> dx,
                              std::span<float> dgates) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  if (kind_ != ExpertKind::kSwiGLU) return FailedPrecondition("backward needs the SwiGLU expert kind");
  if (!ranks_[static_cast<size_t>(rank)]->has_weights() || !ranks_[static_cast<size_t>(rank)]->has_grads())
    return FailedPrecondition("backward on rank " + std::to_string(rank) +
                              ": the layer was created without weights and no weights and gradients are bound");
  const int64_t K = config_.shape.topk, H = config_.shape.hidden;
  {
    const Saved* peek = ContextAccess::Peek<Saved>(ctx, id_, rank);
    const int64_t n = peek ? peek->num_tokens : 0;
    if (peek) {
      RDEP_RETURN_IF_ERROR(CheckSpan("backward input dy", rank, dy.size(), n * H, "num_tokens*H"));
      RDEP_RETURN_IF_ERROR(CheckSpan("backward output dx", rank, dx.size(), n * H, "num_tokens*H"));
      RDEP_RETURN_IF_ERROR(CheckSpan("backward output dgates", rank, dgates.size(), n * K, "num_tokens*K"));
    }
  }
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginBackward<Saved>(ctx, id_, rank));
  Saved& st = *saved;
  RankState& rs = *ranks_[static_cast<size_t>(rank)];
  const int64_t n = st.num_tokens;
  const RankAcceptance& acc = st.acceptance;

  // dgate at the front-end: dL/dg'_k = <dy_t, f_k(x_t)>, then through the capacity renormalization.
  std::vector<double> d_eff(static_cast<size_t>(K)), d_g(static_cast<size_t>(K));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const auto i = static_cast<size_t>(t * K + k);
      double dot = 0;
      if (acc.accepted[i]) {
        const float* f = st.expert_out.data() + static_cast<int64_t>(i) * H;
        for (int64_t c = 0; c < H; ++c) dot += static_cast<double>(dy[static_cast<size_t>(t * H + c)]) * f[c];
      }
      d_eff[static_cast<size_t>(k)] = dot;
    }
    RenormalizeGatesBackward(st.routing.gates.data() + t * K, acc.accepted.data() + t * K, K, d_eff.data(), d_g.data());
    for (int64_t k = 0; k < K; ++k) dgates[static_cast<size_t>(t * K + k)] = static_cast<float>(d_g[static_cast<size_t>(k)]);
  }

  std::fill_n(rs.DW1(), rs.w1_count, 0.f);
  std::fill_n(rs.DW2(), rs.w2_count, 0.f);
  RDEP_RETURN_IF_ERROR(Exchange(rank, st, /*backward=*/true, dy));

  // dx_t = sum_k of the returned dgrad rows, slot order, fp32.
  const float* ret = domain_.region_as<float>(rank, regions_.ret);
  for (int64_t t = 0; t < n; ++t) {
    float* dxt = dx.data() + t * H;
    std::fill(dxt, dxt + H, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const auto i = t * K + k;
      if (!acc.accepted[static_cast<size_t>(i)]) continue;
      for (int64_t c = 0; c < H; ++c) dxt[c] += ret[i * H + c];
    }
  }
  return Status::Ok();
}

// Phase 3 per segment (scatter this rank's tokens that fall in each owner's segment window), then the
// owner work on this rank's own segment, then the final barrier after which every returned row landed.
Status HostMoELayer::Exchange(int32_t rank, Saved& st, bool backward, std::span<const float> payload) {
  const int64_t W = config_.shape.ranks, K = config_.shape.topk, H = config_.shape.hidden, S = layout_.S;
  const size_t tsb = layout_.token_sideband_bytes();
  const RowIdCodec codec{config_.shape.tokens, K};
  const RankAcceptance& acc = st.acceptance;
  for (int64_t seg = 0; seg < st.num_segments; ++seg) {
    const int64_t buf = seg % 2, lo = seg * S;
    for (int64_t q = 0; q < W; ++q) {
      const auto& toks = st.tokens_to[static_cast<size_t>(q)];
      const int64_t base = st.stream_base[static_cast<size_t>(q)];
      const int64_t first = std::max<int64_t>(0, lo - base);
      const int64_t end = std::min<int64_t>(static_cast<int64_t>(toks.size()), lo + S - base);
      float* dst_payload = domain_.region_as<float>(static_cast<int32_t>(q), regions_.payload) + buf * S * H;
      std::byte* dst_sideband = domain_.region(static_cast<int32_t>(q), regions_.sideband) + static_cast<size_t>(buf * S) * tsb;
      for (int64_t i = first; i < end; ++i) {
        const int64_t t = toks[static_cast<size_t>(i)];
        const int64_t slot = base + i - lo;
        std::byte* hdr = dst_sideband + static_cast<size_t>(slot) * tsb;
        auto* rows = reinterpret_cast<RowSideband*>(hdr + sizeof(int64_t));
        int64_t num_rows = 0;
        for (int64_t k = 0; k < K; ++k) {
          const auto idx = static_cast<size_t>(t * K + k);
          const int32_t e = st.routing.experts[idx];
          if (ownership_.owner(e) != q || !acc.accepted[idx]) continue;
          rows[num_rows++] = RowSideband{codec.encode(rank, t, k), ownership_.local_index(e), acc.effective_gates[idx]};
        }
        std::memcpy(hdr, &num_rows, sizeof(int64_t));
        if (num_rows > 0) std::copy_n(payload.data() + t * H, H, dst_payload + slot * H);
      }
    }
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardSegment : Phase::kDispatchSegment));
    OwnerSegment(rank, st, seg, backward);
  }
  return domain_.Barrier(rank, backward ? Phase::kBackwardDone : Phase::kReturnDone);
}

// Owner work on one received segment: expand tokens into rows grouped by local expert (stream order
// within an expert), compute, and store each output row at its front-end's slot decoded from row_id.
void HostMoELayer::OwnerSegment(int32_t rank, Saved& st, int64_t seg, bool backward) {
  RankState& rs = *ranks_[static_cast<size_t>(rank)];
  const LayerShape& s = config_.shape;
  const int64_t K = s.topk, H = s.hidden, F = s.ffn, S = layout_.S;
  const int64_t buf = seg % 2, lo = seg * S;
  const int64_t n_seg = std::clamp<int64_t>(st.stream_tokens - lo, 0, S);
  const size_t tsb = layout_.token_sideband_bytes();
  const float* payload = domain_.region_as<float>(rank, regions_.payload) + buf * S * H;
  const std::byte* sideband = domain_.region(rank, regions_.sideband) + static_cast<size_t>(buf * S) * tsb;
  const int32_t Lq = ownership_.num_local(rank);
  const RowIdCodec codec{s.tokens, K};

  struct Grouped {
    int64_t token;  // index in the segment
    RowSideband row;
  };
  std::vector<int64_t> offset(static_cast<size_t>(Lq) + 1, 0);
  for (int64_t p = 0; p < n_seg; ++p) {
    int64_t num_rows;
    std::memcpy(&num_rows, sideband + static_cast<size_t>(p) * tsb, sizeof(int64_t));
    const auto* rows = reinterpret_cast<const RowSideband*>(sideband + static_cast<size_t>(p) * tsb + sizeof(int64_t));
    for (int64_t r = 0; r < num_rows; ++r) ++offset[static_cast<size_t>(rows[r].local_expert) + 1];
    if (!backward && num_rows > 0) std::copy_n(payload + p * H, H, st.saved_x.data() + (lo + p) * H);
  }
  for (int32_t j = 0; j < Lq; ++j) offset[static_cast<size_t>(j) + 1] += offset[static_cast<size_t>(j)];
  std::vector<Grouped> grouped(static_cast<size_t>(offset[static_cast<size_t>(Lq)]));
  std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
  for (int64_t p = 0; p < n_seg; ++p) {
    int64_t num_rows;
    std::memcpy(&num_rows, sideband + static_cast<size_t>(p) * tsb, sizeof(int64_t));
    const auto* rows = reinterpret_cast<const RowSideband*>(sideband + static_cast<size_t>(p) * tsb + sizeof(int64_t));
    for (int64_t r = 0; r < num_rows; ++r)
      grouped[static_cast<size_t>(fill[static_cast<size_t>(rows[r].local_expert)]++)] = Grouped{p, rows[r]};
  }
  if (trace_ && !backward)
    for (size_t g = 0; g < grouped.size(); ++g)
      st.trace.push_back({grouped[g].row.row_id, grouped[g].row.local_expert, static_cast<int32_t>(seg), static_cast<int64_t>(g)});

  const size_t n1 = static_cast<size_t>(H * 2 * F), n2 = static_cast<size_t>(F * H);
  std::vector<float> h(static_cast<size_t>(2 * F)), z(static_cast<size_t>(F)), o(static_cast<size_t>(H));
  std::vector<float> dout(static_cast<size_t>(H)), scratch(static_cast<size_t>(3 * F));
  for (const Grouped& g : grouped) {
    const RowKey key = codec.decode(g.row.row_id);
    float* dst = domain_.region_as<float>(static_cast<int32_t>(key.rank), regions_.ret) + (key.token * K + key.slot) * H;
    const float* x = st.saved_x.data() + (lo + g.token) * H;
    const auto j = static_cast<size_t>(g.row.local_expert);
    const float* w1 = rs.W1() + j * n1;
    const float* w2 = rs.W2() + j * n2;
    if (kind_ == ExpertKind::kSentinel) {
      const int32_t expert = ownership_.global_expert(rank, g.row.local_expert);
      for (int64_t c = 0; c < H; ++c) dst[c] = c < kSentinelFields ? SentinelField(g.row.row_id, rank, expert, c) : x[c];
    } else if (!backward) {
      mlp::Forward<float>(x, w1, w2, H, F, h.data(), z.data(), dst);
    } else {
      const float* dy = payload + g.token * H;
      for (int64_t c = 0; c < H; ++c) dout[static_cast<size_t>(c)] = g.row.gate * dy[c];
      mlp::Forward<float>(x, w1, w2, H, F, h.data(), z.data(), o.data());
      mlp::Backward<float>(x, w1, w2, H, F, h.data(), dout.data(), rs.DW1() + j * n1, rs.DW2() + j * n2, dst, scratch.data());
    }
  }
}

}  // namespace rdep
