// RowArena (row_arena.h) on host pointers, no device: the caller's allocator behind it outside an arena call and
// only its own blocks given back to it; inside one, consecutive 256-aligned pieces of the arena, null once it is
// exhausted, the allocator never called and giving a piece back a no-op; after it, the allocator again.
#include "capi/row_arena.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace rdep::capi {
namespace {

struct FakeAllocator {
  std::vector<size_t> allocs;  // bytes asked for
  std::vector<void*> frees;    // pointers given back
  char block[4096]{};
  size_t next = 0;
  static void* Alloc(void* self, size_t bytes, int32_t, void*) {
    auto* a = static_cast<FakeAllocator*>(self);
    a->allocs.push_back(bytes);
    if (a->next + bytes > sizeof(a->block)) return nullptr;
    void* p = a->block + a->next;
    a->next += 1024;
    return p;
  }
  static void Free(void* self, void* ptr, size_t, int32_t) { static_cast<FakeAllocator*>(self)->frees.push_back(ptr); }
};

TEST(RowArena, WithoutAnAllocatorNothingIsHandedOut) {
  RowArena arena;
  EXPECT_FALSE(arena.has_allocator());
  EXPECT_EQ(RowArena::Alloc(&arena, 16, 0, nullptr), nullptr);
  RowArena::Free(&arena, reinterpret_cast<void*>(0x1000), 16, 0);  // unknown: a no-op
}

TEST(RowArena, OutsideAnArenaCallTheCallersAllocatorServesAndGetsOnlyItsBlocksBack) {
  FakeAllocator fake;
  RowArena arena;
  arena.SetAllocator(&FakeAllocator::Alloc, &FakeAllocator::Free, &fake);
  ASSERT_TRUE(arena.has_allocator());
  void* a = RowArena::Alloc(&arena, 100, 0, nullptr);
  void* b = RowArena::Alloc(&arena, 200, 0, nullptr);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(fake.allocs, (std::vector<size_t>{100, 200}));
  RowArena::Free(&arena, b, 200, 0);
  RowArena::Free(&arena, b, 200, 0);  // given back already: not twice
  RowArena::Free(&arena, fake.block + 3000, 8, 0);  // never handed out by the allocator
  EXPECT_EQ(fake.frees, (std::vector<void*>{b}));
  RowArena::Free(&arena, a, 100, 0);
  EXPECT_EQ(fake.frees, (std::vector<void*>{b, a}));
}

TEST(RowArena, InsideAnArenaCallPiecesAreConsecutiveAlignedAndNeverGivenToTheAllocator) {
  FakeAllocator fake;
  RowArena arena;
  arena.SetAllocator(&FakeAllocator::Alloc, &FakeAllocator::Free, &fake);
  alignas(256) static char buffer[1024];
  std::vector<void*> pieces;
  {
    RowArena::Use use(arena, buffer, sizeof(buffer));
    for (size_t n : {1, 256, 300}) pieces.push_back(RowArena::Alloc(&arena, n, 0, nullptr));
    EXPECT_EQ(pieces, (std::vector<void*>{buffer, buffer + 256, buffer + 512}));
    EXPECT_EQ(use.used(), 1024u);  // 256 + 256 + 512 (300 bytes round up to 512)
    EXPECT_EQ(RowArena::Alloc(&arena, 1, 0, nullptr), nullptr);  // exhausted: null, not the allocator
    EXPECT_EQ(use.used(), 1024u);
  }
  EXPECT_TRUE(fake.allocs.empty());
  for (void* p : pieces) RowArena::Free(&arena, p, 256, 0);
  EXPECT_TRUE(fake.frees.empty());
  void* after = RowArena::Alloc(&arena, 64, 0, nullptr);  // the call is over: the allocator again
  EXPECT_EQ(after, fake.block);
  EXPECT_EQ(fake.allocs, (std::vector<size_t>{64}));
}

TEST(RowArena, AnArenaTooSmallForOneRequestFailsIt) {
  FakeAllocator fake;
  RowArena arena;
  arena.SetAllocator(&FakeAllocator::Alloc, &FakeAllocator::Free, &fake);
  alignas(256) static char buffer[256];
  RowArena::Use use(arena, buffer, sizeof(buffer));
  EXPECT_EQ(RowArena::Alloc(&arena, 257, 0, nullptr), nullptr);
  EXPECT_EQ(use.used(), 0u);
  EXPECT_NE(RowArena::Alloc(&arena, 256, 0, nullptr), nullptr);
  EXPECT_TRUE(fake.allocs.empty());
}

}  // namespace
}  // namespace rdep::capi
