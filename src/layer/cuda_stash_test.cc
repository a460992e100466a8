// The paged stash (LayerConfig::stash_rows): the sync-free layer's saved owner rows in pages of a pool
// shared by a domain's layers, moved there at the end of forward and back at the start of backward.
// Bitwise equal to the layer without it (the moves are copies): W = 1 and W = 4 ranks sharing the GPUs
// present, dropless and with capacity drops, in several segments, with owner_reduce; three layers in
// flight at once (forward all, backward in reverse) sharing one pool; a pool too small for a forward
// (its output still right, every rank's backward failing alike naming ranks, rows and pool with NaN
// outputs, the next step on the same pool exact; a layer that fits, forward and backward between the
// overflowing layer's, unaffected); a context's pages given back by ReleaseRows and by freeing the context; refusals
// (config, capture of a forward or of a backward); the free list wrapping with pages given back out of
// order. Skips without a GPU, CUTLASS or sm_90. The config checks run everywhere.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include <string>

#include "rdep/layer/layer_config.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/device_count.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"
#endif

namespace rdep {
namespace {

LayerConfig StashConfig(int64_t stash_rows) {
  LayerConfig c = MakeLayerConfig({.tokens = 64, .hidden = 128, .ffn = 64, .experts = 8, .topk = 2, .ranks = 4});
  c.expert_compute = ExpertComputeKind::kCutlass;
  c.stash_rows = stash_rows;
  return c;
}

TEST(StashConfig, NegativeRowsAreRefusedNamingTheField) {
  const Status s = StashConfig(-1).Validate();
  ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("stash_rows: -1"), std::string::npos) << s;
}

TEST(StashConfig, NeedsTheSyncFreeLayer) {
  EXPECT_TRUE(StashConfig(4096).Validate().ok());
  LayerConfig lt = StashConfig(4096);
  lt.expert_compute = ExpertComputeKind::kCublasLt;
  Status s = lt.Validate();
  ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expert_compute cublaslt"), std::string::npos) << s;
  LayerConfig two = StashConfig(4096);
  two.nodes.nodes = 2;
  s = two.Validate();
  ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("stash_rows"), std::string::npos) << s;
  LayerConfig off = StashConfig(0);
  off.expert_compute = ExpertComputeKind::kCublasLt;
  EXPECT_TRUE(off.Validate().ok()) << "0 is off, with any compute";
}

#if defined(RDEP_HAVE_CUDA)

struct Problem : SmallProblem {  // weights and activations from one seed
  Problem(int32_t W, const char* spec, uint64_t seed) : SmallProblem(W, spec, seed, seed + 2) {}
};

struct Setting {
  int64_t stash_rows = 0;
  double capacity = 0;
  int64_t segment = 0;
  bool owner_reduce = false;
  bool overlap = false;  // LayerConfig::overlap_segments (needs segment below W*T)
};

// Per rank: y, dx, dgates, dW1, dW2 and the backward's status.
struct Outputs {
  std::vector<std::vector<uint16_t>> y, dx;
  std::vector<std::vector<float>> dg, dw1, dw2;
  std::vector<Status> backward;
  explicit Outputs(size_t W) : y(W), dx(W), dg(W), dw1(W), dw2(W), backward(W) {}
};

StatusOr<std::unique_ptr<CudaDomain>> MakeDomain(int32_t W) {
  return CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(W, std::min(W, cuda::DeviceCount()))});
}

LayerConfig ConfigOf(const Problem& p, const Setting& set) {
  LayerConfig cfg = MakeLayerConfig(p.shape, {.capacity_factor = set.capacity});
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.segment_tokens = set.segment;
  cfg.owner_reduce = set.owner_reduce;
  cfg.stash_rows = set.stash_rows;
  cfg.overlap_segments = set.overlap;
  return cfg;
}

Status Collect(CudaMoELayer& layer, const Problem& p, const Batch& b, int32_t r, Outputs& out) {
  const auto i = static_cast<size_t>(r);
  const int64_t H = p.shape.hidden, F = p.shape.ffn;
  RDEP_ASSIGN_OR_RETURN(out.y[i], Download(reinterpret_cast<const uint16_t*>(b.y), static_cast<size_t>(b.n * H)));
  RDEP_ASSIGN_OR_RETURN(out.dx[i], Download(reinterpret_cast<const uint16_t*>(b.dx), static_cast<size_t>(b.n * H)));
  RDEP_ASSIGN_OR_RETURN(out.dg[i], Download(b.dg, static_cast<size_t>(b.n * p.shape.topk)));
  const auto L = static_cast<size_t>(p.own.num_local(r));
  RDEP_ASSIGN_OR_RETURN(out.dw1[i], Download(layer.dw1(r), L * static_cast<size_t>(H * 2 * F)));
  RDEP_ASSIGN_OR_RETURN(out.dw2[i], Download(layer.dw2(r), L * static_cast<size_t>(F * H)));
  return Status::Ok();
}

// One layer, forward then backward on every rank; each rank's backward status kept, not returned.
Outputs RunOne(const Problem& p, const Setting& set) {
  const auto W = static_cast<size_t>(p.shape.ranks);
  Outputs out(W);
  auto domain = MakeDomain(static_cast<int32_t>(p.shape.ranks));
  EXPECT_TRUE(domain.ok()) << domain.status();
  if (!domain.ok()) return out;
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(p, set), p.own, p.w);
  EXPECT_TRUE(layer.ok()) << layer.status();
  if (!layer.ok()) return out;
  const Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[i], p.x[i], p.dy[i], p.shape.hidden, b));
    RDEP_RETURN_IF_ERROR((*layer)->Forward(r, b.e, b.g, b.n, b.x, b.y));
    out.backward[i] = (*layer)->Backward(r, b.dy, b.dx, b.dg);
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    return Collect(**layer, p, b, r, out);
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

void ExpectSame(const Outputs& a, const Outputs& b, const std::string& what) {
  for (size_t i = 0; i < a.y.size(); ++i) {
    EXPECT_EQ(a.y[i], b.y[i]) << what << ": y, rank " << i;
    EXPECT_EQ(a.dx[i], b.dx[i]) << what << ": dx, rank " << i;
    EXPECT_EQ(a.dg[i], b.dg[i]) << what << ": dgates, rank " << i;
    EXPECT_EQ(a.dw1[i], b.dw1[i]) << what << ": dW1, rank " << i;
    EXPECT_EQ(a.dw2[i], b.dw2[i]) << what << ": dW2, rank " << i;
  }
}

class CudaStash : public ::testing::TestWithParam<std::tuple<int32_t, Setting>> {};

TEST_P(CudaStash, BitwiseTheLayerWithoutIt) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  const auto [W, set] = GetParam();
  Problem p(W, "zipf:1.2", 7);
  Setting off = set;
  off.stash_rows = 0;
  const Outputs with = RunOne(p, set), without = RunOne(p, off);
  for (size_t i = 0; i < with.backward.size(); ++i) EXPECT_TRUE(with.backward[i].ok()) << "rank " << i << ": " << with.backward[i];
  ExpectSame(with, without, "stash on vs off");
}

// The pool: the rows a forward can bring to one owner (W*T*K), so nothing overflows; in segments each
// segment's rows round up to whole pages (S = 24: 11 segments of <= 48 rows, S = 40: 7 of <= 80).
INSTANTIATE_TEST_SUITE_P(Cuda_bf16, CudaStash,
                         ::testing::Values(std::tuple{1, Setting{.stash_rows = 128}}, std::tuple{4, Setting{.stash_rows = 512}},
                                           std::tuple{4, Setting{.stash_rows = 512, .capacity = 0.8}},
                                           std::tuple{4, Setting{.stash_rows = 1024, .segment = 24}},
                                           std::tuple{4, Setting{.stash_rows = 1024, .segment = 40, .owner_reduce = true}}),
                         [](const ::testing::TestParamInfo<std::tuple<int32_t, Setting>>& i) {
                           const Setting& s = std::get<1>(i.param);
                           return "W" + std::to_string(std::get<0>(i.param)) + (s.capacity > 0 ? "_capacity_drops" : "") +
                                  (s.segment > 0 ? "_S" + std::to_string(s.segment) : "") + (s.owner_reduce ? "_owner_reduce" : "");
                         });

// Three layers of one shape on a domain, one pool: forward A, B, C, then backward C, B, A, so that all
// three contexts hold pages at once and the transient rows serve each in turn. Each equals its layer
// alone without a stash, bitwise; the domain holds the pool once, and each layer's own context holds
// no owner rows.
TEST(CudaStash_Stack, W4_ThreeLayersInFlightShareOnePool) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  const std::vector<Problem> ps = {Problem(4, "zipf:1.2", 3), Problem(4, "uniform", 11), Problem(4, "zipf:2", 19)};
  std::vector<Outputs> alone;
  for (const Problem& p : ps) alone.push_back(RunOne(p, Setting{}));
  auto domain = MakeDomain(4);
  ASSERT_TRUE(domain.ok()) << domain.status();
  std::vector<std::unique_ptr<CudaMoELayer>> layers, plain;
  for (const Problem& p : ps) {
    auto l = CudaMoELayer::Create(**domain, ConfigOf(p, Setting{.stash_rows = 3 * 512}), p.own, p.w);
    ASSERT_TRUE(l.ok()) << l.status();
    layers.push_back(std::move(*l));
  }
  const size_t one_stash = layers[0]->stash_bytes();
  ASSERT_GT(one_stash, 0u);
  EXPECT_EQ((*domain)->shared_bytes_per_rank(), layers[0]->shared_bytes()) << "three layers of one shape: one pool, one transient";
  std::vector<Outputs> stacked(3, Outputs(4));
  const Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    std::vector<Batch> b(3);
    for (size_t l = 0; l < 3; ++l) RDEP_RETURN_IF_ERROR(Upload(ps[l].routing[i], ps[l].x[i], ps[l].dy[i], ps[l].shape.hidden, b[l]));
    for (size_t l = 0; l < 3; ++l) RDEP_RETURN_IF_ERROR(layers[l]->Forward(r, b[l].e, b[l].g, b[l].n, b[l].x, b[l].y));
    for (size_t l = 3; l-- > 0;) RDEP_RETURN_IF_ERROR(layers[l]->Backward(r, b[l].dy, b[l].dx, b[l].dg));
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    for (size_t l = 0; l < 3; ++l) RDEP_RETURN_IF_ERROR(Collect(*layers[l], ps[l], b[l], r, stacked[l]));
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (size_t l = 0; l < 3; ++l) ExpectSame(stacked[l], alone[l], "layer " + std::to_string(l));
  // The same layer without a stash: its own context holds the worst case of x and h rows (W*T*K rows
  // of H + 2F bf16 values), which the stashed layer's context does not.
  auto lone = MakeDomain(4);
  ASSERT_TRUE(lone.ok());
  auto unstashed = CudaMoELayer::Create(**lone, ConfigOf(ps[0], Setting{}), ps[0].own, ps[0].w);
  ASSERT_TRUE(unstashed.ok()) << unstashed.status();
  const Status run = (*lone)->Run([&](int32_t r) -> Status {
    Batch b;
    const auto i = static_cast<size_t>(r);
    RDEP_RETURN_IF_ERROR(Upload(ps[0].routing[i], ps[0].x[i], ps[0].dy[i], ps[0].shape.hidden, b));
    RDEP_RETURN_IF_ERROR((*unstashed)->Forward(r, b.e, b.g, b.n, b.x, b.y));
    return (*lone)->Synchronize(r);
  });
  ASSERT_TRUE(run.ok()) << run;
  const size_t worst_rows = 4 * 64 * 2 * (128 + 2 * 64) * 2;  // W*T*K rows of x [H] and h [2F], bf16
  const size_t page_table = 8 * 4 + 2 * 8;                     // 8 pages of 64 rows, and the state words
  EXPECT_EQ((*unstashed)->device_bytes(0) - layers[0]->device_bytes(0), worst_rows - page_table)
      << "the stashed layer's context holds a page table instead of the worst case's owner rows";
}

// A pool of 3 pages (192 rows) where one owner receives more under Zipf routing: every rank's forward
// output is still bitwise right; every rank's backward fails alike before its exchange, naming the ranks
// that overflowed, their rows and the pool, with dx and the weight gradients NaN (no rank computes from
// rows that were not kept); then, on the same layer and pool, a uniform step (every owner within 192
// rows) is bitwise the layer without a stash: the overflow took no pages and the others gave theirs back.
// `set` without its stash: the layer's segments (and whether they run as the overlapped pipeline); `pages`:
// the pool, which the skewed step's hot owner overflows and the uniform step fits (each segment's rows take
// whole pages: with several segments an owner needs about one page per segment it has rows in).
void TooSmallPoolFailsEveryRanksBackward(Setting set, int64_t pages) {
  Problem skewed(4, "zipf:2", 5), even(4, "uniform", 6);
  even.w = skewed.w;  // one layer's weights for both steps
  even.x = RandomActivations(even.shape, even.routing, 8);
  even.dy = RandomActivations(even.shape, even.routing, 9);
  const Outputs skewed_plain = RunOne(skewed, set), even_plain = RunOne(even, set);
  auto domain = MakeDomain(4);
  ASSERT_TRUE(domain.ok()) << domain.status();
  set.stash_rows = pages * 64;
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(skewed, set), skewed.own, skewed.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  Outputs small(4), after(4);
  for (auto [p, out] : {std::pair{&skewed, &small}, {&even, &after}}) {
    const Status s = (*domain)->Run([&, p = p, out = out](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      Batch b;
      RDEP_RETURN_IF_ERROR(Upload(p->routing[i], p->x[i], p->dy[i], p->shape.hidden, b));
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, b.e, b.g, b.n, b.x, b.y));
      out->backward[i] = (*layer)->Backward(r, b.dy, b.dx, b.dg);
      RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
      return Collect(**layer, *p, b, r, *out);
    });
    ASSERT_TRUE(s.ok()) << s;
  }
  // Every rank learns every rank's outcome at forward: all four backwards fail alike, before the exchange.
  std::string first_tail;
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE("rank " + std::to_string(i));
    EXPECT_EQ(small.y[i], skewed_plain.y[i]) << "forward output";
    ASSERT_FALSE(small.backward[i].ok()) << "a rank's backward ran although an owner's rows were not kept";
    EXPECT_EQ(small.backward[i].code(), StatusCode::kFailedPrecondition) << small.backward[i];
    const std::string& m = small.backward[i].message();
    const std::string prefix = "backward on rank " + std::to_string(i) + ":";
    EXPECT_EQ(m.rfind(prefix, 0), 0u) << m;
    EXPECT_NE(m.find("stash_rows " + std::to_string(pages * 64) + ": " + std::to_string(pages) + " pages"), std::string::npos) << m;
    EXPECT_NE(m.find("owner rows did not fit"), std::string::npos) << m;
    size_t listed = 0;  // the ranks named as "rank r needed N"
    for (size_t at = m.find(" needed "); at != std::string::npos; at = m.find(" needed ", at + 1)) ++listed;
    EXPECT_GE(listed, 1u) << "Zipf 2 puts more than the pool on a hot owner: " << m;
    EXPECT_NE(m.find(" pages for "), std::string::npos) << "the pages each overflowing rank needed: " << m;
    EXPECT_LT(listed, 4u) << "the lightly loaded owners fit in 3 pages: " << m;
    const std::string tail = m.substr(prefix.size());
    if (i == 0) first_tail = tail;
    else EXPECT_EQ(tail, first_tail) << "the ranks disagree on the outcomes";
    const bool all_nan = std::all_of(small.dw1[i].begin(), small.dw1[i].end(), [](float v) { return std::isnan(v); }) &&
                         std::all_of(small.dw2[i].begin(), small.dw2[i].end(), [](float v) { return std::isnan(v); });
    EXPECT_TRUE(all_nan) << "the failed backward's weight gradients are NaN, not plausible values";
    EXPECT_TRUE(std::all_of(small.dx[i].begin(), small.dx[i].end(), [](uint16_t v) { return (v & 0x7f80) == 0x7f80 && (v & 0x7f); }))
        << "the failed backward's dx is NaN";
    EXPECT_TRUE(std::all_of(small.dg[i].begin(), small.dg[i].end(), [](float v) { return std::isnan(v); }))
        << "the failed backward's dgates are NaN";
  }
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(after.backward[i].ok()) << "rank " << i << ": " << after.backward[i];
  ExpectSame(after, even_plain, "the step after the overflow");
}

TEST(CudaStash_Overflow, W4_TooSmallPoolFailsEveryRanksBackwardNamingRanksRowsAndPool) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  TooSmallPoolFailsEveryRanksBackward(Setting{}, 3);
}

// The same through the overlapped segment pipeline (several segments; it reaches the same FinishExchange).
TEST(CudaStash_Overflow, W4_OverlappedSegments_TooSmallPoolFailsEveryRanksBackward) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  // 24-token segments (11 at the hot owner: a page each), 8 pages: the uniform step's owners (~120 tokens, 5
  // segments) fit, Zipf 2's hot owner (~230 tokens) does not.
  TooSmallPoolFailsEveryRanksBackward(Setting{.segment = 24, .overlap = true}, 8);
}

// Two layers sharing the domain's transient rows and its one set of outcome words (each with a pool of its
// own size), interleaved: forward of a layer that overflows its 3 pages (Zipf 2), forward of one that fits
// (uniform, 8 pages), backward of the second, then of the first. The second layer's forward writes the outcome words after the first's were copied for its
// backward: the second's backward succeeds on every rank, bitwise the layer without a stash, and the
// first's fails on every rank.
TEST(CudaStash_Overflow, W4_ALayerThatFitsBetweenAnOverflowingLayersCallsIsUnaffected) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  Problem skewed(4, "zipf:2", 5), even(4, "uniform", 6);
  const Outputs even_plain = RunOne(even, Setting{});
  auto domain = MakeDomain(4);
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto l1 = CudaMoELayer::Create(**domain, ConfigOf(skewed, Setting{.stash_rows = 192}), skewed.own, skewed.w);
  ASSERT_TRUE(l1.ok()) << l1.status();
  auto l2 = CudaMoELayer::Create(**domain, ConfigOf(even, Setting{.stash_rows = 512}), even.own, even.w);  // a pool of its own
  ASSERT_TRUE(l2.ok()) << l2.status();
  Outputs first(4), second(4);
  const Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b1, b2;
    RDEP_RETURN_IF_ERROR(Upload(skewed.routing[i], skewed.x[i], skewed.dy[i], skewed.shape.hidden, b1));
    RDEP_RETURN_IF_ERROR(Upload(even.routing[i], even.x[i], even.dy[i], even.shape.hidden, b2));
    RDEP_RETURN_IF_ERROR((*l1)->Forward(r, b1.e, b1.g, b1.n, b1.x, b1.y));
    RDEP_RETURN_IF_ERROR((*l2)->Forward(r, b2.e, b2.g, b2.n, b2.x, b2.y));
    second.backward[i] = (*l2)->Backward(r, b2.dy, b2.dx, b2.dg);
    first.backward[i] = (*l1)->Backward(r, b1.dy, b1.dx, b1.dg);
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    return Collect(**l2, even, b2, r, second);
  });
  ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(second.backward[i].ok()) << "rank " << i << ": " << second.backward[i];
    EXPECT_FALSE(first.backward[i].ok()) << "rank " << i << ": the overflowing layer's backward ran";
    EXPECT_NE(first.backward[i].message().find("owner rows did not fit"), std::string::npos) << first.backward[i];
  }
  ExpectSame(second, even_plain, "the layer that fits");
}

// The backward that fails on the stash's overflow also reports the forward's routing fault when the
// sync-free forward had not read it yet (else it would show only at a later call). W = 1, 128 rows in a pool
// of 1 page, token 3's second expert out of range; the rank's stream is held by a host function until the
// forward has returned, so the forward cannot have read its routing check (a sync-free forward does not wait
// on the device once its context's buffers exist).
TEST(CudaStash_Overflow, W1_TheFailedBackwardAlsoReportsAnUnreadRoutingFault) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  Problem p(1, "uniform", 11);
  p.routing[0].experts[3 * 2 + 1] = static_cast<int32_t>(p.shape.experts);  // token 3, slot 1: E is out of range
  auto domain = MakeDomain(1);
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(p, Setting{.stash_rows = 64}), p.own, p.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  StreamHold hold;
  // A first step with valid routing makes the context's buffers (allocations may wait on the device, which the
  // held stream would block); its backward overflows the pool too.
  Problem valid(1, "uniform", 11);
  Batch warm;
  ASSERT_TRUE(Upload(valid.routing[0], valid.x[0], valid.dy[0], valid.shape.hidden, warm).ok());
  ASSERT_TRUE((*layer)->Forward(0, warm.e, warm.g, warm.n, warm.x, warm.y).ok());
  EXPECT_EQ((*layer)->Backward(0, warm.dy, warm.dx, warm.dg).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*domain)->Synchronize(0).ok());
  Batch b;
  ASSERT_TRUE(Upload(p.routing[0], p.x[0], p.dy[0], p.shape.hidden, b).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaLaunchHostFunc((*domain)->stream(0), &StreamHold::Wait, &hold), cudaSuccess);
  std::promise<void> returned;
  std::thread watchdog([&, done = returned.get_future()] {  // a forward that waited on its stream would not hang the test
    done.wait_for(std::chrono::seconds(10));
    hold.Release();
  });
  const Status forward = (*layer)->Forward(0, b.e, b.g, b.n, b.x, b.y);
  returned.set_value();
  watchdog.join();
  EXPECT_TRUE(forward.ok()) << "the forward could not have read its routing check yet: " << forward;
  const Status back = (*layer)->Backward(0, b.dy, b.dx, b.dg);
  EXPECT_EQ(back.code(), StatusCode::kFailedPrecondition) << back;
  EXPECT_NE(back.message().find("owner rows did not fit"), std::string::npos) << back;
  EXPECT_NE(back.message().find("; and forward on rank 0: routing"), std::string::npos) << back;
  EXPECT_NE(back.message().find("token 3"), std::string::npos) << back;
  EXPECT_TRUE((*domain)->Synchronize(0).ok());
}

// W = 1 (all 128 rows on the one owner: 2 pages) with a pool of exactly 2 pages and caller-owned
// contexts: A's pages come back by ReleaseRows (B then fits and is exact), by freeing a context, and
// a forward again in the same context gives back its previous pages first. Without a release, B
// overflows while A holds the pool.
TEST(CudaStash_Release, W1_PagesComeBackByReleaseRowsFreeingOrAForwardAgain) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  Problem p(1, "uniform", 9);
  const Outputs without = RunOne(p, Setting{});
  auto domain = MakeDomain(1);
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(p, Setting{.stash_rows = 128}), p.own, p.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[0], p.x[0], p.dy[0], p.shape.hidden, b));
    auto y_of = [&]() { return Download(reinterpret_cast<const uint16_t*>(b.y), static_cast<size_t>(b.n * p.shape.hidden)); };
    auto dx_of = [&]() { return Download(reinterpret_cast<const uint16_t*>(b.dx), static_cast<size_t>(b.n * p.shape.hidden)); };
    {
      ForwardContext a, c;
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, a, b.e, b.g, b.n, b.x, b.y));
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, c, b.e, b.g, b.n, b.x, b.y));  // the pool is A's: C overflows
      const Status c_back = (*layer)->Backward(r, c, b.dy, b.dx, b.dg);
      EXPECT_EQ(c_back.code(), StatusCode::kFailedPrecondition) << c_back;
      RDEP_RETURN_IF_ERROR((*layer)->ReleaseRows(a));                           // A's pages back
      EXPECT_FALSE((*layer)->Backward(r, a, b.dy, b.dx, b.dg).ok()) << "a released context has no rows for a backward";
      ForwardContext d;
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, d, b.e, b.g, b.n, b.x, b.y));
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, d, b.e, b.g, b.n, b.x, b.y));  // again: D's earlier pages come back first
      RDEP_RETURN_IF_ERROR((*layer)->Backward(r, d, b.dy, b.dx, b.dg));
      RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
      RDEP_ASSIGN_OR_RETURN(auto y, y_of());
      RDEP_ASSIGN_OR_RETURN(auto dx, dx_of());
      EXPECT_EQ(y, without.y[0]);
      EXPECT_EQ(dx, without.dx[0]);
      ForwardContext e;
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, e, b.e, b.g, b.n, b.x, b.y));  // E holds the pool as the scope ends
    }
    ForwardContext f;  // E was freed with its pages taken: they came back
    RDEP_RETURN_IF_ERROR((*layer)->Forward(r, f, b.e, b.g, b.n, b.x, b.y));
    RDEP_RETURN_IF_ERROR((*layer)->Backward(r, f, b.dy, b.dx, b.dg));
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    RDEP_ASSIGN_OR_RETURN(auto dx, dx_of());
    EXPECT_EQ(dx, without.dx[0]) << "after a freed context's pages came back";
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
}

// The free list wraps around with pages given back in another order than they were taken: W = 1 (128
// rows, 2 pages a forward) on a pool of 7 pages, three contexts per round, backward in the order A, C, B
// (so B's pages go back after C's, which were taken later), four rounds: 24 pages taken from a 7-slot
// ring. Every backward is bitwise the layer without a stash.
TEST(CudaStash_Ring, W1_WrapsWithPagesGivenBackOutOfOrder) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  Problem p(1, "uniform", 12);
  const Outputs without = RunOne(p, Setting{});
  auto domain = MakeDomain(1);
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(p, Setting{.stash_rows = 448}), p.own, p.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[0], p.x[0], p.dy[0], p.shape.hidden, b));
    for (int round = 0; round < 4; ++round) {
      ForwardContext ctx[3];
      for (auto& c : ctx) RDEP_RETURN_IF_ERROR((*layer)->Forward(r, c, b.e, b.g, b.n, b.x, b.y));
      for (int k : {0, 2, 1}) {
        RDEP_RETURN_IF_ERROR((*layer)->Backward(r, ctx[k], b.dy, b.dx, b.dg));
        RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
        RDEP_ASSIGN_OR_RETURN(auto dx, Download(reinterpret_cast<const uint16_t*>(b.dx), static_cast<size_t>(b.n * p.shape.hidden)));
        RDEP_ASSIGN_OR_RETURN(auto dw1, Download((*layer)->dw1(r), static_cast<size_t>(8 * p.shape.hidden * 2 * p.shape.ffn)));
        EXPECT_EQ(dx, without.dx[0]) << "round " << round << ", context " << k;
        EXPECT_EQ(dw1, without.dw1[0]) << "round " << round << ", context " << k;
      }
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
}

TEST(CudaStash_Capture, AForwardInsideACaptureIsRefusedBeforeTheCollective) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  Problem p(1, "uniform", 4);
  auto domain = MakeDomain(1);
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, ConfigOf(p, Setting{.stash_rows = 128}), p.own, p.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[0], p.x[0], p.dy[0], p.shape.hidden, b));
    cudaStream_t stream = (*domain)->stream(r);
    ForwardContext ctx;
    cudaGraph_t graph = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status f = (*layer)->Forward(r, ctx, b.e, b.g, b.n, b.x, b.y);
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
    if (graph) cudaGraphDestroy(graph);
    EXPECT_EQ(f.code(), StatusCode::kFailedPrecondition) << f;
    EXPECT_NE(f.message().find("CUDA graph capture"), std::string::npos) << f;
    // A forward run eagerly, its backward inside a capture: refused before the collective too.
    RDEP_RETURN_IF_ERROR((*layer)->Forward(r, ctx, b.e, b.g, b.n, b.x, b.y));
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status back = (*layer)->Backward(r, ctx, b.dy, b.dx, b.dg);
    graph = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
    if (graph) cudaGraphDestroy(graph);
    EXPECT_EQ(back.code(), StatusCode::kFailedPrecondition) << back;
    EXPECT_NE(back.message().find("CUDA graph capture"), std::string::npos) << back;
    return (*layer)->ReleaseRows(ctx);
  });
  ASSERT_TRUE(s.ok()) << s;
}

#endif  // RDEP_HAVE_CUDA

}  // namespace
}  // namespace rdep
