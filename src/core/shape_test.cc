#include "rdep/core/shape.h"

#include <gtest/gtest.h>

namespace rdep {
namespace {

LayerShape Ok() { return LayerShape{.tokens = 16, .hidden = 64, .ffn = 128, .experts = 8, .topk = 2, .ranks = 4}; }

TEST(LayerShape, AcceptsValidAndEdgeShapes) {
  EXPECT_TRUE(Ok().Validate().ok());
  LayerShape s = Ok();
  s.topk = s.experts;  // K = E
  EXPECT_TRUE(s.Validate().ok());
  s = Ok();
  s.tokens = 0;  // no tokens anywhere is degenerate but valid
  EXPECT_TRUE(s.Validate().ok());
  s = Ok();
  s.ranks = 1;
  EXPECT_TRUE(s.Validate().ok());
}

TEST(LayerShape, RejectsBadShapesWithNamedReason) {
  struct Case { LayerShape s; const char* needle; };
  std::vector<Case> cases;
  LayerShape s = Ok(); s.topk = 9; cases.push_back({s, "topk K must be <= experts E"});
  s = Ok(); s.experts = 0; cases.push_back({s, "experts E must be >= 1"});
  s = Ok(); s.ranks = 0; cases.push_back({s, "ranks W must be >= 1"});
  s = Ok(); s.hidden = 0; cases.push_back({s, "hidden H"});
  s = Ok(); s.ffn = -1; cases.push_back({s, "ffn D_ff"});
  s = Ok(); s.topk = 0; cases.push_back({s, "topk K must be >= 1"});
  s = Ok(); s.tokens = -3; cases.push_back({s, "tokens T"});
  s = Ok(); s.tokens = int64_t{1} << 40; s.ranks = int64_t{1} << 20; s.topk = 8; cases.push_back({s, "overflows"});
  for (const auto& c : cases) {
    Status st = c.s.Validate();
    ASSERT_FALSE(st.ok()) << c.s;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(c.needle), std::string::npos) << st.message();
  }
}

TEST(LayerShape, DerivedCounts) {
  LayerShape s{.tokens = 4096, .hidden = 2048, .ffn = 1408, .experts = 64, .topk = 6, .ranks = 4};
  EXPECT_EQ(s.total_rows(), 4 * 4096 * 6);
  EXPECT_DOUBLE_EQ(s.pooled_rows_per_expert(), 1536.0);
}

}  // namespace
}  // namespace rdep
