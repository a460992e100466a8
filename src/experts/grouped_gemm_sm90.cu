// The sm_90a grouped GEMMs' host entry (grouped_gemm_sm90.h): kind and tile names, the availability
// check, and Create, which hands the (kind, tile) to the tile's translation unit
// (generated from grouped_gemm_sm90_tile.cu.in per tile; the configurations are in grouped_gemm_sm90_runner.cuh).
#include "experts/grouped_gemm_sm90.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "rdep/cuda/check.h"

namespace rdep::kernels::internal {

const char* GroupedGemmKindName(GroupedGemmKind k) {
  switch (k) {
    case GroupedGemmKind::kNN: return "NN (bf16)";
    case GroupedGemmKind::kNT: return "NT (bf16)";
    case GroupedGemmKind::kTN_F32: return "TN (fp32 out)";
    case GroupedGemmKind::kTN_BF16: return "TN (bf16 out)";
    case GroupedGemmKind::kNN_SwiGLU: return "NN (bf16) + SwiGLU";
  }
  return "?";
}

bool GroupedGemmSm90Available(int device, std::string* why) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    if (why) *why = "no CUDA device";
    return false;
  }
  cudaDeviceProp prop{};
  if (device < 0 || device >= count || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = "device " + std::to_string(device) + " is not a CUDA device here";
    return false;
  }
  if (prop.major != 9) {
    if (why) *why = "the CUTLASS grouped GEMMs are built for sm_90a (Hopper); device " + std::to_string(device) + " is sm_" +
                    std::to_string(prop.major * 10 + prop.minor);
    return false;
  }
  return true;
}

const char* GroupedGemmTileName(GroupedGemmTile t) {
  switch (t) {
    case GroupedGemmTile::kCoop128x128: return "coop_128x128";
    case GroupedGemmTile::kCoop128x256: return "coop_128x256";
    case GroupedGemmTile::kCoop128x128C1x2: return "coop_128x128_c1x2";
    case GroupedGemmTile::kCoop256x128C1x2: return "coop_256x128_c1x2";
    case GroupedGemmTile::kPing128x128: return "ping_128x128";
    case GroupedGemmTile::kPing128x128C2x1: return "ping_128x128_c2x1";
    case GroupedGemmTile::kCoop256x128C2x1: return "coop_256x128_c2x1";
    case GroupedGemmTile::kCoop128x256C2x1: return "coop_128x256_c2x1";
  }
  return "?";
}

StatusOr<GroupedGemmTile> ParseGroupedGemmTile(const std::string& name) {
  std::string known;
  for (GroupedGemmTile t : kGroupedGemmTiles) {
    if (name == GroupedGemmTileName(t)) return t;
    known += (known.empty() ? "" : ", ") + std::string(GroupedGemmTileName(t));
  }
  return InvalidArgument("grouped GEMM tile '" + name + "' is not one of: " + known);
}

const char* GroupedGemmMapsName(GroupedGemmMaps m) { return m == GroupedGemmMaps::kPrebuilt ? "prebuilt" : "kernel"; }

StatusOr<GroupedGemmMaps> DefaultGroupedGemmMaps() {
  const char* v = std::getenv("RDEP_GROUPED_GEMM_MAPS");
  if (v == nullptr || *v == '\0' || std::string(v) == "prebuilt") return GroupedGemmMaps::kPrebuilt;
  if (std::string(v) == "kernel") return GroupedGemmMaps::kInKernel;
  return InvalidArgument(std::string("RDEP_GROUPED_GEMM_MAPS='") + v + "': kernel or prebuilt");
}

StatusOr<std::unique_ptr<GroupedGemmSm90>> GroupedGemmSm90::Create(GroupedGemmKind kind, int32_t num_groups, int64_t lda,
                                                                   int64_t ldb, int64_t ldd, int device, GroupedGemmTile tile,
                                                                   const GroupedGemmMaps* maps_or_null) {
  const std::string what = std::string("grouped GEMM ") + GroupedGemmKindName(kind) + ": ";
  GroupedGemmMaps maps = GroupedGemmMaps::kInKernel;
  if (maps_or_null) {
    maps = *maps_or_null;
  } else {
    RDEP_ASSIGN_OR_RETURN(maps, DefaultGroupedGemmMaps());
  }
  if (num_groups < 1) return InvalidArgument(what + "num_groups must be >= 1, got " + std::to_string(num_groups));
  for (const auto& [ld, name] : {std::pair{lda, "lda"}, {ldb, "ldb"}, {ldd, "ldd"}})
    if (ld <= 0 || ld % 8 != 0 || ld > (int64_t{1} << 30))
      return InvalidArgument(what + name + " = " + std::to_string(ld) + " must be a positive multiple of 8 (16-byte rows for TMA)");
  std::string why;
  if (!GroupedGemmSm90Available(device, &why)) return Unavailable(what + why);
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  switch (tile) {
    case GroupedGemmTile::kCoop128x128: return MakeTiled<GroupedGemmTile::kCoop128x128>(kind, num_groups, lda, ldb, ldd, device, maps);
    case GroupedGemmTile::kCoop128x256: return MakeTiled<GroupedGemmTile::kCoop128x256>(kind, num_groups, lda, ldb, ldd, device, maps);
    case GroupedGemmTile::kCoop128x128C1x2:
      return MakeTiled<GroupedGemmTile::kCoop128x128C1x2>(kind, num_groups, lda, ldb, ldd, device, maps);
    case GroupedGemmTile::kCoop256x128C1x2:
      return MakeTiled<GroupedGemmTile::kCoop256x128C1x2>(kind, num_groups, lda, ldb, ldd, device, maps);
    case GroupedGemmTile::kPing128x128: return MakeTiled<GroupedGemmTile::kPing128x128>(kind, num_groups, lda, ldb, ldd, device, maps);
    case GroupedGemmTile::kPing128x128C2x1:
      return MakeTiled<GroupedGemmTile::kPing128x128C2x1>(kind, num_groups, lda, ldb, ldd, device, maps);
    case GroupedGemmTile::kCoop256x128C2x1:
      return MakeTiled<GroupedGemmTile::kCoop256x128C2x1>(kind, num_groups, lda, ldb, ldd, device, maps);
    case GroupedGemmTile::kCoop128x256C2x1:
      return MakeTiled<GroupedGemmTile::kCoop128x256C2x1>(kind, num_groups, lda, ldb, ldd, device, maps);
  }
  return InvalidArgument(what + "unknown tile");
}

}  // namespace rdep::kernels::internal
