#include "rdep/core/ownership.h"

#include <gtest/gtest.h>

#include <map>

namespace rdep {
namespace {

// Every expert appears exactly once, under its owner, at its local index.
void ExpectConsistent(const OwnershipMap& m) {
  std::vector<int> seen(static_cast<size_t>(m.num_experts()), 0);
  for (int32_t q = 0; q < m.num_ranks(); ++q)
    for (int32_t j = 0; j < m.num_local(q); ++j) {
      const int32_t e = m.global_expert(q, j);
      EXPECT_EQ(m.owner(e), q);
      EXPECT_EQ(m.local_index(e), j);
      ++seen[static_cast<size_t>(e)];
    }
  for (int c : seen) EXPECT_EQ(c, 1);
}

TEST(Ownership, BalancedMatchesPaperFormula) {
  auto m = OwnershipMap::Contiguous(64, 4);
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->balanced());
  for (int32_t e = 0; e < 64; ++e) {
    EXPECT_EQ(m->owner(e), e / 16);
    EXPECT_EQ(m->local_index(e), e % 16);
  }
  ExpectConsistent(*m);
}

TEST(Ownership, NonUniformE128W72) {
  auto m = OwnershipMap::Contiguous(128, 72);
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(m->balanced());
  std::map<int, int> ranks_by_count;
  for (int32_t q = 0; q < 72; ++q) ++ranks_by_count[m->num_local(q)];
  EXPECT_EQ(ranks_by_count[2], 56);
  EXPECT_EQ(ranks_by_count[1], 16);
  EXPECT_EQ(m->max_local(), 2);
  ExpectConsistent(*m);
}

TEST(Ownership, FewerExpertsThanRanksLeavesPureFrontEnds) {
  auto m = OwnershipMap::Contiguous(3, 4);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_local(3), 0);
  ExpectConsistent(*m);
}

TEST(Ownership, ArbitraryMapAndErrors) {
  auto m = OwnershipMap::FromOwners({1, 0, 1, 0, 1}, 2);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->global_expert(1, 2), 4);
  EXPECT_EQ(m->local_index(3), 1);
  ExpectConsistent(*m);
  EXPECT_FALSE(OwnershipMap::FromOwners({0, 2}, 2).ok());
  EXPECT_FALSE(OwnershipMap::Contiguous(0, 2).ok());
  EXPECT_FALSE(OwnershipMap::Contiguous(4, 0).ok());
}

}  // namespace
}  // namespace rdep
