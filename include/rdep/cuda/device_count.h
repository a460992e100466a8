// Number of usable CUDA devices, callable from any build: 0 without CUDA, without a driver, or
// without a device.
#pragma once

namespace rdep {
int CudaDeviceCount();
}  // namespace rdep
