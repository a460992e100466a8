// Training steps of one MoE layer on the host backend through the installed library: forward,
// backward, an SGD update on each rank's own experts. Prints the loss per step; exits non-zero if it
// does not fall. Run: host_training_step [steps]
#include <rdep/rdep.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  constexpr float kLr = 2e-3f;
  rdep::LayerConfig cfg;
  cfg.shape = {.tokens = 32, .hidden = 32, .ffn = 64, .experts = 8, .topk = 2, .ranks = 4};
  auto domain = rdep::HostDomain::Create(cfg.shape.ranks);
  auto own = rdep::OwnershipMap::Contiguous(cfg.shape.experts, cfg.shape.ranks);
  auto routing = rdep::GenerateRouting(cfg.shape, rdep::RoutingSpec{});
  if (!domain.ok() || !own.ok() || !routing.ok()) return std::fprintf(stderr, "setup failed\n"), 1;
  rdep::MoEWeights weights = rdep::RandomWeights(cfg.shape, 7);
  auto x = rdep::RandomActivations(cfg.shape, *routing, 8);
  auto target = rdep::RandomActivations(cfg.shape, *routing, 9, 0.1);
  auto layer = rdep::HostMoELayer::Create(**domain, cfg, *own, weights);
  if (!layer.ok()) return std::fprintf(stderr, "%s\n", layer.status().ToString().c_str()), 1;

  const size_t W = static_cast<size_t>(cfg.shape.ranks), H = static_cast<size_t>(cfg.shape.hidden);
  std::vector<double> loss(W);
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    rdep::Status s = (*domain)->Run([&](int32_t r) -> rdep::Status {
      const auto i = static_cast<size_t>(r);
      const size_t n = static_cast<size_t>((*routing)[i].num_tokens);
      std::vector<float> y(n * H), dy(n * H), dx(n * H), dg(n * static_cast<size_t>(cfg.shape.topk));
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, (*routing)[i], x[i], y));
      loss[i] = 0;
      for (size_t j = 0; j < y.size(); ++j) {  // L = 0.5 |y - target|^2
        dy[j] = y[j] - target[i][j];
        loss[i] += 0.5 * static_cast<double>(dy[j]) * dy[j];
      }
      return (*layer)->Backward(r, dy, dx, dg);
    });
    if (!s.ok()) return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
    // SGD on the global weights, then rebuild the layer (a real stack would update in place).
    for (int32_t q = 0; q < cfg.shape.ranks; ++q)
      for (int32_t j = 0; j < own->num_local(q); ++j) {
        const size_t e = static_cast<size_t>(own->global_expert(q, j));
        const size_t n1 = weights.w1_per_expert(), n2 = weights.w2_per_expert();
        for (size_t k = 0; k < n1; ++k) weights.w1[e * n1 + k] -= kLr * (*layer)->dw1(q)[static_cast<size_t>(j) * n1 + k];
        for (size_t k = 0; k < n2; ++k) weights.w2[e * n2 + k] -= kLr * (*layer)->dw2(q)[static_cast<size_t>(j) * n2 + k];
      }
    layer = rdep::HostMoELayer::Create(**domain, cfg, *own, weights);
    double total = 0;
    for (double l : loss) total += l;
    std::printf("step %d loss %.6f\n", step, total);
    (step == 0 ? first : last) = total;
  }
  return steps > 1 && !(last < first) ? 1 : 0;
}
