// Lab (issue 19: the transport's floor): how fast the SMs of one GPU write rows into a peer GPU's memory over
// NVLink, by the copy the scatter and the return use (rdep's detail::WarpCopyRow from src/dispatch/warp_rows.cuh, which
// their WarpRowHead finishes with: a warp per 4 KiB row, 16-byte vectors, 8 loads in flight per lane) and by the bulk copy engine (cp.async.bulk: a row into shared memory, then from there into
// the peer's memory, kStages rows in flight per block), against cudaMemcpyPeerAsync (the copy engines, one
// contiguous copy). The kernels' rows land at a permuted position (as the scatter's slots do). One direction
// (GPU 0 writes to GPU 1) and both at once (each writes to the other, as every rank of a dispatch does).
// Each result is checked.
//   nvcc -O3 -std=c++17 -arch=sm_90a -Iinclude -Isrc -o /tmp/psr bench/lab/peer_store_rate.cu && /tmp/psr [rows [row_bytes]]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dispatch/warp_rows.cuh"

#include "lab_check.h"

// Row r of src lands at row perm(r) of dst: r * P mod rows, P a prime above rows (a bijection on [0, rows), the
// spread order of ReturnRowsKernel).
__host__ __device__ inline int64_t Perm(int64_t r, int64_t rows) { return (r * 2654435761LL) % rows; }

__global__ void __launch_bounds__(256) WarpRows(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int64_t rows,
                                                int64_t H) {
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < rows; r += warps)
    rdep::dispatch::detail::WarpCopyRow(src + r * H, dst + Perm(r, rows) * H, H);
}

__device__ __forceinline__ uint32_t Smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// One thread per block drives kStages shared-memory row buffers: the bulk engine loads a row into a buffer
// (completing on that buffer's mbarrier), then stores the buffer into the peer's row; a buffer is reloaded
// once the bulk store before it has read it (cp.async.bulk.wait_group.read).
template <int kStages>
__global__ void BulkRows(const char* __restrict__ src, char* __restrict__ dst, int64_t rows, uint32_t row_bytes) {
  extern __shared__ __align__(128) char buf[];
  __shared__ __align__(8) uint64_t bar[kStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(Smem(&bar[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  uint32_t phase[kStages] = {};
  int64_t it = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, ++it) {
    const int s = static_cast<int>(it % kStages);
    char* b = buf + static_cast<size_t>(s) * row_bytes;
    // The buffer's previous store must have read it: at most kStages - 1 bulk groups still reading.
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kStages - 1) : "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(Smem(&bar[s])), "r"(row_bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(Smem(b)),
                 "l"(src + r * row_bytes), "r"(row_bytes), "r"(Smem(&bar[s]))
                 : "memory");
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(Smem(&bar[s])), "r"(phase[s])
          : "memory");
    phase[s] ^= 1u;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + Perm(r, rows) * row_bytes),
                 "r"(Smem(b)), "r"(row_bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Side {
  int dev;
  cudaStream_t stream;
  cudaEvent_t a, b;
  char* src;    // on dev
  char* dst;    // on the other GPU: dev writes into it
};

// Runs launch(side) on the sides given, together, iters times after warmup; p50 of the slowest side's time.
template <typename F>
float TimeSides(std::vector<Side*> sides, F launch, int warmup = 5, int iters = 30) {
  std::vector<float> v;
  for (int i = 0; i < warmup + iters; ++i) {
    for (Side* s : sides) {
      CK(cudaSetDevice(s->dev));
      CK(cudaDeviceSynchronize());
    }
    for (Side* s : sides) {
      CK(cudaSetDevice(s->dev));
      CK(cudaEventRecord(s->a, s->stream));
      launch(*s);
      CK(cudaEventRecord(s->b, s->stream));
    }
    float worst = 0;
    for (Side* s : sides) {
      CK(cudaSetDevice(s->dev));
      CK(cudaEventSynchronize(s->b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, s->a, s->b));
      worst = std::max(worst, ms);
    }
    if (i >= warmup) v.push_back(worst * 1000.f);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Every row of each side's dst equals the source row that maps to it (the same row when not permuted: the
// copy engine's contiguous copy).
bool Check(const Side& s, const std::vector<char>& src_host, int64_t rows, int64_t row_bytes, bool permuted) {
  std::vector<char> got(rows * row_bytes);
  CK(cudaSetDevice(s.dev));
  CK(cudaMemcpy(got.data(), s.dst, got.size(), cudaMemcpyDefault));
  for (int64_t r = 0; r < rows; ++r)
    if (std::memcmp(got.data() + (permuted ? Perm(r, rows) : r) * row_bytes, src_host.data() + r * row_bytes, row_bytes) != 0) {
      std::printf("  MISMATCH at source row %lld\n", static_cast<long long>(r));
      return false;
    }
  return true;
}

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int64_t row_bytes = argc > 2 ? std::atoll(argv[2]) : 4096;
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2 || rows < 1 || row_bytes % 16 != 0) {
    std::fprintf(stderr, "needs 2 GPUs, rows >= 1 and row_bytes a multiple of 16 (have %d GPUs)\n", n);
    return 2;
  }
  const size_t bytes = static_cast<size_t>(rows * row_bytes);
  Side side[2];
  std::vector<char> host(bytes);
  for (size_t i = 0; i < bytes; ++i) host[i] = static_cast<char>((i * 131) ^ (i >> 12));
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    side[d].dev = d;
    CK(cudaStreamCreateWithFlags(&side[d].stream, cudaStreamNonBlocking));
    CK(cudaEventCreate(&side[d].a));
    CK(cudaEventCreate(&side[d].b));
    CK(cudaMalloc(&side[d].src, bytes));
    CK(cudaMemcpy(side[d].src, host.data(), bytes, cudaMemcpyHostToDevice));
  }
  for (int d = 0; d < 2; ++d) {  // dst of side d lives on the other GPU
    CK(cudaSetDevice(1 - d));
    CK(cudaMalloc(&side[d].dst, bytes));
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("peer_store_rate: %lld rows of %lld bytes (%.1f MiB) a side, %d SMs; p50 of 30, GB/s = bytes a side / time\n",
              static_cast<long long>(rows), static_cast<long long>(row_bytes), bytes / 1048576.0, sms);
  const int64_t H = row_bytes / 2;  // bf16 elements a row
  auto report = [&](const char* what, int blocks, float us_one, float us_both, bool permuted = true) {
    bool ok = true;
    for (int d = 0; d < 2; ++d) ok = ok && Check(side[d], host, rows, row_bytes, permuted);
    std::printf("%-26s blocks %5d  one way %8.1f us %7.1f GB/s   both ways %8.1f us %7.1f GB/s a side  %s\n", what, blocks, us_one,
                bytes / (us_one * 1e3), us_both, bytes / (us_both * 1e3), ok ? "ok" : "WRONG");
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(1 - d));
      CK(cudaMemset(side[d].dst, 0, bytes));
    }
  };
  std::vector<Side*> one{&side[0]}, both{&side[0], &side[1]};
  {
    auto ce = [&](Side& s) { CK(cudaMemcpyPeerAsync(s.dst, 1 - s.dev, s.src, s.dev, bytes, s.stream)); };
    report("cudaMemcpyPeerAsync", 0, TimeSides(one, ce), TimeSides(both, ce), /*permuted=*/false);
  }
  for (int blocks : {16, 32, 66, 132, 264, 528, 1056}) {
    auto kw = [&](Side& s) {
      WarpRows<<<blocks, 256, 0, s.stream>>>(reinterpret_cast<const uint16_t*>(s.src), reinterpret_cast<uint16_t*>(s.dst), rows, H);
    };
    report("warp row (WarpCopyRow)", blocks, TimeSides(one, kw), TimeSides(both, kw));
  }
  constexpr int kStages = 4;
  const size_t smem = kStages * static_cast<size_t>(row_bytes);
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaFuncSetAttribute(BulkRows<kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  for (int blocks : {16, 32, 66, 132, 264, 528}) {
    auto kb = [&](Side& s) {
      BulkRows<kStages><<<blocks, 32, smem, s.stream>>>(s.src, s.dst, rows, static_cast<uint32_t>(row_bytes));
      CK(cudaGetLastError());
    };
    report("bulk copy, 4 stages", blocks, TimeSides(one, kb), TimeSides(both, kb));
  }
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceSynchronize());
  }
  std::printf("done\n");
  return 0;
}
