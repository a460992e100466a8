// A forward's whole plan under per-source windows (LaunchWindowPlan, rdep/dispatch/dispatch_kernels.h)
// in two kernels, a thread per token. The three-phase plan takes six kernels and two barriers: the
// routing check and its one-block finish, the counts and the positions, then the counts barrier, the
// owner scan, the offsets barrier and the acceptance. With windows nothing is exchanged, so:
//   1. copy the caller's routing, check it (rdep::CheckRouteSlot, as LaunchValidateRouting), rewrite a
//      faulty token in place by its own thread (the stand-in of the check's finish), fold the first
//      fault into *worst; per block of kThreads tokens, the tokens it sends to each owner;
//   2. per (block, owner) the tokens' positions (the earlier blocks' tokens + a block scan); each owner's
//      tokens; (general path) every slot accepted with its effective gates; the control copy; the fault
//      record (the first fault's values read from the caller's arrays, which nothing rewrites) and the
//      words reset.
// With K <= kRegSlots and W <= kMaskOwners (Moonlight's and DeepSeek-V3's shapes) the first kernel takes its block's
// slots through shared memory (coalesced) and each token's into registers, so no load waits on a store as through
// memory; it also accepts the slots and leaves a word of each token's owners for the second kernel, whose block
// (0, 0) writes the fault record before its scans. ncu put the general path's kernels at 5.7 and 6.7 us at the
// Moonlight shape on one H200, for a few hundred KB of traffic (docs/perf-notes.md, thirtieth session).
// Positions come from scans in token order, as the three-phase plan's (routing_kernels.cu), so the
// windows hold the same rows in the same order as the packed stream. One kernel instead of two (blocks
// numbered by tickets in start order, each waiting on the earlier ones' published counts) measured slower:
// 19.8 against 17.5 us at W = 2 on 2x H200 (docs/perf-notes.md, twenty-eighth session).
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <string>

#include "rdep/core/capacity_rules.h"
#include "rdep/core/route_rules.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"
#include "launch/pdl.h"

namespace rdep::dispatch {
namespace {

constexpr int kThreads = 256;
// Slots a thread holds in registers on the fast path (with W <= kMaskOwners: a token's owners as one word);
// more slots or owners take the general path, which reads the routing back from memory. 8 measured faster
// than 16 at K = 6 (the unrolled code and registers; thirtieth session).
constexpr int kRegSlots = 8;
constexpr int kMaskOwners = 32;
using Scan = cub::BlockScan<int, kThreads>;

int64_t Blocks(int64_t n) { return std::max<int64_t>((n + kThreads - 1) / kThreads, 1); }
bool FastPath(const RegionLayout& l) { return l.K <= kRegSlots && l.W <= kMaskOwners; }

__device__ __forceinline__ bool SendsTo(const int32_t* ids, int64_t K, const OwnerMapView& own, int q) {
  for (int64_t k = 0; k < K; ++k)
    if (own.owner[ids[k]] == q) return true;
  return false;
}

__device__ __forceinline__ void NoteFault(unsigned long long* worst, int64_t slot, RouteSlotFault f) {
  atomicMax(worst, ~((static_cast<unsigned long long>(slot) << 2) | static_cast<unsigned long long>(f)));
}

// Block (b, q) of the second kernel, either path: `flag` says whether this thread's token sends to owner q.
// tok_index[q*n + t] = its position among this rank's tokens for q (the earlier blocks' tokens + a block scan),
// -1 for none; block 0 also writes window_tokens[q].
__device__ __forceinline__ void PlacePositions(bool flag, int64_t n, int q, const int32_t* part, int32_t* tok_index,
                                              int64_t* window_tokens, typename Scan::TempStorage& scan) {
  const int64_t B = gridDim.x, b = blockIdx.x;
  const int32_t* of_q = part + q * B;
  int before = 0, all = 0;
  for (int64_t bb = threadIdx.x; bb < B; bb += kThreads) {
    all += of_q[bb];
    if (bb < b) before += of_q[bb];
  }
  int base, total, unused;
  Scan(scan).ExclusiveSum(before, unused, base);
  __syncthreads();
  Scan(scan).ExclusiveSum(all, unused, total);
  __syncthreads();
  const int64_t t = b * kThreads + threadIdx.x;
  int pos;
  Scan(scan).ExclusiveSum(flag ? 1 : 0, pos);
  if (t < n) tok_index[static_cast<int64_t>(q) * n + t] = flag ? base + pos : -1;
  if (b == 0 && threadIdx.x == 0) window_tokens[q] = total;
}

// Block (0, 0) of the second kernel, either path: the control copy, the fault record (the first fault's values
// read from the caller's arrays, which nothing rewrites) and the words reset. The record may be host memory:
// the caller's thread 0 fences (__threadfence_system) once the block's scans are done.
__device__ __forceinline__ void FinishPlan(const RegionLayout& l, int32_t rank, int64_t* control_copy, unsigned long long* worst,
                                          RoutingFault* fault, int64_t* zero, const int32_t* from_experts, const float* from_gates) {
  const auto words = static_cast<int64_t>(l.control_bytes() / sizeof(int64_t));
  for (int64_t w = threadIdx.x; w < words; w += kThreads) control_copy[w] = l.window_word(rank, w);
  if (threadIdx.x == 0) {
    const unsigned long long first = ~*worst;
    *worst = 0;
    *zero = 0;
    RoutingFault r{first, 0, 0.f};
    if (first != ~0ull) r.expert = from_experts[first >> 2], r.gate = from_gates[first >> 2];  // as the caller gave them
    *fault = r;
  }
}

// Fast path, kernel 1, block b: tokens [b*kThreads, ...). The block's slots (a contiguous range of the caller's
// arrays) go through shared memory by consecutive threads, coalesced both ways; a thread takes its token's K <=
// kRegSlots slots into registers: the check (rdep::CheckRouteSlot on the registers, slot order) and a faulty token's
// stand-in, every slot accepted with its effective gates, the token's owners as a bit mask (mask_of[t]); then the
// copy, the acceptance and the effective gates stored, and part[q * B + b] = the block's tokens that send to owner q.
__global__ void __launch_bounds__(kThreads) WindowCheckCountFastKernel(const int32_t* from_experts, const float* from_gates,
                                                                      int32_t* experts, float* gates, uint8_t* accepted,
                                                                      float* effective, int64_t n, int32_t K, int32_t num_experts,
                                                                      int32_t W, OwnerMapView own, unsigned long long* worst,
                                                                      int32_t* part, uint32_t* mask_of) {
  cuda::WaitForPrimaryGrid();
  __shared__ int32_t s_e[kThreads * kRegSlots];
  __shared__ float s_g[kThreads * kRegSlots];
  __shared__ float s_f[kThreads * kRegSlots];
  __shared__ int count[kMaskOwners];
  if (threadIdx.x < kMaskOwners) count[threadIdx.x] = 0;
  const int64_t first = blockIdx.x * static_cast<int64_t>(kThreads);
  const int64_t t = first + threadIdx.x;
  const int span = static_cast<int>(std::min<int64_t>(kThreads, n - first)) * K;  // the block's slots (0 when n == 0)
  const int64_t base = first * K;
  for (int i = threadIdx.x; i < span; i += kThreads) s_e[i] = from_experts[base + i], s_g[i] = from_gates[base + i];
  __syncthreads();
  uint32_t mask = 0;
  if (t < n) {
    int32_t* my_e = s_e + threadIdx.x * K;
    float* my_g = s_g + threadIdx.x * K;
    float* my_f = s_f + threadIdx.x * K;
    int32_t e[kRegSlots];
    float g[kRegSlots];
#pragma unroll
    for (int k = 0; k < kRegSlots; ++k)
      if (k < K) e[k] = my_e[k], g[k] = my_g[k];
    int bad = -1;
    RouteSlotFault fault = RouteSlotFault::kNone;
#pragma unroll
    for (int k = 0; k < kRegSlots; ++k) {
      if (k >= K || bad >= 0) continue;
      const RouteSlotFault f = CheckRouteSlot(e, g, k, num_experts);
      if (f != RouteSlotFault::kNone) bad = k, fault = f;
    }
    if (bad >= 0) {
      NoteFault(worst, t * K + bad, fault);
#pragma unroll
      for (int k = 0; k < kRegSlots; ++k) e[k] = k, g[k] = 0.f;  // distinct in-range experts, zero weight
    }
    // Dropless: every slot accepted, so RenormalizeTokenGates's S and A are the same sum (double, slot order)
    // and each effective gate is the gate itself, or 0 when that sum is 0.
    double sum = 0;
#pragma unroll
    for (int k = 0; k < kRegSlots; ++k)
      if (k < K) sum += g[k];
    uint32_t owners_of[kRegSlots];
#pragma unroll
    for (int k = 0; k < kRegSlots; ++k)
      if (k < K) owners_of[k] = static_cast<uint32_t>(own.owner[e[k]]);
#pragma unroll
    for (int k = 0; k < kRegSlots; ++k)
      if (k < K) {
        my_e[k] = e[k], my_g[k] = g[k], my_f[k] = sum == 0 ? 0.f : g[k];
        mask |= 1u << owners_of[k];
      }
    mask_of[t] = mask;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < span; i += kThreads)
    experts[base + i] = s_e[i], gates[base + i] = s_g[i], accepted[base + i] = 1, effective[base + i] = s_f[i];
  for (int q = 0; q < W; ++q) {
    const unsigned sends = __ballot_sync(0xffffffffu, (mask >> q) & 1u);
    if ((threadIdx.x & 31) == 0 && sends != 0) atomicAdd(&count[q], __popc(sends));
  }
  __syncthreads();
  if (threadIdx.x < W) part[static_cast<int64_t>(threadIdx.x) * gridDim.x + blockIdx.x] = count[threadIdx.x];
}

// Fast path, kernel 2, block (b, q): positions from the first kernel's masks; block (0, 0) finishes the plan.
__global__ void __launch_bounds__(kThreads) WindowPlaceFastKernel(const uint32_t* mask_of, int64_t n, RegionLayout l, int32_t rank,
                                                                 const int32_t* part, int32_t* tok_index, int64_t* window_tokens,
                                                                 int64_t* control_copy, unsigned long long* worst, RoutingFault* fault,
                                                                 int64_t* zero, const int32_t* from_experts, const float* from_gates) {
  cuda::WaitForPrimaryGrid();
  __shared__ typename Scan::TempStorage scan;
  const int q = static_cast<int>(blockIdx.y);
  const int64_t t = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const uint32_t mask = t < n ? mask_of[t] : 0u;
  const bool finisher = q == 0 && blockIdx.x == 0;
  if (finisher) FinishPlan(l, rank, control_copy, worst, fault, zero, from_experts, from_gates);
  PlacePositions((mask >> q) & 1u, n, q, part, tok_index, window_tokens, scan);
  if (finisher && threadIdx.x == 0) __threadfence_system();  // the record (written before the scans) may be host memory
}

// General path (K > kRegSlots or W > kMaskOwners), kernel 1, block b: the copy, the check and the stand-in, and
// part[q * B + b], reading a token's slots from memory (the copy) each time; no acceptance and no owner word (kernel 2
// does the acceptance and asks each token's owners again).
__global__ void __launch_bounds__(kThreads) WindowCheckCountKernel(const int32_t* from_experts, const float* from_gates,
                                                                  int32_t* experts, float* gates, int64_t n, int64_t K,
                                                                  int32_t num_experts, int32_t W, OwnerMapView own,
                                                                  unsigned long long* worst, int32_t* part) {
  cuda::WaitForPrimaryGrid();
  const int64_t t = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const bool mine = t < n;
  if (mine) {
    int32_t* e = experts + t * K;
    float* g = gates + t * K;
    for (int64_t k = 0; k < K; ++k) e[k] = from_experts[t * K + k], g[k] = from_gates[t * K + k];
    for (int64_t k = 0; k < K; ++k) {
      const RouteSlotFault f = CheckRouteSlot(e, g, k, num_experts);
      if (f == RouteSlotFault::kNone) continue;
      NoteFault(worst, t * K + k, f);
      for (int64_t j = 0; j < K; ++j) e[j] = static_cast<int32_t>(j), g[j] = 0.f;  // distinct in-range experts, zero weight
      break;
    }
  }
  for (int q = 0; q < W; ++q) {
    const int count = __syncthreads_count(mine && SendsTo(experts + t * K, K, own, q));
    if (threadIdx.x == 0) part[static_cast<int64_t>(q) * gridDim.x + blockIdx.x] = count;
  }
}

// General path, kernel 2, block (b, q): positions; the q = 0 blocks accept every slot with its effective gates;
// block (0, 0) finishes the plan.
__global__ void __launch_bounds__(kThreads) WindowPlaceKernel(const int32_t* experts, const float* gates, int64_t n, RegionLayout l,
                                                             OwnerMapView own, int32_t rank, const int32_t* part, int32_t* tok_index,
                                                             int64_t* window_tokens, uint8_t* accepted, float* effective,
                                                             int64_t* control_copy, unsigned long long* worst, RoutingFault* fault,
                                                             int64_t* zero, const int32_t* from_experts, const float* from_gates) {
  cuda::WaitForPrimaryGrid();
  __shared__ typename Scan::TempStorage scan;
  const int q = static_cast<int>(blockIdx.y);
  const int64_t K = l.K;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  PlacePositions(t < n && SendsTo(experts + t * K, K, own, q), n, q, part, tok_index, window_tokens, scan);
  if (q != 0) return;
  if (t < n) {  // dropless: every slot accepted
    for (int64_t k = 0; k < K; ++k) accepted[t * K + k] = 1;
    RenormalizeTokenGates(gates + t * K, accepted + t * K, K, effective + t * K);  // as rdep::RenormalizeGates
  }
  if (blockIdx.x != 0) return;
  FinishPlan(l, rank, control_copy, worst, fault, zero, from_experts, from_gates);
  if (threadIdx.x == 0) __threadfence_system();  // the record may be host memory
}

}  // namespace

// Per (owner, block) its token count, then (fast path) a word per token: the owners it sends to.
int64_t WindowPlanScratchInts(const RegionLayout& l, int64_t max_tokens) {
  return l.W * Blocks(max_tokens) + (FastPath(l) ? std::max<int64_t>(max_tokens, 0) : 0);
}

Status LaunchWindowPlan(const int32_t* from_experts, const float* from_gates, int64_t n, const RegionLayout& l, OwnerMapView own,
                        int32_t num_experts, int32_t rank, int32_t* experts, float* gates, int32_t* tok_index, int64_t* window_tokens,
                        uint8_t* accepted, float* effective, int64_t* control_copy, unsigned long long* worst, RoutingFault* fault,
                        int64_t* zero, int32_t* scratch, int64_t scratch_ints, cudaStream_t s) {
  if (n > 0 && (from_experts == nullptr || from_gates == nullptr))
    return InvalidArgument("window plan: " + std::to_string(n) + " tokens without the caller's from_experts and from_gates");
  if (rank < 0 || rank >= l.W) return InvalidArgument("window plan: rank " + std::to_string(rank) + " outside [0, W=" + std::to_string(l.W) + ")");
  if (l.W > 65535) return InvalidArgument("window plan: W=" + std::to_string(l.W) + " ranks: the grid takes at most 65535");
  if (l.K > num_experts)
    return InvalidArgument("window plan: K=" + std::to_string(l.K) + " slots need as many experts for a faulty token's stand-in (E=" +
                           std::to_string(num_experts) + ")");
  if (scratch_ints < WindowPlanScratchInts(l, n))
    return InvalidArgument("window plan: " + std::to_string(scratch_ints) + " scratch ints for n=" + std::to_string(n) +
                           " tokens, which need " + std::to_string(WindowPlanScratchInts(l, n)));
  const auto B = static_cast<unsigned>(Blocks(n));
  const dim3 grid2(B, static_cast<unsigned>(l.W));
  if (FastPath(l)) {
    auto* mask_of = reinterpret_cast<uint32_t*>(scratch + l.W * B);
    RDEP_LAUNCH_PDL(WindowCheckCountFastKernel, B, kThreads, 0, s, from_experts, from_gates, experts, gates, accepted, effective, n,
                    static_cast<int32_t>(l.K), num_experts, static_cast<int32_t>(l.W), own, worst, scratch, mask_of);
    RDEP_LAUNCH_PDL(WindowPlaceFastKernel, grid2, kThreads, 0, s, mask_of, n, l, rank, scratch, tok_index, window_tokens, control_copy,
                    worst, fault, zero, from_experts, from_gates);
    return Status::Ok();
  }
  RDEP_LAUNCH_PDL(WindowCheckCountKernel, B, kThreads, 0, s, from_experts, from_gates, experts, gates, n, l.K, num_experts,
                  static_cast<int32_t>(l.W), own, worst, scratch);
  RDEP_LAUNCH_PDL(WindowPlaceKernel, grid2, kThreads, 0, s, experts, gates, n, l, own, rank, scratch, tok_index, window_tokens,
                  accepted, effective, control_copy, worst, fault, zero, from_experts, from_gates);
  return Status::Ok();
}

}  // namespace rdep::dispatch
