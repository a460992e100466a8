#include "cli.h"

#include <gtest/gtest.h>

namespace rdep::cli {
namespace {

TEST(Flags, ParsesBothForms) {
  Flags f({"pos", "--ranks", "4", "--topk=2", "--json", "out.json", "--verbose"});
  EXPECT_EQ(f.get_int("ranks", 1), 4);
  EXPECT_EQ(f.get_int("topk", 1), 2);
  EXPECT_EQ(f.get_string("json", ""), "out.json");
  EXPECT_TRUE(f.get_bool("verbose"));
  EXPECT_EQ(f.get_int("missing", 7), 7);
  EXPECT_EQ(f.positional(), (std::vector<std::string>{"pos"}));
  EXPECT_TRUE(f.Finish().ok());
}

TEST(Flags, ReportsUnknownAndMalformed) {
  Flags f({"--ranks", "four", "--bogus", "1"});
  f.get_int("ranks", 1);
  EXPECT_NE(f.Finish().message().find("--ranks expects an integer"), std::string::npos);
  Flags g({"--bogus", "1"});
  EXPECT_NE(g.Finish().message().find("unknown flag --bogus"), std::string::npos);
  Flags h({"--capacity-factor", "x"});
  h.get_double("capacity-factor", 0);
  EXPECT_FALSE(h.Finish().ok());
}

TEST(Flags, NegativeNumbersAreValues) {
  Flags f({"--seed", "-3"});
  // "-3" does not start with "--", so it is the value.
  EXPECT_EQ(f.get_int("seed", 0), -3);
}

}  // namespace
}  // namespace rdep::cli
