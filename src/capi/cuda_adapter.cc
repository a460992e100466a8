// The C ABI's CUDA backend: CudaMoELayer over a CudaDomain (ranks of this process over local GPUs, or
// this process as one rank of a world), the caller's weights bound per call, and the layer's work
// ordered against the caller's streams by events (no host synchronization added).
#include <cuda_runtime.h>

#include "capi/layer_adapter.h"
#include "rdep/cuda/check.h"
#include "rdep/cuda/device_count.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/transport/cuda_domain.h"
#include "rdep/transport/domain.h"

namespace rdep::capi {
namespace {

// The caller's current device is restored when an ABI call returns (PyTorch keeps its own notion of
// the current device; creating domains and joining streams select each rank's device).
class DeviceGuard {
 public:
  DeviceGuard() { ok_ = cudaGetDevice(&device_) == cudaSuccess; }
  ~DeviceGuard() {
    if (ok_) cudaSetDevice(device_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_ = 0;
  bool ok_ = false;
};

class CudaAdapter final : public LayerAdapter {
 public:
  ~CudaAdapter() override {
    DeviceGuard guard;
    layer_.reset();
    for (size_t i = 0; i < in_.size(); ++i) {  // events exist for the first in_.size() ranks (a failed create may stop early)
      cudaSetDevice(domain_->device(ranks_[i]));
      cudaEventDestroy(in_[i]);
      if (i < out_.size()) cudaEventDestroy(out_[i]);
    }
  }

  static StatusOr<std::unique_ptr<LayerAdapter>> Create(CudaDomain& domain, const LayerConfig& config, const OwnershipMap& ownership) {
    DeviceGuard guard;
    std::unique_ptr<CudaAdapter> a(new CudaAdapter(domain));
    a->ranks_ = domain.local_ranks();
    RDEP_ASSIGN_OR_RETURN(a->layer_, CudaMoELayer::Create(domain, config, ownership));
    for (int32_t r : a->ranks_) {
      RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(domain.device(r)));
      cudaEvent_t in = nullptr, out = nullptr;
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&in, cudaEventDisableTiming));
      a->in_.push_back(in);
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&out, cudaEventDisableTiming));
      a->out_.push_back(out);
    }
    return std::unique_ptr<LayerAdapter>(std::move(a));
  }

  std::vector<int32_t> local_ranks() const override { return ranks_; }
  int32_t device(int32_t rank) const override { return domain_->device(rank); }
  std::string placement() const override { return domain_->placement() + " (" + domain_->transport_name() + ")"; }
  size_t replica_slot_bytes() const override { return layer_->replica_slot_bytes(); }
  size_t shared_row_bytes() const override {
    return layer_->shared_row_bytes() + layer_->shared_transport_bytes() + layer_->stash_bytes();
  }
  Status SetRowAllocator(rdep_alloc_fn alloc, rdep_free_fn free, void* user) override {
    return layer_->SetRowAllocator(RowAllocator{alloc, free, user});
  }
  size_t row_allocator_bytes() const override {
    size_t b = 0;
    for (int32_t r : ranks_) b += layer_->row_allocator_bytes(r);
    return b;
  }
  void ReleaseRows(std::vector<ForwardContext>& ctx) override {
    DeviceGuard guard;  // the stash's give-back launches on each rank's device: the caller's stays current
    for (auto& c : ctx) (void)layer_->ReleaseRows(c);
  }
  void RebaseRows(std::vector<ForwardContext>& ctx, const void* old_base, size_t bytes, void* new_base) override {
    for (auto& c : ctx) layer_->RebaseRows(c, old_base, bytes, new_base);
  }

  // Before a call that forwards or plans in ctx: each rank's caller stream, and a released context's rows
  // taken again from the row allocator on this thread (CudaMoELayer::PrepareRows).
  Status PrepareRows(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) {
    DeviceGuard guard;
    for (size_t i = 0; i < ranks_.size(); ++i)
      RDEP_RETURN_IF_ERROR(layer_->PrepareRows(ranks_[i], ctx[i], static_cast<cudaStream_t>(io[i].stream)));
    return Status::Ok();
  }

  Status Forward(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) override {
    RDEP_RETURN_IF_ERROR(PrepareRows(ctx, io));
    for (size_t i = 0; i < ranks_.size(); ++i) {
      const rdep_rank_io& a = io[i];
      RDEP_RETURN_IF_ERROR(layer_->BindExpertWeights(ranks_[i], ExternalWeights<__nv_bfloat16, float>{bf(a.w1), bf(a.w2), nullptr, nullptr}));
    }
    return Call(io, [&](size_t i, int32_t r) {
      const rdep_rank_io& a = io[i];
      return layer_->Forward(r, ctx[i], a.experts, a.gates, a.num_tokens, bf(a.x), static_cast<__nv_bfloat16*>(a.y));
    });
  }

  Status CheckDeviceErrors() override {
    for (int32_t r : ranks_) {  // named by rank here, as CudaDomain::Run names a call's errors
      const Status s = domain_->CheckErrors(r);
      if (!s.ok()) return Status(s.code(), "rank " + std::to_string(r) + ": " + s.message());
    }
    return Status::Ok();
  }

  Status CheckRoutingFaults(std::vector<ForwardContext>& ctx) override {
    DeviceGuard guard;
    for (size_t i = 0; i < ranks_.size(); ++i) RDEP_RETURN_IF_ERROR(layer_->CheckRoutingFaults(ranks_[i], ctx[i]));
    return Status::Ok();
  }

  Status Backward(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) override {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      const rdep_rank_io& a = io[i];
      if (a.grad_bf16) {
        RDEP_RETURN_IF_ERROR(layer_->BindExpertWeights(ranks_[i], ExternalWeights<__nv_bfloat16, __nv_bfloat16>{
                                                                      bf(a.w1), bf(a.w2), static_cast<__nv_bfloat16*>(a.dw1),
                                                                      static_cast<__nv_bfloat16*>(a.dw2)}));
      } else {
        RDEP_RETURN_IF_ERROR(layer_->BindExpertWeights(
            ranks_[i], ExternalWeights<__nv_bfloat16, float>{bf(a.w1), bf(a.w2), static_cast<float*>(a.dw1), static_cast<float*>(a.dw2)}));
      }
    }
    return Call(io, [&](size_t i, int32_t r) {
      const rdep_rank_io& a = io[i];
      return layer_->Backward(r, ctx[i], bf(a.dy), static_cast<__nv_bfloat16*>(a.dx), a.dgates);
    });
  }

  Status Plan(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) override {
    RDEP_RETURN_IF_ERROR(PrepareRows(ctx, io));
    return Call(io, [&](size_t i, int32_t r) { return layer_->Plan(r, ctx[i], io[i].experts, io[i].gates, io[i].num_tokens); });
  }
  StatusOr<std::vector<int64_t>> RecvCounts(ForwardContext& ctx, int32_t) override {
    DeviceGuard guard;
    return layer_->recv_counts(ctx);
  }
  StatusOr<std::vector<uint64_t>> RecvRowIds(ForwardContext& ctx, int32_t) override {
    DeviceGuard guard;
    return layer_->recv_row_ids(ctx);
  }

  Status Rows(RowsStep step, std::vector<ForwardContext>& ctx, const rdep_rank_rows* rows) override {
    return Call(rows, [&](size_t i, int32_t r) -> Status {
      const rdep_rank_rows& a = rows[i];
      auto* out = static_cast<__nv_bfloat16*>(a.out);
      switch (step) {
        case RowsStep::kDispatch: return layer_->Dispatch(r, ctx[i], bf(a.in), a.in_rows, out, a.out_rows);
        case RowsStep::kCombine: return layer_->Combine(r, ctx[i], bf(a.in), a.in_rows, out, a.out_rows);
        case RowsStep::kCombineBackward:
          return layer_->CombineBackward(r, ctx[i], bf(a.in), a.in_rows, out, a.out_rows, a.dgates);
        case RowsStep::kDispatchBackward: return layer_->DispatchBackward(r, ctx[i], bf(a.in), a.in_rows, out, a.out_rows);
      }
      return InternalError("unknown rows step");
    });
  }

 private:
  explicit CudaAdapter(CudaDomain& domain) : domain_(&domain) {}
  static const __nv_bfloat16* bf(const void* p) { return static_cast<const __nv_bfloat16*>(p); }

  // The ranks' streams wait for the callers' streams, the collective runs, the callers' streams wait
  // for the ranks' streams. Both joins are made from this thread, before and after the collective.
  // io is rdep_rank_io or rdep_rank_rows: each names the caller's stream of its rank.
  template <typename Io, typename Fn>
  Status Call(const Io* io, Fn fn) {
    DeviceGuard guard;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(domain_->device(ranks_[i])));
      layer_->SetCallerStream(ranks_[i], static_cast<cudaStream_t>(io[i].stream));  // a RowAllocator's stream
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(in_[i], static_cast<cudaStream_t>(io[i].stream)));
      RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(domain_->stream(ranks_[i]), in_[i], 0));
    }
    Status status = domain_->Run([&](int32_t r) -> Status {
      for (size_t i = 0; i < ranks_.size(); ++i)
        if (ranks_[i] == r) return fn(i, r);
      return InternalError("layer call: rank " + std::to_string(r) + " is not local");
    });
    // The call's own error first: a failure that invalidated a capture also fails the joins after it.
    const Status joined = JoinCallers(io);
    return status.ok() ? joined : status;
  }
  template <typename Io>
  Status JoinCallers(const Io* io) {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(domain_->device(ranks_[i])));
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(out_[i], domain_->stream(ranks_[i])));
      RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(static_cast<cudaStream_t>(io[i].stream), out_[i], 0));
    }
    return Status::Ok();
  }

  CudaDomain* domain_;  // the rdep_domain's, which outlives the adapter
  std::unique_ptr<CudaMoELayer> layer_;
  std::vector<int32_t> ranks_;
  std::vector<cudaEvent_t> in_, out_;
};

}  // namespace

StatusOr<std::unique_ptr<LayerAdapter>> MakeCudaAdapter(Domain& domain, const LayerConfig& config, const OwnershipMap& ownership) {
  return CudaAdapter::Create(static_cast<CudaDomain&>(domain), config, ownership);  // made for a CUDA backend
}

StatusOr<std::unique_ptr<Domain>> MakeCudaDomain(const DomainSpec& spec, const std::string&) {
  DeviceGuard guard;
  return MakeDomain(spec);
}

int32_t CudaDomainDevice(const Domain& domain, int32_t rank) { return static_cast<const CudaDomain&>(domain).device(rank); }

void WithCallerDevice(const std::function<void()>& fn) {
  DeviceGuard guard;
  fn();
}

Status CutlassComputeAvailable(int32_t device) {
  const int32_t devices = CudaDeviceCount();
  if (device < 0 || device >= devices)
    return InvalidArgument("device: " + std::to_string(device) + " is not a CUDA device of this process (it sees " +
                           std::to_string(devices) + ")");
  DeviceGuard guard;
  return kernels::MakeCutlassExpertCompute({1, 64, 64, 64}, device).status();
}

}  // namespace rdep::capi
