// Replica gradient reduction from a plan in device memory (rdep/balance/gpu_planner.h,
// LaunchReduceReplicaGradients): the device form of the host layer's ReduceReplicaGradients
// (src/layer/host_balance.cc), used by the CUDA layer after its backward's last barrier.
#include "rdep/balance/gpu_planner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

namespace rdep {

namespace {

constexpr int kThreads = 256;

struct ReduceArgs {
  DevicePlanView plan;
  int32_t rank, E;
  const int32_t* owner;
  const int32_t* local;
  float* dw[2];        // this rank's gradients: w1 part, w2 part
  int64_t count[2];    // elements per expert of each part
  const float* const* grads_of;  // [W] slot-gradient regions: [N_slot][count[0] + count[1]]
};

// Blocks along y take experts (grid-stride), along x the expert's elements; each thread adds the
// replicas of its element in instance order into one register, then stores once.
__global__ void __launch_bounds__(kThreads) ReduceReplicasKernel(ReduceArgs a) {
  const int64_t per = a.count[0] + a.count[1];
  for (int32_t e = static_cast<int32_t>(blockIdx.y); e < a.E; e += static_cast<int32_t>(gridDim.y)) {
    const int32_t first = a.plan.instance_offsets[e], last = a.plan.instance_offsets[e + 1];
    if (a.owner[e] != a.rank || last - first <= 1) continue;
    const int64_t j = a.local[e];
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < per;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int part = c < a.count[0] ? 0 : 1;
      float* dst = a.dw[part] + j * a.count[part] + (part == 0 ? c : c - a.count[0]);
      float acc = *dst;
      for (int32_t i = first + 1; i < last; ++i) {
        const int32_t slot = a.plan.instance_slot[i];
        if (slot < 0 || a.plan.instance_quota[i] == 0) continue;  // idle replica: computed nothing this call
        acc += a.grads_of[a.plan.instance_rank[i]][static_cast<int64_t>(slot) * per + c];
      }
      *dst = acc;
    }
  }
}

}  // namespace

Status LaunchReduceReplicaGradients(const DevicePlanView& plan, int32_t rank, int32_t num_experts, const int32_t* owner_of_expert,
                                    const int32_t* local_of_expert, float* dw1, int64_t w1_count, float* dw2, int64_t w2_count,
                                    const float* const* slot_grads_of, CUstream_st* stream) {
  if (num_experts < 1 || rank < 0 || w1_count < 0 || w2_count < 0)
    return InvalidArgument("reduce replicas: E " + std::to_string(num_experts) + ", rank " + std::to_string(rank) +
                           ", part sizes " + std::to_string(w1_count) + "/" + std::to_string(w2_count) + " out of range");
  const int64_t per = w1_count + w2_count;
  if (per == 0) return Status::Ok();
  if (!plan.instance_offsets || !plan.instance_rank || !plan.instance_slot || !plan.instance_quota || !owner_of_expert ||
      !local_of_expert || !slot_grads_of || (w1_count > 0 && !dw1) || (w2_count > 0 && !dw2))
    return InvalidArgument("reduce replicas: a pointer is null");
  const ReduceArgs a{plan, rank, num_experts, owner_of_expert, local_of_expert, {dw1, dw2}, {w1_count, w2_count}, slot_grads_of};
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((per + kThreads - 1) / kThreads, 256)),
                  static_cast<unsigned>(std::min(num_experts, 65535)));
  ReduceReplicasKernel<<<grid, kThreads, 0, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status(StatusCode::kCudaError, std::string("reduce replicas: ") + cudaGetErrorString(err));
  return Status::Ok();
}

}  // namespace rdep
