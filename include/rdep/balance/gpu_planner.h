// The GPU UltraEP quota planner: Algorithm 1 in one thread block with its state in shared memory.
// The binary search is evaluated speculatively: for R <= 64 (loads < 2^26) each thread probes one node
// of the search tree (128 threads a round: in the first, a chain down the leftmost path, where the
// solved threshold lies close above the mean load, then a tree of 6 levels; later rounds a tree of 7),
// running the greedy oracle without any target search: untouched ranks form one
// list ordered by load (the greedy only takes its head) and ranks that keep slack after a replica form
// a small sorted set in registers (overflow in shared memory); for larger R, warps probe one node each
// with a warp-wide argmax. Then the block builds the instance tables and the locality reroute (one
// thread per instance of a replicated expert, carrying the cumulative residual quotas on both sides
// of its instance through the sources). RDEP_GPU_PLANNER_PROBE_THREADS / _CHAIN_SHIFT / _PROBE_WARPS
// set the speculation shape (measurement knobs). All integer arithmetic (or exact-by-construction
// double reciprocals) with the host planner's tie-breaking and rounding: the plan is bitwise the same
// as SolveQuotaPlan's. Builds without CUDA return Unavailable. docs/balance.md describes the phases.
//   exercise: build-*/src/balance/balance_test --gtest_filter='GpuPlanner*'
//             build-*/bin/rdep plan bench --device gpu --experts 256 --ranks 64 --slots 2
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rdep/balance/plan.h"
#include "rdep/balance/quota_planner.h"
#include "rdep/core/ownership.h"
#include "rdep/core/stats.h"
#include "rdep/status.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; this header builds without the CUDA headers

namespace rdep {

// True if this build has CUDA and a device is visible; otherwise false with the reason in *why.
bool GpuPlannerAvailable(std::string* why);

// Shape limits of the one-block planner: R <= 1024 and the per-probe state must fit shared memory.
// Returns the dynamic shared memory bytes and the number of probe warps it would use (staging the
// load matrix, as int32, in shared memory when it fits).
struct GpuPlannerConfig {
  size_t shared_bytes = 0;
  int32_t probe_warps = 0;    // warp search (any R): 2^d - 1 warps probing d levels of the search per round
  int32_t probe_threads = 0;  // thread search (R <= 64, loads < 2^26): one threshold per thread and round
  int32_t chain_shift = 0;    //   its first round probes a chain of thresholds >= lo + lo >> chain_shift, then a tree
  bool staged_load = false;   // the load matrix is staged in shared memory (as int32)
};
StatusOr<GpuPlannerConfig> GpuPlannerCanImplement(int32_t num_experts, int32_t num_ranks, int32_t num_slots);

// Solves on the current device (copies the load in, the plan out). Same result as SolveQuotaPlan. On the
// device the plan counts rows in int32 (route entries are at most a load entry), so every load entry
// must be below 2^31: a larger one is refused with InvalidArgument naming it.
StatusOr<BalancePlan> SolveQuotaPlanGpu(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                        const QuotaConfig& config);

// Device solve time with the load already resident: `warmup` untimed solves, then `iters` solves each
// timed with CUDA events (kernel only; the plan stays on the device, as in a layer).
struct GpuPlannerTiming {
  Summary solve_us;                 // per-solve microseconds: p50, p99, ...
  std::vector<double> samples_us;   // the raw per-solve times
  GpuPlannerConfig config;
  std::string device_name;
  // Mean SM clock cycles (clock64 of thread 0 after each phase's barrier, which it reads before the
  // barrier releases, so the split is approximate) per phase over the timed solves: [0] setup (staging, loads, visiting
  // order), [1] threshold search, [2] the solved threshold's transfers (unpacking, or a re-run with
  // recording when no recording probe held it), [3] tables + reroute; within [3]:
  // [4] preparation (transfers out, instance offsets), [5] replicated experts' reroute and [6] instance
  // tables + single-instance routes (each the longest warp; [5] and [6] run side by side).
  std::vector<double> phase_cycles;
  double clock_mhz = 0;  // the device's reported SM clock, to turn cycles into rough microseconds
};
StatusOr<GpuPlannerTiming> BenchQuotaPlanGpu(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                             const QuotaConfig& config, int32_t warmup, int32_t iters);

// Device pointers of the plan DevicePlanner::Solve leaves in device memory (valid until the next
// Solve). I = instance_offsets[E] instances; the arrays mean what BalancePlan's do.
struct DevicePlanView {
  const int32_t* instance_offsets = nullptr;  // [E+1]
  const int32_t* instance_expert = nullptr;   // [I]
  const int32_t* instance_rank = nullptr;     // [I]
  const int32_t* instance_slot = nullptr;     // [I]
  const int64_t* instance_quota = nullptr;    // [I]
  const int32_t* slot_expert = nullptr;       // [R * N_slot]
  const int32_t* route = nullptr;             // [R][I] rows source r sends to instance i (int32)
  const int64_t* admitted_load = nullptr;     // [R][E] the load the plan was solved for
  const int64_t* misc = nullptr;              // [4]: threshold tau, transfers, probes, fault flag (nonzero:
                                              // the reroute found residual demand above residual quota)
};

// The planner of one layer, resident on the device: its buffers are allocated once at Create; each
// Solve reads the load matrix from device memory, applies the capacity rule to it and leaves the plan
// in device memory, all on the caller's stream (no host round trip, no synchronization, no
// allocation). The plan is SolveQuotaPlan's for the admitted load, bit for bit. Every load entry must
// be below 2^31 (one layer's rows from one rank are).
class DevicePlanner {
 public:
  static StatusOr<std::unique_ptr<DevicePlanner>> Create(const OwnershipMap& owners, const QuotaConfig& config);
  ~DevicePlanner();
  // load_dev: [R][E] rows per source rank and expert (device). capacity: rows an expert admits, in
  // source order (rdep::SourceOrderAdmission; INT64_MAX = dropless).
  Status Solve(const int64_t* load_dev, int64_t capacity, CUstream_st* stream);
  DevicePlanView view() const;
  // The last plan on the host (synchronizes `stream`); InternalError if the planner flagged a fault.
  StatusOr<BalancePlan> Download(CUstream_st* stream) const;

 private:
  struct Impl;
  explicit DevicePlanner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The reroute of one source rank on the device, after DevicePlanner::Solve on the same stream: for
// every route slot i of its routing (experts[i], and rank_in_expert[i] = how many earlier tokens of
// the rank chose the same expert), the slot is accepted iff rank_in_expert[i] is below the admitted
// rows of (rank, expert); an accepted slot goes to the instance whose cumulative route count covers
// it (rdep::InstanceForRow), on dest_rank[i] at physical local index dest_local[i]: local_of_expert[e]
// for the main instance, slot_base + s for a replica in redundant slot s (-1 and 0 when dropped).
// Device pointers; no synchronization.
Status LaunchAssignInstances(const DevicePlanView& plan, int32_t rank, int32_t num_experts, const int32_t* experts,
                             const int32_t* rank_in_expert, int64_t rows, const int32_t* local_of_expert, int32_t slot_base,
                             uint8_t* accepted, int32_t* dest_rank, int32_t* dest_local, CUstream_st* stream);

// The chunk relays of a plan on the device (rdep/balance/relay_rule.h, the rule of PlanRelays):
// chunks [E] (m of a relayed expert, 0: streamed directly), chunk_of [I] (the chunk instance i relays,
// -1: none), chunk_range [I][2] (the bytes [begin, end) of the slot image a relay's chunk covers,
// RelayChunkBegin of its c and c + 1). Null chunks: no relays.
struct DeviceRelayView {
  const int32_t* chunks = nullptr;
  const int32_t* chunk_of = nullptr;
  const int64_t* chunk_range = nullptr;
};

// After the plan is in device memory on the same stream: ComputeRelays (relay_rule.h) in one device
// thread, writing chunks [E], chunk_of [I_max], chunk_range [I_max][2] for a slot image of slot_bytes,
// and *num_relayed; load [R] (double) and wide [E] are scratch. The same relays as PlanRelays of the
// same plan. No synchronization.
Status LaunchPlanRelays(const DevicePlanView& plan, int32_t num_experts, int32_t num_ranks, int32_t relay_above, int64_t slot_bytes,
                        double* load, int32_t* wide, int32_t* chunks, int32_t* chunk_of, int64_t* chunk_range, int32_t* num_relayed,
                        CUstream_st* stream);

// After DevicePlanner::Solve on the same stream, rank `rank` stores each of its replicated experts'
// weights into every active replica's slot (slot >= 0, quota > 0: idle replicas compute nothing):
// slots_of[r] (a device array of W device pointers, peer-visible) is rank r's slot region, slot s at
// s * (w1_bytes + w2_bytes), holding [w1 | w2]; w1/w2 are this rank's weights, local expert j at
// j * w1_bytes / j * w2_bytes. Each tile of a source is read once and stored to every replica
// (16-byte vectors where aligned). With `relays`, this is stage 1 of the chunk relays: a relayed
// expert's chunk c (RelayChunkBegin of its slot image) goes only to relay c; a barrier, then
// LaunchRelayReplicaChunks on every rank, completes it. `blocks` persistent blocks (0 = two per SM).
// No synchronization; the caller orders the replicas' reads after it (a barrier).
Status LaunchStreamReplicaWeights(const DevicePlanView& plan, int32_t rank, int32_t num_experts, const int32_t* owner_of_expert,
                                  const int32_t* local_of_expert, const void* w1, int64_t w1_bytes, const void* w2,
                                  int64_t w2_bytes, unsigned char* const* slots_of, int64_t tile_bytes, int blocks,
                                  CUstream_st* stream, const DeviceRelayView& relays = {});

// Stage 2 of the chunk relays, after a barrier that follows every owner's stage 1: each relay on rank
// `rank` copies its chunk from its own slot into the same bytes of its expert's other active
// replicas' slots (slot_bytes = w1_bytes + w2_bytes of one expert; slots_of as above). Nothing for a
// rank that relays nothing. No synchronization; the caller orders the replicas' reads after it.
Status LaunchRelayReplicaChunks(const DevicePlanView& plan, const DeviceRelayView& relays, int32_t rank, int32_t num_experts,
                                int64_t slot_bytes, unsigned char* const* slots_of, int64_t tile_bytes, int blocks,
                                CUstream_st* stream);

// After every replica's weight gradient of a backward is final (a barrier after the replicas' wgrad),
// rank `rank` adds them to its main experts' gradients, the device form of the host layer's
// ReduceReplicaGradients: for each expert it owns, its replicas with a quota (slot >= 0, quota > 0)
// in instance order, so dw = ((dw + g_1) + g_2) + ... per element (deterministic; replicas without
// rows computed nothing and are skipped). slot_grads_of[r] (a device array of W device pointers,
// peer-visible) is rank r's slot-gradient region, fp32 [N_slot][w1_count + w2_count] holding
// [dw1 | dw2] per slot; dw1 [E_loc][w1_count] and dw2 [E_loc][w2_count] are this rank's fp32
// gradients, local expert j at j * w1_count / j * w2_count. No synchronization.
Status LaunchReduceReplicaGradients(const DevicePlanView& plan, int32_t rank, int32_t num_experts, const int32_t* owner_of_expert,
                                    const int32_t* local_of_expert, float* dw1, int64_t w1_count, float* dw2, int64_t w2_count,
                                    const float* const* slot_grads_of, CUstream_st* stream);

}  // namespace rdep
