// rdep: the command. `rdep` alone runs the main job for this machine: on a machine without a GPU,
// `rdep check --backend host` at a small default shape. `rdep help` lists the subcommands;
// `rdep help <command> [<subcommand>]`, `rdep <command> --help` and `-h` print one command's page,
// which starts with its usage line.
#include <exception>
#include <iostream>
#include <new>
#include <stdexcept>

#include "cli.h"

namespace {

int Help(std::ostream& os) {
  os << "usage: rdep <command> [flags]\n\ncommands:\n";
  for (const auto& [name, cmd] : rdep::cli::Registry()) os << "  " << name << "\t" << cmd.summary << "\n";
  os << "\n`rdep help <command>` or `rdep <command> --help` (-h) describes a command's flags. `rdep` alone runs\n"
        "`rdep check` with its defaults. Every command estimates its memory and work before allocating and\n"
        "refuses (exit 2) what exceeds --max-memory-gib / --max-gop (defaults: 3/4 of physical memory,\n"
        "2000 * 10^9 operations; also $RDEP_MAX_MEMORY_GIB, $RDEP_MAX_GOP). Exit codes: 0 success, 1 a\n"
        "check or run failed, 2 bad input or a refused size.\n";
  return 0;
}

int Run(rdep::cli::Args args) {
  const auto& registry = rdep::cli::Registry();
  if (args.empty()) {
    auto it = registry.find("check");
    if (it == registry.end()) return Help(std::cout);
    return it->second.run({});
  }
  // One help convention: -h is --help everywhere.
  for (auto& a : args)
    if (a == "-h") a = "--help";
  std::string name = args.front();
  if (name == "--help") return Help(std::cout);
  if (name == "help") {  // `rdep help check` is `rdep check --help`; `rdep help plan sim` is `rdep plan sim --help`
    if (args.size() == 1) return Help(std::cout);
    args.erase(args.begin());
    name = args.front();
    args.push_back("--help");
  }
  auto it = registry.find(name);
  if (it == registry.end()) {
    std::cerr << "rdep: unknown command '" << name << "'\n";
    Help(std::cerr);
    return 2;
  }
  args.erase(args.begin());
  return it->second.run(args);
}

}  // namespace

int main(int argc, char** argv) {
  // The last line of defense: every command estimates its footprint before allocating, so these
  // should not happen; if one does, it is an exit 2 with a message, not an abort.
  try {
    return Run(rdep::cli::Args(argv + 1, argv + argc));
  } catch (const std::bad_alloc&) {
    std::cerr << "rdep: out of memory (std::bad_alloc): the inputs ask for more memory than this machine has; "
                 "reduce the sizes (this is a bug in the command's size estimate: please report the command line)\n";
  } catch (const std::length_error& e) {
    std::cerr << "rdep: a size is too large (std::length_error: " << e.what() << "); reduce the sizes "
                 "(this is a bug in the command's size estimate: please report the command line)\n";
  } catch (const std::exception& e) {
    std::cerr << "rdep: unexpected error: " << e.what() << "\n";
  }
  return 2;
}
