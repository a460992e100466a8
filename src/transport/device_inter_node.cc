// The device inter-node exchange: the checks and the counts exchange both implementations share, and
// the factory that picks one from the domain's placement (device_inter_node.h). The implementations
// are device_copy_inter_node.cc and nccl_inter_node.cc (built with NCCL only).
#include "rdep/transport/device_inter_node.h"

#include <algorithm>
#include <string>

#include "rdep/cuda/check.h"
#include "transport/device_inter_node_internal.h"

namespace rdep {
namespace internal {

Status CheckDeviceExchange(const DeviceExchangeBuffers& b, int32_t rank, int32_t nodes, int32_t ranks_per_node,
                           const char* impl) {
  const std::string where = std::string("inter-node exchange (") + impl + ") on rank " + std::to_string(rank) +
                            " (node " + std::to_string(rank / ranks_per_node) + "): ";
  const auto N = static_cast<size_t>(nodes);
  const auto count = [&](size_t n, const char* what) {
    return InvalidArgument(where + std::to_string(n) + " " + what + " for N=" + std::to_string(nodes) +
                           " nodes (one per node)");
  };
  if (b.send.size() != N) return count(b.send.size(), "send buffers");
  if (b.send_bytes.size() != N) return count(b.send_bytes.size(), "send_bytes entries");
  if (b.recv.size() != N) return count(b.recv.size(), "recv buffers");
  if (b.recv_bytes.size() != N) return count(b.recv_bytes.size(), "recv_bytes entries");
  // A size must be >= 0, and a pointer non-null wherever its size is > 0.
  const auto entry = [&](const char* name, size_t i, int64_t bytes, const void* ptr) {
    const std::string idx = "[" + std::to_string(i) + "]";
    if (bytes < 0) return InvalidArgument(where + name + "_bytes" + idx + " = " + std::to_string(bytes) + " is negative");
    if (bytes > 0 && ptr == nullptr)
      return InvalidArgument(where + name + idx + " is null with " + name + "_bytes" + idx + " = " + std::to_string(bytes));
    return Status::Ok();
  };
  for (size_t i = 0; i < N; ++i) {
    RDEP_RETURN_IF_ERROR(entry("send", i, b.send_bytes[i], b.send[i]));
    RDEP_RETURN_IF_ERROR(entry("recv", i, b.recv_bytes[i], b.recv[i]));
  }
  const auto own = static_cast<size_t>(rank / ranks_per_node);
  if (b.recv_bytes[own] != b.send_bytes[own])
    return InvalidArgument(where + "recv_bytes[" + std::to_string(own) + "] = " + std::to_string(b.recv_bytes[own]) +
                           " differs from send_bytes[" + std::to_string(own) + "] = " + std::to_string(b.send_bytes[own]) +
                           " for its own node (a rank receives from itself what it sends itself)");
  return Status::Ok();
}

DeviceInterNodeBase::DeviceInterNodeBase(CudaDomain& domain, NodeConfig nodes)
    : domain_(domain), nodes_(nodes.nodes), per_node_(nodes.ranks_per_node(domain.num_ranks())),
      counts_dev_(static_cast<size_t>(domain.num_ranks()), nullptr),
      counts_host_(static_cast<size_t>(domain.num_ranks()), nullptr) {}

DeviceInterNodeBase::~DeviceInterNodeBase() {
  for (int32_t r : domain_.local_ranks()) {
    const auto q = static_cast<size_t>(r);
    if (counts_dev_[q] != nullptr) {
      cudaSetDevice(domain_.device(r));
      cudaFree(counts_dev_[q]);
    }
    if (counts_host_[q] != nullptr) cudaFreeHost(counts_host_[q]);
  }
}

Status DeviceInterNodeBase::InitScratch() {
  const size_t bytes = sizeof(int64_t) * 2 * static_cast<size_t>(nodes_);
  int caller = -1;
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&caller));
  for (int32_t r : domain_.local_ranks()) {
    const auto q = static_cast<size_t>(r);
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(domain_.device(r)));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&counts_dev_[q], bytes));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(counts_dev_[q], 0, bytes));
    // cudaMemset runs on the legacy stream, which the ranks' non-blocking streams do not wait for: done before the first
    // exchange's copies on them (else it may zero counts already copied in: a flaky ExchangeCounts on one GPU).
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&counts_host_[q], bytes, cudaHostAllocPortable));
  }
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(caller));
  return Status::Ok();
}

Status DeviceInterNodeBase::CheckRank(int32_t rank) const {
  if (rank < 0 || rank >= domain_.num_ranks() || !domain_.is_local(rank))
    return InvalidArgument(std::string("inter-node exchange (") + name() + "): rank " + std::to_string(rank) +
                           " is not a rank this process drives (W=" + std::to_string(domain_.num_ranks()) + ")");
  return Status::Ok();
}

std::string DeviceInterNodeBase::Prefix(int32_t rank) const {
  return std::string("inter-node exchange (") + name() + ") on rank " + std::to_string(rank) + " (node " +
         std::to_string(rank / per_node_) + "): ";
}

Status DeviceInterNodeBase::ExchangeCounts(int32_t rank, std::span<const int64_t> send_counts,
                                           std::span<int64_t> recv_counts, cudaStream_t stream) {
  RDEP_RETURN_IF_ERROR(CheckRank(rank));
  const auto N = static_cast<size_t>(nodes_);
  if (send_counts.size() != N || recv_counts.size() != N)
    return InvalidArgument(Prefix(rank) + "counts exchange with " + std::to_string(send_counts.size()) + " send and " +
                           std::to_string(recv_counts.size()) + " recv entries for N=" + std::to_string(nodes_) +
                           " nodes (one per node)");
  for (size_t b = 0; b < N; ++b)
    if (send_counts[b] < 0)
      return InvalidArgument(Prefix(rank) + "send count [" + std::to_string(b) + "] = " + std::to_string(send_counts[b]) +
                             " is negative");
  int64_t* dev = counts_dev_[static_cast<size_t>(rank)];
  int64_t* host = counts_host_[static_cast<size_t>(rank)];
  std::copy(send_counts.begin(), send_counts.end(), host);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev, host, sizeof(int64_t) * N, cudaMemcpyHostToDevice, stream));
  std::vector<const void*> send(N);
  std::vector<void*> recv(N);
  const std::vector<int64_t> bytes(N, static_cast<int64_t>(sizeof(int64_t)));
  for (size_t b = 0; b < N; ++b) {
    send[b] = dev + b;
    recv[b] = dev + N + b;
  }
  RDEP_RETURN_IF_ERROR(AllToAllV(rank, {send, bytes, recv, bytes}, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host + N, dev + N, sizeof(int64_t) * N, cudaMemcpyDeviceToHost, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  for (size_t a = 0; a < N; ++a) {
    recv_counts[a] = host[N + a];
    if (recv_counts[a] < 0)
      return InternalError(Prefix(rank) + "received a negative count " + std::to_string(recv_counts[a]) + " from rank " +
                           std::to_string(static_cast<int32_t>(a) * per_node_ + rank % per_node_));
  }
  return Status::Ok();
}

}  // namespace internal

#if !defined(RDEP_HAVE_NCCL)
StatusOr<std::unique_ptr<DeviceInterNodeExchange>> MakeNcclInterNodeExchange(CudaDomain& domain, NodeConfig nodes) {
  RDEP_RETURN_IF_ERROR(nodes.Validate(domain.num_ranks()));
  return Unavailable("nccl inter-node exchange: this rdep build has no NCCL (nccl.h and libnccl were not found when "
                     "it was configured; install NCCL or set NCCL_HOME, then reconfigure)");
}
#endif

StatusOr<std::unique_ptr<DeviceInterNodeExchange>> MakeDeviceInterNodeExchange(CudaDomain& domain, NodeConfig nodes) {
  RDEP_RETURN_IF_ERROR(nodes.Validate(domain.num_ranks()));
  if (nodes.nodes == 1 || (domain.bootstrap() == nullptr && domain.joins_barriers()))
    return MakeDeviceCopyInterNodeExchange(domain, nodes);
  auto nccl = MakeNcclInterNodeExchange(domain, nodes);
  if (nccl.status().code() == StatusCode::kUnavailable)
    return Unavailable(nccl.status().message() + "; the domain (" + domain.placement() +
                       ") gives every rank its own GPU, which needs NCCL (the device-copy exchange is for ranks "
                       "sharing GPUs in one process)");
  return nccl;
}

}  // namespace rdep
