// The C ABI's domains (version 4) on the host backend: three balanced layers created on one domain
// (rdep_layer_create_on), their calls interleaved (A fwd, B fwd, B bwd, C fwd, A bwd, C bwd), give
// bitwise the y, dx, dgates, dw1, dw2 of the same layers each with a domain of its own
// (rdep_layer_create), while the domain holds one set of replica slots for the three
// (rdep_domain_memory); a domain and its layers destroyed in any order; a layer spec that does not
// match its domain, and bad domain specs, refused naming the field.
//   exercise: build/src/capi/capi_test --gtest_filter='CApiDomain*'
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rdep/capi.h"
#include "rdep/balance/layer_balance.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

using Vec = std::vector<float>;

// The routings of HostSharedSlots (src/layer/host_shared_slots_test.cc), which make replicas at this shape.
constexpr LayerShape kShape{.tokens = 40, .hidden = 12, .ffn = 6, .experts = 32, .topk = 4, .ranks = 8};

rdep_layer_spec BalancedSpec(int32_t balance, int32_t slots, int32_t relay_above) {
  rdep_layer_spec spec{};
  spec.struct_size = sizeof(rdep_layer_spec);
  spec.backend = RDEP_BACKEND_HOST;
  spec.world_size = static_cast<int32_t>(kShape.ranks);
  spec.tokens = kShape.tokens;
  spec.hidden = kShape.hidden;
  spec.ffn = kShape.ffn;
  spec.experts = kShape.experts;
  spec.topk = kShape.topk;
  spec.barrier_timeout_s = 10;
  spec.balance = balance;
  spec.balance_slots = slots;
  spec.balance_relay_above = relay_above;
  return spec;
}

rdep_domain_spec HostDomainSpec(int32_t world_size) {
  rdep_domain_spec d{};
  d.struct_size = sizeof(rdep_domain_spec);
  d.backend = RDEP_BACKEND_HOST;
  d.world_size = world_size;
  d.barrier_timeout_s = 10;
  return d;
}

// One layer of the model: its spec, and its inputs and outputs through the ABI (per rank).
struct Model {
  rdep_layer_spec spec;
  std::string routing;
  uint64_t seed;
  Routing rt;
  std::vector<Vec> x, dy, w1, w2, y, dx, dg, dw1, dw2;
  std::vector<rdep_rank_io> io;

  Model(rdep_layer_spec s, std::string family, uint64_t sd) : spec(s), routing(std::move(family)), seed(sd) {
    RoutingSpec rs = *RoutingSpec::Parse(routing);
    rs.seed = seed;
    rt = *GenerateRouting(kShape, rs);
    x = RandomActivations(kShape, rt, 20 + seed);
    dy = RandomActivations(kShape, rt, 40 + seed);
    const MoEWeights w = RandomWeights(kShape, seed);
    const auto W = static_cast<size_t>(kShape.ranks);
    const auto per_rank = kShape.experts / kShape.ranks;
    const auto n1 = static_cast<int64_t>(w.w1_per_expert()), n2 = static_cast<int64_t>(w.w2_per_expert());
    for (size_t r = 0; r < W; ++r) {
      const int64_t e0 = static_cast<int64_t>(r) * per_rank;
      w1.emplace_back(w.w1.begin() + e0 * n1, w.w1.begin() + (e0 + per_rank) * n1);
      w2.emplace_back(w.w2.begin() + e0 * n2, w.w2.begin() + (e0 + per_rank) * n2);
    }
  }

  // Poisoned outputs and the io that points at them.
  void Reset() {
    const auto W = static_cast<size_t>(kShape.ranks);
    y.assign(W, {});
    dx.assign(W, {});
    dg.assign(W, {});
    dw1.assign(W, {});
    dw2.assign(W, {});
    io.assign(W, {});
    for (size_t r = 0; r < W; ++r) {
      const int64_t n = rt[r].num_tokens;
      y[r].assign(static_cast<size_t>(n * kShape.hidden), -7.f);
      dx[r] = y[r];
      dg[r].assign(static_cast<size_t>(n * kShape.topk), -7.f);
      dw1[r].assign(w1[r].size(), -7.f);
      dw2[r].assign(w2[r].size(), -7.f);
      io[r] = rdep_rank_io{n, rt[r].experts.data(), rt[r].gates.data(), x[r].data(), y[r].data(), w1[r].data(), w2[r].data(),
                           dy[r].data(), dx[r].data(), dg[r].data(), dw1[r].data(), dw2[r].data(), nullptr, 0, 0};
    }
  }
};

std::vector<Model> ThreeBalancedLayers() {
  std::vector<Model> m;
  m.emplace_back(BalancedSpec(RDEP_BALANCE_ULTRAEP, 2, -1), "zipf:1.5", 1);
  m.emplace_back(BalancedSpec(RDEP_BALANCE_EPLB_EXACT, 2, -1), "zipf:1.5", 5);
  m.emplace_back(BalancedSpec(RDEP_BALANCE_ULTRAEP, 2, 1), "one-expert", 3);  // chunk relays
  return m;
}

// What rank 0's plan made for the model's forward (the same layer as C++ HostMoELayer): the cases must
// use replicas, or sharing the slots would go untested.
BalanceTelemetry Telemetry(const Model& m) {
  auto d = std::move(*HostDomain::Create(kShape.ranks, {.barrier_timeout_s = 10}));
  LayerConfig cfg = MakeLayerConfig(kShape, {});
  cfg.balance.kind = static_cast<BalanceKind>(m.spec.balance);
  cfg.balance.num_slots = m.spec.balance_slots;
  if (m.spec.balance_relay_above >= 0) cfg.balance.relay_above = m.spec.balance_relay_above;
  auto layer = std::move(*HostMoELayer::Create(*d, cfg, *OwnershipMap::Contiguous(kShape.experts, kShape.ranks), RandomWeights(kShape, m.seed)));
  std::vector<ForwardContext> ctx(static_cast<size_t>(kShape.ranks));
  std::vector<Vec> y(static_cast<size_t>(kShape.ranks));
  BalanceTelemetry t;
  EXPECT_TRUE(d->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    y[i].assign(static_cast<size_t>(m.rt[i].num_tokens * kShape.hidden), 0.f);
    RDEP_RETURN_IF_ERROR(layer->Forward(r, ctx[i], m.rt[i], m.x[i], y[i]));
    if (r == 0) {
      RDEP_ASSIGN_OR_RETURN(t, layer->balance_telemetry(ctx[i]));
    }
    return Status::Ok();
  }).ok());
  return t;
}

void ExpectSameOutputs(const Model& a, const Model& b, const std::string& what) {
  for (size_t r = 0; r < a.y.size(); ++r) {
    EXPECT_EQ(a.y[r], b.y[r]) << what << ": y, rank " << r;
    EXPECT_EQ(a.dx[r], b.dx[r]) << what << ": dx, rank " << r;
    EXPECT_EQ(a.dg[r], b.dg[r]) << what << ": dgates, rank " << r;
    EXPECT_EQ(a.dw1[r], b.dw1[r]) << what << ": dw1, rank " << r;
    EXPECT_EQ(a.dw2[r], b.dw2[r]) << what << ": dw2, rank " << r;
  }
}

// Bytes per rank of the layer's domain (symmetric, shared), through rdep_layer_domain.
std::pair<size_t, size_t> LayerDomainMemory(rdep_layer* l) {
  rdep_domain* d = nullptr;
  EXPECT_EQ(rdep_layer_domain(l, &d), 0) << rdep_last_error();
  size_t sym = 0, shared = 0;
  EXPECT_EQ(rdep_domain_memory(d, &sym, &shared), 0) << rdep_last_error();
  rdep_domain_destroy(d);
  return {sym, shared};
}

TEST(CApiDomain, W8_ThreeBalancedLayersOnOneDomainInterleavedEqualEachOnItsOwnDomain) {
  const auto W = static_cast<int32_t>(kShape.ranks);
  // Each layer on a domain of its own (rdep_layer_create): forward then backward.
  std::vector<Model> own = ThreeBalancedLayers();
  size_t own_symmetric = 0, slot_bytes = 0;
  for (Model& m : own) {
    rdep_layer* l = nullptr;
    ASSERT_EQ(rdep_layer_create(&m.spec, &l), 0) << rdep_last_error();
    m.Reset();
    int64_t ctx = 0;
    ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
    ASSERT_EQ(rdep_layer_forward(l, ctx, m.io.data(), W), 0) << rdep_last_error();
    ASSERT_EQ(rdep_layer_backward(l, ctx, m.io.data(), W), 0) << rdep_last_error();
    ASSERT_EQ(rdep_layer_replica_slot_bytes(l, &slot_bytes), 0);
    const auto [sym, shared] = LayerDomainMemory(l);
    EXPECT_EQ(shared, slot_bytes) << "a layer's own domain holds its slots";
    own_symmetric += sym;
    rdep_layer_destroy(l);
  }
  ASSERT_GT(slot_bytes, 0u);
  for (size_t i = 0; i < own.size(); ++i) {
    const BalanceTelemetry t = Telemetry(own[i]);
    EXPECT_GT(t.replicas, 0) << "layer " << i << ": the case must use replicas";
    if (own[i].spec.balance_relay_above == 1) {
      EXPECT_GT(t.relayed_experts, 0) << "layer " << i << " must stream through relays";
    }
  }

  // The same layers on one domain, interleaved: B and C overwrite the slots between A's forward and
  // backward, C's forward follows B's slot-gradient reduction, A's backward runs between C's calls.
  std::vector<Model> on = ThreeBalancedLayers();
  const rdep_domain_spec ds = HostDomainSpec(W);
  rdep_domain* d = nullptr;
  ASSERT_EQ(rdep_domain_create(&ds, &d), 0) << rdep_last_error();
  std::vector<rdep_layer*> layers(on.size(), nullptr);
  std::vector<int64_t> ctx(on.size(), 0);
  for (size_t i = 0; i < on.size(); ++i) {
    ASSERT_EQ(rdep_layer_create_on(d, &on[i].spec, &layers[i]), 0) << rdep_last_error();
    on[i].Reset();
    ASSERT_EQ(rdep_context_acquire(layers[i], &ctx[i]), 0);
  }
  int32_t num_layers = 0;
  ASSERT_EQ(rdep_domain_num_layers(d, &num_layers), 0);
  EXPECT_EQ(num_layers, 3);
  size_t sym = 0, shared = 0;
  ASSERT_EQ(rdep_domain_memory(d, &sym, &shared), 0) << rdep_last_error();
  EXPECT_EQ(shared, slot_bytes) << "one set of slots for the three layers";
  EXPECT_EQ(sym, own_symmetric - 2 * slot_bytes) << "the three own domains held three sets";
  for (size_t i = 0; i < on.size(); ++i) {
    size_t b = 0;
    ASSERT_EQ(rdep_layer_replica_slot_bytes(layers[i], &b), 0);
    EXPECT_EQ(b, slot_bytes);
  }
  const std::vector<std::pair<size_t, bool>> schedule = {{0, false}, {1, false}, {1, true}, {2, false}, {0, true}, {2, true}};
  for (const auto& [i, backward] : schedule) {
    const int rc = backward ? rdep_layer_backward(layers[i], ctx[i], on[i].io.data(), W) : rdep_layer_forward(layers[i], ctx[i], on[i].io.data(), W);
    ASSERT_EQ(rc, 0) << "layer " << i << (backward ? " backward: " : " forward: ") << rdep_last_error();
  }
  for (size_t i = 0; i < on.size(); ++i) ExpectSameOutputs(on[i], own[i], "layer " + std::to_string(i) + " on the shared domain vs its own");

  // The domain outlives its creator's reference while layers hold it; the last layer frees it.
  rdep_domain_destroy(d);
  ASSERT_EQ(rdep_context_release(layers[1], ctx[1]), 0);
  ASSERT_EQ(rdep_context_acquire(layers[1], &ctx[1]), 0);
  on[1].Reset();
  ASSERT_EQ(rdep_layer_forward(layers[1], ctx[1], on[1].io.data(), W), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_backward(layers[1], ctx[1], on[1].io.data(), W), 0) << rdep_last_error();
  ExpectSameOutputs(on[1], own[1], "layer 1 again, after the domain's creator let go");
  rdep_layer_destroy(layers[1]);
  rdep_layer_destroy(layers[0]);
  const auto [sym_last, shared_last] = LayerDomainMemory(layers[2]);
  EXPECT_EQ(shared_last, slot_bytes) << "the last balanced layer keeps the slots";
  EXPECT_LT(sym_last, sym);
  rdep_layer_destroy(layers[2]);
}

TEST(CApiDomain, AnotherSlotSizeGetsItsOwnSlotsAndLayersWithoutBalancingNone) {
  const auto W = static_cast<int32_t>(kShape.ranks);
  const rdep_domain_spec ds = HostDomainSpec(W);
  rdep_domain* d = nullptr;
  ASSERT_EQ(rdep_domain_create(&ds, &d), 0) << rdep_last_error();
  const rdep_layer_spec two = BalancedSpec(RDEP_BALANCE_ULTRAEP, 2, -1), three = BalancedSpec(RDEP_BALANCE_ULTRAEP, 3, -1),
                        off = BalancedSpec(RDEP_BALANCE_OFF, 0, -1);
  rdep_layer *a = nullptr, *b = nullptr, *c = nullptr;
  ASSERT_EQ(rdep_layer_create_on(d, &two, &a), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_create_on(d, &three, &b), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_create_on(d, &off, &c), 0) << rdep_last_error();
  size_t sa = 0, sb = 0, sc = 1, shared = 0;
  ASSERT_EQ(rdep_layer_replica_slot_bytes(a, &sa), 0);
  ASSERT_EQ(rdep_layer_replica_slot_bytes(b, &sb), 0);
  ASSERT_EQ(rdep_layer_replica_slot_bytes(c, &sc), 0);
  EXPECT_EQ(sc, 0u);
  EXPECT_EQ(sb, sa / 2 * 3);
  ASSERT_EQ(rdep_domain_memory(d, nullptr, &shared), 0);
  EXPECT_EQ(shared, sa + sb);
  rdep_layer_destroy(a);
  ASSERT_EQ(rdep_domain_memory(d, nullptr, &shared), 0);
  EXPECT_EQ(shared, sb);
  rdep_layer_destroy(b);
  ASSERT_EQ(rdep_domain_memory(d, nullptr, &shared), 0);
  EXPECT_EQ(shared, 0u);
  int32_t n = -1;
  ASSERT_EQ(rdep_domain_num_layers(d, &n), 0);
  EXPECT_EQ(n, 1);
  // The domain's creator lets go first, the last layer frees it.
  rdep_domain_destroy(d);
  rdep_layer_destroy(c);
}

TEST(CApiDomain, LocalRanksAndDescription) {
  const rdep_domain_spec ds = HostDomainSpec(3);
  rdep_domain* d = nullptr;
  ASSERT_EQ(rdep_domain_create(&ds, &d), 0) << rdep_last_error();
  int32_t first = -1, count = -1;
  ASSERT_EQ(rdep_domain_local_ranks(d, &first, &count), 0);
  EXPECT_EQ(first, 0);
  EXPECT_EQ(count, 3);
  int32_t device = 0;
  ASSERT_EQ(rdep_domain_device(d, 2, &device), 0);
  EXPECT_EQ(device, -1);
  EXPECT_EQ(rdep_domain_device(d, 3, &device), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("rank 3 is not driven by this process"), std::string::npos);
  size_t needed = 0;
  ASSERT_EQ(rdep_domain_describe(d, nullptr, 0, &needed), 0);
  std::string text(needed + 1, '\0');
  ASSERT_EQ(rdep_domain_describe(d, text.data(), text.size(), &needed), 0);
  EXPECT_EQ(text.find("host domain, W=3"), 0u) << text;
  rdep_domain_destroy(d);
}

TEST(CApiDomain, MismatchedLayerAndBadDomainSpecsNameTheField) {
  const rdep_domain_spec ds = HostDomainSpec(4);
  rdep_domain* d = nullptr;
  ASSERT_EQ(rdep_domain_create(&ds, &d), 0) << rdep_last_error();
  rdep_layer_spec spec = BalancedSpec(RDEP_BALANCE_OFF, 0, -1);
  spec.world_size = 4;
  spec.experts = 8;
  rdep_layer* l = nullptr;
  auto refused = [&](const rdep_layer_spec& s, const std::string& field) {
    EXPECT_EQ(rdep_layer_create_on(d, &s, &l), 1) << field;
    EXPECT_EQ(l, nullptr);
    EXPECT_NE(std::string(rdep_last_error()).find(field), std::string::npos) << rdep_last_error();
  };
  rdep_layer_spec bad = spec;
  bad.world_size = 2;
  refused(bad, "world_size 2 differs from the domain's 4");
  bad = spec;
  bad.backend = RDEP_BACKEND_CUDA_ONE_PROCESS;
  refused(bad, "backend 1 (cuda, one process) differs from the domain's 0 (host)");
  bad = spec;
  bad.barrier_timeout_s = 3;
  refused(bad, "barrier_timeout_s 3 differs from the domain's 10");
  bad = spec;
  bad.num_gpus = 2;
  refused(bad, "num_gpus 2 differs");
  bad = spec;
  bad.struct_size = 8;
  refused(bad, "struct_size 8");
  bad = spec;
  bad.topk = 9;  // the layer's own fields are checked as by rdep_layer_create
  refused(bad, "K");
  EXPECT_EQ(rdep_layer_create_on(nullptr, &spec, &l), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("domain, spec and out must not be null"), std::string::npos);
  // A refused layer leaves nothing on the domain; 0 for the domain fields, or their values, are accepted.
  int32_t n = -1;
  ASSERT_EQ(rdep_domain_num_layers(d, &n), 0);
  EXPECT_EQ(n, 0);
  spec.barrier_timeout_s = 0;
  ASSERT_EQ(rdep_layer_create_on(d, &spec, &l), 0) << rdep_last_error();
  rdep_layer_destroy(l);
  spec.barrier_timeout_s = 10;
  ASSERT_EQ(rdep_layer_create_on(d, &spec, &l), 0) << rdep_last_error();
  rdep_layer_destroy(l);
  rdep_domain_destroy(d);

  auto domain_refused = [&](const rdep_domain_spec& s, int code, const std::string& text) {
    rdep_domain* out = nullptr;
    EXPECT_EQ(rdep_domain_create(&s, &out), code) << text;
    EXPECT_EQ(out, nullptr);
    EXPECT_NE(std::string(rdep_last_error()).find(text), std::string::npos) << rdep_last_error();
  };
  rdep_domain_spec b = ds;
  b.struct_size = 4;
  domain_refused(b, 1, "domain spec: struct_size 4");
  b = ds;
  b.backend = 7;
  domain_refused(b, 1, "domain spec: backend 7");
  b = ds;
  b.world_size = 0;
  domain_refused(b, 1, "domain spec: world_size must be >= 1");
  b = ds;
  b.barrier_timeout_s = -1;
  domain_refused(b, 1, "domain spec: barrier_timeout_s");
  b = ds;
  b.backend = RDEP_BACKEND_CUDA_PER_PROCESS;
  b.process_rank = 4;
  domain_refused(b, 1, "domain spec: process_rank 4 outside [0, world_size=4)");
  b.process_rank = 0;
  domain_refused(b, 1, "domain spec: allgather is required");
  if (rdep_cuda_device_count() == 0) {
    b = ds;
    b.backend = RDEP_BACKEND_CUDA_ONE_PROCESS;
    domain_refused(b, 4, rdep_built_with_cuda() ? "no CUDA device" : "no CUDA backend");  // Unavailable
  }
  EXPECT_EQ(rdep_domain_create(nullptr, &d), 1);
}

}  // namespace
}  // namespace rdep
