// Lab (issue 19, the dispatch's routing phase; issues 14-15, a layer's chain of small kernels): what does
// programmatic dependent launch (PDL, sm_90) take off a chain of dependent small kernels such as the
// plan's (16 blocks, ~100 KB read, ~5 us each under ncu, most of it launch and ramp)?
// A chain of N kernels, kernel i reading what kernel i-1 wrote (a[i % 2] -> a[(i + 1) % 2], one int per element,
// plus a running sum), timed by events over R repetitions, in five variants:
//   plain      <<<>>> launches
//   pdl        cudaLaunchKernelEx with programmatic stream serialization; each kernel waits
//              (griddepcontrol.wait) before its first load; no early trigger (the dependent launches as
//              the primary's blocks exit)
//   pdl+early  the same, each kernel triggering its dependent (griddepcontrol.launch_dependents) at its start
//   graph      the plain chain captured in a CUDA graph, replayed
//   graph+pdl  the pdl+early chain captured, replayed (programmatic edges in the graph)
// Every variant's final array is checked against the host (a race would show as a wrong sum).
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/pdl bench/lab/pdl_chain.cu && /tmp/pdl [elements [blocks [kernels]]]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lab_check.h"

namespace {

// out[j] = in[j] + in[(j + 1) % n] (mod 2^32): each element needs two of the primary's, one of them written by
// another block, so a dependent that ran early would read stale values.
template <bool kEarly>
__global__ void Step(const uint32_t* __restrict__ in, uint32_t* __restrict__ out, int64_t n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (kEarly) asm volatile("griddepcontrol.launch_dependents;" :::);
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < n; j += int64_t{gridDim.x} * blockDim.x)
    out[j] = in[j] + in[(j + 1) % n];
}

struct Chain {
  uint32_t* a[2];
  int64_t n;
  int blocks, kernels;
};

void Launch(const Chain& c, int variant /*0 plain, 1 pdl, 2 pdl+early*/, cudaStream_t s) {
  for (int i = 0; i < c.kernels; ++i) {
    const uint32_t* in = c.a[i % 2];
    uint32_t* out = c.a[(i + 1) % 2];
    if (variant == 0) {
      Step<false><<<c.blocks, 256, 0, s>>>(in, out, c.n);
      continue;
    }
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(c.blocks);
    cfg.blockDim = dim3(256);
    cfg.stream = s;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (variant == 1)
      CK(cudaLaunchKernelEx(&cfg, Step<false>, in, out, c.n));
    else
      CK(cudaLaunchKernelEx(&cfg, Step<true>, in, out, c.n));
  }
  CK(cudaGetLastError());
}

std::vector<uint32_t> HostChain(std::vector<uint32_t> v, int kernels) {
  std::vector<uint32_t> w(v.size());
  for (int i = 0; i < kernels; ++i) {
    for (size_t j = 0; j < v.size(); ++j) w[j] = v[j] + v[(j + 1) % v.size()];
    v.swap(w);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 24576;  // 4096 tokens x 6 slots
  const int blocks = argc > 2 ? std::atoi(argv[2]) : 16;
  const int kernels = argc > 3 ? std::atoi(argv[3]) : 20;
  const int reps = 200;
  Chain c{{nullptr, nullptr}, n, blocks, kernels};
  CK(cudaMalloc(&c.a[0], n * 4));
  CK(cudaMalloc(&c.a[1], n * 4));
  std::vector<uint32_t> init(n);
  for (int64_t j = 0; j < n; ++j) init[j] = static_cast<uint32_t>(j * 2654435761u);
  const std::vector<uint32_t> want = HostChain(init, kernels);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const char* names[] = {"plain", "pdl", "pdl+early", "graph", "graph+pdl"};
  std::printf("chain of %d kernels, %d blocks x 256 threads, %lld elements (%lld KB read a kernel), %d repetitions\n",
              kernels, blocks, static_cast<long long>(n), static_cast<long long>(n * 8 / 1024), reps);
  int fails = 0;
  for (int round = 0; round < 2; ++round) {
    for (int v = 0; v < 5; ++v) {
      cudaGraphExec_t exec = nullptr;
      if (v >= 3) {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        Launch(c, v == 3 ? 0 : 2, s);
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&exec, g, 0));
        CK(cudaGraphDestroy(g));
      }
      const auto run = [&] {
        CK(cudaMemcpyAsync(c.a[0], init.data(), n * 4, cudaMemcpyHostToDevice, s));
        if (exec)
          CK(cudaGraphLaunch(exec, s));
        else
          Launch(c, v, s);
      };
      run();  // warm
      CK(cudaStreamSynchronize(s));
      std::vector<uint32_t> got(n);
      CK(cudaMemcpy(got.data(), c.a[kernels % 2], n * 4, cudaMemcpyDeviceToHost));
      const bool ok = got == want;
      fails += !ok;
      std::vector<float> ms(reps);
      for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0, s));
        if (exec)
          CK(cudaGraphLaunch(exec, s));
        else
          Launch(c, v, s);
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms[r], e0, e1));
      }
      std::sort(ms.begin(), ms.end());
      std::printf("round %d %-10s p50 %7.2f us a kernel (chain %8.2f us, p10 %8.2f, p90 %8.2f)  result %s\n", round, names[v],
                  1e3 * ms[reps / 2] / kernels, 1e3 * ms[reps / 2], 1e3 * ms[reps / 10], 1e3 * ms[reps * 9 / 10],
                  ok ? "exact" : "WRONG");
      if (exec) CK(cudaGraphExecDestroy(exec));
    }
  }
  std::printf("%s\n", fails ? "FAILED: a variant's result differs from the host" : "every variant exact");
  return fails ? 1 : 0;
}
