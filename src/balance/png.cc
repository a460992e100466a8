// PNG writer (stored deflate blocks, CRC-32, Adler-32), a tiny canvas with a 5x7 font, and box plots.
#include "rdep/balance/png.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "rdep/core/random.h"
#include "rdep/core/stats.h"

namespace rdep {
namespace {

size_t Z(int64_t v) { return static_cast<size_t>(v); }

// 5x7 font: 7 rows, low 5 bits per row, bit 4 = leftmost column.
struct Glyph {
  char c;
  uint8_t rows[7];
};
constexpr Glyph kFont[] = {
    {'0', {14, 17, 19, 21, 25, 17, 14}}, {'1', {4, 12, 4, 4, 4, 4, 14}},     {'2', {14, 17, 1, 2, 4, 8, 31}},
    {'3', {31, 2, 4, 2, 1, 17, 14}},     {'4', {2, 6, 10, 18, 31, 2, 2}},    {'5', {31, 16, 30, 1, 1, 17, 14}},
    {'6', {6, 8, 16, 30, 17, 17, 14}},   {'7', {31, 1, 2, 4, 8, 8, 8}},      {'8', {14, 17, 17, 14, 17, 17, 14}},
    {'9', {14, 17, 17, 15, 1, 2, 12}},   {'A', {14, 17, 17, 31, 17, 17, 17}}, {'B', {30, 17, 17, 30, 17, 17, 30}},
    {'C', {14, 17, 16, 16, 16, 17, 14}}, {'D', {28, 18, 17, 17, 17, 18, 28}}, {'E', {31, 16, 16, 30, 16, 16, 31}},
    {'F', {31, 16, 16, 30, 16, 16, 16}}, {'G', {14, 17, 16, 23, 17, 17, 15}}, {'H', {17, 17, 17, 31, 17, 17, 17}},
    {'I', {14, 4, 4, 4, 4, 4, 14}},      {'J', {7, 2, 2, 2, 2, 18, 12}},     {'K', {17, 18, 20, 24, 20, 18, 17}},
    {'L', {16, 16, 16, 16, 16, 16, 31}}, {'M', {17, 27, 21, 21, 17, 17, 17}}, {'N', {17, 17, 25, 21, 19, 17, 17}},
    {'O', {14, 17, 17, 17, 17, 17, 14}}, {'P', {30, 17, 17, 30, 16, 16, 16}}, {'Q', {14, 17, 17, 17, 21, 18, 13}},
    {'R', {30, 17, 17, 30, 20, 18, 17}}, {'S', {15, 16, 16, 14, 1, 1, 30}},  {'T', {31, 4, 4, 4, 4, 4, 4}},
    {'U', {17, 17, 17, 17, 17, 17, 14}}, {'V', {17, 17, 17, 17, 17, 10, 4}}, {'W', {17, 17, 17, 21, 21, 21, 10}},
    {'X', {17, 17, 10, 4, 10, 17, 17}},  {'Y', {17, 17, 10, 4, 4, 4, 4}},    {'Z', {31, 1, 2, 4, 8, 16, 31}},
    {'.', {0, 0, 0, 0, 0, 12, 12}},      {'-', {0, 0, 0, 31, 0, 0, 0}},      {'+', {0, 4, 4, 31, 4, 4, 0}},
    {'=', {0, 0, 31, 0, 31, 0, 0}},      {':', {0, 12, 12, 0, 12, 12, 0}},   {'/', {0, 1, 2, 4, 8, 16, 0}},
    {'(', {2, 4, 8, 8, 8, 4, 2}},        {')', {8, 4, 2, 2, 2, 4, 8}},       {'_', {0, 0, 0, 0, 0, 0, 31}},
    {'%', {24, 25, 2, 4, 8, 19, 3}},     {'<', {2, 4, 8, 16, 8, 4, 2}},      {'>', {8, 4, 2, 1, 2, 4, 8}},
    {',', {0, 0, 0, 0, 12, 4, 8}},
};

const Glyph* FindGlyph(char c) {
  if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  for (const auto& g : kFont)
    if (g.c == c) return &g;
  return nullptr;
}

void Put32(std::vector<uint8_t>& v, uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<uint8_t>(x >> s));
}

void Chunk(std::vector<uint8_t>& out, const char type[4], const std::vector<uint8_t>& data) {
  Put32(out, static_cast<uint32_t>(data.size()));
  const size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  Put32(out, Crc32(out.data() + start, out.size() - start));
}

}  // namespace

uint32_t Crc32(const uint8_t* data, size_t n, uint32_t crc) {
  static uint32_t table[256];
  static bool init = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    return true;
  }();
  (void)init;
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t Adler32(const uint8_t* data, size_t n) {
  uint32_t a = 1, b = 0;
  for (size_t i = 0; i < n; ++i) {
    a = (a + data[i]) % 65521u;
    b = (b + a) % 65521u;
  }
  return (b << 16) | a;
}

Canvas::Canvas(int32_t width, int32_t height, Rgb bg)
    : width_(std::max(width, 1)), height_(std::max(height, 1)), rgb_(Z(width_) * Z(height_) * 3) {
  for (size_t i = 0; i < rgb_.size(); i += 3) {
    rgb_[i] = bg.r;
    rgb_[i + 1] = bg.g;
    rgb_[i + 2] = bg.b;
  }
}

void Canvas::Set(int32_t x, int32_t y, Rgb c) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  const size_t i = (Z(y) * Z(width_) + Z(x)) * 3;
  rgb_[i] = c.r;
  rgb_[i + 1] = c.g;
  rgb_[i + 2] = c.b;
}

Rgb Canvas::Get(int32_t x, int32_t y) const {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return {};
  const size_t i = (Z(y) * Z(width_) + Z(x)) * 3;
  return {rgb_[i], rgb_[i + 1], rgb_[i + 2]};
}

void Canvas::Line(int32_t x0, int32_t y0, int32_t x1, int32_t y1, Rgb c) {
  const int32_t dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
  const int32_t sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
  int32_t err = dx + dy;
  while (true) {
    Set(x0, y0, c);
    if (x0 == x1 && y0 == y1) break;
    const int32_t e2 = 2 * err;
    if (e2 >= dy) {
      err += dy;
      x0 += sx;
    }
    if (e2 <= dx) {
      err += dx;
      y0 += sy;
    }
  }
}

void Canvas::FillRect(int32_t x0, int32_t y0, int32_t x1, int32_t y1, Rgb c) {
  for (int32_t y = std::min(y0, y1); y <= std::max(y0, y1); ++y)
    for (int32_t x = std::min(x0, x1); x <= std::max(x0, x1); ++x) Set(x, y, c);
}

void Canvas::Rect(int32_t x0, int32_t y0, int32_t x1, int32_t y1, Rgb c) {
  Line(x0, y0, x1, y0, c);
  Line(x1, y0, x1, y1, c);
  Line(x1, y1, x0, y1, c);
  Line(x0, y1, x0, y0, c);
}

void Canvas::Text(int32_t x, int32_t y, const std::string& s, Rgb c, int32_t scale) {
  for (size_t k = 0; k < s.size(); ++k) {
    const Glyph* g = FindGlyph(s[k]);
    if (!g) continue;
    const int32_t gx = x + static_cast<int32_t>(k) * 6 * scale;
    for (int32_t row = 0; row < 7; ++row)
      for (int32_t col = 0; col < 5; ++col)
        if (g->rows[row] & (1u << (4 - col))) FillRect(gx + col * scale, y + row * scale, gx + col * scale + scale - 1, y + row * scale + scale - 1, c);
  }
}

std::vector<uint8_t> Canvas::EncodePng() const {
  std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> ihdr;
  Put32(ihdr, static_cast<uint32_t>(width_));
  Put32(ihdr, static_cast<uint32_t>(height_));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit, RGB, deflate, adaptive filter, no interlace
  Chunk(out, "IHDR", ihdr);
  // Raw scanlines: filter byte 0 then the row.
  std::vector<uint8_t> raw;
  const size_t row = Z(width_) * 3;
  raw.reserve((row + 1) * Z(height_));
  for (int32_t y = 0; y < height_; ++y) {
    raw.push_back(0);
    raw.insert(raw.end(), rgb_.begin() + static_cast<std::ptrdiff_t>(Z(y) * row),
               rgb_.begin() + static_cast<std::ptrdiff_t>(Z(y + 1) * row));
  }
  // zlib: CMF/FLG (deflate, 32K window, no dictionary, check bits), stored blocks of <= 65535 bytes.
  std::vector<uint8_t> z = {0x78, 0x01};
  size_t pos = 0;
  do {
    const size_t n = std::min<size_t>(65535, raw.size() - pos);
    const bool last = pos + n == raw.size();
    z.push_back(last ? 1 : 0);
    z.push_back(static_cast<uint8_t>(n & 0xFF));
    z.push_back(static_cast<uint8_t>(n >> 8));
    z.push_back(static_cast<uint8_t>(~n & 0xFF));
    z.push_back(static_cast<uint8_t>((~n >> 8) & 0xFF));
    z.insert(z.end(), raw.begin() + static_cast<std::ptrdiff_t>(pos), raw.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
  } while (pos < raw.size());
  Put32(z, Adler32(raw.data(), raw.size()));
  Chunk(out, "IDAT", z);
  Chunk(out, "IEND", {});
  return out;
}

Status Canvas::WritePng(const std::string& path) const {
  const auto bytes = EncodePng();
  std::ofstream f(path, std::ios::binary);
  if (!f) return InvalidArgument("png: cannot open '" + path + "' for writing");
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) return InvalidArgument("png: write to '" + path + "' failed");
  return Status::Ok();
}

Status WriteBoxPlotPng(const std::string& path, const std::string& title, const std::vector<std::string>& names,
                       const std::vector<std::vector<double>>& series) {
  if (names.size() != series.size() || series.empty()) return InvalidArgument("box plot: need one name per series");
  double lo = 1e300, hi = -1e300;
  for (const auto& s : series)
    for (double v : s) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  if (lo > hi) {
    lo = 0;
    hi = 1;
  }
  // Nice tick step: 1, 2 or 5 times a power of ten, about 8 ticks.
  double span = std::max(hi - lo, 1e-6);
  const double raw_step = span / 8;
  const double p10 = std::pow(10.0, std::floor(std::log10(raw_step)));
  double step = p10;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p10 >= raw_step) {
      step = m * p10;
      break;
    }
  lo = std::floor(lo / step) * step;
  hi = std::ceil(hi / step) * step;
  if (hi <= lo) hi = lo + step;
  const int32_t col_w = 130, left = 80, right = 30, top = 40, bottom = 50, plot_h = 420;
  const int32_t W = std::max(left + right + col_w * static_cast<int32_t>(series.size()),
                             left + Canvas::TextWidth(title, 2) + 20);
  const int32_t H = top + plot_h + bottom;
  Canvas c(W, H);
  const Rgb black{0, 0, 0}, grey{220, 220, 220}, dark{90, 90, 90};
  const Rgb palette[] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44}, {214, 39, 40}, {148, 103, 189}, {140, 86, 75}};
  auto ypix = [&](double v) { return top + plot_h - static_cast<int32_t>(std::lround((v - lo) / (hi - lo) * plot_h)); };
  c.Text(left, 14, title, black, 2);
  for (double t = lo; t <= hi + step * 1e-6; t += step) {
    const int32_t y = ypix(t);
    c.Line(left, y, W - right, y, grey);
    c.Line(left - 5, y, left, y, black);
    char buf[32];
    std::snprintf(buf, sizeof(buf), step < 0.01 ? "%.3f" : "%.2f", t);
    c.Text(left - 8 - Canvas::TextWidth(buf), y - 3, buf, black);
  }
  c.Line(left, top, left, top + plot_h, black);
  c.Line(left, top + plot_h, W - right, top + plot_h, black);
  Rng rng(7);
  for (size_t k = 0; k < series.size(); ++k) {
    const Rgb col = palette[k % 6];
    const int32_t cx = left + col_w * static_cast<int32_t>(k) + col_w / 2;
    const auto& s = series[k];
    c.Text(cx - Canvas::TextWidth(names[k]) / 2, top + plot_h + 12, names[k], black);
    c.Line(cx, top + plot_h, cx, top + plot_h + 5, black);
    if (s.empty()) continue;
    const Summary sm = Summarize(s);
    const double q1 = Percentile(s, 25), q3 = Percentile(s, 75);
    for (double v : s) {  // strip, jittered
      const int32_t x = cx + 30 + static_cast<int32_t>(rng.below(30));
      c.Set(x, ypix(v), col);
      c.Set(x + 1, ypix(v), col);
    }
    c.Line(cx, ypix(sm.min), cx, ypix(q1), dark);
    c.Line(cx, ypix(q3), cx, ypix(sm.max), dark);
    c.Line(cx - 10, ypix(sm.min), cx + 10, ypix(sm.min), dark);
    c.Line(cx - 10, ypix(sm.max), cx + 10, ypix(sm.max), dark);
    c.FillRect(cx - 22, ypix(q3), cx + 22, ypix(q1), col);
    c.Rect(cx - 22, ypix(q3), cx + 22, ypix(q1), black);
    c.Line(cx - 22, ypix(sm.p50), cx + 22, ypix(sm.p50), black);
    c.FillRect(cx - 2, ypix(sm.mean) - 2, cx + 2, ypix(sm.mean) + 2, black);
  }
  return c.WritePng(path);
}

}  // namespace rdep
