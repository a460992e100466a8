// GPU router (rdep::kernels::LaunchRouterTopK) against the host reference router (rdep::Route):
// experts and tokens_per_expert must match exactly, gates within a relative bound (1e-5 for fp32
// scores, 2.5e-7 — about one fp32 ulp — for fp64 scores). Fresh seeded logits per case, with tokens
// redrawn while two keys that decide the routing lie closer than the precision can order (exact ties
// are tested on their own, with inputs whose scores tie bit for bit). Outputs are poisoned first.
// Every GPU test skips when no device is present. The timing test prints the routing time:
//   build-*/src/router/router_kernel_test --gtest_filter='GpuRouterTiming.*'
#include "rdep/router/gpu_router.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <sstream>
#include <vector>

#include "rdep/core/random.h"
#include "rdep/cuda/check.h"
#include "rdep/router/router.h"

namespace rdep::kernels {
namespace {

#define SKIP_WITHOUT_GPU()                 \
  if (::rdep::cuda::DeviceCount() == 0) { \
    GTEST_SKIP() << "no CUDA device";     \
  }

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (n_ > 0) {
      EXPECT_EQ(cudaMalloc(&ptr_, n_ * sizeof(T)), cudaSuccess);
    }
  }
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return ptr_; }
  void Upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    if (n_ > 0) {
      ASSERT_EQ(cudaMemcpy(ptr_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  void Poison(int byte) {
    if (n_ > 0) {
      ASSERT_EQ(cudaMemset(ptr_, byte, n_ * sizeof(T)), cudaSuccess);
    }
  }
  std::vector<T> Download() const {
    std::vector<T> v(n_);
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }

 private:
  size_t n_;
  T* ptr_ = nullptr;
};

struct Case {
  int64_t experts = 0, topk = 0;
  ScoreFunction score = ScoreFunction::kSoftmax;
  bool normalize = true;
  double scale = 1.0;
  bool bias = false;
  int64_t groups = 1, topk_groups = 1;
  int64_t tokens = 1000;
  uint64_t seed = 1;
  int64_t nodes = 0, max_nodes = 0;  // node-limited: expert e on node e*nodes/E (contiguous, possibly uneven)
};

std::vector<int32_t> NodeMap(const Case& c) {
  std::vector<int32_t> node;
  for (int64_t e = 0; e < c.experts; ++e) node.push_back(static_cast<int32_t>(e * c.nodes / c.experts));
  return node;
}

RouterConfig HostConfig(const Case& c) {
  RouterConfig r;
  r.num_experts = c.experts;
  r.topk = c.topk;
  r.score_function = c.score;
  r.normalize_topk = c.normalize;
  r.scaling_factor = c.scale;
  r.num_groups = c.groups;
  r.topk_groups = c.topk_groups;
  if (c.nodes > 0) {
    r.max_nodes = c.max_nodes;
    r.node_of_expert = NodeMap(c);
  }
  return r;
}

size_t Sz(int64_t i) { return static_cast<size_t>(i); }

// The smallest gap between two selection keys of one token that decide its routing (the group
// boundary, and adjacent keys among the top K+1 allowed experts), relative to the row's largest key.
double DecidingGap(const double* sel, const Case& c) {
  const int64_t e = c.experts;
  double scale = 0;
  for (int64_t i = 0; i < e; ++i) scale = std::max(scale, std::abs(sel[i]));
  double gap = INFINITY;
  std::vector<char> allowed(Sz(e), 1);
  if (c.groups > 1) {
    const int64_t gs = e / c.groups;
    std::vector<double> gscore(Sz(c.groups));
    for (int64_t g = 0; g < c.groups; ++g) {
      std::vector<double> v(sel + g * gs, sel + (g + 1) * gs);
      std::sort(v.begin(), v.end(), std::greater<>());
      gscore[Sz(g)] = gs == 1 ? v[0] : v[0] + v[1];
    }
    std::vector<int64_t> order(Sz(c.groups));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return gscore[Sz(a)] > gscore[Sz(b)]; });
    if (c.topk_groups < c.groups)
      gap = std::min(gap, gscore[Sz(order[Sz(c.topk_groups - 1)])] - gscore[Sz(order[Sz(c.topk_groups)])]);
    for (int64_t r = c.topk_groups; r < c.groups; ++r)
      for (int64_t i = 0; i < gs; ++i) allowed[Sz(order[Sz(r)] * gs + i)] = 0;
  }
  if (c.nodes > 0) {  // the node boundary, over the experts the groups left
    const std::vector<int32_t> node = NodeMap(c);
    std::vector<double> a(Sz(c.nodes), -INFINITY), b(Sz(c.nodes), -INFINITY), nscore(Sz(c.nodes));
    for (int64_t i = 0; i < e; ++i) {
      if (!allowed[Sz(i)]) continue;
      const auto n = Sz(node[Sz(i)]);
      if (sel[i] > a[n]) {
        b[n] = a[n];
        a[n] = sel[i];
      } else if (sel[i] > b[n]) {
        b[n] = sel[i];
      }
    }
    for (size_t n = 0; n < nscore.size(); ++n) nscore[n] = b[n] == -INFINITY ? a[n] : a[n] + b[n];
    std::vector<int64_t> order(Sz(c.nodes));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return nscore[Sz(x)] > nscore[Sz(y)]; });
    if (c.max_nodes < c.nodes && std::isfinite(nscore[Sz(order[Sz(c.max_nodes)])]))
      gap = std::min(gap, nscore[Sz(order[Sz(c.max_nodes - 1)])] - nscore[Sz(order[Sz(c.max_nodes)])]);
    for (int64_t r = c.max_nodes; r < c.nodes; ++r)
      for (int64_t i = 0; i < e; ++i)
        if (node[Sz(i)] == order[Sz(r)]) allowed[Sz(i)] = 0;
  }
  std::vector<double> v;
  for (int64_t i = 0; i < e; ++i)
    if (allowed[Sz(i)]) v.push_back(sel[i]);
  std::sort(v.begin(), v.end(), std::greater<>());
  const size_t deciding = std::min(v.size(), Sz(c.topk + 1));
  for (size_t i = 1; i < deciding; ++i) gap = std::min(gap, v[i - 1] - v[i]);
  return scale > 0 ? gap / scale : gap;
}

struct Inputs {
  std::vector<float> logits, bias;
  RouterOutput host;
};

// Seeded logits (and bias); tokens whose deciding gap is below min_gap are redrawn.
Inputs MakeInputs(const Case& c, double min_gap) {
  Inputs in;
  Rng rng(c.seed, static_cast<uint64_t>(c.experts * 1000 + c.topk));
  const int64_t e = c.experts;
  const double spread = c.score == ScoreFunction::kSoftmax ? 1.5 : 2.0;
  auto draw_row = [&](int64_t t) {
    for (int64_t i = 0; i < e; ++i) in.logits[Sz(t * e + i)] = static_cast<float>(spread * rng.normal());
  };
  in.logits.resize(Sz(c.tokens * e));
  for (int64_t t = 0; t < c.tokens; ++t) draw_row(t);
  if (c.bias) {
    // Comparable to the scores, so it changes selections: ~1/E for softmax, ~0.05 for sigmoid.
    const double amp = c.score == ScoreFunction::kSoftmax ? 2.0 / static_cast<double>(e) : 0.1;
    for (int64_t i = 0; i < e; ++i) in.bias.push_back(static_cast<float>(amp * (rng.uniform() - 0.5)));
  }
  const RouterConfig cfg = HostConfig(c);
  for (int attempt = 0;; ++attempt) {
    auto out = Route(cfg, in.logits, c.tokens, in.bias);
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return in;
    in.host = std::move(out).value();
    std::vector<double> sel(Sz(e));
    int64_t redrawn = 0;
    for (int64_t t = 0; t < c.tokens; ++t) {
      for (int64_t i = 0; i < e; ++i)
        sel[Sz(i)] = in.host.scores[Sz(t * e + i)] + (c.bias ? static_cast<double>(in.bias[Sz(i)]) : 0.0);
      if (DecidingGap(sel.data(), c) < min_gap) {
        draw_row(t);
        ++redrawn;
      }
    }
    if (redrawn == 0) return in;
    EXPECT_LT(attempt, 50) << "could not draw logits without near-ties";
    if (attempt >= 50) return in;
  }
}

GpuRouterDesc DescOf(const Case& c, bool fp64) {
  auto d = FromRouterConfig(HostConfig(c));
  EXPECT_TRUE(d.ok()) << d.status();
  GpuRouterDesc desc = d.ok() ? *d : GpuRouterDesc{};
  desc.fp64_scores = fp64;
  return desc;
}

struct GpuResult {
  std::vector<int32_t> experts, tokens_per_expert;
  std::vector<float> gates;
};

GpuResult RunGpu(GpuRouterDesc desc, const std::vector<float>& logits, int64_t tokens, const std::vector<float>& bias,
                 const std::vector<int32_t>& node_of_expert = {}) {
  const size_t nk = Sz(tokens * desc.topk), e = Sz(desc.num_experts);
  DeviceArray<float> d_logits(logits.size()), d_bias(bias.size()), d_gates(nk);
  DeviceArray<int32_t> d_experts(nk), d_tpe(e), d_node(node_of_expert.size());
  d_node.Upload(node_of_expert);
  if (!node_of_expert.empty()) desc.node_of_expert = d_node.get();
  d_logits.Upload(logits);
  d_bias.Upload(bias);
  d_experts.Poison(0xFF);  // -1
  d_gates.Poison(0xFF);    // NaN
  d_tpe.Poison(0x7F);
  const Status st = LaunchRouterTopK(desc, d_logits.get(), tokens, bias.empty() ? nullptr : d_bias.get(),
                                     d_experts.get(), d_gates.get(), d_tpe.get(), nullptr);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {d_experts.Download(), d_tpe.Download(), d_gates.Download()};
}

// Routes one case on the GPU in both precisions and compares with the host router.
void CheckAgainstHost(const Case& c) {
  for (bool fp64 : {true, false}) {
    SCOPED_TRACE(fp64 ? "fp64 scores" : "fp32 scores");
    const Inputs in = MakeInputs(c, fp64 ? 1e-9 : 1e-5);
    const GpuRouterDesc desc = DescOf(c, fp64);
    const GpuResult g = RunGpu(desc, in.logits, c.tokens, in.bias, c.nodes > 0 ? NodeMap(c) : std::vector<int32_t>{});
    const RankRouting& h = in.host.routing;
    ASSERT_EQ(g.experts.size(), h.experts.size());
    int64_t wrong_experts = 0, wrong_gates = 0;
    double worst = 0;
    const double rtol = fp64 ? 2.5e-7 : 1e-5;
    for (size_t i = 0; i < h.experts.size(); ++i) {
      if (g.experts[i] != h.experts[i] && wrong_experts++ < 5)
        ADD_FAILURE() << "token " << i / Sz(c.topk) << " slot " << i % Sz(c.topk) << ": gpu expert " << g.experts[i]
                      << ", host " << h.experts[i];
      const double ref = h.gates[i], err = std::abs(static_cast<double>(g.gates[i]) - ref);
      worst = std::max(worst, err / std::max(std::abs(ref), 1e-30));
      if (!(err <= rtol * std::abs(ref)) && wrong_gates++ < 5)
        ADD_FAILURE() << "token " << i / Sz(c.topk) << " slot " << i % Sz(c.topk) << ": gpu gate " << g.gates[i]
                      << ", host " << ref;
    }
    EXPECT_EQ(wrong_experts, 0) << desc;
    EXPECT_EQ(wrong_gates, 0) << desc << " (worst relative error " << worst << ")";
    std::vector<int32_t> host_tpe(in.host.tokens_per_expert.begin(), in.host.tokens_per_expert.end());
    EXPECT_EQ(g.tokens_per_expert, host_tpe) << desc;
  }
}

// --- Agreement with the host router; names encode E, K, score, normalize, scale, bias, groups, tokens.

TEST(GpuRouter_NodeLimited, E64_K6_Nodes8_Keep2_T2000) {  // Moonlight experts over 8 nodes, M = 2
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 64, .topk = 6, .scale = 2.446, .tokens = 2000, .seed = 11, .nodes = 8, .max_nodes = 2});
}

TEST(GpuRouter_NodeLimited, E64_K6_Nodes8_Keep1_Bias_T1000) {  // every token on one node
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 64, .topk = 6, .bias = true, .seed = 12, .nodes = 8, .max_nodes = 1});
}

TEST(GpuRouter_NodeLimited, E60_K4_Nodes7_Keep3_Sigmoid_T1000) {  // uneven nodes (8 or 9 experts)
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 60, .topk = 4, .score = ScoreFunction::kSigmoid, .seed = 13, .nodes = 7, .max_nodes = 3});
}

TEST(GpuRouter_NodeLimited, E256_K8_Groups4of8_Nodes4_Keep2_Bias_T5000) {  // groups, then nodes
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 256, .topk = 8, .score = ScoreFunction::kSigmoid, .scale = 2.5, .bias = true, .groups = 8,
                    .topk_groups = 4, .tokens = 5000, .seed = 14, .nodes = 4, .max_nodes = 2});
}

TEST(GpuRouter_NodeLimited, E128_K8_Nodes32_Keep4_T1000) {  // the widest node count
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 128, .topk = 8, .seed = 15, .nodes = 32, .max_nodes = 4});
}

TEST(GpuRouterDescNodes, BadNodeDescriptionsAreRejected) {
  GpuRouterDesc d;
  d.num_experts = 64;
  d.topk = 4;
  d.num_nodes = 33;
  d.max_nodes = 2;
  EXPECT_NE(d.Validate().message().find("num_nodes in [1, 32]"), std::string::npos);
  d.num_nodes = 8;
  d.max_nodes = 9;
  EXPECT_NE(d.Validate().message().find("max_nodes in [1, num_nodes]"), std::string::npos);
  d.max_nodes = 2;
  EXPECT_TRUE(d.Validate().ok());
  EXPECT_NE(LaunchRouterTopK(d, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr).message().find("node_of_expert"),
            std::string::npos);
  RouterConfig rc;
  rc.num_experts = 8;
  rc.topk = 2;
  rc.max_nodes = 1;
  rc.node_of_expert = {0, 0, 0, 0, 5, 5, 5, 5};  // two distinct nodes, but ids with a gap
  EXPECT_NE(FromRouterConfig(rc).status().message().find("without gaps"), std::string::npos);
  rc.node_of_expert = {0, 0, 0, 0, 1, 1, 1, 1};
  auto ok = FromRouterConfig(rc);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->num_nodes, 2);
  EXPECT_EQ(ok->max_nodes, 1);
}

TEST(GpuRouter_Softmax, E64_K6_Norm_Scale2p446_T1000) {  // the Moonlight router
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 64, .topk = 6, .scale = 2.446});
}

TEST(GpuRouter_Softmax, E64_K6_NoNorm_T1000) {
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 64, .topk = 6, .normalize = false, .seed = 2});
}

TEST(GpuRouter_Softmax, E60_K4_Norm_Bias_T1000) {  // E not a power of two: padded lanes
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 60, .topk = 4, .bias = true, .seed = 3});
}

TEST(GpuRouter_Sigmoid, E60_K4_NoNorm_T1000) {
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 60, .topk = 4, .score = ScoreFunction::kSigmoid, .normalize = false, .seed = 4});
}

TEST(GpuRouter_Sigmoid, E256_K8_Norm_Scale2p5_Bias_Groups4of8_T20000) {  // DeepSeek-V3; grid-stride loop
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 256, .topk = 8, .score = ScoreFunction::kSigmoid, .scale = 2.5, .bias = true,
                    .groups = 8, .topk_groups = 4, .tokens = 20000, .seed = 5});
}

TEST(GpuRouter_Softmax, E160_K6_Norm_Groups3of10_T1000) {  // groups without bias; E not a power of two
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 160, .topk = 6, .groups = 10, .topk_groups = 3, .seed = 6});
}

TEST(GpuRouter_Sigmoid, E32_K2_Norm_Bias_Groups5of32_T1000) {  // group size 1 (top-2 of one expert)
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 32, .topk = 2, .score = ScoreFunction::kSigmoid, .bias = true, .groups = 32,
                    .topk_groups = 5, .seed = 7});
}

TEST(GpuRouter_Sigmoid, E512_K16_Norm_Bias_T2000) {  // the largest E and K
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 512, .topk = 16, .score = ScoreFunction::kSigmoid, .bias = true, .tokens = 2000,
                    .seed = 8});
}

TEST(GpuRouter_Softmax, E384_K8_NoNorm_Bias_T1000) {
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 384, .topk = 8, .normalize = false, .bias = true, .seed = 9});
}

TEST(GpuRouter_Softmax, E16_K1_Norm_T1000) {  // K = 1: the gate is c after normalization
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 16, .topk = 1, .seed = 10});
}

TEST(GpuRouter_Sigmoid, E100_K1_NoNorm_Bias_T1000) {
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 100, .topk = 1, .score = ScoreFunction::kSigmoid, .normalize = false, .bias = true,
                    .seed = 11});
}

TEST(GpuRouter_Softmax, E16_K16_Norm_T1000) {  // K = E: every expert, in descending order
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 16, .topk = 16, .seed = 12});
}

TEST(GpuRouter_Sigmoid, E5_K5_NoNorm_Bias_T1000) {
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 5, .topk = 5, .score = ScoreFunction::kSigmoid, .normalize = false, .bias = true,
                    .seed = 13});
}

TEST(GpuRouter_Softmax, E1_K1_T100) {
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 1, .topk = 1, .tokens = 100, .seed = 14});
}

TEST(GpuRouter_Softmax, E64_K6_Norm_Bias_T1) {
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 64, .topk = 6, .bias = true, .tokens = 1, .seed = 15});
}

TEST(GpuRouter_Sigmoid, E256_K8_Norm_Groups4of8_T1) {
  SKIP_WITHOUT_GPU();
  CheckAgainstHost({.experts = 256, .topk = 8, .score = ScoreFunction::kSigmoid, .groups = 8, .topk_groups = 4,
                    .tokens = 1, .seed = 16});
}

// n = 0: nothing is written except tokens_per_expert, which is zeroed.
TEST(GpuRouter_Softmax, E64_K6_T0) {
  SKIP_WITHOUT_GPU();
  const Case c{.experts = 64, .topk = 6, .tokens = 0};
  for (bool fp64 : {true, false}) {
    DeviceArray<int32_t> experts(6), tpe(64);
    DeviceArray<float> gates(6);
    experts.Poison(0xFF);
    gates.Poison(0xFF);
    tpe.Poison(0x7F);
    EXPECT_TRUE(LaunchRouterTopK(DescOf(c, fp64), nullptr, 0, nullptr, experts.get(), gates.get(), tpe.get(), nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(experts.Download(), std::vector<int32_t>(6, -1));
    for (float g : gates.Download()) EXPECT_TRUE(std::isnan(g));
    EXPECT_EQ(tpe.Download(), std::vector<int32_t>(64, 0));
  }
}

// --- Exact ties: scores equal bit for bit on host and GPU; the lower expert (group) id must win.

void CheckTies(const Case& c, const std::vector<float>& logits, const std::vector<float>& bias) {
  auto host = Route(HostConfig(c), logits, c.tokens, bias);
  ASSERT_TRUE(host.ok()) << host.status();
  for (bool fp64 : {true, false}) {
    SCOPED_TRACE(fp64 ? "fp64 scores" : "fp32 scores");
    const GpuResult g = RunGpu(DescOf(c, fp64), logits, c.tokens, bias);
    EXPECT_EQ(g.experts, host->routing.experts);
    for (size_t i = 0; i < g.gates.size(); ++i)
      EXPECT_NEAR(g.gates[i], host->routing.gates[i], 1e-5 * std::abs(host->routing.gates[i])) << i;
  }
}

TEST(GpuRouter_Ties, Softmax_E40_K6_IntegerLogits) {
  SKIP_WITHOUT_GPU();
  const Case c{.experts = 40, .topk = 6, .tokens = 200};
  Rng rng(21);
  std::vector<float> logits(Sz(c.tokens * c.experts));
  for (float& l : logits) l = static_cast<float>(rng.below(4));  // many equal logits per token
  CheckTies(c, logits, {});
  // All equal: experts 0..K-1 in order, equal gates.
  std::fill(logits.begin(), logits.end(), 0.5f);
  CheckTies(c, logits, {});
}

TEST(GpuRouter_Ties, Sigmoid_E48_K4_Bias_ZeroLogits) {
  SKIP_WITHOUT_GPU();
  // sigmoid(0) = 0.5 exactly; the bias takes values {0, 0.25, 0.5}, so sel = s + b ties exactly in
  // fp32 and fp64 and only the bias and the expert id decide.
  const Case c{.experts = 48, .topk = 4, .score = ScoreFunction::kSigmoid, .bias = true, .tokens = 64};
  std::vector<float> logits(Sz(c.tokens * c.experts), 0.0f), bias(Sz(c.experts));
  Rng rng(22);
  for (float& b : bias) b = 0.25f * static_cast<float>(rng.below(3));
  for (int64_t t = 0; t < c.tokens; t += 2)  // every other token: a few logits of 1 break some ties
    for (int64_t i = 0; i < c.experts; ++i) logits[Sz(t * c.experts + i)] = rng.below(8) == 0 ? 1.0f : 0.0f;
  CheckTies(c, logits, bias);
}

TEST(GpuRouter_Ties, Softmax_E64_K4_Groups2of8_TiedGroups) {
  SKIP_WITHOUT_GPU();
  // Integer logits repeated group by group: every group scores the same, so groups 0 and 1 are kept.
  const Case c{.experts = 64, .topk = 4, .groups = 8, .topk_groups = 2, .tokens = 50};
  Rng rng(23);
  std::vector<float> logits(Sz(c.tokens * c.experts));
  for (int64_t t = 0; t < c.tokens; ++t) {
    std::vector<float> group(8);
    for (float& l : group) l = static_cast<float>(rng.below(5));
    for (int64_t i = 0; i < c.experts; ++i) logits[Sz(t * c.experts + i)] = group[Sz(i % 8)];
  }
  CheckTies(c, logits, {});
  auto host = Route(HostConfig(c), logits, c.tokens, {});
  ASSERT_TRUE(host.ok());
  for (int32_t e : host->routing.experts) EXPECT_LT(e, 16) << "only groups 0 and 1 may be chosen";
}

// --- Descriptions the kernel cannot take are rejected before any launch (no device needed).

TEST(GpuRouter_Validate, RejectsUnsupportedDescriptions) {
  auto bad = [](GpuRouterDesc d) {
    return LaunchRouterTopK(d, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr).code();
  };
  const GpuRouterDesc ok{.num_experts = 64, .topk = 6};
  EXPECT_TRUE(ok.Validate().ok());
  GpuRouterDesc d = ok;
  d.num_experts = 513;
  EXPECT_EQ(bad(d), StatusCode::kInvalidArgument);
  d = ok;
  d.topk = 17;
  d.num_experts = 64;
  EXPECT_EQ(bad(d), StatusCode::kInvalidArgument);
  d = ok;
  d.topk = 65;
  EXPECT_EQ(bad(d), StatusCode::kInvalidArgument);
  d = ok;
  d.scaling_factor = 0;
  EXPECT_EQ(bad(d), StatusCode::kInvalidArgument);
  d = ok;
  d.num_groups = 7;  // does not divide 64
  EXPECT_EQ(bad(d), StatusCode::kInvalidArgument);
  d = ok;
  d.num_groups = 64;  // more than 32 groups
  EXPECT_EQ(bad(d), StatusCode::kInvalidArgument);
  d = ok;
  d.num_groups = 16;
  d.topk_groups = 1;  // 4 experts kept < K = 6
  EXPECT_EQ(bad(d), StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchRouterTopK(ok, nullptr, 5, nullptr, nullptr, nullptr, nullptr, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchRouterTopK(ok, nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr).code(),
            StatusCode::kInvalidArgument);
  RouterConfig sinkhorn = HostConfig({.experts = 8, .topk = 2});
  sinkhorn.sinkhorn = true;
  EXPECT_NE(FromRouterConfig(sinkhorn).status().message().find("Sinkhorn"), std::string::npos);
}

// --- Timing: 32K tokens at the DeepSeek-V3 router (E=256, K=8) and the Moonlight router (E=64, K=6).

TEST(GpuRouterTiming, T32768_E256_K8_And_E64_K6) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    const char* name;
    Case c;
  };
  const int64_t n = 32768;
  const Shape shapes[] = {
      {"E256 K8 sigmoid+bias groups 4/8", {.experts = 256, .topk = 8, .score = ScoreFunction::kSigmoid, .scale = 2.5,
                                           .bias = true, .groups = 8, .topk_groups = 4, .tokens = n}},
      {"E256 K8 softmax", {.experts = 256, .topk = 8, .tokens = n}},
      {"E64 K6 softmax", {.experts = 64, .topk = 6, .scale = 2.446, .tokens = n}},
  };
  // Rotate over enough logit buffers (>= 160 MB in all) that each run reads rows that are not in L2
  // (50 MB on H100). Two numbers per row: p50/p99 of one launch timed alone (events around it, host
  // launch overhead included), and the mean of kIters launches back to back on the stream.
  constexpr int kWarmup = 5, kIters = 50;
  for (const Shape& sh : shapes) {
    const Case& c = sh.c;
    const size_t buf_bytes = Sz(n * c.experts) * sizeof(float);
    const int buffers = static_cast<int>(std::max<size_t>(2, (160u << 20) / buf_bytes + 1));
    Rng rng(31);
    std::vector<float> logits(Sz(n * c.experts)), bias(c.bias ? Sz(c.experts) : 0);
    for (float& l : logits) l = static_cast<float>(rng.normal());
    for (float& b : bias) b = static_cast<float>(0.05 * rng.uniform());
    std::vector<std::unique_ptr<DeviceArray<float>>> bufs;
    for (int i = 0; i < buffers; ++i) {
      bufs.push_back(std::make_unique<DeviceArray<float>>(logits.size()));
      bufs.back()->Upload(logits);
    }
    DeviceArray<float> d_bias(bias.size()), gates(Sz(n * c.topk));
    DeviceArray<int32_t> experts(Sz(n * c.topk)), tpe(Sz(c.experts));
    d_bias.Upload(bias);
    for (bool fp64 : {true, false}) {
      const GpuRouterDesc desc = DescOf(c, fp64);
      auto launch = [&](int it) {
        return LaunchRouterTopK(desc, bufs[Sz(it % buffers)]->get(), n, c.bias ? d_bias.get() : nullptr,
                                experts.get(), gates.get(), tpe.get(), nullptr);
      };
      cudaEvent_t start, stop;
      ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
      ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
      std::vector<float> ms;
      for (int it = 0; it < kWarmup + kIters; ++it) {
        ASSERT_EQ(cudaEventRecord(start), cudaSuccess);
        ASSERT_TRUE(launch(it).ok());
        ASSERT_EQ(cudaEventRecord(stop), cudaSuccess);
        ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
        float t = 0;
        ASSERT_EQ(cudaEventElapsedTime(&t, start, stop), cudaSuccess);
        if (it >= kWarmup) ms.push_back(t);
      }
      ASSERT_EQ(cudaEventRecord(start), cudaSuccess);
      for (int it = 0; it < kIters; ++it) ASSERT_TRUE(launch(it).ok());
      ASSERT_EQ(cudaEventRecord(stop), cudaSuccess);
      ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
      float total = 0;
      ASSERT_EQ(cudaEventElapsedTime(&total, start, stop), cudaSuccess);
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      std::sort(ms.begin(), ms.end());
      const double p50 = ms[ms.size() / 2], p99 = ms[ms.size() * 99 / 100], mean_b2b = total / kIters;
      // Bytes that must move: the logits read, experts and gates written.
      const double bytes = static_cast<double>(n) * static_cast<double>(c.experts * 4 + c.topk * 8);
      std::printf("[router timing] T=%lld %-32s %s: alone p50 %6.1f us p99 %6.1f us | back-to-back %6.1f us"
                  " (%4.0f GB/s)\n",
                  static_cast<long long>(n), sh.name, fp64 ? "fp64" : "fp32", p50 * 1e3, p99 * 1e3,
                  mean_b2b * 1e3, bytes / (mean_b2b * 1e-3) / 1e9);
      RecordProperty(std::string(sh.name) + (fp64 ? " fp64" : " fp32") + " back_to_back_us",
                     std::to_string(mean_b2b * 1e3));
    }
  }
}

}  // namespace
}  // namespace rdep::kernels
