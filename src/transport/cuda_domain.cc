#include "rdep/transport/cuda_domain.h"

#include <cstring>
#include <sstream>
#include <thread>

#include "rdep/cuda/check.h"

namespace rdep {

StatusOr<std::unique_ptr<CudaDomain>> CudaDomain::CreateSingleProcess(int64_t num_ranks, CudaDomainOptions options) {
  const int available = cuda::DeviceCount();
  if (available == 0) return Unavailable("cuda domain: no CUDA device is present");
  if (num_ranks < 1) return InvalidArgument("cuda domain: ranks W must be >= 1, got " + std::to_string(num_ranks));
  if (!(options.barrier_timeout_s > 0)) return InvalidArgument("cuda domain: barrier timeout must be > 0 seconds");
  if (options.devices.empty()) {
    if (num_ranks > available)
      return InvalidArgument("cuda domain: W=" + std::to_string(num_ranks) + " ranks need " + std::to_string(num_ranks) +
                             " GPUs in one process, this machine has " + std::to_string(available));
    for (int i = 0; i < num_ranks; ++i) options.devices.push_back(i);
  }
  if (static_cast<int64_t>(options.devices.size()) != num_ranks)
    return InvalidArgument("cuda domain: " + std::to_string(options.devices.size()) + " devices given for W=" +
                           std::to_string(num_ranks));
  std::unique_ptr<CudaDomain> d(new CudaDomain());
  d->num_ranks_ = static_cast<int32_t>(num_ranks);
  d->options_ = options;
  d->devices_ = options.devices;
  d->epoch_.assign(static_cast<size_t>(num_ranks), 0);
  for (int32_t r = 0; r < num_ranks; ++r) {
    const int dev = d->devices_[static_cast<size_t>(r)];
    if (dev < 0 || dev >= available) return InvalidArgument("cuda domain: device " + std::to_string(dev) + " does not exist");
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));
    for (int32_t p = 0; p < num_ranks; ++p) {
      const int peer = d->devices_[static_cast<size_t>(p)];
      if (peer == dev) continue;
      int can = 0;
      RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, dev, peer));
      if (!can)
        return Unavailable("cuda domain: GPU " + std::to_string(dev) + " cannot access GPU " + std::to_string(peer) +
                           " as a peer (no NVLink/P2P path); one-process mode needs peer access");
      cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else RDEP_CUDA_RETURN_IF_ERROR(e);
    }
    cudaStream_t s;
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    d->streams_.push_back(s);
  }
  void* host = nullptr;
  RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host, sizeof(DeviceErrorRecord) * static_cast<size_t>(num_ranks),
                                          cudaHostAllocMapped | cudaHostAllocPortable));
  d->errors_ = static_cast<DeviceErrorRecord*>(host);
  std::memset(d->errors_, 0, sizeof(DeviceErrorRecord) * static_cast<size_t>(num_ranks));
  for (int32_t r = 0; r < num_ranks; ++r) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(d->device(r)));
    void* dev_ptr = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev_ptr, d->errors_ + r, 0));
    d->errors_dev_.push_back(static_cast<DeviceErrorRecord*>(dev_ptr));
  }
  RDEP_ASSIGN_OR_RETURN(d->barrier_region_,
                        d->AllocateSymmetric(sizeof(uint64_t) * static_cast<size_t>(num_ranks), "barrier"));
  return d;
}

CudaDomain::~CudaDomain() {
  for (auto& r : regions_)
    for (size_t q = 0; q < r.base.size(); ++q) {
      cudaSetDevice(devices_[q]);
      cudaFree(r.base[q]);
      cudaFree(r.tables[q]);
    }
  for (size_t q = 0; q < streams_.size(); ++q) {
    cudaSetDevice(devices_[q]);
    cudaStreamDestroy(streams_[q]);
  }
  if (errors_) cudaFreeHost(errors_);
}

StatusOr<RegionId> CudaDomain::AllocateSymmetric(size_t bytes, const std::string& name) {
  if (running_) return FailedPrecondition("cuda domain: AllocateSymmetric(" + name + ") called inside Run");
  Region r;
  r.name = name;
  r.bytes = bytes;
  const size_t W = static_cast<size_t>(num_ranks_);
  for (size_t q = 0; q < W; ++q) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[q]));
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess)
      return Status(StatusCode::kCudaError, "cuda domain: allocating " + std::to_string(bytes) + " bytes for region '" +
                                                name + "' on GPU " + std::to_string(devices_[q]) + ": " + cudaGetErrorString(e));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, bytes ? bytes : 1));
    r.base.push_back(p);
  }
  for (size_t q = 0; q < W; ++q) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[q]));
    void** table = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&table, sizeof(void*) * W));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(table, r.base.data(), sizeof(void*) * W, cudaMemcpyHostToDevice));
    r.tables.push_back(table);
  }
  for (size_t q = 0; q < W; ++q) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[q]));
    RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  }
  regions_.push_back(std::move(r));
  return static_cast<RegionId>(regions_.size() - 1);
}

void* CudaDomain::region(int32_t rank, RegionId id) const {
  return regions_[static_cast<size_t>(id)].base[static_cast<size_t>(rank)];
}

void* const* CudaDomain::peer_table(int32_t viewer, RegionId id) const {
  return regions_[static_cast<size_t>(id)].tables[static_cast<size_t>(viewer)];
}

size_t CudaDomain::symmetric_bytes_per_rank() const {
  size_t total = 0;
  for (const auto& r : regions_) total += r.bytes;
  return total;
}

Status CudaDomain::Run(const std::function<Status(int32_t rank)>& fn) {
  running_ = true;
  std::vector<Status> status(static_cast<size_t>(num_ranks_));
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < num_ranks_; ++r)
    threads.emplace_back([&, r] {
      Status s = cuda::CudaStatus(cudaSetDevice(device(r)), "cudaSetDevice", __FILE__, __LINE__);
      if (s.ok()) s = fn(r);
      status[static_cast<size_t>(r)] = std::move(s);
    });
  for (auto& t : threads) t.join();
  running_ = false;
  int first = -1, failed = 0;
  for (int32_t r = 0; r < num_ranks_; ++r)
    if (!status[static_cast<size_t>(r)].ok()) {
      ++failed;
      // A timeout on a waiting rank is a consequence; prefer a rank that failed for another reason.
      if (first < 0 || (status[static_cast<size_t>(first)].code() == StatusCode::kTimeout &&
                        status[static_cast<size_t>(r)].code() != StatusCode::kTimeout))
        first = r;
    }
  if (first < 0) return Status::Ok();
  const Status& s = status[static_cast<size_t>(first)];
  std::ostringstream os;
  os << "rank " << first << ": " << s.message();
  if (failed > 1) os << " (and " << failed - 1 << " other rank(s) failed)";
  return Status(s.code(), os.str());
}

Status CudaDomain::Barrier(int32_t rank, Phase phase) {
  const uint64_t epoch = ++epoch_[static_cast<size_t>(rank)];
  return LaunchPhaseBarrier(peer_table(rank, barrier_region_), rank, num_ranks_, epoch, phase,
                            options_.barrier_timeout_s, errors_dev_[static_cast<size_t>(rank)], stream(rank));
}

Status CudaDomain::CheckErrors(int32_t rank) {
  // The device writes this record through a mapped pointer: read it field by field, volatile.
  const volatile DeviceErrorRecord* v = errors_ + rank;
  DeviceErrorRecord e;
  e.code = v->code;
  e.phase = v->phase;
  e.peer = v->peer;
  e.peer_phase = v->peer_phase;
  e.epoch = v->epoch;
  if (e.code == 0) return Status::Ok();
  std::ostringstream os;
  if (e.code == 1) {
    os << "device barrier '" << PhaseName(static_cast<Phase>(e.phase)) << "' (#" << e.epoch << ") timed out after "
       << options_.barrier_timeout_s << " s; no arrival from rank(s) " << e.peer;
    return TimeoutError(os.str());
  }
  os << "device barrier #" << e.epoch << " phase mismatch: this rank is at '" << PhaseName(static_cast<Phase>(e.phase))
     << "', rank " << e.peer << " is at '" << PhaseName(static_cast<Phase>(e.peer_phase)) << "'";
  return InternalError(os.str());
}

Status CudaDomain::Synchronize(int32_t rank) {
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream(rank)));
  return CheckErrors(rank);
}

}  // namespace rdep
