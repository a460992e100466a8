#include "rdep/transport/host_domain.h"

#include <chrono>
#include <cstring>
#include <new>
#include <sstream>
#include <exception>
#include <thread>

namespace rdep {

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kSmoke: return "smoke";
    case Phase::kDispatchCounts: return "dispatch.counts";
    case Phase::kDispatchOffsets: return "dispatch.offsets";
    case Phase::kDispatchSegment: return "dispatch.segment";
    case Phase::kReturnDone: return "return.done";
    case Phase::kBackwardSegment: return "backward.segment";
    case Phase::kBackwardDone: return "backward.done";
    case Phase::kDispatchRoute: return "dispatch.route";
    case Phase::kInterNode: return "inter-node";
    case Phase::kInterNodeDone: return "inter-node.done";
    case Phase::kReplicaRelay: return "replica.relay";
    case Phase::kInterNodeCopy: return "inter-node.copy";
    case Phase::kInterNodeCopyDone: return "inter-node.copy.done";
    case Phase::kReturnStart: return "return.start";
    case Phase::kRowsTaken: return "rows.taken";
    case Phase::kPlanStart: return "plan.start";
    case Phase::kTest: return "test";
  }
  return "unknown";
}

namespace {
constexpr std::align_val_t kAlign{64};
constexpr uint64_t kPhaseMask = 0xFFFF;
}  // namespace

StatusOr<std::unique_ptr<HostDomain>> HostDomain::Create(int64_t num_ranks, DomainOptions options) {
  if (num_ranks < 1 || num_ranks > 4096)
    return InvalidArgument("host domain: ranks W must be in [1, 4096], got " + std::to_string(num_ranks));
  if (!(options.barrier_timeout_s > 0))
    return InvalidArgument("host domain: barrier timeout must be > 0 seconds");
  return std::unique_ptr<HostDomain>(new HostDomain(static_cast<int32_t>(num_ranks), options));
}

HostDomain::HostDomain(int32_t num_ranks, DomainOptions options)
    : num_ranks_(num_ranks),
      options_(options),
      slots_(new std::atomic<uint64_t>[static_cast<size_t>(num_ranks) * static_cast<size_t>(num_ranks)]),
      epoch_(static_cast<size_t>(num_ranks), 0) {
  Reset();
}

HostDomain::~HostDomain() {
  for (auto& r : regions_)
    for (std::byte* p : r.per_rank)
      if (p) ::operator delete[](p, kAlign);
}

void HostDomain::Reset() {
  const size_t n = static_cast<size_t>(num_ranks_) * static_cast<size_t>(num_ranks_);
  for (size_t i = 0; i < n; ++i) slots_[i].store(0, std::memory_order_relaxed);
  std::fill(epoch_.begin(), epoch_.end(), 0);
  failed_rank_.store(-1);
  failure_message_.clear();
  abandoned_.assign(static_cast<size_t>(num_ranks_), 0);
}

StatusOr<RegionId> HostDomain::AllocateSymmetric(size_t bytes, const std::string& name) {
  if (running_) return FailedPrecondition("host domain: AllocateSymmetric(" + name + ") called inside Run");
  Region r;
  r.name = name;
  r.bytes = bytes;
  for (int32_t q = 0; q < num_ranks_; ++q) {
    auto* p = static_cast<std::byte*>(::operator new[](bytes ? bytes : 1, kAlign, std::nothrow));
    if (!p) {
      for (std::byte* done : r.per_rank) ::operator delete[](done, kAlign);
      return Unavailable("host domain: out of memory allocating " + std::to_string(bytes) + " bytes for region " + name);
    }
    std::memset(p, 0, bytes);
    r.per_rank.push_back(p);
  }
  regions_.push_back(std::move(r));
  return static_cast<RegionId>(regions_.size() - 1);
}

void HostDomain::FreeSymmetric(RegionId id) {
  if (running_ || id < 0 || static_cast<size_t>(id) >= regions_.size()) return;
  Region& r = regions_[static_cast<size_t>(id)];
  for (std::byte*& p : r.per_rank) {
    ::operator delete[](p, kAlign);
    p = nullptr;
  }
  r.bytes = 0;
}

std::string HostDomain::placement() const {
  return std::to_string(num_ranks_) + (num_ranks_ == 1 ? " rank" : " ranks") + " as threads of one process";
}

std::vector<int32_t> HostDomain::local_ranks() const {
  std::vector<int32_t> r(static_cast<size_t>(num_ranks_));
  for (int32_t q = 0; q < num_ranks_; ++q) r[static_cast<size_t>(q)] = q;
  return r;
}

std::byte* HostDomain::region(int32_t rank, RegionId id) const {
  return regions_[static_cast<size_t>(id)].per_rank[static_cast<size_t>(rank)];
}

size_t HostDomain::symmetric_bytes_per_rank() const {
  size_t total = 0;
  for (const auto& r : regions_) total += r.bytes;
  return total;
}

std::vector<Status> HostDomain::RunAll(const std::function<Status(int32_t rank)>& fn) {
  Reset();
  running_ = true;
  std::vector<Status> status(static_cast<size_t>(num_ranks_));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(num_ranks_));
  for (int32_t r = 0; r < num_ranks_; ++r) {
    threads.emplace_back([&, r] {
      Status s;
      try {
        s = fn(r);
      } catch (const std::exception& e) {  // an exception must not end the process from a worker thread
        s = InternalError(std::string("unexpected C++ exception: ") + e.what());
      }
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(failure_mu_);
        int32_t expected = -1;
        if (failed_rank_.compare_exchange_strong(expected, r)) {
          failure_message_ = s.message();
          failure_code_ = s.code();
        }
      }
      status[static_cast<size_t>(r)] = std::move(s);
    });
  }
  for (auto& t : threads) t.join();
  running_ = false;
  return status;
}

Status HostDomain::Run(const std::function<Status(int32_t rank)>& fn) {
  std::vector<Status> all = RunAll(fn);
  int first = -1, failed = 0;
  for (int32_t r = 0; r < num_ranks_; ++r)
    if (!all[static_cast<size_t>(r)].ok()) {
      ++failed;
      // Report a root cause, not a rank that only abandoned its wait because of another's failure;
      // among ranks that failed on their own, the lowest (the same report whatever the timing).
      if (first < 0 || (abandoned_[static_cast<size_t>(first)] && !abandoned_[static_cast<size_t>(r)])) first = r;
    }
  if (first < 0) return Status::Ok();
  const Status& s = all[static_cast<size_t>(first)];
  std::ostringstream os;
  os << "rank " << first << ": " << s.message();
  if (failed > 1) os << " (and " << failed - 1 << " other rank(s) failed)";
  return Status(s.code(), os.str());
}

Status HostDomain::Barrier(int32_t rank, Phase phase) {
  const size_t W = static_cast<size_t>(num_ranks_);
  const uint64_t epoch = ++epoch_[static_cast<size_t>(rank)];
  const uint64_t tag = (epoch << 16) | static_cast<uint64_t>(phase);
  for (size_t p = 0; p < W; ++p) slots_[p * W + static_cast<size_t>(rank)].store(tag, std::memory_order_release);

  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(options_.barrier_timeout_s));
  std::atomic<uint64_t>* mine = &slots_[static_cast<size_t>(rank) * W];
  for (uint64_t spins = 0;; ++spins) {
    bool all = true;
    for (size_t p = 0; p < W; ++p) {
      const uint64_t v = mine[p].load(std::memory_order_acquire);
      if ((v >> 16) < epoch) {
        all = false;
        continue;
      }
      if ((v >> 16) == epoch && (v & kPhaseMask) != static_cast<uint64_t>(phase)) {
        std::ostringstream os;
        os << "barrier #" << epoch << " phase mismatch: this rank is at '" << PhaseName(phase) << "', rank " << p
           << " is at '" << PhaseName(static_cast<Phase>(v & kPhaseMask)) << "' (ranks disagree on the protocol)";
        return InternalError(os.str());
      }
    }
    if (all) return Status::Ok();
    const int32_t failed = failed_rank_.load(std::memory_order_acquire);
    if (failed >= 0 && failed != rank) {
      std::lock_guard<std::mutex> lock(failure_mu_);
      abandoned_[static_cast<size_t>(rank)] = 1;
      // Carry the root cause's code, so a peer's timeout reads as a timeout on every rank.
      return Status(failure_code_, std::string("abandoned barrier '") + PhaseName(phase) + "': rank " +
                                       std::to_string(failed) + " failed: " + failure_message_);
    }
    if ((spins & 63) == 0 && Clock::now() > deadline) {
      std::ostringstream os;
      os << "barrier '" << PhaseName(phase) << "' (#" << epoch << ") timed out after " << options_.barrier_timeout_s
         << " s; no arrival from rank(s)";
      for (size_t p = 0; p < W; ++p)
        if ((mine[p].load(std::memory_order_acquire) >> 16) < epoch) os << " " << p;
      return TimeoutError(os.str());
    }
    if (spins < 2000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace rdep
