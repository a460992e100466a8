// The front-end combine (LaunchCombine) on the GPU against a host reference with the same arithmetic
// (one fused multiply-add per slot in slot order, fp32, rounded once to bf16): y bitwise, the saved
// rows bitwise (zeros for dropped slots), bytes past the outputs untouched. Fresh random rows, gates
// and drops per case, a dropped slot's row NaN (it must reach neither y nor the saved rows); outputs
// poisoned first. Covers the 16-byte kernel (H % 8 == 0, aligned) and the
// 2-byte kernel (H % 8 != 0, or an output 2 bytes off alignment). The mapped cases read each slot's row
// through row_of (the owner's rows in place at W = 1): the rows shuffled among spare ones, a dropped slot's
// map entry pointing at a NaN row, and two accepted slots whose entries fall outside [0, row_bound) adding
// nothing (their saved rows zeros). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "experts/experts_test_util.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"

namespace rdep::dispatch {
namespace {

constexpr uint16_t kPoison = 0xFFFF;  // a bf16 NaN: what Dev::Poison writes

struct CombineCase {
  std::string name;
  int64_t n, K, H;
  bool weighted, with_save;
  int64_t y_offset;  // elements: 1 puts y 2 bytes off 16-byte alignment
  bool mapped = false;  // slot i reads row row_of[i] of a shuffled row array (LaunchCombine's row_of)
};

using kernels::test_util::Dev;

class CombineKernel : public ::testing::TestWithParam<CombineCase> {};

TEST_P(CombineKernel, MatchesTheHostReferenceBitwise) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const CombineCase& c = GetParam();
  const auto nk = static_cast<size_t>(c.n * c.K), nh = static_cast<size_t>(c.n * c.H);
  std::mt19937 rng(static_cast<uint32_t>(c.n * 131 + c.K * 17 + c.H));
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  // The rows: one per slot (row i for slot i), or, mapped, nk + 7 shuffled rows with slot i's at row_of[i].
  const size_t rows = nk + (c.mapped ? 7 : 0), H = static_cast<size_t>(c.H);
  std::vector<int32_t> row_of(nk);
  for (size_t i = 0; i < nk; ++i) row_of[i] = static_cast<int32_t>(i);
  if (c.mapped) {
    std::vector<int32_t> perm(rows);
    for (size_t r = 0; r < rows; ++r) perm[r] = static_cast<int32_t>(r);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy_n(perm.begin(), nk, row_of.begin());
  }
  std::vector<uint16_t> ret(rows * H);
  for (auto& v : ret) v = FloatToBf16Bits(normal(rng));
  std::vector<uint8_t> accepted(nk);
  std::vector<float> weights(nk);
  for (size_t i = 0; i < nk; ++i) {
    accepted[i] = unit(rng) < 0.8f ? 1 : 0;  // about one slot in five dropped
    weights[i] = unit(rng);
    if (!accepted[i])  // a dropped slot's row holds NaN (what a stale region may hold): it must reach neither y nor save
      std::fill_n(ret.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(row_of[i]) * H), c.H, kPoison);
  }
  std::vector<uint8_t> in_bounds(nk, 1);
  if (c.mapped) {  // two accepted slots with entries outside [0, rows): nothing read, zeros saved
    int outside = 0;
    for (size_t i = 0; i < nk && outside < 2; ++i)
      if (accepted[i]) {
        row_of[i] = outside++ == 0 ? static_cast<int32_t>(rows) : -3;
        in_bounds[i] = 0;
      }
  }
  // Host reference: the kernel's arithmetic, slot by slot.
  std::vector<uint16_t> want_y(nh), want_save(nk * H, 0);
  for (int64_t t = 0; t < c.n; ++t)
    for (int64_t h = 0; h < c.H; ++h) {
      float acc = 0.f;
      for (int64_t k = 0; k < c.K; ++k) {
        const auto i = static_cast<size_t>(t * c.K + k);
        if (!accepted[i] || !in_bounds[i]) continue;
        const uint16_t v = ret[static_cast<size_t>(row_of[i]) * H + static_cast<size_t>(h)];
        want_save[i * H + static_cast<size_t>(h)] = v;
        acc = std::fmaf(c.weighted ? weights[i] : 1.f, Bf16BitsToFloat(v), acc);
      }
      want_y[static_cast<size_t>(t * c.H + h)] = FloatToBf16Bits(acc);
    }

  const size_t y_len = nh + static_cast<size_t>(c.y_offset) + 8, save_len = nk * H + 8;  // 8 guard elements each
  Dev<uint16_t> d_ret(ret.size()), d_y(y_len), d_save(save_len);
  Dev<uint8_t> d_acc(nk);
  Dev<float> d_w(nk);
  Dev<int32_t> d_row_of(nk);
  d_ret.Upload(ret);
  d_row_of.Upload(row_of);
  d_acc.Upload(accepted);
  d_w.Upload(weights);
  d_y.Poison();
  d_save.Poison();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  const Status st = LaunchCombine(d_ret.p, d_acc.p, c.weighted ? d_w.p : nullptr, c.n, c.K, c.H, d_y.p + c.y_offset,
                                  c.with_save ? d_save.p : nullptr, s, c.mapped ? d_row_of.p : nullptr,
                                  static_cast<int64_t>(rows));
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const auto y = d_y.Download(), save = d_save.Download();
  for (int64_t i = 0; i < c.y_offset; ++i) ASSERT_EQ(y[static_cast<size_t>(i)], kPoison) << "y written before its start";
  for (size_t i = 0; i < nh; ++i)
    ASSERT_EQ(y[i + static_cast<size_t>(c.y_offset)], want_y[i]) << "y element " << i << " (token " << i / static_cast<size_t>(c.H) << ")";
  for (size_t i = nh + static_cast<size_t>(c.y_offset); i < y_len; ++i) ASSERT_EQ(y[i], kPoison) << "y written past its end at " << i;
  for (size_t i = 0; i < nk * H; ++i) {
    if (c.with_save) {
      ASSERT_EQ(save[i], want_save[i]) << "saved row element " << i;
    } else {
      ASSERT_EQ(save[i], kPoison) << "save written without being asked at " << i;
    }
  }
  for (size_t i = nk * H; i < save_len; ++i) ASSERT_EQ(save[i], kPoison) << "save written past its end at " << i;
  cudaStreamDestroy(s);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CombineKernel,
    ::testing::Values(CombineCase{"vec8_H2048_K6_weighted_save", 97, 6, 2048, true, true, 0},
                      CombineCase{"vec8_H64_K2_unweighted", 33, 2, 64, false, false, 0},
                      CombineCase{"vec8_H8_K1", 5, 1, 8, true, true, 0},
                      CombineCase{"vec8_H4096_K8_more_columns_than_threads", 7, 8, 4096, true, true, 0},
                      CombineCase{"vec8_H1024_K13", 19, 13, 1024, true, true, 0},
                      CombineCase{"scalar_H36_not_multiple_of_8", 29, 3, 36, true, true, 0},
                      CombineCase{"scalar_H2050_K4", 11, 4, 2050, true, true, 0},
                      CombineCase{"scalar_misaligned_y_H64", 21, 4, 64, true, true, 1},
                      CombineCase{"mapped_vec8_H2048_K6_weighted_save", 97, 6, 2048, true, true, 0, true},
                      CombineCase{"mapped_vec8_H64_K2_unweighted", 33, 2, 64, false, false, 0, true},
                      CombineCase{"mapped_scalar_H36", 29, 3, 36, true, true, 0, true}),
    [](const ::testing::TestParamInfo<CombineCase>& i) { return i.param.name; });

}  // namespace
}  // namespace rdep::dispatch
