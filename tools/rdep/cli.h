// Command-line plumbing shared by the rdep subcommands: a registry of subcommands and a small flag
// parser that rejects unknown flags and malformed values with a message naming the flag.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "rdep/core/footprint.h"
#include "rdep/status.h"

namespace rdep::cli {

using Args = std::vector<std::string>;
using CommandFn = std::function<int(const Args& args)>;

struct Command {
  std::string name;
  std::string summary;  // one line for `rdep help`
  CommandFn run;
};

// Subcommands register themselves from their own translation unit:
//   static const bool kRegistered = rdep::cli::Register({"check", "validation matrix", &RunCheck});
bool Register(Command command);
const std::map<std::string, Command>& Registry();

// `rdep bench <name>` subcommands register the same way, from tools/rdep/bench_NAME_command.cc.
bool RegisterBench(Command command);
const std::map<std::string, Command>& BenchRegistry();

// Parses --name VALUE and --name=VALUE flags (and bare --switch for booleans). Positional arguments
// are kept in order. Every lookup marks the flag as known; Finish() reports any flag never looked up.
class Flags {
 public:
  explicit Flags(const Args& args);
  bool has(const std::string& name) const;
  std::string get_string(const std::string& name, const std::string& def);
  int64_t get_int(const std::string& name, int64_t def);
  double get_double(const std::string& name, double def);
  bool get_bool(const std::string& name);  // a bare --name, or --name=true/false
  const std::vector<std::string>& positional() const { return positional_; }
  // The first error seen (unknown flag, bad number, missing value); OK if none.
  Status Finish() const;

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> used_;
  std::vector<std::string> positional_;
  Status error_;
};

// -h or --help anywhere in the arguments.
bool WantsHelp(const Args& args);

// The limits every command checks its estimated footprint against before it allocates anything:
//   host memory  --max-memory-gib G, else $RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory
//   work         --max-gop N (10^9 operations), else $RDEP_MAX_GOP, else 2000 (2*10^12: ten minutes
//                to hours on a 2-core CPU, depending on the shape)
//   device       each GPU's total memory (CUDA runs)
struct Limits {
  double host_bytes = 0;
  std::string host_source;  // how host_bytes was chosen, for messages
  double operations = 0;
  std::string operations_source;
  double device_bytes = 0;  // 0: no device limit known
};
constexpr double kDefaultMaxGop = 2000;
constexpr double kDefaultMemoryFraction = 0.75;
double PhysicalMemoryBytes();  // sysconf; 0 if unknown
// Reads --max-memory-gib and --max-gop (a flag wins over the environment); an error names the flag
// or variable.
StatusOr<Limits> ReadLimits(Flags& f);
// OK when the footprint fits the limits; else InvalidArgument with the estimate, the limit, how to
// raise it, and the largest term with the flags it grows with ("--experts 1024 x --hidden 65536").
Status CheckFootprint(const Footprint& fp, const Limits& limits);
// "1.50 GiB", "12.0 TiB".
std::string FormatBytes(double bytes);

// Opens `path` for writing before the work starts (creating it; existing content is kept, and a file
// this call created is removed again), so a bad --json/--png/--out fails at once, with the OS's reason.
Status CheckOutputPath(const std::string& flag, const std::string& path);

// Parses a comma-separated list of numbers given to --flag ("128,384,768").
template <typename T>
StatusOr<std::vector<T>> ParseList(const std::string& flag, const std::string& text) {
  std::vector<T> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::stringstream is(item);
    T v{};
    if (!(is >> v) || !is.eof()) return InvalidArgument("--" + flag + ": '" + item + "' is not a number");
    out.push_back(v);
  }
  if (out.empty()) return InvalidArgument("--" + flag + ": empty list");
  return out;
}

}  // namespace rdep::cli
