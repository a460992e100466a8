// The overlapped segment pipeline (LayerConfig::overlap_segments, cuda_overlap.cc) against the same
// layer run in sequence: y, dx, dgates, dW1, dW2 and the acceptance bitwise, on the second of two
// forward+backward steps (the first leaves every buffer the pipeline reuses written), with W = 1 and
// W = 4 ranks sharing the GPUs present, uniform and skewed routing, capacity drops, the paged stash (a
// pool with room for every segment's pages), the expert GEMMs on fewer SMs (transport_sms > 0), and one
// stream held back (SetPipelineDelaysForTesting: the compute late, or the returns late) so that each
// cross-stream wait guards a real race. The pipeline must really have run: every rank reports
// overlapped() and more than one segment. Skips without a GPU, CUTLASS or sm_90.
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/device_count.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

struct Setting {
  int32_t ranks = 4;
  const char* routing = "zipf:1.2";
  int64_t segment = 24;     // token rows per owner segment (< W*T: several segments)
  double capacity = 0;      // 0 = dropless
  int32_t transport_sms = 0;
  int64_t stash_rows = 0;
  int64_t delay_compute_us = 0;  // SetPipelineDelaysForTesting (the overlapped run only)
  int64_t delay_return_us = 0;
};
void PrintTo(const Setting& s, std::ostream* os) {
  *os << "{W " << s.ranks << ", " << s.routing << ", S " << s.segment << ", capacity " << s.capacity << ", transport_sms "
      << s.transport_sms << ", stash_rows " << s.stash_rows << ", delays " << s.delay_compute_us << "/" << s.delay_return_us << " us}";
}

struct Outputs {
  std::vector<std::vector<uint16_t>> y, dx;
  std::vector<std::vector<float>> dg, dw1, dw2;
  std::vector<RankAcceptance> acc;
  std::vector<int64_t> segments;
  std::vector<int> overlapped;
  explicit Outputs(size_t W) : y(W), dx(W), dg(W), dw1(W), dw2(W), acc(W), segments(W), overlapped(W) {}
};

Outputs RunLayer(const SmallProblem& p, const Setting& set, bool overlap) {
  const auto W = static_cast<size_t>(p.shape.ranks);
  Outputs out(W);
  const int gpus = cuda::DeviceCount();
  auto domain = CudaDomain::CreateSingleProcess(p.shape.ranks, {.barrier_timeout_s = 20,
                                                                .devices = RoundRobinDevices(p.shape.ranks, std::min<int>(static_cast<int>(W), gpus))});
  EXPECT_TRUE(domain.ok()) << domain.status();
  if (!domain.ok()) return out;
  LayerConfig cfg = MakeLayerConfig(p.shape, {.capacity_factor = set.capacity}, set.segment);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.transport_sms = set.transport_sms;
  cfg.stash_rows = set.stash_rows;
  cfg.overlap_segments = overlap;
  auto layer = CudaMoELayer::Create(**domain, cfg, p.own, p.w);
  EXPECT_TRUE(layer.ok()) << layer.status();
  if (!layer.ok()) return out;
  (*layer)->SetPipelineDelaysForTesting(set.delay_compute_us * 1000, set.delay_return_us * 1000);
  const int64_t H = p.shape.hidden, F = p.shape.ffn;
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[i], p.x[i], p.dy[i], H, b));
    for (int step = 0; step < 2; ++step) {
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.y, 0xff, static_cast<size_t>(b.n * H) * 2));  // poisoned: NaN bits
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dx, 0xff, static_cast<size_t>(b.n * H) * 2));
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, b.e, b.g, b.n, b.x, b.y));
      RDEP_RETURN_IF_ERROR((*layer)->Backward(r, b.dy, b.dx, b.dg));
    }
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    RDEP_ASSIGN_OR_RETURN(out.acc[i], (*layer)->CopyAcceptance(r));
    RDEP_ASSIGN_OR_RETURN(out.y[i], Download(reinterpret_cast<const uint16_t*>(b.y), static_cast<size_t>(b.n * H)));
    RDEP_ASSIGN_OR_RETURN(out.dx[i], Download(reinterpret_cast<const uint16_t*>(b.dx), static_cast<size_t>(b.n * H)));
    RDEP_ASSIGN_OR_RETURN(out.dg[i], Download(b.dg, static_cast<size_t>(b.n * p.shape.topk)));
    const auto L = static_cast<size_t>(p.own.num_local(r));
    RDEP_ASSIGN_OR_RETURN(out.dw1[i], Download((*layer)->dw1(r), L * static_cast<size_t>(H * 2 * F)));
    RDEP_ASSIGN_OR_RETURN(out.dw2[i], Download((*layer)->dw2(r), L * static_cast<size_t>(F * H)));
    out.segments[i] = (*layer)->segments(r);
    out.overlapped[i] = (*layer)->overlapped(r) ? 1 : 0;
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

bool AllFinite(const std::vector<uint16_t>& bf16) {
  for (uint16_t v : bf16)
    if ((v & 0x7f80) == 0x7f80) return false;  // exponent all ones: inf or NaN (the poison)
  return true;
}

class CudaOverlap : public ::testing::TestWithParam<Setting> {};

TEST_P(CudaOverlap, SameBitsAsTheSequentialSchedule) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  const Setting set = GetParam();
  const SmallProblem p(set.ranks, set.routing, 1, 7);
  const Outputs seq = RunLayer(p, set, false), ov = RunLayer(p, set, true);
  for (size_t i = 0; i < static_cast<size_t>(set.ranks); ++i) {
    SCOPED_TRACE("rank " + std::to_string(i));
    EXPECT_GT(ov.segments[i], 1) << "one segment: nothing to overlap, the case tests nothing";
    EXPECT_EQ(ov.overlapped[i], 1) << "the overlapped layer ran in sequence";
    EXPECT_EQ(seq.overlapped[i], 0);
    EXPECT_EQ(ov.segments[i], seq.segments[i]);
    EXPECT_EQ(ov.acc[i].accepted, seq.acc[i].accepted);
    EXPECT_EQ(ov.acc[i].effective_gates, seq.acc[i].effective_gates);
    EXPECT_TRUE(AllFinite(seq.y[i]) && AllFinite(seq.dx[i])) << "the sequential layer left poisoned outputs";
    EXPECT_EQ(ov.y[i], seq.y[i]) << "y";
    EXPECT_EQ(ov.dx[i], seq.dx[i]) << "dx";
    EXPECT_EQ(ov.dg[i], seq.dg[i]) << "dgates";
    EXPECT_EQ(ov.dw1[i], seq.dw1[i]) << "dW1";
    EXPECT_EQ(ov.dw2[i], seq.dw2[i]) << "dW2";
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda_bf16, CudaOverlap,
                         ::testing::Values(Setting{.ranks = 1, .routing = "uniform", .segment = 16},
                                           Setting{.ranks = 4, .routing = "uniform", .segment = 40},
                                           Setting{.ranks = 4},
                                           Setting{.ranks = 4, .routing = "zipf:2", .segment = 16},
                                           Setting{.ranks = 4, .capacity = 0.8},
                                           Setting{.ranks = 4, .transport_sms = 8},
                                           Setting{.ranks = 4, .stash_rows = 4096},
                                           // The compute late (a missing wait before a return would send stale rows) and the
                                           // returns late (a missing wait before a compute would overwrite rows still being sent).
                                           Setting{.ranks = 4, .segment = 40, .delay_compute_us = 300},
                                           Setting{.ranks = 4, .segment = 40, .delay_return_us = 300}),
                         [](const ::testing::TestParamInfo<Setting>& i) {
                           const Setting& s = i.param;
                           std::string name = "W" + std::to_string(s.ranks) + "_" + s.routing + "_S" + std::to_string(s.segment);
                           if (s.capacity > 0) name += "_capacity_drops";
                           if (s.transport_sms > 0) name += "_gemms_leave_" + std::to_string(s.transport_sms) + "_sms";
                           if (s.stash_rows > 0) name += "_stash";
                           if (s.delay_compute_us > 0) name += "_compute_late";
                           if (s.delay_return_us > 0) name += "_returns_late";
                           for (char& c : name)
                             if (c == ':' || c == '.') c = '_';
                           return name;
                         });

// What the pipeline cannot run with is refused at Create, naming the setting.
TEST(CudaOverlap_Errors, OwnerReduceIsRefusedByName) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const SmallProblem p(1, "uniform", 1, 7);
  LayerConfig cfg = MakeLayerConfig(p.shape, {}, 16);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.owner_reduce = true;
  cfg.overlap_segments = true;
  const Status st = CreateStatus(p, cfg);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("overlap_segments"), std::string::npos) << st;
  EXPECT_NE(st.message().find("owner_reduce on"), std::string::npos) << st;
}

TEST(CudaOverlap_Errors, ATransportBudgetOverHalfTheSmsIsRefused) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  const SmallProblem p(1, "uniform", 1, 7);
  LayerConfig cfg = MakeLayerConfig(p.shape, {}, 16);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.overlap_segments = true;
  cfg.transport_sms = kMaxTransportSms;  // more than half of any GPU's SMs: the GEMMs would be left (nearly) none
  const Status st = CreateStatus(p, cfg);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("transport_sms: 1024 with overlap_segments"), std::string::npos) << st;
}

}  // namespace
}  // namespace rdep
#endif
