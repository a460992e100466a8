// The C ABI's host backend: HostMoELayer over a HostDomain, fp32, the caller's weights bound per call.
#include <span>

#include "capi/layer_adapter.h"
#include "rdep/layer/host_moe_layer.h"
#include "rdep/transport/host_domain.h"

namespace rdep::capi {
namespace {

class HostAdapter final : public LayerAdapter {
 public:
  HostAdapter(std::unique_ptr<HostDomain> domain, std::unique_ptr<HostMoELayer> layer)
      : domain_(std::move(domain)), layer_(std::move(layer)) {}
  ~HostAdapter() override { layer_.reset(); }

  std::vector<int32_t> local_ranks() const override { return domain_->local_ranks(); }
  int32_t device(int32_t) const override { return -1; }
  std::string placement() const override { return domain_->placement(); }

  Status Forward(std::vector<ForwardContext>& ctx, const rdep_rank_io* io) override {
    const int64_t H = layer_->config().shape.hidden, K = layer_->config().shape.topk;
    for (int32_t r = 0; r < domain_->num_ranks(); ++r) {
      const auto* w1 = static_cast<const float*>(io[r].w1);
      RDEP_RETURN_IF_ERROR(layer_->BindExpertWeights(r, {w1, static_cast<const float*>(io[r].w2), nullptr, nullptr}));
    }
    return domain_->Run([&](int32_t r) -> Status {
      const rdep_rank_io& a = io[r];
      const int64_t n = a.num_tokens;
      RankRouting routing;
      routing.num_tokens = n;
      routing.topk = K;
      routing.experts.assign(a.experts, a.experts + n * K);
      routing.gates.assign(a.gates, a.gates + n * K);
      return layer_->Forward(r, ctx[static_cast<size_t>(r)], routing,
                             std::span<const float>(static_cast<const float*>(a.x), static_cast<size_t>(n * H)),
                             std::span<float>(static_cast<float*>(a.y), static_cast<size_t>(n * H)));
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
  std::unique_ptr<HostDomain> domain_;
  std::unique_ptr<HostMoELayer> layer_;
};

}  // namespace

StatusOr<std::unique_ptr<LayerAdapter>> MakeHostAdapter(const LayerConfig& config, const OwnershipMap& ownership,
                                                        double barrier_timeout_s) {
  RDEP_ASSIGN_OR_RETURN(auto domain, HostDomain::Create(config.shape.ranks, {.barrier_timeout_s = barrier_timeout_s}));
  RDEP_ASSIGN_OR_RETURN(auto layer, HostMoELayer::Create(*domain, config, ownership));
  return std::unique_ptr<LayerAdapter>(new HostAdapter(std::move(domain), std::move(layer)));
}

}  // namespace rdep::capi
