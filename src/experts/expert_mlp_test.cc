// Expert compute on the GPU against the double-precision host reference (include/rdep/core/expert_mlp.h)
// on bf16-rounded inputs: forward h and y, backward dx, dW1, dW2 (overwrite and accumulate), for
// per-expert row counts with empty, single-row and very uneven experts, on both GEMM paths.
//   build/src/experts/experts_test --gtest_filter='ExpertMlp*'
//
// Tolerances. Every bf16 output (h, y, dx) must satisfy ||out - ref|| / ||ref|| <= 1e-2 (Frobenius).
// The fp32 weight gradients are computed by fp32-accumulating GEMMs whose operands are bf16: x and dout
// exact, but z and dh are intermediates rounded to bf16 (unit roundoff 2^-9 ~ 2e-3 each, with h's
// rounding entering dh through silu' once more), so their relative error is a few 1e-3 at most; fp32
// accumulation over <= 300 rows adds ~1e-5. We require the same 1e-2 relative bound for dW (margin ~3x)
// and, elementwise for every output, max|out - ref| <= 5e-2 * max|ref| (catches a single bad row or
// column the norm would hide). Outputs are poisoned (bf16 0xFFFF, fp32 NaN) before each call, rows past
// M are checked to stay poisoned, and an empty expert's dW must be exactly 0 after an overwrite.
#include "rdep/experts/expert_mlp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "rdep/core/expert_mlp.h"
#include "rdep/core/random.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"

namespace rdep::kernels {
namespace {

constexpr double kRelTol = 1e-2;
constexpr double kMaxAbsFrac = 5e-2;
constexpr int64_t kPadRows = 3;  // rows past M in every activation buffer; must stay poisoned

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  void upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    ASSERT_EQ(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // done before work on a non-blocking stream reads it
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    EXPECT_EQ(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  // bf16 0xFFFF / fp32 NaN. cudaMemset runs on the legacy stream, which a non-blocking stream does not
  // wait for: finish it before the code under test runs, or its overwrite can land before the poison.
  void poison() {
    ASSERT_EQ(cudaMemset(p_, 0xFF, n_ * sizeof(T)), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

using Bf16Bits = uint16_t;
__nv_bfloat16* AsBf16(Bf16Bits* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

// Random bf16 tensor: host floats (already bf16 values) and their bits.
struct Bf16Tensor {
  std::vector<float> values;
  std::vector<Bf16Bits> bits;
};
Bf16Tensor RandomBf16(Rng& rng, size_t n, double scale) {
  Bf16Tensor t;
  t.values.resize(n);
  t.bits.resize(n);
  for (size_t i = 0; i < n; ++i) {
    t.bits[i] = FloatToBf16Bits(static_cast<float>(scale * rng.normal()));
    t.values[i] = Bf16BitsToFloat(t.bits[i]);
  }
  return t;
}

struct ErrorStats {
  double rel = 0, max_abs = 0, max_ref = 0;
};
// out has at least ref.size() entries; `decode` maps an out element to double.
template <typename T, typename Decode>
ErrorStats Compare(const std::vector<T>& out, const std::vector<double>& ref, Decode decode, const std::vector<double>* base = nullptr) {
  double num = 0, den = 0;
  ErrorStats s;
  for (size_t i = 0; i < ref.size(); ++i) {
    double o = decode(out[i]);
    if (base) o -= (*base)[i];
    const double d = o - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    s.max_abs = std::isnan(d) ? NAN : std::max(s.max_abs, std::fabs(d));
    if (std::isnan(d)) num = NAN;
    s.max_ref = std::max(s.max_ref, std::fabs(ref[i]));
  }
  s.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return s;
}

double DecodeBf16(Bf16Bits b) { return Bf16BitsToFloat(b); }
double DecodeF32(float f) { return f; }

#define EXPECT_CLOSE(what, stats)                                                                           \
  do {                                                                                                      \
    const ErrorStats s_ = (stats);                                                                          \
    EXPECT_LE(s_.rel, kRelTol) << what << ": relative error";                                               \
    EXPECT_LE(s_.max_abs, kMaxAbsFrac * s_.max_ref + 1e-30) << what << ": max abs error (max |ref| " << s_.max_ref << ")"; \
  } while (0)

struct Case {
  int64_t H, F;
  std::vector<int64_t> rows;
  ExpertMlpConfig config;
  uint64_t seed = 7;
};

void RunCase(const Case& c) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t E = static_cast<int64_t>(c.rows.size()), H = c.H, F = c.F;
  const int64_t M = std::accumulate(c.rows.begin(), c.rows.end(), int64_t{0});
  const int64_t R = M + kPadRows;  // allocated rows
  const auto sz = [](int64_t v) { return static_cast<size_t>(v); };
  std::vector<int64_t> off(sz(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[sz(e) + 1] = off[sz(e)] + c.rows[sz(e)];

  Rng rng(c.seed, static_cast<uint64_t>(H * 131 + F));
  Bf16Tensor x = RandomBf16(rng, sz(M * H), 1.0);
  Bf16Tensor w1 = RandomBf16(rng, sz(E * H * 2 * F), 1.0 / std::sqrt(static_cast<double>(H)));
  Bf16Tensor w2 = RandomBf16(rng, sz(E * F * H), 1.0 / std::sqrt(static_cast<double>(F)));
  Bf16Tensor dout = RandomBf16(rng, sz(M * H), 1.0);

  // Reference in double.
  std::vector<double> ref_h(sz(M * 2 * F)), ref_y(sz(M * H)), ref_dx(sz(M * H));
  std::vector<double> ref_dw1(sz(E * H * 2 * F), 0.0), ref_dw2(sz(E * F * H), 0.0);
  {
    std::vector<double> z(sz(F)), scratch(sz(3 * F)), d(sz(H));
    for (int64_t e = 0; e < E; ++e) {
      const float* w1e = w1.values.data() + e * H * 2 * F;
      const float* w2e = w2.values.data() + e * F * H;
      for (int64_t r = off[sz(e)]; r < off[sz(e) + 1]; ++r) {
        mlp::Forward<double>(x.values.data() + r * H, w1e, w2e, H, F, ref_h.data() + r * 2 * F, z.data(),
                             ref_y.data() + r * H);
        for (int64_t i = 0; i < H; ++i) d[sz(i)] = dout.values[sz(r * H + i)];
        mlp::Backward<double>(x.values.data() + r * H, w1e, w2e, H, F, ref_h.data() + r * 2 * F, d.data(),
                              ref_dw1.data() + e * H * 2 * F, ref_dw2.data() + e * F * H, ref_dx.data() + r * H,
                              scratch.data());
      }
    }
  }

  ExpertMlpDesc desc{E, H, F, R};
  auto mlp_or = ExpertMlp::Create(desc, 0, c.config);
  ASSERT_TRUE(mlp_or.ok()) << mlp_or.status();
  ExpertMlp& mlp = **mlp_or;

  std::vector<Bf16Bits> x_pad = x.bits, dout_pad = dout.bits;
  x_pad.resize(sz(R * H), FloatToBf16Bits(1.0f));
  dout_pad.resize(sz(R * H), FloatToBf16Bits(1.0f));
  DeviceBuffer<Bf16Bits> d_x(sz(R * H)), d_w1(w1.bits.size()), d_w2(w2.bits.size()), d_dout(sz(R * H));
  DeviceBuffer<Bf16Bits> d_h(sz(R * 2 * F)), d_y(sz(R * H)), d_dx(sz(R * H));
  DeviceBuffer<float> d_dw1(ref_dw1.size()), d_dw2(ref_dw2.size());
  d_x.upload(x_pad);
  d_w1.upload(w1.bits);
  d_w2.upload(w2.bits);
  d_dout.upload(dout_pad);
  d_h.poison();
  d_y.poison();
  d_dx.poison();
  d_dw1.poison();
  d_dw2.poison();

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Status st = mlp.Forward(AsBf16(d_x.get()), c.rows.data(), AsBf16(d_w1.get()), AsBf16(d_w2.get()),
                          AsBf16(d_h.get()), AsBf16(d_y.get()), stream);
  ASSERT_TRUE(st.ok()) << st;
  st = mlp.Backward(AsBf16(d_x.get()), AsBf16(d_h.get()), AsBf16(d_dout.get()), c.rows.data(), AsBf16(d_w1.get()),
                    AsBf16(d_w2.get()), AsBf16(d_dx.get()), d_dw1.get(), d_dw2.get(), /*accumulate=*/false, stream);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

  const auto h = d_h.download(), y = d_y.download(), dx = d_dx.download();
  const auto dw1 = d_dw1.download(), dw2 = d_dw2.download();
  if (M > 0) {
    EXPECT_CLOSE("h", Compare(h, ref_h, DecodeBf16));
    EXPECT_CLOSE("y", Compare(y, ref_y, DecodeBf16));
    EXPECT_CLOSE("dx", Compare(dx, ref_dx, DecodeBf16));
  }
  // Rows past M are never written.
  for (size_t i = sz(M * 2 * F); i < h.size(); ++i) ASSERT_EQ(h[i], 0xFFFF) << "h written past M at " << i;
  for (size_t i = sz(M * H); i < y.size(); ++i) ASSERT_EQ(y[i], 0xFFFF) << "y written past M at " << i;
  for (size_t i = sz(M * H); i < dx.size(); ++i) ASSERT_EQ(dx[i], 0xFFFF) << "dx written past M at " << i;
  // Weight gradients, per expert (an empty expert's must be exactly zero).
  for (int64_t e = 0; e < E; ++e) {
    const size_t n1 = sz(H * 2 * F), n2 = sz(F * H), b1 = sz(e) * n1, b2 = sz(e) * n2;
    std::vector<float> g1(dw1.begin() + b1, dw1.begin() + b1 + n1), g2(dw2.begin() + b2, dw2.begin() + b2 + n2);
    std::vector<double> r1(ref_dw1.begin() + b1, ref_dw1.begin() + b1 + n1), r2(ref_dw2.begin() + b2, ref_dw2.begin() + b2 + n2);
    if (c.rows[sz(e)] == 0) {
      for (float v : g1) ASSERT_EQ(v, 0.0f) << "dW1 of empty expert " << e;
      for (float v : g2) ASSERT_EQ(v, 0.0f) << "dW2 of empty expert " << e;
      continue;
    }
    EXPECT_CLOSE("dW1 expert " + std::to_string(e), Compare(g1, r1, DecodeF32));
    EXPECT_CLOSE("dW2 expert " + std::to_string(e), Compare(g2, r2, DecodeF32));
  }

  // Accumulate: dW starts from a random fp32 value and must end at init + grad.
  Rng rng_init(c.seed + 1);
  std::vector<float> init1(ref_dw1.size()), init2(ref_dw2.size());
  for (auto& v : init1) v = static_cast<float>(rng_init.normal());
  for (auto& v : init2) v = static_cast<float>(rng_init.normal());
  d_dw1.upload(init1);
  d_dw2.upload(init2);
  d_dx.poison();
  st = mlp.Backward(AsBf16(d_x.get()), AsBf16(d_h.get()), AsBf16(d_dout.get()), c.rows.data(), AsBf16(d_w1.get()),
                    AsBf16(d_w2.get()), AsBf16(d_dx.get()), d_dw1.get(), d_dw2.get(), /*accumulate=*/true, stream);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const auto acc1 = d_dw1.download(), acc2 = d_dw2.download();
  const auto dx2 = d_dx.download();
  if (M > 0) EXPECT_CLOSE("dx (accumulate call)", Compare(dx2, ref_dx, DecodeBf16));
  for (int64_t e = 0; e < E; ++e) {
    const size_t n1 = sz(H * 2 * F), n2 = sz(F * H), b1 = sz(e) * n1, b2 = sz(e) * n2;
    std::vector<float> g1(acc1.begin() + b1, acc1.begin() + b1 + n1), g2(acc2.begin() + b2, acc2.begin() + b2 + n2);
    std::vector<double> i1(init1.begin() + b1, init1.begin() + b1 + n1), i2(init2.begin() + b2, init2.begin() + b2 + n2);
    if (c.rows[sz(e)] == 0) {
      for (size_t i = 0; i < n1; ++i) ASSERT_EQ(g1[i], init1[b1 + i]) << "accumulate changed empty expert " << e;
      for (size_t i = 0; i < n2; ++i) ASSERT_EQ(g2[i], init2[b2 + i]) << "accumulate changed empty expert " << e;
      continue;
    }
    std::vector<double> r1(ref_dw1.begin() + b1, ref_dw1.begin() + b1 + n1), r2(ref_dw2.begin() + b2, ref_dw2.begin() + b2 + n2);
    EXPECT_CLOSE("accumulated dW1 expert " + std::to_string(e), Compare(g1, r1, DecodeF32, &i1));
    EXPECT_CLOSE("accumulated dW2 expert " + std::to_string(e), Compare(g2, r2, DecodeF32, &i2));
  }
  cudaStreamDestroy(stream);
}

ExpertMlpConfig Lt(int streams) {
  ExpertMlpConfig c;
  c.path = GemmPath::kLtPerExpert;
  c.num_streams = streams;
  return c;
}
ExpertMlpConfig Grouped() {
  ExpertMlpConfig c;
  c.path = GemmPath::kGrouped;
  return c;
}

TEST(ExpertMlp_Cuda_bf16, E5_H256_F128_Uneven) { RunCase({256, 128, {0, 1, 300, 0, 17}, Lt(4)}); }
TEST(ExpertMlp_Cuda_bf16, E5_H256_F128_Uneven_OneStream) { RunCase({256, 128, {0, 1, 300, 0, 17}, Lt(1)}); }
TEST(ExpertMlp_Cuda_bf16, E5_H256_F128_Uneven_Grouped) { RunCase({256, 128, {0, 1, 300, 0, 17}, Grouped()}); }
TEST(ExpertMlp_Cuda_bf16, E4_H128_F64_AllToOne) { RunCase({128, 64, {0, 0, 129, 0}, Lt(4)}); }
TEST(ExpertMlp_Cuda_bf16, E4_H128_F64_AllToOne_Grouped) { RunCase({128, 64, {0, 0, 129, 0}, Grouped()}); }
TEST(ExpertMlp_Cuda_bf16, E3_H64_F32_AllEmpty) { RunCase({64, 32, {0, 0, 0}, Lt(4)}); }
TEST(ExpertMlp_Cuda_bf16, E3_H64_F32_AllEmpty_Grouped) { RunCase({64, 32, {0, 0, 0}, Grouped()}); }
TEST(ExpertMlp_Cuda_bf16, E8_H512_F256_Random) {
  Rng rng(11);
  std::vector<int64_t> rows(8);
  for (auto& r : rows) r = static_cast<int64_t>(rng.below(65));
  rows[3] = 0;
  RunCase({512, 256, rows, Lt(3)});
}
TEST(ExpertMlp_Cuda_bf16, E5_H256_F128_Uneven_Auto) { RunCase({256, 128, {0, 1, 300, 0, 17}, ExpertMlpConfig{}}); }
TEST(ExpertMlp_Cuda_bf16, E2_H256_F128_Large_Auto) { RunCase({256, 128, {300, 600}, ExpertMlpConfig{}}); }
TEST(ExpertMlp_Cuda_bf16, E2_H2048_F1408_Moonlight) { RunCase({2048, 1408, {37, 96}, Lt(4)}); }
TEST(ExpertMlp_Cuda_bf16, E2_H2048_F1408_Moonlight_Grouped) { RunCase({2048, 1408, {37, 96}, Grouped()}); }

// Shape and argument checks (no GPU needed for Validate).
TEST(ExpertMlp_Desc, RejectsBadShapes) {
  EXPECT_TRUE((ExpertMlpDesc{4, 256, 128, 100}.Validate().ok()));
  EXPECT_FALSE((ExpertMlpDesc{0, 256, 128, 100}.Validate().ok()));
  EXPECT_FALSE((ExpertMlpDesc{4, 250, 128, 100}.Validate().ok()));  // H % 8
  EXPECT_FALSE((ExpertMlpDesc{4, 256, 124, 100}.Validate().ok()));  // F % 8
  EXPECT_FALSE((ExpertMlpDesc{4, 256, 128, -1}.Validate().ok()));
}

TEST(ExpertMlp_Cuda_bf16, RejectsTooManyRows) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto mlp = ExpertMlp::Create({2, 64, 32, 10}, 0);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  const int64_t rows[2] = {6, 5};
  DeviceBuffer<Bf16Bits> buf(1024);
  __nv_bfloat16* p = AsBf16(buf.get());
  const Status st = (*mlp)->Forward(p, rows, p, p, p, p, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
}

}  // namespace
}  // namespace rdep::kernels
