// The CUDA layer's two-phase exchange (LayerConfig::nodes; src/layer/cuda_two_phase.cc) with W = N*G
// ranks sharing one GPU (so the device-copy inter-node exchange is used), N in {2, 3, 4} x G in
// {1, 2, 4} with W <= 8, M in {1, 2, N}, on node-limited Zipf routing:
//   - against the host two-phase layer on the same (bf16-rounded) inputs: accepted set and effective
//     gates bitwise; y, dx, dgates and weight gradients within the CUDA checks' bf16 bound
//     ||cuda - host|| / ||host|| <= 1e-2 per rank (as cuda_balance_test.cc and rdep check);
//   - against the CUDA one-domain layer on the same routing: accepted set, dgates and weight gradients
//     bitwise (owners see the same streams; the relays' dgate dot products use the one-domain order);
//     y and dx within one bf16 rounding of fp32 reassociation (the relay sums per node first), and
//     bitwise at M = 1 (every token's rows on one node: the relay's sum is the one-domain sum);
//   - inter-node rows: exactly one per (token, remote node with an accepted row), and as many back;
//   - sentinel experts: the expert outputs each source's rows got (gathered from the relays) and the
//     owners' grouped placement equal the host two-phase layer's bit for bit;
//   - bad input: N not dividing W, M outside [1, N], balancing or the CUTLASS compute with nodes, a
//     token over the cap (named after the collective), the caller's-experts steps with nodes.
// Every test skips, saying so, without a GPU.
//   exercise: ctest --test-dir build -R CudaTwoPhase --output-on-failure
//             build/src/layer/layer_test --gtest_filter='*CudaTwoPhase*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

constexpr double kRelL2 = 1e-2;  // the CUDA checks' bf16 bound (ValidationOptions::rel_l2)
using Activations = std::vector<std::vector<float>>;

struct NodeCase {
  int32_t nodes, per_node, max_nodes;  // max_nodes 0 = N
  double capacity_factor = 0;
  int64_t segment = 0;  // 0 = the CUDA default (W*T: one segment)
};

void PrintTo(const NodeCase& c, std::ostream* os) {
  *os << "N" << c.nodes << "_G" << c.per_node << "_M" << (c.max_nodes ? c.max_nodes : c.nodes);
}

LayerShape ShapeOf(const NodeCase& c) {
  const int64_t W = c.nodes * c.per_node;
  return LayerShape{.tokens = 24, .hidden = 64, .ffn = 32, .experts = 4 * W, .topk = 4, .ranks = W};
}

std::vector<int32_t> NodeOfExpert(const LayerShape& s, int32_t per_node) {
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  std::vector<int32_t> node(static_cast<size_t>(s.experts));
  for (int32_t e = 0; e < s.experts; ++e) node[static_cast<size_t>(e)] = own.owner(e) / per_node;
  return node;
}

// Inputs every run of a case shares: node-limited routing, bf16-rounded weights and activations (the
// host layer then sees exactly what the device sees).
struct Inputs {
  LayerShape s;
  Routing rt;
  MoEWeights w;
  Activations x, dy;
};

Inputs MakeInputs(const NodeCase& c, const std::string& routing = "zipf:1.2") {
  Inputs in;
  in.s = ShapeOf(c);
  in.rt = *GenerateRouting(in.s, *RoutingSpec::Parse(routing));
  const int32_t cap = c.max_nodes > 0 ? c.max_nodes : c.nodes;
  if (cap < c.nodes) {
    EXPECT_TRUE(LimitRoutingNodes(in.rt, NodeOfExpert(in.s, c.per_node), cap).ok());
  }
  in.w = RandomWeights(in.s, 3);
  in.x = RandomActivations(in.s, in.rt, 4);
  in.dy = RandomActivations(in.s, in.rt, 5);
  for (auto* v : {&in.w.w1, &in.w.w2})
    for (float& f : *v) f = RoundToBf16(f);
  for (auto* t : {&in.x, &in.dy})
    for (auto& r : *t)
      for (float& f : r) f = RoundToBf16(f);
  return in;
}

LayerConfig ConfigOf(const NodeCase& c, const LayerShape& s, bool nodes) {
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
  if (nodes) cfg.nodes = NodeConfig{.nodes = c.nodes, .max_nodes = c.max_nodes};
  return cfg;
}

struct RankResult {
  std::vector<float> y, dx, dg, dw1, dw2, expert_out;
  RankAcceptance acc;
  std::vector<OwnerTraceEntry> trace;
  NodeTraffic traffic;
};
using Run = std::vector<RankResult>;

StatusOr<std::unique_ptr<CudaDomain>> SharedGpuDomain(int64_t W) {
  return CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(W, 1)});
}

// One forward (and, for the SwiGLU kind, backward) of a fresh CUDA layer on every rank.
StatusOr<Run> RunCuda(const LayerConfig& cfg, const Inputs& in, bool sentinel = false) {
  const LayerShape& s = cfg.shape;
  RDEP_ASSIGN_OR_RETURN(auto domain, SharedGpuDomain(s.ranks));
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain, cfg, own, in.w));
  if (sentinel) layer->set_expert_kind(ExpertKind::kSentinel);
  Run out(static_cast<size_t>(s.ranks));
  RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(in.rt[i], in.x[i], in.dy[i], s.hidden, b));
    RDEP_RETURN_IF_ERROR(layer->Forward(r, b.e, b.g, b.n, b.x, b.y));
    if (!sentinel) RDEP_RETURN_IF_ERROR(layer->Backward(r, b.dy, b.dx, b.dg));
    RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
    RankResult& o = out[i];
    const auto nh = static_cast<size_t>(b.n * s.hidden), L = static_cast<size_t>(own.num_local(r));
    RDEP_ASSIGN_OR_RETURN(o.acc, layer->CopyAcceptance(r));
    RDEP_ASSIGN_OR_RETURN(o.trace, layer->CopyOwnerTrace(r));
    RDEP_ASSIGN_OR_RETURN(o.y, DownloadBf16(b.y, nh));
    if (cfg.nodes.nodes > 1) {
      RDEP_ASSIGN_OR_RETURN(o.traffic, layer->node_traffic(r));
    }
    if (sentinel) return Status::Ok();
    RDEP_ASSIGN_OR_RETURN(o.dx, DownloadBf16(b.dx, nh));
    RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, static_cast<size_t>(b.n * s.topk)));
    RDEP_ASSIGN_OR_RETURN(o.dw1, Download(layer->dw1(r), L * static_cast<size_t>(2 * s.hidden * s.ffn)));
    RDEP_ASSIGN_OR_RETURN(o.dw2, Download(layer->dw2(r), L * static_cast<size_t>(s.ffn * s.hidden)));
    return Status::Ok();
  }));
  if (sentinel)  // the relays' kept rows, after every rank finished
    for (int32_t r = 0; r < s.ranks; ++r) {
      RDEP_ASSIGN_OR_RETURN(out[static_cast<size_t>(r)].expert_out, layer->CopyExpertOutputs(r));
    }
  return out;
}

StatusOr<Run> RunHost(const LayerConfig& cfg, const Inputs& in, bool sentinel = false) {
  const LayerShape& s = cfg.shape;
  RDEP_ASSIGN_OR_RETURN(auto domain, HostDomain::Create(s.ranks, {.barrier_timeout_s = 20}));
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  RDEP_ASSIGN_OR_RETURN(auto layer, HostMoELayer::Create(*domain, cfg, own, in.w));
  if (sentinel) layer->set_expert_kind(ExpertKind::kSentinel);
  layer->set_trace(true);
  Run out(static_cast<size_t>(s.ranks));
  RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    RankResult& o = out[i];
    o.y.assign(in.x[i].size(), NAN);
    o.dx.assign(in.x[i].size(), NAN);
    o.dg.assign(static_cast<size_t>(in.rt[i].num_tokens * s.topk), NAN);
    RDEP_RETURN_IF_ERROR(layer->Forward(r, in.rt[i], in.x[i], o.y));
    if (!sentinel) RDEP_RETURN_IF_ERROR(layer->Backward(r, in.dy[i], o.dx, o.dg));
    return Status::Ok();
  }));
  for (int32_t r = 0; r < s.ranks; ++r) {
    RankResult& o = out[static_cast<size_t>(r)];
    o.acc = layer->acceptance(r);
    o.trace = layer->owner_trace(r);
    o.expert_out = layer->expert_outputs(r);
    o.dw1.assign(layer->dw1(r).begin(), layer->dw1(r).end());
    o.dw2.assign(layer->dw2(r).begin(), layer->dw2(r).end());
  }
  return out;
}

// ||a - b|| / ||b|| (0 when both are zero; infinite on a size mismatch or NaN).
double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (std::isnan(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Per element: |a - b| <= 2^-7 |b| + 1e-5 max|b|: one bf16 rounding apart after fp32 reassociation.
void ExpectOneRounding(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  float scale = 0;
  for (float v : b) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_LE(std::abs(a[i] - b[i]), 0x1p-7f * std::abs(b[i]) + 1e-5f * scale) << what << " element " << i;
}

// Empty when the traces are equal entry for entry; else the first difference.
std::string TraceDiff(const std::vector<OwnerTraceEntry>& a, const std::vector<OwnerTraceEntry>& b) {
  auto str = [](const OwnerTraceEntry& e) {
    return "{row " + std::to_string(e.row_id) + ", expert " + std::to_string(e.local_expert) + ", segment " +
           std::to_string(e.segment) + ", position " + std::to_string(e.group_position) + "}";
  };
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (a[i].row_id != b[i].row_id || a[i].local_expert != b[i].local_expert || a[i].segment != b[i].segment ||
        a[i].group_position != b[i].group_position)
      return "entry " + std::to_string(i) + ": " + str(a[i]) + " vs " + str(b[i]);
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  return "";
}

// One per (token, remote node holding an accepted row of it), summed over ranks.
int64_t ExpectedInterRows(const NodeCase& c, const Inputs& in, const Run& run) {
  const std::vector<int32_t> node = NodeOfExpert(in.s, c.per_node);
  int64_t rows = 0;
  for (int64_t r = 0; r < in.s.ranks; ++r) {
    const auto i = static_cast<size_t>(r);
    for (int64_t t = 0; t < in.rt[i].num_tokens; ++t) {
      std::vector<int32_t> remote;
      for (int64_t k = 0; k < in.s.topk; ++k) {
        const auto idx = static_cast<size_t>(t * in.s.topk + k);
        const int32_t nd = node[static_cast<size_t>(in.rt[i].experts[idx])];
        if (run[i].acc.accepted[idx] && nd != r / c.per_node && std::find(remote.begin(), remote.end(), nd) == remote.end())
          remote.push_back(nd);
      }
      rows += static_cast<int64_t>(remote.size());
    }
  }
  return rows;
}

class CudaTwoPhase : public ::testing::TestWithParam<NodeCase> {};

TEST_P(CudaTwoPhase, AgreesWithTheHostTwoPhaseAndTheOneDomainLayer) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const NodeCase c = GetParam();
  const Inputs in = MakeInputs(c);
  auto two = RunCuda(ConfigOf(c, in.s, true), in);
  ASSERT_TRUE(two.ok()) << two.status();
  auto host = RunHost(ConfigOf(c, in.s, true), in);
  ASSERT_TRUE(host.ok()) << host.status();
  auto one = RunCuda(ConfigOf(c, in.s, false), in);
  ASSERT_TRUE(one.ok()) << one.status();
  int64_t sent = 0, back = 0;
  const int32_t M = c.max_nodes ? c.max_nodes : c.nodes;
  for (int64_t r = 0; r < in.s.ranks; ++r) {
    const auto i = static_cast<size_t>(r);
    const RankResult &a = (*two)[i], &h = (*host)[i], &o = (*one)[i];
    const std::string at = " on rank " + std::to_string(r);
    // The host two-phase layer: routing metadata bitwise, values within the bf16 bound.
    EXPECT_EQ(a.acc.accepted, h.acc.accepted) << "accepted set vs host" << at;
    EXPECT_TRUE(Bitwise(a.acc.effective_gates, h.acc.effective_gates)) << "effective gates vs host" << at;
    EXPECT_LE(RelL2(a.y, h.y), kRelL2) << "y vs host" << at;
    EXPECT_LE(RelL2(a.dx, h.dx), kRelL2) << "dx vs host" << at;
    EXPECT_LE(RelL2(a.dg, h.dg), kRelL2) << "dgates vs host" << at;
    EXPECT_LE(RelL2(a.dw1, h.dw1), kRelL2) << "dW1 vs host" << at;
    EXPECT_LE(RelL2(a.dw2, h.dw2), kRelL2) << "dW2 vs host" << at;
    // The CUDA one-domain layer on the same routing.
    EXPECT_EQ(a.acc.accepted, o.acc.accepted) << "accepted set vs one domain" << at;
    EXPECT_EQ(TraceDiff(a.trace, o.trace), "") << "owner placement vs one domain" << at;
    EXPECT_TRUE(Bitwise(a.dg, o.dg)) << "dgates vs one domain" << at;
    EXPECT_TRUE(Bitwise(a.dw1, o.dw1)) << "dW1 vs one domain" << at;
    EXPECT_TRUE(Bitwise(a.dw2, o.dw2)) << "dW2 vs one domain" << at;
    if (M == 1) {
      EXPECT_TRUE(Bitwise(a.y, o.y)) << "y vs one domain at M=1" << at;
      EXPECT_TRUE(Bitwise(a.dx, o.dx)) << "dx vs one domain at M=1" << at;
    } else {
      ExpectOneRounding(a.y, o.y, "y vs one domain" + at);
      ExpectOneRounding(a.dx, o.dx, "dx vs one domain" + at);
    }
    sent += a.traffic.inter_dispatch_rows;
    back += a.traffic.inter_combine_rows;
    EXPECT_EQ(a.traffic.inter_dispatch_bytes > 0, a.traffic.inter_dispatch_rows > 0) << at;
  }
  const int64_t expect = ExpectedInterRows(c, in, *two);
  EXPECT_EQ(sent, expect) << "inter-node rows: one per (token, remote node)";
  EXPECT_EQ(back, expect) << "every row that crossed comes back once, reduced";
  if (c.nodes > 1) {
    EXPECT_GT(sent, 0);
  }
}

std::vector<NodeCase> Cases() {
  std::vector<NodeCase> v;
  for (int32_t N : {2, 3, 4})
    for (int32_t G : {1, 2, 4})
      for (int32_t M = 1; M <= N; ++M)  // M in {1, 2, N}, each once
        if (N * G <= 8 && (M <= 2 || M == N)) v.push_back(NodeCase{N, G, M == N ? 0 : M});
  v.push_back(NodeCase{3, 2, 2, 0.8});     // capacity drops
  v.push_back(NodeCase{2, 4, 0, 0, 20});   // several segments (S = 20 < W*T)
  v.push_back(NodeCase{4, 2, 2, 1.0, 7});  // drops and segments
  return v;
}

INSTANTIATE_TEST_SUITE_P(Nodes, CudaTwoPhase, ::testing::ValuesIn(Cases()), [](const ::testing::TestParamInfo<NodeCase>& p) {
  const NodeCase& c = p.param;
  std::string name = "N" + std::to_string(c.nodes) + "_G" + std::to_string(c.per_node) + "_M" +
                     std::to_string(c.max_nodes ? c.max_nodes : c.nodes);
  if (c.capacity_factor > 0) name += "_drops";
  if (c.segment) name += "_S" + std::to_string(c.segment);
  return name;
});

// Sentinel experts echo (row_id, owner, expert) and x: every row each source got back, gathered from
// its relays, and every owner's grouped placement equal the host two-phase layer's bit for bit.
TEST(CudaTwoPhaseSentinel, ExpertOutputsAndPlacementEqualTheHostTwoPhaseLayer) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (NodeCase c : {NodeCase{2, 2, 0}, NodeCase{4, 2, 2, 0.9}, NodeCase{3, 1, 1, 0, 10}}) {
    const Inputs in = MakeInputs(c);
    // Placement is compared across backends, so both get the same segment size (their defaults differ:
    // the host's is T, the CUDA layer's W*T).
    if (c.segment == 0) c.segment = in.s.ranks * in.s.tokens;
    const LayerConfig cfg = ConfigOf(c, in.s, true);
    auto dev = RunCuda(cfg, in, /*sentinel=*/true);
    ASSERT_TRUE(dev.ok()) << dev.status();
    auto host = RunHost(cfg, in, /*sentinel=*/true);
    ASSERT_TRUE(host.ok()) << host.status();
    auto dev_one = RunCuda(ConfigOf(c, in.s, false), in, /*sentinel=*/true);  // the one-domain layers, to tell
    ASSERT_TRUE(dev_one.ok()) << dev_one.status();                           // which side a difference is on
    auto host_one = RunHost(ConfigOf(c, in.s, false), in, /*sentinel=*/true);
    ASSERT_TRUE(host_one.ok()) << host_one.status();
    for (size_t r = 0; r < dev->size(); ++r) {
      const std::string at = ::testing::PrintToString(c) + " rank " + std::to_string(r);
      EXPECT_EQ((*dev)[r].acc.accepted, (*host)[r].acc.accepted) << at;
      EXPECT_EQ(TraceDiff((*dev)[r].trace, (*host)[r].trace), "") << "owner placement, " << at;
      EXPECT_EQ(TraceDiff((*dev)[r].trace, (*dev_one)[r].trace), "") << "owner placement vs the CUDA one-domain layer, " << at;
      EXPECT_EQ(TraceDiff((*dev_one)[r].trace, (*host_one)[r].trace), "") << "one domain: CUDA vs host, " << at;
      EXPECT_TRUE(Bitwise((*dev)[r].expert_out, (*host)[r].expert_out)) << "sentinel rows, " << at;
    }
  }
}

TEST(CudaTwoPhaseErrors, BadNodeConfigurationsAreNamed) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const LayerShape s{.tokens = 8, .hidden = 16, .ffn = 8, .experts = 12, .topk = 3, .ranks = 6};
  auto domain = SharedGpuDomain(6);
  ASSERT_TRUE(domain.ok()) << domain.status();
  const OwnershipMap own = *OwnershipMap::Contiguous(12, 6);
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.nodes = NodeConfig{.nodes = 4};  // N*G != W
  EXPECT_NE(CudaMoELayer::Create(**domain, cfg, own).status().message().find("N=4 must be >= 1 and divide W=6"), std::string::npos);
  cfg.nodes = NodeConfig{.nodes = 3, .max_nodes = 4};  // M outside [1, N]
  EXPECT_NE(CudaMoELayer::Create(**domain, cfg, own).status().message().find("M=4 must be in [1, N=3]"), std::string::npos);
  cfg.nodes = NodeConfig{.nodes = 3, .max_nodes = 1};
  cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp};
  EXPECT_NE(CudaMoELayer::Create(**domain, cfg, own).status().message().find("not supported yet"), std::string::npos);
  cfg.balance = BalanceConfig{};
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  EXPECT_NE(CudaMoELayer::Create(**domain, cfg, own).status().message().find("with expert_compute cutlass"), std::string::npos);
  cfg.expert_compute = ExpertComputeKind::kCublasLt;
}

TEST(CudaTwoPhaseErrors, ATokenOverTheCapIsNamedAfterTheCollective) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const LayerShape s{.tokens = 8, .hidden = 16, .ffn = 8, .experts = 12, .topk = 3, .ranks = 6};
  auto domain = SharedGpuDomain(6);
  ASSERT_TRUE(domain.ok()) << domain.status();
  const OwnershipMap own = *OwnershipMap::Contiguous(12, 6);
  LayerConfig cfg = MakeLayerConfig(s);
  cfg.nodes = NodeConfig{.nodes = 3, .max_nodes = 1};
  auto layer = CudaMoELayer::Create(**domain, cfg, own, RandomWeights(s, 1));
  ASSERT_TRUE(layer.ok()) << layer.status();
  // Token 2 of rank 1 picks experts 0, 4, 8: owners 0, 2, 4, i.e. nodes 0, 1, 2 with a cap of 1.
  Routing rt = *GenerateRouting(s, *RoutingSpec::Parse("one-expert"));  // experts 0,1,2: node 0 only
  rt[1].experts[2 * 3 + 1] = 4;
  rt[1].experts[2 * 3 + 2] = 8;
  const Activations x = RandomActivations(s, rt, 2);
  std::vector<Status> per_rank(6);
  Status st = (*domain)->Run([&](int32_t r) -> Status {
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(rt[static_cast<size_t>(r)], x[static_cast<size_t>(r)], x[static_cast<size_t>(r)], s.hidden, b));
    per_rank[static_cast<size_t>(r)] = (*layer)->Forward(r, b.e, b.g, b.n, b.x, b.y);
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    return per_rank[static_cast<size_t>(r)];
  });
  ASSERT_FALSE(st.ok());
  for (int32_t r = 0; r < 6; ++r)
    if (r != 1) {
      EXPECT_TRUE(per_rank[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << per_rank[static_cast<size_t>(r)];
    }
  EXPECT_NE(per_rank[1].message().find("forward on rank 1: routing: token 2 has experts on 3 nodes (0,1,2), more than the node cap M=1"),
            std::string::npos)
      << per_rank[1];
}

TEST(CudaTwoPhaseErrors, TheCallersExpertsStepsAreRefusedWithNodes) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const NodeCase c{2, 2, 0};
  const Inputs in = MakeInputs(c);
  auto domain = SharedGpuDomain(in.s.ranks);
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(c, in.s, true), *OwnershipMap::Contiguous(in.s.experts, in.s.ranks), in.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<Status> per_rank(static_cast<size_t>(in.s.ranks));
  Status st = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(in.rt[i], in.x[i], in.dy[i], in.s.hidden, b));
    ForwardContext ctx;
    RDEP_RETURN_IF_ERROR((*layer)->Plan(r, ctx, b.e, b.g, b.n));
    per_rank[i] = (*layer)->Dispatch(r, ctx, b.x, b.n, b.y, 0);
    RDEP_RETURN_IF_ERROR((*layer)->Run(r, ctx, b.x, b.y));  // the plan still runs (every rank's Dispatch was refused alike)
    return (*domain)->Synchronize(r);
  });
  EXPECT_TRUE(st.ok()) << st;
  for (const Status& p : per_rank) EXPECT_NE(p.message().find("cannot run with nodes (N=2)"), std::string::npos) << p;
}

}  // namespace
}  // namespace rdep
#endif  // RDEP_HAVE_CUDA
