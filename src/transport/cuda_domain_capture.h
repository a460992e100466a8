// CudaDomain's capture state (BeginCapture / EndCapture, cuda_domain_capture.cc): internal to the transport
// library, included where the domain is destroyed.
#ifndef RDEP_SRC_TRANSPORT_CUDA_DOMAIN_CAPTURE_H_
#define RDEP_SRC_TRANSPORT_CUDA_DOMAIN_CAPTURE_H_

#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "rdep/transport/cuda_domain.h"

namespace rdep {

struct CudaDomain::CaptureState {
  // The rendezvous of the local ranks' threads: each arrives with a step tag and its own outcome; the last
  // one publishes whether every rank's outcome was good. A timeout or a tag mismatch breaks the state for
  // good (`broken`): later captures on the domain are refused, and no rank can pair with another's step.
  std::mutex mu;
  std::condition_variable cv;
  size_t waiting = 0;
  uint64_t generation = 0;
  int tag = 0;
  bool all_ok = true, result = true, broken = false;

  cudaEvent_t fork = nullptr;        // recorded on the capturing stream after the capture began
  std::vector<cudaEvent_t> join;     // [W] each local rank's, on its own device, made before any capture
  bool open = false;                 // the first local rank's capture has begun and not ended
  cudaError_t ended = cudaSuccess;   // the first local rank's cudaStreamEndCapture, for every rank
  cudaGraph_t graph = nullptr;       // what the capture made, handed to the first local rank

  explicit CaptureState(size_t num_ranks) : join(num_ranks, nullptr) {}
  ~CaptureState() {
    if (fork) cudaEventDestroy(fork);
    for (cudaEvent_t e : join)
      if (e) cudaEventDestroy(e);
  }
};

}  // namespace rdep

#endif  // RDEP_SRC_TRANSPORT_CUDA_DOMAIN_CAPTURE_H_
