// The launch mode of rdep's kernels (src/launch/pdl.h): programmatic dependent launch unless RDEP_PDL=off or a
// device predates compute capability 9.0; any other RDEP_PDL value is refused. Runs on the host.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "launch/pdl.h"

namespace rdep::cuda {
namespace {

TEST(PdlLaunchMode, OnByDefaultWhereEveryDeviceHasIt) {
  EXPECT_EQ(ParsePdlMode(nullptr, true), 1);
  EXPECT_EQ(ParsePdlMode("", true), 1);
  EXPECT_EQ(ParsePdlMode("on", true), 1);
}

TEST(PdlLaunchMode, PlainWhenOffOrADeviceLacksIt) {
  EXPECT_EQ(ParsePdlMode("off", true), 0);
  EXPECT_EQ(ParsePdlMode("off", false), 0);
  EXPECT_EQ(ParsePdlMode(nullptr, false), 0);
  EXPECT_EQ(ParsePdlMode("on", false), 0);
}

TEST(PdlLaunchMode, AnyOtherValueIsRefused) {
  for (const char* v : {"1", "0", "ON", "Off", "yes", " on"}) EXPECT_EQ(ParsePdlMode(v, true), -1) << v;
}

// Run by the ctest pdl_bad_setting_is_named with RDEP_PDL=bogus (skipped otherwise): the process's setting is refused,
// naming the variable and its value, by the check every launch runs first (no GPU needed).
TEST(PdlLaunchMode, BadProcessSettingIsNamed) {
  const char* v = std::getenv("RDEP_PDL");
  if (v == nullptr || std::string(v) != "bogus") GTEST_SKIP() << "runs with RDEP_PDL=bogus (ctest pdl_bad_setting_is_named)";
  EXPECT_EQ(PdlMode(), -1);
  const Status st = CheckPdlSetting();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("RDEP_PDL='bogus': expected on (the default) or off"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace rdep::cuda
