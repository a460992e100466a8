// CudaDomain::BeginCapture / EndCapture: the local ranks' work captured as one CUDA graph (see the header).
// The first local rank's stream begins the capture and records `fork`; after a host rendezvous of the
// ranks' threads the other ranks' streams wait on it, which joins them to the capture. At the end each
// other rank records its `join` event; after a rendezvous the capturing stream waits on them all and ends
// the capture, and a last rendezvous hands every rank the outcome.
#include "cuda_domain_capture.h"

#include <chrono>
#include <string>

#include "rdep/cuda/check.h"

namespace rdep {

Status CudaDomain::CaptureRendezvous(CaptureState& c) {
  const size_t ranks = local_ranks().size();
  std::unique_lock<std::mutex> lock(c.mu);
  const uint64_t gen = c.generation;
  if (++c.waiting == ranks) {
    c.waiting = 0;
    ++c.generation;
    c.cv.notify_all();
    return Status::Ok();
  }
  const auto bound = std::chrono::duration<double>(options_.barrier_timeout_s);
  if (!c.cv.wait_for(lock, bound, [&] { return c.generation != gen; })) {
    --c.waiting;
    return TimeoutError("graph capture: the local ranks did not all reach BeginCapture / EndCapture within " +
                        std::to_string(options_.barrier_timeout_s) + " s (every local rank's thread must call both)");
  }
  return Status::Ok();
}

Status CudaDomain::BeginCapture(int32_t rank) {
  if (num_ranks_ > 1 && !shared_)
    return FailedPrecondition(
        "graph capture: this domain's ranks (one per GPU) synchronize through barrier kernels that take their epoch "
        "from the host, so every replay would repeat the captured epochs and pass its barriers without waiting; "
        "capture is supported at W = 1 and where ranks share GPUs (their barriers are then stream-ordered joins)");
  const std::vector<int32_t> local = local_ranks();
  if (local.size() == 1) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream(rank), cudaStreamCaptureModeThreadLocal));
    return Status::Ok();
  }
  CaptureState& c = *capture_;
  const int32_t first = local.front();
  const auto me = static_cast<size_t>(rank);
  if (!c.join[me]) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&c.join[me], cudaEventDisableTiming));
  if (rank == first) {
    c.begun = c.fork ? cudaSuccess : cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming);
    if (c.begun == cudaSuccess) c.begun = cudaStreamBeginCapture(stream(first), cudaStreamCaptureModeThreadLocal);
    if (c.begun == cudaSuccess) c.begun = cudaEventRecord(c.fork, stream(first));
  }
  RDEP_RETURN_IF_ERROR(CaptureRendezvous(c));
  RDEP_RETURN_IF_ERROR(cuda::CudaStatus(c.begun, "BeginCapture (the first local rank's cudaStreamBeginCapture)", __FILE__, __LINE__));
  if (rank != first) RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream(rank), c.fork, 0));
  return Status::Ok();
}

StatusOr<cudaGraph_t> CudaDomain::EndCapture(int32_t rank) {
  const std::vector<int32_t> local = local_ranks();
  if (local.size() == 1) {
    cudaGraph_t graph = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream(rank), &graph));
    return graph;
  }
  CaptureState& c = *capture_;
  const int32_t first = local.front();
  // A failed record leaves this stream unjoined: the capture's end then fails and says so.
  const cudaError_t recorded = rank == first ? cudaSuccess : cudaEventRecord(c.join[static_cast<size_t>(rank)], stream(rank));
  RDEP_RETURN_IF_ERROR(CaptureRendezvous(c));
  if (rank == first) {
    c.ended = cudaSuccess;
    for (int32_t r : local)
      if (r != first && c.ended == cudaSuccess) c.ended = cudaStreamWaitEvent(stream(first), c.join[static_cast<size_t>(r)], 0);
    c.graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream(first), &c.graph);  // always ended, whatever came before
    if (c.ended == cudaSuccess) c.ended = end;
  }
  RDEP_RETURN_IF_ERROR(CaptureRendezvous(c));
  RDEP_RETURN_IF_ERROR(cuda::CudaStatus(recorded, "EndCapture (this rank's join event)", __FILE__, __LINE__));
  if (c.ended != cudaSuccess) {
    if (rank == first && c.graph) cudaGraphDestroy(c.graph);
    return cuda::CudaStatus(c.ended, "EndCapture (the first local rank's cudaStreamEndCapture)", __FILE__, __LINE__);
  }
  return rank == first ? c.graph : nullptr;
}

}  // namespace rdep
