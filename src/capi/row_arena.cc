#include "capi/row_arena.h"

namespace rdep::capi {

void* RowArena::Alloc(void* self, size_t bytes, int32_t /*device*/, void* /*stream*/) {
  auto* a = static_cast<RowArena*>(self);
  const size_t n = (bytes + kAlign - 1) / kAlign * kAlign;
  std::lock_guard<std::mutex> lock(a->mu_);
  if (n > a->size_ - a->used_) return nullptr;
  void* p = a->base_ + a->used_;
  a->used_ += n;
  return p;
}

void RowArena::Free(void* /*self*/, void* /*ptr*/, size_t /*bytes*/, int32_t /*device*/) {}

size_t RowArena::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

}  // namespace rdep::capi
