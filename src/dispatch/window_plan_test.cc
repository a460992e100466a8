// The plan under per-source windows (LaunchWindowPlan, window_plan_kernels.cu) on the GPU against the host,
// exactly: the copy of the caller's routing with each faulty token rewritten to the stand-in (the others
// untouched, the caller's arrays only read), the first fault's record with its values as given, each
// token's position among this rank's tokens for each owner (token order), each owner's tokens, every slot
// accepted with rdep::RenormalizeTokenGates's gates, the control copy (RegionLayout::window_word), and the
// check's word and the drop counter left 0, so that a second plan from the same routing finds the same.
// Fresh random routings, every output poisoned first; token counts over several blocks, K from 1 to 36 and
// W from 1 to 40 (owners with no tokens among them), faults in several blocks, tokens whose gates are all
// +0, all -0 or partly -0 (the effective gates' zero-sum rule). Both paths of the kernels: K <= 8 with
// W <= 32 (a token's slots in registers) and the general one (K 9, 13, 20 and 36; W 40 at K 6 and 20), each case's
// path asserted by its scratch size; faults in a token's last slot, and two in one token (the first slot's named). The refusals run without
// a GPU; the rest skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dispatch/routing_test_util.h"
#include "experts/experts_test_util.h"
#include "rdep/core/capacity_rules.h"
#include "rdep/core/random.h"
#include "rdep/core/route_rules.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"

namespace rdep::dispatch {
namespace {

using kernels::test_util::Dev;

struct PlanCase {
  std::string name;
  int64_t n, K, E, W;
  std::vector<int64_t> bad_tokens;  // each gets a fault of kind (index % 4): expert E, expert -1, NaN gate, a repeat
  int32_t rank = 0;
  std::vector<int64_t> zero_gate_tokens = {};  // gates of the i-th: all +0 (i % 3 == 0), all -0 (1), -0 in the even slots (2)
  // the i-th: an infinite gate in the last slot only (i even); a bad gate in slot 0 and expert -1 in the last (odd)
  std::vector<int64_t> edge_fault_tokens = {};
};
void PrintTo(const PlanCase& c, std::ostream* os) { *os << c.name; }

// n tokens of K distinct experts among the first `used` (all E when used is 0), gates in [0, 1), the case's faults.
void Routing(const PlanCase& c, int64_t used, std::vector<int32_t>& experts, std::vector<float>& gates) {
  test_util::RandomRouting(c.n, c.K, used > 0 ? used : c.E, 31 + static_cast<uint64_t>(c.n * c.K), experts, gates);
  for (size_t i = 0; i < c.zero_gate_tokens.size(); ++i)
    for (int64_t k = 0; k < c.K; ++k) {
      float& g = gates[static_cast<size_t>(c.zero_gate_tokens[i] * c.K + k)];
      g = i % 3 == 0 ? 0.f : (i % 3 == 1 || k % 2 == 0) ? -0.f : g;
    }
  test_util::InjectRoutingFaults(c.bad_tokens, c.K, c.E, experts, gates);
  for (size_t i = 0; i < c.edge_fault_tokens.size(); ++i) {
    const auto at = static_cast<size_t>(c.edge_fault_tokens[i] * c.K);
    if (i % 2 == 0) {
      gates[at + static_cast<size_t>(c.K - 1)] = std::numeric_limits<float>::infinity();
    } else {
      gates[at] = -2.f;
      experts[at + static_cast<size_t>(c.K - 1)] = -1;
    }
  }
}

class WindowPlan : public ::testing::TestWithParam<PlanCase> {};

TEST_P(WindowPlan, MatchesTheHostExactly) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const PlanCase& c = GetParam();
  // Owners: contiguous, ceil(E/W) experts each; with W > 2 the routing keeps off the last owner's experts.
  const int64_t per = (c.E + c.W - 1) / c.W;
  const int64_t used = c.W > 2 ? per * (c.W - 1) : 0;
  std::vector<int32_t> experts, owner(static_cast<size_t>(c.E)), local(static_cast<size_t>(c.E));
  std::vector<float> gates;
  Routing(c, used, experts, gates);
  for (int64_t e = 0; e < c.E; ++e) owner[static_cast<size_t>(e)] = static_cast<int32_t>(e / per), local[static_cast<size_t>(e)] = static_cast<int32_t>(e % per);
  RegionLayout l;
  l.W = c.W, l.L = per, l.T = std::max<int64_t>(c.n, 1), l.S = l.W * l.T, l.H = 8, l.K = c.K, l.slots_per_token = c.K, l.elem_bytes = 2;
  // The host: the first fault, the rewritten routing, positions, tokens per owner, effective gates.
  unsigned long long want_key = ~0ull;
  std::vector<int32_t> want_e = experts;
  std::vector<float> want_g = gates;
  for (int64_t t = 0; t < c.n; ++t)
    for (int64_t k = 0; k < c.K; ++k) {
      const auto at = static_cast<size_t>(t * c.K);
      const RouteSlotFault f = CheckRouteSlot(&experts[at], &gates[at], k, c.E);
      if (f == RouteSlotFault::kNone) continue;
      want_key = std::min(want_key, (static_cast<unsigned long long>(t * c.K + k) << 2) | static_cast<unsigned long long>(f));
      for (int64_t j = 0; j < c.K; ++j) want_e[at + static_cast<size_t>(j)] = static_cast<int32_t>(j), want_g[at + static_cast<size_t>(j)] = 0.f;
      break;
    }
  ASSERT_EQ(want_key == ~0ull, c.bad_tokens.empty() && c.edge_fault_tokens.empty());
  // The fast path (K <= 8, W <= 32) keeps a word per token after the block counts; the case's name says which it takes.
  const bool fast = c.K <= 8 && c.W <= 32;
  ASSERT_EQ(c.name.find("general") != std::string::npos, !fast) << "the case's name and its path";
  ASSERT_EQ(WindowPlanScratchInts(l, c.n), c.W * std::max<int64_t>((c.n + 255) / 256, 1) + (fast ? c.n : 0));
  std::vector<int32_t> want_tok(static_cast<size_t>(c.W * c.n), -1);
  std::vector<int64_t> want_tokens(static_cast<size_t>(c.W), 0);
  for (int64_t t = 0; t < c.n; ++t)
    for (int64_t q = 0; q < c.W; ++q) {
      bool sends = false;
      for (int64_t k = 0; k < c.K; ++k) sends |= owner[static_cast<size_t>(want_e[static_cast<size_t>(t * c.K + k)])] == q;
      if (sends) want_tok[static_cast<size_t>(q * c.n + t)] = static_cast<int32_t>(want_tokens[static_cast<size_t>(q)]++);
    }
  if (c.W > 2 && c.bad_tokens.empty()) {
    ASSERT_EQ(want_tokens[static_cast<size_t>(c.W - 1)], 0) << "an owner with no tokens";
  }
  const std::vector<uint8_t> ones(static_cast<size_t>(c.K), 1);
  std::vector<float> want_eff(want_g.size());
  for (int64_t t = 0; t < c.n; ++t)
    RenormalizeTokenGates(&want_g[static_cast<size_t>(t * c.K)], ones.data(), c.K, &want_eff[static_cast<size_t>(t * c.K)]);
  const auto words = static_cast<int64_t>(l.control_bytes() / sizeof(int64_t));
  std::vector<int64_t> want_ctl(static_cast<size_t>(words));
  for (int64_t w = 0; w < words; ++w) want_ctl[static_cast<size_t>(w)] = l.window_word(c.rank, w);

  const size_t nk = std::max<size_t>(experts.size(), 1);
  Dev<int32_t> e_src(nk), e_dev(nk), tok(static_cast<size_t>(std::max<int64_t>(c.W * c.n, 1))), owner_dev(owner.size()), local_dev(local.size());
  Dev<float> g_src(nk), g_dev(nk), eff(nk);
  Dev<uint8_t> acc(nk);
  Dev<int64_t> window_tokens(static_cast<size_t>(c.W)), ctl(static_cast<size_t>(words)), zero(1);
  Dev<unsigned long long> worst(1);
  Dev<RoutingFault> fault(1);
  Dev<int32_t> scratch(static_cast<size_t>(WindowPlanScratchInts(l, c.n)));
  if (c.n > 0) e_src.Upload(experts), g_src.Upload(gates);
  owner_dev.Upload(owner);
  local_dev.Upload(local);
  ASSERT_EQ(cudaMemset(worst.p, 0, sizeof(unsigned long long)), cudaSuccess);
  for (int pass = 0; pass < 2; ++pass) {  // the second from the same routing: the words were reset, the same answer
    SCOPED_TRACE("pass " + std::to_string(pass));
    for (auto* d : {&e_dev, &tok}) d->Poison();
    for (auto* d : {&g_dev, &eff}) d->Poison();
    for (auto* d : {&window_tokens, &ctl, &zero}) d->Poison();
    acc.Poison();
    fault.Poison();
    scratch.Poison();
    ASSERT_TRUE(LaunchWindowPlan(c.n > 0 ? e_src.p : nullptr, c.n > 0 ? g_src.p : nullptr, c.n, l, OwnerMapView{owner_dev.p, local_dev.p},
                                 static_cast<int32_t>(c.E), c.rank, e_dev.p, g_dev.p, tok.p, window_tokens.p, acc.p, eff.p, ctl.p, worst.p,
                                 fault.p, zero.p, scratch.p, static_cast<int64_t>(scratch.n), nullptr)
                    .ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const RoutingFault got = fault.Download()[0];
    ASSERT_EQ(got.key, want_key);
    if (want_key != ~0ull) {
      EXPECT_EQ(got.expert, experts[static_cast<size_t>(want_key >> 2)]) << "the value as given";
      const float g = gates[static_cast<size_t>(want_key >> 2)];
      if (std::isnan(g)) EXPECT_TRUE(std::isnan(got.gate));
      else EXPECT_EQ(got.gate, g);
    }
    EXPECT_EQ(worst.Download()[0], 0ull);
    EXPECT_EQ(zero.Download()[0], 0);
    EXPECT_EQ(window_tokens.Download(), want_tokens);
    EXPECT_EQ(ctl.Download(), want_ctl);
    if (c.n == 0) continue;
    std::vector<int32_t> tok_got = tok.Download();
    EXPECT_EQ(tok_got, want_tok);
    EXPECT_EQ(e_dev.Download(), want_e);
    const std::vector<float> g_got = g_dev.Download(), eff_got = eff.Download();
    EXPECT_EQ(std::memcmp(g_got.data(), want_g.data(), want_g.size() * 4), 0) << "gates: rewritten ones 0, the rest as given";
    EXPECT_EQ(std::memcmp(eff_got.data(), want_eff.data(), want_eff.size() * 4), 0) << "effective gates";
    for (uint8_t a : acc.Download()) ASSERT_EQ(a, 1) << "dropless: every slot accepted";
    EXPECT_EQ(e_src.Download(), experts) << "the caller's experts are only read";
    const std::vector<float> g_src_after = g_src.Download();
    EXPECT_EQ(std::memcmp(g_src_after.data(), gates.data(), gates.size() * 4), 0) << "the caller's gates are only read";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, WindowPlan,
                         ::testing::Values(PlanCase{"empty", 0, 6, 64, 4, {}, 1}, PlanCase{"one_token_W1", 1, 1, 4, 1, {}},
                                           PlanCase{"moonlight_W4", 4096, 6, 64, 4, {}, 2},
                                           PlanCase{"moonlight_W2_faults", 4096, 6, 64, 2, {4000, 17, 2500, 1023, 4095}, 1, {}, {5, 4094}},
                                           PlanCase{"dsv3_W8", 5000, 8, 256, 8, {}, 7},
                                           PlanCase{"K13_W3_general_faults", 700, 13, 40, 3, {650, 300, 301}, 0},
                                           PlanCase{"K1_W1_fault", 3000, 1, 8, 1, {2999}},
                                           PlanCase{"zero_gates_W2", 600, 6, 64, 2, {300}, 1, {0, 1, 2, 257, 258, 599}},
                                           PlanCase{"K8_W32_faults", 1000, 8, 64, 32, {999, 500, 3}, 31, {10, 11, 12}, {700, 1}},
                                           PlanCase{"K9_W2_general", 500, 9, 40, 2, {499, 256}, 0, {7, 8, 9}},
                                           PlanCase{"K36_W4_general", 300, 36, 80, 4, {}, 3},
                                           PlanCase{"K20_W40_general_faults", 600, 20, 80, 40, {1, 598}, 39, {300, 301, 302}},
                                           PlanCase{"K6_W40_general", 600, 6, 80, 40, {5}, 20, {}, {0, 9}}),
                         [](const ::testing::TestParamInfo<PlanCase>& i) { return i.param.name; });

// Refused before any CUDA call (so in CI too), each naming what is wrong.
TEST(WindowPlanRefusals, NameTheArgument) {
  RegionLayout l;
  l.W = 4, l.L = 16, l.S = 256, l.H = 8, l.T = 64, l.K = 6, l.slots_per_token = 6, l.elem_bytes = 2;
  const OwnerMapView own{nullptr, nullptr};
  int32_t e = 0;
  float g = 0;
  auto plan = [&](const int32_t* fe, const float* fg, int64_t n, int32_t E, int32_t rank, int64_t scratch) {
    return LaunchWindowPlan(fe, fg, n, l, own, E, rank, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                            nullptr, nullptr, scratch, nullptr);
  };
  const int64_t enough = WindowPlanScratchInts(l, 64);
  EXPECT_EQ(enough, 4 * 1 + 64);  // one block of 256 tokens per owner, then (K <= 8, W <= 32) a word per token
  // The fast path's condition, K <= 8 and W <= 32, pinned where CI runs it: only there a word per token follows.
  auto need = [&](int64_t K, int64_t W, int64_t n) {
    RegionLayout m = l;
    m.K = K, m.slots_per_token = K, m.W = W;
    return WindowPlanScratchInts(m, n);
  };
  EXPECT_EQ(need(8, 32, 300), 32 * 2 + 300);
  EXPECT_EQ(need(9, 32, 300), 32 * 2);
  EXPECT_EQ(need(8, 33, 300), 33 * 2);
  EXPECT_EQ(need(1, 1, 0), 1);
  Status st = plan(&e, nullptr, 10, 64, 0, enough);
  EXPECT_NE(st.message().find("without the caller's from_experts and from_gates"), std::string::npos) << st.message();
  st = plan(&e, &g, 10, 64, 4, enough);
  EXPECT_NE(st.message().find("rank 4 outside [0, W=4)"), std::string::npos) << st.message();
  st = plan(&e, &g, 10, 5, 0, enough);
  EXPECT_NE(st.message().find("K=6"), std::string::npos) << st.message();
  st = plan(&e, &g, 1000, 64, 0, enough);
  EXPECT_NE(st.message().find("n=1000"), std::string::npos) << st.message();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdep::dispatch
