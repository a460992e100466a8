// Device-side phase barrier over peer-visible slots (seeds 000 A.1 barrier[W]).
// The epoch is counted on the device: slot W of a rank's own array holds the last epoch it announced, which
// the kernel advances with plain accesses, so a CUDA graph's replays count on from where the previous call
// left off instead of repeating the epochs captured. That needs a rank's barriers to run one after another,
// never two at once: eager calls and graph launches must be ordered against each other on every local rank's
// stream (CudaDomain::BeginCapture says so). A peer's tag can be at most one epoch ahead (it needs this rank's
// tag of e+1 to pass e+1); a tag further ahead means the counts diverged, reported as error code 3. Rank r announces
// `epoch` by a system-scope release store of (epoch << 16 | phase) into slot r of every peer, then thread p
// waits (acquire) until its own slot p reaches the epoch, bounded by %globaltimer. Prior kernels on the
// stream have completed, so their peer stores are visible first: the kernel begins with cuda::WaitForPrimaryGrid
// (launched with PDL it starts as the previous kernel's blocks exit, and waits there for that kernel's completion
// and memory, which is what a plain launch's stream order gave), and its release store follows.
// A failed barrier writes the rank's error record (mapped host memory), which the next call on the domain reads
// (CudaDomain::CheckErrors). A barrier recorded in a CUDA graph (`trap`) has no next call to read it: its replays
// run no host code, and a replay that went on would run on a peer's missing data. So a captured barrier also traps
// after writing the record: the CUDA context stops with an error the caller sees at its next synchronization, and
// the record (rdep_layer_check_errors, CudaDomain::CheckErrors) says which barrier, rank and phase.
#include <cuda/atomic>

#include "rdep/cuda/check.h"
#include "rdep/transport/cuda_domain.h"
#include "launch/pdl.h"

namespace rdep {
namespace {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Writes the error record once (the first failing thread of any barrier of this rank), then traps if asked.
__device__ void Fail(DeviceErrorRecord* error, int32_t code, uint32_t phase, int p, uint64_t v, uint64_t epoch, bool trap) {
  if (atomicCAS(&error->code, 0, code) == 0) {
    error->phase = static_cast<int32_t>(phase);
    error->peer = p;
    error->peer_phase = code == 1 ? 0 : static_cast<int32_t>(v & 0xFFFF);
    error->epoch = epoch;
    error->peer_epoch = code == 3 ? v >> 16 : 0;
    __threadfence_system();
  }
  if (trap) __trap();
}

__global__ void PhaseBarrierKernel(void* const* slot_table, int32_t rank, int32_t num_ranks, uint32_t phase,
                                   uint64_t timeout_ns, DeviceErrorRecord* error, bool trap) {
  cuda::WaitForPrimaryGrid();
  __shared__ uint64_t next_epoch;
  const int p = static_cast<int>(threadIdx.x);
  if (p == 0) {
    uint64_t* counter = static_cast<uint64_t*>(slot_table[rank]) + num_ranks;
    next_epoch = *counter + 1;
    *counter = next_epoch;
  }
  __syncthreads();
  const uint64_t epoch = next_epoch;
  if (p >= num_ranks) return;
  const uint64_t tag = (epoch << 16) | phase;
  __threadfence_system();
  {
    auto* peer_slots = static_cast<uint64_t*>(slot_table[p]);
    ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system> slot(peer_slots[rank]);
    slot.store(tag, ::cuda::memory_order_release);
  }
  auto* mine = static_cast<uint64_t*>(slot_table[rank]);
  ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system> wait(mine[p]);
  const uint64_t start = GlobalTimerNs();
  uint64_t v = wait.load(::cuda::memory_order_acquire);
  while ((v >> 16) < epoch) {
    if (GlobalTimerNs() - start > timeout_ns) {
      Fail(error, 1, phase, p, v, epoch, trap);
      return;
    }
    __nanosleep(64);
    v = wait.load(::cuda::memory_order_acquire);
  }
  if ((v >> 16) > epoch + 1) {
    Fail(error, 3, phase, p, v, epoch, trap);
    return;
  }
  if ((v >> 16) == epoch && (v & 0xFFFF) != phase) Fail(error, 2, phase, p, v, epoch, trap);
}

__global__ void TakeForwardKernel(int32_t* armed, DeviceErrorRecord* error, bool trap) {
  cuda::WaitForPrimaryGrid();
  if (*armed == 0) {
    Fail(error, 4, 0, -1, 0, 0, trap);  // code 4 uses no other field
    return;
  }
  *armed = 0;
}

}  // namespace

Status LaunchTakeForward(int32_t* armed, DeviceErrorRecord* error, cudaStream_t stream, bool trap) {
  RDEP_LAUNCH_PDL(TakeForwardKernel, 1, 1, 0, stream, armed, error, trap);
  return Status::Ok();
}

Status LaunchPhaseBarrier(void* const* slot_table, int32_t rank, int32_t num_ranks, Phase phase, double timeout_s,
                          DeviceErrorRecord* error, cudaStream_t stream, bool trap) {
  const int threads = ((num_ranks + 31) / 32) * 32;
  RDEP_LAUNCH_PDL(PhaseBarrierKernel, 1, threads, 0, stream, slot_table, rank, num_ranks, static_cast<uint32_t>(phase),
                  static_cast<uint64_t>(timeout_s * 1e9), error, trap);
  return Status::Ok();
}

}  // namespace rdep

namespace rdep {
namespace {
__global__ void SmokeStoreKernel(void* const* table, int32_t rank, int32_t num_ranks) {
  cuda::WaitForPrimaryGrid();
  const int q = static_cast<int>(threadIdx.x);
  if (q < num_ranks) static_cast<int64_t*>(table[q])[rank] = 1000 * static_cast<int64_t>(rank) + q;
}
}  // namespace

Status LaunchSmokeStore(void* const* table, int32_t rank, int32_t num_ranks, cudaStream_t stream) {
  RDEP_LAUNCH_PDL(SmokeStoreKernel, 1, ((num_ranks + 31) / 32) * 32, 0, stream, table, rank, num_ranks);
  return Status::Ok();
}
}  // namespace rdep
