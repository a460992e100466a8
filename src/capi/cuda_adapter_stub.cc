// The C ABI's CUDA backend in a build without CUDA.
#include "capi/layer_adapter.h"

namespace rdep::capi {

StatusOr<std::unique_ptr<LayerAdapter>> MakeCudaAdapter(Domain&, const LayerConfig&, const OwnershipMap&) {
  return Unavailable("layer spec: this build of rdep has no CUDA backend (configured without a CUDA compiler)");
}

StatusOr<std::unique_ptr<Domain>> MakeCudaDomain(const DomainSpec&, const std::string& what) {
  return Unavailable(what + ": this build of rdep has no CUDA backend (configured without a CUDA compiler)");
}

int32_t CudaDomainDevice(const Domain&, int32_t) { return -1; }

void WithCallerDevice(const std::function<void()>& fn) { fn(); }

Status CutlassComputeAvailable(int32_t) {
  return Unavailable("cutlass expert compute: this build of rdep has no CUDA backend (configured without a CUDA compiler)");
}

}  // namespace rdep::capi
