// In-place SGD on a rank's bf16 expert weights from fp32 gradients: w <- bf16(float(w) - lr * dw).
#include <cuda_bf16.h>

#include "rdep/cuda/check.h"
#include "layer/sgd_kernel.h"

namespace rdep {
namespace {
__global__ void SgdKernel(__nv_bfloat16* w, const float* dw, size_t n, float lr) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    w[i] = __float2bfloat16(__bfloat162float(w[i]) - lr * dw[i]);
}
}  // namespace

Status LaunchSgdBf16(__nv_bfloat16* w, const float* dw, size_t n, float lr, cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  const size_t blocks = std::min<size_t>((n + 255) / 256, 4096);
  SgdKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(w, dw, n, lr);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}
}  // namespace rdep
