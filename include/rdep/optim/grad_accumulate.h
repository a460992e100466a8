// A bf16 gradient moved into an fp32 accumulator (rdep.torch.MasterAdamW(fp32_grads=True)'s hook, once per
// micro-batch and parameter):
//   add false:  acc[i] = float(grad[i])             (the step's first micro-batch; exact)
//   add true:   acc[i] = acc[i] + float(grad[i])    (one fp32 rounding: torch's acc.add_(grad) bit for bit)
// 6 bytes an element moved (copy) or 10 (add). torch's own add of a bf16 tensor into an fp32 one runs its
// mixed-dtype elementwise path (2.76 TB/s on an H200, docs/perf-notes.md, thirty-fourth session); the kernel
// here moves 16 bytes of gradient and 32 of accumulator a thread.
#pragma once

#include <cstdint>

#include "rdep/status.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace rdep::optim {

struct GradAccumulation {
  float* acc = nullptr;             // fp32 [numel]
  const uint16_t* grad = nullptr;   // bf16 bits [numel]
  int64_t numel = 0;
  bool add = true;                  // false: acc is overwritten
};

// InvalidArgument naming the field: numel < 0, a null array (numel > 0), or acc and grad overlapping.
Status CheckGradAccumulation(const GradAccumulation& a);

// The host reference (and the host path of the C ABI).
void GradAccumulateHost(const GradAccumulation& a);

#if defined(RDEP_HAVE_CUDA)
// The CUDA kernel on `stream`, both arrays in device memory of the current device: eight elements a thread
// where acc is 16-byte and grad 16-byte aligned, one at a time otherwise (and for the tail).
Status LaunchGradAccumulate(const GradAccumulation& a, cudaStream_t stream);
#endif

}  // namespace rdep::optim
