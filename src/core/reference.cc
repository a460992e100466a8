#include "rdep/core/reference.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "rdep/core/expert_mlp.h"
#include "rdep/core/random.h"

namespace rdep {

Status MoEWeights::Validate(const LayerShape& s) const {
  if (experts != s.experts || hidden != s.hidden || ffn != s.ffn)
    return InvalidArgument("weights are for E=" + std::to_string(experts) + " H=" + std::to_string(hidden) +
                           " D_ff=" + std::to_string(ffn) + ", the layer has E=" + std::to_string(s.experts) +
                           " H=" + std::to_string(s.hidden) + " D_ff=" + std::to_string(s.ffn));
  if (w1.size() != static_cast<size_t>(experts) * w1_per_expert() || w2.size() != static_cast<size_t>(experts) * w2_per_expert())
    return InvalidArgument("weights: w1 must hold E*H*2F and w2 E*F*H values");
  if (gate_up != mlp::GateUp::kSplit && gate_up != mlp::GateUp::kInterleaved8)
    return InvalidArgument("weights: gate_up " + std::to_string(static_cast<int>(gate_up)) + " is not kSplit (0) or kInterleaved8 (1)");
  if (gate_up == mlp::GateUp::kInterleaved8 && ffn % 8 != 0)
    return InvalidArgument("weights: gate_up interleaved8 needs D_ff a multiple of 8, got " + std::to_string(ffn));
  return Status::Ok();
}

StatusOr<MoEWeights> MoEWeights::InLayout(mlp::GateUp layout) const {
  for (mlp::GateUp l : {gate_up, layout}) {
    if (l != mlp::GateUp::kSplit && l != mlp::GateUp::kInterleaved8)
      return InvalidArgument("weights: gate_up " + std::to_string(static_cast<int>(l)) + " is not kSplit (0) or kInterleaved8 (1)");
    if (l == mlp::GateUp::kInterleaved8 && (ffn <= 0 || ffn % 8 != 0))
      return InvalidArgument("weights: the interleaved8 layout needs D_ff a positive multiple of 8, got " + std::to_string(ffn));
  }
  if (w1.size() % static_cast<size_t>(std::max<int64_t>(2 * ffn, 1)) != 0)
    return InvalidArgument("weights: w1 holds " + std::to_string(w1.size()) + " values, not rows of 2*D_ff = " + std::to_string(2 * ffn));
  MoEWeights out = *this;
  out.gate_up = layout;
  if (layout != gate_up)  // rows of 2F: (expert, hidden index)
    mlp::MoveGateUp(w1.data(), out.w1.data(), w1.size() / static_cast<size_t>(2 * ffn), ffn, gate_up, layout);
  return out;
}

namespace {

// v[i] = normal draw (first + i) of `base`, times scale, on up to hardware_concurrency threads; the
// values are those of one sequential stream whatever the thread count (Rng::skip). A DeepSeek-V3 layer
// (E = 256, H = 7168, D_ff = 2048) has 11.3 G weights: minutes on one thread.
void FillNormal(std::vector<float>& v, const Rng& base, uint64_t first, double scale) {
  constexpr size_t kMinChunk = size_t{1} << 22;
  const size_t n = v.size();
  const size_t threads = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), n / kMinChunk));
  const size_t chunk = (n + threads - 1) / threads;
  auto fill = [&](size_t lo, size_t hi) {
    Rng rng = base;
    rng.skip(2 * (first + lo));  // two draws per normal()
    for (size_t i = lo; i < hi; ++i) v[i] = static_cast<float>(rng.normal() * scale);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(fill, std::min(n, t * chunk), std::min(n, (t + 1) * chunk));
  fill(0, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

}  // namespace

MoEWeights RandomWeights(const LayerShape& s, uint64_t seed, double scale) {
  MoEWeights w{s.experts, s.hidden, s.ffn, {}, {}};
  w.w1.resize(static_cast<size_t>(s.experts) * w.w1_per_expert());
  w.w2.resize(static_cast<size_t>(s.experts) * w.w2_per_expert());
  const Rng rng(seed, 1001);  // w1 then w2, one stream
  const double s1 = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(s.hidden));
  const double s2 = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(s.ffn));
  FillNormal(w.w1, rng, 0, s1);
  FillNormal(w.w2, rng, w.w1.size(), s2);
  return w;
}

std::vector<std::vector<float>> RandomActivations(const LayerShape& s, const Routing& routing, uint64_t seed,
                                                  double scale) {
  std::vector<std::vector<float>> x(routing.size());
  for (size_t r = 0; r < routing.size(); ++r) {
    Rng rng(seed, 2000 + r);
    x[r].resize(static_cast<size_t>(routing[r].num_tokens * s.hidden));
    for (auto& v : x[r]) v = static_cast<float>(rng.normal() * scale);
  }
  return x;
}

namespace {

Status CheckInputs(const LayerShape& s, const MoEWeights& w, const Routing& routing,
                   const std::vector<std::vector<float>>& x, const char* name) {
  RDEP_RETURN_IF_ERROR(w.Validate(s));
  if (x.size() != routing.size())
    return InvalidArgument(std::string(name) + " has " + std::to_string(x.size()) + " ranks, routing has " +
                           std::to_string(routing.size()));
  for (size_t r = 0; r < x.size(); ++r)
    if (x[r].size() != static_cast<size_t>(routing[r].num_tokens * s.hidden))
      return InvalidArgument(std::string(name) + "[" + std::to_string(r) + "] has " + std::to_string(x[r].size()) +
                             " values, expected num_tokens*H = " + std::to_string(routing[r].num_tokens * s.hidden));
  return Status::Ok();
}

}  // namespace

StatusOr<ReferenceForwardResult> ReferenceForward(const LayerShape& s, const MoEWeights& w, const Routing& routing,
                                                  const CapacityPolicy& policy,
                                                  const std::vector<std::vector<float>>& x) {
  ReferenceForwardResult res;
  RDEP_ASSIGN_OR_RETURN(res.acceptance, ApplyCapacity(s, routing, policy));
  RDEP_RETURN_IF_ERROR(CheckInputs(s, w, routing, x, "x"));
  const int64_t H = s.hidden, F = s.ffn, K = s.topk;
  std::vector<double> h(static_cast<size_t>(2 * F)), z(static_cast<size_t>(F)), o(static_cast<size_t>(H));
  res.y.resize(routing.size());
  res.expert_out.resize(routing.size());
  for (size_t r = 0; r < routing.size(); ++r) {
    const auto& rr = routing[r];
    const auto& acc = res.acceptance[r];
    res.y[r].assign(static_cast<size_t>(rr.num_tokens * H), 0.0);
    res.expert_out[r].assign(static_cast<size_t>(rr.num_tokens * K * H), 0.0);
    for (int64_t t = 0; t < rr.num_tokens; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const auto i = static_cast<size_t>(t * K + k);
        if (!acc.accepted[i]) continue;
        const auto e = static_cast<size_t>(rr.experts[i]);
        mlp::Forward<double>(x[r].data() + t * H, w.w1.data() + e * w.w1_per_expert(),
                             w.w2.data() + e * w.w2_per_expert(), H, F, h.data(), z.data(), o.data(), w.gate_up);
        for (int64_t c = 0; c < H; ++c) {
          res.expert_out[r][i * static_cast<size_t>(H) + static_cast<size_t>(c)] = o[static_cast<size_t>(c)];
          res.y[r][static_cast<size_t>(t * H + c)] += static_cast<double>(acc.effective_gates[i]) * o[static_cast<size_t>(c)];
        }
      }
  }
  return res;
}

StatusOr<ReferenceGradients> ReferenceBackward(const LayerShape& s, const MoEWeights& w, const Routing& routing,
                                               const CapacityPolicy& policy, const std::vector<std::vector<float>>& x,
                                               const std::vector<std::vector<float>>& dy) {
  RDEP_ASSIGN_OR_RETURN(auto fwd, ReferenceForward(s, w, routing, policy, x));
  RDEP_RETURN_IF_ERROR(CheckInputs(s, w, routing, dy, "dy"));
  const int64_t H = s.hidden, F = s.ffn, K = s.topk;
  ReferenceGradients g;
  g.dw1.assign(w.w1.size(), 0.0);
  g.dw2.assign(w.w2.size(), 0.0);
  g.dx.resize(routing.size());
  g.dgates.resize(routing.size());
  std::vector<double> h(static_cast<size_t>(2 * F)), z(static_cast<size_t>(F)), o(static_cast<size_t>(H));
  std::vector<double> dout(static_cast<size_t>(H)), dxr(static_cast<size_t>(H)), scratch(static_cast<size_t>(3 * F));
  std::vector<double> dgeff(static_cast<size_t>(K)), dg(static_cast<size_t>(K));
  for (size_t r = 0; r < routing.size(); ++r) {
    const auto& rr = routing[r];
    const auto& acc = fwd.acceptance[r];
    g.dx[r].assign(static_cast<size_t>(rr.num_tokens * H), 0.0);
    g.dgates[r].assign(static_cast<size_t>(rr.num_tokens * K), 0.0);
    for (int64_t t = 0; t < rr.num_tokens; ++t) {
      const float* dyt = dy[r].data() + t * H;
      for (int64_t k = 0; k < K; ++k) {
        const auto i = static_cast<size_t>(t * K + k);
        dgeff[static_cast<size_t>(k)] = 0;
        if (!acc.accepted[i]) continue;
        const auto e = static_cast<size_t>(rr.experts[i]);
        const double* f = fwd.expert_out[r].data() + i * static_cast<size_t>(H);
        double dot = 0;
        for (int64_t c = 0; c < H; ++c) dot += static_cast<double>(dyt[c]) * f[c];
        dgeff[static_cast<size_t>(k)] = dot;
        const double ge = acc.effective_gates[i];
        for (int64_t c = 0; c < H; ++c) dout[static_cast<size_t>(c)] = ge * static_cast<double>(dyt[c]);
        const float* xt = x[r].data() + t * H;
        const float* w1 = w.w1.data() + e * w.w1_per_expert();
        const float* w2 = w.w2.data() + e * w.w2_per_expert();
        mlp::Forward<double>(xt, w1, w2, H, F, h.data(), z.data(), o.data(), w.gate_up);
        mlp::Backward<double>(xt, w1, w2, H, F, h.data(), dout.data(), g.dw1.data() + e * w.w1_per_expert(),
                              g.dw2.data() + e * w.w2_per_expert(), dxr.data(), scratch.data(), w.gate_up);
        for (int64_t c = 0; c < H; ++c) g.dx[r][static_cast<size_t>(t * H + c)] += dxr[static_cast<size_t>(c)];
      }
      RenormalizeGatesBackward(rr.gates.data() + t * K, acc.accepted.data() + t * K, K, dgeff.data(), dg.data());
      for (int64_t k = 0; k < K; ++k) g.dgates[r][static_cast<size_t>(t * K + k)] = dg[static_cast<size_t>(k)];
    }
  }
  return g;
}

}  // namespace rdep
