// Pieces of a `rdep bench` JSON receipt that need no CUDA (bench_util.h adds the GPU environment):
// a summary of per-iteration max-rank times and the file write.
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include "rdep/core/json.h"
#include "rdep/core/stats.h"

namespace rdep::bench {

inline void WriteSummary(JsonWriter& j, const std::string& name, const std::vector<double>& ms) {
  const Summary s = Summarize(ms);
  j.key(name).begin_object().field("p50_ms", s.p50).field("p99_ms", s.p99).field("min_ms", s.min).field("max_ms", s.max);
  j.field("mean_ms", s.mean).field("count", s.count).key("per_iteration_ms").value(ms).end_object();
}

inline bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text << "\n";
  return static_cast<bool>(out);
}

}  // namespace rdep::bench
