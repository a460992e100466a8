// Phase 1's kernels at a source (routing_kernels.cu) on the GPU against host computations of the same
// rules, exactly: the routing check (the first faulty slot by rdep::CheckRouteSlot's order, with the
// values as given; every faulty token rewritten, the others untouched; the scratch word left 0), the
// counts per owner with each token's position in the owner's stream (tok_index, every control word),
// the ranks per expert and the load matrix row. Fresh random routings, outputs poisoned first; token
// counts span several of the staged kernels' tiles, K from 1 to 13, per-slot targets (balancing's) as
// well as the owner map, and expert ids 4 bytes off 16-byte alignment (the staging's scalar path).
// Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dispatch/routing_test_util.h"
#include "experts/experts_test_util.h"
#include "rdep/core/random.h"
#include "rdep/core/route_rules.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"

namespace rdep::dispatch {
namespace {

using kernels::test_util::Dev;

using test_util::InjectRoutingFaults;
using test_util::RandomRouting;

struct CheckCase {
  std::string name;
  int64_t n, K, E;
  std::vector<int64_t> bad_tokens;  // each gets a fault of kind (index % 4): expert E, expert -1, NaN gate, a repeat
};
void PrintTo(const CheckCase& c, std::ostream* os) { *os << c.name; }

class RoutingCheck : public ::testing::TestWithParam<CheckCase> {};

TEST_P(RoutingCheck, NamesTheFirstFaultAndRewritesOnlyFaultyTokens) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const CheckCase& c = GetParam();
  std::vector<int32_t> experts;
  std::vector<float> gates;
  RandomRouting(c.n, c.K, c.E, 11 + static_cast<uint64_t>(c.n), experts, gates);
  InjectRoutingFaults(c.bad_tokens, c.K, c.E, experts, gates);
  // The host's answer: the first faulty slot in (t, k) order, and the faulty tokens.
  unsigned long long want = ~0ull;
  std::vector<bool> faulty(static_cast<size_t>(c.n), false);
  for (int64_t t = 0; t < c.n; ++t)
    for (int64_t k = 0; k < c.K; ++k) {
      const RouteSlotFault f = CheckRouteSlot(&experts[static_cast<size_t>(t * c.K)], &gates[static_cast<size_t>(t * c.K)], k, c.E);
      if (f == RouteSlotFault::kNone) continue;
      faulty[static_cast<size_t>(t)] = true;
      want = std::min(want, (static_cast<unsigned long long>(t * c.K + k) << 2) | static_cast<unsigned long long>(f));
      break;
    }
  ASSERT_EQ(want == ~0ull, c.bad_tokens.empty());
  // Twice: with the caller's arrays copied by the check into poisoned ones (from_experts, from_gates; with no
  // tokens one of them null, which is then not read), and checked in place. In each, pass 0 checks the routing as
  // given and pass 1 the rewritten copy in place.
  for (const bool copy : {true, false}) {
    SCOPED_TRACE(copy ? "copied by the check" : "in place");
    Dev<int32_t> e_src(experts.size()), e_dev(experts.size());
    Dev<float> g_src(gates.size()), g_dev(gates.size());
    Dev<unsigned long long> worst(1);
    Dev<RoutingFault> fault(1);
    e_src.Upload(experts);
    g_src.Upload(gates);
    if (copy) {
      e_dev.Poison();
      g_dev.Poison();
    } else {
      e_dev.Upload(experts);
      g_dev.Upload(gates);
    }
    ASSERT_EQ(cudaMemset(worst.p, 0, sizeof(unsigned long long)), cudaSuccess);
    fault.Poison();
    for (int pass = 0; pass < 2; ++pass) {  // the second pass sees the rewritten routing: no fault, and the word was reset
      Dev<int64_t> zero(1);
      zero.Poison();
      const bool from = copy && pass == 0;
      ASSERT_TRUE(LaunchValidateRouting(e_dev.p, g_dev.p, c.n, c.K, static_cast<int32_t>(c.E), worst.p, fault.p, nullptr, zero.p,
                                        from ? e_src.p : nullptr, from && c.n > 0 ? g_src.p : nullptr)
                      .ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(zero.Download()[0], 0) << "pass " << pass;
      const RoutingFault got = fault.Download()[0];
      EXPECT_EQ(worst.Download()[0], 0ull) << "pass " << pass;
      if (pass == 1) {
        EXPECT_EQ(got.key, ~0ull) << "the rewritten routing is valid";
        continue;
      }
      ASSERT_EQ(got.key, want);
      if (want != ~0ull) {
        EXPECT_EQ(got.expert, experts[static_cast<size_t>(want >> 2)]);
        const float g = gates[static_cast<size_t>(want >> 2)];
        if (std::isnan(g)) EXPECT_TRUE(std::isnan(got.gate));
        else EXPECT_EQ(got.gate, g);
      }
      const std::vector<int32_t> e_after = e_dev.Download();
      const std::vector<float> g_after = g_dev.Download();
      for (int64_t t = 0; t < c.n; ++t)
        for (int64_t k = 0; k < c.K; ++k) {
          const auto i = static_cast<size_t>(t * c.K + k);
          if (faulty[static_cast<size_t>(t)]) {
            ASSERT_EQ(e_after[i], k) << "token " << t;
            ASSERT_EQ(g_after[i], 0.f) << "token " << t;
          } else {
            ASSERT_EQ(e_after[i], experts[i]) << "token " << t;
            ASSERT_EQ(std::memcmp(&g_after[i], &gates[i], 4), 0) << "token " << t;
          }
        }
      EXPECT_EQ(e_src.Download(), experts) << "the caller's experts are only read";
      const std::vector<float> g_src_after = g_src.Download();
      EXPECT_EQ(std::memcmp(g_src_after.data(), gates.data(), gates.size() * 4), 0) << "the caller's gates are only read";
    }
  }
}

TEST(RoutingCheck, RefusesOneSourceArrayWithoutTheOther) {
  int32_t e = 0;
  float g = 0;
  EXPECT_EQ(LaunchValidateRouting(&e, &g, 1, 1, 1, nullptr, nullptr, nullptr, nullptr, &e, nullptr).code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RoutingCheck,
    ::testing::Values(CheckCase{"empty", 0, 6, 64, {}}, CheckCase{"clean", 5000, 6, 64, {}},
                      CheckCase{"one_token", 1, 1, 4, {0}},
                      CheckCase{"faults_in_several_blocks", 5000, 6, 64, {4900, 3100, 777, 2048, 4999}},
                      CheckCase{"first_token_and_last", 1000, 8, 256, {999, 0}},
                      CheckCase{"K13", 700, 13, 40, {650, 300, 301}}),
    [](const ::testing::TestParamInfo<CheckCase>& i) { return i.param.name; });

// ---- counts per owner, tok_index, expert ranks, the load row -------------------------------------------

struct CountCase {
  std::string name;
  int64_t n, K, E, W;
  bool per_slot_targets;  // balancing's targets: a random destination rank (or -1) and local index per slot
  bool load_row;
  int64_t offset;  // expert ids this many ints past a 16-byte boundary
};
void PrintTo(const CountCase& c, std::ostream* os) { *os << c.name; }

class PhaseOneCounts : public ::testing::TestWithParam<CountCase> {};

TEST_P(PhaseOneCounts, MatchTheHostExactly) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const CountCase& c = GetParam();
  const int64_t L = (c.E + c.W - 1) / c.W + (c.per_slot_targets ? 3 : 0);  // contiguous owners; slots beside them
  RegionLayout l;
  l.W = c.W, l.L = L, l.S = 1, l.H = 8, l.T = std::max<int64_t>(c.n, 1), l.K = c.K, l.slots_per_token = c.K, l.elem_bytes = 2;
  l.E_load = c.load_row ? c.E : 0;
  std::vector<int32_t> experts;
  std::vector<float> gates;
  RandomRouting(c.n, c.K, c.E, 97 + static_cast<uint64_t>(c.n * c.K), experts, gates);
  std::vector<int32_t> owner(static_cast<size_t>(c.E)), local(static_cast<size_t>(c.E));
  const int64_t per = (c.E + c.W - 1) / c.W;
  for (int64_t e = 0; e < c.E; ++e) owner[static_cast<size_t>(e)] = static_cast<int32_t>(e / per), local[static_cast<size_t>(e)] = static_cast<int32_t>(e % per);
  std::vector<int32_t> dest_rank, dest_local;
  if (c.per_slot_targets) {
    Rng rng(5);
    for (size_t i = 0; i < experts.size(); ++i) {
      dest_rank.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.W + 1))) - 1);  // -1: dropped
      dest_local.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(L))));
    }
  }
  auto rank_of = [&](size_t i) { return c.per_slot_targets ? dest_rank[i] : owner[static_cast<size_t>(experts[i])]; };
  auto local_of = [&](size_t i) { return c.per_slot_targets ? dest_local[i] : local[static_cast<size_t>(experts[i])]; };
  // Host: positions per owner in token order, rows per (owner, local), tokens per owner, expert ranks, loads.
  std::vector<int32_t> want_tok(static_cast<size_t>(c.W * c.n), -1);
  std::vector<int64_t> want_rows(static_cast<size_t>(c.W * L), 0), want_tokens(static_cast<size_t>(c.W), 0);
  std::vector<int32_t> want_rank(experts.size(), 0);
  std::vector<int64_t> seen(static_cast<size_t>(c.E), 0), want_load(static_cast<size_t>(c.E), 0);
  for (int64_t t = 0; t < c.n; ++t) {
    for (int64_t q = 0; q < c.W; ++q) {
      bool sends = false;
      for (int64_t k = 0; k < c.K; ++k) {
        const auto i = static_cast<size_t>(t * c.K + k);
        if (rank_of(i) != q) continue;
        sends = true;
        ++want_rows[static_cast<size_t>(q * L + local_of(i))];
      }
      if (sends) want_tok[static_cast<size_t>(q * c.n + t)] = static_cast<int32_t>(want_tokens[static_cast<size_t>(q)]++);
    }
    for (int64_t k = 0; k < c.K; ++k) {
      const auto i = static_cast<size_t>(t * c.K + k);
      want_rank[i] = static_cast<int32_t>(seen[static_cast<size_t>(experts[i])]++);
      ++want_load[static_cast<size_t>(experts[i])];
    }
  }
  // Device inputs: the expert ids at the requested offset from a 16-byte boundary.
  Dev<int32_t> e_dev(experts.size() + 4), tok(static_cast<size_t>(c.W * c.n)), ranks(experts.size());
  std::vector<int32_t> shifted(experts.size() + 4, -7);
  std::copy(experts.begin(), experts.end(), shifted.begin() + c.offset);
  e_dev.Upload(shifted);
  const int32_t* e_ptr = e_dev.p + c.offset;
  Dev<int32_t> owner_dev(owner.size()), local_dev(local.size()), dr(std::max<size_t>(dest_rank.size(), 1)), dl(std::max<size_t>(dest_local.size(), 1));
  owner_dev.Upload(owner);
  local_dev.Upload(local);
  if (c.per_slot_targets) dr.Upload(dest_rank), dl.Upload(dest_local);
  const size_t words = l.control_bytes() / sizeof(int64_t);
  std::vector<std::unique_ptr<Dev<int64_t>>> control;
  std::vector<int64_t*> ptrs;
  for (int64_t q = 0; q < c.W; ++q) {
    control.push_back(std::make_unique<Dev<int64_t>>(words));
    control.back()->Poison();
    ptrs.push_back(control.back()->p);
  }
  Dev<int64_t*> control_of(ptrs.size());
  control_of.Upload(ptrs);
  tok.Poison();
  ranks.Poison();
  const OwnerMapView own{owner_dev.p, local_dev.p};
  const RouteTargets targets = c.per_slot_targets ? RouteTargets(own, dr.p, dl.p) : RouteTargets(own);
  const int32_t rank = static_cast<int32_t>(c.W - 1);
  Dev<int32_t> scratch(static_cast<size_t>(CountScratchInts(l, c.n)));
  scratch.Poison();
  ASSERT_TRUE(LaunchCountAndPublish(e_ptr, c.n, l, targets, rank, tok.p, control_of.p, scratch.p,
                                    static_cast<int64_t>(scratch.n), nullptr).ok());
  ASSERT_TRUE(LaunchExpertRank(e_ptr, c.n, c.K, static_cast<int32_t>(c.E), ranks.p, nullptr).ok());
  ASSERT_TRUE(LaunchPublishLoadRow(e_ptr, c.n, l, rank, control_of.p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(tok.Download(), want_tok);
  if (c.n > 0) {
    EXPECT_EQ(ranks.Download(), want_rank);
  }
  for (int64_t q = 0; q < c.W; ++q) {
    const std::vector<int64_t> got = control[static_cast<size_t>(q)]->Download();
    for (int64_t j = 0; j < L; ++j)
      ASSERT_EQ(got[static_cast<size_t>(l.recv_counts(rank, j))], want_rows[static_cast<size_t>(q * L + j)]) << "owner " << q << " local " << j;
    EXPECT_EQ(got[static_cast<size_t>(l.recv_tokens(rank))], want_tokens[static_cast<size_t>(q)]) << "owner " << q;
    for (int64_t e = 0; c.load_row && e < c.E; ++e)
      ASSERT_EQ(got[static_cast<size_t>(l.load(rank, e))], want_load[static_cast<size_t>(e)]) << "owner " << q << " expert " << e;
    for (int64_t s = 0; s < c.W; ++s) {  // another source's words are left alone (still poison)
      if (s == rank) continue;
      EXPECT_EQ(got[static_cast<size_t>(l.recv_tokens(s))], -1) << "owner " << q << " source " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PhaseOneCounts,
    ::testing::Values(CountCase{"empty", 0, 6, 64, 4, false, true, 0},
                      CountCase{"moonlight_W4", 4096, 6, 64, 4, false, true, 0},
                      CountCase{"many_tiles_W2", 9001, 6, 64, 2, false, false, 0},
                      CountCase{"dsv3_W4_unaligned", 5000, 8, 256, 4, false, true, 1},
                      CountCase{"K1_W1", 3000, 1, 8, 1, false, true, 3},
                      CountCase{"K13_W3", 2500, 13, 40, 3, false, false, 2},
                      CountCase{"per_slot_targets_W4", 6000, 6, 64, 4, true, false, 0},
                      CountCase{"per_slot_targets_W8_unaligned", 777, 8, 64, 8, true, true, 1}),
    [](const ::testing::TestParamInfo<CountCase>& i) { return i.param.name; });

// The launchers' refusals come before any CUDA call, so they run without a GPU (in CI too).
TEST(PhaseOneLimits, ShapesBeyondTheKernelsAreRefusedWithTheirNumbers) {
  RegionLayout l;
  l.W = 4, l.L = 16, l.S = 64, l.H = 8, l.T = 64, l.K = 6, l.slots_per_token = 6, l.elem_bytes = 2;
  EXPECT_TRUE(CheckKernelLimits(l).ok());
  RegionLayout wide = l;
  wide.L = kMaxExpandLocalExperts + 1;
  Status st = CheckKernelLimits(wide);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("L=5121"), std::string::npos) << st.message();
  wide.L = kMaxExpandLocalExperts;
  EXPECT_TRUE(CheckKernelLimits(wide).ok());
  RegionLayout deep = l;
  deep.K = 20000;
  st = CheckKernelLimits(deep);
  EXPECT_NE(st.message().find("K=20000"), std::string::npos) << st.message();
  // A count scratch smaller than n tokens need: refused, naming both.
  st = LaunchCountAndPublish(nullptr, 1000, l, RouteTargets(OwnerMapView{nullptr, nullptr}), 0, nullptr, nullptr, nullptr,
                             CountScratchInts(l, 1000) - 1, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("n=1000"), std::string::npos) << st.message();
  EXPECT_EQ(CountScratchInts(l, 1000), 4 * 4 * 17);  // ceil(1000/256) blocks of each of W owners, L + 1 words
  EXPECT_EQ(CountScratchInts(l, 0), 4 * 1 * 17);     // n = 0 still launches one block per owner
  // The expansion refuses more local experts than its offsets' shared memory holds.
  st = LaunchExpand(nullptr, 0, 0, l, nullptr, static_cast<int32_t>(kMaxExpandLocalExperts + 1), nullptr, nullptr, 0, nullptr, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("5121 local experts"), std::string::npos) << st.message();
  EXPECT_EQ(ExpandScratchInts(l, 16), 2 * 16);  // ceil(S/32) chunks of one word per expert
}

}  // namespace
}  // namespace rdep::dispatch
