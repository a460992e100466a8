#include "cli.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>

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

bool WantsHelp(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

double PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

std::string FormatBytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  std::ostringstream os;
  if (u >= 6 && bytes >= 1024) os << std::setprecision(3) << bytes;  // beyond EiB: 1.2e+06 EiB
  else os << std::fixed << std::setprecision(bytes < 10 ? 2 : (bytes < 100 ? 1 : 0)) << bytes;
  os << " " << kUnits[u];
  return os.str();
}

namespace {

// A limit from --flag, else $env, else the default; must be a finite number > 0.
Status ReadLimit(Flags& f, const std::string& flag, const char* env, double def, const std::string& def_source,
                 double* value, std::string* source) {
  if (f.has(flag)) {
    const double v = f.get_double(flag, def);
    if (!(std::isfinite(v) && v > 0)) return InvalidArgument("--" + flag + " must be a finite number > 0, got '" + f.get_string(flag, "") + "'");
    *value = v;
    *source = "--" + flag;
    return Status::Ok();
  }
  f.get_double(flag, def);  // mark as known
  if (const char* e = std::getenv(env); e && *e) {
    char* end = nullptr;
    const double v = std::strtod(e, &end);
    if (*end != '\0' || !(std::isfinite(v) && v > 0))
      return InvalidArgument(std::string(env) + "='" + e + "' must be a finite number > 0");
    *value = v;
    *source = std::string("$") + env;
    return Status::Ok();
  }
  *value = def;
  *source = def_source;
  return Status::Ok();
}

std::string Factors(const FootprintTerm& t) {
  std::ostringstream os;
  for (size_t i = 0; i < t.factors.size(); ++i) {
    if (i) os << " x ";
    // A shape field is a flag ("--experts 16"); a name with a space is not ("trace experts 16").
    if (t.factors[i].first.find(' ') == std::string::npos) os << "--";
    os << t.factors[i].first << " " << std::setprecision(12) << t.factors[i].second;
  }
  return os.str();
}

std::string Largest(const std::vector<FootprintTerm>& terms, bool bytes) {
  const FootprintTerm* t = Footprint::Largest(terms);
  if (!t) return "";
  std::ostringstream os;
  os << "; the largest part is " << t->what << ": ";
  if (bytes) os << FormatBytes(t->amount);
  else os << std::setprecision(3) << t->amount << " operations";
  if (!t->factors.empty()) os << ", from " << Factors(*t);
  return os.str();
}

}  // namespace

StatusOr<Limits> ReadLimits(Flags& f) {
  Limits l;
  const double phys = PhysicalMemoryBytes();
  const double gib = 1024.0 * 1024.0 * 1024.0;
  double mem_gib = 0, gop = 0;
  const std::string mem_default =
      phys > 0 ? "the default, 3/4 of this machine's " + FormatBytes(phys) + " of physical memory" : "the default, 16 GiB (physical memory unknown)";
  RDEP_RETURN_IF_ERROR(ReadLimit(f, "max-memory-gib", "RDEP_MAX_MEMORY_GIB", phys > 0 ? kDefaultMemoryFraction * phys / gib : 16.0,
                                 mem_default, &mem_gib, &l.host_source));
  RDEP_RETURN_IF_ERROR(ReadLimit(f, "max-gop", "RDEP_MAX_GOP", kDefaultMaxGop, "the default, 2*10^12 operations: ten minutes to hours on a CPU", &gop,
                                 &l.operations_source));
  l.host_bytes = mem_gib * gib;
  l.operations = gop * 1e9;
  return l;
}

Status CheckFootprint(const Footprint& fp, const Limits& l) {
  const double host = fp.host_bytes();
  if (!(host <= l.host_bytes)) {
    std::ostringstream os;
    os << "this run needs about " << FormatBytes(host) << " of host memory, more than the limit of " << FormatBytes(l.host_bytes)
       << " (" << l.host_source << "; raise it with --max-memory-gib G or RDEP_MAX_MEMORY_GIB)" << Largest(fp.host, true);
    return InvalidArgument(os.str());
  }
  const double device = fp.device_bytes();
  if (l.device_bytes > 0 && !(device <= l.device_bytes)) {
    std::ostringstream os;
    os << "this run needs about " << FormatBytes(device) << " of memory on each GPU, more than the GPU's "
       << FormatBytes(l.device_bytes) << Largest(fp.device, true);
    return InvalidArgument(os.str());
  }
  const double ops = fp.operations();
  if (!(ops <= l.operations)) {
    std::ostringstream os;
    os << std::setprecision(3) << "this run would do about " << ops << " operations, more than the limit of " << l.operations
       << " (" << l.operations_source << "; raise it with --max-gop N, in 10^9 operations, or RDEP_MAX_GOP)"
       << Largest(fp.work, false);
    return InvalidArgument(os.str());
  }
  return Status::Ok();
}

Status CheckOutputPath(const std::string& flag, const std::string& path) {
  if (path.empty()) return Status::Ok();
  const bool existed = access(path.c_str(), F_OK) == 0;
  errno = 0;
  std::FILE* fp = std::fopen(path.c_str(), "a");
  if (!fp) {
    const int err = errno;
    return InvalidArgument("--" + flag + " " + path + ": cannot open for writing: " + std::strerror(err));
  }
  std::fclose(fp);
  if (!existed) std::remove(path.c_str());
  return Status::Ok();
}

}  // namespace rdep::cli
