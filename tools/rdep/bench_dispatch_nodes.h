// `rdep bench dispatch --nodes N`: the two-phase exchange per phase per rank (bench_dispatch_nodes.cc).
#pragma once

#include "cli.h"

namespace rdep::bench {

// Runs the --nodes form of `rdep bench dispatch` (host or CUDA backend); the exit code.
int RunDispatchNodesBench(const cli::Args& args);

}  // namespace rdep::bench
