// The C ABI's dispatch/combine calls (the caller's own experts) on the host backend: bitwise equal to
// HostMoELayer's Plan/Dispatch/Combine/CombineBackward/DispatchBackward on the same routing and the
// same caller computation, the received row ids, and errors that name the field, rank or step.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "rdep/capi.h"
#include "rdep/core/routing.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

using Vec = std::vector<float>;

// The caller's "experts": an elementwise map, so the expected rows are easy to state.
Vec Expert(const Vec& rows) {
  Vec out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = 0.5f * rows[i] + 1.f;
  return out;
}
Vec ExpertGrad(const Vec& d_out) {
  Vec d(d_out.size());
  for (size_t i = 0; i < d_out.size(); ++i) d[i] = 0.5f * d_out[i];
  return d;
}

struct PerRank {
  std::vector<Vec> recv, y, d_out, dg, dx;
  std::vector<std::vector<uint64_t>> ids;
  explicit PerRank(size_t W) : recv(W), y(W), d_out(W), dg(W), dx(W), ids(W) {}
};

struct Problem {
  LayerShape s{.tokens = 12, .hidden = 8, .ffn = 6, .experts = 6, .topk = 2, .ranks = 4};
  double capacity = 0.9;
  Routing routing;
  std::vector<Vec> x, dy;
  Problem() {
    RoutingSpec rs;
    rs.family = RoutingSpec::Family::kZipf;
    rs.alpha = 1.2;
    rs.empty_rank = 3;
    routing = *GenerateRouting(s, rs);
    x = RandomActivations(s, routing, 4);
    dy = RandomActivations(s, routing, 5);
  }
  size_t n(size_t r) const { return static_cast<size_t>(routing[r].num_tokens); }
};

PerRank RunLayer(const Problem& p) {
  const LayerShape& s = p.s;
  const auto W = static_cast<size_t>(s.ranks), H = static_cast<size_t>(s.hidden), K = static_cast<size_t>(s.topk);
  auto domain = std::move(*HostDomain::Create(s.ranks, {.barrier_timeout_s = 10}));
  auto layer = std::move(*HostMoELayer::Create(*domain, MakeLayerConfig(s, {p.capacity}), *OwnershipMap::Contiguous(s.experts, s.ranks)));
  PerRank out(W);
  EXPECT_TRUE(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    ForwardContext ctx;
    RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx, p.routing[i]));
    RDEP_ASSIGN_OR_RETURN(std::vector<int64_t> counts, layer->recv_counts(ctx));
    out.recv[i].assign(static_cast<size_t>(std::accumulate(counts.begin(), counts.end(), int64_t{0})) * H, 0.f);
    RDEP_RETURN_IF_ERROR(layer->Dispatch(r, ctx, p.x[i], out.recv[i]));
    RDEP_ASSIGN_OR_RETURN(out.ids[i], layer->recv_row_ids(ctx));
    out.y[i].assign(p.n(i) * H, 0.f);
    RDEP_RETURN_IF_ERROR(layer->Combine(r, ctx, Expert(out.recv[i]), out.y[i]));
    out.d_out[i].assign(out.recv[i].size(), 0.f);
    out.dg[i].assign(p.n(i) * K, 0.f);
    RDEP_RETURN_IF_ERROR(layer->CombineBackward(r, ctx, p.dy[i], out.d_out[i], out.dg[i]));
    out.dx[i].assign(p.n(i) * H, 0.f);
    return layer->DispatchBackward(r, ctx, ExpertGrad(out.d_out[i]), out.dx[i]);
  }).ok());
  return out;
}

rdep_layer* MakeAbi(const Problem& p) {
  rdep_layer_spec spec{};
  spec.struct_size = sizeof(rdep_layer_spec);
  spec.backend = RDEP_BACKEND_HOST;
  spec.world_size = static_cast<int32_t>(p.s.ranks);
  spec.tokens = p.s.tokens;
  spec.hidden = p.s.hidden;
  spec.ffn = p.s.ffn;
  spec.experts = p.s.experts;
  spec.topk = p.s.topk;
  spec.capacity_factor = p.capacity;
  spec.barrier_timeout_s = 10;
  rdep_layer* abi = nullptr;
  EXPECT_EQ(rdep_layer_create(&spec, &abi), 0) << rdep_last_error();
  return abi;
}

std::vector<rdep_rank_io> PlanIo(const Problem& p) {
  std::vector<rdep_rank_io> io(static_cast<size_t>(p.s.ranks));
  for (size_t r = 0; r < io.size(); ++r) {
    io[r] = rdep_rank_io{};
    io[r].num_tokens = p.routing[r].num_tokens;
    io[r].experts = p.routing[r].experts.data();
    io[r].gates = p.routing[r].gates.data();
  }
  return io;
}

// rows[r] = {in, out, dgates, stream, in_rows, out_rows, reserved}
int Step(int (*fn)(rdep_layer*, int64_t, const rdep_rank_rows*, int32_t), rdep_layer* abi, int64_t ctx,
         std::vector<rdep_rank_rows>& rows) {
  return fn(abi, ctx, rows.data(), static_cast<int32_t>(rows.size()));
}

TEST(CApiRows, MatchesHostLayerBitwise) {
  const Problem p;
  const PerRank want = RunLayer(p);
  const auto W = static_cast<size_t>(p.s.ranks), H = static_cast<size_t>(p.s.hidden), K = static_cast<size_t>(p.s.topk);
  rdep_layer* abi = MakeAbi(p);
  ASSERT_NE(abi, nullptr);
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(abi, &ctx), 0);
  std::vector<rdep_rank_io> io = PlanIo(p);
  ASSERT_EQ(rdep_layer_plan(abi, ctx, io.data(), static_cast<int32_t>(W)), 0) << rdep_last_error();
  PerRank got(W);
  std::vector<Vec> out(W), d_recv(W);
  std::vector<rdep_rank_rows> rows(W);
  for (size_t r = 0; r < W; ++r) {
    int64_t e0 = 0, ne = 0;
    ASSERT_EQ(rdep_layer_owned_experts(abi, static_cast<int32_t>(r), &e0, &ne), 0);
    std::vector<int64_t> counts(static_cast<size_t>(ne), -1);
    ASSERT_EQ(rdep_context_recv_counts(abi, ctx, static_cast<int32_t>(r), counts.data(), ne), 0) << rdep_last_error();
    const int64_t M = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    got.recv[r].assign(static_cast<size_t>(M) * H, -7.f);  // poisoned
    rows[r] = rdep_rank_rows{p.x[r].data(), got.recv[r].data(), nullptr, nullptr, p.routing[r].num_tokens, M, 0};
  }
  ASSERT_EQ(Step(rdep_layer_dispatch, abi, ctx, rows), 0) << rdep_last_error();
  for (size_t r = 0; r < W; ++r) {
    const auto M = static_cast<int64_t>(got.recv[r].size() / H);
    std::vector<int64_t> ids(static_cast<size_t>(M));
    ASSERT_EQ(rdep_context_recv_row_ids(abi, ctx, static_cast<int32_t>(r), ids.data(), M), 0) << rdep_last_error();
    got.ids[r].assign(ids.begin(), ids.end());
    out[r] = Expert(got.recv[r]);
    got.y[r].assign(p.n(r) * H, -7.f);
    rows[r] = rdep_rank_rows{out[r].data(), got.y[r].data(), nullptr, nullptr, M, p.routing[r].num_tokens, 0};
  }
  ASSERT_EQ(Step(rdep_layer_combine, abi, ctx, rows), 0) << rdep_last_error();
  for (size_t r = 0; r < W; ++r) {
    got.d_out[r].assign(got.recv[r].size(), -7.f);
    got.dg[r].assign(p.n(r) * K, -7.f);
    rows[r] = rdep_rank_rows{p.dy[r].data(), got.d_out[r].data(), got.dg[r].data(), nullptr, p.routing[r].num_tokens,
                             static_cast<int64_t>(got.recv[r].size() / H), 0};
  }
  ASSERT_EQ(Step(rdep_layer_combine_backward, abi, ctx, rows), 0) << rdep_last_error();
  for (size_t r = 0; r < W; ++r) {
    d_recv[r] = ExpertGrad(got.d_out[r]);
    got.dx[r].assign(p.n(r) * H, -7.f);
    rows[r] = rdep_rank_rows{d_recv[r].data(), got.dx[r].data(), nullptr, nullptr, static_cast<int64_t>(d_recv[r].size() / H),
                             p.routing[r].num_tokens, 0};
  }
  ASSERT_EQ(Step(rdep_layer_dispatch_backward, abi, ctx, rows), 0) << rdep_last_error();
  for (size_t r = 0; r < W; ++r) {
    EXPECT_EQ(got.recv[r], want.recv[r]) << "recv, rank " << r;
    EXPECT_EQ(got.ids[r], want.ids[r]) << "row ids, rank " << r;
    EXPECT_EQ(got.y[r], want.y[r]) << "y, rank " << r;
    EXPECT_EQ(got.d_out[r], want.d_out[r]) << "d_out, rank " << r;
    EXPECT_EQ(got.dg[r], want.dg[r]) << "dgates, rank " << r;
    EXPECT_EQ(got.dx[r], want.dx[r]) << "dx, rank " << r;
  }
  // The context was consumed by dispatch backward: a plain backward on it is refused by the slot.
  std::vector<rdep_rank_io> bio(W);
  EXPECT_NE(rdep_layer_backward(abi, ctx, bio.data(), static_cast<int32_t>(W)), 0);
  EXPECT_EQ(rdep_context_release(abi, ctx), 0);
  rdep_layer_destroy(abi);
}

TEST(CApiRows, ErrorsNameTheFieldRankOrStep) {
  const Problem p;
  const auto W = static_cast<int32_t>(p.s.ranks);
  rdep_layer* abi = MakeAbi(p);
  ASSERT_NE(abi, nullptr);
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(abi, &ctx), 0);
  auto expect_error = [](int rc, const std::string& want) {
    EXPECT_NE(rc, 0);
    const std::string got = rdep_last_error();
    EXPECT_NE(got.find(want), std::string::npos) << "got: " << got << "\nwant: " << want;
  };
  std::vector<rdep_rank_io> io = PlanIo(p);
  io[1].num_tokens = p.s.tokens + 1;
  expect_error(rdep_layer_plan(abi, ctx, io.data(), W), "plan on rank 1: num_tokens 13 outside [0, T=12]");
  io = PlanIo(p);
  io[2].gates = nullptr;
  expect_error(rdep_layer_plan(abi, ctx, io.data(), W), "plan on rank 2: gates is null");
  io = PlanIo(p);
  expect_error(rdep_layer_plan(abi, ctx, io.data(), W - 1), "io has 3 entries; this process drives 4 ranks");
  expect_error(rdep_layer_plan(abi, ctx + 1, io.data(), W), "is not a live context of this layer");
  std::vector<rdep_rank_rows> rows(static_cast<size_t>(W), rdep_rank_rows{});
  expect_error(Step(rdep_layer_dispatch, abi, ctx, rows), "dispatch on rank 0: the context holds no plan");
  ASSERT_EQ(rdep_layer_plan(abi, ctx, io.data(), W), 0) << rdep_last_error();
  int64_t counts[8];
  expect_error(rdep_context_recv_counts(abi, ctx, 0, counts, 7), "num_counts 7 != the 2 experts rank 0 owns");
  expect_error(rdep_context_recv_counts(abi, ctx, 9, counts, 2), "rank 9 is not driven by this process");
  expect_error(rdep_context_recv_row_ids(abi, ctx, 0, nullptr, 0), "the context holds no dispatched rows");
  rows[1].in_rows = -1;
  expect_error(Step(rdep_layer_dispatch, abi, ctx, rows), "dispatch on rank 1: in_rows and out_rows must be >= 0");
  rows[1] = rdep_rank_rows{};
  rows[2].out_rows = 3;
  expect_error(Step(rdep_layer_dispatch, abi, ctx, rows), "dispatch on rank 2: out is null with out_rows 3");
  rows[2] = rdep_rank_rows{};
  rows[3].reserved = 1;
  expect_error(Step(rdep_layer_combine, abi, ctx, rows), "combine on rank 3: reserved must be 0");
  rows[3] = rdep_rank_rows{};
  rows[0].in_rows = 2;
  rows[0].in = p.x[0].data();
  expect_error(Step(rdep_layer_combine_backward, abi, ctx, rows), "combine backward on rank 0: dgates is null");
  rows[0] = rdep_rank_rows{};
  expect_error(Step(rdep_layer_combine, abi, ctx, rows), "combine on rank 0: the context holds no dispatched rows");
  // Row counts that differ from the plan, on one rank: refused before the collective, naming the rank.
  std::vector<rdep_rank_rows> sized(static_cast<size_t>(W));
  std::vector<Vec> recv(static_cast<size_t>(W));
  for (int32_t r = 0; r < W; ++r) {
    int64_t e0 = 0, ne = 0;
    ASSERT_EQ(rdep_layer_owned_experts(abi, r, &e0, &ne), 0);
    ASSERT_EQ(rdep_context_recv_counts(abi, ctx, r, counts, ne), 0) << rdep_last_error();
    int64_t M = 0;
    for (int64_t k = 0; k < ne; ++k) M += counts[k];
    recv[static_cast<size_t>(r)].assign(static_cast<size_t>((M + 1) * p.s.hidden), 0.f);
    sized[static_cast<size_t>(r)] = rdep_rank_rows{p.x[static_cast<size_t>(r)].data(), recv[static_cast<size_t>(r)].data(), nullptr,
                                                   nullptr, p.routing[static_cast<size_t>(r)].num_tokens, M, 0};
  }
  sized[2].out_rows += 1;
  expect_error(Step(rdep_layer_dispatch, abi, ctx, sized),
               "dispatch on rank 2: out_rows " + std::to_string(sized[2].out_rows) + " != the rows the rank receives");
  sized[2].out_rows -= 1;
  sized[1].in_rows += 1;
  expect_error(Step(rdep_layer_dispatch, abi, ctx, sized), "dispatch on rank 1: in_rows");
  sized[1].in_rows -= 1;
  EXPECT_EQ(Step(rdep_layer_dispatch, abi, ctx, sized), 0) << rdep_last_error();  // the plan is still usable
  EXPECT_EQ(rdep_context_release(abi, ctx), 0);
  rdep_layer_destroy(abi);
}

}  // namespace
}  // namespace rdep
