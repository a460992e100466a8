// The device-copy inter-node exchange (device_inter_node.h): for ranks sharing GPUs in one process,
// where NCCL refuses two ranks of a communicator on one GPU. One call on rank r (node a, local l):
//   1. r writes its send pointers and sizes into its row of a host table (posted_[r]);
//   2. barrier inter-node.copy: the ranks' host threads meet (which orders the table), and r's
//      stream waits for every peer's earlier work (the join's events), so the senders' data is ready;
//   3. for each node b, r copies posted_[b*G + l].send[a] into recv[b] on its stream
//      (cudaMemcpyPeerAsync: the same GPU or a peer GPU of this process);
//   4. barrier inter-node.copy.done: every peer's stream waits for r's copies, so a sender's later
//      work may overwrite its send buffers, and the table rows may be rewritten by the next call.
// The barriers run on the domain's stream of the rank; a caller's other stream is joined to it by an
// event before step 2 and after step 4.
#include <array>
#include <string>
#include <vector>

#include "rdep/cuda/check.h"
#include "transport/device_inter_node_internal.h"

namespace rdep {
namespace {

class DeviceCopyInterNode final : public internal::DeviceInterNodeBase {
 public:
  DeviceCopyInterNode(CudaDomain& domain, NodeConfig nodes)
      : DeviceInterNodeBase(domain, nodes), posted_(static_cast<size_t>(domain.num_ranks())),
        bridge_(static_cast<size_t>(domain.num_ranks()), {nullptr, nullptr}) {}

  ~DeviceCopyInterNode() override {
    for (int32_t r : domain_.local_ranks())
      for (cudaEvent_t e : bridge_[static_cast<size_t>(r)])
        if (e != nullptr) {
          cudaSetDevice(domain_.device(r));
          cudaEventDestroy(e);
        }
  }

  Status Init() {
    RDEP_RETURN_IF_ERROR(InitScratch());
    int caller = -1;
    RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&caller));
    for (int32_t r : domain_.local_ranks()) {
      auto& p = posted_[static_cast<size_t>(r)];
      p.send.assign(static_cast<size_t>(nodes_), nullptr);
      p.bytes.assign(static_cast<size_t>(nodes_), 0);
      RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(domain_.device(r)));
      for (cudaEvent_t& e : bridge_[static_cast<size_t>(r)])
        RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(caller));
    return Status::Ok();
  }

  const char* name() const override { return "device-copy"; }

  std::string description() const override {
    return "device-copy: N=" + std::to_string(nodes_) + " nodes x G=" + std::to_string(per_node_) +
           " ranks, peer copies between stream-ordered joins; " + domain_.placement();
  }

  Status AllToAllV(int32_t rank, const DeviceExchangeBuffers& b, cudaStream_t stream) override {
    RDEP_RETURN_IF_ERROR(CheckRank(rank));
    RDEP_RETURN_IF_ERROR(internal::CheckDeviceExchange(b, rank, nodes_, per_node_, name()));
    const int32_t node = rank / per_node_, local = rank % per_node_;
    const auto me = static_cast<size_t>(rank);
    if (nodes_ == 1) {  // nothing crosses nodes: the own-node copy alone, no peer involved
      if (b.send_bytes[0] == 0) return Status::Ok();
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.recv[0], b.send[0], static_cast<size_t>(b.send_bytes[0]),
                                                cudaMemcpyDeviceToDevice, stream));
      return Status::Ok();
    }
    Posted& mine = posted_[me];
    for (size_t i = 0; i < static_cast<size_t>(nodes_); ++i) {
      mine.send[i] = b.send[i];
      mine.bytes[i] = b.send_bytes[i];
    }
    const cudaStream_t ds = domain_.stream(rank);
    if (stream != ds) {  // the caller's stream's earlier work before the barrier on the domain's stream
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(bridge_[me][0], stream));
      RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ds, bridge_[me][0], 0));
    }
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kInterNodeCopy));
    // From here on every rank reaches the second barrier, whatever goes wrong, so its peers do not
    // time out; the first error is returned after it.
    Status first;
    for (int32_t a = 0; a < nodes_; ++a) {
      const int32_t from = a * per_node_ + local;
      const Posted& p = posted_[static_cast<size_t>(from)];
      const int64_t want = b.recv_bytes[static_cast<size_t>(a)], sent = p.bytes[static_cast<size_t>(node)];
      if (want != sent) {
        if (first.ok())
          first = InvalidArgument(Prefix(rank) + "recv_bytes[" + std::to_string(a) + "] = " + std::to_string(want) +
                                  " but rank " + std::to_string(from) + " (node " + std::to_string(a) + ") sends " +
                                  std::to_string(sent) + " bytes to node " + std::to_string(node) +
                                  " (exchange the counts first)");
        continue;
      }
      if (want == 0) continue;
      Status s = cuda::CudaStatus(cudaMemcpyPeerAsync(b.recv[static_cast<size_t>(a)], domain_.device(rank),
                                                      p.send[static_cast<size_t>(node)], domain_.device(from),
                                                      static_cast<size_t>(want), ds),
                                  "cudaMemcpyPeerAsync", __FILE__, __LINE__);
      if (!s.ok() && first.ok()) first = std::move(s);
    }
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kInterNodeCopyDone));
    if (stream != ds) {  // the caller's later work after the copies and the second barrier
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(bridge_[me][1], ds));
      RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, bridge_[me][1], 0));
    }
    return first;
  }

 private:
  // A rank's row of the table: written by the rank before the first barrier, read by its receivers
  // between the two barriers (the barriers' host rendezvous orders both).
  struct Posted {
    std::vector<const void*> send;  // [N] device pointers on the sender's GPU
    std::vector<int64_t> bytes;     // [N]
  };
  std::vector<Posted> posted_;                      // [W]
  std::vector<std::array<cudaEvent_t, 2>> bridge_;  // [W] local ranks: caller stream -> domain stream, and back
};

}  // namespace

StatusOr<std::unique_ptr<DeviceInterNodeExchange>> MakeDeviceCopyInterNodeExchange(CudaDomain& domain,
                                                                                   NodeConfig nodes) {
  RDEP_RETURN_IF_ERROR(nodes.Validate(domain.num_ranks()));
  if (nodes.nodes > 1 && (domain.bootstrap() != nullptr || !domain.joins_barriers()))
    return FailedPrecondition("device-copy inter-node exchange: needs ranks sharing GPUs in one process whose barriers are "
                              "joins of the ranks' threads (which also order the table of send buffers; not with "
                              "CudaDomainOptions::kernel_barriers), or N=1; this domain is " + domain.placement() +
                              (domain.shares_gpus() ? " with barrier kernels" : "") +
                              ": use the nccl exchange (MakeNcclInterNodeExchange)");
  std::unique_ptr<DeviceCopyInterNode> x(new DeviceCopyInterNode(domain, nodes));
  RDEP_RETURN_IF_ERROR(x->Init());
  return std::unique_ptr<DeviceInterNodeExchange>(std::move(x));
}

}  // namespace rdep
