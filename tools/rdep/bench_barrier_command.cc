// `rdep bench barrier`: the host backend's phase barrier at width W (W ranks as threads of this
// process), the cost every segment of the protocol pays a few times. The RDEP paper (seeds 000),
// section 4.5, budgets 3.6-7.2 us per barrier at W = 72 on GPUs; this measures what the host backend,
// the CI and reference backend, pays on this machine (docs/perf-notes.md records it). Example:
//   rdep bench barrier --ranks 72,512,2048,4096 --iters 200
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <thread>
#include <vector>

#include "cli.h"
#include "rdep/transport/host_domain.h"

namespace {

constexpr const char* kHelp = R"(usage: rdep bench barrier [flags]

The host backend's phase barrier: W ranks (threads of this process) pass --iters barriers back to
back after --warmup; prints the mean time per barrier (wall time of the slowest rank / iters) and
the time to start and join the W rank threads. Runs on any build (no GPU). The RDEP paper (seeds 000),
section 4.5, budgets 3.6-7.2 us per barrier at W = 72 on GPUs.

flags [defaults]:
  --ranks W,W,...     widths to measure, each in [1, 4096] [8,72,512,2048,4096]
  --iters N           barriers timed per width [100]
  --warmup N          barriers before timing [10]
  --timeout SECONDS   bound on every barrier wait [60]
  -h, --help          this page
)";

int RunBarrierBench(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  rdep::cli::Flags f(args);
  auto widths = rdep::cli::ParseList<int64_t>("ranks", f.get_string("ranks", "8,72,512,2048,4096"));
  const int64_t iters = f.get_int("iters", 100), warmup = f.get_int("warmup", 10);
  const double timeout = f.get_double("timeout", 60);
  auto fail = [](const std::string& m) {
    std::cerr << "rdep bench barrier: " << m << "\n(see rdep bench barrier --help)\n";
    return 2;
  };
  if (auto st = f.Finish(); !st.ok()) return fail(st.message());
  if (!f.positional().empty()) return fail("unexpected argument '" + f.positional().front() + "'");
  if (!widths.ok()) return fail(widths.status().message());
  for (int64_t w : *widths)
    if (w < 1 || w > 4096) return fail("--ranks: each width must be in [1, 4096], got " + std::to_string(w));
  if (iters < 1 || iters > 1000000) return fail("--iters must be in [1, 1000000]");
  if (warmup < 0 || warmup > 1000000) return fail("--warmup must be in [0, 1000000]");
  if (!(timeout > 0 && timeout < 1e6)) return fail("--timeout must be in (0, 1e6) seconds");
  std::printf("host barrier (threads of one process, %u hardware threads)\n", std::max(1u, std::thread::hardware_concurrency()));
  std::printf("  %6s %14s %16s\n", "W", "us/barrier", "thread start ms");
  using Clock = std::chrono::steady_clock;
  for (int64_t w : *widths) {
    auto d = rdep::HostDomain::Create(w, {.barrier_timeout_s = timeout});
    if (!d.ok()) return fail(d.status().message());
    // Thread start and join alone: a Run with no barrier.
    const auto s0 = Clock::now();
    if (auto st = (*d)->Run([](int32_t) { return rdep::Status::Ok(); }); !st.ok()) return fail(st.message());
    const double start_ms = std::chrono::duration<double, std::milli>(Clock::now() - s0).count();
    std::vector<double> seconds(static_cast<size_t>(w), 0);
    auto st = (*d)->Run([&](int32_t r) -> rdep::Status {
      for (int64_t i = 0; i < warmup; ++i) RDEP_RETURN_IF_ERROR((*d)->Barrier(r, rdep::Phase::kTest));
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < iters; ++i) RDEP_RETURN_IF_ERROR((*d)->Barrier(r, rdep::Phase::kTest));
      seconds[static_cast<size_t>(r)] = std::chrono::duration<double>(Clock::now() - t0).count();
      return rdep::Status::Ok();
    });
    if (!st.ok()) return fail("W=" + std::to_string(w) + ": " + st.message());
    const double slowest = *std::max_element(seconds.begin(), seconds.end());
    std::printf("  %6lld %14.1f %16.1f\n", static_cast<long long>(w), 1e6 * slowest / static_cast<double>(iters), start_ms);
    std::fflush(stdout);
  }
  return 0;
}

const bool kRegistered = rdep::cli::RegisterBench(
    {"barrier", "the host backend's phase barrier at width W, us per barrier (any build)", &RunBarrierBench});

}  // namespace
