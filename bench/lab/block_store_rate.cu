// Lab (GPU planner, docs/perf-notes.md round 5): how fast one 1024-thread block writes a route-sized
// table (64 rows x 297 columns) to global memory: int64 or int32 entries, every column or ~87% of them
// (the single-instance columns), from 29 warps. Reports the SM cycles until the last warp has issued
// its stores and the event time of the launch, next to an empty launch of the same shape.
//   nvcc -O3 -arch=sm_90a -o /tmp/bs bench/lab/block_store_rate.cu && /tmp/bs
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int kRows = 64, kCols = 297;

template <typename T>
__global__ void Store(T* out, int warps, int skip_mod, long long* cyc) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long c0 = clock64();
  if (warp < warps) {
    for (int r = warp; r < kRows; r += warps) {
      T* row = out + static_cast<size_t>(r) * kCols;
#pragma unroll 4
      for (int c = lane; c < kCols; c += 32)
        if (skip_mod == 0 || c % skip_mod != 0) row[c] = static_cast<T>(r * 1000 + c);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *cyc = clock64() - c0;
}

__global__ void Empty(long long* cyc) {
  if (threadIdx.x == 0) *cyc = 0;
}

template <typename K>
float TimeIt(K k) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> v;
  for (int i = 0; i < 200; ++i) {
    cudaEventRecord(a);
    k();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (i >= 20) v.push_back(ms * 1000);
  }
  std::sort(v.begin(), v.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return v[v.size() / 2];
}

int main() {
  void* buf = nullptr;
  long long* cyc = nullptr;
  cudaMalloc(&buf, sizeof(int64_t) * kRows * kCols);
  cudaMalloc(&cyc, sizeof(long long));
  long long host_cyc = 0;
  printf("empty launch (1024 threads): p50 %.2f us\n", TimeIt([&] { Empty<<<1, 1024>>>(cyc); }));
  for (int w : {29, 32}) {
    for (int skip : {0, 8}) {
      const float t64 = TimeIt([&] { Store<int64_t><<<1, 1024>>>(static_cast<int64_t*>(buf), w, skip, cyc); });
      cudaMemcpy(&host_cyc, cyc, sizeof(host_cyc), cudaMemcpyDeviceToHost);
      const long long c64 = host_cyc;
      const float t32 = TimeIt([&] { Store<int32_t><<<1, 1024>>>(static_cast<int32_t*>(buf), w, skip, cyc); });
      cudaMemcpy(&host_cyc, cyc, sizeof(host_cyc), cudaMemcpyDeviceToHost);
      printf("%d warps, skip every %d-th column: int64 %lld cycles to issue, launch p50 %.2f us | int32 %lld cycles, %.2f us\n",
             w, skip, c64, t64, host_cyc, t32);
    }
  }
  const cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
