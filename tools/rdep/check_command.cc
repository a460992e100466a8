// `rdep check`: the validation matrix (smoke, dispatch invariants, forward and gradient parity,
// finite values, segment invariance) for one configuration. Exits 0 only if every check passes.
//   rdep check --backend host --ranks 4 --tokens 256 --hidden 256 --experts 32 --topk 4 --json out.json
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

#include "cli.h"
#include "rdep/cuda/device_count.h"
#include "rdep/layer/cuda_validation.h"
#include "rdep/layer/validation.h"
#include "rdep/transport/bootstrap.h"

namespace {

constexpr const char* kHelp = R"(usage: rdep check [flags]

Runs the validation matrix of the RDEP paper (seeds 000), Table 18, for one configuration and prints a
table; exits 0 if every check passes, 1 if one fails, 2 on bad input (the message names the flag).
  smoke                  domain bootstrap, peer-visible stores, phase barrier
  dispatch invariants    sentinel payloads: each accepted row lands once at its owner's local expert and
                         returns to its own front-end slot; accepted set = the documented capacity rule;
                         rows at owners + dropped = routed rows
  forward parity         y vs the double-precision reference MoE operator
  gradient parity        dx, dgate, dW1, dW2 vs the reference
  finite outputs         every output and gradient finite on every rank
  segment invariance     results bitwise equal with a different segment size S

flags (defaults in brackets):
  --backend B            host | cuda | auto: cuda when this build has CUDA and the machine has a GPU,
                         else host [auto]
  --gpus N               cuda, one process: ranks round-robin over N local GPUs [min(W, GPUs)];
                         N < W: ranks share GPUs (stream-join barriers; the placement is printed)
  --bootstrap B          cuda backend: process (one process drives all W GPUs) or mpi (one process per
                         GPU under mpirun: W = the MPI world size; CUDA IPC or fabric handles)
                         [mpi when launched by mpirun, else process]
  --ranks W              ranks in the domain [4]; the host backend runs at most 4096
  --tokens T             tokens per rank [64]
  --hidden H             hidden size [64]
  --ffn F                expert intermediate size D_ff [128]
  --experts E            experts [16]
  --topk K               experts per token [4]
  --routing R            uniform | zipf:ALPHA | one-expert | sparse [uniform]
  --empty-rank R         give rank R (0 <= R < W) zero tokens [none]
  --capacity-factor C    0 = dropless; else each expert admits ceil(C*W*T*K/E) rows [0]
  --segment S            token rows per owner per segment; 0 = T [0]
  --seed N               seed for routing, weights and activations [1]
  --timeout SECONDS      bound on every barrier wait [30]
  --json FILE            write a JSON receipt (configuration and each check's result); FILE is opened
                         before the run, so a bad path fails at once
  --max-memory-gib G     refuse a configuration whose estimated host memory exceeds G GiB
                         [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]
  --max-gop N            refuse a configuration whose estimated work exceeds N * 10^9 operations
                         [$RDEP_MAX_GOP, else 2000]
  -h, --help             this page

Before allocating anything the command estimates the run's host memory (and, on the cuda backend,
each GPU's) and its work from the flags, and refuses (exit 2) what exceeds the limits, naming the
flags of the largest part.
)";

#if defined(RDEP_HAVE_CUDA)
// The smallest total memory of the first `ranks` GPUs (0 if none can be queried).
double SmallestGpuBytes(int64_t ranks) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
    cudaGetLastError();
    return 0;
  }
  double smallest = 0;
  for (int d = 0; d < n && d < ranks; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    const auto b = static_cast<double>(p.totalGlobalMem);
    if (smallest == 0 || b < smallest) smallest = b;
  }
  return smallest;
}
#else
double SmallestGpuBytes(int64_t) { return 0; }
#endif

int RunCheck(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  rdep::cli::Flags f(args);
  rdep::ValidationOptions o;
  std::string backend = f.get_string("backend", "auto");
  std::string bootstrap = f.get_string("bootstrap", rdep::LaunchedUnderMpi() ? "mpi" : "process");
  const bool ranks_given = f.has("ranks");
  const bool gpus_given = f.has("gpus");
  const int64_t gpus = f.get_int("gpus", 0);
  auto& s = o.layer.shape;
  s.ranks = f.get_int("ranks", 4);
  s.tokens = f.get_int("tokens", 64);
  s.hidden = f.get_int("hidden", 64);
  s.ffn = f.get_int("ffn", 128);
  s.experts = f.get_int("experts", 16);
  s.topk = f.get_int("topk", 4);
  const std::string routing = f.get_string("routing", "uniform");
  const int64_t empty_rank = f.get_int("empty-rank", -1);
  o.layer.capacity.capacity_factor = f.get_double("capacity-factor", 0.0);
  o.layer.segment_tokens = f.get_int("segment", 0);
  const int64_t seed = f.get_int("seed", 1);
  o.barrier_timeout_s = f.get_double("timeout", 30.0);
  const std::string json = f.get_string("json", "");
  auto limits = rdep::cli::ReadLimits(f);
  if (rdep::Status st = f.Finish(); !st.ok()) {
    std::cerr << "rdep check: " << st.message() << "\n(see rdep check --help)\n";
    return 2;
  }
  if (!f.positional().empty()) {
    std::cerr << "rdep check: unexpected argument '" << f.positional().front() << "'\n(see rdep check --help)\n";
    return 2;
  }
  if (!limits.ok()) {
    std::cerr << "rdep check: " << limits.status().message() << "\n";
    return 2;
  }
  if (!std::isfinite(o.barrier_timeout_s) || !(o.barrier_timeout_s > 0)) {
    std::cerr << "rdep check: --timeout must be a finite number of seconds > 0\n";
    return 2;
  }
  std::unique_ptr<rdep::Bootstrap> boot;
  if (bootstrap == "mpi") {
    auto b = rdep::MakeMpiBootstrap();
    if (!b.ok()) {
      std::cerr << "rdep check: --bootstrap mpi: " << b.status().message() << "\n";
      return 2;
    }
    boot = std::move(*b);
    if (ranks_given && s.ranks != boot->size()) {
      std::cerr << "rdep check: --ranks " << s.ranks << " but the MPI world has " << boot->size() << " processes\n";
      return 2;
    }
    s.ranks = boot->size();
    if (backend == "auto") backend = "cuda";
  } else if (bootstrap != "process") {
    std::cerr << "rdep check: unknown bootstrap '" << bootstrap << "' (process, mpi)\n";
    return 2;
  }
  if (backend == "auto") backend = rdep::CudaDeviceCount() > 0 ? "cuda" : "host";
  if (gpus_given && (backend != "cuda" || boot)) {
    std::cerr << "rdep check: --gpus places the ranks of one process on GPUs: it needs --backend cuda without --bootstrap mpi\n";
    return 2;
  }
  if (gpus_given && (gpus < 1 || gpus > rdep::CudaDeviceCount())) {
    std::cerr << "rdep check: --gpus must be in [1, " << rdep::CudaDeviceCount() << "] on this machine, got " << gpus << "\n";
    return 2;
  }
  if (boot && backend != "cuda") {
    std::cerr << "rdep check: --bootstrap mpi needs --backend cuda\n";
    return 2;
  }
  const bool leader = !boot || boot->rank() == 0;  // prints the table and writes the receipt
  if (backend != "host" && backend != "cuda") {
    std::cerr << "rdep check: unknown backend '" << backend << "' (host, cuda, auto)\n";
    return 2;
  }
  auto spec = rdep::RoutingSpec::Parse(routing);
  if (!spec.ok()) {
    std::cerr << "rdep check: --routing: " << spec.status().message() << "\n";
    return 2;
  }
  o.routing = *spec;
  o.routing.seed = static_cast<uint64_t>(seed);
  o.routing.empty_rank = empty_rank;
  o.seed = static_cast<uint64_t>(seed);
  if (rdep::Status st = o.layer.Validate(); !st.ok()) {
    std::cerr << "rdep check: " << st.message() << "\n";
    return 2;
  }
  if (f.has("empty-rank") && (empty_rank < 0 || empty_rank >= s.ranks)) {
    std::cerr << "rdep check: --empty-rank must be a rank in [0, W=" << s.ranks << "), got " << empty_rank << "\n";
    return 2;
  }
  if (backend == "host" && s.ranks > 4096) {
    std::cerr << "rdep check: --ranks " << s.ranks << ": the host backend runs at most 4096 ranks (threads)\n";
    return 2;
  }
  // Estimate before allocating: refuse what would exhaust memory or run for hours. On the cuda backend
  // in one process, ranks placed on the same GPU (--gpus N < W) add up on it.
  rdep::Footprint footprint = rdep::EstimateValidationFootprint(o, backend == "cuda");
  if (backend == "cuda") {
    const int64_t used = boot ? s.ranks : (gpus_given ? gpus : std::min<int64_t>(s.ranks, rdep::CudaDeviceCount()));
    const double per_gpu = boot ? 1.0 : std::ceil(static_cast<double>(s.ranks) / static_cast<double>(std::max<int64_t>(used, 1)));
    if (per_gpu > 1)
      for (auto& term : footprint.device) {
        term.amount *= per_gpu;
        term.what += " x " + std::to_string(static_cast<int64_t>(per_gpu)) + " ranks per GPU";
        term.factors.push_back({"gpus", static_cast<double>(used)});
      }
    limits->device_bytes = SmallestGpuBytes(used);
  }
  if (rdep::Status st = rdep::cli::CheckFootprint(footprint, *limits); !st.ok()) {
    std::cerr << "rdep check: " << st.message() << "\n";
    return 2;
  }
  if (leader) {
    if (rdep::Status st = rdep::cli::CheckOutputPath("json", json); !st.ok()) {
      std::cerr << "rdep check: " << st.message() << "\n";
      return 2;
    }
  }

  if (leader) {
    std::cout << "rdep check: backend " << backend << ", " << o.layer << ", routing " << o.routing.name();
    if (empty_rank >= 0) std::cout << " (rank " << empty_rank << " empty)";
    std::cout << ", seed " << seed << std::endl;
  }
  rdep::StatusOr<std::unique_ptr<rdep::ValidationBackend>> be =
      boot ? rdep::MakeCudaMultiProcessBackend(*boot, o.barrier_timeout_s)
           : (backend == "cuda" ? rdep::MakeCudaBackend(s.ranks, o.barrier_timeout_s, static_cast<int>(gpus)) : rdep::MakeHostBackend(s.ranks, o.barrier_timeout_s));
  if (!be.ok()) {
    std::cerr << "rdep check: backend " << backend << ": " << be.status().message() << "\n";
    return 2;
  }
  auto rep = rdep::RunValidation(o, **be);
  if (!rep.ok()) {
    std::cerr << "rdep check: " << rep.status().message() << "\n";
    return 2;
  }
  if (!leader) return rep->passed() ? 0 : 1;  // every process evaluated the same gathered results
  std::printf("  transport: %s\n", rep->transport.c_str());
  std::printf("  %-30s %-6s %9s  %s\n", "check", "result", "seconds", "detail");
  for (const auto& c : rep->checks)
    std::printf("  %-30s %-6s %9.3f  %s\n", c.name.c_str(), c.skipped ? "skip" : (c.passed ? "PASS" : "FAIL"), c.seconds,
                c.detail.c_str());
  if (rep->symmetric_bytes_per_rank > 0)  // only a completed dispatch run measured them
    std::printf("  symmetric buffers per rank: %.3f MiB (S=%lld)\n",
                static_cast<double>(rep->symmetric_bytes_per_rank) / (1024.0 * 1024.0),
                static_cast<long long>(rep->segment_size));
  int passed = 0, failed = 0;
  for (const auto& c : rep->checks) (c.passed ? passed : failed) += c.skipped ? 0 : 1;
  std::printf("%d passed, %d failed\n", passed, failed);
  if (!json.empty()) {
    errno = 0;
    std::ofstream out(json);
    out << rep->ToJson(o) << "\n";
    out.flush();
    if (!out) {
      std::cerr << "rdep check: --json " << json << ": write failed: " << std::strerror(errno) << "\n";
      return 2;
    }
  }
  return rep->passed() ? 0 : 1;
}

const bool kRegistered = rdep::cli::Register({"check", "run the validation matrix for one configuration", &RunCheck});

}  // namespace
