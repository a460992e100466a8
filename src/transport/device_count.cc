#include "rdep/cuda/device_count.h"

#if defined(RDEP_HAVE_CUDA)
#include "rdep/cuda/check.h"
#endif

namespace rdep {

int CudaDeviceCount() {
#if defined(RDEP_HAVE_CUDA)
  return cuda::DeviceCount();
#else
  return 0;
#endif
}

}  // namespace rdep
