// LayerConfig::owner_reduce on the CUDA layer, W = 4 ranks on the GPUs present (sharing them when
// fewer): the owner sums a token's rows into one return row per (token, owner) and takes dgate's dot
// products. Against the same layer without it, on the same routing, weights and inputs, two forward
// and backward calls per layer, both compared (the first grows the buffers, the second finds the
// first's sums in the return rows): y and dx within the CUDA checks' bf16 bound, ||a - b|| / ||b|| <=
// 1e-2 per rank (the owner's partial sum is rounded to bf16 once more); dgates and the weight gradients
// bitwise (the same bf16 expert outputs, the same dot-product order, the same GEMMs). The reduced layer
// must refuse CopyExpertOutputs (the mode is on: the front-end keeps no rows). Cases: uniform, Zipf 2,
// capacity drops, several segments, one expert for every token, balancing with replicas, H = 40 (not a
// multiple of 16), H = 2056 (rows past the scatter's and the return's first 4 KiB of loads), K = 36 with
// every token's 36 rows on owner 0 (slots past a warp's lanes) and the CUTLASS (sync-free) compute. Outputs are poisoned with NaN first, so a value
// nobody wrote fails. Every test skips without a GPU; the CUTLASS case also where that compute cannot be
// made (a failure under RDEP_REQUIRE_CUTLASS=1). The same cases also check LayerConfig::transport_sms: an
// SM budget (3 blocks of kTransportThreads for the peer-storing kernels) gives bitwise the outputs of the
// grids sized by the work, with and without owner_reduce. And the identity expert (kIdentity), with and
// without owner_reduce, against x times the token's gate sum.
//   exercise: build-*/src/layer/layer_test --gtest_filter='*CudaOwnerReduce*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/device_count.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

constexpr int32_t kW = 4;
constexpr double kRelL2 = 1e-2;  // the CUDA checks' bf16 bound (ValidationOptions::rel_l2)

struct Case {
  std::string name;
  std::string routing = "uniform";
  double capacity_factor = 0;  // 0 = dropless
  int64_t segment = 0;         // 0 = W*T (one segment)
  bool balance = false;
  bool cutlass = false;
  int64_t hidden = 64;
  int64_t experts = 16, topk = 4;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

LayerShape Shape(const Case& c) {
  return LayerShape{.tokens = 48, .hidden = c.hidden, .ffn = 32, .experts = c.experts, .topk = c.topk, .ranks = kW};
}

struct RankOut {
  std::vector<float> y, dx, dg, dw1, dw2;
};

// Two forward+backward calls (routing seeds 1 and 2) on one layer: [call][rank] outputs.
StatusOr<std::vector<std::vector<RankOut>>> RunLayer(const Case& c, bool owner_reduce, int32_t transport_sms = 0) {
  const LayerShape s = Shape(c);
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
  cfg.owner_reduce = owner_reduce;
  cfg.transport_sms = transport_sms;
  if (c.balance) cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 2};
  if (c.cutlass) cfg.expert_compute = ExpertComputeKind::kCutlass;
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, kW);
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(
                                         kW, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(kW, std::min(kW, cuda::DeviceCount()))}));
  RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain, cfg, own, RandomWeights(s, 7)));
  std::vector<std::vector<RankOut>> out(2, std::vector<RankOut>(kW));
  for (uint64_t call = 1; call <= 2; ++call) {
    RoutingSpec spec = *RoutingSpec::Parse(c.routing);
    spec.seed = call;
    RDEP_ASSIGN_OR_RETURN(Routing rt, GenerateRouting(s, spec));
    const auto x = RandomActivations(s, rt, 8 + call);
    const auto dy = RandomActivations(s, rt, 20 + call);
    RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      Batch b;
      RDEP_RETURN_IF_ERROR(Upload(rt[i], x[i], dy[i], s.hidden, b));
      const auto nh = static_cast<size_t>(std::max<int64_t>(b.n * s.hidden, 1)), nk = static_cast<size_t>(std::max<int64_t>(b.n * s.topk, 1));
      for (auto [p, bytes] : {std::pair<void*, size_t>{b.y, nh * 2}, {b.dx, nh * 2}, {b.dg, nk * 4}})
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0xFF, bytes));  // NaN in bf16 and fp32
      RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());         // before the layer's non-blocking stream
      RDEP_RETURN_IF_ERROR(layer->Forward(r, b.e, b.g, b.n, b.x, b.y));
      RDEP_RETURN_IF_ERROR(layer->Backward(r, b.dy, b.dx, b.dg));
      RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
      RankOut& o = out[call - 1][i];
      if (owner_reduce && layer->CopyExpertOutputs(r).ok())
        return InternalError("owner_reduce is on but the front-end kept expert outputs (rank " + std::to_string(r) + ")");
      const auto L = static_cast<size_t>(own.num_local(r));
      RDEP_ASSIGN_OR_RETURN(o.y, DownloadBf16(b.y, static_cast<size_t>(b.n * s.hidden)));
      RDEP_ASSIGN_OR_RETURN(o.dx, DownloadBf16(b.dx, static_cast<size_t>(b.n * s.hidden)));
      RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, static_cast<size_t>(b.n * s.topk)));
      RDEP_ASSIGN_OR_RETURN(o.dw1, Download(layer->dw1(r), L * static_cast<size_t>(2 * s.hidden * s.ffn)));
      RDEP_ASSIGN_OR_RETURN(o.dw2, Download(layer->dw2(r), L * static_cast<size_t>(s.ffn * s.hidden)));
      return Status::Ok();
    }));
  }
  return out;
}

// ||a - b|| / ||b||; +inf on a NaN or a size mismatch, 0 when both are zero.
double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return num == 0 ? 0 : (den == 0 ? INFINITY : std::sqrt(num / den));
}

class CudaOwnerReduce : public ::testing::TestWithParam<Case> {};

TEST_P(CudaOwnerReduce, MatchesTheLayerThatReturnsEveryRow) {
  const Case& c = GetParam();
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer runs on a GPU";
  std::string why;
  if (c.cutlass && !CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  auto rows = RunLayer(c, false);
  ASSERT_TRUE(rows.ok()) << rows.status();
  auto reduced = RunLayer(c, true);
  ASSERT_TRUE(reduced.ok()) << reduced.status();
  for (size_t call = 0; call < 2; ++call)
    for (int32_t r = 0; r < kW; ++r) {
      SCOPED_TRACE("call " + std::to_string(call + 1) + ", rank " + std::to_string(r));
      const RankOut &a = (*reduced)[call][static_cast<size_t>(r)], &b = (*rows)[call][static_cast<size_t>(r)];
      EXPECT_LE(RelL2(a.y, b.y), kRelL2) << "y";
      EXPECT_LE(RelL2(a.dx, b.dx), kRelL2) << "dx";
      EXPECT_TRUE(Bitwise(a.dg, b.dg)) << "dgates (relative L2 " << RelL2(a.dg, b.dg) << ")";
      EXPECT_TRUE(Bitwise(a.dw1, b.dw1)) << "dW1 (relative L2 " << RelL2(a.dw1, b.dw1) << ")";
      EXPECT_TRUE(Bitwise(a.dw2, b.dw2)) << "dW2 (relative L2 " << RelL2(a.dw2, b.dw2) << ")";
    }
}

TEST_P(CudaOwnerReduce, AnSmBudgetGivesTheSameBits) {
  const Case& c = GetParam();
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer runs on a GPU";
  std::string why;
  if (c.cutlass && !CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  for (bool owner_reduce : {false, true}) {
    auto wide = RunLayer(c, owner_reduce, 0);
    ASSERT_TRUE(wide.ok()) << wide.status();
    auto narrow = RunLayer(c, owner_reduce, 3);
    ASSERT_TRUE(narrow.ok()) << narrow.status();
    for (size_t call = 0; call < 2; ++call)
      for (int32_t r = 0; r < kW; ++r) {
        SCOPED_TRACE(std::string(owner_reduce ? "owner_reduce, " : "") + "call " + std::to_string(call + 1) + ", rank " +
                     std::to_string(r));
        const RankOut &a = (*narrow)[call][static_cast<size_t>(r)], &b = (*wide)[call][static_cast<size_t>(r)];
        EXPECT_TRUE(Bitwise(a.y, b.y)) << "y (relative L2 " << RelL2(a.y, b.y) << ")";
        EXPECT_TRUE(Bitwise(a.dx, b.dx)) << "dx (relative L2 " << RelL2(a.dx, b.dx) << ")";
        EXPECT_TRUE(Bitwise(a.dg, b.dg)) << "dgates (relative L2 " << RelL2(a.dg, b.dg) << ")";
        EXPECT_TRUE(Bitwise(a.dw1, b.dw1)) << "dW1";
        EXPECT_TRUE(Bitwise(a.dw2, b.dw2)) << "dW2";
      }
  }
}

// The identity expert (ExpertKind::kIdentity, what `rdep bench dispatch --owner-reduce` times): one
// forward per mode, y against the host's x * (sum of the token's accepted effective gates) per element
// within |x| * sum|g'| * 2^-7 (a bf16 rounding of the owner's partial sum and one of y: at most 2^-8 of
// that in exact arithmetic), y poisoned with NaN first. A lost, doubled or misplaced row is off by a
// whole gate's share.
TEST_P(CudaOwnerReduce, TheIdentityExpertReturnsTheGateSumTimesX) {
  const Case& c = GetParam();
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the CUDA layer runs on a GPU";
  std::string why;
  if (c.cutlass && !CutlassLayerAvailable(&why)) GTEST_SKIP() << why;  // the layer makes the compute, though the identity never calls it
  const LayerShape s = Shape(c);
  for (bool owner_reduce : {false, true}) {
    SCOPED_TRACE(owner_reduce ? "owner_reduce" : "rows");
    LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = c.capacity_factor}, c.segment);
    cfg.owner_reduce = owner_reduce;
    if (c.balance) cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 2};
    if (c.cutlass) cfg.expert_compute = ExpertComputeKind::kCutlass;  // not used by the identity: the sync path
    const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, kW);
    auto domain = CudaDomain::CreateSingleProcess(kW, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(kW, std::min(kW, cuda::DeviceCount()))});
    ASSERT_TRUE(domain.ok()) << domain.status();
    auto layer = CudaMoELayer::Create(**domain, cfg, own, RandomWeights(s, 7));
    ASSERT_TRUE(layer.ok()) << layer.status();
    (*layer)->set_expert_kind(ExpertKind::kIdentity);
    RoutingSpec spec = *RoutingSpec::Parse(c.routing);
    spec.seed = 3;
    auto rt = GenerateRouting(s, spec);
    ASSERT_TRUE(rt.ok()) << rt.status();
    const auto x = RandomActivations(s, *rt, 11);
    std::vector<std::string> errors(kW);
    Status st = (*domain)->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      Batch b;
      RDEP_RETURN_IF_ERROR(Upload((*rt)[i], x[i], x[i], s.hidden, b));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.y, 0xFF, static_cast<size_t>(std::max<int64_t>(b.n * s.hidden, 1)) * 2));
      RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, b.e, b.g, b.n, b.x, b.y));
      RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
      RDEP_ASSIGN_OR_RETURN(RankAcceptance acc, (*layer)->CopyAcceptance(r));
      RDEP_ASSIGN_OR_RETURN(std::vector<float> y, DownloadBf16(b.y, static_cast<size_t>(b.n * s.hidden)));
      for (int64_t t = 0; t < b.n && errors[i].empty(); ++t) {
        double gsum = 0, gabs = 0;
        for (int64_t k = 0; k < s.topk; ++k) {
          const auto j = static_cast<size_t>(t * s.topk + k);
          if (acc.accepted[j]) gsum += acc.effective_gates[j], gabs += std::fabs(acc.effective_gates[j]);
        }
        for (int64_t col = 0; col < s.hidden; ++col) {
          const double xv = Bf16BitsToFloat(FloatToBf16Bits(x[i][static_cast<size_t>(t * s.hidden + col)]));
          const double want = xv * gsum, got = y[static_cast<size_t>(t * s.hidden + col)];
          if (!(std::fabs(got - want) <= std::fabs(xv) * gabs * 0x1p-7 + 1e-30)) {
            errors[i] = "token " + std::to_string(t) + " column " + std::to_string(col) + ": y " + std::to_string(got) +
                        ", x * sum of gates " + std::to_string(want);
            break;
          }
        }
      }
      return Status::Ok();
    });
    ASSERT_TRUE(st.ok()) << st;
    for (int32_t r = 0; r < kW; ++r) EXPECT_TRUE(errors[static_cast<size_t>(r)].empty()) << "rank " << r << ": " << errors[static_cast<size_t>(r)];
    const Status bwd = (*layer)->Backward(0, nullptr, nullptr, nullptr);  // refused before any pointer or peer is touched
    EXPECT_EQ(bwd.code(), StatusCode::kFailedPrecondition) << bwd;
    EXPECT_NE(bwd.message().find("SwiGLU"), std::string::npos) << "the identity expert is forward only: " << bwd;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaOwnerReduce,
                         ::testing::Values(Case{.name = "uniform"}, Case{.name = "zipf2", .routing = "zipf:2"},
                                           Case{.name = "capacity_drops", .routing = "zipf:1", .capacity_factor = 0.6},
                                           Case{.name = "segments", .routing = "zipf:1", .segment = 20},
                                           Case{.name = "one_expert", .routing = "one-expert"},
                                           Case{.name = "balanced_zipf2", .routing = "zipf:2", .balance = true},
                                           Case{.name = "H40", .routing = "zipf:1", .hidden = 40},
                                           // Rows longer than the copies' first 256 vectors (the scatter's and
                                           // the return's early loads, then the rest).
                                           Case{.name = "H2056", .routing = "zipf:1", .hidden = 2056},
                                           // More than 32 of a token's rows on one owner (sums and sideband
                                           // entries past a warp's lanes): its 36 experts, 0-35, on owner 0.
                                           Case{.name = "K36_one_owner", .routing = "one-expert", .experts = 160, .topk = 36},
                                           Case{.name = "cutlass_zipf1", .routing = "zipf:1", .cutlass = true}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
}  // namespace rdep
#endif  // RDEP_HAVE_CUDA
