// Chunk relays of the replica weight streaming on the device (rdep/balance/gpu_planner.h): the relay
// rule in one thread (LaunchPlanRelays, rdep/balance/relay_rule.h) and stage 2, the relays' stores
// (LaunchRelayReplicaChunks); stage 1 is LaunchStreamReplicaWeights with a DeviceRelayView.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "balance/replica_copy.cuh"
#include "rdep/balance/gpu_planner.h"
#include "rdep/balance/relay_rule.h"

namespace rdep {

namespace {

using replica_copy::kThreads;
using replica_copy::Targets;

__global__ void PlanRelaysKernel(DevicePlanView plan, int32_t E, int32_t R, int32_t relay_above, int64_t slot_bytes, double* load,
                                 int32_t* wide, int32_t* chunks, int32_t* chunk_of, int64_t* chunk_range, int32_t* num_relayed) {
  const RelayRuleInputs in{E, R, plan.instance_offsets, plan.instance_rank, plan.instance_slot, plan.instance_quota};
  *num_relayed = ComputeRelays(in, relay_above, load, wide, chunks, chunk_of);
  for (int32_t e = 0; e < E; ++e) {  // the byte range of each relay's chunk (no divisions in the streaming kernels)
    const int32_t m = chunks[e];
    for (int32_t i = plan.instance_offsets[e]; i < plan.instance_offsets[e + 1]; ++i) {
      const int32_t c = chunk_of[i];
      chunk_range[2 * i] = c < 0 ? 0 : RelayChunkBegin(slot_bytes, m, c);
      chunk_range[2 * i + 1] = c < 0 ? 0 : RelayChunkBegin(slot_bytes, m, c + 1);
    }
  }
}

struct RelayArgs {
  DevicePlanView plan;
  DeviceRelayView relays;
  int32_t rank, E;
  int64_t slot_bytes, tile, tiles;  // tiles per slot image
  unsigned char* const* slots_of;
};

// Work item = (expert, tile of the slot image): each relay of the expert on this rank copies the part
// of the tile inside its chunk from its own slot to the expert's other active replicas.
__global__ void __launch_bounds__(kThreads) RelayChunksKernel(RelayArgs a) {
  const int64_t items = static_cast<int64_t>(a.E) * a.tiles;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const auto e = static_cast<int32_t>(w / a.tiles);
    const int32_t m = a.relays.chunks[e];
    if (m == 0) continue;
    const int32_t first = a.plan.instance_offsets[e], last = a.plan.instance_offsets[e + 1];
    const int64_t off = (w % a.tiles) * a.tile, end = min(off + a.tile, a.slot_bytes);
    for (int32_t i = first + 1; i < last; ++i) {
      const int32_t c = a.relays.chunk_of[i];
      if (c < 0 || a.plan.instance_rank[i] != a.rank) continue;
      const int64_t lo = max(off, a.relays.chunk_range[2 * i]), hi = min(end, a.relays.chunk_range[2 * i + 1]);
      if (hi <= lo) continue;
      const unsigned char* src = replica_copy::SlotAt(a.plan, a.slots_of, a.slot_bytes, i, lo);
      replica_copy::CopySpan(a.plan, a.slots_of, a.slot_bytes, Targets{first + 1, last, -1, i}, src, hi - lo, lo);
    }
  }
}

Status LaunchError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(err));
  return Status::Ok();
}

}  // namespace

Status LaunchPlanRelays(const DevicePlanView& plan, int32_t num_experts, int32_t num_ranks, int32_t relay_above, int64_t slot_bytes,
                        double* load, int32_t* wide, int32_t* chunks, int32_t* chunk_of, int64_t* chunk_range, int32_t* num_relayed,
                        CUstream_st* stream) {
  if (num_experts < 1 || num_ranks < 1 || slot_bytes < 0)
    return InvalidArgument("plan relays: E " + std::to_string(num_experts) + ", R " + std::to_string(num_ranks) + " (both >= 1) and slot bytes " +
                           std::to_string(slot_bytes) + " (>= 0) out of range");
  if (!plan.instance_offsets || !plan.instance_rank || !plan.instance_slot || !plan.instance_quota || !load || !wide || !chunks ||
      !chunk_of || !chunk_range || !num_relayed)
    return InvalidArgument("plan relays: a pointer is null");
  PlanRelaysKernel<<<1, 1, 0, stream>>>(plan, num_experts, num_ranks, relay_above, slot_bytes, load, wide, chunks, chunk_of, chunk_range,
                                        num_relayed);
  return LaunchError("plan relays");
}

Status LaunchRelayReplicaChunks(const DevicePlanView& plan, const DeviceRelayView& relays, int32_t rank, int32_t num_experts,
                                int64_t slot_bytes, unsigned char* const* slots_of, int64_t tile_bytes, int blocks,
                                CUstream_st* stream) {
  if (num_experts < 1 || rank < 0 || slot_bytes < 0 || tile_bytes <= 0 || tile_bytes % 16 != 0)
    return InvalidArgument("relay replicas: E " + std::to_string(num_experts) + ", rank " + std::to_string(rank) + ", slot bytes " +
                           std::to_string(slot_bytes) + ", tile " + std::to_string(tile_bytes) + " (a positive multiple of 16) out of range");
  if (!plan.instance_offsets || !plan.instance_rank || !plan.instance_slot || !plan.instance_quota || !relays.chunks ||
      !relays.chunk_of || !relays.chunk_range || !slots_of)
    return InvalidArgument("relay replicas: a pointer is null");
  const RelayArgs a{plan, relays, rank, num_experts, slot_bytes, tile_bytes, (slot_bytes + tile_bytes - 1) / tile_bytes, slots_of};
  const int64_t items = static_cast<int64_t>(num_experts) * a.tiles;
  if (items == 0) return Status::Ok();
  if (blocks <= 0) {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return Status(StatusCode::kCudaError, "relay replicas: cannot query the device");
    blocks = 2 * sms;
  }
  RelayChunksKernel<<<static_cast<unsigned>(std::min<int64_t>(blocks, items)), kThreads, 0, stream>>>(a);
  return LaunchError("relay replicas");
}

}  // namespace rdep
