// Test helpers for the CUDA layer's tests: one rank's routing and activations on its GPU (Batch,
// Upload) and downloads to the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "rdep/core/ownership.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/cuda/device_count.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/status.h"

namespace rdep {

// Holds a stream: cudaLaunchHostFunc(stream, &StreamHold::Wait, &hold) blocks the stream's later work until
// Release(). Tests use it to make a call return before the device has done something (a watchdog thread that
// calls Release keeps a call that waited on the held stream from hanging the test). Keep it alive until the
// stream has passed the host function.
struct StreamHold {
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  static void CUDART_CB Wait(void* self) {
    auto* h = static_cast<StreamHold*>(self);
    std::unique_lock<std::mutex> lock(h->mu);
    h->cv.wait(lock, [h] { return h->go; });
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      go = true;
    }
    cv.notify_all();
  }
};

// An environment variable set to `value` (null: unset) for one scope, the caller's value restored after (for the
// settings a layer reads when it is made: RDEP_EXPERT_SCRATCH, RDEP_W1_RETURN).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) saved_ = v, had_ = true;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), saved_.c_str(), 1);
    else unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, saved_;
  bool had_ = false;
};

// Whether the CUTLASS expert compute runs here (a GPU, a build with CUTLASS, sm_90); why not in *why.
// With RDEP_REQUIRE_CUTLASS=1 (scripts/device.sh) its absence on a GPU is a test failure, not a skip.
inline bool CutlassLayerAvailable(std::string* why) {
  if (cuda::DeviceCount() == 0) {
    *why = "no CUDA device";
    return false;
  }
  auto c = kernels::MakeCutlassExpertCompute({1, 64, 64, 64}, 0);
  if (c.ok()) return true;
  *why = c.status().message();
  const char* require = std::getenv("RDEP_REQUIRE_CUTLASS");
  if (require != nullptr && std::string(require) == "1") ADD_FAILURE() << "RDEP_REQUIRE_CUTLASS=1 but " << c.status();
  return false;
}

// A small layer problem (T 64, H 128, F 64, E 8, K 2 at W ranks, contiguous ownership): weights from
// weight_seed, routing from `spec`, x and dy from act_seed and act_seed + 1.
struct SmallProblem {
  LayerShape shape;
  OwnershipMap own;
  MoEWeights w;
  Routing routing;
  std::vector<std::vector<float>> x, dy;
  SmallProblem(int32_t W, const char* spec, uint64_t weight_seed, uint64_t act_seed)
      : shape{.tokens = 64, .hidden = 128, .ffn = 64, .experts = 8, .topk = 2, .ranks = W},
        own(*OwnershipMap::Contiguous(8, W)),
        w(RandomWeights(shape, weight_seed)),
        routing(*GenerateRouting(shape, *RoutingSpec::Parse(spec))),
        x(RandomActivations(shape, routing, act_seed)),
        dy(RandomActivations(shape, routing, act_seed + 1)) {}
};

// What CudaMoELayer::Create says for `cfg` on a one-rank domain on GPU 0 (a layer made is freed at once).
inline Status CreateStatus(const SmallProblem& p, const LayerConfig& cfg) {
  auto domain = CudaDomain::CreateSingleProcess(1, {});
  if (!domain.ok()) return domain.status();
  auto layer = CudaMoELayer::Create(**domain, cfg, p.own, p.w);
  return layer.status();
}

// One micro-batch's device tensors on one rank.
struct Batch {
  int32_t* e = nullptr;
  float *g = nullptr, *dg = nullptr;
  __nv_bfloat16 *x = nullptr, *y = nullptr, *dy = nullptr, *dx = nullptr;
  int64_t n = 0;
  ~Batch() {
    for (void* p : {static_cast<void*>(e), static_cast<void*>(g), static_cast<void*>(dg), static_cast<void*>(x),
                    static_cast<void*>(y), static_cast<void*>(dy), static_cast<void*>(dx)})
      if (p) cudaFree(p);
  }
};

inline Status UploadBf16(const std::vector<float>& v, __nv_bfloat16** p) {
  std::vector<uint16_t> bits(std::max<size_t>(v.size(), 1));
  for (size_t i = 0; i < v.size(); ++i) bits[i] = FloatToBf16Bits(v[i]);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(p, bits.size() * 2));
  return cuda::CudaStatus(cudaMemcpy(*p, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "upload", __FILE__, __LINE__);
}

inline Status Upload(const RankRouting& rr, const std::vector<float>& x, const std::vector<float>& dy, int64_t H, Batch& b) {
  b.n = rr.num_tokens;
  const size_t nk = std::max<size_t>(rr.experts.size(), 1);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.e, nk * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.g, nk * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.dg, nk * 4));
  if (!rr.experts.empty()) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.e, rr.experts.data(), rr.experts.size() * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.g, rr.gates.data(), rr.gates.size() * 4, cudaMemcpyHostToDevice));
  }
  RDEP_RETURN_IF_ERROR(UploadBf16(x, &b.x));
  RDEP_RETURN_IF_ERROR(UploadBf16(dy, &b.dy));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.y, static_cast<size_t>(std::max<int64_t>(b.n * H, 1)) * 2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.dx, static_cast<size_t>(std::max<int64_t>(b.n * H, 1)) * 2));
  // The copies ran on the legacy stream (a pageable copy may return before its DMA lands), which the layer's
  // non-blocking streams do not wait for.
  return cuda::CudaStatus(cudaStreamSynchronize(cudaStreamLegacy), "upload", __FILE__, __LINE__);
}

template <typename T>
StatusOr<std::vector<T>> Download(const T* p, size_t n) {
  std::vector<T> out(n);
  if (n) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

// n bf16 values on the device, as floats.
inline StatusOr<std::vector<float>> DownloadBf16(const __nv_bfloat16* p, size_t n) {
  RDEP_ASSIGN_OR_RETURN(std::vector<uint16_t> bits, Download(reinterpret_cast<const uint16_t*>(p), n));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = Bf16BitsToFloat(bits[i]);
  return out;
}

// One forward and backward of rank 0 on a one-rank layer: y, dx (bf16 bits), dgates, dW1 and dW2, compared bit for bit.
struct W1Outputs {
  std::vector<uint16_t> y, dx;
  std::vector<float> dg, dw1, dw2;
  bool operator==(const W1Outputs& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
    };
    return same(y, o.y) && same(dx, o.dx) && same(dg, o.dg) && same(dw1, o.dw1) && same(dw2, o.dw2);
  }
  // No NaN or infinity left: every poisoned output was written.
  bool AllFinite() const {
    for (const auto* v : {&y, &dx})
      for (const uint16_t b : *v)
        if ((b & 0x7f80) == 0x7f80) return false;
    for (const auto* v : {&dg, &dw1, &dw2})
      for (const float f : *v)
        if (!std::isfinite(f)) return false;
    return true;
  }
};

// Call `call` (routing `routing` seeded by it; x from seed 7 + call, dy from 17 + call) on rank 0 of a one-rank layer of
// shape s: y, dx and dgates poisoned with NaN first; after_forward (if any) runs between the forward and the backward.
inline StatusOr<W1Outputs> RunW1Call(CudaMoELayer& layer, CudaDomain& domain, const LayerShape& s, const std::string& routing,
                                     uint64_t call, const std::function<void()>& after_forward = {}) {
  RoutingSpec spec = *RoutingSpec::Parse(routing);
  spec.seed = call;
  RDEP_ASSIGN_OR_RETURN(Routing rt, GenerateRouting(s, spec));
  const auto x = RandomActivations(s, rt, 7 + call), dy = RandomActivations(s, rt, 17 + call);
  Batch b;
  RDEP_RETURN_IF_ERROR(Upload(rt[0], x[0], dy[0], s.hidden, b));
  const auto nh = static_cast<size_t>(b.n * s.hidden), nk = static_cast<size_t>(b.n * s.topk);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.y, 0xFF, std::max<size_t>(nh, 1) * 2));  // NaN
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dx, 0xFF, std::max<size_t>(nh, 1) * 2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(b.dg, 0xFF, std::max<size_t>(nk, 1) * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  RDEP_RETURN_IF_ERROR(layer.Forward(0, b.e, b.g, b.n, b.x, b.y));
  if (after_forward) after_forward();
  RDEP_RETURN_IF_ERROR(layer.Backward(0, b.dy, b.dx, b.dg));
  RDEP_RETURN_IF_ERROR(domain.Synchronize(0));
  W1Outputs o;
  RDEP_ASSIGN_OR_RETURN(o.y, Download(reinterpret_cast<const uint16_t*>(b.y), nh));
  RDEP_ASSIGN_OR_RETURN(o.dx, Download(reinterpret_cast<const uint16_t*>(b.dx), nh));
  RDEP_ASSIGN_OR_RETURN(o.dg, Download(b.dg, nk));
  RDEP_ASSIGN_OR_RETURN(o.dw1, Download(layer.dw1(0), static_cast<size_t>(s.experts * 2 * s.hidden * s.ffn)));
  RDEP_ASSIGN_OR_RETURN(o.dw2, Download(layer.dw2(0), static_cast<size_t>(s.experts * s.ffn * s.hidden)));
  return o;
}

// The same size and the same bits (NaNs compare by their bits).
inline bool Bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

}  // namespace rdep
