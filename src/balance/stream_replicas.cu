// Replica weight streaming from a plan in device memory (rdep/balance/gpu_planner.h,
// LaunchStreamReplicaWeights): the device form of the host layer's PushReplicaWeights; with chunk
// relays this is stage 1 (relay_replicas.cu has stage 2).
#include "rdep/balance/gpu_planner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "balance/replica_copy.cuh"

namespace rdep {

namespace {

using replica_copy::kThreads;
using replica_copy::Targets;

struct StreamArgs {
  DevicePlanView plan;
  DeviceRelayView relays;     // chunks null: no relays
  int32_t rank, E;
  const int32_t* owner;
  const int32_t* local;
  const unsigned char* w[2];  // w1, w2 of this rank's experts
  int64_t part_bytes[2];      // per expert
  unsigned char* const* slots_of;
  int64_t tile, tiles[2];     // tiles per part
};

// Work item = (expert, part, tile): the tile of the owner's part, at offset dst_off of the slot image
// [w1 | w2], is read once and stored into every active replica's slot at that offset; for a relayed
// expert each of its pieces goes only to the relay whose chunk holds it (stage 1).
__global__ void __launch_bounds__(kThreads, 1) StreamReplicasKernel(StreamArgs a) {
  // Items are below 2^32 (the launcher checks): 32-bit division, no division subroutine call.
  const auto per_expert = static_cast<uint32_t>(a.tiles[0] + a.tiles[1]);
  const uint32_t items = static_cast<uint32_t>(a.E) * per_expert;
  const int64_t slot_bytes = a.part_bytes[0] + a.part_bytes[1];
  for (uint32_t w = blockIdx.x; w < items; w += gridDim.x) {
    const auto e = static_cast<int32_t>(w / per_expert);
    const int32_t first = a.plan.instance_offsets[e], last = a.plan.instance_offsets[e + 1];
    if (a.owner[e] != a.rank || last - first <= 1) continue;
    int64_t t = w % per_expert;
    const int part = t < a.tiles[0] ? 0 : 1;
    if (part == 1) t -= a.tiles[0];
    const int64_t part_bytes = part == 0 ? a.part_bytes[0] : a.part_bytes[1];  // no dynamic index into the parameters
    const int64_t off = t * a.tile, n = min(a.tile, part_bytes - off);
    const unsigned char* src = (part == 0 ? a.w[0] : a.w[1]) + static_cast<int64_t>(a.local[e]) * part_bytes + off;
    const int64_t dst_off = (part == 0 ? 0 : a.part_bytes[0]) + off;
    const int32_t m = a.relays.chunks ? a.relays.chunks[e] : 0;
    if (m == 0) {
      replica_copy::CopySpan(a.plan, a.slots_of, slot_bytes, Targets{first + 1, last, -1, -1}, src, n, dst_off);
      continue;
    }
    for (int32_t i = first + 1; i < last; ++i) {  // relay c takes the piece of the tile inside chunk c
      const int32_t c = a.relays.chunk_of[i];
      if (c < 0) continue;
      const int64_t lo = max(dst_off, a.relays.chunk_range[2 * i]), hi = min(dst_off + n, a.relays.chunk_range[2 * i + 1]);
      if (hi > lo) replica_copy::CopySpan(a.plan, a.slots_of, slot_bytes, Targets{0, 0, i, -1}, src + (lo - dst_off), hi - lo, lo);
    }
  }
}

}  // namespace

Status LaunchStreamReplicaWeights(const DevicePlanView& plan, int32_t rank, int32_t num_experts, const int32_t* owner_of_expert,
                                  const int32_t* local_of_expert, const void* w1, int64_t w1_bytes, const void* w2,
                                  int64_t w2_bytes, unsigned char* const* slots_of, int64_t tile_bytes, int blocks,
                                  CUstream_st* stream, const DeviceRelayView& relays) {
  if (num_experts < 1 || rank < 0 || w1_bytes < 0 || w2_bytes < 0 || tile_bytes <= 0 || tile_bytes % 16 != 0)
    return InvalidArgument("stream replicas: E " + std::to_string(num_experts) + ", rank " + std::to_string(rank) +
                           ", part bytes " + std::to_string(w1_bytes) + "/" + std::to_string(w2_bytes) + ", tile " +
                           std::to_string(tile_bytes) + " (a positive multiple of 16) out of range");
  if (!plan.instance_offsets || !plan.instance_rank || !plan.instance_slot || !owner_of_expert || !local_of_expert ||
      !plan.instance_quota || !slots_of || (w1_bytes > 0 && !w1) || (w2_bytes > 0 && !w2) || (relays.chunks && (!relays.chunk_of || !relays.chunk_range)))
    return InvalidArgument("stream replicas: a pointer is null");
  StreamArgs a{plan, relays, rank, num_experts, owner_of_expert, local_of_expert,
               {static_cast<const unsigned char*>(w1), static_cast<const unsigned char*>(w2)}, {w1_bytes, w2_bytes}, slots_of,
               tile_bytes, {(w1_bytes + tile_bytes - 1) / tile_bytes, (w2_bytes + tile_bytes - 1) / tile_bytes}};
  const int64_t items = static_cast<int64_t>(num_experts) * (a.tiles[0] + a.tiles[1]);
  if (items == 0) return Status::Ok();
  if (items > UINT32_MAX)
    return InvalidArgument("stream replicas: " + std::to_string(items) + " tiles (E x tiles per expert) exceed 2^32; use a larger tile");
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
