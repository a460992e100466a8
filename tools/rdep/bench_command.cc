// `rdep bench <what>`: benchmarks that follow DESIGN.md's measurement protocol (max-rank p50/p99,
// useful TFLOPS without padding, baseline in the same run, JSON receipts). Each <what> registers from
// its own tools/rdep/bench_NAME_command.cc.
#include <iostream>

#include "cli.h"

namespace {

int RunBench(const rdep::cli::Args& args) {
  const auto& reg = rdep::cli::BenchRegistry();
  if (args.empty() || args.front() == "--help" || args.front() == "help") {
    std::cout << "usage: rdep bench <what> [flags]\n\n";
    for (const auto& [name, cmd] : reg) std::cout << "  " << name << "\t" << cmd.summary << "\n";
    if (reg.empty()) std::cout << "  (no benchmarks in this build: they need the CUDA backend)\n";
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
