// Replica weight streaming from a plan in device memory (rdep/balance/gpu_planner.h,
// LaunchStreamReplicaWeights): the device form of the host layer's PushReplicaWeights without relays.
#include "rdep/balance/gpu_planner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

namespace rdep {

namespace {

constexpr int kThreads = 256;

struct StreamArgs {
  DevicePlanView plan;
  int32_t rank, E;
  const int32_t* owner;
  const int32_t* local;
  const unsigned char* w[2];  // w1, w2 of this rank's experts
  int64_t part_bytes[2];      // per expert
  unsigned char* const* slots_of;
  int64_t tile, tiles[2];     // tiles per part
};

// Work item = (expert, part, tile): the tile of the owner's part is read once (16-byte vectors when
// every address allows) and stored into every replica's slot at the same offset.
__global__ void __launch_bounds__(kThreads) StreamReplicasKernel(StreamArgs a) {
  const int64_t per_expert = a.tiles[0] + a.tiles[1];
  const int64_t items = static_cast<int64_t>(a.E) * per_expert;
  const int64_t slot_bytes = a.part_bytes[0] + a.part_bytes[1];
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const auto e = static_cast<int32_t>(w / per_expert);
    const int32_t first = a.plan.instance_offsets[e], last = a.plan.instance_offsets[e + 1];
    if (a.owner[e] != a.rank || last - first <= 1) continue;
    int64_t t = w % per_expert;
    const int part = t < a.tiles[0] ? 0 : 1;
    if (part == 1) t -= a.tiles[0];
    const int64_t off = t * a.tile, n = min(a.tile, a.part_bytes[part] - off);
    const unsigned char* src = a.w[part] + static_cast<int64_t>(a.local[e]) * a.part_bytes[part] + off;
    const int64_t dst_off = (part == 0 ? 0 : a.part_bytes[0]) + off;
    bool vec = (reinterpret_cast<uintptr_t>(src) % 16 == 0) && n % 16 == 0 && dst_off % 16 == 0 && slot_bytes % 16 == 0;
    for (int32_t i = first + 1; i < last && vec; ++i) vec = reinterpret_cast<uintptr_t>(a.slots_of[a.plan.instance_rank[i]]) % 16 == 0;
    if (vec) {
      for (int64_t v = threadIdx.x; v < n / 16; v += kThreads) {
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(src) + v);
        for (int32_t i = first + 1; i < last; ++i)
          reinterpret_cast<uint4*>(a.slots_of[a.plan.instance_rank[i]] + a.plan.instance_slot[i] * slot_bytes + dst_off)[v] = x;
      }
    } else {
      for (int64_t b = threadIdx.x; b < n; b += kThreads) {
        const unsigned char x = src[b];
        for (int32_t i = first + 1; i < last; ++i) a.slots_of[a.plan.instance_rank[i]][a.plan.instance_slot[i] * slot_bytes + dst_off + b] = x;
      }
    }
  }
}

}  // namespace

Status LaunchStreamReplicaWeights(const DevicePlanView& plan, int32_t rank, int32_t num_experts, const int32_t* owner_of_expert,
                                  const int32_t* local_of_expert, const void* w1, int64_t w1_bytes, const void* w2,
                                  int64_t w2_bytes, unsigned char* const* slots_of, int64_t tile_bytes, int blocks,
                                  CUstream_st* stream) {
  if (num_experts < 1 || rank < 0 || w1_bytes < 0 || w2_bytes < 0 || tile_bytes <= 0 || tile_bytes % 16 != 0)
    return InvalidArgument("stream replicas: E " + std::to_string(num_experts) + ", rank " + std::to_string(rank) +
                           ", part bytes " + std::to_string(w1_bytes) + "/" + std::to_string(w2_bytes) + ", tile " +
                           std::to_string(tile_bytes) + " (a positive multiple of 16) out of range");
  if (!plan.instance_offsets || !plan.instance_rank || !plan.instance_slot || !owner_of_expert || !local_of_expert ||
      !slots_of || (w1_bytes > 0 && !w1) || (w2_bytes > 0 && !w2))
    return InvalidArgument("stream replicas: a pointer is null");
  StreamArgs a{plan, rank, num_experts, owner_of_expert, local_of_expert,
               {static_cast<const unsigned char*>(w1), static_cast<const unsigned char*>(w2)}, {w1_bytes, w2_bytes}, slots_of,
               tile_bytes, {(w1_bytes + tile_bytes - 1) / tile_bytes, (w2_bytes + tile_bytes - 1) / tile_bytes}};
  const int64_t items = static_cast<int64_t>(num_experts) * (a.tiles[0] + a.tiles[1]);
  if (items == 0) return Status::Ok();
  if (blocks <= 0) {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return Status(StatusCode::kCudaError, "stream replicas: cannot query the device");
    blocks = 2 * sms;
  }
  StreamReplicasKernel<<<static_cast<unsigned>(std::min<int64_t>(blocks, items)), kThreads, 0, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status(StatusCode::kCudaError, std::string("stream replicas: ") + cudaGetErrorString(err));
  return Status::Ok();
}

}  // namespace rdep
