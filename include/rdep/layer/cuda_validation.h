// The CUDA backend for the validation matrix (rdep/layer/validation.h): W ranks on W local GPUs.
#pragma once

#include <memory>

#include "rdep/layer/validation.h"

namespace rdep {

// Unavailable when the build has no CUDA or the machine has fewer than W GPUs.
StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaBackend(int64_t num_ranks, double barrier_timeout_s);

}  // namespace rdep
