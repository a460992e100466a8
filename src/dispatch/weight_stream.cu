#include "rdep/dispatch/weight_stream.h"

#include <algorithm>
#include <string>
#include <utility>

#include "rdep/cuda/check.h"

namespace rdep::dispatch {

struct StreamDeviceJob {
  const unsigned char* src;
  int64_t bytes;
  int32_t first_dst;
  int32_t num_dst;
  int32_t vector_ok;  // src, every dst and the tile size allow 16-byte accesses
  int32_t pad;
};

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte vectors in flight per thread per step

__device__ __forceinline__ uint4 LoadStreaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The job that holds global tile `tile` (tile_prefix is ascending with tile_prefix[0] = 0).
__device__ int32_t FindJob(const int64_t* tile_prefix, int32_t num_jobs, int64_t tile) {
  int32_t lo = 0, hi = num_jobs;  // tile_prefix[lo] <= tile < tile_prefix[hi]
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (tile_prefix[mid] <= tile) lo = mid;
    else hi = mid;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) TileStreamKernel(const StreamDeviceJob* jobs, int32_t num_jobs, void* const* dst,
                                                              const int64_t* tile_prefix, int64_t total_tiles,
                                                              int64_t tile_bytes) {
  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const int32_t j = FindJob(tile_prefix, num_jobs, tile);
    const StreamDeviceJob job = jobs[j];
    const int64_t off = (tile - tile_prefix[j]) * tile_bytes;
    const int64_t n = min(tile_bytes, job.bytes - off);
    const unsigned char* src = job.src + off;
    if (job.vector_ok && n % 16 == 0) {
      const int64_t nv = n / 16;
      const auto* s = reinterpret_cast<const uint4*>(src);
      for (int64_t base = threadIdx.x; base < nv; base += static_cast<int64_t>(kThreads) * kUnroll) {
        uint4 v[kUnroll] = {};
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + static_cast<int64_t>(u) * kThreads;
          if (i < nv) v[u] = LoadStreaming(s + i);
        }
        for (int32_t d = 0; d < job.num_dst; ++d) {
          auto* o = reinterpret_cast<uint4*>(static_cast<unsigned char*>(dst[job.first_dst + d]) + off);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = base + static_cast<int64_t>(u) * kThreads;
            if (i < nv) o[i] = v[u];
          }
        }
      }
    } else {  // unaligned job or its last partial tile: bytes
      for (int64_t i = threadIdx.x; i < n; i += kThreads) {
        const unsigned char b = src[i];
        for (int32_t d = 0; d < job.num_dst; ++d) static_cast<unsigned char*>(dst[job.first_dst + d])[off + i] = b;
      }
    }
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

StatusOr<StreamPlan> StreamPlan::Create(const std::vector<StreamJob>& jobs, int64_t tile_bytes) {
  if (tile_bytes <= 0 || tile_bytes % 16 != 0)
    return InvalidArgument("weight stream: tile size " + std::to_string(tile_bytes) + " must be a positive multiple of 16 bytes");
  StreamPlan p;
  p.tile_bytes_ = tile_bytes;
  std::vector<StreamDeviceJob> dj;
  std::vector<void*> dst;
  std::vector<int64_t> prefix{0};
  for (size_t j = 0; j < jobs.size(); ++j) {
    const StreamJob& s = jobs[j];
    if (s.bytes < 0) return InvalidArgument("weight stream: job " + std::to_string(j) + " has negative bytes");
    if (s.bytes > 0 && s.src == nullptr) return InvalidArgument("weight stream: job " + std::to_string(j) + " has no source");
    bool vec = Aligned16(s.src);
    for (size_t d = 0; d < s.dst.size(); ++d) {
      if (s.bytes > 0 && s.dst[d] == nullptr)
        return InvalidArgument("weight stream: job " + std::to_string(j) + " destination " + std::to_string(d) + " is null");
      vec = vec && Aligned16(s.dst[d]);
    }
    if (s.bytes == 0 || s.dst.empty()) continue;  // nothing to move
    dj.push_back(StreamDeviceJob{static_cast<const unsigned char*>(s.src), s.bytes, static_cast<int32_t>(dst.size()),
                           static_cast<int32_t>(s.dst.size()), vec ? 1 : 0, 0});
    dst.insert(dst.end(), s.dst.begin(), s.dst.end());
    prefix.push_back(prefix.back() + (s.bytes + tile_bytes - 1) / tile_bytes);
    p.bytes_read_ += s.bytes;
    p.bytes_written_ += s.bytes * static_cast<int64_t>(s.dst.size());
  }
  p.num_jobs_ = static_cast<int32_t>(dj.size());
  p.total_tiles_ = prefix.back();
  if (p.num_jobs_ == 0) return StatusOr<StreamPlan>(std::move(p));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p.jobs_, dj.size() * sizeof(StreamDeviceJob)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p.dst_, dst.size() * sizeof(void*)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p.tile_prefix_, prefix.size() * sizeof(int64_t)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.jobs_, dj.data(), dj.size() * sizeof(StreamDeviceJob), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.dst_, dst.data(), dst.size() * sizeof(void*), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p.tile_prefix_, prefix.data(), prefix.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  // A copy from pageable memory may return before its DMA lands, on the legacy stream, which a launch on a non-blocking
  // stream does not wait for.
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  return StatusOr<StreamPlan>(std::move(p));
}

Status StreamPlan::Launch(cudaStream_t stream, int blocks) const {
  if (total_tiles_ == 0) return Status::Ok();
  if (blocks <= 0) {
    int dev = 0, sms = 0;
    RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
    RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    blocks = 2 * sms;
  }
  const auto grid = static_cast<unsigned>(std::min<int64_t>(blocks, total_tiles_));
  TileStreamKernel<<<grid, kThreads, 0, stream>>>(jobs_, num_jobs_, dst_, tile_prefix_, total_tiles_, tile_bytes_);
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

void StreamPlan::Release() {
  cudaFree(jobs_);
  cudaFree(dst_);
  cudaFree(tile_prefix_);
  jobs_ = nullptr;
  dst_ = nullptr;
  tile_prefix_ = nullptr;
}

StreamPlan::StreamPlan(StreamPlan&& o) noexcept { *this = std::move(o); }

StreamPlan& StreamPlan::operator=(StreamPlan&& o) noexcept {
  if (this != &o) {
    Release();
    jobs_ = std::exchange(o.jobs_, nullptr);
    dst_ = std::exchange(o.dst_, nullptr);
    tile_prefix_ = std::exchange(o.tile_prefix_, nullptr);
    num_jobs_ = o.num_jobs_;
    total_tiles_ = o.total_tiles_;
    tile_bytes_ = o.tile_bytes_;
    bytes_read_ = o.bytes_read_;
    bytes_written_ = o.bytes_written_;
  }
  return *this;
}

StreamPlan::~StreamPlan() { Release(); }

}  // namespace rdep::dispatch
