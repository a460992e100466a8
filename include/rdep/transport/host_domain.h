// The host backend's Domain: W ranks as threads of one process, each with peer-visible symmetric
// regions in host memory and a control block of barrier slots (seeds 000 A.1). It runs the same
// protocol the CUDA backend runs, and is the reference and CI backend.
//
//   auto domain = HostDomain::Create(4, {});
//   RegionId r = domain->AllocateSymmetric(bytes, "payload");   // before Run
//   domain->Run([&](int32_t rank) -> Status {
//     write into domain->region(peer, r) ...;                    // a peer-visible store
//     RDEP_RETURN_IF_ERROR(domain->Barrier(rank, Phase::kDispatchCounts));
//     ...
//   });
//
// Barriers are bounded: a rank that does not arrive within DomainOptions::barrier_timeout_s makes
// every waiting rank fail with an error naming the missing rank(s) and the phase; a rank that fails
// makes the others abandon their waits at once with its error. Nothing hangs.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rdep/status.h"
#include "rdep/transport/domain.h"
#include "rdep/transport/phase.h"

namespace rdep {

struct DomainOptions {
  double barrier_timeout_s = 30.0;  // bound on every wait for a peer
};

class HostDomain final : public Domain {
 public:
  static StatusOr<std::unique_ptr<HostDomain>> Create(int64_t num_ranks, DomainOptions options = {});
  ~HostDomain();
  HostDomain(const HostDomain&) = delete;
  HostDomain& operator=(const HostDomain&) = delete;

  int32_t num_ranks() const override { return num_ranks_; }
  const DomainOptions& options() const { return options_; }
  const char* backend_name() const override { return "host"; }
  std::string transport_name() const override { return "threads"; }
  std::string placement() const override;
  std::vector<int32_t> local_ranks() const override;

  // Allocates `bytes` (64-byte aligned, zero-filled) on every rank. Not callable during Run.
  StatusOr<RegionId> AllocateSymmetric(size_t bytes, const std::string& name) override;
  // Releases a region on every rank (not callable during Run). Its id is not reused.
  void FreeSymmetric(RegionId id) override;
  // Base of region `id` on `rank`: the rank's own copy or a peer's (peer-visible store/load target).
  std::byte* region(int32_t rank, RegionId id) const;
  void* region_base(int32_t rank, RegionId id) const override { return region(rank, id); }
  template <typename T>
  T* region_as(int32_t rank, RegionId id) const { return reinterpret_cast<T*>(region(rank, id)); }
  size_t region_bytes(RegionId id) const { return regions_[static_cast<size_t>(id)].bytes; }
  // Symmetric bytes allocated per rank (sum over regions).
  size_t symmetric_bytes_per_rank() const override;

  // Runs fn(rank) on W threads and waits for all. Returns OK, or the first failing rank's error
  // (prefixed with its rank) followed by how many other ranks failed.
  Status Run(const std::function<Status(int32_t rank)>& fn) override;
  // Like Run, but returns every rank's status.
  std::vector<Status> RunAll(const std::function<Status(int32_t rank)>& fn);

  // Phase barrier for `rank`, inside Run: publishes this rank's arrival to every peer (release) and
  // waits (acquire) until every peer has arrived at the same barrier. Errors: timeout (names the
  // missing ranks and the phase), phase mismatch between ranks (a protocol bug), or a failed peer.
  Status Barrier(int32_t rank, Phase phase) override;
  Status Synchronize(int32_t) override { return Status::Ok(); }  // host barriers report at once

 private:
  struct Region {
    std::string name;
    size_t bytes = 0;
    std::vector<std::byte*> per_rank;
  };
  HostDomain(int32_t num_ranks, DomainOptions options);
  void Reset();

  int32_t num_ranks_;
  DomainOptions options_;
  std::vector<Region> regions_;
  // slots_[owner * W + src]: the tag (epoch << 16 | phase) of the last barrier src announced to owner.
  std::unique_ptr<std::atomic<uint64_t>[]> slots_;
  std::vector<uint64_t> epoch_;  // per rank: barriers entered in this Run
  std::atomic<int32_t> failed_rank_{-1};
  std::vector<uint8_t> abandoned_;  // [W] the rank's failure was abandoning a barrier after another's
  std::mutex failure_mu_;
  std::string failure_message_;
  StatusCode failure_code_ = StatusCode::kOk;
  bool running_ = false;
};

}  // namespace rdep
