// Test helpers shared by the expert compute tests: a device array freed at scope exit (with upload,
// download and 0xFF poisoning) and random bf16 data.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "rdep/core/random.h"
#include "rdep/cuda/bf16.h"

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

}  // namespace rdep::kernels::test_util
