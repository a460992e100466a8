// The launch mode of rdep's kernels (src/launch/pdl.h): programmatic dependent launch unless RDEP_PDL=off or a
// device predates compute capability 9.0; any other RDEP_PDL value is refused. Runs on the host.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace rdep::cuda
