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
// Only for translation units built with the CUDA toolkit (RDEP_HAVE_CUDA), inside rdep's build (an internal header:
// RDEP_PDL_ARCHS comes from rdep_set_options, the same for every target that includes it).
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

// This process's RDEP_PDL (empty when unset) and mode (ParsePdlMode), read once. PDL also needs every kernel built
// with its wait: RDEP_PDL_ARCHS (CMake: every architecture in RDEP_CUDA_ARCHITECTURES is 90 or above). A build for an
// older architecture would run on a Hopper GPU from JIT-compiled PTX whose kernels do not wait.
struct PdlSetting {
  std::string value;
  int mode = 0;
};
inline const PdlSetting& Pdl() {
  static const PdlSetting setting = [] {
    bool all = true;
#if !defined(RDEP_PDL_ARCHS)
    all = false;
#endif
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
    const char* v = std::getenv("RDEP_PDL");
    return PdlSetting{v ? v : "", ParsePdlMode(v, all)};
  }();
  return setting;
}
inline int PdlMode() { return Pdl().mode; }

// Ok, or InvalidArgument naming RDEP_PDL when it holds neither on nor off (LaunchPdl's check, for launchers that
// return a cudaError_t to check first).
inline Status CheckPdlSetting() {
  if (PdlMode() >= 0) return Status::Ok();
  return InvalidArgument("RDEP_PDL='" + Pdl().value + "': expected on (the default) or off");
}

namespace detail {
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                         Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = shared_bytes;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
}  // namespace detail

// kernel<<<grid, block, shared_bytes, stream>>>(args...), with programmatic stream serialization when PdlMode() is 1;
// the launch's error (cudaErrorInvalidValue for a bad RDEP_PDL: check CheckPdlSetting first to name it). The caller
// synchronizes under RDEP_DEBUG_SYNC (RDEP_CUDA_CHECK_LAUNCH), as after a <<<>>> launch.
template <typename... Params, typename... Args>
cudaError_t LaunchPdlError(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                           Args&&... args) {
  const int mode = PdlMode();
  if (mode < 0) return cudaErrorInvalidValue;
  return detail::LaunchKernel(mode == 1, kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
}

// The same as a Status naming the kernel and the launch site (RDEP_LAUNCH_PDL passes them), and RDEP_PDL when it
// holds neither on nor off.
template <typename... Params, typename... Args>
Status LaunchPdl(const char* name, const char* file, int line, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                 cudaStream_t stream, Args&&... args) {
  RDEP_RETURN_IF_ERROR(CheckPdlSetting());
  const int mode = PdlMode();
  const cudaError_t err = detail::LaunchKernel(mode == 1, kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
  if (err != cudaSuccess) return CudaStatus(err, (std::string("launch of ") + name).c_str(), file, line);  // the text only on failure
#if defined(RDEP_DEBUG_SYNC)
  if (const cudaError_t sync = cudaDeviceSynchronize(); sync != cudaSuccess)
    return CudaStatus(sync, (std::string(name) + " (debug sync)").c_str(), file, line);
#endif
  return Status::Ok();
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

// kernel<<<grid, block, shared_bytes, stream>>>(args...) with PDL: RDEP_LAUNCH_PDL(kernel, grid, block, shared_bytes,
// stream, args...) returns from the calling function (a Status) on failure, naming the kernel and this call's file and
// line. A template kernel whose arguments hold a comma goes in parentheses.
#define RDEP_LAUNCH_PDL(kernel, ...) RDEP_RETURN_IF_ERROR(::rdep::cuda::LaunchPdl(#kernel, __FILE__, __LINE__, kernel, __VA_ARGS__))
