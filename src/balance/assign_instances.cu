// Instance assignment on the device (see rdep/balance/gpu_planner.h, LaunchAssignInstances): the
// device form of the host layer's reroute (src/layer/host_balance.cc, PlanBalanced) and of
// rdep::InstanceForRow.
#include "rdep/balance/gpu_planner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

namespace rdep {

namespace {

__global__ void AssignInstancesKernel(DevicePlanView plan, int32_t rank, int32_t E, const int32_t* experts,
                                      const int32_t* rank_in_expert, int64_t rows, const int32_t* local_of_expert,
                                      int32_t slot_base, uint8_t* accepted, int32_t* dest_rank, int32_t* dest_local) {
  const int32_t I = plan.instance_offsets[E];
  const int32_t* route = plan.route + static_cast<int64_t>(rank) * I;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = experts[i];
    const int64_t j = rank_in_expert[i];
    int32_t q = -1, local = -1;
    if (j < plan.admitted_load[static_cast<int64_t>(rank) * E + e]) {
      int64_t cum = 0;
      for (int32_t inst = plan.instance_offsets[e]; inst < plan.instance_offsets[e + 1]; ++inst) {
        cum += route[inst];
        if (j < cum) {
          const int32_t slot = plan.instance_slot[inst];
          q = plan.instance_rank[inst];
          local = slot < 0 ? local_of_expert[e] : slot_base + slot;
          break;
        }
      }
    }
    accepted[i] = q >= 0 ? 1 : 0;
    dest_rank[i] = q;
    dest_local[i] = local;
  }
}

}  // namespace

Status LaunchAssignInstances(const DevicePlanView& plan, int32_t rank, int32_t num_experts, const int32_t* experts,
                             const int32_t* rank_in_expert, int64_t rows, const int32_t* local_of_expert, int32_t slot_base,
                             uint8_t* accepted, int32_t* dest_rank, int32_t* dest_local, CUstream_st* stream) {
  if (rows < 0 || num_experts < 1 || rank < 0 || slot_base < 0)
    return InvalidArgument("assign instances: rows " + std::to_string(rows) + ", E " + std::to_string(num_experts) + ", rank " +
                           std::to_string(rank) + ", slot base " + std::to_string(slot_base) + " out of range");
  if (rows == 0) return Status::Ok();
  if (!plan.instance_offsets || !plan.route || !plan.admitted_load || !experts || !rank_in_expert || !local_of_expert ||
      !accepted || !dest_rank || !dest_local)
    return InvalidArgument("assign instances: a pointer is null");
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((rows + 255) / 256, 1024));
  AssignInstancesKernel<<<blocks, 256, 0, stream>>>(plan, rank, num_experts, experts, rank_in_expert, rows, local_of_expert,
                                                    slot_base, accepted, dest_rank, dest_local);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status(StatusCode::kCudaError, std::string("assign instances: ") + cudaGetErrorString(err));
  return Status::Ok();
}

}  // namespace rdep
