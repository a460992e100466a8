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

TEST(RowId, RoundTripsAtLargeTKWAsTheKernelsUnsignedDecode) {
  // Random shapes with W*T*K far above 2^32; decode must agree with the unsigned arithmetic the
  // CUDA return kernel used before it called RowIdCodec (slot = id % K, rank/token from id / K).
  Rng rng(11);
  int above_32_bits = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const auto T = static_cast<int64_t>(1 + rng.below(uint64_t{1} << 32));
    const auto K = static_cast<int64_t>(1 + rng.below(64));
    const auto W = static_cast<int64_t>(1 + rng.below(4096));
    const RowIdCodec c{.tokens = T, .topk = K};
    for (int i = 0; i < 50; ++i) {
      const RowKey key{static_cast<int64_t>(rng.below(static_cast<uint64_t>(W))),
                       static_cast<int64_t>(rng.below(static_cast<uint64_t>(T))),
                       static_cast<int64_t>(rng.below(static_cast<uint64_t>(K)))};
      const uint64_t id = c.encode(key.rank, key.token, key.slot);
      const uint64_t uT = static_cast<uint64_t>(T), uK = static_cast<uint64_t>(K);
      EXPECT_EQ(id, (static_cast<uint64_t>(key.rank) * uT + static_cast<uint64_t>(key.token)) * uK +
                        static_cast<uint64_t>(key.slot));
      EXPECT_EQ(c.decode(id), key);
      const uint64_t rt = id / uK;
      EXPECT_EQ(c.decode(id), (RowKey{static_cast<int64_t>(rt / uT), static_cast<int64_t>(rt % uT),
                                      static_cast<int64_t>(id % uK)}));
      above_32_bits += id > (uint64_t{1} << 32);
    }
    const RowKey last{W - 1, T - 1, K - 1};  // the largest id of the shape
    EXPECT_EQ(c.decode(c.encode(last.rank, last.token, last.slot)), last);
  }
  EXPECT_GT(above_32_bits, 5000);
}

}  // namespace
}  // namespace rdep
