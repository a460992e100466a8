// Launchers of the RDEP protocol kernels on one rank (raw device pointers + stream; return Status).
// Layout of every peer-visible region: rdep/dispatch/region_layout.h. "control_of", "payload_of",
// "sideband_of", "return_of" are device arrays of the W ranks' region bases (CudaDomain::peer_table).
// Activations are bf16 (passed as uint16_t bits so this header needs no CUDA types).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rdep/dispatch/region_layout.h"
#include "rdep/status.h"

namespace rdep::dispatch {

using bf16_bits = uint16_t;

// An owner's grouped row: rows of local expert j are contiguous, in token-stream order.
struct GroupedRow {
  uint64_t row_id;
  int32_t token;         // index of its token in the owner's segment
  int32_t local_expert;
  float gate;            // effective gate g'
  int32_t pad;
};
static_assert(sizeof(GroupedRow) == 24);

struct OwnerMapView {
  const int32_t* owner;  // [E]
  const int32_t* local;  // [E]
};

// Where a source's route slot i (expert e) is computed: without balancing at its expert's owner and
// local index (owner[e], local[e]); with balancing (dest_rank set) at the physical instance the plan
// gave the slot, rank dest_rank[i] and physical local index dest_local[i] (the owner and local[e], or a
// replica's slot_base + s), rank -1 for a dropped slot. The one rule the count, scatter and their
// backward read.
struct RouteTargets {
  OwnerMapView own{nullptr, nullptr};
  const int32_t* dest_rank = nullptr;   // [n*K] or null (no balancing)
  const int32_t* dest_local = nullptr;  // [n*K]
  RouteTargets(OwnerMapView o) : own(o) {}  // NOLINT: every owner map is a set of targets
  RouteTargets(OwnerMapView o, const int32_t* rank, const int32_t* local) : own(o), dest_rank(rank), dest_local(local) {}
  RDEP_HD int32_t rank(int64_t i, int32_t e) const { return dest_rank ? dest_rank[i] : own.owner[e]; }
  RDEP_HD int32_t local(int64_t i, int32_t e) const { return dest_rank ? dest_local[i] : own.local[e]; }
};

// Before phase 1 at a source: checks every slot with rdep::CheckRouteSlot (expert in [0, E), gate
// finite and >= 0, no expert twice in a token). *fault receives the first faulty slot (lowest
// t*K + k) with the values it had, or key ~0 (it may be host-mapped memory: plain stores and a system
// fence); every token with a faulty slot is then rewritten in place to experts 0..K-1 with zero
// gates, so the protocol still completes on every rank with in-bounds writes. Needs K <= E. A check
// spread over the GPU (a thread per token), then one block for the record and the rewrite; `worst` is a
// device word holding 0 before the launch (the check folds faults into it; the second kernel reads it
// and leaves it 0 again). zero (nullable): a device int64 the second kernel sets to 0 (the caller's drop
// counter, so the plan needs no memset of its own). from_experts, from_gates (nullable, both or neither when
// n > 0; not read when n == 0): the routing as the caller gave it, copied into experts and gates by the check
// (the layer's saved copy, with no copy call of its own), which are then checked and rewritten; the caller's
// arrays are only read.
struct RoutingFault {
  unsigned long long key;  // (t*K + k) << 2 | RouteSlotFault; ~0 = none
  int32_t expert;          // the slot's expert id and gate as given
  float gate;
};
Status LaunchValidateRouting(int32_t* experts, float* gates, int64_t n, int64_t K, int32_t num_experts,
                             unsigned long long* worst, RoutingFault* fault, cudaStream_t s, int64_t* zero = nullptr,
                             const int32_t* from_experts = nullptr, const float* from_gates = nullptr);
// The shared-memory limits of the kernels below on a layout: phase 1's counts hold L + 1 counters
// (L < kMaxCountLocalExperts), the owner's expansion L expert offsets (L <= kMaxExpandLocalExperts), the
// staged scans at least one token's K ids (K < 10240). InvalidArgument naming the limit; a layer checks
// this when it is created, so every rank refuses the shape before any collective starts.
inline constexpr int64_t kMaxCountLocalExperts = 10239;
inline constexpr int64_t kMaxExpandLocalExperts = 5120;
Status CheckKernelLimits(const RegionLayout& l);
// Phase 1, with LayerConfig::load_matrix: this rank's row of the load matrix (rows per expert, from
// its n*K expert ids) into every rank's control words at load(rank, 0..E) (one block per rank).
// The counting kernels below stage their expert ids into shared memory by tiles; a shape whose tables
// leave no room for one token's ids (E or L plus K above ~10k) is refused with InvalidArgument.
Status LaunchPublishLoadRow(const int32_t* experts, int64_t n, const RegionLayout& l, int32_t rank,
                            int64_t* const* control_of, cudaStream_t s);
// Phase 1 at a source: for each owner q the position of each token among the tokens
// that chose an expert of q (tok_index[q*n + t], -1 if none), the rows per q-local expert, published
// into q's recv_counts_by_src[rank][*] and recv_tokens_by_src[rank]. With balancing (targets with
// per-slot destinations, after the plan) the same per destination rank and physical local index,
// counting only the slots the plan sends there (accepted ones).
// scratch: device int32s, scratch_ints of them, at least CountScratchInts(l, n) (per block of 256
// tokens and owner, its tokens and rows: two kernels, a thread per token); fewer is InvalidArgument.
int64_t CountScratchInts(const RegionLayout& l, int64_t max_tokens);
Status LaunchCountAndPublish(const int32_t* experts, int64_t n, const RegionLayout& l, RouteTargets targets,
                             int32_t rank, int32_t* tok_index, int64_t* const* control_of, int32_t* scratch,
                             int64_t scratch_ints, cudaStream_t s);
// Per-source windows (region_layout.h; a dropless forward in one segment with the owner map's targets):
// the whole plan in two kernels (window_plan_kernels.cu), exchanging nothing. As LaunchValidateRouting
// with the caller's arrays, the routing is copied into experts, gates and checked, each faulty token
// rewritten to the stand-in, *fault the first fault's record (its values as the caller gave them),
// *worst and *zero left 0; as LaunchCountAndPublish, tok_index[q*n + t] (-1 for none); window_tokens[q]
// ([W]) the tokens for owner q; every slot accepted with effective gates by RenormalizeTokenGates; and
// the control copy RegionLayout::window_word(rank, ·). from_experts, from_gates: read only (null only
// when n == 0). scratch: WindowPlanScratchInts(l, n) device int32s (fewer is InvalidArgument).
int64_t WindowPlanScratchInts(const RegionLayout& l, int64_t max_tokens);
Status LaunchWindowPlan(const int32_t* from_experts, const float* from_gates, int64_t n, const RegionLayout& l, OwnerMapView own,
                        int32_t num_experts, int32_t rank, int32_t* experts, float* gates, int32_t* tok_index, int64_t* window_tokens,
                        uint8_t* accepted, float* effective, int64_t* control_copy, unsigned long long* worst, RoutingFault* fault,
                        int64_t* zero, int32_t* scratch, int64_t scratch_ints, cudaStream_t s);
// rank_in_expert[t*K+k]: how many earlier tokens of this rank chose the same expert (token order).
Status LaunchExpertRank(const int32_t* experts, int64_t n, int64_t K, int32_t num_experts, int32_t* rank_in_expert,
                        cudaStream_t s);
// Phase 2 at an owner: admitted counts per (source, local expert) in source order under `capacity`
// (rdep::SourceOrderAdmission, the host's rule: rdep/core/capacity_rules.h), token-stream bases,
// all published to the sources; rows_per_expert[j] = admitted rows (device).
Status LaunchOwnerScan(const RegionLayout& l, int32_t rank, int32_t num_local, int64_t capacity,
                       int64_t* const* control_of, int64_t* rows_per_expert, cudaStream_t s);
// At a source after phase 2: accepted[t*K+k] = rank_in_expert < admitted(owner, local) (rank_in_expert
// null: every row accepted; the caller guarantees a dropless layer, where the owner scan admits every
// row, so the ranks need not be computed), effective
// gates by rdep::RenormalizeTokenGates (bitwise rdep::RenormalizeGates), dropped rows added to *dropped;
// and, when control_copy is not null, a copy of this rank's control words there (the forward's own).
Status LaunchAccept(const int32_t* experts, const float* gates, const int32_t* rank_in_expert, int64_t n,
                    const RegionLayout& l, OwnerMapView own, const int64_t* my_control, int64_t* control_copy,
                    uint8_t* accepted, float* effective_gates, int64_t* dropped, cudaStream_t s);
// With balancing, at a source after the plan assigned the accepted set (rdep::LaunchAssignInstances):
// effective gates by rdep::RenormalizeTokenGates over `accepted`, dropped rows added to *dropped.
Status LaunchRenormalizeAccepted(const float* gates, const uint8_t* accepted, int64_t n, int64_t K, float* effective_gates,
                                 int64_t* dropped, cudaStream_t s);
// Phase 3 for one segment [lo, lo+S) of every owner's token stream: payload row + sideband of each of
// this rank's tokens that falls in the window, into the owner's segment buffer `buf` (each accepted
// slot to targets.rank, with local expert targets.local). Row ids by rdep::RowIdCodec. With window_tokens
// (per-source windows: LaunchWindowPlan's output, device [W]; one segment) also a row count
// of 0 at every position of this rank's window in each owner's stream past its window_tokens[q] tokens.
Status LaunchScatter(const bf16_bits* payload, const int32_t* experts, const uint8_t* accepted,
                     const float* effective_gates, const int32_t* tok_index, int64_t n, const RegionLayout& l,
                     RouteTargets targets, int32_t rank, const int64_t* my_control, int64_t lo, int32_t buf,
                     void* const* payload_of, void* const* sideband_of, cudaStream_t s,
                     const int64_t* window_tokens = nullptr);
// Owner: rows per local expert in its segment buffer `buf` (tokens [lo, min(lo+S, stream total))),
// then the grouped rows (written at grouped + 0). counts is [num_local] int64. inv (nullable,
// [S][slots_per_token] int32) receives, for segment position p and its sideband row r, that row's
// grouped index: inv[p * slots_per_token + r] (owner_reduce sums a token's rows through it). slot_rows
// (nullable, [T*K] int32; W = 1, where every row is rank 0's own) receives each row's grouped index at its
// slot t*K+k, decoded from row_id (-1 for a row at or past max_rows): the combine reads the owner's rows through it
// (LaunchCombine's row_of). Rows at
// grouped indices >= max_rows (grouped's size) are not written (the counts still count them: the caller
// checks the total against its bound, on the host or in the expert compute). scratch: device int32s,
// ExpandScratchInts(l, num_local) of them (a counting sort over chunks of 32 positions, expand_kernels.cu).
int64_t ExpandScratchInts(const RegionLayout& l, int32_t num_local);
Status LaunchExpand(const void* my_sideband, int32_t buf, int64_t lo, const RegionLayout& l, const int64_t* my_control,
                    int32_t num_local, int64_t* counts, GroupedRow* grouped, int64_t max_rows, int32_t* scratch, cudaStream_t s,
                    int32_t* inv = nullptr, int32_t* slot_rows = nullptr);
// out[g] = src[grouped[g].token] (times the row's gate when scale_by_gate), g < M. With device_rows (a
// device int64), g < min(*device_rows, M): M is then the host's bound (it sizes the grid only).
Status LaunchGatherRows(const bf16_bits* segment_payload, const GroupedRow* grouped, int64_t M, int64_t H,
                        bool scale_by_gate, bf16_bits* out, cudaStream_t s, const int64_t* device_rows = nullptr);
// *total = counts[0] + ... + counts[n-1] (device int64s; n <= 2^20): the rows a segment's expand wrote.
Status LaunchSumCounts(const int64_t* counts, int32_t n, int64_t* total, cudaStream_t s);
// Sentinel echo instead of the MLP: out[g] = SentinelField(row_id, rank, global expert) | x row.
Status LaunchSentinelEcho(const bf16_bits* x_rows, const GroupedRow* grouped, int64_t M, int64_t H, int32_t rank,
                          const int32_t* local_to_global, bf16_bits* out, cudaStream_t s);
// Return: row g goes to its front-end's return region at (t*K+k), decoded from row_id (rdep::RowIdCodec).
Status LaunchReturnRows(const bf16_bits* rows, const GroupedRow* grouped, int64_t M, const RegionLayout& l,
                        void* const* return_of, cudaStream_t s, const int64_t* device_rows = nullptr);
// Front-end combine in slot order with fp32 accumulation: y[t] = sum_k w_k * ret[t*K+k] over accepted
// slots (w = effective gate, or 1 when weights is null; one fused multiply-add per slot, rounded to bf16
// once). save (nullable) receives every slot's row, zeros for a dropped slot. 16-byte accesses when H % 8
// == 0 and ret, y and save are 16-byte aligned, 2-byte ones otherwise (the same bits). With row_of
// (device [n*K] int32, read at accepted slots only) slot t*K+k reads row ret[row_of[t*K+k]] instead of
// ret[t*K+k]: the owner's rows in place at W = 1 (LaunchExpand's slot_rows), ret holding row_bound rows;
// a slot whose index falls outside [0, row_bound) adds nothing and saves zeros.
Status LaunchCombine(const bf16_bits* ret, const uint8_t* accepted, const float* weights, int64_t n, int64_t K,
                     int64_t H, bf16_bits* y, bf16_bits* save, cudaStream_t s, const int32_t* row_of = nullptr,
                     int64_t row_bound = 0);
// dgate: dL/dg'_k = <dy_t, f_k> (fp32), then the chain rule through the capacity renormalization
// (rdep::RenormalizeTokenGatesBackward: math in double, float in and out). With dots (owner_reduce:
// [n*K] floats the owners wrote, LaunchOwnerDots) the dot products are read from there and dy and
// saved_f are not touched (they may be null).
Status LaunchDgate(const bf16_bits* dy, const bf16_bits* saved_f, const float* gates, const uint8_t* accepted,
                   int64_t n, int64_t K, int64_t H, float* scratch, float* dgates, cudaStream_t s, const float* dots = nullptr);

// LayerConfig::owner_reduce (owner_reduce_kernels.cu). The owner sums a token's rows before they cross
// back: one row per (token, owner) lands in the return row of the token's lead slot on that owner (its
// first accepted slot there = its sideband's first row).
// Owner: for each token of segment buffer `buf` with rows (positions p < the segment's token count, read
// on the device), sum over its sideband rows r of w * rows[inv[p*slots_per_token + r]] in fp32 (w = the
// row's effective gate when scale_by_gate, else 1), in r order, rounded to bf16 once, into the lead row.
// 16-byte accesses: InvalidArgument unless H % 8 == 0 and rows and my_return (this rank's return region;
// every rank's is an allocation of the same kind) are 16-byte aligned, as the SwiGLU layer's always are.
Status LaunchReduceReturnRows(const bf16_bits* rows, const GroupedRow* grouped, const int32_t* inv, const void* my_sideband,
                              int32_t buf, int64_t lo, const RegionLayout& l, const int64_t* my_control, bool scale_by_gate,
                              void* const* return_of, const void* my_return, cudaStream_t s);
// Owner, backward: for each grouped row g < M (or the device count), <dy of its token, f_rows[g]> (fp32,
// detail::WarpDotBf16's order) into its front-end's dots region at (token, slot).
Status LaunchOwnerDots(const bf16_bits* segment_dy, const bf16_bits* f_rows, const GroupedRow* grouped, int64_t M,
                       const RegionLayout& l, void* const* dots_of, cudaStream_t s, const int64_t* device_rows = nullptr);
// Owner, backward, LayerConfig::gate_in_expert: row g's dgate (row_dots[g], from the expert compute) into its
// front-end's dots at (t*K+k), decoded from row_id; M rows, or the device count capped by M.
Status LaunchStoreRowDots(const float* row_dots, const GroupedRow* grouped, int64_t M, const RegionLayout& l, void* const* dots_of,
                          cudaStream_t s, const int64_t* device_rows = nullptr);
// Front-end: lead[t*K+k] = 1 when slot k is accepted and no earlier accepted slot of the token computes on
// the same rank (targets), else 0: the slots whose return rows carry the owners' sums.
Status LaunchLeadSlots(const int32_t* experts, const uint8_t* accepted, int64_t n, int64_t K, RouteTargets targets,
                       uint8_t* lead, cudaStream_t s);

}  // namespace rdep::dispatch
