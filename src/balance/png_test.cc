// PNG writer tests: signature, IHDR, chunk CRCs, stored-deflate framing and Adler-32 are right.
#include "rdep/balance/png.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>

namespace rdep {
namespace {

uint32_t Be32(const std::vector<uint8_t>& v, size_t at) {
  return (uint32_t{v[at]} << 24) | (uint32_t{v[at + 1]} << 16) | (uint32_t{v[at + 2]} << 8) | uint32_t{v[at + 3]};
}

TEST(Png, ChecksumsMatchKnownValues) {
  const std::string s = "123456789";
  const auto* d = reinterpret_cast<const uint8_t*>(s.data());
  EXPECT_EQ(Crc32(d, s.size()), 0xCBF43926u);   // the CRC-32 check value
  EXPECT_EQ(Adler32(d, s.size()), 0x091E01DEu);  // the Adler-32 check value
  const std::string w = "Wikipedia";
  EXPECT_EQ(Adler32(reinterpret_cast<const uint8_t*>(w.data()), w.size()), 0x11E60398u);
}

// Walks the chunks, checks every CRC, inflates the stored blocks and returns the raw scanlines.
std::vector<uint8_t> ParseAndInflate(const std::vector<uint8_t>& png, uint32_t* w, uint32_t* h) {
  const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  EXPECT_TRUE(std::equal(sig, sig + 8, png.begin()));
  size_t at = 8;
  std::vector<uint8_t> z;
  std::vector<std::string> order;
  while (at + 12 <= png.size()) {
    const uint32_t len = Be32(png, at);
    const std::string type(png.begin() + static_cast<long>(at + 4), png.begin() + static_cast<long>(at + 8));
    order.push_back(type);
    EXPECT_EQ(Crc32(png.data() + at + 4, len + 4), Be32(png, at + 8 + len)) << "bad CRC in " << type;
    if (type == "IHDR") {
      EXPECT_EQ(len, 13u);
      *w = Be32(png, at + 8);
      *h = Be32(png, at + 12);
      EXPECT_EQ(png[at + 16], 8);  // bit depth
      EXPECT_EQ(png[at + 17], 2);  // RGB
    }
    if (type == "IDAT") z.insert(z.end(), png.begin() + static_cast<long>(at + 8), png.begin() + static_cast<long>(at + 8 + len));
    at += 12 + len;
  }
  EXPECT_EQ(at, png.size());
  EXPECT_EQ(order.front(), "IHDR");
  EXPECT_EQ(order.back(), "IEND");
  // zlib header: (CMF*256 + FLG) % 31 == 0, deflate method 8.
  EXPECT_EQ((z[0] & 0x0F), 8);
  EXPECT_EQ((z[0] * 256 + z[1]) % 31, 0);
  std::vector<uint8_t> raw;
  size_t p = 2;
  bool last = false;
  while (!last) {
    last = z[p] & 1;
    EXPECT_EQ((z[p] >> 1) & 3, 0);  // stored block
    const uint32_t n = z[p + 1] | (uint32_t{z[p + 2]} << 8);
    const uint32_t nn = z[p + 3] | (uint32_t{z[p + 4]} << 8);
    EXPECT_EQ(n ^ 0xFFFFu, nn);
    raw.insert(raw.end(), z.begin() + static_cast<long>(p + 5), z.begin() + static_cast<long>(p + 5 + n));
    p += 5 + n;
  }
  EXPECT_EQ(Be32(z, p), Adler32(raw.data(), raw.size()));
  EXPECT_EQ(p + 4, z.size());
  return raw;
}

TEST(Png, EncodesPixelsExactly) {
  Canvas c(300, 250);  // 250 rows of 901 bytes: more than one 64 KiB stored block
  c.Set(0, 0, {1, 2, 3});
  c.Set(299, 249, {250, 251, 252});
  c.Line(10, 10, 100, 10, {0, 0, 0});
  c.Text(20, 40, "IMBALANCE 1.03", {255, 0, 0}, 2);
  uint32_t w = 0, h = 0;
  const auto raw = ParseAndInflate(c.EncodePng(), &w, &h);
  ASSERT_EQ(w, 300u);
  ASSERT_EQ(h, 250u);
  ASSERT_EQ(raw.size(), 250u * (1 + 300 * 3));
  EXPECT_EQ(raw[0], 0);  // filter type none
  EXPECT_EQ(raw[1], 1);
  EXPECT_EQ(raw[2], 2);
  EXPECT_EQ(raw[3], 3);
  const size_t last = 249 * 901 + 1 + 299 * 3;
  EXPECT_EQ(raw[last], 250);
  EXPECT_EQ(raw[last + 2], 252);
  const size_t on_line = 10 * 901 + 1 + 50 * 3;
  EXPECT_EQ(raw[on_line], 0);
  int red = 0;
  for (int y = 40; y < 54; ++y)
    for (int x = 20; x < 200; ++x) red += c.Get(x, y).r == 255 && c.Get(x, y).g == 0;
  EXPECT_GT(red, 100);  // the text was drawn
}

TEST(Png, BoxPlotFileIsValid) {
  const std::string path = ::testing::TempDir() + "/rdep_boxplot_test.png";
  ASSERT_TRUE(WriteBoxPlotPng(path, "test", {"a", "b"}, {{1.0, 1.1, 1.2, 1.5}, {1.01, 1.02, 1.03}}).ok());
  std::ifstream f(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint32_t w = 0, h = 0;
  const auto raw = ParseAndInflate(bytes, &w, &h);
  EXPECT_EQ(raw.size(), static_cast<size_t>(h) * (1 + w * 3));
  std::remove(path.c_str());
  EXPECT_FALSE(WriteBoxPlotPng(path, "t", {"a"}, {}).ok());
}

}  // namespace
}  // namespace rdep
