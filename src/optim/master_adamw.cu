// AdamW with fp32 master weights on the GPU (master_adamw.h): an elementwise pass at the memory's
// bandwidth, 14 bytes read and 14 written an element (fp32 master, exp_avg, exp_avg_sq; bf16 grad
// in, bf16 param out), the same bytes as torch's fused AdamW on fp32 parameters and gradients; 16 read
// with fp32 gradients.
#include <cuda_bf16.h>

#include <algorithm>

#include "rdep/cuda/check.h"
#include "rdep/optim/master_adamw.h"

namespace rdep::optim {
namespace {

constexpr int kThreads = 256;

// Rounded fp32 operations, never contracted into fused multiply-adds: the host reference's order.
__device__ __forceinline__ void Update(float g, float& w, float& m, float& v, const AdamWCoeffs& c) {
  w = __fmul_rn(w, c.decay);
  m = c.one_minus_beta1 < 0.5f ? __fadd_rn(m, __fmul_rn(c.one_minus_beta1, __fsub_rn(g, m)))  // torch's lerp
                                : __fsub_rn(g, __fmul_rn(__fsub_rn(g, m), __fsub_rn(1.0f, c.one_minus_beta1)));
  v = __fadd_rn(__fmul_rn(c.beta2, v), __fmul_rn(c.one_minus_beta2, __fmul_rn(g, g)));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
  w = __fsub_rn(w, __fdiv_rn(__fmul_rn(c.step_size, m), denom));
}

// g * grad_scale (1 when null: exact, as the host reference's unscaled gradient).
__device__ __forceinline__ float Scaled(float g, float scale) { return __fmul_rn(g, scale); }

// Four gradients as fp32 from one vector load: four bf16 (8 bytes) or four fp32 (16 bytes).
template <class G> struct Grad4;
template <> struct Grad4<__nv_bfloat16> {
  using Vec = uint2;
  __device__ __forceinline__ static float4 Load(const Vec* p, int64_t i) {
    const uint2 raw = p[i];
    const auto* g = reinterpret_cast<const __nv_bfloat16*>(&raw);
    return make_float4(__bfloat162float(g[0]), __bfloat162float(g[1]), __bfloat162float(g[2]), __bfloat162float(g[3]));
  }
};
template <> struct Grad4<float> {
  using Vec = float4;
  __device__ __forceinline__ static float4 Load(const Vec* p, int64_t i) { return p[i]; }
};
__device__ __forceinline__ float GradAt(const __nv_bfloat16* g, int64_t i) { return __bfloat162float(g[i]); }
__device__ __forceinline__ float GradAt(const float* g, int64_t i) { return g[i]; }

__device__ __forceinline__ float ScaleOf(const float* grad_scale) { return grad_scale ? *grad_scale : 1.0f; }

// Four elements a thread: float4 master and moments, four bf16 (8 bytes) of param, four G of grad.
template <class G>
__global__ void __launch_bounds__(kThreads)
MasterAdamWVec4Kernel(float4* master, float4* exp_avg, float4* exp_avg_sq, const typename Grad4<G>::Vec* grad, uint2* param,
                      int64_t n4, AdamWCoeffs c, const float* grad_scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float scale = ScaleOf(grad_scale);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4; i += stride) {
    float4 w = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    const float4 g = Grad4<G>::Load(grad, i);
    Update(Scaled(g.x, scale), w.x, m.x, v.x, c);
    Update(Scaled(g.y, scale), w.y, m.y, v.y, c);
    Update(Scaled(g.z, scale), w.z, m.z, v.z, c);
    Update(Scaled(g.w, scale), w.w, m.w, v.w, c);
    master[i] = w;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    uint2 praw;
    auto* p = reinterpret_cast<__nv_bfloat16*>(&praw);
    p[0] = __float2bfloat16_rn(w.x);
    p[1] = __float2bfloat16_rn(w.y);
    p[2] = __float2bfloat16_rn(w.z);
    p[3] = __float2bfloat16_rn(w.w);
    param[i] = praw;
  }
}

// Elements [first, n) one a thread: unaligned arrays, and the vector kernel's tail.
template <class G>
__global__ void __launch_bounds__(kThreads)
MasterAdamWKernel(float* master, float* exp_avg, float* exp_avg_sq, const G* grad, __nv_bfloat16* param, int64_t first, int64_t n,
                  AdamWCoeffs c, const float* grad_scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float scale = ScaleOf(grad_scale);
  for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float w = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    Update(Scaled(GradAt(grad, i), scale), w, m, v, c);
    master[i] = w;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = __float2bfloat16_rn(w);
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

// The two kernels for gradients of type G.
template <class G>
Status Launch(const MasterTensor& t, const AdamWCoeffs& c, const float* grad_scale, cudaStream_t stream) {
  const auto* grad = static_cast<const G*>(t.grad);
  auto* param = reinterpret_cast<__nv_bfloat16*>(t.param);
  const bool vec = Aligned(t.master, 16) && Aligned(t.exp_avg, 16) && Aligned(t.exp_avg_sq, 16) &&
                   Aligned(t.grad, 4 * sizeof(G)) && Aligned(t.param, 8);
  const int64_t n4 = vec ? t.numel / 4 : 0;
  int blocks = 0;
  if (n4 > 0) {
    RDEP_RETURN_IF_ERROR(Blocks(n4, &blocks));
    MasterAdamWVec4Kernel<G><<<blocks, kThreads, 0, stream>>>(
        reinterpret_cast<float4*>(t.master), reinterpret_cast<float4*>(t.exp_avg), reinterpret_cast<float4*>(t.exp_avg_sq),
        reinterpret_cast<const typename Grad4<G>::Vec*>(grad), reinterpret_cast<uint2*>(param), n4, c, grad_scale);
    RDEP_CUDA_CHECK_LAUNCH();
  }
  if (const int64_t first = n4 * 4; first < t.numel) {
    RDEP_RETURN_IF_ERROR(Blocks(t.numel - first, &blocks));
    MasterAdamWKernel<G><<<blocks, kThreads, 0, stream>>>(t.master, t.exp_avg, t.exp_avg_sq, grad, param, first, t.numel, c, grad_scale);
    RDEP_CUDA_CHECK_LAUNCH();
  }
  return Status::Ok();
}

}  // namespace

Status LaunchMasterAdamW(const MasterTensor& t, const AdamWCoeffs& c, const float* grad_scale, cudaStream_t stream) {
  if (t.numel == 0) return Status::Ok();
  return t.grad_dtype == GradDtype::kFp32 ? Launch<float>(t, c, grad_scale, stream) : Launch<__nv_bfloat16>(t, c, grad_scale, stream);
}

}  // namespace rdep::optim
