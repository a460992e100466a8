#include "rdep/core/json.h"

#include <gtest/gtest.h>

#include <cmath>

namespace rdep {
namespace {

TEST(Json, WritesNestedDocuments) {
  JsonWriter w;
  w.begin_object().field("name", "a\"b\n").field("n", int64_t{3}).field("ok", true).field("x", NAN);
  w.key("list").value(std::vector<double>{1.5, 2});
  w.key("rows").begin_array().begin_object().field("k", 1).end_object().begin_object().end_object().end_array();
  w.end_object();
  EXPECT_EQ(w.str(), R"({"name":"a\"b\n","n":3,"ok":true,"x":null,"list":[1.5,2],"rows":[{"k":1},{}]})");
}

}  // namespace
}  // namespace rdep
