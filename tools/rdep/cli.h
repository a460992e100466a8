// Command-line plumbing shared by the rdep subcommands: a registry of subcommands and a small flag
// parser that rejects unknown flags and malformed values with a message naming the flag.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

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
