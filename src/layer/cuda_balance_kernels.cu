// The CUDA layer's balancing test hook (see cuda_balance_kernels.h).
#include <cuda_bf16.h>

#include "layer/cuda_balance_kernels.h"
#include "rdep/cuda/check.h"

namespace rdep {
namespace {

__global__ void CorruptReplicaKernel(DevicePlanView plan, DeviceRelayView relays, int32_t rank, int32_t E, const int32_t* owner,
                                     unsigned char* const* slots_of, int64_t slot_bytes, int64_t count) {
  for (int32_t e = 0; e < E; ++e) {
    if (owner[e] != rank) continue;
    const bool relayed = relays.chunks && relays.chunks[e] > 0;
    for (int32_t i = plan.instance_offsets[e] + 1; i < plan.instance_offsets[e + 1]; ++i) {
      if (plan.instance_slot[i] < 0 || plan.instance_quota[i] == 0) continue;
      if (relayed && relays.chunk_of[i] != 0) continue;
      auto* w = reinterpret_cast<__nv_bfloat16*>(slots_of[plan.instance_rank[i]] + plan.instance_slot[i] * slot_bytes);
      for (int64_t c = 0; c < count; ++c) w[c] = __float2bfloat16(__bfloat162float(w[c]) + 8.f);
      return;
    }
  }
}

}  // namespace

Status LaunchCorruptReplicaForTest(const DevicePlanView& plan, const DeviceRelayView& relays, int32_t rank, int32_t num_experts,
                                   const int32_t* owner_of_expert, unsigned char* const* slots_of, int64_t slot_bytes, int64_t w1_count,
                                   cudaStream_t stream) {
  if (num_experts < 1 || slot_bytes <= 0 || w1_count <= 0) return Status::Ok();
  CorruptReplicaKernel<<<1, 1, 0, stream>>>(plan, relays, rank, num_experts, owner_of_expert, slots_of, slot_bytes, w1_count < 8 ? w1_count : 8);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace rdep
