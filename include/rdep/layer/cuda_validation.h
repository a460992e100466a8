// The CUDA backend for the validation matrix (rdep/layer/validation.h): W ranks on W GPUs, one
// process driving all of them or one process per GPU.
#pragma once

#include <memory>

#include "rdep/layer/validation.h"
#include "rdep/transport/bootstrap.h"

namespace rdep {

// Unavailable when the build has no CUDA or the machine has fewer than W GPUs.
StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaBackend(int64_t num_ranks, double barrier_timeout_s);
// One process per GPU: this process is bootstrap.rank(); results are gathered through the bootstrap so
// every process evaluates the same checks. The bootstrap must outlive the backend.
StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaMultiProcessBackend(Bootstrap& bootstrap, double barrier_timeout_s);

}  // namespace rdep
