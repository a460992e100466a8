// A Domain: W ranks with peer-visible symmetric regions and phase barriers, one interface with its
// implementation chosen at construction (MakeDomain):
//   host               W threads of one process, regions in host memory (the reference and CI backend;
//                      HostDomain, rdep/transport/host_domain.h)
//   cuda, one process  W ranks driven by one process over the local GPUs: every rank on its own GPU
//                      (peer access, device barriers), or several ranks sharing a GPU (stream-join
//                      barriers) — CudaDomain::CreateSingleProcess (rdep/transport/cuda_domain.h)
//   cuda, per process  this process is one rank of a Bootstrap's world, on its own GPU (CUDA IPC or
//                      fabric handles) — CudaDomain::CreateMultiProcess
// Layers and kernels use the concrete classes (a CUDA layer needs streams and device peer tables);
// what every backend shares is here: the ranks this process drives, symmetric regions, Run, Barrier,
// and a printable placement.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rdep/status.h"
#include "rdep/transport/phase.h"

namespace rdep {

class Bootstrap;
using RegionId = int32_t;

class Domain {
 public:
  virtual ~Domain() = default;
  virtual int32_t num_ranks() const = 0;
  virtual const char* backend_name() const = 0;      // "host" or "cuda"
  virtual std::string transport_name() const = 0;    // "threads", "peer-access", "ipc", "fabric"
  virtual std::string placement() const = 0;         // where the ranks run, printable
  virtual std::vector<int32_t> local_ranks() const = 0;  // the ranks this process drives, ascending

  // Symmetric regions: `bytes` on every rank, zero-filled; not callable during Run.
  virtual StatusOr<RegionId> AllocateSymmetric(size_t bytes, const std::string& name) = 0;
  virtual void FreeSymmetric(RegionId id) = 0;
  // Base of region `id` on `rank`, usable by the backend's own code (host: a host pointer; cuda: a
  // device pointer valid on every local rank's device).
  virtual void* region_base(int32_t rank, RegionId id) const = 0;
  virtual size_t symmetric_bytes_per_rank() const = 0;

  // A symmetric region shared by every holder that asks for the same name and size (the redundant
  // replica slots that every balanced layer of a model reuses): the first AcquireShared allocates it
  // (zero-filled, AllocateSymmetric), later calls with the same (name, bytes) return the same id and
  // count one more holder; ReleaseShared drops a holder and frees the region with its last one. The
  // contents are whatever the last user left: holders must write before they read, and must not use
  // the region from two calls at once (calls on one domain run one after another on each rank).
  // Not callable during Run. shared_holders: the current holders of id (0 if not shared).
  StatusOr<RegionId> AcquireShared(const std::string& name, size_t bytes);
  void ReleaseShared(RegionId id);
  int32_t shared_holders(RegionId id) const;
  // Bytes per rank of the shared regions (each counted once, whatever its number of holders).
  size_t shared_bytes_per_rank() const;

  // Runs fn(rank) for every local rank on its own thread; the first failing rank's error.
  virtual Status Run(const std::function<Status(int32_t rank)>& fn) = 0;
  // A phase barrier of `rank` inside Run, bounded: a missing rank is a Timeout naming it and the phase.
  // (A CUDA device barrier reports its timeout at the rank's next Synchronize.)
  virtual Status Barrier(int32_t rank, Phase phase) = 0;
  // Waits for the rank's enqueued work and reports a deferred barrier failure (host: nothing to wait for).
  virtual Status Synchronize(int32_t rank) = 0;

 private:
  struct SharedRegion {
    std::string name;
    size_t bytes = 0;
    RegionId id = -1;
    int32_t holders = 0;
  };
  mutable std::mutex shared_mu_;
  std::vector<SharedRegion> shared_;
};

// Which implementation, and its settings.
struct DomainSpec {
  enum class Kind { kHost, kCudaOneProcess, kCudaPerProcess };
  Kind kind = Kind::kHost;
  int64_t num_ranks = 1;            // host and cuda one-process (per process: the bootstrap's size)
  double barrier_timeout_s = 30.0;
  int num_gpus = 0;                 // cuda one-process: ranks round-robin over this many GPUs (0 = min(W, present))
  Bootstrap* bootstrap = nullptr;   // cuda per-process; must outlive the domain
  int device = -1;                  // cuda per-process: this process's GPU (-1 = local rank mod GPUs present)
};

// InvalidArgument for a bad spec (naming the field); Unavailable when the build or the machine lacks
// what the kind needs (CUDA, a GPU, MPI).
StatusOr<std::unique_ptr<Domain>> MakeDomain(const DomainSpec& spec);

}  // namespace rdep
