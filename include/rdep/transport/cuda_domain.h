// The CUDA backend's Domain: W ranks on W GPUs, in one of two modes, same kernels, same results:
//   one process driving all local GPUs (one host thread per rank, peer access between every pair,
//   symmetric regions opened through UVA): transport "peer-access";
//   one process per GPU (under mpirun, or any launcher with a Bootstrap): every symmetric region is
//   exported and opened by each peer, through cuMem fabric handles where the driver reports support
//   ("fabric") and CUDA IPC handles otherwise ("ipc"), chosen at construction. Ranks exchange a
//   fingerprint at bootstrap (W, rank, GPU, build) and every region's size, so a mismatch is an
//   error naming the ranks, not a hang.
// Each rank has its own stream; phase barriers are device kernels with bounded waits, so a layer call
// enqueues work without host round trips. A barrier that times out records {phase, missing rank}
// in host-mapped memory and lets the stream drain; the next Synchronize() (or CheckErrors) reports
// it as a Timeout naming the rank and the phase. After such an error, recreate the domain.
// Ranks sharing a GPU (one process; `devices` repeats a GPU, e.g. RoundRobinDevices(4, 1)): a kernel
// spinning on a peer whose stream may never be scheduled (a device-wide sync of another rank's thread,
// a full GPU) can deadlock, so there every barrier is a stream-ordered join instead: each rank records
// an event on its stream, the ranks' host threads meet (bounded wait: a rank that never arrives is a
// Timeout naming it and the phase, returned by Barrier itself), then each stream waits on every peer's
// event. Same protocol, same kernels, same results; timings taken this way do not measure NVLink.
//
//   auto d = CudaDomain::CreateSingleProcess(4);
//   RegionId r = d->AllocateSymmetric(bytes, "payload");        // before Run
//   d->Run([&](int32_t rank) -> Status {                         // device already set
//     kernel<<<..., d->stream(rank)>>>(d->peer_table(rank, r), ...);   // stores into peers' copies
//     RDEP_RETURN_IF_ERROR(d->Barrier(rank, Phase::kDispatchCounts));
//     return d->Synchronize(rank);
//   });
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "rdep/status.h"
#include "rdep/transport/bootstrap.h"
#include "rdep/transport/domain.h"
#include "rdep/transport/host_domain.h"  // DomainOptions
#include "rdep/transport/phase.h"

namespace rdep {

struct CudaDomainOptions {
  double barrier_timeout_s = 10.0;  // bound on every wait for a peer (in the barrier kernel, or host-side for joins)
  std::vector<int> devices;         // device of each rank; empty = 0..W-1; a repeated device = ranks share it
  // Tests: barrier kernels even where ranks share a GPU (the default there is a host join and event waits).
  // Only for work that leaves the GPU room: a rank whose kernels fill it can keep a peer's barrier kernel
  // from running, and the barriers then time out.
  bool kernel_barriers = false;
};

// The widest domain: the device barrier's one block has a thread per rank.
constexpr int64_t kMaxCudaRanks = 1024;

// Ranks placed round-robin over the first `num_gpus` local GPUs (rank r on GPU r mod num_gpus).
std::vector<int> RoundRobinDevices(int64_t num_ranks, int num_gpus);

// What a barrier that failed, or a backward without its forward (TakeForward), recorded (host-mapped, written by
// the device). The first failure of a rank stays: every later call of the domain on that rank reports it.
struct DeviceErrorRecord {
  int32_t code;          // 0 none, 1 timeout, 2 phase mismatch, 3 epochs diverged, 4 a backward without its forward
  int32_t phase;         // Phase
  int32_t peer;          // the missing (or mismatching) rank
  int32_t peer_phase;    // mismatch, divergence: the phase the peer announced
  uint64_t epoch;        // the barrier's sequence number on this rank
  uint64_t peer_epoch;   // divergence: the peer's (more than one ahead)
};

class CudaDomain final : public Domain {
 public:
  static StatusOr<std::unique_ptr<CudaDomain>> CreateSingleProcess(int64_t num_ranks, CudaDomainOptions options = {});
  // This process is rank bootstrap.rank() of bootstrap.size(); its GPU is options.devices[0] if given,
  // else local_rank mod the visible device count. The bootstrap must outlive the domain.
  static StatusOr<std::unique_ptr<CudaDomain>> CreateMultiProcess(Bootstrap& bootstrap, CudaDomainOptions options = {});
  ~CudaDomain();
  CudaDomain(const CudaDomain&) = delete;
  CudaDomain& operator=(const CudaDomain&) = delete;

  int32_t num_ranks() const override { return num_ranks_; }
  // Whether `rank` is driven by this process (all ranks in one-process mode, one otherwise).
  bool is_local(int32_t rank) const { return bootstrap_ == nullptr || rank == bootstrap_->rank(); }
  // The ranks this process drives, ascending.
  std::vector<int32_t> local_ranks() const override;
  int device(int32_t rank) const { return devices_[static_cast<size_t>(rank)]; }  // local ranks only
  cudaStream_t stream(int32_t rank) const { return streams_[static_cast<size_t>(rank)]; }  // local ranks only
  // The multi-process bootstrap, or null in one-process mode.
  Bootstrap* bootstrap() const { return bootstrap_; }
  // Fails unless every process passed the same bytes (no-op in one-process mode). Collective.
  Status AgreeAcrossRanks(const std::vector<uint8_t>& mine, const std::string& what,
                          const std::function<std::string(const std::vector<uint8_t>&)>& describe);
  const char* backend_name() const override { return "cuda"; }
  // How peers' memory is opened: "peer-access" (one process), "ipc" or "fabric" (one process per GPU).
  std::string transport_name() const override { return transport_; }
  const CudaDomainOptions& options() const { return options_; }
  // Whether two ranks of this process share a GPU (barriers are then stream-ordered joins, unless
  // kernel_barriers).
  bool shares_gpus() const { return shared_; }
  // Whether barriers are host joins with stream waits (ranks sharing GPUs, unless kernel_barriers).
  bool joins_barriers() const { return joins_; }
  // "4 ranks on 1 GPU (GPU 0: ranks 0-3); ranks share GPUs: timings do not measure NVLink", or
  // "4 ranks on 4 GPUs (rank r on GPU r)"; multi-process: "rank 2 of 4 on GPU 2".
  std::string placement() const override;

  // cudaMalloc of `bytes` on every rank's device, zero-filled. Not callable during Run.
  StatusOr<RegionId> AllocateSymmetric(size_t bytes, const std::string& name) override;
  // Releases a region (collective, like its allocation; no rank may use it afterwards). Its id is not
  // reused. Layers free their regions when destroyed.
  void FreeSymmetric(RegionId id) override;
  // Base of region `id` on `rank`, as a pointer usable from any rank's device.
  void* region(int32_t rank, RegionId id) const;
  void* region_base(int32_t rank, RegionId id) const override { return region(rank, id); }
  // A device array (on `viewer`'s device) of the W ranks' base pointers of region `id`.
  void* const* peer_table(int32_t viewer, RegionId id) const;
  size_t symmetric_bytes_per_rank() const override;

  // Runs fn(rank) for every local rank, each on its own host thread with its device current. Same
  // error contract as HostDomain::Run: the first failing rank's error, prefixed with its rank.
  Status Run(const std::function<Status(int32_t rank)>& fn) override;

  // Enqueues a phase barrier on rank's stream: a one-block kernel with in-kernel bounded waits, or,
  // where ranks share a GPU (unless kernel_barriers), a host rendezvous of the ranks' threads and stream
  // waits on their events.
  // Nothing at W = 1 (the stream's order already orders the rank's work).
  Status Barrier(int32_t rank, Phase phase) override;
  // Synchronizes rank's stream and reports a device-recorded barrier failure, if any.
  Status Synchronize(int32_t rank) override;
  Status CheckErrors(int32_t rank);
  // A backward's check that its context holds a forward: `armed` is a device word of the context that each forward
  // sets as it completes (on the rank's stream, so also in every replay of a captured forward). Enqueues its take
  // (cleared for the next forward) or, where no forward set it since the last backward took it (a CUDA graph's
  // backward replayed, or recorded again, without its forward's replay in between), the rank's error record (code 4)
  // and, inside a capture, a trap as a failed barrier's. The host refuses such an eager backward before it gets here,
  // unless rdep_context_rearm vouched for the context.
  Status TakeForward(int32_t rank, int32_t* armed);

  // CUDA-graph capture of the work of every local rank as one graph (cuda_domain_capture.cc). Collective
  // over the local ranks' threads (inside Run): each calls BeginCapture, issues its work (a layer's
  // Forward, Backward), then EndCapture. The first local rank's stream captures; the others' streams join
  // it through an event and rejoin it at the end, so their work and the barriers between the ranks (event
  // edges where ranks share a GPU, barrier kernels otherwise) land in one graph, which EndCapture returns
  // to the first local rank (nullptr to the others; every rank gets the capture's error, if any). Launch
  // it on stream(local_ranks().front()): one launch runs every local rank's work. With one local rank (W = 1,
  // or one process per GPU) it is a plain capture of the rank's stream. Barrier kernels count their epochs
  // on the device, so replays synchronize as eager calls do, provided a rank's barriers never run two at
  // once: order every launch of such a graph against every local rank's stream, before and after (each
  // rank's eager work done, as Synchronize leaves it; the launch done before the ranks' streams run more).
  // Where ranks live in several processes, every process must replay its graphs (and make its eager
  // calls) in the same order, as with NCCL in graphs. Epoch counts that diverge anyway are reported
  // (CheckErrors: "epochs diverged") rather than passed silently.
  // All local ranks get the same outcome; on a failure the capture is ended and discarded (by the first
  // local rank's thread, which began it). Every rank that called BeginCapture successfully must call
  // EndCapture, whatever its work did in between; a rank that never arrives times out the others
  // (barrier_timeout_s) and leaves the domain unable to capture again.
  Status BeginCapture(int32_t rank);
  StatusOr<cudaGraph_t> EndCapture(int32_t rank);

 private:
  struct Region {
    std::string name;
    size_t bytes = 0;
    std::vector<void*> base;          // [W] pointers usable in this process (peers' opened handles)
    std::vector<void**> tables;       // [W] device arrays of W pointers, one per local viewer
    // multi-process bookkeeping
    uint64_t fabric_handle = 0;       // CUmemGenericAllocationHandle of the local allocation (fabric)
    size_t mapped_bytes = 0;          // granularity-rounded size of each mapping (fabric)
    bool freed = false;
  };
  struct JoinState;  // ranks sharing a GPU: the host rendezvous and each rank's barrier events
  struct CaptureState;  // BeginCapture / EndCapture: the local ranks' rendezvous and fork / join events
  CudaDomain();
  StatusOr<bool> CaptureRendezvous(CaptureState& c, int tag, bool ok);
  void DiscardCapture(int32_t rank);
  Status InitJoin();
  Status JoinBarrier(int32_t rank, Phase phase, uint64_t epoch);
  Status AllocateLocal(Region& r, size_t bytes);
  Status OpenPeers(Region& r);
  Status ProbeFabric(std::string* why_not);
  void FreeRegion(Region& r);

  int32_t num_ranks_ = 0;
  CudaDomainOptions options_;
  std::string transport_ = "peer-access";
  Bootstrap* bootstrap_ = nullptr;             // multi-process mode
  bool fabric_ = false;                        // multi-process: cuMem fabric handles instead of IPC
  std::vector<int> devices_;
  std::vector<cudaStream_t> streams_;
  std::vector<Region> regions_;
  RegionId barrier_region_ = -1;               // per rank: uint64 slots[W], then its own epoch counter
  std::vector<uint64_t> epoch_;                // per rank, the host joins' epochs (monotonically increasing)
  DeviceErrorRecord* errors_ = nullptr;        // host-mapped [W]
  std::vector<DeviceErrorRecord*> errors_dev_; // device views of errors_ + rank
  bool running_ = false;
  bool shared_ = false;                        // some GPU holds several ranks
  bool joins_ = false;                         // barriers are host joins (shared_, unless kernel_barriers)
  std::unique_ptr<JoinState> join_;
  std::unique_ptr<CaptureState> capture_;
};

// Launches the barrier kernel (cuda_barrier.cu). slot_table[r] points at rank r's num_ranks + 1 uint64 slots
// (the last: r's epoch counter, advanced by each of r's barriers). trap: after writing the error record, a failed
// barrier traps (the CUDA context stops with an error): CudaDomain::Barrier asks for it when the stream is capturing.
Status LaunchPhaseBarrier(void* const* slot_table, int32_t rank, int32_t num_ranks, Phase phase, double timeout_s,
                          DeviceErrorRecord* error, cudaStream_t stream, bool trap = false);

// Launches TakeForward's one-thread kernel (cuda_barrier.cu).
Status LaunchTakeForward(int32_t* armed, DeviceErrorRecord* error, cudaStream_t stream, bool trap);

// Smoke test store: rank writes 1000*rank + q into slot `rank` of every peer q's int64 region.
Status LaunchSmokeStore(void* const* table, int32_t rank, int32_t num_ranks, cudaStream_t stream);

}  // namespace rdep
