// rdep_master_adamw and rdep_grad_accumulate through the C ABI: the host paths against the host references
// (bitwise; several tensors in one call), and errors that name the field or tensor before anything is touched.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "rdep/capi.h"
#include "rdep/cuda/bf16.h"
#include "rdep/optim/grad_accumulate.h"
#include "rdep/optim/master_adamw.h"

namespace rdep {
namespace {

struct Arrays {
  std::vector<float> master, m, v;
  std::vector<uint16_t> grad, param;
  explicit Arrays(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, 0.02f);
    for (size_t i = 0; i < n; ++i) {
      master.push_back(d(rng));
      m.push_back(d(rng) * 1e-2f);
      v.push_back(std::abs(d(rng)) * 1e-3f);  // a second moment: >= 0
      grad.push_back(FloatToBf16Bits(d(rng) * 0.1f));
      param.push_back(0);
    }
  }
  rdep_adamw_tensor Abi() {
    return {master.data(), m.data(), v.data(), grad.data(), param.data(), static_cast<int64_t>(master.size()), RDEP_ADAMW_GRAD_BF16};
  }
  optim::MasterTensor Ref() {
    return {master.data(), m.data(), v.data(), grad.data(), param.data(), static_cast<int64_t>(master.size())};
  }
};

rdep_adamw_step HostStep() {
  rdep_adamw_step s{};
  s.lr = 1e-3f;
  s.beta1 = 0.9f;
  s.beta2 = 0.95f;
  s.eps = 1e-8f;
  s.weight_decay = 0.1f;
  s.device = -1;
  s.step = 3;
  return s;
}

TEST(CApiMasterAdamW, HostPathIsTheReference) {
  Arrays a(1000, 1), b(37, 2), ra(1000, 1), rb(37, 2);
  rdep_adamw_tensor ts[] = {a.Abi(), b.Abi()};
  rdep_adamw_step s = HostStep();
  const float scale = 0.5f;
  s.grad_scale = &scale;
  ASSERT_EQ(rdep_master_adamw(ts, 2, &s), 0) << rdep_last_error();
  const optim::AdamWCoeffs c = optim::Coeffs({s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step});
  optim::MasterAdamWHost(ra.Ref(), c, &scale);
  optim::MasterAdamWHost(rb.Ref(), c, &scale);
  EXPECT_EQ(a.master, ra.master);
  EXPECT_EQ(a.m, ra.m);
  EXPECT_EQ(a.v, ra.v);
  EXPECT_EQ(a.param, ra.param);
  EXPECT_EQ(b.master, rb.master);
  EXPECT_EQ(b.param, rb.param);
}

TEST(CApiMasterAdamW, Fp32GradientsOnTheHostPathAreTheReference) {
  Arrays a(1001, 7), ra(1001, 7);
  std::vector<float> g32(a.master.size());
  std::mt19937 rng(8);
  std::normal_distribution<float> d(0.f, 0.01f);
  for (float& x : g32) x = d(rng);  // not bf16 values
  rdep_adamw_tensor t = a.Abi();
  t.grad = g32.data();
  t.grad_dtype = RDEP_ADAMW_GRAD_FP32;
  rdep_adamw_step s = HostStep();
  ASSERT_EQ(rdep_master_adamw(&t, 1, &s), 0) << rdep_last_error();
  optim::MasterTensor r = ra.Ref();
  r.grad = g32.data();
  r.grad_dtype = optim::GradDtype::kFp32;
  optim::MasterAdamWHost(r, optim::Coeffs({s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step}), nullptr);
  EXPECT_EQ(a.master, ra.master);
  EXPECT_EQ(a.m, ra.m);
  EXPECT_EQ(a.v, ra.v);
  EXPECT_EQ(a.param, ra.param);
  t.grad_dtype = 7;
  EXPECT_NE(rdep_master_adamw(&t, 1, &s), 0);
  EXPECT_NE(std::string(rdep_last_error()).find("adamw tensor 0: grad_dtype must be 0 (bf16) or 1 (fp32), got 7"), std::string::npos)
      << rdep_last_error();
}

TEST(CApiMasterAdamW, ErrorsNameTheFieldAndTouchNothing) {
  Arrays a(16, 3), b(16, 4);
  const Arrays before = a;
  rdep_adamw_tensor ts[] = {a.Abi(), b.Abi()};
  auto fails = [&](rdep_adamw_step s, int32_t count, const rdep_adamw_tensor* t, const std::string& what) {
    EXPECT_NE(rdep_master_adamw(t, count, &s), 0) << what;
    EXPECT_NE(std::string(rdep_last_error()).find(what), std::string::npos) << rdep_last_error();
  };
  EXPECT_NE(rdep_master_adamw(ts, 2, nullptr), 0);
  EXPECT_NE(std::string(rdep_last_error()).find("step must not be null"), std::string::npos);
  fails(HostStep(), -1, ts, "count must be >= 0");
  fails(HostStep(), 1, nullptr, "tensors not null");
  rdep_adamw_step s = HostStep();
  s.beta2 = 1.f;
  fails(s, 2, ts, "beta2 must be in [0, 1)");
  s = HostStep();
  s.step = 0;
  fails(s, 2, ts, "step must be >= 1");
  s = HostStep();
  s.device = -2;
  fails(s, 2, ts, "device must be -1 (host) or a CUDA device");
  ts[1].grad = ts[0].grad;  // two tensors reading one gradient: refused before either is updated
  fails(HostStep(), 2, ts, "adamw tensors 0 and 1 overlap (grad of 0, grad of 1)");
  ts[1] = b.Abi();
  ts[1].exp_avg_sq = ts[1].exp_avg;  // tensor 1 is bad: tensor 0 must not have been updated either
  fails(HostStep(), 2, ts, "adamw tensor 1: exp_avg and exp_avg_sq overlap");
  EXPECT_EQ(a.master, before.master);
  EXPECT_EQ(a.param, before.param);
  s = HostStep();
  EXPECT_EQ(rdep_master_adamw(ts, 0, &s), 0) << "no tensors: nothing to do";
}

TEST(CApiMasterAdamW, AMissingDeviceIsNamed) {
  Arrays a(8, 5);
  rdep_adamw_tensor t = a.Abi();
  rdep_adamw_step s = HostStep();
  s.device = 4096;
  EXPECT_NE(rdep_master_adamw(&t, 1, &s), 0);
  const std::string e = rdep_last_error();
  EXPECT_TRUE(e.find("device 4096") != std::string::npos || e.find("cuda") != std::string::npos ||
              e.find("CUDA") != std::string::npos)
      << e;
}

TEST(CApiGradAccumulate, HostPathIsTheReference) {
  for (const int32_t add : {1, 0}) {
    Arrays a(1001, 6);
    std::vector<float> ref = a.m;  // any fp32 values: the accumulator
    std::vector<float> got = a.m;
    optim::GradAccumulateHost({ref.data(), a.grad.data(), 1001, add == 1});
    ASSERT_EQ(rdep_grad_accumulate(got.data(), a.grad.data(), 1001, add, -1, nullptr), 0) << rdep_last_error();
    EXPECT_EQ(got, ref) << "add " << add;
  }
}

TEST(CApiGradAccumulate, ErrorsNameTheFieldAndTouchNothing) {
  Arrays a(8, 7);
  std::vector<float> acc = a.m;
  const std::vector<float> before = acc;
  auto fails = [&](float* p, const void* g, int64_t n, int32_t add, int32_t device, const std::string& want) {
    EXPECT_NE(rdep_grad_accumulate(p, g, n, add, device, nullptr), 0) << want;
    const std::string e = rdep_last_error();
    EXPECT_NE(e.find(want), std::string::npos) << e;
    EXPECT_EQ(acc, before) << want;
  };
  fails(acc.data(), a.grad.data(), 8, 2, -1, "add must be 0 (copy) or 1 (add), got 2");
  fails(acc.data(), a.grad.data(), 8, 1, -2, "device must be -1 (host) or a CUDA device, got -2");
  fails(acc.data(), a.grad.data(), -1, 1, -1, "numel must be >= 0, got -1");
  fails(nullptr, a.grad.data(), 8, 1, -1, "acc (the fp32 accumulator) is null");
  fails(acc.data(), nullptr, 8, 1, -1, "grad (the bf16 gradient) is null");
  fails(acc.data(), acc.data() + 1, 8, 1, -1, "acc and grad overlap");
  EXPECT_NE(rdep_grad_accumulate(acc.data(), a.grad.data(), 8, 1, 4096, nullptr), 0);
  const std::string e = rdep_last_error();  // the missing device, or no CUDA (a host-only build, no GPU)
  EXPECT_TRUE(e.find("device 4096") != std::string::npos || e.find("cuda") != std::string::npos ||
              e.find("CUDA") != std::string::npos)
      << e;
  EXPECT_EQ(acc, before);
  EXPECT_EQ(rdep_grad_accumulate(nullptr, nullptr, 0, 1, -1, nullptr), 0) << "nothing to move";
}

}  // namespace
}  // namespace rdep
