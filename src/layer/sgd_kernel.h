// Launcher of the in-place bf16 SGD step used by CudaMoELayer::ApplySgd.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "rdep/status.h"

namespace rdep {
Status LaunchSgdBf16(__nv_bfloat16* w, const float* dw, size_t n, float lr, cudaStream_t stream);
}  // namespace rdep
