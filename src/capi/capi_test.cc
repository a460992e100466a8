// The C ABI on the host backend: results bitwise equal to HostMoELayer with its own copy of the same
// weights (forward y, backward dx, dgates, dw1, dw2), with and without capacity drops and with E not
// divisible by W; the context pool (stale ids, reuse, several forwards in flight); and errors that
// name the field, rank or context.
#include "rdep/capi.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "rdep/core/routing.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

using Vec = std::vector<float>;

rdep_layer_spec Spec(const LayerShape& s, double capacity) {
  rdep_layer_spec spec{};
  spec.struct_size = sizeof(rdep_layer_spec);
  spec.backend = RDEP_BACKEND_HOST;
  spec.world_size = static_cast<int32_t>(s.ranks);
  spec.tokens = s.tokens;
  spec.hidden = s.hidden;
  spec.ffn = s.ffn;
  spec.experts = s.experts;
  spec.topk = s.topk;
  spec.capacity_factor = capacity;
  spec.barrier_timeout_s = 10;
  return spec;
}

struct Case {
  LayerShape shape;
  double capacity;
  RoutingSpec::Family routing;
};

// The same forward and backward through HostMoELayer (own weights) and through the C ABI (bound).
void ExpectAbiMatchesLayer(const Case& c) {
  const LayerShape& s = c.shape;
  const auto W = static_cast<size_t>(s.ranks);
  const MoEWeights w = RandomWeights(s, 3);
  RoutingSpec rs;
  rs.family = c.routing;
  rs.alpha = 1.2;
  const Routing routing = *GenerateRouting(s, rs);
  const auto x = RandomActivations(s, routing, 4);
  const auto dy = RandomActivations(s, routing, 5);
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);

  // Reference: the layer with its own weights.
  auto domain = std::move(*HostDomain::Create(s.ranks, {.barrier_timeout_s = 10}));
  LayerConfig cfg = MakeLayerConfig(s, {c.capacity});
  auto layer = std::move(*HostMoELayer::Create(*domain, cfg, own, w));
  std::vector<Vec> y_ref(W), dx_ref(W), dg_ref(W), dw1_ref(W), dw2_ref(W);
  ASSERT_TRUE(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    const int64_t n = routing[i].num_tokens;
    y_ref[i].assign(static_cast<size_t>(n * s.hidden), 0.f);
    dx_ref[i] = y_ref[i];
    dg_ref[i].assign(static_cast<size_t>(n * s.topk), 0.f);
    RDEP_RETURN_IF_ERROR(layer->Forward(r, routing[i], x[i], y_ref[i]));
    RDEP_RETURN_IF_ERROR(layer->Backward(r, dy[i], dx_ref[i], dg_ref[i]));
    dw1_ref[i].assign(layer->dw1(r).begin(), layer->dw1(r).end());
    dw2_ref[i].assign(layer->dw2(r).begin(), layer->dw2(r).end());
    return Status::Ok();
  }).ok());

  // The ABI, with the weights as the caller's per-rank arrays.
  const rdep_layer_spec spec = Spec(s, c.capacity);
  rdep_layer* abi = nullptr;
  ASSERT_EQ(rdep_layer_create(&spec, &abi), 0) << rdep_last_error();
  int32_t first = -1, count = 0;
  ASSERT_EQ(rdep_layer_local_ranks(abi, &first, &count), 0);
  ASSERT_EQ(first, 0);
  ASSERT_EQ(count, s.ranks);
  const size_t n1 = w.w1_per_expert(), n2 = w.w2_per_expert();
  std::vector<Vec> w1(W), w2(W), y(W), dx(W), dg(W), dw1(W), dw2(W);
  std::vector<std::vector<int32_t>> experts(W);
  std::vector<Vec> gates(W);
  std::vector<rdep_rank_io> io(W);
  for (size_t r = 0; r < W; ++r) {
    int64_t e0 = -1, ne = -1;
    ASSERT_EQ(rdep_layer_owned_experts(abi, static_cast<int32_t>(r), &e0, &ne), 0);
    ASSERT_EQ(ne, own.num_local(static_cast<int32_t>(r)));
    w1[r].assign(w.w1.begin() + e0 * static_cast<int64_t>(n1), w.w1.begin() + (e0 + ne) * static_cast<int64_t>(n1));
    w2[r].assign(w.w2.begin() + e0 * static_cast<int64_t>(n2), w.w2.begin() + (e0 + ne) * static_cast<int64_t>(n2));
    const int64_t n = routing[r].num_tokens;
    y[r].assign(static_cast<size_t>(n * s.hidden), -7.f);  // poisoned outputs
    dx[r] = y[r];
    dg[r].assign(static_cast<size_t>(n * s.topk), -7.f);
    dw1[r].assign(w1[r].size(), -7.f);
    dw2[r].assign(w2[r].size(), -7.f);
    io[r] = rdep_rank_io{n, routing[r].experts.data(), routing[r].gates.data(), x[r].data(), y[r].data(), w1[r].data(),
                         w2[r].data(), dy[r].data(), dx[r].data(), dg[r].data(), dw1[r].data(), dw2[r].data(), nullptr, 0, 0};
  }
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(abi, &ctx), 0);
  ASSERT_EQ(rdep_layer_forward(abi, ctx, io.data(), count), 0) << rdep_last_error();
  size_t bytes = 0;
  ASSERT_EQ(rdep_context_bytes(abi, ctx, &bytes), 0);
  EXPECT_GT(bytes, 0u);
  ASSERT_EQ(rdep_layer_backward(abi, ctx, io.data(), count), 0) << rdep_last_error();
  EXPECT_EQ(rdep_context_release(abi, ctx), 0);
  for (size_t r = 0; r < W; ++r) {
    EXPECT_EQ(y[r], y_ref[r]) << "rank " << r;
    EXPECT_EQ(dx[r], dx_ref[r]) << "rank " << r;
    EXPECT_EQ(dg[r], dg_ref[r]) << "rank " << r;
    EXPECT_EQ(dw1[r], dw1_ref[r]) << "rank " << r;
    EXPECT_EQ(dw2[r], dw2_ref[r]) << "rank " << r;
  }
  // Version 17: the host backend has no row allocator, so a forward given an arena is rdep_layer_forward (none used).
  for (size_t r = 0; r < W; ++r) std::fill(y[r].begin(), y[r].end(), -7.f);
  alignas(256) static char arena[1024];
  size_t used = 1;
  ASSERT_EQ(rdep_context_acquire(abi, &ctx), 0);
  EXPECT_EQ(rdep_layer_forward_arena(abi, ctx, io.data(), count, arena + 8, sizeof(arena) - 8, &used), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("rows: the arena must be 256-byte aligned"), std::string::npos) << rdep_last_error();
  ASSERT_EQ(rdep_layer_forward_arena(abi, ctx, io.data(), count, arena, sizeof(arena), &used), 0) << rdep_last_error();
  EXPECT_EQ(used, 0u);
  // Version 18: no rows came from the arena, so a move of it changes nothing; a bad new address is still refused.
  alignas(256) static char moved[1024];
  EXPECT_EQ(rdep_context_rebase_rows(abi, ctx, arena, sizeof(arena), moved + 16), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("256-byte aligned"), std::string::npos) << rdep_last_error();
  EXPECT_EQ(rdep_context_rebase_rows(abi, ctx, arena, sizeof(arena), moved), 0) << rdep_last_error();
  EXPECT_EQ(rdep_context_rebase_rows(nullptr, ctx, arena, sizeof(arena), moved), 1);
  EXPECT_EQ(rdep_context_release(abi, ctx), 0);
  EXPECT_EQ(rdep_context_rebase_rows(abi, ctx, arena, sizeof(arena), moved), 1) << "a stale id";
  for (size_t r = 0; r < W; ++r) EXPECT_EQ(y[r], y_ref[r]) << "rank " << r;
  rdep_layer_destroy(abi);
}

TEST(CApi, MatchesHostLayerDropless) {
  ExpectAbiMatchesLayer({{.tokens = 12, .hidden = 8, .ffn = 6, .experts = 8, .topk = 2, .ranks = 4}, 0.0, RoutingSpec::Family::kUniform});
}

TEST(CApi, MatchesHostLayerWithDropsAndUnevenOwnership) {
  ExpectAbiMatchesLayer({{.tokens = 16, .hidden = 8, .ffn = 4, .experts = 7, .topk = 3, .ranks = 3}, 0.5, RoutingSpec::Family::kZipf});
}

TEST(CApi, MatchesHostLayerOneRank) {
  ExpectAbiMatchesLayer({{.tokens = 9, .hidden = 4, .ffn = 4, .experts = 5, .topk = 2, .ranks = 1}, 0.0, RoutingSpec::Family::kUniform});
}

TEST(CApi, SpecErrorsNameTheField) {
  const LayerShape s{.tokens = 4, .hidden = 4, .ffn = 4, .experts = 4, .topk = 2, .ranks = 2};
  // The spec Spec(s, 0) changed by `edit`: create returns `code` and makes no layer, and the error
  // contains `says`.
  auto refused = [&](auto edit, const std::string& says, int code = 1) {
    rdep_layer_spec spec = Spec(s, 0);
    edit(spec);
    rdep_layer* l = nullptr;
    EXPECT_EQ(rdep_layer_create(&spec, &l), code) << says;
    EXPECT_EQ(l, nullptr) << says;
    EXPECT_NE(std::string(rdep_last_error()).find(says), std::string::npos) << rdep_last_error();
  };
  // The spec changed by `edit` is valid: a layer is made.
  auto made = [&](auto edit, const char* what) {
    rdep_layer_spec spec = Spec(s, 0);
    edit(spec);
    rdep_layer* l = nullptr;
    ASSERT_EQ(rdep_layer_create(&spec, &l), 0) << what << ": " << rdep_last_error();
    rdep_layer_destroy(l);
  };
  refused([](rdep_layer_spec& x) { x.struct_size = 8; }, "struct_size");
  refused([](rdep_layer_spec& x) { x.topk = 9; }, "K");
  refused([](rdep_layer_spec& x) { x.backend = 7; }, "backend");
  refused([](rdep_layer_spec& x) { x.capacity_factor = -1; }, "");
  refused([](rdep_layer_spec& x) { x.balance = 7; }, "balance 7 is not 0 (off)");
  refused([](rdep_layer_spec& x) { x.expert_compute = 2; }, "expert_compute 2 is not 0 (cublaslt) or 1 (cutlass)");
  made([](rdep_layer_spec& x) { x.expert_compute = 1; }, "expert_compute 1 (the host backend ignores it)");
  refused([](rdep_layer_spec& x) { x.owner_reduce = 2; }, "owner_reduce 2 is not 0 (off) or 1 (on)");
  refused([](rdep_layer_spec& x) { x.owner_reduce = 1, x.nodes = 2; }, "owner_reduce: with nodes (N=2)");
  refused([](rdep_layer_spec& x) { x.transport_sms = 1025; }, "transport_sms: 1025 is outside [0, 1024]");
  refused([](rdep_layer_spec& x) { x.transport_sms = -1; }, "transport_sms: -1 is outside");
  refused([](rdep_layer_spec& x) { x.reserved = 3; }, "reserved must be 0, got 3");
  refused([](rdep_layer_spec& x) { x.no_source_windows = 2; }, "no_source_windows 2 is not 0 (per-source windows where they apply)");
  made([](rdep_layer_spec& x) { x.no_source_windows = 1; }, "no_source_windows 1 (the host backend ignores it)");
  refused([](rdep_layer_spec& x) { x.transport_sms = 2, x.nodes = 2; }, "transport_sms: not with nodes");
  made([](rdep_layer_spec& x) { x.transport_sms = 8; }, "transport_sms 8 (the host backend ignores it)");
  refused([](rdep_layer_spec& x) { x.overlap_segments = 2; }, "overlap_segments 2 is not 0 (off) or 1 (on)");
  made([](rdep_layer_spec& x) { x.overlap_segments = 1; }, "overlap_segments 1 (the host backend ignores it)");
  refused([](rdep_layer_spec& x) { x.nodes = 3; }, "N=3 must be >= 1 and divide W=2");
  made([](rdep_layer_spec& x) { x.balance = RDEP_BALANCE_ULTRAEP, x.balance_slots = 1, x.balance_relay_above = -1; },
       "version-2 fields that are valid");
  made([](rdep_layer_spec& x) { x.nodes = 2, x.max_nodes = 1; }, "nodes 2, max_nodes 1");
  refused([](rdep_layer_spec& x) { x.balance = RDEP_BALANCE_ULTRAEP, x.balance_slots = 1, x.balance_min_gain = -1; },
          "balance_min_gain must be >= 0");
  refused([](rdep_layer_spec& x) { x.balance = RDEP_BALANCE_EPLB, x.balance_slots = 1, x.balance_min_gain = 4; },
          "balance_min_gain is UltraEP's gain gate");
  made([](rdep_layer_spec& x) { x.balance = RDEP_BALANCE_ULTRAEP, x.balance_slots = 1, x.balance_min_gain = 2500; },
       "version-9 balance_min_gain with ultraep");
  refused([](rdep_layer_spec& x) { x.stash_rows = -1; }, "stash_rows must be >= 0");
  made([](rdep_layer_spec& x) { x.stash_rows = 4096; }, "version-10 stash_rows (the host backend ignores it)");
  if (!rdep_built_with_cuda())
    refused([](rdep_layer_spec& x) { x.backend = RDEP_BACKEND_CUDA_ONE_PROCESS; }, "no CUDA", /*code=*/4);  // Unavailable
}

// Version 14: whether the CUTLASS compute runs on a device; 0 with the reason otherwise (here: no such device,
// no GPU or no CUDA in this build). capi_cuda_test.cc checks the GPU case.
TEST(CApi, CutlassAvailabilityNamesWhyNot) {
  EXPECT_EQ(rdep_cutlass_available(-1), 0);
  const std::string why = rdep_last_error();
  if (rdep_built_with_cuda()) {
    EXPECT_NE(why.find("device: -1 is not a CUDA device"), std::string::npos) << why;
  } else {
    EXPECT_NE(why.find("no CUDA backend"), std::string::npos) << why;
  }
  if (rdep_cuda_device_count() == 0) {
    EXPECT_EQ(rdep_cutlass_available(0), 0);
    EXPECT_FALSE(std::string(rdep_last_error()).empty());
  }
}

// Version 14: rdep_context_check_routing on the host backend (which checks in its forward): refused before a
// forward and for a stale id, 0 after a forward with valid routing; a bad slot fails the forward itself.
TEST(CApi, CheckRoutingOnTheHostBackend) {
  const LayerShape s{.tokens = 4, .hidden = 4, .ffn = 4, .experts = 4, .topk = 2, .ranks = 1};
  const rdep_layer_spec spec = Spec(s, 0);
  rdep_layer* l = nullptr;
  ASSERT_EQ(rdep_layer_create(&spec, &l), 0) << rdep_last_error();
  std::vector<int32_t> experts = {0, 1, 2, 3, 1, 2, 0, 3};
  Vec gates(8, 0.5f), x(16, 1.f), y(16), w1(4 * 4 * 8, 0.1f), w2(4 * 4 * 4, 0.1f);
  rdep_rank_io io{4, experts.data(), gates.data(), x.data(), y.data(), w1.data(), w2.data(), nullptr, nullptr, nullptr, nullptr,
                  nullptr, nullptr, 0, 0};
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  EXPECT_EQ(rdep_context_check_routing(l, ctx), 2) << "FailedPrecondition: no forward yet";  // rdep/status.h
  EXPECT_NE(std::string(rdep_last_error()).find("holds no forward"), std::string::npos) << rdep_last_error();
  ASSERT_EQ(rdep_layer_forward(l, ctx, &io, 1), 0) << rdep_last_error();
  EXPECT_EQ(rdep_context_check_routing(l, ctx), 0) << rdep_last_error();
  experts[5] = 7;
  EXPECT_EQ(rdep_layer_forward(l, ctx, &io, 1), 1) << "InvalidArgument from the forward itself";
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  EXPECT_EQ(rdep_context_check_routing(l, ctx), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("is not a live context"), std::string::npos) << rdep_last_error();
  EXPECT_EQ(rdep_context_check_routing(nullptr, ctx), 1);
  EXPECT_EQ(rdep_layer_check_errors(l), 0) << "version 16: the host backend has no device barrier records";
  EXPECT_EQ(rdep_layer_check_errors(nullptr), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("layer is null"), std::string::npos) << rdep_last_error();
  rdep_layer_destroy(l);
}

TEST(CApi, CallErrorsNameRankFieldAndContext) {
  const LayerShape s{.tokens = 4, .hidden = 4, .ffn = 4, .experts = 4, .topk = 2, .ranks = 2};
  const rdep_layer_spec spec = Spec(s, 0);
  rdep_layer* l = nullptr;
  ASSERT_EQ(rdep_layer_create(&spec, &l), 0) << rdep_last_error();
  std::vector<int32_t> experts = {0, 1, 2, 3, 1, 2, 0, 3};
  Vec gates(8, 0.5f), x(16, 1.f), y(16), w1(2 * 4 * 8, 0.1f), w2(2 * 4 * 4, 0.1f), dy(16, 1.f), dx(16), dg(8), dw1(w1.size()),
      dw2(w2.size());
  // Inputs shared by both ranks; each rank writes its own outputs.
  Vec y1 = y, dx1 = dx, dg1 = dg, dw1_1 = dw1, dw2_1 = dw2;
  std::vector<rdep_rank_io> io = {
      {4, experts.data(), gates.data(), x.data(), y.data(), w1.data(), w2.data(), dy.data(), dx.data(), dg.data(), dw1.data(),
       dw2.data(), nullptr, 0, 0},
      {4, experts.data(), gates.data(), x.data(), y1.data(), w1.data(), w2.data(), dy.data(), dx1.data(), dg1.data(),
       dw1_1.data(), dw2_1.data(), nullptr, 0, 0}};
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  EXPECT_EQ(rdep_layer_forward(l, ctx, io.data(), 1), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("drives 2 ranks"), std::string::npos);
  io[1].x = nullptr;
  EXPECT_EQ(rdep_layer_forward(l, ctx, io.data(), 2), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("rank 1: x is null"), std::string::npos) << rdep_last_error();
  io[1].x = x.data();
  io[0].num_tokens = 5;
  EXPECT_EQ(rdep_layer_forward(l, ctx, io.data(), 2), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("num_tokens 5"), std::string::npos);
  io[0].num_tokens = 4;
  io[1].grad_bf16 = 1;  // bf16 gradients are the CUDA backend's
  EXPECT_EQ(rdep_layer_backward(l, ctx, io.data(), 2), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("grad_bf16"), std::string::npos) << rdep_last_error();
  io[1].grad_bf16 = 0;
  // Backward before its forward: the context says so.
  EXPECT_EQ(rdep_layer_backward(l, ctx, io.data(), 2), 2) << rdep_last_error();
  // A bad expert id names the rank, token and slot.
  experts[3] = 4;
  EXPECT_EQ(rdep_layer_forward(l, ctx, io.data(), 2), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("token 1"), std::string::npos) << rdep_last_error();
  experts[3] = 3;
  ASSERT_EQ(rdep_layer_forward(l, ctx, io.data(), 2), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_backward(l, ctx, io.data(), 2), 0) << rdep_last_error();
  // Released ids are stale: a second release is a no-op, a call is an error; slots are reused.
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  EXPECT_EQ(rdep_layer_forward(l, ctx, io.data(), 2), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("not a live context"), std::string::npos);
  int64_t a = 0, b = 0;
  ASSERT_EQ(rdep_context_acquire(l, &a), 0);
  ASSERT_EQ(rdep_context_acquire(l, &b), 0);
  EXPECT_NE(a, ctx);
  EXPECT_NE(a, b);
  EXPECT_EQ(a >> 32, ctx >> 32);  // the first slot again, a new generation
  // Two forwards in flight, backwards in reverse order.
  ASSERT_EQ(rdep_layer_forward(l, a, io.data(), 2), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_forward(l, b, io.data(), 2), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_backward(l, b, io.data(), 2), 0) << rdep_last_error();
  const Vec dx_b = dx;
  ASSERT_EQ(rdep_layer_backward(l, a, io.data(), 2), 0) << rdep_last_error();
  EXPECT_EQ(dx, dx_b);
  // A second backward of one forward is refused.
  EXPECT_EQ(rdep_layer_backward(l, a, io.data(), 2), 2);
  // Version 19: re-armed (as for a context a CUDA graph recorded, whose forward replays wrote it), the forward runs a
  // backward again, with its saved state: the same dx. Re-arming a context holding an unused forward changes nothing.
  std::fill(dx.begin(), dx.end(), -7.0f);
  ASSERT_EQ(rdep_context_rearm(l, a), 0) << rdep_last_error();
  ASSERT_EQ(rdep_context_rearm(l, a), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_backward(l, a, io.data(), 2), 0) << rdep_last_error();
  EXPECT_EQ(dx, dx_b);
  EXPECT_EQ(rdep_layer_backward(l, a, io.data(), 2), 2);
  EXPECT_EQ(rdep_context_rearm(nullptr, a), 1);
  // A slot released after its forward and acquired again holds no forward for a backward.
  ASSERT_EQ(rdep_layer_forward(l, a, io.data(), 2), 0) << rdep_last_error();
  EXPECT_EQ(rdep_context_release(l, a), 0);
  int64_t again = 0;
  ASSERT_EQ(rdep_context_acquire(l, &again), 0);
  EXPECT_EQ(again >> 32, a >> 32);
  EXPECT_EQ(rdep_layer_backward(l, again, io.data(), 2), 2);
  EXPECT_NE(std::string(rdep_last_error()).find("holds no forward"), std::string::npos) << rdep_last_error();
  EXPECT_EQ(rdep_context_rearm(l, again), 2);  // no forward completed into it: nothing to re-arm
  EXPECT_NE(std::string(rdep_last_error()).find("no completed forward"), std::string::npos) << rdep_last_error();
  EXPECT_EQ(rdep_context_rearm(l, a), 1);  // released: a stale id
  io[0].reserved = 3;
  EXPECT_EQ(rdep_layer_forward(l, again, io.data(), 2), 1);
  io[0].reserved = 0;
  // Version 8's row allocator: both functions or neither, and CUDA only.
  auto alloc = [](void*, size_t, int32_t, void*) -> void* { return nullptr; };
  auto free_fn = [](void*, void*, size_t, int32_t) {};
  EXPECT_EQ(rdep_layer_set_row_allocator(nullptr, alloc, free_fn, nullptr), 1);
  EXPECT_EQ(rdep_layer_set_row_allocator(l, alloc, nullptr, nullptr), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("both be set or both be null"), std::string::npos) << rdep_last_error();
  EXPECT_EQ(rdep_layer_set_row_allocator(l, alloc, free_fn, nullptr), 2);  // contexts are acquired
  EXPECT_EQ(rdep_context_release(l, again), 0);
  EXPECT_EQ(rdep_context_release(l, b), 0);
  EXPECT_EQ(rdep_layer_set_row_allocator(l, alloc, free_fn, nullptr), 2);
  EXPECT_NE(std::string(rdep_last_error()).find("CUDA only"), std::string::npos) << rdep_last_error();
  rdep_layer_destroy(l);
}

}  // namespace
}  // namespace rdep
