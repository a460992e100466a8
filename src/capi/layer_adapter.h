// What the C ABI (rdep/capi.h) drives: one layer over its domain, behind an interface with a host and
// a CUDA implementation, so capi.cc holds the ABI's bookkeeping (handles, contexts, errors) once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rdep/capi.h"
#include "rdep/core/ownership.h"
#include "rdep/layer/forward_context.h"
#include "rdep/layer/layer_config.h"
#include "rdep/status.h"

namespace rdep::capi {

class LayerAdapter {
 public:
  virtual ~LayerAdapter() = default;
  virtual std::vector<int32_t> local_ranks() const = 0;
  virtual int32_t device(int32_t rank) const = 0;  // -1 on the host
  virtual std::string placement() const = 0;
  // Collective over the local ranks: io[i] belongs to local_ranks()[i], ctx[i] is its context.
  virtual Status Forward(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) = 0;
  virtual Status Backward(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) = 0;

  // The caller's own experts (capi.h version 3): the plan alone, the rows a local rank receives per
  // local expert and their ids, and the four row steps.
  enum class RowsStep { kDispatch, kCombine, kCombineBackward, kDispatchBackward };
  virtual Status Plan(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) = 0;
  virtual StatusOr<std::vector<int64_t>> RecvCounts(ForwardContext& ctx, int32_t rank) = 0;
  virtual StatusOr<std::vector<uint64_t>> RecvRowIds(ForwardContext& ctx, int32_t rank) = 0;
  virtual Status Rows(RowsStep step, std::vector<ForwardContext>& ctx, const rdep_rank_rows* rows) = 0;
};

const char* RowsStepName(LayerAdapter::RowsStep step);

// The host backend: W threads of this process, fp32.
StatusOr<std::unique_ptr<LayerAdapter>> MakeHostAdapter(const LayerConfig& config, const OwnershipMap& ownership,
                                                        double barrier_timeout_s);

// The CUDA backend, one process (spec.num_gpus) or per process (spec.process_rank, device, allgather).
// Unavailable in a build without CUDA.
StatusOr<std::unique_ptr<LayerAdapter>> MakeCudaAdapter(const rdep_layer_spec& spec, const LayerConfig& config,
                                                        const OwnershipMap& ownership, double barrier_timeout_s);

}  // namespace rdep::capi
