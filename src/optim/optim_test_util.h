// What the optimizer kernels' tests share: device copies of host arrays with poisoned guard elements around
// them (and a start offset that breaks vector alignment), checked on the way back.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rdep/cuda/check.h"
#include "rdep/status.h"

namespace rdep::optim::test_util {

// Device copies of a state, each array with kGuard poisoned elements before and after it and its start
// offset by `skew` elements (skew 1 breaks every vector alignment: the one-at-a-time kernel).
constexpr int64_t kGuard = 64;

template <typename T>
struct Guarded {
  T* base = nullptr;
  int64_t n = 0, skew = 0;
  T* data() const { return base + kGuard + skew; }
};

template <typename T>
Status Upload(const std::vector<T>& host, int64_t skew, T poison, Guarded<T>* out) {
  out->n = static_cast<int64_t>(host.size());
  out->skew = skew;
  const size_t total = static_cast<size_t>(out->n + 2 * kGuard + skew);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&out->base, total * sizeof(T)));
  std::vector<T> staged(total, poison);
  std::copy(host.begin(), host.end(), staged.begin() + kGuard + skew);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(out->base, staged.data(), total * sizeof(T), cudaMemcpyHostToDevice));
  return Status::Ok();
}

// The array back into `host`; every guard element must still hold the poison.
template <typename T>
void Download(const Guarded<T>& d, T poison, std::vector<T>* host, const char* name) {
  const size_t total = static_cast<size_t>(d.n + 2 * kGuard + d.skew);
  std::vector<T> staged(total);
  ASSERT_EQ(cudaMemcpy(staged.data(), d.base, total * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < total; ++i) {
    const bool inside = i >= static_cast<size_t>(kGuard + d.skew) && i < static_cast<size_t>(kGuard + d.skew + d.n);
    if (!inside) {
      ASSERT_EQ(std::memcmp(&staged[i], &poison, sizeof(T)), 0) << name << ": guard element " << i << " was written";
    }
  }
  host->assign(staged.begin() + kGuard + d.skew, staged.begin() + kGuard + d.skew + d.n);
  cudaFree(d.base);
}

}  // namespace rdep::optim::test_util
