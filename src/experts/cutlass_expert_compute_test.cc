// The CUTLASS expert compute (MakeCutlassExpertCompute) against the cuBLASLt one on the same inputs:
// h, y, dx (bf16) within ||a-b||/||b|| <= 1e-2 and dW1, dW2 (fp32 accumulate or overwrite, bf16
// overwrite) within 1e-2, over empty experts, a single row, one expert holding every row, row counts
// that are not tile multiples and the Moonlight expert shape; outputs poisoned first, rows past M
// untouched, empty experts' gradients zeroed on overwrite; counts above rows.max_rows compute nothing
// and the next call reports it; a forward and backward captured in a CUDA graph and replayed with new
// device counts equal eager calls bitwise. The grouped GEMM alone against a host reference.
// Errors are measured per expert (its rows of h, y, dx; its dW1, dW2 blocks), so one small expert
// computed wrong cannot hide in the norm of a large one.
// Skips, saying why, without a GPU, without CUTLASS in the build, or on a GPU other than sm_90;
// with RDEP_REQUIRE_CUTLASS=1 (scripts/device.sh sets it) a GPU without the compute fails instead.
//   build/src/experts/experts_test --gtest_filter='*CutlassExpertCompute*:*GroupedGemmSm90*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#if defined(RDEP_HAVE_CUTLASS)
#include "experts/grouped_gemm_sm90.h"
#endif
#include "experts/experts_test_util.h"
#include "rdep/core/random.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/experts/expert_compute.h"

namespace rdep::kernels {
namespace {

using test_util::AsDouble;
using test_util::Dev;
using test_util::ExpectPerExpert;
using test_util::MakeOrSkipReason;
using test_util::RandomBf16;
using test_util::RequireCutlass;

struct Case {
  std::string name;
  int64_t H, F;
  std::vector<int64_t> counts;
  bool accumulate = false;
  bool bf16_grads = false;
  std::string tile;  // every GEMM role on this tile ("" = the defaults)
};

// The CUTLASS backward again, on the forward's h restored, with dx written over dout (one buffer, as the
// layer's output rows): the same bits as with separate dx and dout buffers. Only the first M rows are dx.
void ExpectSameBitsWithDxOverDout(ExpertCompute& ec, const Case& c, const ExpertRows& rows, const ExpertWeightsView& w,
                                  Dev<uint16_t>& x, Dev<uint16_t>& h, Dev<uint16_t>& dout, const std::vector<uint16_t>& h_forward,
                                  const std::vector<uint16_t>& dx, const std::vector<float>& dw1, const std::vector<float>& dw2,
                                  const std::vector<uint16_t>& dw1_b, const std::vector<uint16_t>& dw2_b) {
  h.Upload(h_forward);
  Dev<uint16_t> io(dout.n), dw1b(dw1_b.size()), dw2b(dw2_b.size());
  io.Upload(dout.Download());
  Dev<float> g1(dw1.size()), g2(dw2.size());
  if (c.accumulate) {
    g1.Upload(std::vector<float>(dw1.size(), 0.25f));  // CompareWithCublasLt's starting values
    g2.Upload(std::vector<float>(dw2.size(), -0.5f));
  } else {
    for (auto* d : {&g1, &g2}) d->Poison();
    for (auto* d : {&dw1b, &dw2b}) d->Poison();
  }
  const ExpertGradsView g = c.bf16_grads ? ExpertGradsView{nullptr, nullptr, dw1b.bf(), dw2b.bf()} : ExpertGradsView{g1.p, g2.p};
  const Status b = ec.Backward(rows, x.bf(), h.bf(), io.bf(), w, io.bf(), g, c.accumulate, nullptr);
  ASSERT_TRUE(b.ok()) << b;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> got = io.Download();
  const auto n = static_cast<size_t>(rows.max_rows * c.H);
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(n), dx.begin())) << "dx over dout differs";
  if (c.bf16_grads) {
    EXPECT_EQ(dw1b.Download(), dw1_b) << "dW1 (bf16) with dx over dout";
    EXPECT_EQ(dw2b.Download(), dw2_b) << "dW2 (bf16) with dx over dout";
  } else {
    EXPECT_EQ(g1.Download(), dw1) << "dW1 with dx over dout";
    EXPECT_EQ(g2.Download(), dw2) << "dW2 with dx over dout";
  }
}

// Forward and backward with both implementations on the same inputs.
void CompareWithCublasLt(const Case& c) {
  const int64_t E = static_cast<int64_t>(c.counts.size()), H = c.H, F = c.F, pad = 5;
  const int64_t M = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
  const auto h_n = static_cast<size_t>(M * 2 * F), y_n = static_cast<size_t>(M * H);
  const ExpertMlpDesc desc{E, H, F, M + pad};
  std::string skip;
  auto cut = MakeOrSkipReason(desc, &skip, {c.tile, c.tile, c.tile, c.tile, c.tile, c.tile});
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_TRUE((*cut)->graph_safe());
  auto lt = MakeCublasLtExpertCompute(desc, 0);
  ASSERT_TRUE(lt.ok()) << lt.status();
  Dev<int64_t> dcounts(static_cast<size_t>(E));
  dcounts.Upload(c.counts);
  Dev<uint16_t> x(static_cast<size_t>((M + pad) * H)), w1(static_cast<size_t>(E * H * 2 * F)), w2(static_cast<size_t>(E * F * H));
  Dev<uint16_t> dout(x.n);
  x.Upload(RandomBf16(x.n, 1, 1.f));
  w1.Upload(RandomBf16(w1.n, 2, 1.f / std::sqrt(static_cast<float>(H))));
  w2.Upload(RandomBf16(w2.n, 3, 1.f / std::sqrt(static_cast<float>(F))));
  dout.Upload(RandomBf16(dout.n, 4, 1.f));
  const std::vector<float> dw1_start(w1.n, 0.25f), dw2_start(w2.n, -0.5f);  // what accumulate adds to
  struct Out {
    std::vector<uint16_t> h, y, dx, dw1_b, dw2_b;
    std::vector<float> dw1, dw2;
  } got[2];
  ExpertCompute* impl[2] = {lt->get(), cut->get()};
  for (int k = 0; k < 2; ++k) {
    Dev<uint16_t> h(static_cast<size_t>((M + pad) * 2 * F)), y(x.n), dx(x.n), dw1b(w1.n), dw2b(w2.n);
    Dev<float> dw1(w1.n), dw2(w2.n);
    for (auto* d : {&h, &y, &dx, &dw1b, &dw2b}) d->Poison();
    if (c.accumulate) {
      dw1.Upload(dw1_start);
      dw2.Upload(dw2_start);
    } else {
      dw1.Poison();
      dw2.Poison();
    }
    const ExpertRows rows{dcounts.p, M, k == 0 ? c.counts.data() : nullptr};  // the CUTLASS one reads device counts only
    const ExpertWeightsView w{w1.bf(), w2.bf()};
    const ExpertGradsView g = c.bf16_grads ? ExpertGradsView{nullptr, nullptr, dw1b.bf(), dw2b.bf()} : ExpertGradsView{dw1.p, dw2.p};
    ASSERT_TRUE(impl[k]->Forward(rows, x.bf(), w, h.bf(), y.bf(), nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << impl[k]->name();
    const std::vector<uint16_t> h_forward = h.Download();  // Backward consumes h (the CUTLASS one writes dh there)
    Status b = impl[k]->Backward(rows, x.bf(), h.bf(), dout.bf(), w, dx.bf(), g, c.accumulate, nullptr);
    ASSERT_TRUE(b.ok()) << impl[k]->name() << ": " << b;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << impl[k]->name();
    got[k] = {h_forward, y.Download(), dx.Download(), dw1b.Download(), dw2b.Download(), dw1.Download(), dw2.Download()};
    for (int64_t i = M * H; i < (M + pad) * H; ++i) {
      ASSERT_EQ(got[k].y[static_cast<size_t>(i)], 0xFFFF) << impl[k]->name() << ": y row past M written";
      ASSERT_EQ(got[k].dx[static_cast<size_t>(i)], 0xFFFF) << impl[k]->name() << ": dx row past M written";
    }
    EXPECT_EQ(impl[k]->dx_may_alias_dout(), k == 1) << impl[k]->name();
    if (k == 1) ExpectSameBitsWithDxOverDout(*impl[k], c, rows, w, x, h, dout, h_forward, got[k].dx, got[k].dw1, got[k].dw2, got[k].dw1_b,
                                             got[k].dw2_b);
  }
  const auto& n = c.counts;
  ExpectPerExpert(AsDouble(got[1].h, h_n), AsDouble(got[0].h, h_n), n, 2 * F, true, "h");
  ExpectPerExpert(AsDouble(got[1].y, y_n), AsDouble(got[0].y, y_n), n, H, true, "y");
  ExpectPerExpert(AsDouble(got[1].dx, y_n), AsDouble(got[0].dx, y_n), n, H, true, "dx");
  if (c.bf16_grads) {
    ExpectPerExpert(AsDouble(got[1].dw1_b, w1.n), AsDouble(got[0].dw1_b, w1.n), n, H * 2 * F, false, "dW1 (bf16)");
    ExpectPerExpert(AsDouble(got[1].dw2_b, w2.n), AsDouble(got[0].dw2_b, w2.n), n, F * H, false, "dW2 (bf16)");
  } else {
    ExpectPerExpert(AsDouble(got[1].dw1, w1.n), AsDouble(got[0].dw1, w1.n), n, H * 2 * F, false, "dW1");
    ExpectPerExpert(AsDouble(got[1].dw2, w2.n), AsDouble(got[0].dw2, w2.n), n, F * H, false, "dW2");
  }
  // An empty expert's gradient: zero when overwritten, unchanged when accumulated.
  for (size_t e = 0; e < c.counts.size(); ++e) {
    if (c.counts[e] != 0) continue;
    const size_t at = e * static_cast<size_t>(H * 2 * F);
    if (c.bf16_grads) EXPECT_EQ(got[1].dw1_b[at], 0) << "expert " << e;
    else EXPECT_EQ(got[1].dw1[at], c.accumulate ? 0.25f : 0.f) << "expert " << e;
  }
}

class CutlassExpertCompute : public ::testing::TestWithParam<Case> {};

TEST_P(CutlassExpertCompute, MatchesCublasLt) { CompareWithCublasLt(GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    Cuda_bf16, CutlassExpertCompute,
    ::testing::Values(Case{"E5_H64_F48_empty_single_uneven", 64, 48, {37, 0, 1, 0, 90}, false, false, ""},
                      Case{"E4_one_expert_holds_every_row", 128, 64, {0, 0, 300, 0}, false, false, ""},
                      Case{"E3_not_tile_multiples_accumulate", 256, 136, {129, 255, 7}, true, false, ""},
                      Case{"E6_bf16_gradients", 128, 96, {64, 0, 200, 3, 0, 128}, false, true, ""},
                      Case{"E16_moonlight_expert", 2048, 1408, {384, 0, 512, 130, 768, 1, 256, 640, 96, 384, 0, 1024, 33, 512, 300, 200}, false, false, ""}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Every tile configuration built, on empty experts, counts that are not tile multiples (under and over
// one tile), fp32 accumulation and bf16 gradients.
std::vector<Case> TileCases() {
  std::vector<Case> cases;
  for (const std::string& t : CutlassTileNames()) {
    cases.push_back({t + "_accumulate", 256, 136, {129, 0, 255, 7, 300, 0}, true, false, t});
    cases.push_back({t + "_bf16_gradients", 128, 96, {64, 0, 200, 3, 0, 385}, false, true, t});
  }
  if (cases.empty()) cases.push_back({"no_cutlass_build", 64, 48, {1}, false, false, ""});  // skips without CUTLASS
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Tiles_bf16, CutlassExpertCompute, ::testing::ValuesIn(TileCases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(CutlassExpertCompute_TileNames, UnknownTileIsInvalidArgumentNamingTheRole) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto ec = MakeCutlassExpertCompute({2, 64, 48, 16}, 0, {"", "", "", "coop_64x64", "", ""});
  if (!ec.ok() && ec.status().code() == StatusCode::kUnavailable && !RequireCutlass()) GTEST_SKIP() << ec.status();
  ASSERT_FALSE(ec.ok());
  EXPECT_EQ(ec.status().code(), StatusCode::kInvalidArgument) << ec.status();
  EXPECT_NE(ec.status().message().find("tiles.dgrad_x"), std::string::npos) << ec.status();
  EXPECT_NE(ec.status().message().find("coop_64x64"), std::string::npos) << ec.status();
}

TEST(CutlassExpertCompute_Faults, CountsAboveMaxRowsComputeNothingAndAreReported) {
  const int64_t E = 2, H = 64, F = 32;
  std::string skip;
  auto ec = MakeOrSkipReason({E, H, F, 64}, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(ec.ok()) << ec.status();
  Dev<int64_t> counts(2);
  counts.Upload({40, 30});  // 70 rows, the call allows 64
  Dev<uint16_t> x(64 * H), w1(E * H * 2 * F), w2(E * F * H), h(64 * 2 * F), y(64 * H);
  x.Upload(RandomBf16(x.n, 1, 1.f));
  w1.Upload(RandomBf16(w1.n, 2, 0.1f));
  w2.Upload(RandomBf16(w2.n, 3, 0.1f));
  y.Poison();
  ASSERT_TRUE((*ec)->Forward({counts.p, 64, nullptr}, x.bf(), {w1.bf(), w2.bf()}, h.bf(), y.bf(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (uint16_t v : y.Download()) ASSERT_EQ(v, 0xFFFF) << "an overflowing call wrote its output";
  counts.Upload({10, 20});
  const Status next = (*ec)->Forward({counts.p, 64, nullptr}, x.bf(), {w1.bf(), w2.bf()}, h.bf(), y.bf(), nullptr);
  EXPECT_EQ(next.code(), StatusCode::kFailedPrecondition) << next;
  EXPECT_NE(next.message().find("summed to 70 rows"), std::string::npos) << next;
  EXPECT_TRUE((*ec)->Forward({counts.p, 64, nullptr}, x.bf(), {w1.bf(), w2.bf()}, h.bf(), y.bf(), nullptr).ok())
      << "the fault is reported once";
  // An overflowing backward in overwrite mode leaves the gradients as they were too (no expert's is
  // zeroed as if it were empty).
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Dev<uint16_t> dout(64 * H), dx(64 * H);
  Dev<float> dw1(w1.n), dw2(w2.n);
  dout.Upload(RandomBf16(dout.n, 4, 1.f));
  for (auto* d : {&dw1, &dw2}) d->Poison();
  dx.Poison();
  counts.Upload({64, 1});
  ASSERT_TRUE((*ec)->Backward({counts.p, 64, nullptr}, x.bf(), h.bf(), dout.bf(), {w1.bf(), w2.bf()}, dx.bf(), {dw1.p, dw2.p}, false,
                              nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (uint16_t v : dx.Download()) ASSERT_EQ(v, 0xFFFF) << "an overflowing backward wrote dx";
  for (const auto* d : {&dw1, &dw2})
    for (float v : d->Download()) ASSERT_TRUE(std::isnan(v)) << "an overflowing backward wrote a weight gradient: " << v;
  counts.Upload({10, 20});
  const Status after = (*ec)->Forward({counts.p, 64, nullptr}, x.bf(), {w1.bf(), w2.bf()}, h.bf(), y.bf(), nullptr);
  EXPECT_NE(after.message().find("summed to 65 rows"), std::string::npos) << after;
}

// Forward + backward captured once, replayed after the device counts and inputs changed in place:
// bitwise the eager results for the new counts.
TEST(CutlassExpertCompute_Graph, CapturedAndReplayedWithNewCountsEqualsEager) {
  const int64_t E = 4, H = 128, F = 64, max_rows = 512;
  std::string skip;
  auto ec = MakeOrSkipReason({E, H, F, max_rows}, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(ec.ok()) << ec.status();
  Dev<int64_t> counts(static_cast<size_t>(E));
  Dev<uint16_t> x(max_rows * H), w1(E * H * 2 * F), w2(E * F * H), dout(max_rows * H), h(max_rows * 2 * F), y(max_rows * H),
      dx(max_rows * H);
  Dev<float> dw1(w1.n), dw2(w2.n);
  w1.Upload(RandomBf16(w1.n, 2, 0.1f));
  w2.Upload(RandomBf16(w2.n, 3, 0.1f));
  const ExpertRows rows{counts.p, max_rows, nullptr};
  const ExpertWeightsView w{w1.bf(), w2.bf()};
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  auto step = [&]() -> Status {
    RDEP_RETURN_IF_ERROR((*ec)->Forward(rows, x.bf(), w, h.bf(), y.bf(), s));
    return (*ec)->Backward(rows, x.bf(), h.bf(), dout.bf(), w, dx.bf(), {dw1.p, dw2.p}, false, s);
  };
  auto load = [&](std::vector<int64_t> c, uint64_t seed) {
    counts.Upload(c);
    x.Upload(RandomBf16(x.n, seed, 1.f));
    dout.Upload(RandomBf16(dout.n, seed + 1, 1.f));
  };
  load({100, 0, 37, 200}, 10);
  ASSERT_TRUE(step().ok());  // warm (first-call initialization outside the capture)
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status captured = step();
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_TRUE(captured.ok()) << captured;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  load({3, 300, 0, 150}, 20);  // new counts and data in the same buffers
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const auto y_graph = y.Download(), dx_graph = dx.Download();
  const auto dw1_graph = dw1.Download();
  ASSERT_TRUE(step().ok());
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(y_graph, y.Download());
  EXPECT_EQ(dx_graph, dx.Download());
  EXPECT_EQ(dw1_graph, dw1.Download());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

#if defined(RDEP_HAVE_CUTLASS)
// One grouped GEMM's tables as its caller fills them (grouped_gemm_sm90.h): a group at a time, then uploaded.
struct GemmTables {
  std::vector<internal::GemmProblem> problems;
  std::vector<const void*> a, b;
  std::vector<void*> d;
  void Add(internal::GemmProblem p, const void* pa, const void* pb, void* pd) {
    problems.push_back(p);
    a.push_back(pa);
    b.push_back(pb);
    d.push_back(pd);
  }
  void Upload(internal::GroupedGemmSm90& g) const {
    ASSERT_EQ(cudaMemcpy(g.problems(), problems.data(), problems.size() * sizeof(problems[0]), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(g.ptr_a(), a.data(), a.size() * sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(g.ptr_b(), b.data(), b.size() * sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(g.ptr_d(), d.data(), d.size() * sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
  }
};

// The grouped GEMM alone (kind NN) against a host fp32-accumulated reference of the bf16 inputs, with
// groups of 0, 1 and uneven rows.
TEST(GroupedGemmSm90, NNMatchesHostReference) {
  std::string why;
  if (!internal::GroupedGemmSm90Available(0, &why)) {
    if (RequireCutlass() && cuda::DeviceCount() > 0) ADD_FAILURE() << "RDEP_REQUIRE_CUTLASS=1 but " << why;
    GTEST_SKIP() << why;
  }
  const int64_t K = 96, N = 72;
  const std::vector<int32_t> m = {5, 0, 130, 1};
  const int64_t M = std::accumulate(m.begin(), m.end(), int64_t{0}), G = static_cast<int64_t>(m.size());
  auto gemm = internal::GroupedGemmSm90::Create(internal::GroupedGemmKind::kNN, static_cast<int32_t>(G), K, N, N, 0);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  Dev<uint16_t> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(G * K * N)), d(static_cast<size_t>(M * N));
  const auto ha = RandomBf16(a.n, 7, 1.f), hb = RandomBf16(b.n, 8, 1.f);
  a.Upload(ha);
  b.Upload(hb);
  d.Poison();
  GemmTables t;
  int64_t off = 0;
  for (int64_t g = 0; g < G; ++g) {
    t.Add({m[static_cast<size_t>(g)], static_cast<int32_t>(N), static_cast<int32_t>(K)}, a.p + off * K, b.p + g * K * N, d.p + off * N);
    off += m[static_cast<size_t>(g)];
  }
  t.Upload(**gemm);
  ASSERT_TRUE((*gemm)->Run(0.f, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = d.Download();
  off = 0;
  double worst = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < m[static_cast<size_t>(g)]; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k)
          ref += static_cast<double>(Bf16BitsToFloat(ha[static_cast<size_t>((off + i) * K + k)])) *
                 Bf16BitsToFloat(hb[static_cast<size_t>(g * K * N + k * N + j)]);
        const double v = Bf16BitsToFloat(got[static_cast<size_t>((off + i) * N + j)]);
        worst = std::max(worst, std::abs(v - ref) / (1.0 + std::abs(ref)));
      }
    off += m[static_cast<size_t>(g)];
  }
  EXPECT_LE(worst, 1e-2) << "max |d - ref| / (1 + |ref|)";  // bf16 output rounding: 2^-8 relative
}

// Every group's TMA descriptors built before the launch (GroupedGemmMaps::kPrebuilt) against CUTLASS's rewritten in
// the kernel: the same bits, for the row GEMMs (NN, NT: groups of 0, 1 and uneven rows, past one tile) and the weight
// gradient (TN into fp32, its K the group's rows; overwritten, then added to), cooperative and pingpong tiles. One
// object per variant runs over two sets of tables in turn (groups going from 0 rows to some and back) in one stream's
// order, reading the results only at the end: each Run's descriptors follow the tables as they are then.
class GroupedGemmSm90Maps : public ::testing::TestWithParam<std::tuple<internal::GroupedGemmKind, internal::GroupedGemmTile>> {};

TEST_P(GroupedGemmSm90Maps, PrebuiltGivesTheSameBitsAsInKernel) {
  std::string why;
  if (!internal::GroupedGemmSm90Available(0, &why)) {
    if (RequireCutlass() && cuda::DeviceCount() > 0) ADD_FAILURE() << "RDEP_REQUIRE_CUTLASS=1 but " << why;
    GTEST_SKIP() << why;
  }
  const auto [kind, tile] = GetParam();
  const bool wgrad = kind == internal::GroupedGemmKind::kTN_F32;
  const int64_t P = 96, Q = 72;  // row GEMMs: K = P, N = Q; weight gradient: M = P, N = Q, K = the group's rows
  const std::vector<std::vector<int32_t>> sets = {{5, 0, 130, 1, 257}, {0, 300, 64, 0, 3}};
  const int64_t G = 5, M_max = 400;
  Dev<uint16_t> a(static_cast<size_t>(M_max * P)), b(static_cast<size_t>(wgrad ? M_max * Q : G * P * Q));
  a.Upload(RandomBf16(a.n, 11, 1.f));
  b.Upload(RandomBf16(b.n, 12, 1.f));
  const size_t d_bytes = static_cast<size_t>(wgrad ? G * P * Q * 4 : M_max * Q * 2);
  std::vector<unsigned char> got[2][2];  // [variant][set]
  const internal::GroupedGemmMaps modes[2] = {internal::GroupedGemmMaps::kInKernel, internal::GroupedGemmMaps::kPrebuilt};
  for (int k = 0; k < 2; ++k) {
    // A [rows][P] (row GEMMs: M x K; TN: K x M); B [P][Q], NT's [Q][P], TN's [rows][Q]; D rows of Q.
    const int64_t ldb = kind == internal::GroupedGemmKind::kNT ? P : Q;
    auto gemm = internal::GroupedGemmSm90::Create(kind, static_cast<int32_t>(G), P, ldb, Q, 0, tile, &modes[k]);
    ASSERT_TRUE(gemm.ok()) << gemm.status();
    ASSERT_EQ((*gemm)->maps(), modes[k]);
    Dev<unsigned char> d0(d_bytes), d1(d_bytes);
    Dev<unsigned char>* ds[2] = {&d0, &d1};
    for (size_t si = 0; si < sets.size(); ++si) {
      ds[si]->Poison();
      GemmTables t;
      int64_t off = 0;
      for (int64_t g = 0; g < G; ++g) {
        const int32_t m = sets[si][static_cast<size_t>(g)];
        if (wgrad)
          t.Add({m == 0 ? 0 : static_cast<int32_t>(P), static_cast<int32_t>(Q), m}, a.p + off * P, b.p + off * Q,
                ds[si]->p + static_cast<size_t>(g * P * Q * 4));
        else
          t.Add({m, static_cast<int32_t>(Q), static_cast<int32_t>(P)}, a.p + off * P, b.p + g * P * Q,
                ds[si]->p + static_cast<size_t>(off * Q * 2));
        off += m;
      }
      t.Upload(**gemm);  // in the legacy stream's order, after the previous set's Runs
      ASSERT_TRUE((*gemm)->Run(0.f, nullptr).ok());
      if (wgrad) {
        ASSERT_TRUE((*gemm)->Run(1.f, nullptr).ok());  // adds the same product: D = 2 x the product
      }
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t si = 0; si < sets.size(); ++si) got[k][si] = ds[si]->Download();
  }
  for (size_t si = 0; si < sets.size(); ++si) {
    EXPECT_EQ(got[0][si], got[1][si]) << internal::GroupedGemmKindName(kind) << " " << internal::GroupedGemmTileName(tile)
                                      << ", row set " << si;
    const int64_t rows = std::accumulate(sets[si].begin(), sets[si].end(), int64_t{0});
    const size_t want = static_cast<size_t>(wgrad ? std::count_if(sets[si].begin(), sets[si].end(), [](int32_t m) { return m > 0; }) * P * Q * 4
                                                  : rows * Q * 2);
    size_t written = 0;  // the product was written where it should be (the poison is 0xFF bytes)
    for (unsigned char byte : got[1][si]) written += byte != 0xFF;
    EXPECT_GT(written, want * 9 / 10) << "row set " << si << ": D written";
    EXPECT_LE(written, want) << "row set " << si << ": nothing past the groups' rows";
  }
}

std::string MapsCaseName(const ::testing::TestParamInfo<GroupedGemmSm90Maps::ParamType>& info) {
  const char* kind_names[] = {"NN", "NT", "TN_F32", "TN_BF16", "NN_SwiGLU"};
  return std::string(kind_names[static_cast<int>(std::get<0>(info.param))]) + "_" +
         internal::GroupedGemmTileName(std::get<1>(info.param));
}
INSTANTIATE_TEST_SUITE_P(Kinds, GroupedGemmSm90Maps,
                         ::testing::Combine(::testing::Values(internal::GroupedGemmKind::kNN, internal::GroupedGemmKind::kNT,
                                                              internal::GroupedGemmKind::kTN_F32),
                                            ::testing::Values(internal::GroupedGemmTile::kCoop128x256,
                                                              internal::GroupedGemmTile::kPing128x128C2x1)),
                         MapsCaseName);
#endif  // RDEP_HAVE_CUTLASS

}  // namespace
}  // namespace rdep::kernels
