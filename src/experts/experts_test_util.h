// Test helpers shared by the expert compute tests: a device array freed at scope exit (with upload,
// download and 0xFF poisoning), random bf16 data, per-expert relative errors, and the CUTLASS compute
// made or the reason it cannot run here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "rdep/core/expert_mlp.h"
#include "rdep/core/random.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/experts/expert_compute.h"

namespace rdep::kernels::test_util {

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  // Upload and Poison finish before returning: the code under test runs on non-blocking streams, which
  // do not wait for the legacy stream's copies and memsets.
  void Upload(const std::vector<T>& v) {
    ASSERT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  void Poison() {
    ASSERT_EQ(cudaMemset(p, 0xFF, n * sizeof(T)), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  __nv_bfloat16* bf() const { return reinterpret_cast<__nv_bfloat16*>(p); }
};

// n bf16 values uniform in [-scale, scale), as raw bits.
inline std::vector<uint16_t> RandomBf16(size_t n, uint64_t seed, float scale) {
  Rng rng(seed);
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = FloatToBf16Bits(scale * static_cast<float>(rng.uniform() * 2 - 1));
  return v;
}

inline std::vector<double> AsDouble(const std::vector<uint16_t>& bits, size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Bf16BitsToFloat(bits[i]);
  return v;
}
template <typename T>
std::vector<double> AsDouble(const std::vector<T>& a, size_t n) {
  return std::vector<double>(a.begin(), a.begin() + static_cast<int64_t>(n));
}

// ||a - b|| / ||b|| (||a - b|| when b is 0).
inline double RelErr(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0, r = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    r += b[i] * b[i];
  }
  return r > 0 ? std::sqrt(d / r) : std::sqrt(d);
}

// The worst of RelErr over expert blocks: expert e's rows [off_e, off_e + counts[e]) of `width`
// values each (per_row), or its own block of `width` values (weight gradients).
inline double WorstPerExpert(const std::vector<double>& a, const std::vector<double>& b, const std::vector<int64_t>& counts,
                             int64_t width, bool per_row, size_t* worst_expert) {
  double worst = -1;
  int64_t off = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t first = per_row ? off * width : static_cast<int64_t>(e) * width;
    const int64_t n = per_row ? counts[e] * width : width;
    off += counts[e];
    if (n == 0) continue;
    const auto lo = a.begin() + first, lo_b = b.begin() + first;
    const double err = RelErr(std::vector<double>(lo, lo + n), std::vector<double>(lo_b, lo_b + n));
    if (err > worst) {
      worst = err;
      *worst_expert = e;
    }
  }
  return worst;
}

// Errors are measured per expert, so one small expert computed wrong cannot hide in a large one's norm.
inline void ExpectPerExpert(const std::vector<double>& got, const std::vector<double>& want, const std::vector<int64_t>& counts,
                            int64_t width, bool per_row, const char* what, double tol = 1e-2) {
  size_t worst_e = 0;
  EXPECT_LE(WorstPerExpert(got, want, counts, width, per_row, &worst_e), tol) << what << ", worst at expert " << worst_e;
}

// Rows of 2F columns (W1 [E][H][2F], h [M][2F], dW1) moved between the GateUp layouts (mlp::MoveGateUp):
// ToInterleaved8 takes split rows (gate | up) to kInterleaved8's columns, ToSplit takes them back.
template <typename T>
std::vector<T> MovedGateUp(const std::vector<T>& v, int64_t F, mlp::GateUp from, mlp::GateUp to) {
  std::vector<T> out(v.size());
  mlp::MoveGateUp(v.data(), out.data(), v.size() / static_cast<size_t>(2 * F), F, from, to);
  return out;
}
template <typename T>
std::vector<T> ToInterleaved8(const std::vector<T>& split, int64_t F) {
  return MovedGateUp(split, F, mlp::GateUp::kSplit, mlp::GateUp::kInterleaved8);
}
template <typename T>
std::vector<T> ToSplit(const std::vector<T>& interleaved, int64_t F) {
  return MovedGateUp(interleaved, F, mlp::GateUp::kInterleaved8, mlp::GateUp::kSplit);
}

inline bool RequireCutlass() {
  const char* v = std::getenv("RDEP_REQUIRE_CUTLASS");
  return v != nullptr && std::string(v) == "1";
}

// Makes the CUTLASS compute, or says why the test cannot run here (a failure, not a skip, when a GPU
// is present and RDEP_REQUIRE_CUTLASS=1).
inline StatusOr<std::unique_ptr<ExpertCompute>> MakeOrSkipReason(const ExpertMlpDesc& desc, std::string* skip,
                                                                 const CutlassTiles& tiles = {}) {
  if (cuda::DeviceCount() == 0) {
    *skip = "no CUDA device";
    return Unavailable(*skip);
  }
  auto ec = MakeCutlassExpertCompute(desc, 0, tiles);
  if (!ec.ok() && ec.status().code() == StatusCode::kUnavailable) {
    if (RequireCutlass()) ADD_FAILURE() << "RDEP_REQUIRE_CUTLASS=1 but " << ec.status();
    *skip = ec.status().message();
  }
  return ec;
}

}  // namespace rdep::kernels::test_util
