// What the C ABI (rdep/capi.h) drives: one layer over a domain it does not own (the rdep_domain handle
// owns it, capi_internal.h), behind an interface with a host and a CUDA implementation, so capi.cc holds
// the ABI's bookkeeping (handles, contexts, errors) once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "rdep/capi.h"
#include "rdep/core/ownership.h"
#include "rdep/layer/forward_context.h"
#include "rdep/layer/layer_config.h"
#include "rdep/status.h"
#include "rdep/transport/domain.h"

namespace rdep::capi {

class LayerAdapter {
 public:
  virtual ~LayerAdapter() = default;
  virtual std::vector<int32_t> local_ranks() const = 0;
  virtual int32_t device(int32_t rank) const = 0;  // -1 on the host
  virtual std::string placement() const = 0;
  // Bytes per rank of the replica slots the layer uses (shared with the domain's other balanced layers
  // of the same slot size; 0 with balancing off).
  virtual size_t replica_slot_bytes() const = 0;
  // Bytes per rank of the owner's shared row buffers: output rows, and the CUTLASS compute's scratch (CUDA;
  // 0 on the host backend). Shared on the domain by layers of the same sizes.
  virtual size_t shared_row_bytes() const = 0;
  // Where contexts' saved rows come from (capi.h version 8; CUDA only: the host backend refuses), and
  // giving a released context's rows back to it.
  virtual Status SetRowAllocator(rdep_alloc_fn alloc, rdep_free_fn free, void* user) = 0;
  // What one forward asks that allocator for, summed over the local ranks (capi.h version 15; 0 on the host).
  virtual size_t row_allocator_bytes() const { return 0; }
  virtual void ReleaseRows(std::vector<ForwardContext>& ctx) = 0;
  // The caller's arena of ctx's forward moved (capi.h version 18; the host backend takes no rows from one).
  virtual void RebaseRows(std::vector<ForwardContext>&, const void* /*old_base*/, size_t /*bytes*/, void* /*new_base*/) {}
  // Collective over the local ranks: io[i] belongs to local_ranks()[i], ctx[i] is its context.
  virtual Status Forward(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) = 0;
  // Waits for the device's check of the routing of the forward in ctx (rdep_context_check_routing); the
  // host backend checks in its forward.
  virtual Status CheckRoutingFaults(std::vector<ForwardContext>&) { return Status::Ok(); }
  // The local ranks' device barrier error records, read without a CUDA call (rdep_layer_check_errors).
  virtual Status CheckDeviceErrors() { return Status::Ok(); }
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

// The host backend: W threads of this process, fp32, on a host domain (HostDomain) that outlives it.
StatusOr<std::unique_ptr<LayerAdapter>> MakeHostAdapter(Domain& domain, const LayerConfig& config, const OwnershipMap& ownership);

// The CUDA backend on a CUDA domain (CudaDomain, one process or per process) that outlives it.
// Unavailable in a build without CUDA.
StatusOr<std::unique_ptr<LayerAdapter>> MakeCudaAdapter(Domain& domain, const LayerConfig& config, const OwnershipMap& ownership);
// A CUDA domain (MakeDomain of a CUDA kind) made with the caller's current device restored afterwards;
// Unavailable in a build without CUDA (the message starts with `what`).
StatusOr<std::unique_ptr<Domain>> MakeCudaDomain(const DomainSpec& spec, const std::string& what);
// The GPU of a local rank of a CUDA domain (-1 in a build without CUDA).
int32_t CudaDomainDevice(const Domain& domain, int32_t rank);
// Runs fn and restores the caller's current CUDA device (fn alone in a build without CUDA).
void WithCallerDevice(const std::function<void()>& fn);
// Ok when the CUTLASS expert compute (LayerConfig::expert_compute kCutlass) runs on CUDA device `device`:
// this build has CUDA and CUTLASS and the device is an sm_90 GPU; else Unavailable or InvalidArgument
// saying why. Makes (and frees) a one-expert compute there; the caller's current device is kept.
Status CutlassComputeAvailable(int32_t device);

}  // namespace rdep::capi
