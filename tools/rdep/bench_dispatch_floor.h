// `rdep bench dispatch`'s floor (bench_dispatch_floor.cc): the rows its dispatch and combine move between each pair
// of ranks, copied into the destinations' memory by the protocol's row copy on every SM with nothing else to do
// (rdep::dispatch::LaunchPeerRowsCopy), all ranks at once after a device barrier. CUDA builds only.
#pragma once

#if defined(RDEP_HAVE_CUDA)

#include <cstdint>
#include <vector>

#include "rdep/status.h"
#include "rdep/transport/cuda_domain.h"

namespace rdep::bench {

// rows[s][q]: the rows rank s sends to rank q (the diagonal, a rank's rows to itself, is not copied).
using PairRows = std::vector<std::vector<int64_t>>;

struct PeerStoreFloor {
  std::vector<double> dispatch_ms, combine_ms;  // per timed iteration, the max over ranks of the copy's time
  bool exact = false;  // each direction's copy, run once more after the timed loops into poisoned buffers, landed every row
  size_t bytes_max_rank = 0;                    // the floor's buffers on the largest rank
};

// Times the copy of `dispatch` rows, then of `combine` rows (rows of H bf16), warmup + iters times each on every
// rank of `domain` (each rank its own GPU), each copy after *launch_ahead_us of host wait and a device barrier.
// Refuses (FailedPrecondition, naming the rank and the bytes) when a rank's buffers would not fit its GPU's free memory.
StatusOr<PeerStoreFloor> RunPeerStoreFloor(CudaDomain& domain, const PairRows& dispatch, const PairRows& combine, int64_t H,
                                           int64_t warmup, int64_t iters, const int64_t* launch_ahead_us);

}  // namespace rdep::bench

#endif  // RDEP_HAVE_CUDA
