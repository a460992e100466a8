// A forward's whole plan under per-source windows (LaunchWindowPlan, rdep/dispatch/dispatch_kernels.h)
// in two kernels, a thread per token. The three-phase plan takes six kernels and two barriers: the
// routing check and its one-block finish, the counts and the positions, then the counts barrier, the
// owner scan, the offsets barrier and the acceptance. With windows nothing is exchanged, so:
//   1. copy the caller's routing, check it (rdep::CheckRouteSlot, as LaunchValidateRouting), rewrite a
//      faulty token in place by its own thread (the stand-in of the check's finish), fold the first
//      fault into *worst; per block of kThreads tokens, the tokens it sends to each owner;
//   2. per (block, owner) the tokens' positions (the earlier blocks' tokens + a block scan); each owner's
//      tokens; every slot accepted with its effective gates; the control copy; the fault record (the
//      first fault's values read from the caller's arrays, which nothing rewrites) and the words reset.
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

namespace rdep::dispatch {
namespace {

constexpr int kThreads = 256;
using Scan = cub::BlockScan<int, kThreads>;

int64_t Blocks(int64_t n) { return std::max<int64_t>((n + kThreads - 1) / kThreads, 1); }

__device__ __forceinline__ bool SendsTo(const int32_t* ids, int64_t K, const OwnerMapView& own, int q) {
  for (int64_t k = 0; k < K; ++k)
    if (own.owner[ids[k]] == q) return true;
  return false;
}

// Kernel 1, block b: tokens [b*kThreads, ...). part[q * B + b] = its tokens that send to owner q.
__global__ void __launch_bounds__(kThreads) WindowCheckCountKernel(const int32_t* from_experts, const float* from_gates,
                                                                  int32_t* experts, float* gates, int64_t n, int64_t K,
                                                                  int32_t num_experts, int32_t W, OwnerMapView own,
                                                                  unsigned long long* worst, int32_t* part) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const bool mine = t < n;
  if (mine) {
    int32_t* e = experts + t * K;
    float* g = gates + t * K;
    for (int64_t k = 0; k < K; ++k) e[k] = from_experts[t * K + k], g[k] = from_gates[t * K + k];
    for (int64_t k = 0; k < K; ++k) {
      const RouteSlotFault f = CheckRouteSlot(e, g, k, num_experts);
      if (f == RouteSlotFault::kNone) continue;
      atomicMax(worst, ~((static_cast<unsigned long long>(t * K + k) << 2) | static_cast<unsigned long long>(f)));
      for (int64_t j = 0; j < K; ++j) e[j] = static_cast<int32_t>(j), g[j] = 0.f;  // distinct in-range experts, zero weight
      break;
    }
  }
  for (int q = 0; q < W; ++q) {
    const int count = __syncthreads_count(mine && SendsTo(experts + t * K, K, own, q));
    if (threadIdx.x == 0) part[static_cast<int64_t>(q) * gridDim.x + blockIdx.x] = count;
  }
}

// Kernel 2, block (b, q).
__global__ void __launch_bounds__(kThreads) WindowPlaceKernel(const int32_t* experts, const float* gates, int64_t n, RegionLayout l,
                                                             OwnerMapView own, int32_t rank, const int32_t* part, int32_t* tok_index,
                                                             int64_t* window_tokens, uint8_t* accepted, float* effective,
                                                             int64_t* control_copy, unsigned long long* worst, RoutingFault* fault,
                                                             int64_t* zero, const int32_t* from_experts, const float* from_gates) {
  __shared__ typename Scan::TempStorage scan;
  const int q = static_cast<int>(blockIdx.y);
  const int64_t B = gridDim.x, b = blockIdx.x, K = l.K;
  const int32_t* of_q = part + q * B;
  // The earlier blocks' tokens for q (and in block 0 every block's: q's window length).
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
  const bool flag = t < n && SendsTo(experts + t * K, K, own, q);
  int pos;
  Scan(scan).ExclusiveSum(flag ? 1 : 0, pos);
  if (t < n) tok_index[static_cast<int64_t>(q) * n + t] = flag ? base + pos : -1;
  if (b == 0 && threadIdx.x == 0) window_tokens[q] = total;
  if (q != 0) return;
  if (t < n) {  // dropless: every slot accepted
    for (int64_t k = 0; k < K; ++k) accepted[t * K + k] = 1;
    RenormalizeTokenGates(gates + t * K, accepted + t * K, K, effective + t * K);  // as rdep::RenormalizeGates
  }
  if (b != 0) return;
  const auto words = static_cast<int64_t>(l.control_bytes() / sizeof(int64_t));
  for (int64_t w = threadIdx.x; w < words; w += kThreads) control_copy[w] = l.window_word(rank, w);
  if (threadIdx.x == 0) {
    const unsigned long long first = ~*worst;
    *worst = 0;
    *zero = 0;
    RoutingFault r{first, 0, 0.f};
    if (first != ~0ull) r.expert = from_experts[first >> 2], r.gate = from_gates[first >> 2];  // as the caller gave them
    *fault = r;
    __threadfence_system();  // the record may be host memory
  }
}

}  // namespace

int64_t WindowPlanScratchInts(const RegionLayout& l, int64_t max_tokens) { return l.W * Blocks(max_tokens); }

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
  WindowCheckCountKernel<<<B, kThreads, 0, s>>>(from_experts, from_gates, experts, gates, n, l.K, num_experts, static_cast<int32_t>(l.W),
                                                own, worst, scratch);
  RDEP_CUDA_CHECK_LAUNCH();
  WindowPlaceKernel<<<dim3(B, static_cast<unsigned>(l.W)), kThreads, 0, s>>>(experts, gates, n, l, own, rank, scratch, tok_index,
                                                                             window_tokens, accepted, effective, control_copy, worst,
                                                                             fault, zero, from_experts, from_gates);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace rdep::dispatch
