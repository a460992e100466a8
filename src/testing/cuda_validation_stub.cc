// Builds without the CUDA toolkit: the CUDA backend is reported as unavailable.
#include "rdep/testing/cuda_validation.h"

namespace rdep {

StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaBackend(int64_t, double, int) {
  return Unavailable("this build of rdep has no CUDA backend (configured without a CUDA compiler)");
}

StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaMultiProcessBackend(Bootstrap&, double) {
  return Unavailable("this build of rdep has no CUDA backend (configured without a CUDA compiler)");
}

}  // namespace rdep
