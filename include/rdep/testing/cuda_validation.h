// The CUDA backend for the validation matrix (rdep/testing/validation.h): W ranks on the local GPUs,
// one process driving all of them (several ranks may share a GPU) or one process per GPU.
#pragma once

#include <memory>

#include "rdep/testing/validation.h"
#include "rdep/transport/bootstrap.h"

namespace rdep {

// W ranks placed round-robin over `num_gpus` local GPUs (0 = min(W, GPUs present)); with fewer GPUs
// than ranks, ranks share GPUs (stream-ordered barriers, see CudaDomain). Unavailable when the build
// has no CUDA or the machine has no GPU; InvalidArgument when num_gpus exceeds the GPUs present.
StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaBackend(int64_t num_ranks, double barrier_timeout_s, int num_gpus = 0);
// One process per GPU: this process is bootstrap.rank(); results are gathered through the bootstrap so
// every process evaluates the same checks. The bootstrap must outlive the backend.
StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaMultiProcessBackend(Bootstrap& bootstrap, double barrier_timeout_s);

}  // namespace rdep
