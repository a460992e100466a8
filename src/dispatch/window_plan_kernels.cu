// A forward's whole plan under per-source windows (LaunchWindowPlan, rdep/dispatch/dispatch_kernels.h)
// in one kernel, a thread per token. The three-phase plan takes five kernels and two barriers: the
// routing check and its one-block finish, the counts and the positions, then (after the counts barrier,
// the owner scan and the offsets barrier) the acceptance. With windows nothing is exchanged, and a block
// of kThreads tokens needs from the others only how many of the earlier tokens go to each owner:
//   1. the block takes a ticket (its tile: the order blocks started in), copies its tokens' routing,
//      checks it (rdep::CheckRouteSlot, as LaunchValidateRouting), rewrites a faulty token in place (the
//      stand-in of the check's finish), folds the first fault into *worst, and publishes its tokens per
//      owner, tagged with the launch's epoch;
//   2. it sums the earlier tiles' counts (each waited for until it carries this epoch: a tile waits only
//      on tiles that started before it, so every wait ends), gives its tokens their positions (a block
//      scan), accepts every slot with its effective gates;
//   3. the last block to finish writes each owner's tokens, the control copy and the fault record (the
//      first fault's values read from the caller's arrays, which nothing rewrites), resets the words,
//      and starts the next epoch.
// Positions come from scans in token order, as the three-phase plan's (routing_kernels.cu), so the
// windows hold the same rows in the same order as the packed stream.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "rdep/core/capacity_rules.h"
#include "rdep/core/route_rules.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"

namespace rdep::dispatch {
namespace {

constexpr int kThreads = 256;
using Scan = cub::BlockScan<int, kThreads>;
constexpr uint64_t kWaitNs = 10'000'000'000ull;  // a tile's wait for an earlier one: far beyond any plan; then a trap

int64_t Blocks(int64_t n) { return std::max<int64_t>((n + kThreads - 1) / kThreads, 1); }

// The kernel's words in `state` (uint64): the ticket counter, the blocks done, the last epoch, then per
// (owner q, tile b) the tile's tokens for q as (epoch << 32 | count).
constexpr int64_t kTicket = 0, kDone = 1, kEpoch = 2, kStatus = 3;

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool SendsTo(const int32_t* ids, int64_t K, const OwnerMapView& own, int q) {
  for (int64_t k = 0; k < K; ++k)
    if (own.owner[ids[k]] == q) return true;
  return false;
}

// Tile `tile`'s tokens for owner q once published in this epoch (spinning until then).
__device__ __forceinline__ int WaitCount(const uint64_t* status, uint32_t epoch) {
  const volatile uint64_t* p = status;
  uint64_t v = *p;
  if ((v >> 32) != epoch) {
    const uint64_t start = GlobalTimerNs();
    while (((v = *p) >> 32) != epoch)
      if (GlobalTimerNs() - start > kWaitNs) __trap();  // an earlier tile never published: the state was overwritten
  }
  return static_cast<int>(v & 0xFFFFFFFFu);
}

struct PlanArgs {
  const int32_t* from_experts;
  const float* from_gates;
  int32_t* experts;
  float* gates;
  int64_t n;
  RegionLayout l;
  OwnerMapView own;
  int32_t num_experts, rank;
  int32_t* tok_index;
  int64_t* window_tokens;
  uint8_t* accepted;
  float* effective;
  int64_t* control_copy;
  unsigned long long* worst;
  RoutingFault* fault;
  int64_t* zero;
  uint64_t* state;
};

// Step 1 for token t (mine: t < n): copy, check, rewrite a faulty token in place.
__device__ __forceinline__ void CheckToken(const PlanArgs& a, int64_t t) {
  const int64_t K = a.l.K;
  int32_t* e = a.experts + t * K;
  float* g = a.gates + t * K;
  for (int64_t k = 0; k < K; ++k) e[k] = a.from_experts[t * K + k], g[k] = a.from_gates[t * K + k];
  for (int64_t k = 0; k < K; ++k) {
    const RouteSlotFault f = CheckRouteSlot(e, g, k, a.num_experts);
    if (f == RouteSlotFault::kNone) continue;
    atomicMax(a.worst, ~((static_cast<unsigned long long>(t * K + k) << 2) | static_cast<unsigned long long>(f)));
    for (int64_t j = 0; j < K; ++j) e[j] = static_cast<int32_t>(j), g[j] = 0.f;  // distinct in-range experts, zero weight
    return;
  }
}

// Step 3, by the last block: every tile has published; each owner's tokens, the control copy, the record.
__device__ void FinishPlan(const PlanArgs& a, uint32_t epoch, int64_t B) {
  const int64_t W = a.l.W;
  for (int64_t q = threadIdx.x; q < W; q += kThreads) {
    int64_t total = 0;
    const volatile uint64_t* status = a.state + kStatus + q * B;  // written by other blocks: not through L1
    for (int64_t b = 0; b < B; ++b) total += static_cast<int64_t>(status[b] & 0xFFFFFFFFu);
    a.window_tokens[q] = total;
  }
  const auto words = static_cast<int64_t>(a.l.control_bytes() / sizeof(int64_t));
  for (int64_t w = threadIdx.x; w < words; w += kThreads) a.control_copy[w] = a.l.window_word(a.rank, w);
  if (threadIdx.x == 0) {
    const unsigned long long first = ~*reinterpret_cast<volatile unsigned long long*>(a.worst);
    *a.worst = 0;
    *a.zero = 0;
    RoutingFault r{first, 0, 0.f};
    if (first != ~0ull) r.expert = a.from_experts[first >> 2], r.gate = a.from_gates[first >> 2];  // as the caller gave them
    *a.fault = r;
    a.state[kTicket] = 0;
    a.state[kDone] = 0;
    a.state[kEpoch] = epoch;  // the next launch's blocks read it and use epoch + 1
    __threadfence_system();  // the record may be host memory
  }
}

__global__ void __launch_bounds__(kThreads) WindowPlanKernel(PlanArgs a) {
  __shared__ typename Scan::TempStorage scan;
  __shared__ int64_t tile_shared;
  __shared__ uint32_t epoch_shared;
  __shared__ bool last_shared;
  const int64_t B = gridDim.x, K = a.l.K, W = a.l.W;
  if (threadIdx.x == 0) {
    tile_shared = static_cast<int64_t>(atomicAdd(reinterpret_cast<unsigned long long*>(a.state + kTicket), 1ull));
    epoch_shared = static_cast<uint32_t>(*reinterpret_cast<volatile uint64_t*>(a.state + kEpoch)) + 1u;
  }
  __syncthreads();
  const int64_t tile = tile_shared;
  const uint32_t epoch = epoch_shared;
  const int64_t t = tile * kThreads + threadIdx.x;
  const bool mine = t < a.n;
  if (mine) CheckToken(a, t);
  uint64_t* status = a.state + kStatus;
  for (int64_t q = 0; q < W; ++q) {
    const int count = __syncthreads_count(mine && SendsTo(a.experts + t * K, K, a.own, static_cast<int>(q)));
    if (threadIdx.x == 0) {
      __threadfence();
      atomicExch(reinterpret_cast<unsigned long long*>(status + q * B + tile), (static_cast<uint64_t>(epoch) << 32) | static_cast<uint32_t>(count));
    }
  }
  for (int64_t q = 0; q < W; ++q) {
    int before = 0;  // the earlier tiles' tokens for q
    for (int64_t b = threadIdx.x; b < tile; b += kThreads) before += WaitCount(status + q * B + b, epoch);
    int base, unused;
    Scan(scan).ExclusiveSum(before, unused, base);
    __syncthreads();
    const bool flag = mine && SendsTo(a.experts + t * K, K, a.own, static_cast<int>(q));
    int pos;
    Scan(scan).ExclusiveSum(flag ? 1 : 0, pos);
    __syncthreads();
    if (mine) a.tok_index[q * a.n + t] = flag ? base + pos : -1;
  }
  if (mine) {  // dropless: every slot accepted
    for (int64_t k = 0; k < K; ++k) a.accepted[t * K + k] = 1;
    RenormalizeTokenGates(a.gates + t * K, a.accepted + t * K, K, a.effective + t * K);  // as rdep::RenormalizeGates
  }
  __syncthreads();  // every fault of this block folded, every count read
  if (threadIdx.x == 0) {
    __threadfence();
    last_shared = atomicAdd(reinterpret_cast<unsigned long long*>(a.state + kDone), 1ull) == static_cast<unsigned long long>(B - 1);
  }
  __syncthreads();
  if (!last_shared) return;
  __threadfence();  // the other blocks' faults and counts are visible
  FinishPlan(a, epoch, B);
}

}  // namespace

int64_t WindowPlanStateWords(const RegionLayout& l, int64_t max_tokens) { return kStatus + l.W * Blocks(max_tokens); }

Status LaunchWindowPlan(const int32_t* from_experts, const float* from_gates, int64_t n, const RegionLayout& l, OwnerMapView own,
                        int32_t num_experts, int32_t rank, int32_t* experts, float* gates, int32_t* tok_index, int64_t* window_tokens,
                        uint8_t* accepted, float* effective, int64_t* control_copy, unsigned long long* worst, RoutingFault* fault,
                        int64_t* zero, uint64_t* state, int64_t state_words, cudaStream_t s) {
  if (n > 0 && (from_experts == nullptr || from_gates == nullptr))
    return InvalidArgument("window plan: " + std::to_string(n) + " tokens without the caller's from_experts and from_gates");
  if (rank < 0 || rank >= l.W) return InvalidArgument("window plan: rank " + std::to_string(rank) + " outside [0, W=" + std::to_string(l.W) + ")");
  if (l.K > num_experts)
    return InvalidArgument("window plan: K=" + std::to_string(l.K) + " slots need as many experts for a faulty token's stand-in (E=" +
                           std::to_string(num_experts) + ")");
  if (n > INT32_MAX) return InvalidArgument("window plan: n=" + std::to_string(n) + " tokens: positions are int32");
  if (l.W > INT32_MAX) return InvalidArgument("window plan: W=" + std::to_string(l.W) + " ranks: owners are int32");
  if (state_words < WindowPlanStateWords(l, n))
    return InvalidArgument("window plan: " + std::to_string(state_words) + " state words for n=" + std::to_string(n) +
                           " tokens, which need " + std::to_string(WindowPlanStateWords(l, n)));
  const PlanArgs a{from_experts, from_gates, experts, gates, n, l, own, num_experts, rank, tok_index, window_tokens, accepted, effective,
                   control_copy, worst, fault, zero, state};
  WindowPlanKernel<<<static_cast<unsigned>(Blocks(n)), kThreads, 0, s>>>(a);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace rdep::dispatch
