// The transport's floor: rows copied into other GPUs' memory by the protocol's row copy (a warp per row,
// 16-byte vectors: WarpCopyRow, the copy the scatter's and the return's WarpRowHead finish with) on every SM, with nothing else to do: no
// routing, no sideband, no placement, no barrier. `rdep bench dispatch` times it on the rows its dispatch
// and combine move between each pair of ranks, in the same run, as the floor they are measured against.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rdep/status.h"

namespace rdep::dispatch {

constexpr int kMaxPeerCopyDestinations = 8;

// Rows [begin[q], begin[q + 1]) of the source go, in order, to rows 0, 1, ... of dst[q] (device memory this GPU can
// store into: its own or a peer's with peer access enabled), for q < num_destinations.
struct PeerRowsCopy {
  int32_t num_destinations = 0;
  void* dst[kMaxPeerCopyDestinations] = {};
  int64_t begin[kMaxPeerCopyDestinations + 1] = {};
};

// Launches the copy of begin[num_destinations] rows of H bf16 from src (this GPU) on stream s. InvalidArgument
// naming the field when num_destinations is outside [0, 8], begin[0] != 0 or begin decreases, H < 1, src is null
// with rows to copy, or a destination with rows has a null dst.
Status LaunchPeerRowsCopy(const uint16_t* src, const PeerRowsCopy& copy, int64_t H, cudaStream_t s);

}  // namespace rdep::dispatch
