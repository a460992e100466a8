// `rdep bench <what>`: benchmarks that follow DESIGN.md's measurement protocol (max-rank p50/p99,
// useful TFLOPS without padding, baseline in the same run, JSON receipts). Each <what> registers from
// its own tools/rdep/bench_NAME_command.cc.
#include <iostream>

#include "cli.h"

namespace {

int RunBench(const rdep::cli::Args& args) {
  const auto& reg = rdep::cli::BenchRegistry();
  if (args.empty() || args.front() == "--help" || args.front() == "-h" || args.front() == "help") {
    // `rdep bench help layer` is `rdep bench layer --help`.
    if (args.size() > 1 && args.front() == "help") return RunBench({args[1], "--help"});
    std::ostream& os = args.empty() ? std::cerr : std::cout;
    os << "usage: rdep bench <what> [flags]\n\n";
    for (const auto& [name, cmd] : reg) os << "  " << name << "\t" << cmd.summary << "\n";
    os << "\n`rdep bench <what> --help` lists its flags; dispatch, gemm and layer need the CUDA backend.\n";
    return args.empty() ? 2 : 0;
  }
  auto it = reg.find(args.front());
  if (it == reg.end()) {
    std::cerr << "rdep bench: unknown benchmark '" << args.front() << "' (rdep bench help lists them)\n";
    return 2;
  }
  return it->second.run(rdep::cli::Args(args.begin() + 1, args.end()));
}

const bool kRegistered = rdep::cli::Register({"bench", "benchmarks (dispatch, gemm, layer) with receipts", &RunBench});

}  // namespace
