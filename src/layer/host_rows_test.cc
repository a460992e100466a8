// The host layer with the caller's own experts (Plan, Dispatch, Combine, CombineBackward,
// DispatchBackward): when the caller computes the same SwiGLU MLP the layer computes, every result
// (y, dx, dgates, the weight gradients) equals the layer's own Forward and Backward bit for bit; the
// received rows are exactly the accepted rows of the owner's experts (sentinel payloads), in the
// documented order; contexts may be in flight together; misuse is an error naming it.
#include <gtest/gtest.h>

#include <array>
#include <functional>
#include <utility>
#include <numeric>

#include "rdep/core/expert_mlp.h"
#include "rdep/core/row_id.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

struct Case {
  const char* name;
  LayerShape shape;
  const char* routing = "uniform";
  double capacity_factor = 0.0;
  int64_t segment = 0;
  int64_t empty_rank = -1;
};

// Per rank: y, dx, dgates; per rank's local experts: dW1, dW2.
struct Results {
  std::vector<std::vector<float>> y, dx, dg, dw1, dw2;
  explicit Results(int64_t W) : y(W), dx(W), dg(W), dw1(W), dw2(W) {}
};

struct RowsFixture {
  Case c;
  std::unique_ptr<HostDomain> domain;
  OwnershipMap own;
  MoEWeights w;
  Routing routing;
  std::vector<std::vector<float>> x, dy;
  LayerConfig config;

  explicit RowsFixture(const Case& cs) : c(cs) {
    const LayerShape& s = c.shape;
    domain = std::move(*HostDomain::Create(s.ranks, {.barrier_timeout_s = 20}));
    own = *OwnershipMap::Contiguous(s.experts, s.ranks);
    w = RandomWeights(s, 11);
    RoutingSpec spec = *RoutingSpec::Parse(c.routing);
    spec.seed = 5;
    spec.empty_rank = c.empty_rank;
    routing = *GenerateRouting(s, spec);
    x = RandomActivations(s, routing, 7);
    dy = RandomActivations(s, routing, 8);
    config = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
  }
  int64_t n(int32_t r) const { return routing[static_cast<size_t>(r)].num_tokens; }
  const float* W1(int32_t r, int64_t j) const {
    return w.w1.data() + static_cast<size_t>(own.global_expert(r, static_cast<int32_t>(j))) * w.w1_per_expert();
  }
  const float* W2(int32_t r, int64_t j) const {
    return w.w2.data() + static_cast<size_t>(own.global_expert(r, static_cast<int32_t>(j))) * w.w2_per_expert();
  }
};

// The layer's own forward and backward.
Results RunLayer(RowsFixture& f) {
  const LayerShape& s = f.c.shape;
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own, f.w);
  Results out(s.ranks);
  Status st = f.domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    out.y[i].assign(static_cast<size_t>(f.n(r) * s.hidden), 0.f);
    out.dx[i].assign(out.y[i].size(), 0.f);
    out.dg[i].assign(static_cast<size_t>(f.n(r) * s.topk), 0.f);
    RDEP_RETURN_IF_ERROR(layer->Forward(r, f.routing[i], f.x[i], out.y[i]));
    RDEP_RETURN_IF_ERROR(layer->Backward(r, f.dy[i], out.dx[i], out.dg[i]));
    out.dw1[i].assign(layer->dw1(r).begin(), layer->dw1(r).end());
    out.dw2[i].assign(layer->dw2(r).begin(), layer->dw2(r).end());
    return Status::Ok();
  });
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// The caller's experts: the same SwiGLU MLP per received row, in the order Dispatch delivered them.
struct CallerExperts {
  const RowsFixture* f = nullptr;
  int32_t rank = 0;
  std::vector<int64_t> counts;  // rows per local expert
  std::vector<float> h;         // saved pre-activations [M][2F]

  std::vector<float> Forward(const std::vector<float>& recv) {
    const int64_t H = f->c.shape.hidden, F = f->c.shape.ffn;
    const int64_t M = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    std::vector<float> out(static_cast<size_t>(M * H)), z(static_cast<size_t>(F));
    h.assign(static_cast<size_t>(M * 2 * F), 0.f);
    int64_t row = 0;
    for (size_t j = 0; j < counts.size(); ++j)
      for (int64_t m = 0; m < counts[j]; ++m, ++row)
        mlp::Forward<float>(recv.data() + row * H, f->W1(rank, static_cast<int64_t>(j)), f->W2(rank, static_cast<int64_t>(j)), H, F,
                            h.data() + row * 2 * F, z.data(), out.data() + row * H);
    return out;
  }
  // d_recv from d_out; weight gradients accumulate in row order (as the layer's do).
  std::vector<float> Backward(const std::vector<float>& recv, const std::vector<float>& d_out, std::vector<float>& dw1,
                              std::vector<float>& dw2) {
    const int64_t H = f->c.shape.hidden, F = f->c.shape.ffn;
    const auto n1 = f->w.w1_per_expert(), n2 = f->w.w2_per_expert();
    dw1.assign(counts.size() * n1, 0.f);
    dw2.assign(counts.size() * n2, 0.f);
    std::vector<float> d_recv(recv.size()), scratch(static_cast<size_t>(3 * F));
    int64_t row = 0;
    for (size_t j = 0; j < counts.size(); ++j)
      for (int64_t m = 0; m < counts[j]; ++m, ++row)
        mlp::Backward<float>(recv.data() + row * H, f->W1(rank, static_cast<int64_t>(j)), f->W2(rank, static_cast<int64_t>(j)), H, F,
                             h.data() + row * 2 * F, d_out.data() + row * H, dw1.data() + j * n1, dw2.data() + j * n2,
                             d_recv.data() + row * H, scratch.data());
    return d_recv;
  }
};

// One rank's whole dispatch/combine forward and backward with the caller's experts.
Status RowsForwardBackward(HostMoELayer& layer, RowsFixture& f, int32_t r, Results& out) {
  const LayerShape& s = f.c.shape;
  const auto i = static_cast<size_t>(r);
  ForwardContext ctx;
  RDEP_RETURN_IF_ERROR(layer.Plan(r, ctx, f.routing[i]));
  CallerExperts experts{&f, r, {}, {}};
  RDEP_ASSIGN_OR_RETURN(experts.counts, layer.recv_counts(ctx));
  const int64_t M = std::accumulate(experts.counts.begin(), experts.counts.end(), int64_t{0});
  std::vector<float> recv(static_cast<size_t>(M * s.hidden), -7.f);  // poisoned
  RDEP_RETURN_IF_ERROR(layer.Dispatch(r, ctx, f.x[i], recv));
  const std::vector<float> expert_out = experts.Forward(recv);
  out.y[i].assign(static_cast<size_t>(f.n(r) * s.hidden), -7.f);
  RDEP_RETURN_IF_ERROR(layer.Combine(r, ctx, expert_out, out.y[i]));
  std::vector<float> d_out(recv.size(), -7.f);
  out.dg[i].assign(static_cast<size_t>(f.n(r) * s.topk), -7.f);
  RDEP_RETURN_IF_ERROR(layer.CombineBackward(r, ctx, f.dy[i], d_out, out.dg[i]));
  const std::vector<float> d_recv = experts.Backward(recv, d_out, out.dw1[i], out.dw2[i]);
  out.dx[i].assign(out.y[i].size(), -7.f);
  return layer.DispatchBackward(r, ctx, d_recv, out.dx[i]);
}

Results RunRows(RowsFixture& f) {
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own);  // no weights: the caller computes
  Results out(f.c.shape.ranks);
  Status st = f.domain->Run([&](int32_t r) { return RowsForwardBackward(*layer, f, r, out); });
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

void ExpectBitwise(const Results& a, const Results& b, int64_t W, const std::string& what) {
  for (size_t i = 0; i < static_cast<size_t>(W); ++i) {
    EXPECT_EQ(a.y[i], b.y[i]) << what << ": y, rank " << i;
    EXPECT_EQ(a.dx[i], b.dx[i]) << what << ": dx, rank " << i;
    EXPECT_EQ(a.dg[i], b.dg[i]) << what << ": dgates, rank " << i;
    EXPECT_EQ(a.dw1[i], b.dw1[i]) << what << ": dW1, rank " << i;
    EXPECT_EQ(a.dw2[i], b.dw2[i]) << what << ": dW2, rank " << i;
  }
}

class HostRows : public ::testing::TestWithParam<Case> {};

TEST_P(HostRows, CallerExpertsEqualTheLayerBitwise) {
  RowsFixture f(GetParam());
  const Results layer = RunLayer(f);
  const Results rows = RunRows(f);
  ASSERT_FALSE(layer.y.empty());
  ExpectBitwise(layer, rows, f.c.shape.ranks, GetParam().name);
}

// Sentinel rows: x encodes (rank, token) exactly; each received row must be its token's row, on the
// owner of its expert, in expert-major order with ascending row ids inside an expert, and the received
// set must be exactly the plan's accepted rows of this owner.
TEST_P(HostRows, ReceivedRowsAreExactlyTheAcceptedRowsInOrder) {
  RowsFixture f(GetParam());
  const LayerShape& s = f.c.shape;
  for (int64_t r = 0; r < s.ranks; ++r)
    for (int64_t t = 0; t < f.n(static_cast<int32_t>(r)); ++t)
      for (int64_t c = 0; c < s.hidden; ++c)
        f.x[static_cast<size_t>(r)][static_cast<size_t>(t * s.hidden + c)] = static_cast<float>(r * 100000 + t * 10 + c % 10);
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own);
  auto plain = *HostMoELayer::Create(*f.domain, f.config, f.own, f.w);  // its acceptance is the reference
  std::vector<RankAcceptance> acc(static_cast<size_t>(s.ranks));
  ASSERT_TRUE(f.domain->Run([&](int32_t r) -> Status {
                std::vector<float> y(static_cast<size_t>(f.n(r) * s.hidden));
                RDEP_RETURN_IF_ERROR(plain->Forward(r, f.routing[static_cast<size_t>(r)], f.x[static_cast<size_t>(r)], y));
                acc[static_cast<size_t>(r)] = plain->acceptance(r);
                return Status::Ok();
              }).ok());
  const RowIdCodec codec{s.tokens, s.topk};
  std::vector<std::vector<float>> recv(static_cast<size_t>(s.ranks));
  std::vector<std::vector<uint64_t>> ids(static_cast<size_t>(s.ranks));
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(s.ranks));
  Status st = f.domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    ForwardContext ctx;
    RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx, f.routing[i]));
    RDEP_ASSIGN_OR_RETURN(counts[i], layer->recv_counts(ctx));
    recv[i].assign(static_cast<size_t>(std::accumulate(counts[i].begin(), counts[i].end(), int64_t{0}) * s.hidden), -1.f);
    RDEP_RETURN_IF_ERROR(layer->Dispatch(r, ctx, f.x[i], recv[i]));
    RDEP_ASSIGN_OR_RETURN(ids[i], layer->recv_row_ids(ctx));
    return Status::Ok();
  });
  ASSERT_TRUE(st.ok()) << st;
  int64_t received = 0, accepted = 0;
  for (int32_t q = 0; q < s.ranks; ++q) {
    const auto qi = static_cast<size_t>(q);
    ASSERT_EQ(counts[qi].size(), static_cast<size_t>(f.own.num_local(q)));
    int64_t row = 0;
    for (size_t j = 0; j < counts[qi].size(); ++j) {
      uint64_t prev = 0;
      for (int64_t m = 0; m < counts[qi][j]; ++m, ++row) {
        const uint64_t id = ids[qi][static_cast<size_t>(row)];
        const RowKey key = codec.decode(id);
        const auto src = static_cast<size_t>(key.rank);
        const auto slot = static_cast<size_t>(key.token * s.topk + key.slot);
        EXPECT_TRUE(m == 0 || id > prev) << "owner " << q << " expert " << j << ": row ids not ascending";
        prev = id;
        const int32_t e = f.routing[src].experts[slot];
        EXPECT_EQ(f.own.owner(e), q) << "row " << id << " of expert " << e << " at the wrong owner";
        EXPECT_EQ(f.own.local_index(e), static_cast<int32_t>(j)) << "row " << id << " under the wrong local expert";
        EXPECT_TRUE(acc[src].accepted[slot]) << "row " << id << " was dropped by the plan but delivered";
        for (int64_t c = 0; c < s.hidden; ++c)
          ASSERT_EQ(recv[qi][static_cast<size_t>(row * s.hidden + c)], f.x[src][static_cast<size_t>(key.token * s.hidden + c)])
              << "owner " << q << " row " << row << " column " << c;
      }
    }
    received += row;
  }
  for (const auto& a : acc) accepted += std::accumulate(a.accepted.begin(), a.accepted.end(), int64_t{0});
  EXPECT_EQ(received, accepted) << "every accepted row is delivered exactly once";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, HostRows,
    ::testing::Values(
        Case{"W4_E8_K2_uniform", {.tokens = 16, .hidden = 8, .ffn = 4, .experts = 8, .topk = 2, .ranks = 4}},
        Case{"W4_E16_K4_zipf_capacity_drops_S3",
             {.tokens = 24, .hidden = 12, .ffn = 6, .experts = 16, .topk = 4, .ranks = 4}, "zipf:1.2", 0.8, 3},
        Case{"W4_E6_not_divisible_K1_empty_rank2", {.tokens = 10, .hidden = 8, .ffn = 4, .experts = 6, .topk = 1, .ranks = 4},
             "uniform", 0.0, 0, 2},
        Case{"W5_E3_ranks_without_experts", {.tokens = 8, .hidden = 8, .ffn = 4, .experts = 3, .topk = 2, .ranks = 5}},
        Case{"W2_one_expert_set_S1", {.tokens = 12, .hidden = 8, .ffn = 4, .experts = 8, .topk = 3, .ranks = 2}, "one-expert",
             0.0, 1},
        Case{"W1_E4_K2", {.tokens = 16, .hidden = 8, .ffn = 8, .experts = 4, .topk = 2, .ranks = 1}, "zipf:1.0", 1.0}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// One context's inputs (routing, x, dy per rank), so contexts in flight together carry different data.
struct Inputs {
  Routing routing;
  std::vector<std::vector<float>> x, dy;
  Inputs(const LayerShape& s, const char* spec, uint64_t seed) {
    RoutingSpec rs = *RoutingSpec::Parse(spec);
    rs.seed = seed;
    routing = *GenerateRouting(s, rs);
    x = RandomActivations(s, routing, seed + 1);
    dy = RandomActivations(s, routing, seed + 2);
  }
};

// The steps of one context on one rank, as a schedule runs them.
struct ContextRun {
  const Inputs* in = nullptr;
  bool rows = true;  // dispatch/combine with the caller's experts, or the layer's own Forward/Backward
  ForwardContext ctx;
  CallerExperts ex;
  std::vector<float> recv, out, d_out, d_recv;
};

enum Step { kPlan, kDispatch, kRun, kCombine, kCombineBackward, kBackward, kDispatchBackward };

Status RunStep(HostMoELayer& layer, RowsFixture& f, int32_t r, ContextRun& c, Step step, Results& res) {
  const auto i = static_cast<size_t>(r);
  const LayerShape& s = f.c.shape;
  const int64_t n = c.in->routing[i].num_tokens, H = s.hidden;
  switch (step) {
    case kPlan: return layer.Plan(r, c.ctx, c.in->routing[i]);
    case kDispatch: {
      RDEP_ASSIGN_OR_RETURN(c.ex.counts, layer.recv_counts(c.ctx));
      c.recv.assign(static_cast<size_t>(std::accumulate(c.ex.counts.begin(), c.ex.counts.end(), int64_t{0}) * H), 0.f);
      RDEP_RETURN_IF_ERROR(layer.Dispatch(r, c.ctx, c.in->x[i], c.recv));
      c.out = c.ex.Forward(c.recv);
      return Status::Ok();
    }
    case kRun:
      res.y[i].assign(static_cast<size_t>(n * H), 0.f);
      return layer.Run(r, c.ctx, c.in->x[i], res.y[i]);
    case kCombine:
      res.y[i].assign(static_cast<size_t>(n * H), 0.f);
      return layer.Combine(r, c.ctx, c.out, res.y[i]);
    case kCombineBackward:
      c.d_out.assign(c.recv.size(), 0.f);
      res.dg[i].assign(static_cast<size_t>(n * s.topk), 0.f);
      RDEP_RETURN_IF_ERROR(layer.CombineBackward(r, c.ctx, c.in->dy[i], c.d_out, res.dg[i]));
      c.d_recv = c.ex.Backward(c.recv, c.d_out, res.dw1[i], res.dw2[i]);
      return Status::Ok();
    case kBackward:
      res.dx[i].assign(static_cast<size_t>(n * H), 0.f);
      res.dg[i].assign(static_cast<size_t>(n * s.topk), 0.f);
      RDEP_RETURN_IF_ERROR(layer.Backward(r, c.ctx, c.in->dy[i], res.dx[i], res.dg[i]));
      res.dw1[i].assign(layer.dw1(r).begin(), layer.dw1(r).end());
      res.dw2[i].assign(layer.dw2(r).begin(), layer.dw2(r).end());
      return Status::Ok();
    case kDispatchBackward:
      res.dx[i].assign(static_cast<size_t>(n * H), 0.f);
      return layer.DispatchBackward(r, c.ctx, c.d_recv, res.dx[i]);
  }
  return InternalError("unknown step");
}

// Runs (context index, step) pairs in order on every rank; contexts 0, 1 use the caller's experts,
// context 2 the layer's own forward and backward.
std::array<Results, 3> RunSchedule(HostMoELayer& layer, RowsFixture& f, const std::array<const Inputs*, 3>& in,
                                   const std::vector<std::pair<int, Step>>& schedule) {
  const int64_t W = f.c.shape.ranks;
  std::array<Results, 3> res{Results(W), Results(W), Results(W)};
  Status st = f.domain->Run([&](int32_t r) -> Status {
    std::array<ContextRun, 3> c;
    for (size_t k = 0; k < 3; ++k) {
      c[k].in = in[k];
      c[k].rows = k < 2;
      c[k].ex.f = &f;
      c[k].ex.rank = r;
    }
    for (const auto& [k, step] : schedule)
      RDEP_RETURN_IF_ERROR(RunStep(layer, f, r, c[static_cast<size_t>(k)], step, res[static_cast<size_t>(k)]));
    return Status::Ok();
  });
  EXPECT_TRUE(st.ok()) << st;
  return res;
}

// Two dispatch/combine forwards and a plain forward of the same layer in flight together, each with
// its own routing and data, their steps interleaved and backwards in another order, with one rank
// reading its received rows late: each equals the same context's calls made one at a time. Without
// the return.start or rows.taken barriers, a late reader sees the next call's rows (checked by
// removing them).
// Segment sizes: 5 (several segments) and 64 = W*T (one segment, so the next dispatch's first scatter
// reuses the buffer the late reader is still reading: the case rows.taken exists for).
class HostRowsInFlight : public ::testing::TestWithParam<int64_t> {};

TEST_P(HostRowsInFlight, DistinctDataAndALateReaderEqualEachAlone) {
  RowsFixture f(Case{"interleaved", {.tokens = 16, .hidden = 8, .ffn = 4, .experts = 8, .topk = 2, .ranks = 4}, "zipf:1.0", 1.0,
                     GetParam()});
  const LayerShape& s = f.c.shape;
  const Inputs a(s, "zipf:1.0", 5), b(s, "uniform", 9), c(s, "one-expert", 13);
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own, f.w);
  const std::vector<std::pair<int, Step>> rows_alone = {{0, kPlan}, {0, kDispatch}, {0, kCombine}, {0, kCombineBackward},
                                                        {0, kDispatchBackward}};
  const std::vector<std::pair<int, Step>> plain_alone = {{2, kPlan}, {2, kRun}, {2, kBackward}};
  const Results want_a = RunSchedule(*layer, f, {&a, &b, &c}, rows_alone)[0];
  const Results want_b = RunSchedule(*layer, f, {&b, &a, &c}, rows_alone)[0];
  const Results want_c = RunSchedule(*layer, f, {&a, &b, &c}, plain_alone)[2];
  layer->set_read_delay_for_test(1, 0.02);
  const std::array<Results, 3> got = RunSchedule(
      *layer, f, {&a, &b, &c},
      {{0, kPlan}, {1, kPlan}, {2, kPlan}, {0, kDispatch}, {1, kDispatch}, {2, kRun}, {0, kCombine}, {1, kCombine},
       {1, kCombineBackward}, {0, kCombineBackward}, {2, kBackward}, {0, kDispatchBackward}, {1, kDispatchBackward}});
  ExpectBitwise(want_a, got[0], s.ranks, "first dispatch/combine context");
  ExpectBitwise(want_b, got[1], s.ranks, "second dispatch/combine context");
  for (size_t i = 0; i < static_cast<size_t>(s.ranks); ++i) {  // the plain context: y, dx, dgates, dW
    EXPECT_EQ(want_c.y[i], got[2].y[i]) << "plain context: y, rank " << i;
    EXPECT_EQ(want_c.dx[i], got[2].dx[i]) << "plain context: dx, rank " << i;
    EXPECT_EQ(want_c.dg[i], got[2].dg[i]) << "plain context: dgates, rank " << i;
    EXPECT_EQ(want_c.dw1[i], got[2].dw1[i]) << "plain context: dW1, rank " << i;
  }
  EXPECT_NE(want_a.y[0], want_b.y[0]) << "the contexts must carry different data for this test to mean anything";
}

INSTANTIATE_TEST_SUITE_P(Segments, HostRowsInFlight, ::testing::Values(5, 64),
                         [](const ::testing::TestParamInfo<int64_t>& i) { return "S" + std::to_string(i.param); });

// Dispatch's backward may run without Combine's (the received rows used directly): dx is the sum of
// the given row gradients over each token's accepted slots.
TEST(HostRows_Contexts, DispatchBackwardWithoutCombine) {
  RowsFixture f(Case{"no_combine", {.tokens = 8, .hidden = 4, .ffn = 4, .experts = 4, .topk = 2, .ranks = 2}});
  const LayerShape& s = f.c.shape;
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own);
  std::vector<std::vector<float>> dx(2);
  Status st = f.domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    ForwardContext ctx;
    RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx, f.routing[i]));
    RDEP_ASSIGN_OR_RETURN(std::vector<int64_t> counts, layer->recv_counts(ctx));
    std::vector<float> recv(static_cast<size_t>(std::accumulate(counts.begin(), counts.end(), int64_t{0}) * s.hidden));
    RDEP_RETURN_IF_ERROR(layer->Dispatch(r, ctx, f.x[i], recv));
    dx[i].assign(static_cast<size_t>(f.n(r) * s.hidden), -1.f);
    return layer->DispatchBackward(r, ctx, recv, dx[i]);  // the row gradient = the row itself
  });
  ASSERT_TRUE(st.ok()) << st;
  for (size_t r = 0; r < 2; ++r)  // dropless: every slot accepted, so dx_t = K * x_t exactly (K = 2)
    for (size_t c = 0; c < dx[r].size(); ++c) EXPECT_EQ(dx[r][c], 2.f * f.x[r][c]) << "rank " << r << " value " << c;
}

TEST(HostRows_Contexts, MisuseIsAnErrorNamingIt) {
  RowsFixture f(Case{"misuse", {.tokens = 8, .hidden = 4, .ffn = 4, .experts = 4, .topk = 2, .ranks = 2}});
  const LayerShape& s = f.c.shape;
  auto layer = *HostMoELayer::Create(*f.domain, f.config, f.own, f.w);
  std::vector<std::vector<std::string>> errors(2);
  Status st = f.domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    auto& e = errors[i];
    const int64_t n = f.n(r), H = s.hidden;
    std::vector<float> y(static_cast<size_t>(n * H)), dg(static_cast<size_t>(n * s.topk)), big(4096);
    ForwardContext ctx;
    e.push_back(layer->Dispatch(r, ctx, f.x[i], big).message());                     // no plan
    RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx, f.routing[i]));
    e.push_back(layer->Combine(r, ctx, big, y).message());                           // no dispatch
    RDEP_ASSIGN_OR_RETURN(std::vector<int64_t> counts, layer->recv_counts(ctx));
    const int64_t M = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    std::vector<float> recv(static_cast<size_t>(M * H)), wrong(static_cast<size_t>(M * H + 1));
    e.push_back(layer->Dispatch(r, ctx, f.x[i], wrong).message());                   // wrong size (every rank)
    RDEP_RETURN_IF_ERROR(layer->Dispatch(r, ctx, f.x[i], recv));
    e.push_back(layer->CombineBackward(r, ctx, f.x[i], recv, dg).message());         // before Combine
    RDEP_RETURN_IF_ERROR(layer->Combine(r, ctx, recv, y));
    e.push_back(layer->Combine(r, ctx, recv, y).message());                          // twice
    e.push_back(layer->Backward(r, ctx, f.x[i], y, dg).message());                   // not a plain forward
    RDEP_RETURN_IF_ERROR(layer->CombineBackward(r, ctx, f.x[i], recv, dg));
    RDEP_RETURN_IF_ERROR(layer->DispatchBackward(r, ctx, recv, y));
    e.push_back(layer->DispatchBackward(r, ctx, recv, y).message());                 // twice
    ForwardContext plain;
    RDEP_RETURN_IF_ERROR(layer->Forward(r, plain, f.routing[i], f.x[i], y));
    e.push_back(layer->CombineBackward(r, plain, f.x[i], recv, dg).message());       // a plain forward's context
    return Status::Ok();
  });
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<std::string> want = {
      "dispatch on rank 0: the context holds no plan",
      "combine on rank 0: the context holds no dispatched rows",
      "dispatch output recv on rank 0 has",
      "combine backward on rank 0: the context holds no combined",
      "combine on rank 0: the context's rows were already combined",
      "ran through dispatch/combine with the caller's experts; its backward is CombineBackward",
      "dispatch backward on rank 0: it already ran",
      "combine backward on rank 0: the context holds no combined",
  };
  ASSERT_EQ(errors[0].size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) EXPECT_NE(errors[0][k].find(want[k]), std::string::npos) << errors[0][k];
}

TEST(HostRows_Contexts, BalancingAndNodesAreRefused) {
  const LayerShape shape{.tokens = 8, .hidden = 4, .ffn = 4, .experts = 8, .topk = 2, .ranks = 4};
  auto domain = *HostDomain::Create(4, {.barrier_timeout_s = 10});
  const OwnershipMap own = *OwnershipMap::Contiguous(8, 4);
  Routing routing = *GenerateRouting(shape, RoutingSpec{});
  std::vector<std::vector<float>> x = RandomActivations(shape, routing, 1);
  LayerConfig balanced = MakeLayerConfig(shape);
  balanced.balance.kind = BalanceKind::kUltraEp;
  balanced.balance.num_slots = 1;
  LayerConfig nodes = MakeLayerConfig(shape);
  nodes.nodes = NodeConfig{2, 0};
  for (const auto& [config, want] : {std::pair{balanced, "cannot run with balancing (ultraep)"},
                                     std::pair{nodes, "not supported with the two-phase exchange (N=2 nodes)"}}) {
    auto layer = *HostMoELayer::Create(*domain, config, own);
    std::vector<std::string> msg(4);
    ASSERT_TRUE(domain->Run([&](int32_t r) -> Status {
                  ForwardContext ctx;
                  RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx, routing[static_cast<size_t>(r)]));
                  std::vector<float> recv(64);
                  msg[static_cast<size_t>(r)] = layer->Dispatch(r, ctx, x[static_cast<size_t>(r)], recv).message();
                  return Status::Ok();
                }).ok());
    for (const auto& m : msg) EXPECT_NE(m.find(want), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace rdep
