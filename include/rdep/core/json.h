// A minimal JSON writer for receipts (`rdep check --json`, `rdep bench --json`): objects, arrays,
// strings (escaped), numbers (non-finite written as null), booleans. No parsing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rdep {

class JsonWriter {
 public:
  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  JsonWriter& key(const std::string& k);
  JsonWriter& value(const std::string& v);
  JsonWriter& value(const char* v) { return value(std::string(v)); }
  JsonWriter& value(double v);
  JsonWriter& value(int64_t v);
  JsonWriter& value(int v) { return value(static_cast<int64_t>(v)); }
  JsonWriter& value(bool v);
  JsonWriter& value(const std::vector<double>& v);
  template <typename T>
  JsonWriter& field(const std::string& k, const T& v) { return key(k).value(v); }
  const std::string& str() const { return out_; }

 private:
  void comma();
  std::string out_;
  std::vector<bool> first_;  // per open container: no element written yet
  bool after_key_ = false;
};

std::string JsonEscape(const std::string& s);

}  // namespace rdep
