// The C ABI on the CUDA backend (skips without a GPU): W = 1 and W = 4 ranks sharing GPU 0, results
// bitwise equal to CudaMoELayer with its own copy of the same weights (y, dx, dgates, dw1, dw2), with
// capacity drops, the caller's work on its own stream ordered before and after the layer's; and with a
// row allocator (version 8): the same bits, the contexts' saved rows taken from it in each forward and all
// given back by each release.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "layer/cuda_test_util.h"
#include "rdep/capi.h"
#include "rdep/core/routing.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

using Bits = std::vector<uint16_t>;

template <typename T>
T* Upload(const std::vector<T>& h) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)), cudaSuccess);
  if (!h.empty()) {
    EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // landed before a non-blocking stream reads it
  }
  return static_cast<T*>(d);
}
template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) {
    EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return h;
}
Bits ToBits(const std::vector<float>& v, size_t first = 0, size_t n = SIZE_MAX) {
  n = std::min(n, v.size() - first);
  Bits b(n);
  for (size_t i = 0; i < n; ++i) b[i] = FloatToBf16Bits(v[first + i]);
  return b;
}

struct Out {
  std::vector<Bits> y, dx;
  std::vector<std::vector<float>> dg, dw1, dw2;
};

// A row allocator over cudaMalloc that counts what it handed out and what came back (the ranks' threads
// call it concurrently).
struct RowCounter {
  std::mutex mu;
  int64_t allocs = 0, frees = 0;
  size_t live = 0;
  size_t aligned = 0;  // every request rounded up to 256 bytes, summed (rdep_layer_row_allocator_bytes' unit)
  static void* Alloc(void* user, size_t bytes, int32_t device, void* /*stream*/) {
    auto* c = static_cast<RowCounter*>(user);
    void* p = nullptr;
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    std::lock_guard<std::mutex> lock(c->mu);
    ++c->allocs;
    c->live += bytes;
    c->aligned += (bytes + 255) / 256 * 256;
    return p;
  }
  static void Free(void* user, void* ptr, size_t bytes, int32_t /*device*/) {
    auto* c = static_cast<RowCounter*>(user);
    cudaFree(ptr);
    std::lock_guard<std::mutex> lock(c->mu);
    ++c->frees;
    c->live -= bytes;
  }
};

// Version 17: a forward whose saved rows come from the caller's arena (rdep_layer_forward_arena) takes exactly
// rdep_layer_row_allocator_bytes of it and never asks the allocator, gives it nothing back on release, and
// computes the y the allocator's forward computed (ys: the outputs now); an arena 256 bytes short fails the call
// naming the bytes, before the collective.
template <typename Ys>
void ArenaForward(rdep_layer* l, std::vector<rdep_rank_io>& io, RowCounter& rows, cudaStream_t caller, Ys ys) {
  const auto W = static_cast<int32_t>(io.size());
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  const auto want = ys();
  size_t predicted = 0, used = 1;
  ASSERT_EQ(rdep_layer_row_allocator_bytes(l, &predicted), 0) << rdep_last_error();
  void* arena = nullptr;
  ASSERT_EQ(cudaMalloc(&arena, predicted), cudaSuccess);
  const int64_t allocs = rows.allocs, frees = rows.frees;
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  ASSERT_EQ(rdep_layer_forward_arena(l, ctx, io.data(), W, arena, predicted, &used), 0) << rdep_last_error();
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  EXPECT_EQ(used, predicted);
  EXPECT_EQ(rows.allocs, allocs) << "the arena served every request";
  EXPECT_EQ(ys(), want);
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  EXPECT_EQ(rows.frees, frees) << "the arena's pieces are the caller's: none given to free";
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  EXPECT_NE(rdep_layer_forward_arena(l, ctx, io.data(), W, arena, predicted - 256, &used), 0);
  EXPECT_NE(std::string(rdep_last_error()).find("returned no memory"), std::string::npos) << rdep_last_error();
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  EXPECT_EQ(rows.allocs, allocs);
  EXPECT_EQ(cudaFree(arena), cudaSuccess);
}

// Version 18: the arena moved between the forward and the backward (a saved-tensor hook copied the caller's rows
// tensor): after rdep_context_rebase_rows the backward reads the copy, and the old bytes, overwritten, are not read:
// the same outputs and gradients (outs: all of them now) as a backward on the arena where the forward left it.
template <typename Outs>
void ArenaRebase(rdep_layer* l, std::vector<rdep_rank_io>& io, cudaStream_t caller, Outs outs) {
  const auto W = static_cast<int32_t>(io.size());
  size_t bytes = 0;
  ASSERT_EQ(rdep_layer_row_allocator_bytes(l, &bytes), 0) << rdep_last_error();
  void *arena = nullptr, *moved = nullptr;
  ASSERT_EQ(cudaMalloc(&arena, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&moved, bytes), cudaSuccess);
  int64_t ctx = 0;
  size_t used = 0;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  ASSERT_EQ(rdep_layer_forward_arena(l, ctx, io.data(), W, arena, bytes, &used), 0) << rdep_last_error();
  ASSERT_EQ(used, bytes) << "the forward's saved rows are all in the arena";
  ASSERT_EQ(rdep_layer_backward(l, ctx, io.data(), W), 0) << rdep_last_error();
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  const auto want = outs();
  EXPECT_EQ(rdep_context_release(l, ctx), 0);

  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  EXPECT_EQ(rdep_context_rebase_rows(l, ctx, arena, bytes, moved), 2) << "FailedPrecondition: no forward yet";
  ASSERT_EQ(rdep_layer_forward_arena(l, ctx, io.data(), W, arena, bytes, &used), 0) << rdep_last_error();
  ASSERT_EQ(cudaMemcpyAsync(moved, arena, bytes, cudaMemcpyDeviceToDevice, caller), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(arena, 0xff, bytes, caller), cudaSuccess);  // what reuses the old bytes
  EXPECT_EQ(rdep_context_rebase_rows(l, ctx, arena, bytes, static_cast<char*>(moved) + 8), 1) << "misaligned";
  EXPECT_NE(std::string(rdep_last_error()).find("256-byte aligned"), std::string::npos) << rdep_last_error();
  ASSERT_EQ(rdep_context_rebase_rows(l, ctx, arena, bytes, moved), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_backward(l, ctx, io.data(), W), 0) << rdep_last_error();
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  EXPECT_EQ(outs(), want) << "the backward read the moved rows";
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  EXPECT_EQ(rdep_context_rebase_rows(l, ctx, arena, bytes, moved), 1) << "a stale id";
  EXPECT_EQ(cudaFree(arena), cudaSuccess);
  EXPECT_EQ(cudaFree(moved), cudaSuccess);
}

void Compare(const LayerShape& s, double capacity, bool row_allocator = false) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const auto W = static_cast<size_t>(s.ranks);
  const MoEWeights w = RandomWeights(s, 11);
  RoutingSpec rs;
  rs.family = RoutingSpec::Family::kZipf;
  rs.alpha = 1.1;
  const Routing routing = *GenerateRouting(s, rs);
  const auto x = RandomActivations(s, routing, 12), dy = RandomActivations(s, routing, 13);
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  const int64_t H = s.hidden, K = s.topk;
  // Per-rank device inputs, shared by both paths.
  std::vector<int32_t*> d_experts(W);
  std::vector<float*> d_gates(W), d_dg(W), d_dw1(W), d_dw2(W);
  std::vector<uint16_t*> d_x(W), d_dy(W), d_y(W), d_dx(W), d_w1(W), d_w2(W);
  const size_t n1 = w.w1_per_expert(), n2 = w.w2_per_expert();
  for (size_t r = 0; r < W; ++r) {
    const auto n = static_cast<size_t>(routing[r].num_tokens);
    d_experts[r] = Upload(routing[r].experts);
    d_gates[r] = Upload(routing[r].gates);
    d_x[r] = Upload(ToBits(x[r]));
    d_dy[r] = Upload(ToBits(dy[r]));
    d_y[r] = Upload(Bits(n * static_cast<size_t>(H), 0x7fc1));  // poisoned (NaN)
    d_dx[r] = Upload(Bits(n * static_cast<size_t>(H), 0x7fc1));
    d_dg[r] = Upload(std::vector<float>(n * static_cast<size_t>(K), -7.f));
    const auto e0 = static_cast<size_t>(own.num_local(static_cast<int32_t>(r)) ? own.global_expert(static_cast<int32_t>(r), 0) : 0);
    const auto ne = static_cast<size_t>(own.num_local(static_cast<int32_t>(r)));
    d_w1[r] = Upload(ToBits(w.w1, e0 * n1, ne * n1));
    d_w2[r] = Upload(ToBits(w.w2, e0 * n2, ne * n2));
    d_dw1[r] = Upload(std::vector<float>(ne * n1, -7.f));
    d_dw2[r] = Upload(std::vector<float>(ne * n2, -7.f));
  }
  auto fetch = [&](Out& o) {
    for (size_t r = 0; r < W; ++r) {
      const auto n = static_cast<size_t>(routing[r].num_tokens);
      const auto ne = static_cast<size_t>(own.num_local(static_cast<int32_t>(r)));
      o.y.push_back(Download(d_y[r], n * static_cast<size_t>(H)));
      o.dx.push_back(Download(d_dx[r], n * static_cast<size_t>(H)));
      o.dg.push_back(Download(d_dg[r], n * static_cast<size_t>(K)));
      o.dw1.push_back(Download(d_dw1[r], ne * n1));
      o.dw2.push_back(Download(d_dw2[r], ne * n2));
    }
  };

  // Reference: the layer with its own weights; its gradients copied into d_dw*.
  Out ref, abi;
  {
    auto domain = std::move(*CudaDomain::CreateSingleProcess(s.ranks, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(s.ranks, 1)}));
    auto layer = std::move(*CudaMoELayer::Create(*domain, MakeLayerConfig(s, {capacity}), own, w));
    ASSERT_TRUE(domain->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      auto* bx = reinterpret_cast<const __nv_bfloat16*>(d_x[i]);
      RDEP_RETURN_IF_ERROR(layer->Forward(r, d_experts[i], d_gates[i], routing[i].num_tokens, bx, reinterpret_cast<__nv_bfloat16*>(d_y[i])));
      RDEP_RETURN_IF_ERROR(layer->Backward(r, reinterpret_cast<const __nv_bfloat16*>(d_dy[i]), reinterpret_cast<__nv_bfloat16*>(d_dx[i]), d_dg[i]));
      const size_t ne = static_cast<size_t>(own.num_local(r));
      cudaMemcpyAsync(d_dw1[i], layer->dw1(r), ne * n1 * 4, cudaMemcpyDeviceToDevice, domain->stream(r));
      cudaMemcpyAsync(d_dw2[i], layer->dw2(r), ne * n2 * 4, cudaMemcpyDeviceToDevice, domain->stream(r));
      return domain->Synchronize(r);
    }).ok());
    fetch(ref);
  }
  for (size_t r = 0; r < W; ++r) {  // poison again
    cudaMemset(d_y[r], 0xff, static_cast<size_t>(routing[r].num_tokens * H) * 2);
    cudaMemset(d_dx[r], 0xff, static_cast<size_t>(routing[r].num_tokens * H) * 2);
    cudaMemset(d_dg[r], 0xff, static_cast<size_t>(routing[r].num_tokens * K) * 4);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the legacy-stream poison lands before the layer's streams write

  rdep_layer_spec spec{};
  spec.struct_size = sizeof spec;
  spec.backend = RDEP_BACKEND_CUDA_ONE_PROCESS;
  spec.world_size = static_cast<int32_t>(W);
  spec.num_gpus = 1;
  spec.tokens = s.tokens, spec.hidden = s.hidden, spec.ffn = s.ffn, spec.experts = s.experts, spec.topk = s.topk;
  spec.capacity_factor = capacity;
  spec.barrier_timeout_s = 20;
  rdep_layer* l = nullptr;
  ASSERT_EQ(rdep_layer_create(&spec, &l), 0) << rdep_last_error();
  RowCounter rows;
  if (row_allocator) {
    ASSERT_EQ(rdep_layer_set_row_allocator(l, &RowCounter::Alloc, &RowCounter::Free, &rows), 0) << rdep_last_error();
  }
  cudaStream_t caller = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking), cudaSuccess);
  std::vector<rdep_rank_io> io(W);
  for (size_t r = 0; r < W; ++r) {
    int32_t dev = -2;
    ASSERT_EQ(rdep_layer_device(l, static_cast<int32_t>(r), &dev), 0);
    EXPECT_EQ(dev, 0);
    cudaMemsetAsync(d_dw1[r], 0xff, static_cast<size_t>(own.num_local(static_cast<int32_t>(r))) * n1 * 4, caller);
    io[r] = rdep_rank_io{routing[r].num_tokens, d_experts[r], d_gates[r], d_x[r], d_y[r], d_w1[r], d_w2[r], d_dy[r], d_dx[r],
                         d_dg[r], d_dw1[r], d_dw2[r], caller, 0, 0};
  }
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  ASSERT_EQ(rdep_layer_forward(l, ctx, io.data(), static_cast<int32_t>(W)), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_backward(l, ctx, io.data(), static_cast<int32_t>(W)), 0) << rdep_last_error();
  // Only the caller's stream is synchronized: the layer's work must be ordered before it.
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  fetch(abi);
  if (row_allocator) {
    EXPECT_GE(rows.allocs, static_cast<int64_t>(W)) << "every rank's context took its saved rows from the allocator";
    EXPECT_GT(rows.live, 0u);
    size_t predicted = 0;  // version 15: what one forward asks for, said before it runs
    ASSERT_EQ(rdep_layer_row_allocator_bytes(l, &predicted), 0) << rdep_last_error();
    EXPECT_EQ(rows.aligned, predicted);
    EXPECT_NE(rdep_layer_set_row_allocator(l, nullptr, nullptr, nullptr), 0) << "ctx is acquired: the allocator cannot change";
    EXPECT_NE(std::string(rdep_last_error()).find("no context of the layer is acquired"), std::string::npos) << rdep_last_error();
  }
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  if (row_allocator) {
    EXPECT_EQ(rows.live, 0u) << "the release gave every row back";
    EXPECT_EQ(rows.frees, rows.allocs);
  }
  // bf16 weight gradients (the gradients of bf16 parameters): within bf16 rounding of the fp32 ones.
  std::vector<uint16_t*> d_bw1(W), d_bw2(W);
  for (size_t r = 0; r < W; ++r) {
    const auto ne = static_cast<size_t>(own.num_local(static_cast<int32_t>(r)));
    d_bw1[r] = Upload(Bits(ne * n1, 0x7fc1));
    d_bw2[r] = Upload(Bits(ne * n2, 0x7fc1));
    io[r].dw1 = d_bw1[r];
    io[r].dw2 = d_bw2[r];
    io[r].grad_bf16 = 1;
  }
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  ASSERT_EQ(rdep_layer_forward(l, ctx, io.data(), static_cast<int32_t>(W)), 0) << rdep_last_error();
  ASSERT_EQ(rdep_layer_backward(l, ctx, io.data(), static_cast<int32_t>(W)), 0) << rdep_last_error();
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  const int64_t allocs_before_release = rows.allocs;
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  if (row_allocator) {  // the pooled context took its rows again for the second forward, and gave them back
    EXPECT_GE(allocs_before_release, 2 * static_cast<int64_t>(W));
    EXPECT_EQ(rows.live, 0u);
    ArenaForward(l, io, rows, caller, [&] {
      std::vector<Bits> y;
      for (size_t r = 0; r < W; ++r) y.push_back(Download(d_y[r], static_cast<size_t>(routing[r].num_tokens * s.hidden)));
      return y;
    });
    ArenaRebase(l, io, caller, [&] {
      std::vector<Bits> all;  // y, dx, the bf16 weight gradients per rank, and dgates' bits
      for (size_t r = 0; r < W; ++r) {
        const auto n = static_cast<size_t>(routing[r].num_tokens), ne = static_cast<size_t>(own.num_local(static_cast<int32_t>(r)));
        all.push_back(Download(d_y[r], n * static_cast<size_t>(H)));
        all.push_back(Download(d_dx[r], n * static_cast<size_t>(H)));
        all.push_back(Download(d_bw1[r], ne * n1));
        all.push_back(Download(d_bw2[r], ne * n2));
        const auto dg = Download(d_dg[r], n * static_cast<size_t>(K));
        Bits dg_bits(dg.size() * 2);
        std::memcpy(dg_bits.data(), dg.data(), dg.size() * sizeof(float));
        all.push_back(std::move(dg_bits));
      }
      return all;
    });
  }
  for (size_t r = 0; r < W; ++r) {
    const auto ne = static_cast<size_t>(own.num_local(static_cast<int32_t>(r)));
    for (int which = 0; which < 2; ++which) {
      const Bits got = Download(which ? d_bw2[r] : d_bw1[r], ne * (which ? n2 : n1));
      const std::vector<float>& want = which ? ref.dw2[r] : ref.dw1[r];
      double max_ref = 0, max_err = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        max_ref = std::max(max_ref, static_cast<double>(std::fabs(want[i])));
        max_err = std::max(max_err, static_cast<double>(std::fabs(Bf16BitsToFloat(got[i]) - want[i])));
      }
      EXPECT_LE(max_err, 8e-3 * max_ref) << (which ? "dw2" : "dw1") << " bf16, rank " << r;
    }
    cudaFree(d_bw1[r]);
    cudaFree(d_bw2[r]);
  }
  rdep_layer_destroy(l);
  cudaStreamDestroy(caller);
  for (size_t r = 0; r < W; ++r) {
    EXPECT_EQ(abi.y[r], ref.y[r]) << "y, rank " << r;
    EXPECT_EQ(abi.dx[r], ref.dx[r]) << "dx, rank " << r;
    EXPECT_EQ(abi.dg[r], ref.dg[r]) << "dgates, rank " << r;
    EXPECT_EQ(abi.dw1[r], ref.dw1[r]) << "dw1, rank " << r;
    EXPECT_EQ(abi.dw2[r], ref.dw2[r]) << "dw2, rank " << r;
    for (void* p : {static_cast<void*>(d_experts[r]), static_cast<void*>(d_gates[r]), static_cast<void*>(d_dg[r]),
                    static_cast<void*>(d_dw1[r]), static_cast<void*>(d_dw2[r]), static_cast<void*>(d_x[r]), static_cast<void*>(d_dy[r]),
                    static_cast<void*>(d_y[r]), static_cast<void*>(d_dx[r]), static_cast<void*>(d_w1[r]), static_cast<void*>(d_w2[r])})
      cudaFree(p);
  }
}

// Version 14: rdep_cutlass_available says what making the CUTLASS compute says, keeps the caller's device,
// and names a device past the last one. Under RDEP_REQUIRE_CUTLASS=1 (scripts/device.sh) it must be 1.
TEST(CApi_Cuda, CutlassAvailabilityMatchesTheCompute) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  int before = -1;
  ASSERT_EQ(cudaGetDevice(&before), cudaSuccess);
  const bool made = kernels::MakeCutlassExpertCompute({1, 64, 64, 64}, 0).ok();
  EXPECT_EQ(rdep_cutlass_available(0), made ? 1 : 0) << rdep_last_error();
  const char* require = std::getenv("RDEP_REQUIRE_CUTLASS");
  if (require != nullptr && std::string(require) == "1") {
    EXPECT_EQ(rdep_cutlass_available(0), 1) << rdep_last_error();
  }
  const int32_t past = rdep_cuda_device_count();
  EXPECT_EQ(rdep_cutlass_available(past), 0);
  EXPECT_NE(std::string(rdep_last_error()).find("device: " + std::to_string(past) + " is not a CUDA device"), std::string::npos)
      << rdep_last_error();
  int after = -1;
  ASSERT_EQ(cudaGetDevice(&after), cudaSuccess);
  EXPECT_EQ(after, before);
}

// Version 14: a sync-free (CUTLASS) forward returns before its device has checked the routing when its
// stream is held, so it reports nothing; rdep_context_check_routing then waits and names rank, token, slot
// and value. A warm-up forward and backward first make the context's buffers (allocations may wait on the
// device, which the held stream would block); a watchdog releases the stream if the forward waited on it.
// A small one-rank CUDA layer through the C ABI with the CUTLASS compute, its device buffers (routing (t + k) mod E,
// gates 0.5, x = dy = 1.0, weights ~0.01) and a caller stream: io names them all. Freed with the struct.
struct SmallCutlassLayer {
  static constexpr int64_t T = 16, H = 64, F = 32, E = 4, K = 2;
  rdep_layer* l = nullptr;
  std::vector<int32_t> experts = std::vector<int32_t>(static_cast<size_t>(T * K));
  int32_t* d_e = nullptr;
  float* d_gates = nullptr;
  uint16_t *d_x = nullptr, *d_y = nullptr, *d_dx = nullptr, *d_w1 = nullptr, *d_w2 = nullptr;
  float *d_dg = nullptr, *d_dw1 = nullptr, *d_dw2 = nullptr;
  cudaStream_t caller = nullptr;
  rdep_rank_io io{};
  int created = -1;                 // rdep_layer_create's code
  cudaError_t stream_created = cudaErrorUnknown;  // the caller stream's

  SmallCutlassLayer() {
    rdep_layer_spec spec{};
    spec.struct_size = sizeof spec;
    spec.backend = RDEP_BACKEND_CUDA_ONE_PROCESS;
    spec.world_size = 1;
    spec.num_gpus = 1;
    spec.tokens = T, spec.hidden = H, spec.ffn = F, spec.experts = E, spec.topk = K;
    spec.barrier_timeout_s = 20;
    spec.expert_compute = 1;
    created = rdep_layer_create(&spec, &l);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) experts[static_cast<size_t>(t * K + k)] = static_cast<int32_t>((t + k) % E);
    d_e = Upload(experts);
    d_gates = Upload(std::vector<float>(static_cast<size_t>(T * K), 0.5f));
    d_x = Upload(Bits(static_cast<size_t>(T * H), 0x3f80));  // 1.0
    d_y = Upload(Bits(static_cast<size_t>(T * H), 0));
    d_dx = Upload(Bits(static_cast<size_t>(T * H), 0));
    d_dg = Upload(std::vector<float>(static_cast<size_t>(T * K), 0.f));
    d_w1 = Upload(Bits(static_cast<size_t>(E * H * 2 * F), 0x3c23));  // ~0.01
    d_w2 = Upload(Bits(static_cast<size_t>(E * F * H), 0x3c23));
    d_dw1 = Upload(std::vector<float>(static_cast<size_t>(E * H * 2 * F), 0.f));
    d_dw2 = Upload(std::vector<float>(static_cast<size_t>(E * F * H), 0.f));
    stream_created = cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking);
    io = rdep_rank_io{T, d_e, d_gates, d_x, d_y, d_w1, d_w2, d_x, d_dx, d_dg, d_dw1, d_dw2, caller, 0, 0};
  }
  ~SmallCutlassLayer() {
    if (l) rdep_layer_destroy(l);
    for (void* p : {static_cast<void*>(d_e), static_cast<void*>(d_gates), static_cast<void*>(d_x), static_cast<void*>(d_y),
                    static_cast<void*>(d_dx), static_cast<void*>(d_dg), static_cast<void*>(d_w1), static_cast<void*>(d_w2),
                    static_cast<void*>(d_dw1), static_cast<void*>(d_dw2)})
      cudaFree(p);
    if (caller) cudaStreamDestroy(caller);
  }
  SmallCutlassLayer(const SmallCutlassLayer&) = delete;
  SmallCutlassLayer& operator=(const SmallCutlassLayer&) = delete;
};

// Skips without a GPU or where the CUTLASS compute does not run (it names why).
class CApi_CudaCutlass : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    if (!rdep_cutlass_available(0)) GTEST_SKIP() << "the CUTLASS compute does not run here: " << rdep_last_error();
  }
};

// The small CUTLASS layer, made (its creation and its caller stream's checked).
class CApi_CudaSmallLayer : public CApi_CudaCutlass {
 protected:
  void SetUp() override {
    CApi_CudaCutlass::SetUp();
    if (IsSkipped()) return;
    s_ = std::make_unique<SmallCutlassLayer>();
    ASSERT_EQ(s_->created, 0) << rdep_last_error();
    ASSERT_EQ(s_->stream_created, cudaSuccess);
  }
  std::unique_ptr<SmallCutlassLayer> s_;
};

TEST_F(CApi_CudaSmallLayer, CheckRoutingReportsWhatTheSyncFreeForwardCouldNotRead) {
  SmallCutlassLayer& s = *s_;
  rdep_layer* l = s.l;
  std::vector<int32_t> experts = s.experts;
  experts[3 * SmallCutlassLayer::K + 1] = 9;  // token 3, slot 1: outside [0, E)
  int32_t* d_bad = Upload(experts);
  rdep_rank_io& io = s.io;
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  EXPECT_EQ(rdep_context_check_routing(l, ctx), static_cast<int>(StatusCode::kFailedPrecondition)) << "no forward yet";
  ASSERT_EQ(rdep_layer_forward(l, ctx, &io, 1), 0) << rdep_last_error();
  EXPECT_EQ(rdep_context_check_routing(l, ctx), 0) << rdep_last_error();  // valid routing
  ASSERT_EQ(rdep_layer_backward(l, ctx, &io, 1), 0) << rdep_last_error();
  ASSERT_EQ(rdep_context_release(l, ctx), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  StreamHold hold;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);  // the pooled slot: its buffers exist
  io.experts = d_bad;
  ASSERT_EQ(cudaLaunchHostFunc(s.caller, &StreamHold::Wait, &hold), cudaSuccess);
  std::promise<void> returned;
  std::thread watchdog([&, done = returned.get_future()] {
    done.wait_for(std::chrono::seconds(10));
    hold.Release();
  });
  const int forward = rdep_layer_forward(l, ctx, &io, 1);
  const std::string forward_error = forward != 0 ? rdep_last_error() : "";
  returned.set_value();
  watchdog.join();
  EXPECT_EQ(forward, 0) << "the forward could not have read its routing check yet: " << forward_error;
  EXPECT_EQ(rdep_context_check_routing(l, ctx), static_cast<int>(StatusCode::kInvalidArgument));
  const std::string why = rdep_last_error();
  EXPECT_NE(why.find("forward on rank 0: routing token 3 slot 1: expert 9 outside [0, E=4)"), std::string::npos) << why;
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
  EXPECT_EQ(rdep_context_check_routing(l, ctx), static_cast<int>(StatusCode::kInvalidArgument)) << "released: stale";
  EXPECT_EQ(cudaStreamSynchronize(s.caller), cudaSuccess);
  cudaFree(d_bad);
}

// Version 19: a backward captured again after its forward's replay re-arms the context on the host
// (rdep_context_rearm); the device still checks that a forward ran into it since the last backward (CudaDomain::
// TakeForward). Forwards and backwards in turn pass it; a backward re-armed without a forward in between (as a second
// backward of one forward would be) writes the rank's error record, which rdep_layer_check_errors and every later call
// report (no trap: the call was eager).
TEST_F(CApi_CudaSmallLayer, BackwardWithoutItsForwardIsCaughtOnTheDevice) {
  SmallCutlassLayer& s = *s_;
  rdep_layer* l = s.l;
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  EXPECT_EQ(rdep_context_rearm(l, ctx), static_cast<int>(StatusCode::kFailedPrecondition)) << "no forward yet";
  for (int i = 0; i < 3; ++i) {  // forward, backward in turn, into one context: each backward takes its forward
    ASSERT_EQ(rdep_layer_forward(l, ctx, &s.io, 1), 0) << rdep_last_error();
    ASSERT_EQ(rdep_layer_backward(l, ctx, &s.io, 1), 0) << rdep_last_error();
  }
  ASSERT_EQ(cudaStreamSynchronize(s.caller), cudaSuccess);
  ASSERT_EQ(rdep_layer_check_errors(l), 0) << rdep_last_error();
  ASSERT_EQ(rdep_context_rearm(l, ctx), 0) << rdep_last_error();  // the host allows it; no forward ran since
  ASSERT_EQ(rdep_layer_backward(l, ctx, &s.io, 1), 0) << rdep_last_error();
  ASSERT_EQ(cudaStreamSynchronize(s.caller), cudaSuccess);
  EXPECT_EQ(rdep_layer_check_errors(l), static_cast<int>(StatusCode::kFailedPrecondition));
  const std::string why = rdep_last_error();
  EXPECT_NE(why.find("rank 0: a backward ran on a context whose forward had not run since the last backward"), std::string::npos) << why;
  EXPECT_NE(rdep_layer_forward(l, ctx, &s.io, 1), 0) << "the record stays: later calls fail";
  EXPECT_EQ(rdep_context_release(l, ctx), 0);
}

// Version 18 on the sync-free (CUTLASS) layouts, whose saved rows are the owner's x rows and SwiGLU inputs (and, with
// owner_reduce and the gate after W2, its outputs) besides the front-end's returned rows: every one of them follows the
// moved arena (ArenaRebase), at W = 1 and with 2 ranks sharing the GPU.
struct RebaseCase {
  int32_t ranks, owner_reduce, gate_in_expert;
};

class CApiCudaRebase : public CApi_CudaCutlass, public ::testing::WithParamInterface<RebaseCase> {};

TEST_P(CApiCudaRebase, EverySavedRowFollowsTheArena) {
  const RebaseCase c = GetParam();
  const int64_t T = 48, H = 64, F = 32, E = 4, K = 2;
  const auto W = static_cast<size_t>(c.ranks);
  rdep_layer_spec spec{};
  spec.struct_size = sizeof spec;
  spec.backend = RDEP_BACKEND_CUDA_ONE_PROCESS;
  spec.world_size = c.ranks;
  spec.num_gpus = 1;
  spec.tokens = T, spec.hidden = H, spec.ffn = F, spec.experts = E, spec.topk = K;
  spec.barrier_timeout_s = 20;
  spec.expert_compute = 1;
  spec.owner_reduce = c.owner_reduce;
  spec.gate_in_expert = c.gate_in_expert;
  rdep_layer* l = nullptr;
  ASSERT_EQ(rdep_layer_create(&spec, &l), 0) << rdep_last_error();
  RowCounter rows;
  ASSERT_EQ(rdep_layer_set_row_allocator(l, &RowCounter::Alloc, &RowCounter::Free, &rows), 0) << rdep_last_error();
  cudaStream_t caller = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking), cudaSuccess);
  const int64_t El = E / c.ranks;
  std::vector<rdep_rank_io> io(W);
  std::vector<void*> owned;
  auto up = [&](auto v) {
    auto* d = Upload(v);
    owned.push_back(static_cast<void*>(d));
    return d;
  };
  std::vector<uint16_t*> d_y(W), d_dx(W), d_dw1(W), d_dw2(W);
  std::vector<float*> d_dg(W);
  for (size_t r = 0; r < W; ++r) {
    std::vector<int32_t> experts(static_cast<size_t>(T * K));
    std::vector<float> gates(static_cast<size_t>(T * K));
    Bits x(static_cast<size_t>(T * H)), dy(x.size()), w1(static_cast<size_t>(El * H * 2 * F)), w2(static_cast<size_t>(El * F * H));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        experts[static_cast<size_t>(t * K + k)] = static_cast<int32_t>((t * 7 + static_cast<int64_t>(r) + k * 3) % E);
        gates[static_cast<size_t>(t * K + k)] = 0.25f + 0.125f * static_cast<float>((t + k) % 5);
      }
    uint32_t h = 0x9e3779b9u * static_cast<uint32_t>(r + 1);  // small bf16 values of either sign
    auto next = [&h] {
      h = h * 1664525u + 1013904223u;
      return static_cast<uint16_t>(0x3c00u + ((h >> 16) & 0xffu) + ((h >> 8) & 1u ? 0x8000u : 0u));
    };
    for (auto* v : {&x, &dy, &w1, &w2})
      for (auto& e : *v) e = next();
    d_y[r] = up(Bits(x.size(), 0x7fc1));
    d_dx[r] = up(Bits(x.size(), 0x7fc1));
    d_dg[r] = up(std::vector<float>(gates.size(), -7.f));
    d_dw1[r] = up(Bits(w1.size(), 0x7fc1));
    d_dw2[r] = up(Bits(w2.size(), 0x7fc1));
    io[r] = rdep_rank_io{T, up(experts), up(gates), up(x), d_y[r], up(w1), up(w2), up(dy), d_dx[r], d_dg[r], d_dw1[r], d_dw2[r],
                         caller, 0, 0};
    io[r].grad_bf16 = 1;
  }
  ArenaRebase(l, io, caller, [&] {
    std::vector<Bits> all;
    for (size_t r = 0; r < W; ++r) {
      all.push_back(Download(d_y[r], static_cast<size_t>(T * H)));
      all.push_back(Download(d_dx[r], static_cast<size_t>(T * H)));
      all.push_back(Download(d_dw1[r], static_cast<size_t>(El * H * 2 * F)));
      all.push_back(Download(d_dw2[r], static_cast<size_t>(El * F * H)));
      const auto dg = Download(d_dg[r], static_cast<size_t>(T * K));
      Bits dg_bits(dg.size() * 2);
      std::memcpy(dg_bits.data(), dg.data(), dg.size() * sizeof(float));
      all.push_back(std::move(dg_bits));
    }
    return all;
  });
  rdep_layer_destroy(l);
  for (void* p : owned) cudaFree(p);
  cudaStreamDestroy(caller);
}

INSTANTIATE_TEST_SUITE_P(CApi_Cuda, CApiCudaRebase,
                         ::testing::Values(RebaseCase{1, 0, 0}, RebaseCase{1, 0, 1}, RebaseCase{1, 1, 0}, RebaseCase{2, 0, 0},
                                           RebaseCase{2, 1, 0}),
                         [](const ::testing::TestParamInfo<RebaseCase>& i) {
                           return "W" + std::to_string(i.param.ranks) + (i.param.owner_reduce ? "_owner_reduce" : "") +
                                  (i.param.gate_in_expert ? "_gate_in_expert" : "");
                         });

TEST(CApi_Cuda, W1_MatchesCudaLayer) { Compare({.tokens = 64, .hidden = 128, .ffn = 64, .experts = 8, .topk = 2, .ranks = 1}, 0.0); }

TEST(CApi_Cuda, W4_SharedGpu_CapacityDrops_MatchesCudaLayer) {
  Compare({.tokens = 48, .hidden = 64, .ffn = 96, .experts = 10, .topk = 3, .ranks = 4}, 0.8);
}

TEST(CApi_Cuda, W4_SharedGpu_RowAllocator_MatchesCudaLayer) {
  Compare({.tokens = 48, .hidden = 64, .ffn = 96, .experts = 10, .topk = 3, .ranks = 4}, 0.8, /*row_allocator=*/true);
}

}  // namespace
}  // namespace rdep

namespace rdep {
namespace {

// bf16 weight gradients are written once, so a forward that ran in several segments refuses them.
TEST(CApi_Cuda, Bf16GradientsNeedOneSegment) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const LayerShape s{.tokens = 32, .hidden = 64, .ffn = 32, .experts = 4, .topk = 2, .ranks = 2};
  rdep_layer_spec spec{};
  spec.struct_size = sizeof spec;
  spec.backend = RDEP_BACKEND_CUDA_ONE_PROCESS;
  spec.world_size = 2;
  spec.num_gpus = 1;
  spec.tokens = s.tokens, spec.hidden = s.hidden, spec.ffn = s.ffn, spec.experts = s.experts, spec.topk = s.topk;
  spec.segment_tokens = 8;
  spec.barrier_timeout_s = 20;
  rdep_layer* l = nullptr;
  ASSERT_EQ(rdep_layer_create(&spec, &l), 0) << rdep_last_error();
  const Routing routing = *GenerateRouting(s, RoutingSpec{});
  const MoEWeights w = RandomWeights(s, 5);
  std::vector<rdep_rank_io> io(2);
  std::vector<void*> owned;
  for (size_t r = 0; r < 2; ++r) {
    const size_t n = static_cast<size_t>(s.tokens), ne = 2;
    auto* e = Upload(routing[r].experts);
    auto* g = Upload(routing[r].gates);
    auto* x = Upload(Bits(n * 64, 0x3f80));
    auto* y = Upload(Bits(n * 64, 0));
    auto* w1 = Upload(ToBits(w.w1, r * ne * w.w1_per_expert(), ne * w.w1_per_expert()));
    auto* w2 = Upload(ToBits(w.w2, r * ne * w.w2_per_expert(), ne * w.w2_per_expert()));
    auto* dx = Upload(Bits(n * 64, 0));
    auto* dg = Upload(std::vector<float>(n * 2, 0.f));
    auto* dw1 = Upload(Bits(ne * w.w1_per_expert(), 0));
    auto* dw2 = Upload(Bits(ne * w.w2_per_expert(), 0));
    owned.insert(owned.end(), {e, g, x, y, w1, w2, dx, dg, dw1, dw2});
    io[r] = rdep_rank_io{s.tokens, e, g, x, y, w1, w2, x, dx, dg, dw1, dw2, nullptr, 1, 0};
  }
  int64_t ctx = 0;
  ASSERT_EQ(rdep_context_acquire(l, &ctx), 0);
  ASSERT_EQ(rdep_layer_forward(l, ctx, io.data(), 2), 0) << rdep_last_error();
  EXPECT_EQ(rdep_layer_backward(l, ctx, io.data(), 2), 1);  // refused by the configuration, before the collective
  EXPECT_NE(std::string(rdep_last_error()).find("one segment"), std::string::npos) << rdep_last_error();
  // A weight view that is not 16-byte aligned is refused before the collective too.
  io[1].w1 = static_cast<const char*>(io[1].w1) + 2;
  EXPECT_EQ(rdep_layer_forward(l, ctx, io.data(), 2), 1);
  EXPECT_NE(std::string(rdep_last_error()).find("w1 must be 16-byte aligned"), std::string::npos) << rdep_last_error();
  rdep_layer_destroy(l);
  for (void* p : owned) cudaFree(p);
}

}  // namespace
}  // namespace rdep
