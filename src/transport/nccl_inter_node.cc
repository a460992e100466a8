// The NCCL inter-node exchange (device_inter_node.h), built when NCCL was found (RDEP_HAVE_NCCL):
// one communicator per local index l, whose N ranks are the domain's ranks l, G+l, ..., (N-1)G+l
// (NCCL rank = node). One call on rank r (node a) enqueues on the caller's stream:
//   the own-node copy (cudaMemcpyAsync device to device), then
//   ncclGroupStart; ncclSend(send[b]) and ncclRecv(recv[b]) for every other node b with bytes to move;
//   ncclGroupEnd.
// Communicators: one process over several GPUs -> ncclCommInitAll per local index on the ranks'
// devices; one process per GPU -> the communicator's node-0 rank draws an ncclUniqueId, every rank
// contributes its id (or zeros) to one bootstrap allgather, and ncclCommInitRank(N, id of rank l, a).
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "rdep/cuda/check.h"
#include "rdep/cuda/nccl_check.h"
#include "transport/device_inter_node_internal.h"

namespace rdep {
namespace {

class NcclInterNode final : public internal::DeviceInterNodeBase {
 public:
  NcclInterNode(CudaDomain& domain, NodeConfig nodes)
      : DeviceInterNodeBase(domain, nodes), comms_(static_cast<size_t>(domain.num_ranks()), nullptr) {}

  ~NcclInterNode() override {
    for (int32_t r : domain_.local_ranks()) {
      ncclComm_t c = comms_[static_cast<size_t>(r)];
      if (c == nullptr) continue;
      cudaSetDevice(domain_.device(r));
      // After a failed call a peer's transfer may never complete: abort rather than wait for it.
      if (failed_) ncclCommAbort(c);
      else ncclCommDestroy(c);
    }
  }

  Status Init() {
    RDEP_RETURN_IF_ERROR(InitScratch());
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // point-to-point only: never NVLink multicast
    int caller = -1;
    RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&caller));
    Status s = domain_.bootstrap() == nullptr ? InitOneProcess() : InitPerProcess(*domain_.bootstrap());
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(caller));
    RDEP_RETURN_IF_ERROR(s);
    int version = 0;
    RDEP_NCCL_RETURN_IF_ERROR(ncclGetVersion(&version));
    version_ = std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." + std::to_string(version % 100);
    return Status::Ok();
  }

  const char* name() const override { return "nccl"; }

  std::string description() const override {
    return "nccl " + version_ + ": " + std::to_string(per_node_) + " communicator(s) of N=" + std::to_string(nodes_) +
           " ranks (one per local index), grouped send/recv; " + domain_.placement();
  }

  Status AllToAllV(int32_t rank, const DeviceExchangeBuffers& b, cudaStream_t stream) override {
    Status s = Exchange(rank, b, stream);
    if (!s.ok()) failed_ = true;  // a peer's transfer may now never complete
    return s;
  }

  Status ExchangeCounts(int32_t rank, std::span<const int64_t> send_counts, std::span<int64_t> recv_counts,
                        cudaStream_t stream) override {
    Status s = DeviceInterNodeBase::ExchangeCounts(rank, send_counts, recv_counts, stream);
    if (!s.ok()) failed_ = true;
    return s;
  }

 private:
  Status Exchange(int32_t rank, const DeviceExchangeBuffers& b, cudaStream_t stream) {
    RDEP_RETURN_IF_ERROR(CheckRank(rank));
    RDEP_RETURN_IF_ERROR(internal::CheckDeviceExchange(b, rank, nodes_, per_node_, name()));
    const int32_t node = rank / per_node_;
    const auto own = static_cast<size_t>(node);
    if (b.send_bytes[own] > 0)
      RDEP_RETURN_IF_ERROR(Checked(cuda::CudaStatus(cudaMemcpyAsync(b.recv[own], b.send[own], static_cast<size_t>(b.send_bytes[own]),
                                                                    cudaMemcpyDeviceToDevice, stream),
                                                    "cudaMemcpyAsync (own node)", __FILE__, __LINE__),
                                   rank));
    if (nodes_ == 1) return Status::Ok();
    ncclComm_t comm = comms_[static_cast<size_t>(rank)];
    RDEP_RETURN_IF_ERROR(Checked(RDEP_NCCL_STATUS(ncclGroupStart()), rank));
    Status first;  // the group is ended whatever happens inside it
    for (int32_t p = 0; p < nodes_ && first.ok(); ++p) {
      if (p == node) continue;
      const auto q = static_cast<size_t>(p);
      if (b.send_bytes[q] > 0)
        first = RDEP_NCCL_STATUS(ncclSend(b.send[q], static_cast<size_t>(b.send_bytes[q]), ncclUint8, p, comm, stream));
      if (first.ok() && b.recv_bytes[q] > 0)
        first = RDEP_NCCL_STATUS(ncclRecv(b.recv[q], static_cast<size_t>(b.recv_bytes[q]), ncclUint8, p, comm, stream));
    }
    Status end = RDEP_NCCL_STATUS(ncclGroupEnd());
    RDEP_RETURN_IF_ERROR(Checked(std::move(first), rank));
    return Checked(std::move(end), rank);
  }

  // Names the rank on a failed call.
  Status Checked(Status s, int32_t rank) const { return s.ok() ? s : Status(s.code(), Prefix(rank) + s.message()); }

  // Refuses two ranks of one communicator on one GPU, then ncclCommInitAll per local index.
  Status InitOneProcess() {
    const auto N = static_cast<size_t>(nodes_);
    std::vector<std::vector<int>> devs(static_cast<size_t>(per_node_), std::vector<int>(N));
    for (int32_t l = 0; l < per_node_; ++l) {
      std::map<int, int32_t> first_rank_on;  // GPU -> the first rank of this communicator on it
      for (int32_t a = 0; a < nodes_; ++a) {
        const int32_t r = a * per_node_ + l;
        const int dev = domain_.device(r);
        devs[static_cast<size_t>(l)][static_cast<size_t>(a)] = dev;
        const auto [it, fresh] = first_rank_on.emplace(dev, r);
        if (!fresh)
          return InvalidArgument(
              "nccl inter-node exchange: ranks " + std::to_string(it->second) + " and " + std::to_string(r) +
              " (local index " + std::to_string(l) + ", nodes " + std::to_string(it->second / per_node_) + " and " +
              std::to_string(a) + ") share GPU " + std::to_string(dev) +
              "; NCCL needs every rank of a communicator on its own GPU: give the ranks distinct GPUs, or use the "
              "device-copy exchange for ranks sharing GPUs (MakeDeviceCopyInterNodeExchange)");
      }
    }
    for (int32_t l = 0; l < per_node_; ++l) {
      std::vector<ncclComm_t> c(N, nullptr);
      RDEP_NCCL_RETURN_IF_ERROR(ncclCommInitAll(c.data(), nodes_, devs[static_cast<size_t>(l)].data()));
      for (int32_t a = 0; a < nodes_; ++a) comms_[static_cast<size_t>(a * per_node_ + l)] = c[static_cast<size_t>(a)];
    }
    return Status::Ok();
  }

  // One process per GPU: the NodeConfig must agree across processes (a mismatch would hang NCCL's
  // initialization), then the unique ids travel through the bootstrap.
  Status InitPerProcess(Bootstrap& boot) {
    const int32_t me = boot.rank(), node = me / per_node_, local = me % per_node_;
    int32_t mine[2] = {nodes_, per_node_};
    std::vector<uint8_t> bytes(sizeof mine);
    std::memcpy(bytes.data(), mine, sizeof mine);
    RDEP_RETURN_IF_ERROR(domain_.AgreeAcrossRanks(bytes, "inter-node config", [](const std::vector<uint8_t>& v) {
      int32_t c[2] = {0, 0};
      if (v.size() == sizeof c) std::memcpy(c, v.data(), sizeof c);
      return "N=" + std::to_string(c[0]) + " nodes x G=" + std::to_string(c[1]) + " ranks";
    }));
    // Every rank takes part in the allgather even if drawing its id failed (the others would wait
    // forever otherwise); an all-zero id says the drawing failed.
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    Status drawn = node == 0 ? RDEP_NCCL_STATUS(ncclGetUniqueId(&id)) : Status::Ok();
    std::vector<ncclUniqueId> ids(static_cast<size_t>(boot.size()));
    RDEP_RETURN_IF_ERROR(boot.AllGather(&id, sizeof id, ids.data()));
    RDEP_RETURN_IF_ERROR(drawn);
    const ncclUniqueId& theirs = ids[static_cast<size_t>(local)];
    const ncclUniqueId zero{};
    if (std::memcmp(&theirs, &zero, sizeof zero) == 0)
      return Unavailable("nccl inter-node exchange: rank " + std::to_string(local) + " (node 0, local index " +
                         std::to_string(local) + ") could not draw the communicator's ncclUniqueId (see its error)");
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(domain_.device(me)));
    RDEP_NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comms_[static_cast<size_t>(me)], nodes_, theirs, node));
    return Status::Ok();
  }

  std::vector<ncclComm_t> comms_;  // [W] local ranks: the communicator of the rank's local index
  std::string version_;
  std::atomic<bool> failed_{false};  // set by a rank's thread on a failed call; read by the destructor
};

}  // namespace

StatusOr<std::unique_ptr<DeviceInterNodeExchange>> MakeNcclInterNodeExchange(CudaDomain& domain, NodeConfig nodes) {
  RDEP_RETURN_IF_ERROR(nodes.Validate(domain.num_ranks()));
  std::unique_ptr<NcclInterNode> x(new NcclInterNode(domain, nodes));
  RDEP_RETURN_IF_ERROR(x->Init());
  return std::unique_ptr<DeviceInterNodeExchange>(std::move(x));
}

}  // namespace rdep
