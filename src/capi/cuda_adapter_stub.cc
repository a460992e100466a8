// The C ABI's CUDA backend in a build without CUDA.
#include "capi/layer_adapter.h"

namespace rdep::capi {

StatusOr<std::unique_ptr<LayerAdapter>> MakeCudaAdapter(const rdep_layer_spec&, const LayerConfig&, const OwnershipMap&,
                                                        double) {
  return Unavailable("layer spec: this build of rdep has no CUDA backend (configured without a CUDA compiler)");
}

}  // namespace rdep::capi
