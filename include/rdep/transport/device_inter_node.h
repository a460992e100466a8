// The inter-node phase of a hierarchical domain on GPUs (seeds 004), the device counterpart of
// inter_node.h's host exchange: W = N*G ranks of a CudaDomain form N nodes of G consecutive ranks
// (rank = node*G + local), and a rank exchanges device buffers only with the ranks of its own local
// index, one per node (the first hop of the two-phase dispatch, the last hop of combine). Two
// implementations behind one interface:
//   nccl         one NCCL communicator per local index (its N ranks; NCCL rank = node), grouped
//                ncclSend/ncclRecv on the caller's stream. Every rank of a communicator needs its own
//                GPU. One process over several GPUs: ncclCommInitAll per local index; one process per
//                GPU (CudaDomain::CreateMultiProcess): ncclCommInitRank, the unique id of each
//                communicator travelling through the domain's bootstrap allgather. To emulate nodes on
//                one host, force NCCL onto its network transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1).
//   device-copy  ranks sharing GPUs in one process (NCCL refuses two ranks of a communicator on one
//                GPU): each sender publishes its buffers in a host-side table, the domain's barrier
//                (there a stream-ordered join) orders the senders' earlier work, each receiver copies
//                from its peers' buffers on its stream (cudaMemcpyPeerAsync), and a second barrier lets
//                senders reuse their buffers.
// MakeDeviceInterNodeExchange picks one from the domain's placement. Only in CUDA builds.
//
//   auto x = MakeDeviceInterNodeExchange(*domain, NodeConfig{.nodes = N});  // outside Run; collective
//   domain->Run([&](int32_t rank) -> Status {                               // across processes
//     cudaStream_t s = domain->stream(rank);
//     RDEP_RETURN_IF_ERROR((*x)->ExchangeCounts(rank, send_bytes, recv_bytes, s));  // may synchronize
//     RDEP_RETURN_IF_ERROR((*x)->AllToAllV(rank, {send, send_bytes, recv, recv_bytes}, s));  // enqueued
//     return domain->Synchronize(rank);
//   });
//
// Tests: ctest --test-dir build -R 'DeviceInterNode|DeviceCopyInterNode|NcclInterNode' --output-on-failure
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "rdep/status.h"
#include "rdep/transport/cuda_domain.h"
#include "rdep/transport/inter_node.h"  // NodeConfig

namespace rdep {

// One rank's buffers for one exchange, indexed by node (N entries each). Pointers are device memory
// of the rank's GPU (a pointer may be null where its size is 0); byte counts are host values.
// send[b] (send_bytes[b] bytes) goes to the rank with this rank's local index on node b; recv[a]
// receives recv_bytes[a] bytes from the one on node a, and must be exactly what that rank passes as
// its send_bytes[this node] (exchange the counts first). recv[own node] gets send[own node] (a
// device-to-device copy). No recv range may overlap another recv or send range.
struct DeviceExchangeBuffers {
  std::span<const void* const> send;
  std::span<const int64_t> send_bytes;
  std::span<void* const> recv;
  std::span<const int64_t> recv_bytes;
};

class DeviceInterNodeExchange {
 public:
  virtual ~DeviceInterNodeExchange() = default;
  virtual int32_t num_nodes() const = 0;
  virtual int32_t ranks_per_node() const = 0;
  // "nccl" or "device-copy".
  virtual const char* name() const = 0;
  // One line for logs, e.g. "nccl 2.28.9: 4 communicators (one per local index) of 2 ranks, ...".
  virtual std::string description() const = 0;

  // Collective over every rank of the domain (each local rank's thread inside CudaDomain::Run, in the
  // same order as the domain's other collectives). Enqueues the exchange on `stream` (a stream of the
  // rank's GPU, usually domain.stream(rank)) after the stream's earlier work: the stream's later work
  // sees recv filled, and a sender's later work (on its stream) may overwrite its send buffers.
  // Never waits for the device on the host. device-copy: the ranks' host threads meet twice (the
  // domain's join barriers, bounded by its barrier timeout: a missing rank is a Timeout naming it);
  // a recv_bytes[a] that differs from what node a's rank sends is InvalidArgument naming both ranks,
  // returned after the collective completes (nothing copied for that pair). nccl: sizes must match
  // (not checked: NCCL's behaviour is undefined otherwise) and NCCL has no timeout.
  // Bad input (entries per node, negative sizes, null with a non-zero size, own-node sizes that
  // differ) is InvalidArgument naming the field, returned before communicating: the other ranks then
  // fail too (device-copy: Timeout at the barrier naming this rank; nccl: their transfers never
  // complete, so destroy this object before the domain is used again).
  virtual Status AllToAllV(int32_t rank, const DeviceExchangeBuffers& buffers, cudaStream_t stream) = 0;

  // Counts exchange (collective like AllToAllV): sends send_counts[b] to node b's rank with this
  // local index and receives recv_counts[a] from node a's (host spans of N entries; counts >= 0).
  // Synchronizes `stream` (its earlier work included) before returning. For counts kept in device
  // memory, call AllToAllV with 8-byte buffers (send[b] = counts + b, recv[a] = received + a): no
  // host synchronization.
  virtual Status ExchangeCounts(int32_t rank, std::span<const int64_t> send_counts, std::span<int64_t> recv_counts,
                                cudaStream_t stream) = 0;
};

// Chooses from the domain's placement: N = 1 (nothing crosses nodes) or ranks sharing GPUs in one
// process -> device-copy; otherwise nccl (Unavailable, naming what is missing, in a build without
// NCCL). Checks `nodes` against W first (InvalidArgument naming the field). The domain must outlive
// the exchange. Call outside Run: on the domain's thread (one process) or once in every process
// (one process per GPU: collective, and every process must pass the same NodeConfig).
StatusOr<std::unique_ptr<DeviceInterNodeExchange>> MakeDeviceInterNodeExchange(CudaDomain& domain, NodeConfig nodes);

// NCCL, whatever the placement: InvalidArgument naming the ranks and the GPU when two ranks of one
// communicator (same local index) share a GPU; Unavailable in a build without NCCL. Ranks of different
// communicators may share a GPU, but NCCL kernels of several communicators on one GPU can deadlock
// when they cannot be resident together, so the chooser above never does that. NCCL_NVLS_ENABLE is
// set to 0 when unset (the exchange is point-to-point only; NVLink multicast is never wanted).
StatusOr<std::unique_ptr<DeviceInterNodeExchange>> MakeNcclInterNodeExchange(CudaDomain& domain, NodeConfig nodes);

// Device copies: needs one process whose ranks share GPUs with barriers that are joins of the ranks'
// host threads (which also order the pointer table; not CudaDomainOptions::kernel_barriers), or N = 1
// (no peer is read).
// FailedPrecondition naming the placement otherwise.
StatusOr<std::unique_ptr<DeviceInterNodeExchange>> MakeDeviceCopyInterNodeExchange(CudaDomain& domain,
                                                                                   NodeConfig nodes);

}  // namespace rdep
