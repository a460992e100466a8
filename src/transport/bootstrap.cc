#include "rdep/transport/bootstrap.h"

#include <cstdlib>
#include <cstring>

namespace rdep {

int32_t Bootstrap::local_rank() const {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* v = std::getenv(var)) return static_cast<int32_t>(std::atoi(v));
  return rank();
}

bool LaunchedUnderMpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

StatusOr<std::vector<std::vector<uint8_t>>> AllGatherBytes(Bootstrap& boot, const std::vector<uint8_t>& mine) {
  const auto W = static_cast<size_t>(boot.size());
  const uint64_t n = mine.size();
  std::vector<uint64_t> sizes(W);
  RDEP_RETURN_IF_ERROR(boot.AllGather(&n, sizeof n, sizes.data()));
  uint64_t mx = 0;
  for (auto s : sizes) mx = std::max(mx, s);
  std::vector<uint8_t> padded(static_cast<size_t>(mx), 0), all(static_cast<size_t>(mx) * W);
  if (n) std::memcpy(padded.data(), mine.data(), mine.size());
  if (mx) RDEP_RETURN_IF_ERROR(boot.AllGather(padded.data(), static_cast<size_t>(mx), all.data()));
  std::vector<std::vector<uint8_t>> out(W);
  for (size_t r = 0; r < W; ++r)
    out[r].assign(all.begin() + static_cast<std::ptrdiff_t>(r * mx), all.begin() + static_cast<std::ptrdiff_t>(r * mx + sizes[r]));
  return out;
}

Status AgreeAcrossRanks(Bootstrap& boot, const std::vector<uint8_t>& mine, const std::string& what,
                        const std::function<std::string(const std::vector<uint8_t>&)>& describe) {
  RDEP_ASSIGN_OR_RETURN(auto all, AllGatherBytes(boot, mine));
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != all[0])
      return InvalidArgument(what + " mismatch between ranks: rank 0 has " + describe(all[0]) + ", rank " +
                             std::to_string(r) + " has " + describe(all[r]));
  return Status::Ok();
}

}  // namespace rdep
