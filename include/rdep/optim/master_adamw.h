// AdamW over bf16 parameters with fp32 master weights: one pass per tensor reads the bf16 gradient and
// the fp32 master weight and moments, and writes the updated master weight, moments and the bf16
// parameter (its round-to-nearest-even copy), so the model's bf16 weights need no cast before a forward.
//
// The update is torch.optim.AdamW's (decoupled weight decay), in fp32 on the master weight w:
//   g  = grad * grad_scale                      (grad bf16 or fp32, read as fp32; grad_scale null: 1)
//   w  = w * (1 - lr * weight_decay)
//   m  = m + w * (g - m), w = 1 - beta1         (exp_avg.lerp_(g, w); for w >= 0.5, as torch's lerp,
//                                                g - (g - m) * (1 - w))
//   v  = beta2 * v + (1 - beta2) * g * g
//   w  = w - (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
//   param = bf16(w)
// The host reference and the CUDA kernel evaluate it in the same order with the same fp32 operations
// (no fused multiply-adds on the device), so they agree to the bit where the compiler honors that.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "rdep/core/byte_range.h"
#include "rdep/status.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace rdep::optim {

// The gradient's element type: bf16 (the parameter's own gradient) or fp32 (gradients accumulated in fp32 over
// micro-batches: rdep.torch.MasterAdamW(fp32_grads=True)).
enum class GradDtype : int32_t { kBf16 = 0, kFp32 = 1 };
constexpr size_t GradBytes(GradDtype d) { return d == GradDtype::kFp32 ? 4 : 2; }

// One tensor's arrays, numel elements each: master, exp_avg, exp_avg_sq fp32; param bf16 bits; grad bf16 bits or
// fp32 as grad_dtype says.
struct MasterTensor {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;
  uint16_t* param = nullptr;
  int64_t numel = 0;
  GradDtype grad_dtype = GradDtype::kBf16;
};

// In double, as torch holds them (Python floats): 1 - beta2, the bias corrections and lr * weight_decay are
// computed in double and rounded to fp32 once, so 1 - 0.999 is 0.001f and not 1 - 0.999f.
struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t step = 1;  // this update's step count (1 for the first update): the bias corrections'
};

// The update's coefficients, computed once per step on the host (in double, rounded to fp32 once).
struct AdamWCoeffs {
  float decay;          // 1 - lr * weight_decay
  float one_minus_beta1;  // the moment's lerp weight (torch's two-branch lerp)
  float beta2, one_minus_beta2;
  float step_size;      // lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
};

// InvalidArgument naming the field: lr, eps, weight_decay >= 0 and finite; beta1, beta2 in [0, 1); step >= 1.
Status CheckHyper(const AdamWHyper& h);
AdamWCoeffs Coeffs(const AdamWHyper& h);

// t's five arrays as named byte ranges (master, exp_avg, exp_avg_sq, grad, param; empty when numel <= 0).
std::array<ByteRange, 5> ArraysOf(const MasterTensor& t);

// InvalidArgument naming tensor `index` and the array: null arrays (numel > 0), numel < 0, an unknown grad_dtype,
// or arrays that overlap one another.
Status CheckTensor(const MasterTensor& t, int32_t index);
// InvalidArgument naming both tensors when any array of a overlaps any array of b.
Status CheckDisjoint(const MasterTensor& a, int32_t ia, const MasterTensor& b, int32_t ib);

// The host reference (and the host path of the C ABI): updates t in place. grad_scale: host pointer or null.
void MasterAdamWHost(const MasterTensor& t, const AdamWCoeffs& c, const float* grad_scale);

#if defined(RDEP_HAVE_CUDA)
// The CUDA kernel on `stream`: t's arrays and grad_scale (null or one fp32 value) in device memory of the
// current device. Four elements a thread where every array allows 16-byte (fp32) and 8-byte (bf16) vector
// accesses, one at a time otherwise.
Status LaunchMasterAdamW(const MasterTensor& t, const AdamWCoeffs& c, const float* grad_scale, cudaStream_t stream);
#endif

}  // namespace rdep::optim
