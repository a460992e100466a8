// Phase 1's kernels at a source (see rdep/dispatch/dispatch_kernels.h): the routing check, the load
// matrix row, the counts per owner with each token's position in the owner's stream, and the ranks per
// expert. Positions come from scans in token order, never from atomics on positions, so every layout is
// deterministic and identical to the host backend's.
//
// Speed (ncu on one H200, Moonlight shape, n = 4096 tokens, K = 6): a single block walking the tokens
// with one dependent load after another took 17 us to validate and 23 us to count, most of the routing
// phase. Here the check is spread over the GPU (a thread per token) and the scans stage their tokens'
// expert ids into shared memory with 16-byte loads before reading them, so a block waits on memory
// once per tile instead of once per slot.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <string>

#include "rdep/core/route_rules.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"
#include "launch/pdl.h"

namespace rdep::dispatch {
namespace {

constexpr int kTileThreads = 1024;
using TileScan = cub::BlockScan<int, kTileThreads>;
// Dynamic shared memory of a staged kernel: its small tables, then the tile of staged expert ids.
constexpr size_t kStageSharedBytes = 40 * 1024;  // under the 48 KiB a launch gets without opting in
constexpr int64_t kMaxTileTokens = 4 * kTileThreads;  // runs of at most four tokens per thread

// A thread's contiguous run [begin, end) of the tile's nt tokens: counted, one block scan, then written
// in order, so positions are the token-order ones with one scan per tile.
struct ThreadRun {
  int64_t begin, end;
};
__device__ __forceinline__ ThreadRun RunOf(int64_t nt) {
  const int64_t per = (nt + kTileThreads - 1) / kTileThreads;
  const int64_t b = min(nt, static_cast<int64_t>(threadIdx.x) * per);
  return {b, min(nt, b + per)};
}

// dst[0, count) = src[0, count) by the whole block: 16-byte loads when src is 16-byte aligned (dst, a
// shared tile, always is), all of a thread's loads independent of each other. src is read-only while
// the kernel runs.
__device__ __forceinline__ void StageInts(const int32_t* __restrict__ src, int64_t count, int32_t* __restrict__ dst) {
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    const int64_t n4 = count / 4;
    const auto* s4 = reinterpret_cast<const int4*>(src);
    auto* d4 = reinterpret_cast<int4*>(dst);
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) d4[i] = __ldg(s4 + i);
    done = n4 * 4;
  }
  for (int64_t i = done + threadIdx.x; i < count; i += blockDim.x) dst[i] = __ldg(src + i);
}

// ---- the routing check -------------------------------------------------------------------------------

// A thread per token: its slots copied from the caller's arrays first (when given), then its first faulty
// slot's key folded into *worst as the complement (atomicMax of ~key is the minimum key; 0 = no fault yet).
__global__ void CheckRoutingKernel(int32_t* experts, float* gates, int64_t n, int64_t K, int32_t num_experts,
                                   unsigned long long* worst, const int32_t* from_experts, const float* from_gates) {
  cuda::WaitForPrimaryGrid();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  if (from_experts) {
    for (int64_t k = 0; k < K; ++k) {
      experts[t * K + k] = from_experts[t * K + k];
      gates[t * K + k] = from_gates[t * K + k];
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const RouteSlotFault f = CheckRouteSlot(experts + t * K, gates + t * K, k, num_experts);
    if (f == RouteSlotFault::kNone) continue;
    atomicMax(worst, ~((static_cast<unsigned long long>(t * K + k) << 2) | static_cast<unsigned long long>(f)));
    return;
  }
}

// One block after the check: the record (the first fault's values as given, before any rewrite), *worst
// back to 0 for the next launch, then (only with a fault) every faulty token rewritten in place.
constexpr int kFinishThreads = 1024;
__global__ void __launch_bounds__(kFinishThreads) FinishRoutingCheckKernel(int32_t* experts, float* gates, int64_t n, int64_t K,
                                                                           int32_t num_experts, unsigned long long* worst,
                                                                           RoutingFault* fault, int64_t* zero) {
  cuda::WaitForPrimaryGrid();
  const unsigned long long first = ~*worst;  // every thread reads it before thread 0 resets it
  __syncthreads();
  if (threadIdx.x == 0) {
    *worst = 0;
    if (zero) *zero = 0;
    RoutingFault r{first, 0, 0.f};
    if (first != ~0ull) {
      r.expert = experts[first >> 2];
      r.gate = gates[first >> 2];
    }
    *fault = r;
    __threadfence_system();  // the record may be host memory
  }
  if (first == ~0ull) return;
  __syncthreads();  // the record's values are read before any rewrite
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    bool bad = false;
    for (int64_t k = 0; k < K && !bad; ++k) bad = CheckRouteSlot(experts + t * K, gates + t * K, k, num_experts) != RouteSlotFault::kNone;
    if (!bad) continue;
    for (int64_t j = 0; j < K; ++j) {  // a valid stand-in: distinct in-range experts, zero weight
      experts[t * K + j] = static_cast<int32_t>(j);
      gates[t * K + j] = 0.f;
    }
  }
}

// ---- the load matrix row -----------------------------------------------------------------------------

__global__ void __launch_bounds__(kTileThreads) PublishLoadRowKernel(const int32_t* experts, int64_t n, RegionLayout l,
                                                                     int32_t rank, int64_t tile_items,
                                                                     int64_t* const* control_of) {
  cuda::WaitForPrimaryGrid();
  extern __shared__ __align__(16) int smem[];
  int* load_shared = smem;                                     // [E]
  int* tile = smem + ((l.E_load + 3) & ~int64_t{3});           // [tile_items]
  for (int64_t e = threadIdx.x; e < l.E_load; e += blockDim.x) load_shared[e] = 0;
  const int64_t items = n * l.K;
  for (int64_t i0 = 0; i0 < items; i0 += tile_items) {
    const int64_t ni = min(tile_items, items - i0);
    __syncthreads();  // the zeroing and the previous tile's reads are done
    StageInts(experts + i0, ni, tile);
    __syncthreads();
    for (int64_t i = threadIdx.x; i < ni; i += blockDim.x) atomicAdd(&load_shared[tile[i]], 1);
  }
  __syncthreads();
  int64_t* dst = control_of[blockIdx.x] + l.load(rank, 0);
  for (int64_t e = threadIdx.x; e < l.E_load; e += blockDim.x) dst[e] = load_shared[e];
}

// ---- counts per owner, positions in its stream ----------------------------------------------------------
// Two kernels over (block of kCountThreads tokens, owner q), a thread per token, so every owner's count is
// spread over the GPU rather than one SM: the first counts each block's tokens and rows for q into the
// scratch, the second gives each token its position (the earlier blocks' tokens + a block scan) and the
// first block of each owner publishes the sums.
constexpr int kCountThreads = 256;
using CountScan = cub::BlockScan<int, kCountThreads>;

// Whether token t (its ids at experts + t*K) sends a row to owner q; its rows counted into rows_shared
// when count is set.
__device__ __forceinline__ bool SendsTo(const int32_t* experts, int64_t t, int64_t K, const RouteTargets& targets, int q,
                                        int* rows_shared, bool count) {
  bool flag = false;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t i = t * K + k;
    const int32_t e = experts[i];
    if (targets.rank(i, e) != q) continue;
    flag = true;
    if (count) atomicAdd(&rows_shared[targets.local(i, e)], 1);
  }
  return flag;
}

// Block (b, q): part[(q * B + b) * (L + 1) + j] = the block's rows on q's local expert j, [... + L] its
// tokens sending to q.
__global__ void __launch_bounds__(kCountThreads) CountBlockKernel(const int32_t* experts, int64_t n, RegionLayout l,
                                                                  RouteTargets targets, int32_t* part) {
  cuda::WaitForPrimaryGrid();
  extern __shared__ int rows_shared[];  // [L]
  const int q = static_cast<int>(blockIdx.y);
  const int64_t B = gridDim.x, b = blockIdx.x;
  for (int64_t j = threadIdx.x; j < l.L; j += blockDim.x) rows_shared[j] = 0;
  __syncthreads();
  const int64_t t = b * kCountThreads + threadIdx.x;
  const bool flag = t < n && SendsTo(experts, t, l.K, targets, q, rows_shared, true);
  const int tokens = __syncthreads_count(flag);  // also orders the row counts before their reads
  int32_t* mine = part + (q * B + b) * (l.L + 1);
  for (int64_t j = threadIdx.x; j < l.L; j += blockDim.x) mine[j] = rows_shared[j];
  if (threadIdx.x == 0) mine[l.L] = tokens;
}

// Block (b, q): tok_index[q*n + t] for its tokens; block (0, q) publishes q's rows per local expert and
// tokens into q's control words.
__global__ void __launch_bounds__(kCountThreads) PlaceTokensKernel(const int32_t* experts, int64_t n, RegionLayout l,
                                                                   RouteTargets targets, int32_t rank, const int32_t* part,
                                                                   int32_t* tok_index, int64_t* const* control_of) {
  cuda::WaitForPrimaryGrid();
  extern __shared__ int sums_shared[];  // [L + 1], block 0 only
  __shared__ typename CountScan::TempStorage scan;
  const int q = static_cast<int>(blockIdx.y);
  const int64_t B = gridDim.x, b = blockIdx.x, L = l.L;
  const int32_t* of_q = part + q * B * (L + 1);
  int before = 0;  // tokens of blocks < b sending to q: a block-wide sum
  for (int64_t bb = threadIdx.x; bb < b; bb += blockDim.x) before += of_q[bb * (L + 1) + L];
  int base, unused;
  CountScan(scan).ExclusiveSum(before, unused, base);  // base: the block aggregate
  __syncthreads();  // the scan storage is reused
  const int64_t t = b * kCountThreads + threadIdx.x;
  const bool flag = t < n && SendsTo(experts, t, l.K, targets, q, nullptr, false);
  int pos;
  CountScan(scan).ExclusiveSum(flag ? 1 : 0, pos);
  if (t < n) tok_index[static_cast<int64_t>(q) * n + t] = flag ? base + pos : -1;
  if (b != 0) return;
  for (int64_t j = threadIdx.x; j <= L; j += blockDim.x) sums_shared[j] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < B * (L + 1); i += blockDim.x) atomicAdd(&sums_shared[i % (L + 1)], of_q[i]);
  __syncthreads();
  int64_t* c = control_of[q];
  for (int64_t j = threadIdx.x; j < L; j += blockDim.x) c[l.recv_counts(rank, j)] = sums_shared[j];
  if (threadIdx.x == 0) c[l.recv_tokens(rank)] = sums_shared[L];
}

// ---- ranks per expert ------------------------------------------------------------------------------------

// The slot of expert e among a token's K ids (the last one: a validated token's experts are distinct), or -1.
__device__ __forceinline__ int64_t SlotOn(const int32_t* ids, int64_t K, int e) {
  int64_t slot = -1;
  for (int64_t k = 0; k < K; ++k)
    if (ids[k] == e) slot = k;
  return slot;
}

__global__ void __launch_bounds__(kTileThreads) ExpertRankKernel(const int32_t* experts, int64_t n, int64_t K, int64_t tile_tokens,
                                                                 int32_t* rank_in_expert) {
  cuda::WaitForPrimaryGrid();
  extern __shared__ __align__(16) int tile[];  // [tile_tokens * K]
  __shared__ typename TileScan::TempStorage scan;
  const int e = static_cast<int>(blockIdx.x);
  int64_t base = 0;
  for (int64_t t0 = 0; t0 < n; t0 += tile_tokens) {
    const int64_t nt = min(tile_tokens, n - t0);
    __syncthreads();
    StageInts(experts + t0 * K, nt * K, tile);
    __syncthreads();
    const ThreadRun run = RunOf(nt);
    int mine = 0;
    for (int64_t t = run.begin; t < run.end; ++t) mine += SlotOn(tile + t * K, K, e) >= 0 ? 1 : 0;
    int pos, total;
    TileScan(scan).ExclusiveSum(mine, pos, total);
    for (int64_t t = run.begin; t < run.end; ++t) {
      const int64_t slot = SlotOn(tile + t * K, K, e);
      if (slot >= 0) rank_in_expert[(t0 + t) * K + slot] = static_cast<int32_t>(base + pos++);
    }
    base += total;
  }
}

// The tile of a staged kernel whose tables take `table_ints` ints: how many items of `per` ints each
// fit beside them (at most kMaxTileTokens items), or 0 when not one does.
// A multiple of 4 when at least 4 fit, so every tile's ids start on a 16-byte boundary (when the first do).
int64_t TileItems(int64_t table_ints, int64_t per) {
  const int64_t free_ints = static_cast<int64_t>(kStageSharedBytes / sizeof(int)) - ((table_ints + 3) & ~int64_t{3});
  if (free_ints < per) return 0;
  const int64_t items = std::min<int64_t>(free_ints / per, kMaxTileTokens);
  return items >= 4 ? items / 4 * 4 : items;
}
size_t StagedShared(int64_t table_ints, int64_t tile_ints) {
  return static_cast<size_t>(((table_ints + 3) & ~int64_t{3}) + tile_ints) * sizeof(int);
}

}  // namespace

Status LaunchValidateRouting(int32_t* experts, float* gates, int64_t n, int64_t K, int32_t num_experts,
                             unsigned long long* worst, RoutingFault* fault, cudaStream_t s, int64_t* zero,
                             const int32_t* from_experts, const float* from_gates) {
  if (n > 0 && (from_experts == nullptr) != (from_gates == nullptr))
    return InvalidArgument("LaunchValidateRouting: from_experts and from_gates are given together or not at all");
  if (n > 0) {
    RDEP_LAUNCH_PDL(CheckRoutingKernel, static_cast<unsigned>((n + 255) / 256), 256, 0, s, experts, gates, n, K, num_experts, worst,
                    from_experts, from_gates);
  }
  RDEP_LAUNCH_PDL(FinishRoutingCheckKernel, 1, kFinishThreads, 0, s, experts, gates, n, K, num_experts, worst, fault, zero);
  return Status::Ok();
}

Status LaunchPublishLoadRow(const int32_t* experts, int64_t n, const RegionLayout& l, int32_t rank,
                            int64_t* const* control_of, cudaStream_t s) {
  if (l.E_load <= 0) return Status::Ok();
  const int64_t tile = TileItems(l.E_load, 1);
  if (tile <= 0)
    return InvalidArgument("load matrix row: E=" + std::to_string(l.E_load) + " counters do not fit the kernel's shared memory");
  RDEP_LAUNCH_PDL(PublishLoadRowKernel, static_cast<unsigned>(l.W), kTileThreads, StagedShared(l.E_load, tile), s, experts, n, l, rank,
                  tile, control_of);
  return Status::Ok();
}

// Blocks of the counts' grid per owner for n tokens (one block even for none: it publishes zeros).
static int64_t CountBlocks(int64_t n) { return std::max<int64_t>((n + kCountThreads - 1) / kCountThreads, 1); }

int64_t CountScratchInts(const RegionLayout& l, int64_t max_tokens) { return l.W * CountBlocks(max_tokens) * (l.L + 1); }

Status CheckKernelLimits(const RegionLayout& l) {
  static_assert((kMaxCountLocalExperts + 1) * sizeof(int) <= kStageSharedBytes, "the counts' counters fit their shared memory");
  if (l.L >= kMaxCountLocalExperts || l.L > kMaxExpandLocalExperts)
    return InvalidArgument("L=" + std::to_string(l.L) + " physical experts per rank: phase 1's counts take fewer than " +
                           std::to_string(kMaxCountLocalExperts) + " and the owner's expansion at most " +
                           std::to_string(kMaxExpandLocalExperts) + " (shared memory)");
  if (TileItems(0, l.K) <= 0)
    return InvalidArgument("K=" + std::to_string(l.K) + " slots per token: the staged scans hold at least one token's ids (K < " +
                           std::to_string(kStageSharedBytes / sizeof(int)) + ")");
  if (l.W > 65535) return InvalidArgument("W=" + std::to_string(l.W) + " ranks: phase 1's grid takes at most 65535");
  return Status::Ok();
}

Status LaunchCountAndPublish(const int32_t* experts, int64_t n, const RegionLayout& l, RouteTargets targets, int32_t rank,
                             int32_t* tok_index, int64_t* const* control_of, int32_t* scratch, int64_t scratch_ints,
                             cudaStream_t s) {
  RDEP_RETURN_IF_ERROR(CheckKernelLimits(l));
  if (scratch_ints < CountScratchInts(l, n))
    return InvalidArgument("phase 1 counts: " + std::to_string(scratch_ints) + " scratch ints for n=" + std::to_string(n) +
                           " tokens, which need " + std::to_string(CountScratchInts(l, n)));
  const size_t shared = static_cast<size_t>(l.L + 1) * sizeof(int);
  const dim3 grid(static_cast<unsigned>(CountBlocks(n)), static_cast<unsigned>(l.W));
  RDEP_LAUNCH_PDL(CountBlockKernel, grid, kCountThreads, shared, s, experts, n, l, targets, scratch);
  RDEP_LAUNCH_PDL(PlaceTokensKernel, grid, kCountThreads, shared, s, experts, n, l, targets, rank, scratch, tok_index, control_of);
  return Status::Ok();
}

Status LaunchExpertRank(const int32_t* experts, int64_t n, int64_t K, int32_t num_experts, int32_t* rank_in_expert,
                        cudaStream_t s) {
  if (n == 0) return Status::Ok();
  const int64_t tile = TileItems(0, K);
  if (tile <= 0) return InvalidArgument("expert ranks: K=" + std::to_string(K) + " slots per token do not fit the kernel's shared memory");
  RDEP_LAUNCH_PDL(ExpertRankKernel, static_cast<unsigned>(num_experts), kTileThreads, StagedShared(0, tile * K), s, experts, n, K,
                  tile, rank_in_expert);
  return Status::Ok();
}

}  // namespace rdep::dispatch
