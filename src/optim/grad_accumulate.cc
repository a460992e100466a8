// The host side of grad_accumulate.h: the argument check and the reference.
#include "rdep/optim/grad_accumulate.h"

#include <cstring>
#include <string>

namespace rdep::optim {

Status CheckGradAccumulation(const GradAccumulation& a) {
  if (a.numel < 0) return InvalidArgument("grad accumulate: numel must be >= 0, got " + std::to_string(a.numel));
  if (a.numel == 0) return Status::Ok();
  if (!a.acc) return InvalidArgument("grad accumulate: acc (the fp32 accumulator) is null");
  if (!a.grad) return InvalidArgument("grad accumulate: grad (the bf16 gradient) is null");
  const auto acc = reinterpret_cast<uintptr_t>(a.acc), grad = reinterpret_cast<uintptr_t>(a.grad);
  const auto n = static_cast<uintptr_t>(a.numel);
  if (acc < grad + 2 * n && grad < acc + 4 * n)
    return InvalidArgument("grad accumulate: acc and grad overlap (" + std::to_string(a.numel) + " elements)");
  return Status::Ok();
}

void GradAccumulateHost(const GradAccumulation& a) {
  for (int64_t i = 0; i < a.numel; ++i) {
    const uint32_t bits = static_cast<uint32_t>(a.grad[i]) << 16;
    float g;
    std::memcpy(&g, &bits, sizeof(g));
    a.acc[i] = a.add ? a.acc[i] + g : g;
  }
}

}  // namespace rdep::optim
