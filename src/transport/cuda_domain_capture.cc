// CudaDomain::BeginCapture / EndCapture: the local ranks' work captured as one CUDA graph (see the header).
// BeginCapture: the first local rank's stream begins the capture (thread-local mode) and records `fork`; after
// a rendezvous of the ranks' threads the other ranks' streams wait on it, which joins them to the capture, and
// a second rendezvous agrees that all joined. EndCapture: the other ranks record their `join` events; after a
// rendezvous the capturing stream waits on them and ends the capture, and a last rendezvous hands every rank
// the outcome. Every rendezvous combines the ranks' outcomes, so all ranks return the same success or
// failure; on any failure the first local rank ends (and discards) the capture before returning, since only
// the thread that began a thread-local capture can end it. A timeout (a rank that never arrives) breaks the
// domain's capture state for good.
#include "cuda_domain_capture.h"

#include <chrono>
#include <string>

#include "rdep/cuda/check.h"

namespace rdep {
namespace {

constexpr int kBeginStarted = 1, kBeginJoined = 2, kEndRecorded = 3, kEndDone = 4;

Status AnotherRankFailed(const char* step) {
  return FailedPrecondition(std::string("graph capture: another local rank failed to ") + step +
                            " (its own error names the cause); the capture was discarded");
}

}  // namespace

StatusOr<bool> CudaDomain::CaptureRendezvous(CaptureState& c, int tag, bool ok) {
  const size_t ranks = local_ranks().size();
  std::unique_lock<std::mutex> lock(c.mu);
  if (c.broken) return FailedPrecondition("graph capture: an earlier capture on this domain failed at a rendezvous (a "
                                          "rank timed out or ranks were at different steps); make a new domain to capture");
  if (c.waiting == 0) {
    c.tag = tag;
    c.all_ok = true;
  } else if (c.tag != tag) {
    c.broken = true;
    c.cv.notify_all();
    return InternalError("graph capture: the local ranks are at different steps (BeginCapture / EndCapture called "
                         "out of turn on some rank)");
  }
  c.all_ok = c.all_ok && ok;
  const uint64_t gen = c.generation;
  if (++c.waiting == ranks) {
    c.waiting = 0;
    c.result = c.all_ok;
    ++c.generation;
    c.cv.notify_all();
    return c.result;
  }
  const auto bound = std::chrono::duration<double>(options_.barrier_timeout_s);
  const bool woke = c.cv.wait_for(lock, bound, [&] { return c.generation != gen || c.broken; });
  if (c.generation != gen) return c.result;
  c.broken = true;
  c.cv.notify_all();
  if (!woke)
    return TimeoutError("graph capture: the local ranks did not all reach BeginCapture / EndCapture within " +
                        std::to_string(options_.barrier_timeout_s) + " s (every local rank's thread must call both)");
  return InternalError("graph capture: another local rank broke the rendezvous (a timeout or a step out of turn)");
}

void CudaDomain::DiscardCapture(int32_t rank) {
  CaptureState& c = *capture_;
  if (rank != local_ranks().front() || !c.open) return;
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream(rank), &graph);  // ends it on the thread that began it; the error is the caller's
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  c.open = false;
}

Status CudaDomain::BeginCapture(int32_t rank) {
  const std::vector<int32_t> local = local_ranks();
  if (local.size() == 1) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream(rank), cudaStreamCaptureModeThreadLocal));
    return Status::Ok();
  }
  CaptureState& c = *capture_;
  const int32_t first = local.front();
  const auto me = static_cast<size_t>(rank);
  cudaError_t err = c.join[me] ? cudaSuccess : cudaEventCreateWithFlags(&c.join[me], cudaEventDisableTiming);
  const char* what = "cudaEventCreateWithFlags";
  if (rank == first && err == cudaSuccess) {
    if (!c.fork) err = cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming);
    if (err == cudaSuccess) {
      err = cudaStreamBeginCapture(stream(first), cudaStreamCaptureModeThreadLocal);
      what = "cudaStreamBeginCapture";
      c.open = err == cudaSuccess;
    }
    if (err == cudaSuccess) err = cudaEventRecord(c.fork, stream(first)), what = "cudaEventRecord (fork)";
  }
  for (int step : {kBeginStarted, kBeginJoined}) {
    if (step == kBeginJoined && rank != first && err == cudaSuccess)
      err = cudaStreamWaitEvent(stream(rank), c.fork, 0), what = "cudaStreamWaitEvent (fork)";
    auto all = CaptureRendezvous(c, step, err == cudaSuccess);
    if (!all.ok() || !*all) {
      DiscardCapture(rank);
      if (err != cudaSuccess) return cuda::CudaStatus(err, what, __FILE__, __LINE__);
      return all.ok() ? AnotherRankFailed("begin or join the capture") : all.status();
    }
  }
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
  // A failed record leaves this stream unjoined: the rendezvous tells every rank, and the capture is discarded.
  const cudaError_t recorded = rank == first ? cudaSuccess : cudaEventRecord(c.join[static_cast<size_t>(rank)], stream(rank));
  auto all = CaptureRendezvous(c, kEndRecorded, recorded == cudaSuccess);
  if (!all.ok()) {
    DiscardCapture(rank);
    return all.status();
  }
  if (rank == first) {
    cudaError_t waited = cudaSuccess;
    for (int32_t r : local)
      if (*all && r != first && waited == cudaSuccess) waited = cudaStreamWaitEvent(stream(first), c.join[static_cast<size_t>(r)], 0);
    c.graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream(first), &c.graph);  // always ended, whatever came before
    c.open = false;
    c.ended = waited != cudaSuccess ? waited : end;
    if ((!*all || c.ended != cudaSuccess) && c.graph) {
      cudaGraphDestroy(c.graph);
      c.graph = nullptr;
    }
  }
  auto done = CaptureRendezvous(c, kEndDone, true);
  if (!done.ok()) {
    if (rank == first && c.graph) cudaGraphDestroy(c.graph);
    if (rank == first) c.graph = nullptr;
    return done.status();
  }
  if (recorded != cudaSuccess) return cuda::CudaStatus(recorded, "cudaEventRecord (join)", __FILE__, __LINE__);
  if (!*all) return AnotherRankFailed("record its join event");
  if (c.ended != cudaSuccess) return cuda::CudaStatus(c.ended, "EndCapture (the first local rank's cudaStreamEndCapture)", __FILE__, __LINE__);
  return rank == first ? c.graph : nullptr;
}

}  // namespace rdep
