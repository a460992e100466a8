#include "cli.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace rdep::cli {

namespace {
std::map<std::string, Command>& MutableRegistry() {
  static std::map<std::string, Command> registry;
  return registry;
}
}  // namespace

bool Register(Command command) {
  const std::string name = command.name;
  MutableRegistry()[name] = std::move(command);
  return true;
}

const std::map<std::string, Command>& Registry() { return MutableRegistry(); }

namespace {
std::map<std::string, Command>& MutableBenchRegistry() {
  static std::map<std::string, Command> registry;
  return registry;
}
}  // namespace

bool RegisterBench(Command command) {
  const std::string name = command.name;
  MutableBenchRegistry()[name] = std::move(command);
  return true;
}

const std::map<std::string, Command>& BenchRegistry() { return MutableBenchRegistry(); }

Flags::Flags(const Args& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      positional_.push_back(a);
      continue;
    }
    const auto eq = a.find('=');
    if (eq != std::string::npos) {
      values_[a.substr(2, eq - 2)] = a.substr(eq + 1);
    } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
      values_[a.substr(2)] = args[++i];
    } else {
      values_[a.substr(2)] = "";  // a bare switch
    }
  }
}

bool Flags::has(const std::string& name) const { return values_.count(name) != 0; }

std::string Flags::get_string(const std::string& name, const std::string& def) {
  used_[name] = true;
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  if (it->second.empty() && error_.ok()) error_ = InvalidArgument("flag --" + name + " needs a value");
  return it->second;
}

int64_t Flags::get_int(const std::string& name, int64_t def) {
  const std::string s = get_string(name, "");
  if (!has(name) || s.empty()) return def;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (*end != '\0' || errno != 0) {
    if (error_.ok()) error_ = InvalidArgument("flag --" + name + " expects an integer, got '" + s + "'");
    return def;
  }
  return v;
}

double Flags::get_double(const std::string& name, double def) {
  const std::string s = get_string(name, "");
  if (!has(name) || s.empty()) return def;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (*end != '\0') {
    if (error_.ok()) error_ = InvalidArgument("flag --" + name + " expects a number, got '" + s + "'");
    return def;
  }
  return v;
}

bool Flags::get_bool(const std::string& name) {
  used_[name] = true;
  auto it = values_.find(name);
  if (it == values_.end()) return false;
  if (it->second.empty() || it->second == "true" || it->second == "1") return true;
  if (it->second == "false" || it->second == "0") return false;
  // "--flag value" consumed a positional: treat as set and keep the value positional.
  positional_.push_back(it->second);
  it->second.clear();
  return true;
}

Status Flags::Finish() const {
  if (!error_.ok()) return error_;
  for (const auto& [name, value] : values_)
    if (!used_.count(name)) return InvalidArgument("unknown flag --" + name);
  return Status::Ok();
}

}  // namespace rdep::cli
