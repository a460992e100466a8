// A small self-contained PNG writer (8-bit RGB, zlib stream of uncompressed "stored" deflate blocks,
// CRC-32 per chunk, Adler-32 over the image data; no external library) and a canvas with lines,
// rectangles and a 5x7 bitmap font, enough to draw the balancer's box plots with labelled axes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rdep/status.h"

namespace rdep {

uint32_t Crc32(const uint8_t* data, size_t n, uint32_t crc = 0);  // PNG/zlib CRC-32 (poly 0xEDB88320)
uint32_t Adler32(const uint8_t* data, size_t n);

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

class Canvas {
 public:
  Canvas(int32_t width, int32_t height, Rgb background = {255, 255, 255});
  int32_t width() const { return width_; }
  int32_t height() const { return height_; }
  void Set(int32_t x, int32_t y, Rgb c);  // ignores pixels outside the canvas
  Rgb Get(int32_t x, int32_t y) const;
  void Line(int32_t x0, int32_t y0, int32_t x1, int32_t y1, Rgb c);
  void FillRect(int32_t x0, int32_t y0, int32_t x1, int32_t y1, Rgb c);  // inclusive corners
  void Rect(int32_t x0, int32_t y0, int32_t x1, int32_t y1, Rgb c);
  // 5x7 glyphs (digits, letters case-folded, . - + = : / ( ) _ % < > and space), scale >= 1.
  void Text(int32_t x, int32_t y, const std::string& s, Rgb c, int32_t scale = 1);
  static int32_t TextWidth(const std::string& s, int32_t scale = 1) { return static_cast<int32_t>(s.size()) * 6 * scale; }
  // The PNG file bytes of the canvas.
  std::vector<uint8_t> EncodePng() const;
  Status WritePng(const std::string& path) const;

 private:
  int32_t width_, height_;
  std::vector<uint8_t> rgb_;  // row-major, 3 bytes per pixel
};

// Box plot (whiskers at min/max, box at p25-p75, line at the median, mean as a dot) plus a jittered
// strip of every value, one column per series, y axis with ticks and values, names under the boxes.
Status WriteBoxPlotPng(const std::string& path, const std::string& title, const std::vector<std::string>& names,
                       const std::vector<std::vector<double>>& series);

}  // namespace rdep
