// LaunchPeerRowsCopy (rdep/dispatch/peer_rows_copy.h): the protocol's row copy with nothing else to do.
#include "rdep/dispatch/peer_rows_copy.h"

#include <string>

#include "dispatch/warp_rows.cuh"
#include "rdep/cuda/check.h"

namespace rdep::dispatch {
namespace {

__global__ void __launch_bounds__(256) PeerRowsCopyKernel(const uint16_t* src, PeerRowsCopy c, int64_t H) {
  const int64_t total = c.begin[c.num_destinations];
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; i < total; i += warps) {
    int q = 0;
    while (i >= c.begin[q + 1]) ++q;
    detail::WarpCopyRow(src + i * H, static_cast<uint16_t*>(c.dst[q]) + (i - c.begin[q]) * H, H);
  }
}

}  // namespace

Status LaunchPeerRowsCopy(const uint16_t* src, const PeerRowsCopy& copy, int64_t H, cudaStream_t s) {
  const int32_t n = copy.num_destinations;
  if (n < 0 || n > kMaxPeerCopyDestinations)
    return InvalidArgument("peer rows copy: num_destinations=" + std::to_string(n) + " outside [0, " +
                           std::to_string(kMaxPeerCopyDestinations) + "]");
  if (H < 1) return InvalidArgument("peer rows copy: H=" + std::to_string(H) + " must be >= 1");
  if (copy.begin[0] != 0) return InvalidArgument("peer rows copy: begin[0]=" + std::to_string(copy.begin[0]) + " must be 0");
  for (int32_t q = 0; q < n; ++q) {
    const int64_t rows = copy.begin[q + 1] - copy.begin[q];
    if (rows < 0)
      return InvalidArgument("peer rows copy: begin[" + std::to_string(q + 1) + "]=" + std::to_string(copy.begin[q + 1]) +
                             " below begin[" + std::to_string(q) + "]=" + std::to_string(copy.begin[q]));
    if (rows > 0 && copy.dst[q] == nullptr)
      return InvalidArgument("peer rows copy: dst[" + std::to_string(q) + "] is null for " + std::to_string(rows) + " rows");
  }
  const int64_t total = copy.begin[n];
  if (total == 0) return Status::Ok();
  if (src == nullptr) return InvalidArgument("peer rows copy: src is null for " + std::to_string(total) + " rows");
  PeerRowsCopyKernel<<<static_cast<unsigned>(detail::WarpBlocks(total)), 256, 0, s>>>(src, copy, H);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace rdep::dispatch
