// The caller's row allocator (rdep_layer_set_row_allocator) behind trampolines that serve one forward call's
// requests from an arena the caller passes with the call (rdep_layer_forward_arena): consecutive 256-aligned pieces
// of the caller's buffer, handed out without calling the allocator (for rdep.torch, a Python callback per request).
// The layer's saved-row buffers are given the trampolines; a request outside such a call goes to the caller's
// allocator, and only blocks that allocator returned are given back to it (an arena's pieces belong to the caller's
// buffer: giving one back is a no-op).
#ifndef RDEP_CAPI_ROW_ARENA_H_
#define RDEP_CAPI_ROW_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_set>

#include "rdep/capi.h"

namespace rdep::capi {

class RowArena {
 public:
  static constexpr size_t kAlign = 256;  // CudaMoELayer::kRowAllocAlign: rdep_layer_row_allocator_bytes counts so

  // The caller's allocator (both null: none).
  void SetAllocator(rdep_alloc_fn alloc, rdep_free_fn free_fn, void* user);
  bool has_allocator() const { return alloc_ != nullptr; }

  // The functions the layer's buffers call, with `self` this arena.
  static void* Alloc(void* self, size_t bytes, int32_t device, void* stream);
  static void Free(void* self, void* ptr, size_t bytes, int32_t device);

  // While one lives, requests take pieces of [base, base + bytes) and null once it is exhausted (the call then fails
  // naming the bytes, as the caller's own arena did: every row of a captured forward must lie in memory the caller
  // tracks). used(): the bytes taken so far. One at a time (the caller holds the layer's call lock).
  class Use {
   public:
    Use(RowArena& arena, void* base, size_t bytes);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    size_t used() const;

   private:
    RowArena& arena_;
  };

 private:
  void* Take(size_t bytes, int32_t device, void* stream);
  void GiveBack(void* ptr, size_t bytes, int32_t device);

  mutable std::mutex mu_;  // the local ranks' threads request at once
  char* base_ = nullptr;
  size_t size_ = 0, used_ = 0;
  bool active_ = false;
  rdep_alloc_fn alloc_ = nullptr;
  rdep_free_fn free_ = nullptr;
  void* user_ = nullptr;
  std::unordered_set<void*> blocks_;  // from the caller's allocator and not yet given back
};

}  // namespace rdep::capi

#endif  // RDEP_CAPI_ROW_ARENA_H_
