// Test hook of the CUDA layer's balancing (CudaMoELayer::set_replica_fault_for_test): a corrupted
// streamed tile, written after the replica weight streaming on the same stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rdep/balance/gpu_planner.h"
#include "rdep/status.h"

namespace rdep {

// Adds 8 to the first min(8, w1_count) bf16 weights (the first 16-byte vector) of the first replica,
// in instance order, that has a quota and whose expert `rank` owns, in that replica's slot:
// slots_of[r] is rank r's slot region, slot s at s * slot_bytes. When that expert is relayed
// (relays.chunks[e] > 0), the relay of chunk 0 instead, after stage 1, so stage 2 passes the bad chunk
// on to every other replica. One thread; nothing when the rank owns no replicated expert.
Status LaunchCorruptReplicaForTest(const DevicePlanView& plan, const DeviceRelayView& relays, int32_t rank, int32_t num_experts,
                                   const int32_t* owner_of_expert, unsigned char* const* slots_of, int64_t slot_bytes, int64_t w1_count,
                                   cudaStream_t stream);

}  // namespace rdep
