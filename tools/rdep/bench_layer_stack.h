// `rdep bench layer --layers N`: the memory (and time) of N layers on one domain, as a model stacks them:
// each layer with its own weights and gradients, each forward's saved state in a context of its own, the
// N forwards in order and then the N backwards in reverse order (bench_layer_stack.cc).
#pragma once

#if defined(RDEP_HAVE_CUDA)
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "rdep/core/json.h"
#include "rdep/core/ownership.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/layer/layer_config.h"

namespace rdep::bench {

// One rank's device inputs and outputs (the same routing and x for every layer of the stack).
struct StackRankIo {
  const int32_t* experts = nullptr;
  const float* gates = nullptr;
  const __nv_bfloat16* x = nullptr;
  __nv_bfloat16* y = nullptr;
  const __nv_bfloat16* dy = nullptr;
  __nv_bfloat16* dx = nullptr;
  float* dgates = nullptr;
  int64_t num_tokens = 0;
};

struct StackResult {
  int32_t layers = 0;
  size_t layer_bytes_max_rank = 0;    // the N layers' own device bytes (CudaMoELayer::device_bytes), summed
  size_t context_bytes_max_rank = 0;  // the N contexts after the forwards (ForwardContext::bytes), summed
  size_t gpu_used_max = 0;            // after the forwards: cudaMemGetInfo's total - free, largest over the GPUs
  int64_t passes = 0;                      // timed passes after the untimed one
  double forward_ms = 0, backward_ms = 0;  // the N forwards, the N backwards: p50 over the passes of the max over ranks
};

// Makes layers - 1 more layers like `first` (same config, ownership and seeded weights) on its domain,
// then on every rank an untimed pass of forward 1..N (contexts 1..N, a synchronization after each: the
// memory is read after the last) and backward N..1, and `passes` timed ones. The caller checked the memory
// estimate (CheckLayerBenchFootprint with layers) and turned profiling off.
StatusOr<StackResult> RunLayerStack(CudaDomain& domain, CudaMoELayer& first, const LayerConfig& cfg, const OwnershipMap& ownership,
                                    uint64_t seed, int32_t layers, int64_t passes, const std::vector<StackRankIo>& io);

void PrintLayerStack(const StackResult& r);
void WriteLayerStack(JsonWriter& j, const StackResult& r);  // a "stack" object

}  // namespace rdep::bench
#endif  // RDEP_HAVE_CUDA
