// The CUDA side of grad_accumulate.h: acc = float(grad) or acc + float(grad), 16 bytes of bf16 gradient and 32 of
// fp32 accumulator a thread.
#include <cuda_bf16.h>

#include <algorithm>

#include "rdep/cuda/check.h"
#include "rdep/optim/grad_accumulate.h"

namespace rdep::optim {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Bf16ToFloat(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Eight elements a thread: one uint4 of gradient (eight bf16), two float4 of accumulator.
__global__ void __launch_bounds__(kThreads) GradAccumulateVec8Kernel(float4* acc, const uint4* grad, int64_t n8, bool add) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8; i += stride) {
    const uint4 g = grad[i];
    float4 lo = make_float4(Bf16ToFloat(g.x & 0xffffu), Bf16ToFloat(g.x >> 16), Bf16ToFloat(g.y & 0xffffu), Bf16ToFloat(g.y >> 16));
    float4 hi = make_float4(Bf16ToFloat(g.z & 0xffffu), Bf16ToFloat(g.z >> 16), Bf16ToFloat(g.w & 0xffffu), Bf16ToFloat(g.w >> 16));
    if (add) {
      const float4 a = acc[2 * i], b = acc[2 * i + 1];
      lo = make_float4(__fadd_rn(a.x, lo.x), __fadd_rn(a.y, lo.y), __fadd_rn(a.z, lo.z), __fadd_rn(a.w, lo.w));
      hi = make_float4(__fadd_rn(b.x, hi.x), __fadd_rn(b.y, hi.y), __fadd_rn(b.z, hi.z), __fadd_rn(b.w, hi.w));
    }
    acc[2 * i] = lo;
    acc[2 * i + 1] = hi;
  }
}

// Elements [first, n) one a thread: unaligned arrays, and the vector kernel's tail.
__global__ void __launch_bounds__(kThreads) GradAccumulateKernel(float* acc, const uint16_t* grad, int64_t first, int64_t n, bool add) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const float g = Bf16ToFloat(grad[i]);
    acc[i] = add ? __fadd_rn(acc[i], g) : g;
  }
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Enough blocks to cover the work, at most 8 resident blocks' worth per SM (grid-stride beyond).
Status Blocks(int64_t work, int* blocks) {
  int device = 0, sms = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  *blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 8));
  return Status::Ok();
}

}  // namespace

Status LaunchGradAccumulate(const GradAccumulation& a, cudaStream_t stream) {
  if (a.numel == 0) return Status::Ok();
  const int64_t n8 = Aligned(a.acc, 16) && Aligned(a.grad, 16) ? a.numel / 8 : 0;
  int blocks = 0;
  if (n8 > 0) {
    RDEP_RETURN_IF_ERROR(Blocks(n8, &blocks));
    GradAccumulateVec8Kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<float4*>(a.acc), reinterpret_cast<const uint4*>(a.grad),
                                                              n8, a.add);
    RDEP_CUDA_CHECK_LAUNCH();
  }
  if (const int64_t first = n8 * 8; first < a.numel) {
    RDEP_RETURN_IF_ERROR(Blocks(a.numel - first, &blocks));
    GradAccumulateKernel<<<blocks, kThreads, 0, stream>>>(a.acc, a.grad, first, a.numel, a.add);
    RDEP_CUDA_CHECK_LAUNCH();
  }
  return Status::Ok();
}

}  // namespace rdep::optim
