#include "capi/row_arena.h"

namespace rdep::capi {

void RowArena::SetAllocator(rdep_alloc_fn alloc, rdep_free_fn free_fn, void* user) {
  std::lock_guard<std::mutex> lock(mu_);
  alloc_ = alloc;
  free_ = free_fn;
  user_ = user;
}

void* RowArena::Alloc(void* self, size_t bytes, int32_t device, void* stream) {
  return static_cast<RowArena*>(self)->Take(bytes, device, stream);
}

void RowArena::Free(void* self, void* ptr, size_t bytes, int32_t device) { static_cast<RowArena*>(self)->GiveBack(ptr, bytes, device); }

void* RowArena::Take(size_t bytes, int32_t device, void* stream) {
  rdep_alloc_fn alloc;
  void* user;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (active_) {
      const size_t n = (bytes + kAlign - 1) / kAlign * kAlign;
      if (n > size_ - used_) return nullptr;
      void* p = base_ + used_;
      used_ += n;
      return p;
    }
    alloc = alloc_;
    user = user_;
  }
  if (!alloc) return nullptr;
  void* p = alloc(user, bytes, device, stream);  // not under the lock: the caller's allocator may take its own locks
  if (p) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.insert(p);
  }
  return p;
}

void RowArena::GiveBack(void* ptr, size_t bytes, int32_t device) {
  rdep_free_fn free_fn;
  void* user;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (blocks_.erase(ptr) == 0) return;  // an arena's piece: the caller's buffer holds it
    free_fn = free_;
    user = user_;
  }
  if (free_fn) free_fn(user, ptr, bytes, device);
}

RowArena::Use::Use(RowArena& arena, void* base, size_t bytes) : arena_(arena) {
  std::lock_guard<std::mutex> lock(arena_.mu_);
  arena_.base_ = static_cast<char*>(base);
  arena_.size_ = base ? bytes : 0;
  arena_.used_ = 0;
  arena_.active_ = true;
}

RowArena::Use::~Use() {
  std::lock_guard<std::mutex> lock(arena_.mu_);
  arena_.active_ = false;
  arena_.base_ = nullptr;
  arena_.size_ = 0;
}

size_t RowArena::Use::used() const {
  std::lock_guard<std::mutex> lock(arena_.mu_);
  return arena_.used_;
}

}  // namespace rdep::capi
