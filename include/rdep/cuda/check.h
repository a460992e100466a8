// Checked CUDA / cuBLAS calls that turn failures into rdep::Status with the call, file and line.
// The sticky-error case (a kernel fault) is reported as such. Only for translation units built with
// the CUDA toolkit (RDEP_HAVE_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "rdep/status.h"

namespace rdep::cuda {

inline Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear a non-sticky error so later calls are not poisoned by it
  return Status(StatusCode::kCudaError, std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
                                            cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// Number of usable CUDA devices; 0 when there is no driver or no device (never an error).
inline int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace rdep::cuda

#define RDEP_CUDA_RETURN_IF_ERROR(expr) \
  RDEP_RETURN_IF_ERROR(::rdep::cuda::CudaStatus((expr), #expr, __FILE__, __LINE__))

// After a kernel launch: reports launch errors; with -DRDEP_DEBUG_SYNC=ON also synchronizes so a
// faulting kernel is reported at its own launch site.
#if defined(RDEP_DEBUG_SYNC)
#define RDEP_CUDA_CHECK_LAUNCH()                                                                   \
  do {                                                                                             \
    RDEP_RETURN_IF_ERROR(::rdep::cuda::CudaStatus(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)); \
    RDEP_RETURN_IF_ERROR(::rdep::cuda::CudaStatus(cudaDeviceSynchronize(), "kernel (debug sync)", __FILE__, __LINE__)); \
  } while (0)
#else
#define RDEP_CUDA_CHECK_LAUNCH() \
  RDEP_RETURN_IF_ERROR(::rdep::cuda::CudaStatus(cudaGetLastError(), "kernel launch", __FILE__, __LINE__))
#endif
