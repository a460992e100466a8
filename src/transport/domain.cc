// MakeDomain: the Domain implementation a spec names (rdep/transport/domain.h).
#include "rdep/transport/domain.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <utility>

#include "rdep/cuda/device_count.h"
#include "rdep/transport/host_domain.h"
#if defined(RDEP_HAVE_CUDA)
#include "rdep/transport/cuda_domain.h"
#endif

namespace rdep {

StatusOr<RegionId> Domain::AcquireShared(const std::string& name, size_t bytes) {
  std::lock_guard<std::mutex> lock(shared_mu_);
  for (SharedRegion& r : shared_) {
    if (r.name == name && r.bytes == bytes) {
      ++r.holders;
      return r.id;
    }
  }
  RDEP_ASSIGN_OR_RETURN(RegionId id, AllocateSymmetric(bytes, name));
  shared_.push_back(SharedRegion{name, bytes, id, 1});
  return id;
}

void Domain::ReleaseShared(RegionId id) {
  std::lock_guard<std::mutex> lock(shared_mu_);
  for (size_t i = 0; i < shared_.size(); ++i) {
    if (shared_[i].id != id) continue;
    if (--shared_[i].holders == 0) {
      FreeSymmetric(id);
      shared_.erase(shared_.begin() + static_cast<std::ptrdiff_t>(i));
    }
    return;
  }
}

int32_t Domain::shared_holders(RegionId id) const {
  std::lock_guard<std::mutex> lock(shared_mu_);
  for (const SharedRegion& r : shared_)
    if (r.id == id) return r.holders;
  return 0;
}

size_t Domain::shared_bytes_per_rank() const {
  std::lock_guard<std::mutex> lock(shared_mu_);
  size_t bytes = 0;
  for (const SharedRegion& r : shared_) bytes += r.bytes;
  return bytes;
}

StatusOr<std::unique_ptr<Domain>> MakeDomain(const DomainSpec& spec) {
  if (!(spec.barrier_timeout_s > 0) || !std::isfinite(spec.barrier_timeout_s))
    return InvalidArgument("domain: barrier_timeout_s must be a finite number > 0");
  switch (spec.kind) {
    case DomainSpec::Kind::kHost: {
      RDEP_ASSIGN_OR_RETURN(auto d, HostDomain::Create(spec.num_ranks, {.barrier_timeout_s = spec.barrier_timeout_s}));
      return std::unique_ptr<Domain>(std::move(d));
    }
    case DomainSpec::Kind::kCudaOneProcess:
    case DomainSpec::Kind::kCudaPerProcess: break;
  }
#if defined(RDEP_HAVE_CUDA)
  if (spec.kind == DomainSpec::Kind::kCudaPerProcess) {
    if (!spec.bootstrap) return InvalidArgument("domain: a per-process CUDA domain needs a bootstrap");
    std::vector<int> devices;
    if (spec.device >= 0) devices.push_back(spec.device);
    // Moved, not copied: GCC 13 reports a false -Warray-bounds inside the copy of a one-element vector.
    RDEP_ASSIGN_OR_RETURN(auto d, CudaDomain::CreateMultiProcess(*spec.bootstrap, {.barrier_timeout_s = spec.barrier_timeout_s,
                                                                                   .devices = std::move(devices)}));
    return std::unique_ptr<Domain>(std::move(d));
  }
  const int present = CudaDeviceCount();
  if (present == 0) return Unavailable("domain: no CUDA device is present");
  if (spec.num_gpus < 0 || spec.num_gpus > present)
    return InvalidArgument("domain: num_gpus " + std::to_string(spec.num_gpus) + " outside [0, " + std::to_string(present) +
                           "] (0 = min(W, GPUs present))");
  if (spec.num_ranks < 1 || spec.num_ranks > kMaxCudaRanks)
    return InvalidArgument("domain: ranks W must be in [1, " + std::to_string(kMaxCudaRanks) + "], got " + std::to_string(spec.num_ranks));
  const int gpus = spec.num_gpus > 0 ? spec.num_gpus : static_cast<int>(std::min<int64_t>(spec.num_ranks, present));
  RDEP_ASSIGN_OR_RETURN(auto d, CudaDomain::CreateSingleProcess(spec.num_ranks, {.barrier_timeout_s = spec.barrier_timeout_s,
                                                                                 .devices = RoundRobinDevices(spec.num_ranks, gpus)}));
  return std::unique_ptr<Domain>(std::move(d));
#else
  return Unavailable("domain: this build of rdep has no CUDA backend (configured without a CUDA compiler)");
#endif
}

}  // namespace rdep
