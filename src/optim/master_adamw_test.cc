// AdamW with fp32 master weights: the host reference against the update evaluated in double, the argument
// checks, and the CUDA kernel against the host reference (bitwise: both round every fp32 operation in the
// same order), on fresh random inputs, aligned and unaligned arrays, with poisoned guard elements around
// every array that must come back untouched.
#include "rdep/optim/master_adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "rdep/cuda/bf16.h"
#if defined(RDEP_HAVE_CUDA)
#include "optim/optim_test_util.h"
#include "rdep/cuda/check.h"
#endif

namespace rdep::optim {
namespace {

#if defined(RDEP_HAVE_CUDA)
using test_util::Download;
using test_util::Guarded;
using test_util::Upload;
#endif

// A tensor's arrays; the gradient in bf16 (grad) or, with fp32_grad, in fp32 (grad32: values bf16 cannot hold,
// so a gradient rounded to bf16 anywhere would show).
struct State {
  std::vector<float> master, m, v;
  std::vector<uint16_t> grad, param;
  std::vector<float> grad32;
  bool fp32_grad = false;
  double GradAt(size_t i) const { return fp32_grad ? double{grad32[i]} : double{Bf16BitsToFloat(grad[i])}; }
};

State RandomState(int64_t n, uint32_t seed, bool fresh_moments, bool fp32_grad = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> w(0.f, 0.02f), g(0.f, 1e-3f);
  std::uniform_real_distribution<float> mom(-1e-3f, 1e-3f), sq(0.f, 1e-6f);
  State s;
  s.fp32_grad = fp32_grad;
  for (int64_t i = 0; i < n; ++i) {
    s.master.push_back(w(rng));
    s.m.push_back(fresh_moments ? 0.f : mom(rng));
    s.v.push_back(fresh_moments ? 0.f : sq(rng));
    const float gi = g(rng);
    s.grad.push_back(FloatToBf16Bits(gi));
    s.grad32.push_back(gi);
    s.param.push_back(FloatToBf16Bits(s.master.back()));
  }
  return s;
}

MasterTensor View(State& s) {
  const void* grad = s.fp32_grad ? static_cast<const void*>(s.grad32.data()) : static_cast<const void*>(s.grad.data());
  return {s.master.data(), s.m.data(), s.v.data(), grad, s.param.data(), static_cast<int64_t>(s.master.size()),
          s.fp32_grad ? GradDtype::kFp32 : GradDtype::kBf16};
}

// The update in double from the same inputs (master_adamw.h's formula).
void ExpectMatchesDouble(const State& before, const State& after, const AdamWHyper& h, double scale) {
  const double bc1 = 1.0 - std::pow(double{h.beta1}, double(h.step)), bc2 = 1.0 - std::pow(double{h.beta2}, double(h.step));
  for (size_t i = 0; i < before.master.size(); ++i) {
    const double g = before.GradAt(i) * scale;
    const double m = before.m[i] + (1.0 - h.beta1) * (g - before.m[i]);
    const double v = h.beta2 * double{before.v[i]} + (1.0 - h.beta2) * g * g;
    const double update = h.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
    const double w = before.master[i] * (1.0 - double{h.lr} * h.weight_decay) - update;
    // fp32 against double, relative to the operands' sizes (the sums cancel): a few fp32 roundings each.
    ASSERT_NEAR(after.m[i], m, 1e-6 * (std::abs(before.m[i]) + std::abs(g)) + 1e-30) << "exp_avg " << i;
    ASSERT_NEAR(after.v[i], v, 1e-6 * (before.v[i] + g * g) + 1e-30) << "exp_avg_sq " << i;
    ASSERT_NEAR(after.master[i], w, 1e-6 * (std::abs(before.master[i]) + std::abs(update)) + 1e-30) << "master " << i;
    ASSERT_EQ(after.param[i], FloatToBf16Bits(after.master[i])) << "param " << i << " is not bf16(master)";
  }
}

TEST(MasterAdamWHost, MatchesTheUpdateInDoubleOverSteps) {
  State s = RandomState(4099, 1, /*fresh_moments=*/true);
  AdamWHyper h{6e-4, 0.9, 0.95, 1e-8, 0.1, 1};
  for (int64_t step = 1; step <= 3; ++step) {
    h.step = step;
    const State before = s;
    MasterAdamWHost(View(s), Coeffs(h), nullptr);
    ExpectMatchesDouble(before, s, h, 1.0);
    std::mt19937 rng(static_cast<uint32_t>(100 + step));  // the next step's gradient
    std::normal_distribution<float> g(0.f, 1e-3f);
    for (auto& x : s.grad) x = FloatToBf16Bits(g(rng));
  }
}

TEST(MasterAdamWHost, Fp32GradientsAreReadUnrounded) {
  State s = RandomState(4099, 21, /*fresh_moments=*/false, /*fp32_grad=*/true);
  const AdamWHyper h{6e-4, 0.9, 0.95, 1e-8, 0.1, 4};
  const State before = s;
  const float scale = 0.83f;
  MasterAdamWHost(View(s), Coeffs(h), &scale);
  ExpectMatchesDouble(before, s, h, double{scale});
  // The same update from the gradients rounded to bf16 differs: the fp32 values were used as they are.
  State rounded = before;
  rounded.fp32_grad = false;
  MasterAdamWHost(View(rounded), Coeffs(h), &scale);
  size_t differ = 0;
  for (size_t i = 0; i < s.m.size(); ++i) differ += s.m[i] != rounded.m[i];
  EXPECT_GT(differ, s.m.size() / 2);
}

TEST(MasterAdamWHost, ScalesTheGradient) {
  State s = RandomState(1000, 2, /*fresh_moments=*/false);
  const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, 7};
  const State before = s;
  const float scale = 0.37f;
  MasterAdamWHost(View(s), Coeffs(h), &scale);
  ExpectMatchesDouble(before, s, h, double{scale});
}

TEST(MasterAdamWHost, SmallBeta1TakesLerpsOtherBranch) {  // 1 - beta1 >= 0.5: g - (g - m) * (1 - w), as torch
  State s = RandomState(999, 5, /*fresh_moments=*/false);
  const AdamWHyper h{1e-3, 0.3, 0.99, 1e-8, 0.0, 2};
  const State before = s;
  MasterAdamWHost(View(s), Coeffs(h), nullptr);
  ExpectMatchesDouble(before, s, h, 1.0);
}

TEST(MasterAdamWHost, CoefficientsComeFromDoubles) {  // 1 - 0.999 is 0.001 rounded once, not 1 - 0.999f
  const AdamWCoeffs c = Coeffs({1e-3, 0.9, 0.999, 1e-8, 0.1, 1});
  EXPECT_EQ(c.one_minus_beta2, 0.001f);
  EXPECT_EQ(c.one_minus_beta1, 0.1f);
  EXPECT_EQ(c.decay, static_cast<float>(1.0 - 1e-4));
  EXPECT_EQ(c.step_size, static_cast<float>(1e-3 / (1.0 - 0.9)));
}

TEST(MasterAdamWHost, NoDecayNoStepLeavesWeights) {  // lr 0: master unchanged, moments still advance
  State s = RandomState(64, 3, /*fresh_moments=*/false);
  const State before = s;
  MasterAdamWHost(View(s), Coeffs({0.0, 0.9, 0.999, 1e-8, 0.1, 1}), nullptr);
  for (size_t i = 0; i < s.master.size(); ++i) {
    EXPECT_EQ(s.master[i], before.master[i]) << i;
    EXPECT_NE(s.m[i], before.m[i]) << i;
  }
}

TEST(MasterAdamWChecks, HyperparametersAreNamed) {
  const AdamWHyper ok{};
  EXPECT_TRUE(CheckHyper(ok).ok());
  auto named = [](AdamWHyper h, const char* field) {
    const Status s = CheckHyper(h);
    EXPECT_FALSE(s.ok()) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
  };
  AdamWHyper h = ok;
  h.lr = -1.0;
  named(h, "lr");
  h = ok;
  h.lr = NAN;
  named(h, "lr");
  h = ok;
  h.eps = -1e-8;
  named(h, "eps");
  h = ok;
  h.weight_decay = INFINITY;
  named(h, "weight_decay");
  h = ok;
  h.beta1 = 1.0;
  named(h, "beta1");
  h = ok;
  h.beta2 = -0.1;
  named(h, "beta2");
  h = ok;
  h.step = 0;
  named(h, "step");
}

TEST(MasterAdamWChecks, TensorsAreNamed) {
  State s = RandomState(16, 4, true);
  EXPECT_TRUE(CheckTensor(View(s), 0).ok());
  MasterTensor t = View(s);
  t.numel = -1;
  EXPECT_NE(CheckTensor(t, 3).message().find("adamw tensor 3: numel"), std::string::npos);
  t = View(s);
  t.grad = nullptr;
  EXPECT_NE(CheckTensor(t, 1).message().find("must not be null"), std::string::npos);
  t = View(s);
  t.exp_avg = s.master.data() + 8;  // inside master
  EXPECT_NE(CheckTensor(t, 2).message().find("master and exp_avg overlap"), std::string::npos);
  t = View(s);
  t.param = const_cast<uint16_t*>(s.grad.data());
  EXPECT_NE(CheckTensor(t, 0).message().find("grad and param overlap"), std::string::npos);
  t = View(s);
  t.grad_dtype = static_cast<GradDtype>(2);
  EXPECT_NE(CheckTensor(t, 5).message().find("adamw tensor 5: grad_dtype must be 0 (bf16) or 1 (fp32), got 2"), std::string::npos);
  // An fp32 gradient spans 4 bytes an element: a param starting halfway through it overlaps it.
  State wide = RandomState(16, 6, true, /*fp32_grad=*/true);
  t = View(wide);
  t.param = reinterpret_cast<uint16_t*>(wide.grad32.data() + 8);
  EXPECT_NE(CheckTensor(t, 0).message().find("grad and param overlap"), std::string::npos);
  t.grad_dtype = GradDtype::kBf16;  // as bf16 the same gradient ends where that param starts
  EXPECT_TRUE(CheckTensor(t, 0).ok());
  t = MasterTensor{};
  EXPECT_TRUE(CheckTensor(t, 0).ok()) << "an empty tensor needs no arrays";
  State other = RandomState(16, 5, true);
  EXPECT_TRUE(CheckDisjoint(View(s), 0, View(other), 1).ok());
  MasterTensor shifted = View(other);
  shifted.numel = 1;
  shifted.param = s.param.data() + 15;  // its one param element is s's last
  EXPECT_NE(CheckDisjoint(View(s), 0, shifted, 1).message().find("adamw tensors 0 and 1 overlap (param of 0, param of 1)"),
            std::string::npos);
}

#if defined(RDEP_HAVE_CUDA)
void RunKernelCase(int64_t n, int64_t skew, bool scaled, uint32_t seed, double beta1 = 0.9, bool fp32_grad = false) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  SCOPED_TRACE("numel " + std::to_string(n) + " skew " + std::to_string(skew) + (scaled ? " grad_scale" : "") +
               (fp32_grad ? " fp32 grad" : ""));
  State host = RandomState(n, seed, /*fresh_moments=*/false, fp32_grad);
  const float nanf = std::nanf("");
  const uint16_t nanb = 0x7FC1;
  Guarded<float> w, m, v, scale, g32;
  Guarded<uint16_t> g, p;
  ASSERT_TRUE(Upload(host.master, skew, nanf, &w).ok());
  ASSERT_TRUE(Upload(host.m, skew, nanf, &m).ok());
  ASSERT_TRUE(Upload(host.v, skew, nanf, &v).ok());
  ASSERT_TRUE(Upload(host.grad, skew, nanb, &g).ok());
  ASSERT_TRUE(Upload(host.grad32, skew, nanf, &g32).ok());
  std::vector<uint16_t> poisoned_param(static_cast<size_t>(n), nanb);  // the kernel writes every element
  ASSERT_TRUE(Upload(poisoned_param, skew, nanb, &p).ok());
  const float s = 0.61f;
  ASSERT_TRUE(Upload(std::vector<float>{s}, 0, nanf, &scale).ok());
  const AdamWHyper h{3e-4, beta1, 0.95, 1e-8, 0.1, 11};
  const MasterTensor dev{w.data(), m.data(), v.data(), fp32_grad ? static_cast<const void*>(g32.data()) : g.data(), p.data(), n,
                         fp32_grad ? GradDtype::kFp32 : GradDtype::kBf16};
  ASSERT_TRUE(CheckTensor(dev, 0).ok());
  const Status launched = LaunchMasterAdamW(dev, Coeffs(h), scaled ? scale.data() : nullptr, nullptr);
  ASSERT_TRUE(launched.ok()) << launched.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  MasterAdamWHost(View(host), Coeffs(h), scaled ? &s : nullptr);
  State got;
  Download(w, nanf, &got.master, "master");
  Download(m, nanf, &got.m, "exp_avg");
  Download(v, nanf, &got.v, "exp_avg_sq");
  Download(g, nanb, &got.grad, "grad");
  Download(g32, nanf, &got.grad32, "grad (fp32)");
  Download(p, nanb, &got.param, "param");
  std::vector<float> unused;
  Download(scale, nanf, &unused, "grad_scale");
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    ASSERT_EQ(std::memcmp(&got.master[k], &host.master[k], 4), 0) << "master " << i << ": " << got.master[k] << " vs " << host.master[k];
    ASSERT_EQ(std::memcmp(&got.m[k], &host.m[k], 4), 0) << "exp_avg " << i;
    ASSERT_EQ(std::memcmp(&got.v[k], &host.v[k], 4), 0) << "exp_avg_sq " << i;
    ASSERT_EQ(got.param[k], host.param[k]) << "param " << i;
    ASSERT_EQ(got.grad[k], host.grad[k]) << "grad " << i << " was written";
    ASSERT_EQ(std::memcmp(&got.grad32[k], &host.grad32[k], 4), 0) << "fp32 grad " << i << " was written";
  }
}

TEST(MasterAdamWCuda, MatchesHostBitwiseVectorized) {
  for (int64_t n : {1, 3, 4, 5, 1000, 4099, (1 << 20) + 3}) RunKernelCase(n, 0, false, static_cast<uint32_t>(n));
}

TEST(MasterAdamWCuda, MatchesHostBitwiseUnaligned) {
  for (int64_t n : {1, 7, 4099, 300001}) RunKernelCase(n, 1, false, static_cast<uint32_t>(n + 1));
}

TEST(MasterAdamWCuda, MatchesHostBitwiseWithGradScale) {
  RunKernelCase(65536 + 2, 0, true, 9);
  RunKernelCase(999, 1, true, 10);
}

TEST(MasterAdamWCuda, MatchesHostBitwiseWithSmallBeta1) {  // the lerp's other branch
  RunKernelCase(4099, 0, false, 11, 0.3);
  RunKernelCase(1001, 1, true, 12, 0.3);
}

TEST(MasterAdamWCuda, Fp32GradsMatchHostBitwise) {  // 16-byte gradient vectors, the unaligned kernel, the multiplier
  for (int64_t n : {1, 5, 4099, (1 << 20) + 3}) RunKernelCase(n, 0, false, static_cast<uint32_t>(n + 40), 0.9, true);
  for (int64_t n : {7, 4099}) RunKernelCase(n, 1, true, static_cast<uint32_t>(n + 41), 0.9, true);
  RunKernelCase(1001, 0, true, 42, 0.3, true);
}

TEST(MasterAdamWCuda, EmptyTensorLaunchesNothing) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(LaunchMasterAdamW(MasterTensor{}, Coeffs(AdamWHyper{}), nullptr, nullptr).ok());
}
#endif

}  // namespace
}  // namespace rdep::optim
