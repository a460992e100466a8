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
  std::mutex mu;
  std::condition_variable cv;
  size_t waiting = 0;       // local ranks at the rendezvous now
  uint64_t generation = 0;  // rendezvous completed
  cudaEvent_t fork = nullptr;        // recorded on the capturing stream after the capture began
  std::vector<cudaEvent_t> join;     // [W] recorded by each other local rank at the end (its own device)
  cudaError_t begun = cudaSuccess;   // the first local rank's cudaStreamBeginCapture, for every rank
  cudaError_t ended = cudaSuccess;   // its cudaStreamEndCapture, for every rank
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
