// Replica slots shared by the balanced layers of one domain (Domain::AcquireShared): three balanced
// host layers on one domain, their forwards and backwards interleaved (A fwd, B fwd, B bwd, C fwd,
// A bwd, C bwd), give bitwise what each layer gives alone on a domain of its own (its own slots),
// and y, dx, dgates bitwise those of the same layers without balancing (weight gradients within fp32
// summation order). The domain holds one set of slots for the three layers; a layer of another slot
// size gets its own.
//   exercise: build/src/layer/layer_test --gtest_filter='HostSharedSlots*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "rdep/balance/layer_balance.h"
#include "rdep/core/capacity.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

constexpr LayerShape kShape{.tokens = 40, .hidden = 12, .ffn = 6, .experts = 32, .topk = 4, .ranks = 8};

// One layer of the model: its balancer, weights, routing, input and output gradient.
struct Spec {
  BalanceConfig balance;
  uint64_t weight_seed = 0;
  std::string routing;
  uint64_t routing_seed = 1;
  double capacity_factor = 0;  // 0 = dropless
};

struct Outputs {
  std::vector<std::vector<float>> y, dx, dg, dw1, dw2;  // per rank
  int32_t replicas = 0, relayed = 0;                     // of rank 0's plan
};

struct Inputs {
  Routing rt;
  std::vector<std::vector<float>> x, dy;
};

Inputs MakeInputs(const Spec& s) {
  RoutingSpec rs = *RoutingSpec::Parse(s.routing);
  rs.seed = s.routing_seed;
  Inputs in{*GenerateRouting(kShape, rs), {}, {}};
  in.x = RandomActivations(kShape, in.rt, 20 + s.weight_seed);
  for (size_t r = 0; r < in.x.size(); ++r) {
    in.dy.emplace_back(in.x[r].size());
    for (size_t k = 0; k < in.dy[r].size(); ++k) in.dy[r][k] = std::sin(0.29f * static_cast<float>(k) + static_cast<float>(r + s.weight_seed));
  }
  return in;
}

std::unique_ptr<HostMoELayer> MakeLayer(HostDomain& d, const Spec& s, bool balanced) {
  LayerConfig cfg = MakeLayerConfig(kShape, CapacityPolicy{.capacity_factor = s.capacity_factor});
  if (balanced) cfg.balance = s.balance;
  auto layer = HostMoELayer::Create(d, cfg, *OwnershipMap::Contiguous(kShape.experts, kShape.ranks), RandomWeights(kShape, s.weight_seed));
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

void Resize(Outputs& o) {
  const auto W = static_cast<size_t>(kShape.ranks);
  o.y.resize(W), o.dx.resize(W), o.dg.resize(W), o.dw1.resize(W), o.dw2.resize(W);
}

// A step of the interleaved schedule: layer `l`'s forward (backward = false) or backward on rank r.
Status Step(HostMoELayer& layer, ForwardContext& ctx, const Inputs& in, bool backward, int32_t r, Outputs& o) {
  const auto i = static_cast<size_t>(r);
  const int64_t n = in.rt[i].num_tokens;
  if (!backward) {
    o.y[i].assign(static_cast<size_t>(n * kShape.hidden), NAN);
    RDEP_RETURN_IF_ERROR(layer.Forward(r, ctx, in.rt[i], in.x[i], o.y[i]));
    if (r == 0 && layer.config().balance.enabled()) {
      RDEP_ASSIGN_OR_RETURN(BalanceTelemetry t, layer.balance_telemetry(ctx));
      o.replicas = t.replicas;
      o.relayed = t.relayed_experts;
    }
    return Status::Ok();
  }
  o.dx[i].assign(static_cast<size_t>(n * kShape.hidden), NAN);
  o.dg[i].assign(static_cast<size_t>(n * kShape.topk), NAN);
  RDEP_RETURN_IF_ERROR(layer.Backward(r, ctx, in.dy[i], o.dx[i], o.dg[i]));
  o.dw1[i].assign(layer.dw1(r).begin(), layer.dw1(r).end());
  o.dw2[i].assign(layer.dw2(r).begin(), layer.dw2(r).end());
  return Status::Ok();
}

// The layer alone on a domain of its own (its own slots): forward then backward.
Outputs RunAlone(const Spec& s, const Inputs& in, bool balanced) {
  auto d = std::move(*HostDomain::Create(kShape.ranks, {.barrier_timeout_s = 10}));
  auto layer = MakeLayer(*d, s, balanced);
  Outputs o;
  Resize(o);
  if (!layer) return o;
  std::vector<ForwardContext> ctx(static_cast<size_t>(kShape.ranks));
  const Status st = d->Run([&](int32_t r) -> Status {
    RDEP_RETURN_IF_ERROR(Step(*layer, ctx[static_cast<size_t>(r)], in, false, r, o));
    return Step(*layer, ctx[static_cast<size_t>(r)], in, true, r, o);
  });
  EXPECT_TRUE(st.ok()) << st;
  return o;
}

bool Bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](float u, float v) {
           return std::memcmp(&u, &v, sizeof(float)) == 0;
         });
}

void ExpectBitwise(const Outputs& a, const Outputs& b, bool grads, const std::string& what) {
  for (size_t r = 0; r < a.y.size(); ++r) {
    EXPECT_TRUE(Bitwise(a.y[r], b.y[r])) << what << ": y on rank " << r;
    EXPECT_TRUE(Bitwise(a.dx[r], b.dx[r])) << what << ": dx on rank " << r;
    EXPECT_TRUE(Bitwise(a.dg[r], b.dg[r])) << what << ": dgates on rank " << r;
    if (!grads) continue;
    EXPECT_TRUE(Bitwise(a.dw1[r], b.dw1[r])) << what << ": dW1 on rank " << r;
    EXPECT_TRUE(Bitwise(a.dw2[r], b.dw2[r])) << what << ": dW2 on rank " << r;
  }
}

// Replicated experts' gradients are summed in parts: |a-b| <= 1e-5 * (max|b| + |b|).
void ExpectGradsClose(const Outputs& a, const Outputs& b, const std::string& what) {
  for (size_t r = 0; r < a.dw1.size(); ++r) {
    for (const auto& [u, v] : {std::pair(&a.dw1[r], &b.dw1[r]), std::pair(&a.dw2[r], &b.dw2[r])}) {
      ASSERT_EQ(u->size(), v->size()) << what;
      float scale = 0;
      for (float x : *v) scale = std::max(scale, std::abs(x));
      for (size_t c = 0; c < v->size(); ++c)
        ASSERT_LE(std::abs((*u)[c] - (*v)[c]), 1e-5f * (scale + std::abs((*v)[c]))) << what << " rank " << r << " element " << c;
    }
  }
}

const std::vector<Spec>& Model() {
  static const std::vector<Spec> specs = {
      {BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 2}, 7, "zipf:2", 1, 1.0},
      {BalanceConfig{.kind = BalanceKind::kEplbExact, .num_slots = 2}, 8, "zipf:1.5", 5, 1.0},
      {BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 2, .relay_above = 1}, 9, "one-expert", 3, 0},
  };
  return specs;
}

TEST(HostSharedSlots, W8_ThreeLayersInterleavedEqualEachLayerAloneAndBalancingOff) {
  const std::vector<Spec>& specs = Model();
  std::vector<Inputs> in;
  for (const Spec& s : specs) in.push_back(MakeInputs(s));

  auto d = std::move(*HostDomain::Create(kShape.ranks, {.barrier_timeout_s = 10}));
  const size_t base = d->symmetric_bytes_per_rank();
  std::vector<std::unique_ptr<HostMoELayer>> layers;
  for (const Spec& s : specs) {
    layers.push_back(MakeLayer(*d, s, true));
    ASSERT_TRUE(layers.back());
  }
  // One set of slots for the three layers.
  const size_t slots = layers[0]->replica_slot_bytes();
  ASSERT_GT(slots, 0u);
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base + 3 * layers[0]->layout().total_bytes() + slots);

  std::vector<Outputs> shared(specs.size());
  for (Outputs& o : shared) Resize(o);
  // A fwd, B fwd, B bwd, C fwd, A bwd, C bwd: B and C overwrite the slots between A's forward and
  // backward, C's forward follows B's slot-gradient reduction, A's backward runs inside C's.
  const std::vector<std::pair<size_t, bool>> schedule = {{0, false}, {1, false}, {1, true}, {2, false}, {0, true}, {2, true}};
  std::vector<std::vector<ForwardContext>> ctx(specs.size());
  for (auto& c : ctx) c.resize(static_cast<size_t>(kShape.ranks));
  const Status st = d->Run([&](int32_t r) -> Status {
    for (const auto& [l, backward] : schedule)
      RDEP_RETURN_IF_ERROR(Step(*layers[l], ctx[l][static_cast<size_t>(r)], in[l], backward, r, shared[l]));
    return Status::Ok();
  });
  ASSERT_TRUE(st.ok()) << st;

  for (size_t l = 0; l < specs.size(); ++l) {
    const std::string what = "layer " + std::to_string(l) + " (" + BalanceKindName(specs[l].balance.kind) + ")";
    EXPECT_GT(shared[l].replicas, 0) << what << ": the case must use replicas";
    const Outputs own = RunAlone(specs[l], in[l], true);
    ExpectBitwise(shared[l], own, /*grads=*/true, what + " shared slots vs its own");
    const Outputs off = RunAlone(specs[l], in[l], false);
    ExpectBitwise(shared[l], off, /*grads=*/false, what + " vs balancing off");
    ExpectGradsClose(shared[l], off, what + " weight gradients vs balancing off");
  }
  EXPECT_GT(shared[2].relayed, 0) << "layer 2 must stream through chunk relays";
}

TEST(HostSharedSlots, AnotherSlotSizeGetsItsOwnSlotsAndTheLastLayerFreesThem) {
  auto d = std::move(*HostDomain::Create(kShape.ranks, {.barrier_timeout_s = 10}));
  const size_t base = d->symmetric_bytes_per_rank();
  Spec three = Model()[0];
  three.balance.num_slots = 3;
  auto a = MakeLayer(*d, Model()[0], true);
  auto b = MakeLayer(*d, three, true);
  auto off = MakeLayer(*d, Model()[0], false);
  ASSERT_TRUE(a && b && off);
  EXPECT_EQ(off->replica_slot_bytes(), 0u);
  EXPECT_EQ(b->replica_slot_bytes(), a->replica_slot_bytes() / 2 * 3);
  const size_t regions = a->layout().total_bytes() + b->layout().total_bytes() + off->layout().total_bytes();
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base + regions + a->replica_slot_bytes() + b->replica_slot_bytes());
  auto a2 = MakeLayer(*d, Model()[1], true);  // same slot size as a: nothing more for slots
  ASSERT_TRUE(a2);
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base + regions + a2->layout().total_bytes() + a->replica_slot_bytes() + b->replica_slot_bytes());
  const size_t a_layout = a->layout().total_bytes();
  a.reset();  // a2 still holds the slots
  EXPECT_EQ(d->symmetric_bytes_per_rank(),
            base + regions - a_layout + a2->layout().total_bytes() + a2->replica_slot_bytes() + b->replica_slot_bytes());
  a2.reset();
  b.reset();
  off.reset();
  EXPECT_EQ(d->symmetric_bytes_per_rank(), base);
}

}  // namespace
}  // namespace rdep
