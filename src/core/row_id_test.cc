#include "rdep/core/row_id.h"

#include <gtest/gtest.h>

#include "rdep/core/random.h"

namespace rdep {
namespace {

TEST(RowId, PaperToyExample) {
  RowIdCodec c{.tokens = 4, .topk = 2};
  EXPECT_EQ(c.encode(0, 0, 0), 0u);
  EXPECT_EQ(c.encode(0, 0, 1), 1u);
  EXPECT_EQ(c.encode(2, 1, 1), static_cast<uint64_t>((2 * 4 + 1) * 2 + 1));
}

TEST(RowId, RoundTripsExhaustivelyOnSmallShapes) {
  for (int64_t T : {1, 3, 16})
    for (int64_t K : {1, 2, 6}) {
      RowIdCodec c{.tokens = T, .topk = K};
      uint64_t expect = 0;
      for (int64_t r = 0; r < 5; ++r)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t k = 0; k < K; ++k) {
            const uint64_t id = c.encode(r, t, k);
            EXPECT_EQ(id, expect++);  // dense and injective
            EXPECT_EQ(c.decode(id), (RowKey{r, t, k}));
          }
    }
}

TEST(RowId, RoundTripsAcrossThe64BitRange) {
  // Width 72 at 2^40 tokens per rank and K = 8 exceeds 32 bits by far.
  RowIdCodec c{.tokens = int64_t{1} << 40, .topk = 8};
  Rng rng(7);
  for (int i = 0; i < 10000; ++i) {
    const auto r = static_cast<int64_t>(rng.below(72));
    const auto t = static_cast<int64_t>(rng.below(uint64_t{1} << 40));
    const auto k = static_cast<int64_t>(rng.below(8));
    EXPECT_EQ(c.decode(c.encode(r, t, k)), (RowKey{r, t, k}));
  }
  const RowKey last{71, (int64_t{1} << 40) - 1, 7};
  EXPECT_EQ(c.decode(c.encode(last.rank, last.token, last.slot)), last);
  EXPECT_GT(c.encode(71, 0, 0), uint64_t{1} << 32);
}

}  // namespace
}  // namespace rdep
