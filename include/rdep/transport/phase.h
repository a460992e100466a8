// Phases of the RDEP protocol, named in barrier errors ("rank 2 did not arrive at dispatch.counts").
#pragma once

#include <cstdint>

namespace rdep {

enum class Phase : uint16_t {
  kSmoke = 1,             // bootstrap check: every rank reaches a barrier
  kDispatchCounts,        // phase 1: sources published per-owner counts
  kDispatchOffsets,       // phase 2: owners published admitted counts and write bases
  kDispatchSegment,       // phase 3 (per segment): payload + sideband scattered
  kReturnDone,            // every returned row has landed at its front-end
  kBackwardSegment,       // backward, per segment: dy scattered to owners
  kBackwardDone,          // every dx row has landed at its front-end
  kDispatchRoute,         // balancing: sources published per-instance counts after the plan
  kInterNode,             // two-phase: inter-node buffers stored into their mailboxes
  kInterNodeDone,         // two-phase: every inter-node buffer taken by its receiver
  kReplicaRelay,          // balancing: owners stored the relays' chunks (stage 1 of the weight relay)
  kInterNodeCopy,         // device-copy inter-node exchange: every sender's buffers are ready to be read
  kInterNodeCopyDone,     // device-copy inter-node exchange: every receiver has copied (senders may reuse)
  kReturnStart,           // dispatch/combine API: every rank finished reading its return rows of earlier calls
  kRowsTaken,             // dispatch/combine API: every owner took its received rows out of the segment buffers
  kPlanStart,             // a plan right after a plan: every rank has copied the previous plan's control words
  kTest,                  // used by tests
};

const char* PhaseName(Phase phase);

}  // namespace rdep
