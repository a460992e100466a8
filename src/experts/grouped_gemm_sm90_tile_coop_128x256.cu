// The four grouped GEMM kinds with tile coop_128x256 (grouped_gemm_sm90_runner.cuh): one translation unit per tile.
#include "experts/grouped_gemm_sm90_runner.cuh"

namespace rdep::kernels::internal {

template <>
StatusOr<std::unique_ptr<GroupedGemmSm90>> MakeTiled<GroupedGemmTile::kCoop128x256>(GroupedGemmKind kind, int32_t groups, int64_t lda,
                                                                        int64_t ldb, int64_t ldd, int device) {
  return MakeTiledImpl<GroupedGemmTile::kCoop128x256>(kind, groups, lda, ldb, ldd, device);
}

}  // namespace rdep::kernels::internal
