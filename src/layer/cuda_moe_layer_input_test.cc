// The CUDA layer refuses bad routing input with InvalidArgument naming the rank, token and slot:
// an expert id equal to E, a negative one, an expert twice in a token, a negative gate, a NaN gate,
// and num_tokens above T. The faulty rank still takes part in the collective, so the other rank's
// forward succeeds, and the next forward with good input works on both (W = 2, sharing a GPU when
// the machine has one). Run under compute-sanitizer on the device to check that nothing is written
// out of bounds.
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

constexpr int64_t kT = 16, kK = 2, kE = 8, kH = 64, kF = 32;

struct Poison {
  const char* name;
  int64_t token, slot;
  int32_t expert;   // -2: keep; -3: the other slot's expert (a repeat)
  float gate;       // -7: keep
  const char* says;  // part of the message
};
void PrintTo(const Poison& p, std::ostream* os) { *os << p.name; }

// One rank's device inputs, exactly n*K and n*H long, freed at scope exit.
struct Inputs {
  int32_t* e = nullptr;
  float *g = nullptr, *dg = nullptr;
  __nv_bfloat16 *x = nullptr, *y = nullptr;
  ~Inputs() {
    for (void* p : {static_cast<void*>(e), static_cast<void*>(g), static_cast<void*>(dg), static_cast<void*>(x), static_cast<void*>(y)})
      if (p) cudaFree(p);
  }
  Status Upload(const RankRouting& rr) {
    const size_t nk = rr.experts.size(), nh = static_cast<size_t>(rr.num_tokens * kH);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&e, std::max<size_t>(nk, 1) * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&g, std::max<size_t>(nk, 1) * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&x, std::max<size_t>(nh, 1) * 2));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&y, std::max<size_t>(nh, 1) * 2));
    if (nk) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(e, rr.experts.data(), nk * 4, cudaMemcpyHostToDevice));
    if (nk) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(g, rr.gates.data(), nk * 4, cudaMemcpyHostToDevice));
    std::vector<uint16_t> ones(std::max<size_t>(nh, 1), FloatToBf16Bits(0.25f));
    return cuda::CudaStatus(cudaMemcpy(x, ones.data(), ones.size() * 2, cudaMemcpyHostToDevice), "x", __FILE__, __LINE__);
  }
};

class CudaMoELayerInput : public ::testing::TestWithParam<Poison> {};

TEST_P(CudaMoELayerInput, W2_BadSlotIsInvalidArgumentNamingRankTokenSlot) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const Poison& p = GetParam();
  LayerConfig cfg;
  cfg.shape = {.tokens = kT, .hidden = kH, .ffn = kF, .experts = kE, .topk = kK, .ranks = 2};
  auto domain = CudaDomain::CreateSingleProcess(2, {.barrier_timeout_s = 10, .devices = RoundRobinDevices(2, std::min(2, cuda::DeviceCount()))});
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, cfg, *OwnershipMap::Contiguous(kE, 2), RandomWeights(cfg.shape, 3));
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Routing good = *GenerateRouting(cfg.shape, RoutingSpec{});
  Routing bad = good;
  RankRouting& r1 = bad[1];
  const auto i = static_cast<size_t>(p.token * kK + p.slot);
  if (p.expert == -3) r1.experts[i] = r1.experts[static_cast<size_t>(p.token * kK + (p.slot ^ 1))];
  else if (p.expert != -2) r1.experts[i] = p.expert;
  if (p.gate != -7.f) r1.gates[i] = p.gate;
  std::vector<Status> first(2), second(2);
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    for (int call = 0; call < 2; ++call) {
      const RankRouting& rr = (call == 0 ? bad : good)[static_cast<size_t>(r)];
      Inputs in;
      RDEP_RETURN_IF_ERROR(in.Upload(rr));
      (call == 0 ? first : second)[static_cast<size_t>(r)] = (*layer)->Forward(r, in.e, in.g, rr.num_tokens, in.x, in.y);
      RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(first[0].ok()) << "the good rank's forward: " << first[0];
  ASSERT_FALSE(first[1].ok()) << p.name << " was accepted";
  EXPECT_EQ(first[1].code(), StatusCode::kInvalidArgument) << first[1];
  const std::string want = "rank 1: routing token " + std::to_string(p.token) + " slot " + std::to_string(p.slot) + ": ";
  EXPECT_NE(first[1].message().find(want), std::string::npos) << first[1] << "\nwanted: " << want;
  EXPECT_NE(first[1].message().find(p.says), std::string::npos) << first[1] << "\nwanted: " << p.says;
  EXPECT_TRUE(second[0].ok()) << second[0];
  EXPECT_TRUE(second[1].ok()) << second[1];
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaMoELayerInput,
    ::testing::Values(Poison{"expert_equal_to_E", 3, 1, static_cast<int32_t>(kE), -7.f, "expert 8 outside [0, E=8)"},
                      Poison{"negative_expert", 0, 0, -1, -7.f, "expert -1 outside [0, E=8)"},
                      Poison{"expert_twice", 5, 1, -3, -7.f, "chosen twice"},
                      Poison{"negative_gate", 15, 0, -2, -0.5f, "gate -0.5 is negative or not finite"},
                      Poison{"nan_gate", 7, 1, -2, std::numeric_limits<float>::quiet_NaN(), "gate nan is negative or not finite"},
                      Poison{"infinite_gate", 2, 0, -2, std::numeric_limits<float>::infinity(), "gate inf is negative or not finite"}),
    [](const ::testing::TestParamInfo<Poison>& i) { return std::string(i.param.name); });

// A W = 2 layer sharing the GPU, for forwards where rank 0 makes a bad call and rank 1 a good one.
class CudaMoELayerInput_Count : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    LayerConfig cfg;
    cfg.shape = {.tokens = kT, .hidden = kH, .ffn = kF, .experts = kE, .topk = kK, .ranks = 2};
    auto domain = CudaDomain::CreateSingleProcess(2, {.barrier_timeout_s = 10, .devices = RoundRobinDevices(2, 1)});
    ASSERT_TRUE(domain.ok()) << domain.status();
    domain_ = std::move(*domain);
    auto layer = CudaMoELayer::Create(*domain_, cfg, *OwnershipMap::Contiguous(kE, 2), RandomWeights(cfg.shape, 3));
    ASSERT_TRUE(layer.ok()) << layer.status();
    layer_ = std::move(*layer);
    good_ = *GenerateRouting(cfg.shape, RoutingSpec{});
  }

  // One forward: rank 0 calls rank0(layer, its inputs), rank 1 forwards its good routing. Expects both ranks to
  // finish, rank 1's forward to succeed and rank 0's to be InvalidArgument saying `says`.
  void ExpectRank0Refused(const std::function<Status(CudaMoELayer&, Inputs&)>& rank0, const std::string& says) {
    std::vector<Status> got(2);
    Status s = domain_->Run([&](int32_t r) -> Status {
      Inputs in;
      RDEP_RETURN_IF_ERROR(in.Upload(good_[static_cast<size_t>(r)]));
      got[static_cast<size_t>(r)] = r == 0 ? rank0(*layer_, in) : layer_->Forward(r, in.e, in.g, kT, in.x, in.y);
      return domain_->Synchronize(r);
    });
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(got[1].ok()) << got[1];
    ASSERT_FALSE(got[0].ok());
    EXPECT_EQ(got[0].code(), StatusCode::kInvalidArgument);
    EXPECT_NE(got[0].message().find(says), std::string::npos) << got[0];
  }

  std::unique_ptr<CudaDomain> domain_;
  std::unique_ptr<CudaMoELayer> layer_;
  Routing good_;
};

// num_tokens above T (or negative) is refused on that rank; the other rank's forward completes.
TEST_F(CudaMoELayerInput_Count, W2_TokensAboveTIsInvalidArgumentAndPeersFinish) {
  for (int64_t bad_n : {kT + 1, int64_t{-1}})
    ExpectRank0Refused([&](CudaMoELayer& l, Inputs& in) { return l.Forward(0, in.e, in.g, bad_n, in.x, in.y); },
                       "rank 0: num_tokens " + std::to_string(bad_n) + " outside [0, T=16]");
}

// A null experts or gates array with tokens (the C ABI refuses it first; the C++ API is checked here): that rank
// takes part with no tokens and is refused naming the array; the other rank's forward completes.
TEST_F(CudaMoELayerInput_Count, W2_NullRoutingArrayIsInvalidArgumentAndPeersFinish) {
  ExpectRank0Refused([](CudaMoELayer& l, Inputs& in) { return l.Forward(0, nullptr, in.g, kT, in.x, in.y); },
                     "rank 0: experts is null for 16 tokens");
  ExpectRank0Refused([](CudaMoELayer& l, Inputs& in) { return l.Forward(0, in.e, nullptr, kT, in.x, in.y); },
                     "rank 0: gates is null for 16 tokens");
}

}  // namespace
}  // namespace rdep
#endif
