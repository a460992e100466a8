// Kernel launches with programmatic dependent launch (PDL, compute capability 9.0+): the next kernel of a
// stream is launched as the previous kernel's blocks exit, and waits on the device (griddepcontrol.wait) for
// that kernel's completion and memory flush, rather than being launched only after both. It hides ~0.8 us
// of each launch in a stream and ~0.25 us in a CUDA graph (bench/lab/pdl_chain.cu, one H200, thirty-first
// session).
//
// The contract: a kernel launched by LaunchPdl calls WaitForPrimaryGrid() before its first access to global
// memory that an earlier kernel of the stream wrote, or that an earlier kernel reads and this one writes
// (rdep's kernels call it first). No rdep kernel triggers its dependents early (griddepcontrol.launch_dependents):
// the dependent launches only as every block of the previous kernel exits, so a kernel that spins on
// another rank's flags never shares the GPU with a dependent that waits on it (and early triggers measured
// no faster). Kernels launched any other way (CUTLASS, cuBLAS, torch) are ordered as before.
//
// RDEP_PDL=off launches every kernel the plain way (A/B timing; the results are the same bits).
// Only for translation units built with the CUDA toolkit (RDEP_HAVE_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "rdep/cuda/check.h"
#include "rdep/status.h"

namespace rdep::cuda {

// The launch mode from RDEP_PDL's value (null when unset) and whether every device has compute capability 9.0+:
// 1 launch with PDL, 0 plain launches (RDEP_PDL=off, or an older device), -1 RDEP_PDL holds neither on nor off.
inline int ParsePdlMode(const char* value, bool devices_have_pdl) {
  if (value != nullptr && std::strcmp(value, "off") == 0) return 0;
  if (value != nullptr && *value != '\0' && std::strcmp(value, "on") != 0) return -1;
  return devices_have_pdl ? 1 : 0;
}

// This process's mode (ParsePdlMode), read once.
inline int PdlMode() {
  static const int mode = [] {
    bool all = true;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      all = false;
    }
    for (int d = 0; d < n && all; ++d) {
      int major = 0;
      if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) != cudaSuccess) {
        cudaGetLastError();
        major = 0;
      }
      all = major >= 9;
    }
    return ParsePdlMode(std::getenv("RDEP_PDL"), all);
  }();
  return mode;
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), with programmatic stream serialization when PdlMode() is 1;
// the launch's error (cudaErrorInvalidValue for a bad RDEP_PDL: LaunchPdl names it).
template <typename... Params, typename... Args>
cudaError_t LaunchPdlError(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                           Args&&... args) {
  const int mode = PdlMode();
  if (mode < 0) return cudaErrorInvalidValue;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = shared_bytes;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = mode == 1 ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
#if defined(RDEP_DEBUG_SYNC)
  if (err == cudaSuccess) return cudaDeviceSynchronize();
#endif
  return err;
}

// The same as a Status that names the kernel launch (and RDEP_PDL when it holds neither on nor off).
template <typename... Params, typename... Args>
Status LaunchPdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  if (PdlMode() < 0)
    return InvalidArgument(std::string("RDEP_PDL='") + std::getenv("RDEP_PDL") + "': expected on (the default) or off");
  return CudaStatus(LaunchPdlError(kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...), "kernel launch", __FILE__,
                    __LINE__);
}

#if defined(__CUDACC__)
// First in every kernel LaunchPdl launches: waits until the stream's previous kernel has completed and its
// writes are visible. A no-op when the kernel was launched without PDL, and below sm_90.
__device__ __forceinline__ void WaitForPrimaryGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
#endif

}  // namespace rdep::cuda
