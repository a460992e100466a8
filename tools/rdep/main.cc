// rdep: the command. `rdep` alone runs the main job for this machine: on a machine without a GPU,
// `rdep check --backend host` at a small default shape. `rdep help` lists the subcommands.
#include <iostream>

#include "cli.h"

namespace {

int Help() {
  std::cout << "usage: rdep <command> [flags]\n\ncommands:\n";
  for (const auto& [name, cmd] : rdep::cli::Registry()) std::cout << "  " << name << "\t" << cmd.summary << "\n";
  std::cout << "\n`rdep <command> --help` describes a command's flags. `rdep` alone runs `rdep check` with its defaults.\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  rdep::cli::Args args(argv + 1, argv + argc);
  const auto& registry = rdep::cli::Registry();
  if (args.empty()) {
    auto it = registry.find("check");
    if (it == registry.end()) return Help();
    return it->second.run({});
  }
  const std::string name = args.front();
  if (name == "help" || name == "--help" || name == "-h") return Help();
  auto it = registry.find(name);
  if (it == registry.end()) {
    std::cerr << "rdep: unknown command '" << name << "'\n";
    Help();
    return 2;
  }
  args.erase(args.begin());
  return it->second.run(args);
}
