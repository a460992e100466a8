// The owner's gather (LaunchGatherRows) on the GPU against the host, bitwise: out[g] = the payload row of
// grouped[g].token, or with scale_by_gate each element times the row's gate rounded to bf16 once (round to
// nearest even). Fresh random payloads, tokens and gates; the output poisoned first, so rows past the
// count (the host bound M, or the device total below it) must stay untouched. Covers the 16-byte path (H a
// multiple of 8 on aligned rows: one vector a lane and rows longer than a warp's unrolled loads) and the
// 2-byte one (H not a multiple of 8). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "experts/experts_test_util.h"
#include "rdep/core/random.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"

namespace rdep::dispatch {
namespace {

using kernels::test_util::Dev;
using kernels::test_util::RandomBf16;

struct GatherCase {
  std::string name;
  int64_t H;
  int64_t device_rows;  // -1: the host bound M only
};
void PrintTo(const GatherCase& c, std::ostream* os) { *os << c.name; }

class GatherRows : public ::testing::TestWithParam<GatherCase> {};

TEST_P(GatherRows, MatchesTheHostBitwise) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const GatherCase& c = GetParam();
  const int64_t S = 97, M = 300, H = c.H;
  const std::vector<uint16_t> payload = RandomBf16(static_cast<size_t>(S * H), 5 + static_cast<uint64_t>(H), 3.f);
  std::vector<GroupedRow> grouped(static_cast<size_t>(M));
  Rng rng(17);
  for (int64_t g = 0; g < M; ++g) {
    GroupedRow& r = grouped[static_cast<size_t>(g)];
    r.row_id = static_cast<uint64_t>(g);
    r.token = static_cast<int32_t>(rng.uniform() * static_cast<double>(S)) % static_cast<int32_t>(S);
    r.local_expert = 0;
    r.gate = static_cast<float>(rng.uniform() * 1.5 - 0.25);
    r.pad = 0;
  }
  Dev<uint16_t> src(payload.size()), out(static_cast<size_t>(M * H));
  Dev<GroupedRow> rows(grouped.size());
  Dev<int64_t> total(1);
  src.Upload(payload);
  rows.Upload(grouped);
  total.Upload({c.device_rows});
  const int64_t written = c.device_rows >= 0 ? c.device_rows : M;
  for (const bool scale : {false, true}) {
    SCOPED_TRACE(scale ? "scaled by the gate" : "copied");
    out.Poison();
    const Status st = LaunchGatherRows(src.p, rows.p, M, H, scale, out.p, nullptr, c.device_rows >= 0 ? total.p : nullptr);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> got = out.Download();
    for (int64_t g = 0; g < M; ++g) {
      const GroupedRow& r = grouped[static_cast<size_t>(g)];
      for (int64_t j = 0; j < H; ++j) {
        const uint16_t x = payload[static_cast<size_t>(r.token * H + j)];
        const uint16_t want = g >= written ? uint16_t{0xFFFF} : scale ? FloatToBf16Bits(r.gate * Bf16BitsToFloat(x)) : x;
        ASSERT_EQ(got[static_cast<size_t>(g * H + j)], want) << "row " << g << " column " << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, GatherRows,
                         ::testing::Values(GatherCase{"H2048_vectors", 2048, -1}, GatherCase{"H40_one_vector_a_lane", 40, -1},
                                           GatherCase{"H4104_past_the_unrolled_loads", 4104, -1},
                                           GatherCase{"H36_elements", 36, -1}, GatherCase{"H64_device_total_below_M", 64, 123}),
                         [](const ::testing::TestParamInfo<GatherCase>& i) { return i.param.name; });

}  // namespace
}  // namespace rdep::dispatch
