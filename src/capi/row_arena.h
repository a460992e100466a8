// The caller's arena of one forward call (rdep_layer_forward_arena): the row allocator the C ABI hands the layer's
// buffers for that call instead of the caller's, taking consecutive 256-aligned pieces of the caller's buffer without
// calling the caller's allocator (for rdep.torch, a Python callback per request). Each buffer keeps the allocator it
// was reserved with, so a piece's release calls this arena's Free, a no-op (the caller's buffer holds the memory),
// and never the caller's free: no address is looked up, so a piece and a block of the caller's allocator that share an
// address (memory reused between them) are never confused.
#ifndef RDEP_CAPI_ROW_ARENA_H_
#define RDEP_CAPI_ROW_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <mutex>

namespace rdep::capi {

class RowArena {
 public:
  static constexpr size_t kAlign = 256;  // CudaMoELayer::kRowAllocAlign: rdep_layer_row_allocator_bytes counts so

  // [base, base + bytes); base must be kAlign-aligned (the C ABI checks).
  RowArena(void* base, size_t bytes) : base_(static_cast<char*>(base)), size_(base ? bytes : 0) {}
  RowArena(const RowArena&) = delete;
  RowArena& operator=(const RowArena&) = delete;

  // The allocator's functions, with `self` this arena: the next piece, or null once the arena is exhausted (the call
  // then fails naming the bytes: every row of a captured forward must lie in memory the caller tracks).
  static void* Alloc(void* self, size_t bytes, int32_t device, void* stream);
  static void Free(void* self, void* ptr, size_t bytes, int32_t device);  // a no-op
  size_t used() const;  // the bytes taken so far

 private:
  mutable std::mutex mu_;  // the local ranks' threads request at once
  char* base_;
  size_t size_;
  size_t used_ = 0;
};

}  // namespace rdep::capi

#endif  // RDEP_CAPI_ROW_ARENA_H_
