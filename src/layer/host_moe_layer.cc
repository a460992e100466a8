// The RDEP protocol on the host backend. Layout of the regions: rdep/layer/layer_config.h.
#include "rdep/layer/host_moe_layer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "rdep/core/expert_mlp.h"
#include "rdep/core/row_id.h"
#include "layer/context_access.h"
#include "layer/host_layer_state.h"

namespace rdep {

HostMoELayer::HostMoELayer(HostDomain& domain, LayerConfig config, OwnershipMap ownership)
    : domain_(domain), config_(std::move(config)), ownership_(std::move(ownership)), id_(ContextAccess::NewLayerId()) {}

Status HostMoELayer::CheckRank(int32_t rank) const {
  if (rank < 0 || rank >= config_.shape.ranks)
    return InvalidArgument("rank " + std::to_string(rank) + " outside [0, W=" + std::to_string(config_.shape.ranks) + ")");
  return Status::Ok();
}

HostMoELayer::~HostMoELayer() {
  regions_.Free(domain_);
  for (RegionId id : {replica_w_, replica_g_})
    if (id >= 0) domain_.ReleaseShared(id);
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
  RDEP_ASSIGN_OR_RETURN(layer->regions_, LayerRegions::Allocate(domain, l, config.owner_reduce ? sizeof(double) : 0));
  if (config.replica_slots() > 0) {  // redundant slots: [N_slot][w1 | w2] and their gradients, per rank,
                                     // shared with every balanced layer of the same slot size on the domain
    const size_t slot_bytes = layer->replica_slot_bytes() / 2;
    RDEP_ASSIGN_OR_RETURN(layer->replica_w_, domain.AcquireShared("replica.weights", slot_bytes));
    RDEP_ASSIGN_OR_RETURN(layer->replica_g_, domain.AcquireShared("replica.grads", slot_bytes));
  }
  if (config.nodes.nodes > 1) {  // the inter-node hop and the node of each expert
    RDEP_ASSIGN_OR_RETURN(layer->inter_, MakeHostInterNodeExchange(domain, config.nodes));
    const int32_t G = config.nodes.ranks_per_node(s.ranks);
    for (int32_t e = 0; e < ownership.num_experts(); ++e) layer->node_of_expert_.push_back(ownership.owner(e) / G);
    layer->gathered_out_.resize(static_cast<size_t>(s.ranks));
  }
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
const std::vector<float>& HostMoELayer::expert_outputs(int32_t r) const {
  if (config_.nodes.nodes == 1) return last(r).expert_out;
  // Two-phase: the rows stayed at the relays of r's local index, one per node.
  const int64_t K = config_.shape.topk, H = config_.shape.hidden, G = config_.nodes.ranks_per_node(config_.shape.ranks);
  const RowIdCodec codec{config_.shape.tokens, K};
  std::vector<float>& out = gathered_out_[static_cast<size_t>(r)];
  out.assign(static_cast<size_t>(last(r).num_tokens * K * H), 0.f);
  for (int64_t b = 0; b < config_.nodes.nodes; ++b) {
    const Saved& relay = last(static_cast<int32_t>(b * G + r % G));
    for (const auto& rel : relay.relayed) {
      if (rel.src_node != r / G) continue;
      for (size_t j = 0; j < rel.rows.size(); ++j) {
        const RowKey key = codec.decode(rel.rows[j].row_id);
        std::copy_n(relay.relay_out.data() + (rel.out + static_cast<int64_t>(j)) * H, H, out.data() + (key.token * K + key.slot) * H);
      }
    }
  }
  return out;
}
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
  const int64_t W = config_.shape.ranks, H = config_.shape.hidden;
  RDEP_RETURN_IF_ERROR(routing.Validate(config_.shape));
  if (config_.nodes.cap() < config_.nodes.nodes) {
    Status limit = CheckNodeLimit(routing, node_of_expert_, config_.nodes.cap());
    if (!limit.ok()) return InvalidArgument("rank " + std::to_string(rank) + ": " + limit.message());
  }
  st.traffic = NodeTraffic{};
  st.num_tokens = routing.num_tokens;
  st.routing = routing;
  st.tokens_to.resize(static_cast<size_t>(W));
  for (auto& v : st.tokens_to) v.clear();
  st.plan.reset();
  st.telemetry = BalanceTelemetry{};
  RDEP_RETURN_IF_ERROR(config_.balance.enabled() ? PlanBalanced(rank, st) : PlanByOwner(rank, st));

  // Both plans end with the stream offsets published: where this rank's tokens go in each stream.
  const int64_t* mine = domain_.region_as<int64_t>(rank, regions_.control);
  st.stream_base.assign(static_cast<size_t>(W), 0);
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

// This rank's row of the load matrix (rows per expert), stored into every rank's control words.
void HostMoELayer::PublishLoadRow(int32_t rank, const RankRouting& routing) {
  std::vector<int64_t> row(static_cast<size_t>(layout_.E_load), 0);
  for (int32_t e : routing.experts) ++row[static_cast<size_t>(e)];
  for (int32_t q = 0; q < config_.shape.ranks; ++q)
    std::copy(row.begin(), row.end(), domain_.region_as<int64_t>(q, regions_.control) + layout_.load(rank, 0));
}

// Phase 2's offsets (owner side): the exclusive scan of the tokens each source sends into this rank's
// token stream, published back to the sources with the stream's length; then the offsets barrier.
Status HostMoELayer::PublishStreamOffsets(int32_t rank, Saved& st) {
  const int64_t W = config_.shape.ranks;
  auto ctrl = [&](int64_t q) { return domain_.region_as<int64_t>(static_cast<int32_t>(q), regions_.control); };
  int64_t* mine = ctrl(rank);
  int64_t base = 0;
  for (int64_t src = 0; src < W; ++src) {
    mine[layout_.recv_offsets(src)] = base;
    ctrl(src)[layout_.send_offsets(rank)] = base;
    base += mine[layout_.recv_tokens(src)];
  }
  st.stream_tokens = base;
  for (int64_t p = 0; p < W; ++p) ctrl(p)[layout_.owner_tokens(rank)] = base;
  return domain_.Barrier(rank, Phase::kDispatchOffsets);
}

// Without balancing every row goes to its expert's owner: phase 1 publishes rows per (owner, local
// expert), phase 2 decides capacity at the owner, and the accepted set is read back.
Status HostMoELayer::PlanByOwner(int32_t rank, Saved& st) {
  const LayerShape& s = config_.shape;
  const int64_t W = s.ranks, K = s.topk, L = layout_.L, n = st.num_tokens;
  const RankRouting& routing = st.routing;
  auto ctrl = [&](int64_t q) { return domain_.region_as<int64_t>(static_cast<int32_t>(q), regions_.control); };

  // Front-end: rows per (owner, local expert) and the tokens that cross to each owner.
  std::vector<int64_t> rows(static_cast<size_t>(W * L), 0);
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
  if (layout_.E_load > 0) PublishLoadRow(rank, routing);
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchCounts));
  if (layout_.E_load > 0) {
    const int64_t* lambda = ctrl(rank) + layout_.load(0, 0);
    st.load.assign(lambda, lambda + W * layout_.E_load);
  } else {
    st.load.clear();
  }

  // Phase 2 (owner): capacity per local expert in source order, then the token-stream bases.
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
  RDEP_RETURN_IF_ERROR(PublishStreamOffsets(rank, st));

  // Front-end: the accepted set is the first send_admitted rows of each (owner, expert) in token order.
  RankAcceptance& acc = st.acceptance;
  acc.accepted.assign(static_cast<size_t>(n * K), 0);
  acc.effective_gates.assign(static_cast<size_t>(n * K), 0.f);
  acc.dropped = 0;
  st.dest_rank.assign(static_cast<size_t>(n * K), -1);
  st.dest_local.assign(static_cast<size_t>(n * K), -1);
  std::fill(rows.begin(), rows.end(), 0);  // reused as "taken so far"
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const auto i = static_cast<size_t>(t * K + k);
      const int32_t e = routing.experts[i];
      const int32_t q = ownership_.owner(e), j = ownership_.local_index(e);
      int64_t& taken = rows[static_cast<size_t>(q * L + j)];
      if (taken < mine[layout_.send_admitted(q, j)]) {
        acc.accepted[i] = 1;
        st.dest_rank[i] = q;
        st.dest_local[i] = j;
        ++taken;
      } else {
        ++acc.dropped;
      }
    }
    RenormalizeGates(routing.gates.data() + t * K, acc.accepted.data() + t * K, K, acc.effective_gates.data() + t * K);
  }
  return Status::Ok();
}

Status HostMoELayer::Run(int32_t rank, ForwardContext& ctx, std::span<const float> x, std::span<float> y) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  if (kind_ == ExpertKind::kSwiGLU && !ranks_[static_cast<size_t>(rank)]->has_weights())
    return FailedPrecondition("forward on rank " + std::to_string(rank) +
                              ": the layer was created without weights and none are bound (BindExpertWeights)");
  if (kind_ == ExpertKind::kSentinel && config_.owner_reduce)
    return FailedPrecondition("forward on rank " + std::to_string(rank) +
                              ": the sentinel expert's rows carry identities, which owner_reduce would sum; use it without");
  RDEP_ASSIGN_OR_RETURN(Saved * saved, ContextAccess::BeginRun<Saved>(ctx, id_, rank));
  Saved& st = *saved;
  const int64_t H = config_.shape.hidden, n = st.num_tokens;
  RDEP_RETURN_IF_ERROR(CheckSpan("forward input x", rank, x.size(), n * H, "num_tokens*H"));
  RDEP_RETURN_IF_ERROR(CheckSpan("forward output y", rank, y.size(), n * H, "num_tokens*H"));
  if (config_.nodes.nodes > 1) {
    RDEP_RETURN_IF_ERROR(RunTwoPhase(rank, st, x, y));
    ContextAccess::FinishForward(ctx);
    return Status::Ok();
  }
  if (st.plan) RDEP_RETURN_IF_ERROR(PushReplicaWeights(rank, st));  // before the replicas' compute: first segment barrier
  RDEP_RETURN_IF_ERROR(Exchange(rank, st, /*backward=*/false, x));
  if (config_.owner_reduce) {
    st.expert_out.clear();  // the owners keep f_k: nothing per slot stays here
    SumReturned(rank, st, y, /*lead_only=*/true);
  } else {
    CombineReturned(rank, st, y);
  }
  ContextAccess::FinishForward(ctx);
  return Status::Ok();
}

void HostMoELayer::TestDelay(int32_t rank) const {
  if (rank == delay_rank_ && delay_s_ > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay_s_));
}

// Front-end, after every row returned: y_t = sum_k g'_k f_k in fixed slot order with fp32
// accumulation; keeps f_k(x_t) for dgate in backward.
void HostMoELayer::CombineReturned(int32_t rank, Saved& st, std::span<float> y) {
  TestDelay(rank);
  const int64_t K = config_.shape.topk, H = config_.shape.hidden, n = st.num_tokens;
  const RankAcceptance& acc = st.acceptance;
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
}

// Front-end, backward: dL/dg'_k = <dy_t, f_k(x_t)> from the saved returned rows, then through the
// capacity renormalization to the router's gates.
void HostMoELayer::ComputeDgates(const Saved& st, std::span<const float> dy, std::span<float> dgates) const {
  const int64_t K = config_.shape.topk, H = config_.shape.hidden, n = st.num_tokens;
  const RankAcceptance& acc = st.acceptance;
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
}

// Front-end, after every row returned: out_t = the sum of its accepted slots' returned rows in slot order,
// fp32 (backward's dx); lead_only (owner_reduce, forward y and backward dx): of its lead slots' rows,
// which carry the owners' sums.
void HostMoELayer::SumReturned(int32_t rank, const Saved& st, std::span<float> out, bool lead_only) const {
  TestDelay(rank);
  const int64_t K = config_.shape.topk, H = config_.shape.hidden, n = st.num_tokens;
  const float* ret = domain_.region_as<float>(rank, regions_.ret);
  for (int64_t t = 0; t < n; ++t) {
    float* ot = out.data() + t * H;
    std::fill(ot, ot + H, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const auto i = t * K + k;
      if (lead_only ? !IsLeadSlot(st, t, k) : !st.acceptance.accepted[static_cast<size_t>(i)]) continue;
      for (int64_t c = 0; c < H; ++c) ot[c] += ret[i * H + c];
    }
  }
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
  if (config_.nodes.nodes > 1) {
    std::fill_n(rs.DW1(), rs.w1_count, 0.f);
    std::fill_n(rs.DW2(), rs.w2_count, 0.f);
    return BackwardTwoPhase(rank, st, dy, dx, dgates);
  }
  if (!config_.owner_reduce) ComputeDgates(st, dy, dgates);  // else the owners' dots, after the exchange
  std::fill_n(rs.DW1(), rs.w1_count, 0.f);
  std::fill_n(rs.DW2(), rs.w2_count, 0.f);
  if (st.plan) RDEP_RETURN_IF_ERROR(PushReplicaWeights(rank, st));  // rematerialized: another forward may have used the slots
  RDEP_RETURN_IF_ERROR(Exchange(rank, st, /*backward=*/true, dy));
  if (st.plan) ReduceReplicaGradients(rank, st);  // every replica finished before backward.done
  if (config_.owner_reduce) {
    DgatesFromDots(rank, st, dgates);
    SumReturned(rank, st, dx, /*lead_only=*/true);
  } else {
    SumReturned(rank, st, dx);
  }
  return Status::Ok();
}

// Phase 3 per segment (scatter this rank's tokens that fall in each owner's segment window), then the
// owner work on this rank's own segment, then the final barrier after which every returned row landed.
Status HostMoELayer::Exchange(int32_t rank, Saved& st, bool backward, std::span<const float> payload) {
  for (int64_t seg = 0; seg < st.num_segments; ++seg) {
    ScatterSegment(rank, st, seg, payload);
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardSegment : Phase::kDispatchSegment));
    OwnerSegment(rank, st, seg, backward);
  }
  return domain_.Barrier(rank, backward ? Phase::kBackwardDone : Phase::kReturnDone);
}

// Phase 3, source side, one segment: each of this rank's tokens whose position in an owner's stream
// falls in the segment's window stores its payload row (x or dy) and its rows' sideband (row_id,
// physical local expert, effective gate) into that owner's buffer seg % 2.
void HostMoELayer::ScatterSegment(int32_t rank, const Saved& st, int64_t seg, std::span<const float> payload) {
  const int64_t W = config_.shape.ranks, K = config_.shape.topk, H = config_.shape.hidden, S = layout_.S;
  const size_t tsb = layout_.token_sideband_bytes();
  const RowIdCodec codec{config_.shape.tokens, K};
  const RankAcceptance& acc = st.acceptance;
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
        if (!acc.accepted[idx] || st.dest_rank[idx] != q) continue;
        rows[num_rows++] = RowSideband{codec.encode(rank, t, k), st.dest_local[idx], acc.effective_gates[idx]};
      }
      std::memcpy(hdr, &num_rows, sizeof(int64_t));
      if (num_rows > 0) std::copy_n(payload.data() + t * H, H, dst_payload + slot * H);
    }
  }
}

int64_t HostMoELayer::SegmentTokenRows(const std::byte* sideband, size_t tsb, int64_t p) {
  int64_t num_rows;
  std::memcpy(&num_rows, sideband + static_cast<size_t>(p) * tsb, sizeof(int64_t));
  return num_rows;
}

// Owner, one received segment (buffer seg % 2): its rows grouped by physical local expert, in stream
// order within an expert (and slot order within a token), each with its token's index in the segment.
std::vector<HostMoELayer::GroupedRow> HostMoELayer::GroupSegment(int32_t rank, const Saved& st, int64_t seg) const {
  const int64_t S = layout_.S, buf = seg % 2;
  const size_t tsb = layout_.token_sideband_bytes();
  const std::byte* sideband = domain_.region(rank, regions_.sideband) + static_cast<size_t>(buf * S) * tsb;
  const int64_t Lq = config_.balance.enabled() ? layout_.L : ownership_.num_local(rank);  // physical local experts
  const int64_t n_seg = std::clamp<int64_t>(st.stream_tokens - seg * S, 0, S);
  std::vector<int64_t> offset(static_cast<size_t>(Lq) + 1, 0);
  auto rows_of = [&](int64_t p) { return reinterpret_cast<const RowSideband*>(sideband + static_cast<size_t>(p) * tsb + sizeof(int64_t)); };
  for (int64_t p = 0; p < n_seg; ++p) {
    const int64_t num_rows = SegmentTokenRows(sideband, tsb, p);
    for (int64_t r = 0; r < num_rows; ++r) ++offset[static_cast<size_t>(rows_of(p)[r].local_expert) + 1];
  }
  for (int64_t j = 0; j < Lq; ++j) offset[static_cast<size_t>(j) + 1] += offset[static_cast<size_t>(j)];
  std::vector<GroupedRow> grouped(static_cast<size_t>(offset[static_cast<size_t>(Lq)]));
  std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
  for (int64_t p = 0; p < n_seg; ++p) {
    const int64_t num_rows = SegmentTokenRows(sideband, tsb, p);
    for (int64_t r = 0; r < num_rows; ++r)
      grouped[static_cast<size_t>(fill[static_cast<size_t>(rows_of(p)[r].local_expert)]++)] = GroupedRow{p, rows_of(p)[r]};
  }
  return grouped;
}

// Owner work on one received segment: expand tokens into rows grouped by local expert (stream order
// within an expert), compute, and store each output row at its front-end's slot decoded from row_id
// (with nodes, at the relay of its source in this node: ReturnRow).
void HostMoELayer::OwnerSegment(int32_t rank, Saved& st, int64_t seg, bool backward) {
  const LayerShape& s = config_.shape;
  const int64_t H = s.hidden, F = s.ffn, S = layout_.S;
  const int64_t buf = seg % 2, lo = seg * S;
  const int64_t n_seg = std::clamp<int64_t>(st.stream_tokens - lo, 0, S);
  const size_t tsb = layout_.token_sideband_bytes();
  const float* payload = domain_.region_as<float>(rank, regions_.payload) + buf * S * H;
  const std::byte* sideband = domain_.region(rank, regions_.sideband) + static_cast<size_t>(buf * S) * tsb;
  TestDelay(rank);
  if (backward && seg == 0 && replica_g_ >= 0)  // replica gradients of this call accumulate from here
    std::fill_n(domain_.region_as<float>(rank, replica_g_), config_.replica_slots() * 3 * H * F, 0.f);
  if (!backward)  // the owner keeps its received token rows for backward
    for (int64_t p = 0; p < n_seg; ++p)
      if (SegmentTokenRows(sideband, tsb, p) > 0) std::copy_n(payload + p * H, H, st.saved_x.data() + (lo + p) * H);
  const std::vector<GroupedRow> grouped = GroupSegment(rank, st, seg);
  if (!backward && config_.nodes.nodes > 1) {  // every grouped row goes back to its relay
    st.traffic.intra_return_rows += static_cast<int64_t>(grouped.size());
    st.traffic.intra_return_bytes += static_cast<int64_t>(grouped.size()) * H * static_cast<int64_t>(sizeof(float));
  }
  if (trace_ && !backward)
    for (size_t g = 0; g < grouped.size(); ++g)
      st.trace.push_back({grouped[g].row.row_id, grouped[g].row.local_expert, static_cast<int32_t>(seg), static_cast<int64_t>(g)});

  const bool reduce = config_.owner_reduce;  // rows accumulate into the token's lead row (host_owner_reduce.cc)
  if (reduce) ZeroLeadRows(rank, sideband, n_seg);
  std::vector<float> h(static_cast<size_t>(2 * F)), z(static_cast<size_t>(F)), o(static_cast<size_t>(H));
  std::vector<float> dout(static_cast<size_t>(H)), scratch(static_cast<size_t>(3 * F)), own_row(static_cast<size_t>(H));
  for (const GroupedRow& g : grouped) {
    float* dst = reduce ? own_row.data() : ReturnRow(rank, g.row.row_id);
    const float* x = st.saved_x.data() + (lo + g.token) * H;
    const int64_t j = g.row.local_expert;
    const float* w1 = ExpertWeights(rank, st, j, 1);
    const float* w2 = ExpertWeights(rank, st, j, 2);
    if (kind_ == ExpertKind::kSentinel) {
      const int32_t expert = ExpertAt(rank, st, j);
      for (int64_t c = 0; c < H; ++c) dst[c] = c < kSentinelFields ? SentinelField(g.row.row_id, rank, expert, c) : x[c];
    } else if (kind_ == ExpertKind::kIdentity) {  // forward only (Backward refuses it)
      std::copy_n(x, H, dst);
    } else if (!backward) {
      mlp::Forward<float>(x, w1, w2, H, F, h.data(), z.data(), dst, config_.gate_up);
    } else {
      const float* dy = payload + g.token * H;
      for (int64_t c = 0; c < H; ++c) dout[static_cast<size_t>(c)] = g.row.gate * dy[c];
      mlp::Forward<float>(x, w1, w2, H, F, h.data(), z.data(), o.data(), config_.gate_up);
      mlp::Backward<float>(x, w1, w2, H, F, h.data(), dout.data(), ExpertGrads(rank, j, 1), ExpertGrads(rank, j, 2), dst,
                           scratch.data(), config_.gate_up);
      if (reduce) {  // dgate's dot, in double as ComputeDgates takes it from the returned f_k
        double dot = 0;
        for (int64_t c = 0; c < H; ++c) dot += static_cast<double>(dy[c]) * o[static_cast<size_t>(c)];
        WriteDot(g.row.row_id, dot);
      }
    }
    if (reduce) {  // forward: g'_k f_k; backward: dx_k
      float* lead = LeadRow(rank, sideband, g.token);
      const float w = backward ? 1.f : g.row.gate;
      for (int64_t c = 0; c < H; ++c) lead[c] += w * own_row[static_cast<size_t>(c)];
    }
  }
  // Two-phase: relays write only the stream positions of tokens with accepted rows here, so the
  // headers go back to "no rows" for the next use of this buffer (ordered by the next barriers).
  if (config_.nodes.nodes > 1)
    for (int64_t p = 0; p < n_seg; ++p) std::memset(domain_.region(rank, regions_.sideband) + static_cast<size_t>(buf * S + p) * tsb, 0, sizeof(int64_t));
}

}  // namespace rdep
