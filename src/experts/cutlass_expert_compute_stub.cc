// MakeCutlassExpertCompute in a build without CUTLASS's headers (cmake/RdepCutlass.cmake).
#include "rdep/experts/expert_compute.h"

namespace rdep::kernels {

StatusOr<std::unique_ptr<ExpertCompute>> MakeCutlassExpertCompute(const ExpertMlpDesc&, int, const CutlassTiles&, void*) {
  return Unavailable("cutlass expert compute: this build has no CUTLASS headers (configure found no nvidia-cutlass wheel; "
                     "see cmake/RdepCutlass.cmake, or set RDEP_CUTLASS_DIR)");
}

std::vector<std::string> CutlassTileNames() { return {}; }

}  // namespace rdep::kernels
