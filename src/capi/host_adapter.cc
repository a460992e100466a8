// The C ABI's host backend: HostMoELayer over a HostDomain (the rdep_domain's), fp32, the caller's
// weights bound per call.
#include <span>

#include "capi/layer_adapter.h"
#include "rdep/layer/host_moe_layer.h"
#include "rdep/transport/host_domain.h"

namespace rdep::capi {
namespace {

class HostAdapter final : public LayerAdapter {
 public:
  HostAdapter(HostDomain& domain, std::unique_ptr<HostMoELayer> layer) : domain_(&domain), layer_(std::move(layer)) {}

  std::vector<int32_t> local_ranks() const override { return domain_->local_ranks(); }
  int32_t device(int32_t) const override { return -1; }
  std::string placement() const override { return domain_->placement(); }
  size_t replica_slot_bytes() const override { return layer_->replica_slot_bytes(); }
  size_t shared_row_bytes() const override { return 0; }  // the host owner's rows are per layer
  Status SetRowAllocator(rdep_alloc_fn, rdep_free_fn, void*) override {
    return FailedPrecondition("row allocator: the host backend keeps its contexts in host memory (CUDA only)");
  }
  void ReleaseRows(std::vector<ForwardContext>&) override {}

  Status Forward(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) override {
    const int64_t H = layer_->config().shape.hidden;
    for (int32_t r = 0; r < domain_->num_ranks(); ++r) {
      const auto* w1 = static_cast<const float*>(io[r].w1);
      RDEP_RETURN_IF_ERROR(layer_->BindExpertWeights(r, {w1, static_cast<const float*>(io[r].w2), nullptr, nullptr}));
    }
    return domain_->Run([&](int32_t r) -> Status {
      const rdep_rank_io& a = io[r];
      const auto n = static_cast<size_t>(a.num_tokens);
      return layer_->Forward(r, ctx[static_cast<size_t>(r)], MakeRouting(a),
                             std::span<const float>(static_cast<const float*>(a.x), n * static_cast<size_t>(H)),
                             std::span<float>(static_cast<float*>(a.y), n * static_cast<size_t>(H)));
    });
  }

  Status Plan(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) override {
    return domain_->Run([&](int32_t r) { return layer_->Plan(r, ctx[static_cast<size_t>(r)], MakeRouting(io[r])); });
  }
  StatusOr<std::vector<int64_t>> RecvCounts(ForwardContext& ctx, int32_t) override { return layer_->recv_counts(ctx); }
  StatusOr<std::vector<uint64_t>> RecvRowIds(ForwardContext& ctx, int32_t) override { return layer_->recv_row_ids(ctx); }

  Status Rows(RowsStep step, std::vector<ForwardContext>& ctx, const rdep_rank_rows* rows) override {
    const auto H = static_cast<size_t>(layer_->config().shape.hidden), K = static_cast<size_t>(layer_->config().shape.topk);
    return domain_->Run([&](int32_t r) -> Status {
      const rdep_rank_rows& a = rows[r];
      ForwardContext& c = ctx[static_cast<size_t>(r)];
      const std::span<const float> in(static_cast<const float*>(a.in), static_cast<size_t>(a.in_rows) * H);
      const std::span<float> out(static_cast<float*>(a.out), static_cast<size_t>(a.out_rows) * H);
      switch (step) {
        case RowsStep::kDispatch: return layer_->Dispatch(r, c, in, out);
        case RowsStep::kCombine: return layer_->Combine(r, c, in, out);
        case RowsStep::kCombineBackward:
          return layer_->CombineBackward(r, c, in, out, std::span<float>(a.dgates, static_cast<size_t>(a.in_rows) * K));
        case RowsStep::kDispatchBackward: return layer_->DispatchBackward(r, c, in, out);
      }
      return InternalError("unknown rows step");
    });
  }

  Status Backward(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) override {
    const int64_t H = layer_->config().shape.hidden, K = layer_->config().shape.topk;
    for (int32_t r = 0; r < domain_->num_ranks(); ++r) {
      const rdep_rank_io& a = io[r];
      RDEP_RETURN_IF_ERROR(layer_->BindExpertWeights(
          r, {static_cast<const float*>(a.w1), static_cast<const float*>(a.w2), static_cast<float*>(a.dw1), static_cast<float*>(a.dw2)}));
    }
    return domain_->Run([&](int32_t r) -> Status {
      const rdep_rank_io& a = io[r];
      const auto n = static_cast<size_t>(a.num_tokens);
      return layer_->Backward(r, ctx[static_cast<size_t>(r)],
                              std::span<const float>(static_cast<const float*>(a.dy), n * static_cast<size_t>(H)),
                              std::span<float>(static_cast<float*>(a.dx), n * static_cast<size_t>(H)),
                              std::span<float>(a.dgates, n * static_cast<size_t>(K)));
    });
  }

 private:
  RankRouting MakeRouting(const rdep_rank_io& a) const {
    const int64_t n = a.num_tokens, K = layer_->config().shape.topk;
    RankRouting routing;
    routing.num_tokens = n;
    routing.topk = K;
    if (n > 0) {
      routing.experts.assign(a.experts, a.experts + n * K);
      routing.gates.assign(a.gates, a.gates + n * K);
    }
    return routing;
  }

  HostDomain* domain_;
  std::unique_ptr<HostMoELayer> layer_;
};

}  // namespace

StatusOr<std::unique_ptr<LayerAdapter>> MakeHostAdapter(Domain& domain, const LayerConfig& config, const OwnershipMap& ownership) {
  auto& host = static_cast<HostDomain&>(domain);  // the caller made it for RDEP_BACKEND_HOST
  RDEP_ASSIGN_OR_RETURN(auto layer, HostMoELayer::Create(host, config, ownership));
  return std::unique_ptr<LayerAdapter>(new HostAdapter(host, std::move(layer)));
}

}  // namespace rdep::capi
