// Weight distribution to replicas by tile streaming (issue 16): each job is one replicated expert's
// weights (contiguous bytes at its owner) and the slots it must reach; a persistent kernel walks every
// job's tiles, and each block loads a tile of the source once and stores it to every destination of
// its job (peer pointers from CudaDomain::peer_table, or local ones). One launch per stage; a
// two-stage relay is two launches with a barrier between them, the second reading the relays' copies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "rdep/status.h"

namespace rdep::dispatch {

inline constexpr int64_t kDefaultStreamTileBytes = 64 * 1024;

struct StreamDeviceJob;  // a job as the kernel reads it (weight_stream.cu)

struct StreamJob {
  const void* src = nullptr;  // the owner's weights
  int64_t bytes = 0;
  std::vector<void*> dst;     // every slot that receives them (disjoint from src and from each other)
};

// The jobs of one stage as device arrays: built on the host, copied once, reusable across launches.
class StreamPlan {
 public:
  // Validates (non-null pointers, bytes >= 0, tile_bytes a positive multiple of 16) and uploads.
  static StatusOr<StreamPlan> Create(const std::vector<StreamJob>& jobs, int64_t tile_bytes = kDefaultStreamTileBytes);
  StreamPlan(StreamPlan&& o) noexcept;
  StreamPlan& operator=(StreamPlan&& o) noexcept;
  StreamPlan(const StreamPlan&) = delete;
  StreamPlan& operator=(const StreamPlan&) = delete;
  ~StreamPlan();

  int64_t total_tiles() const { return total_tiles_; }
  int64_t bytes_read() const { return bytes_read_; }        // sum of job bytes: each source byte read once
  int64_t bytes_written() const { return bytes_written_; }  // sum of job bytes x destinations

  // Streams every job on `stream` with `blocks` persistent blocks (0 = two per SM of the current
  // device): the SM budget the copy takes from concurrent work.
  Status Launch(cudaStream_t stream, int blocks = 0) const;

 private:
  StreamPlan() = default;
  void Release();
  StreamDeviceJob* jobs_ = nullptr;  // [J]
  void** dst_ = nullptr;             // [D] all destinations, job by job
  int64_t* tile_prefix_ = nullptr;   // [J+1] first tile of each job
  int32_t num_jobs_ = 0;
  int64_t total_tiles_ = 0, tile_bytes_ = 0, bytes_read_ = 0, bytes_written_ = 0;
};

}  // namespace rdep::dispatch
