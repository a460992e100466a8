#include "rdep/core/json.h"

#include <cmath>
#include <cstdio>

namespace rdep {

std::string JsonEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\t': o += "\\t"; break;
      case '\r': o += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          o += buf;
        } else {
          o += c;
        }
    }
  }
  return o;
}

void JsonWriter::comma() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!first_.empty()) {
    if (!first_.back()) out_ += ",";
    first_.back() = false;
  }
}

JsonWriter& JsonWriter::begin_object() { comma(); out_ += "{"; first_.push_back(true); return *this; }
JsonWriter& JsonWriter::end_object() { out_ += "}"; first_.pop_back(); return *this; }
JsonWriter& JsonWriter::begin_array() { comma(); out_ += "["; first_.push_back(true); return *this; }
JsonWriter& JsonWriter::end_array() { out_ += "]"; first_.pop_back(); return *this; }
JsonWriter& JsonWriter::key(const std::string& k) {
  comma();
  out_ += '"';  // appended piecewise: GCC 12's -Wrestrict misfires on "..." + std::string&&
  out_ += JsonEscape(k);
  out_ += "\":";
  after_key_ = true;
  return *this;
}
JsonWriter& JsonWriter::value(const std::string& v) {
  comma();
  out_ += '"';
  out_ += JsonEscape(v);
  out_ += '"';
  return *this;
}
JsonWriter& JsonWriter::value(double v) {
  comma();
  if (!std::isfinite(v)) { out_ += "null"; return *this; }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  out_ += buf;
  return *this;
}
JsonWriter& JsonWriter::value(int64_t v) { comma(); out_ += std::to_string(v); return *this; }
JsonWriter& JsonWriter::value(bool v) { comma(); out_ += v ? "true" : "false"; return *this; }
JsonWriter& JsonWriter::value(const std::vector<double>& v) {
  begin_array();
  for (double x : v) value(x);
  return end_array();
}

}  // namespace rdep
