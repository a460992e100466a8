// RowArena (row_arena.h) on host pointers, no device: consecutive 256-aligned pieces of the caller's buffer, null
// once it is exhausted (a request too large for what is left takes nothing), and a piece given back is a no-op.
#include "capi/row_arena.h"

#include <gtest/gtest.h>

#include <vector>

namespace rdep::capi {
namespace {

TEST(RowArena, PiecesAreConsecutiveAlignedAndNullOnceExhausted) {
  alignas(256) static char buffer[1024];
  RowArena arena(buffer, sizeof(buffer));
  std::vector<void*> pieces;
  for (size_t n : {1, 256, 300}) pieces.push_back(RowArena::Alloc(&arena, n, 0, nullptr));
  EXPECT_EQ(pieces, (std::vector<void*>{buffer, buffer + 256, buffer + 512}));
  EXPECT_EQ(arena.used(), 1024u);  // 256 + 256 + 512 (300 bytes round up to 512)
  EXPECT_EQ(RowArena::Alloc(&arena, 1, 0, nullptr), nullptr);
  EXPECT_EQ(arena.used(), 1024u);
  for (void* p : pieces) RowArena::Free(&arena, p, 256, 0);  // the caller's buffer holds them: nothing changes
  EXPECT_EQ(arena.used(), 1024u);
  EXPECT_EQ(RowArena::Alloc(&arena, 1, 0, nullptr), nullptr);
}

TEST(RowArena, ARequestLargerThanWhatIsLeftTakesNothing) {
  alignas(256) static char buffer[512];
  RowArena arena(buffer, sizeof(buffer));
  EXPECT_EQ(RowArena::Alloc(&arena, 513, 0, nullptr), nullptr);
  EXPECT_EQ(arena.used(), 0u);
  EXPECT_EQ(RowArena::Alloc(&arena, 256, 0, nullptr), buffer);
  EXPECT_EQ(RowArena::Alloc(&arena, 257, 0, nullptr), nullptr);
  EXPECT_EQ(RowArena::Alloc(&arena, 200, 0, nullptr), buffer + 256);
}

TEST(RowArena, WithoutABufferNothingIsHandedOut) {
  RowArena arena(nullptr, 4096);
  EXPECT_EQ(RowArena::Alloc(&arena, 1, 0, nullptr), nullptr);
  EXPECT_EQ(arena.used(), 0u);
}

}  // namespace
}  // namespace rdep::capi
