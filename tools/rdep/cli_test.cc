#include "cli.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

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

TEST(Help, DashHAndDashDashHelp) {
  EXPECT_TRUE(WantsHelp({"sim", "-h"}));
  EXPECT_TRUE(WantsHelp({"--ranks", "4", "--help"}));
  EXPECT_FALSE(WantsHelp({"--ranks", "4", "help"}));
}

TEST(Limits, FlagWinsOverEnvironmentAndBadValuesNameTheirSource) {
  ::setenv("RDEP_MAX_MEMORY_GIB", "2", 1);
  Flags env({});
  auto a = ReadLimits(env);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_DOUBLE_EQ(a->host_bytes, 2.0 * 1024 * 1024 * 1024);
  EXPECT_EQ(a->host_source, "$RDEP_MAX_MEMORY_GIB");
  EXPECT_DOUBLE_EQ(a->operations, kDefaultMaxGop * 1e9);
  Flags flag({"--max-memory-gib", "0.5", "--max-gop", "3"});
  auto b = ReadLimits(flag);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_DOUBLE_EQ(b->host_bytes, 0.5 * 1024 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(b->operations, 3e9);
  EXPECT_TRUE(flag.Finish().ok());
  ::setenv("RDEP_MAX_MEMORY_GIB", "lots", 1);
  Flags bad_env({});
  auto c = ReadLimits(bad_env);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("RDEP_MAX_MEMORY_GIB='lots'"), std::string::npos);
  ::unsetenv("RDEP_MAX_MEMORY_GIB");
  Flags neg({"--max-gop", "-1"});
  auto d = ReadLimits(neg);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("--max-gop must be a finite number > 0"), std::string::npos);
  Flags def({});
  auto e = ReadLimits(def);
  ASSERT_TRUE(e.ok());
  if (PhysicalMemoryBytes() > 0) {
    EXPECT_DOUBLE_EQ(e->host_bytes, kDefaultMemoryFraction * PhysicalMemoryBytes());
  }
}

TEST(Limits, RefusalNamesEstimateLimitAndTheLargestTermsFlags) {
  Limits l;
  l.host_bytes = 1024.0 * 1024 * 1024;
  l.host_source = "test";
  l.operations = 1e9;
  l.operations_source = "test";
  Footprint fp;
  fp.host.push_back({"weights", {{"experts", 1024}, {"hidden", 65536}}, 3.0 * 1024 * 1024 * 1024});
  fp.host.push_back({"rows", {{"tokens", 4}}, 1.0});
  const Status st = CheckFootprint(fp, l);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("about 3.00 GiB of host memory, more than the limit of 1.00 GiB"), std::string::npos) << st;
  EXPECT_NE(st.message().find("weights: 3.00 GiB, from --experts 1024 x --hidden 65536"), std::string::npos) << st;
  fp.host.front().amount = 1;
  fp.work.push_back({"mlp", {{"ffn", 8}}, 2e9});
  const Status ops = CheckFootprint(fp, l);
  ASSERT_FALSE(ops.ok());
  EXPECT_NE(ops.message().find("--max-gop"), std::string::npos) << ops;
  EXPECT_NE(ops.message().find("from --ffn 8"), std::string::npos) << ops;
  fp.work.front().amount = 1;
  l.device_bytes = 100;
  fp.device.push_back({"regions", {{"ranks", 8}}, 1000});
  EXPECT_NE(CheckFootprint(fp, l).message().find("on each GPU"), std::string::npos);
  fp.device.clear();
  EXPECT_TRUE(CheckFootprint(fp, l).ok());
}

TEST(Limits, FormatBytes) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(17.7 * 1024 * 1024 * 1024), "17.7 GiB");
  EXPECT_EQ(FormatBytes(336.0 * 1024 * 1024 * 1024 * 1024), "336 TiB");
}

TEST(OutputPath, OpenedBeforeTheWorkWithTheOsReason) {
  const std::string dir = ::testing::TempDir();
  const std::string fresh = dir + "/rdep_cli_out_test.json";
  std::remove(fresh.c_str());
  EXPECT_TRUE(CheckOutputPath("json", fresh).ok());
  EXPECT_FALSE(std::ifstream(fresh).good()) << "a file the check created is removed again";
  {
    std::ofstream f(fresh);
    f << "keep";
  }
  EXPECT_TRUE(CheckOutputPath("json", fresh).ok());
  std::ifstream in(fresh);
  std::string content;
  in >> content;
  EXPECT_EQ(content, "keep") << "an existing file is not truncated by the check";
  std::remove(fresh.c_str());
  const Status missing = CheckOutputPath("out", "/nonexistent-rdep-dir/x");
  EXPECT_NE(missing.message().find("--out /nonexistent-rdep-dir/x: cannot open for writing: No such file or directory"),
            std::string::npos)
      << missing;
  EXPECT_NE(CheckOutputPath("png", dir).message().find("Is a directory"), std::string::npos);
  EXPECT_TRUE(CheckOutputPath("json", "").ok());
}

}  // namespace
}  // namespace rdep::cli
