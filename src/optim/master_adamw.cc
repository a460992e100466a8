// AdamW with fp32 master weights: argument checks, coefficients and the host reference (master_adamw.h).
#include "rdep/optim/master_adamw.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "rdep/cuda/bf16.h"

namespace rdep::optim {
namespace {

bool Finite(double v) { return std::isfinite(v); }

// exp_avg.lerp_(g, w) with w = 1 - beta1, as torch's lerp evaluates it: from the start below weight 0.5, from the
// end at and above it.
float LerpMoment(float m, float g, const AdamWCoeffs& c) {
  return c.one_minus_beta1 < 0.5f ? m + c.one_minus_beta1 * (g - m) : g - (g - m) * (1.0f - c.one_minus_beta1);
}

}  // namespace

std::array<ByteRange, 5> ArraysOf(const MasterTensor& t) {
  const auto n = static_cast<size_t>(std::max<int64_t>(t.numel, 0));
  return {{{"master", t.master, n * 4}, {"exp_avg", t.exp_avg, n * 4}, {"exp_avg_sq", t.exp_avg_sq, n * 4},
           {"grad", t.grad, n * GradBytes(t.grad_dtype)}, {"param", t.param, n * 2}}};
}

Status CheckHyper(const AdamWHyper& h) {
  if (!Finite(h.lr) || h.lr < 0) return InvalidArgument("adamw: lr must be finite and >= 0, got " + std::to_string(h.lr));
  if (!Finite(h.eps) || h.eps < 0) return InvalidArgument("adamw: eps must be finite and >= 0, got " + std::to_string(h.eps));
  if (!Finite(h.weight_decay) || h.weight_decay < 0)
    return InvalidArgument("adamw: weight_decay must be finite and >= 0, got " + std::to_string(h.weight_decay));
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return InvalidArgument("adamw: beta1 must be in [0, 1), got " + std::to_string(h.beta1));
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return InvalidArgument("adamw: beta2 must be in [0, 1), got " + std::to_string(h.beta2));
  if (h.step < 1) return InvalidArgument("adamw: step must be >= 1 (the first update is step 1), got " + std::to_string(h.step));
  return Status::Ok();
}

AdamWCoeffs Coeffs(const AdamWHyper& h) {
  const double steps = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(h.beta1, steps);
  const double bc2 = 1.0 - std::pow(h.beta2, steps);
  AdamWCoeffs c{};
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.step_size = static_cast<float>(h.lr / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  return c;
}

Status CheckTensor(const MasterTensor& t, int32_t index) {
  const std::string what = "adamw tensor " + std::to_string(index);
  if (t.numel < 0) return InvalidArgument(what + ": numel must be >= 0, got " + std::to_string(t.numel));
  if (t.grad_dtype != GradDtype::kBf16 && t.grad_dtype != GradDtype::kFp32)
    return InvalidArgument(what + ": grad_dtype must be 0 (bf16) or 1 (fp32), got " + std::to_string(static_cast<int32_t>(t.grad_dtype)));
  if (t.numel == 0) return Status::Ok();
  if (!t.master || !t.exp_avg || !t.exp_avg_sq || !t.grad || !t.param)
    return InvalidArgument(what + ": master, exp_avg, exp_avg_sq, grad and param must not be null");
  const auto arrays = ArraysOf(t);
  for (size_t i = 0; i < arrays.size(); ++i)
    for (size_t j = i + 1; j < arrays.size(); ++j)
      if (Overlap(arrays[i], arrays[j]))
        return InvalidArgument(what + ": " + arrays[i].name + " and " + arrays[j].name + " overlap");
  return Status::Ok();
}

Status CheckDisjoint(const MasterTensor& a, int32_t ia, const MasterTensor& b, int32_t ib) {
  for (const ByteRange& x : ArraysOf(a))
    for (const ByteRange& y : ArraysOf(b))
      if (Overlap(x, y))
        return InvalidArgument("adamw tensors " + std::to_string(ia) + " and " + std::to_string(ib) + " overlap (" + x.name +
                               " of " + std::to_string(ia) + ", " + y.name + " of " + std::to_string(ib) + ")");
  return Status::Ok();
}

void MasterAdamWHost(const MasterTensor& t, const AdamWCoeffs& c, const float* grad_scale) {
  const float scale = grad_scale ? *grad_scale : 1.0f;
  const auto* g16 = static_cast<const uint16_t*>(t.grad);
  const auto* g32 = static_cast<const float*>(t.grad);
  const bool fp32 = t.grad_dtype == GradDtype::kFp32;
  for (int64_t i = 0; i < t.numel; ++i) {
    const float g = (fp32 ? g32[i] : Bf16BitsToFloat(g16[i])) * scale;  // exact when unscaled (scale 1)
    float w = t.master[i] * c.decay;
    const float m = LerpMoment(t.exp_avg[i], g, c);
    const float gg = g * g;
    const float v = c.beta2 * t.exp_avg_sq[i] + c.one_minus_beta2 * gg;
    const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    w = w - c.step_size * m / denom;
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    t.master[i] = w;
    t.param[i] = FloatToBf16Bits(w);
  }
}

}  // namespace rdep::optim
