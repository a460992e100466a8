#include "rdep/layer/forward_context.h"

namespace rdep {

ForwardContext::ForwardContext() = default;
ForwardContext::~ForwardContext() = default;
ForwardContext::ForwardContext(ForwardContext&&) noexcept = default;
ForwardContext& ForwardContext::operator=(ForwardContext&&) noexcept = default;

size_t ForwardContext::bytes() const { return state_ ? state_->bytes() : 0; }

void ForwardContext::Release() {
  state_.reset();
  planned_ = false;
  ready_ = false;
  consumed_ = false;
  dispatched_ = false;
  combine_grad_ = false;
}

bool ForwardContext::RearmBackward() {
  if (!rearmable()) return false;
  consumed_ = false;
  return true;
}

}  // namespace rdep
