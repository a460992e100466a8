// The owner's expansion of a segment (LaunchExpand, rdep/dispatch/dispatch_kernels.h): its tokens'
// sideband rows grouped by local expert, each expert's rows in segment order, as a stable counting sort
// in three kernels over chunks of 32 positions (a warp each):
//   1. per chunk and expert, the chunk's rows (a ballot per expert);
//   2. per expert (a block each), an exclusive scan over the chunks: each chunk's first index within
//      the expert, and the expert's total (the counts);
//   3. per chunk, each row's grouped index: the expert's offset (a scan of the totals) + the chunk's
//      base + the row's rank among the chunk's rows of that expert (the same ballot).
// A chunk's rows of one expert come from distinct positions (a token has at most one row per expert on
// an owner), so the ballot's rank is the segment order. That invariant is the protocol's (the scatter
// writes a token's rows on distinct local experts): the counts count positions with a row on each expert,
// which are its rows. The grid covers the host's bound (S positions);
// chunks past the segment's token count (read on the device) count nothing.
//
// Speed: the previous kernels (one block counting, then a block per expert walking every position)
// took 10 + 28 us at 4096 positions on one H200 (ncu), latency-bound chains of dependent loads.
#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <string>

#include "rdep/core/row_id.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"
#include "dispatch/warp_rows.cuh"
#include "launch/pdl.h"

namespace rdep::dispatch {
namespace {

using detail::SegmentTokens;

constexpr int kChunk = 32;           // positions per chunk: a warp
constexpr int kChunkThreads = 256;   // 8 chunks per block
constexpr int kScanThreads = 1024;   // kernel 2
constexpr int kCachedRows = 8;       // a position's first rows kept in registers
constexpr size_t kOffsetSharedBytes = kMaxExpandLocalExperts * sizeof(int64_t);  // kernel 3's expert offsets
static_assert(kOffsetSharedBytes <= 40 * 1024, "under the 48 KiB a launch gets without opting in");

int64_t Chunks(const RegionLayout& l) { return (l.S + kChunk - 1) / kChunk; }

// One position's sideband rows: their count and local experts (the first kCachedRows in registers).
struct PositionRows {
  const RowSideband* rows = nullptr;
  int64_t count = 0;
  int32_t cached[kCachedRows];

  __device__ __forceinline__ void Load(const char* base, size_t tsb, int64_t p, bool valid) {
    const char* sb = base + static_cast<size_t>(p) * tsb;
    rows = reinterpret_cast<const RowSideband*>(sb + sizeof(int64_t));
    count = valid ? *reinterpret_cast<const int64_t*>(sb) : 0;
#pragma unroll
    for (int r = 0; r < kCachedRows; ++r) cached[r] = r < count ? rows[r].local_expert : -1;
  }
  // The row on local expert j (the last one, as the host's rule), or -1.
  __device__ __forceinline__ int64_t RowOn(int32_t j) const {
    int64_t hit = -1;
#pragma unroll
    for (int r = 0; r < kCachedRows; ++r)
      if (cached[r] == j) hit = r;
    for (int64_t r = kCachedRows; r < count; ++r)
      if (rows[r].local_expert == j) hit = r;
    return hit;
  }
};

__device__ __forceinline__ const char* SegmentSideband(const void* my_sideband, int32_t buf, const RegionLayout& l) {
  return static_cast<const char*>(my_sideband) + static_cast<size_t>(buf) * l.S * l.token_sideband_bytes();
}

// Kernel 1: chunk_rows[j * C + c] = rows of chunk c on local expert j.
__global__ void __launch_bounds__(kChunkThreads) ExpandChunkCountKernel(const void* my_sideband, int32_t buf, int64_t lo, RegionLayout l,
                                                                        const int64_t* my_control, int32_t num_local, int32_t* chunk_rows) {
  cuda::WaitForPrimaryGrid();
  const int64_t C = (l.S + kChunk - 1) / kChunk;
  const int64_t c = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kChunk;
  if (c >= C) return;  // a whole warp
  const int lane = static_cast<int>(threadIdx.x % kChunk);
  const int64_t p = c * kChunk + lane, n_seg = SegmentTokens(l, my_control, lo);
  if (c * kChunk >= n_seg) {  // a chunk past the segment's tokens (the grid covers S): no rows
    for (int32_t j = lane; j < num_local; j += kChunk) chunk_rows[j * C + c] = 0;
    return;
  }
  PositionRows pr;
  pr.Load(SegmentSideband(my_sideband, buf, l), l.token_sideband_bytes(), p, p < n_seg);
  // Experts in groups of 32: lane jj keeps expert j0 + jj's count and stores it (one store per lane).
  for (int32_t j0 = 0; j0 < num_local; j0 += kChunk) {
    int mine = 0;
    const int32_t group = min(kChunk, num_local - j0);
    for (int32_t jj = 0; jj < group; ++jj) {
      const unsigned m = __ballot_sync(0xFFFFFFFFu, pr.RowOn(j0 + jj) >= 0);
      if (lane == jj) mine = __popc(m);
    }
    if (lane < group) chunk_rows[(j0 + lane) * C + c] = mine;
  }
}

// Kernel 2, block j: chunk_rows[j * C + c] becomes the chunk's first index within expert j; counts[j]
// the expert's rows.
__global__ void __launch_bounds__(kScanThreads) ExpandScanKernel(int64_t C, int32_t* chunk_rows, int64_t* counts) {
  cuda::WaitForPrimaryGrid();
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage scan;
  int32_t* mine = chunk_rows + blockIdx.x * C;
  int carry = 0;
  for (int64_t c0 = 0; c0 < C; c0 += kScanThreads) {
    const int64_t c = c0 + threadIdx.x;
    const int v = c < C ? mine[c] : 0;
    int x, total;
    Scan(scan).ExclusiveSum(v, x, total);
    if (c < C) mine[c] = carry + x;
    carry += total;
    __syncthreads();  // the scan storage is reused
  }
  if (threadIdx.x == 0) counts[blockIdx.x] = carry;
}

// Kernel 3: every row's grouped index; rows at indices >= max_rows are not written.
__global__ void __launch_bounds__(kChunkThreads) ExpandPlaceKernel(const void* my_sideband, int32_t buf, int64_t lo, RegionLayout l,
                                                                   const int64_t* my_control, int32_t num_local,
                                                                   const int32_t* chunk_base, const int64_t* counts,
                                                                   GroupedRow* grouped, int64_t max_rows, int32_t* inv,
                                                                   int32_t* slot_rows) {
  cuda::WaitForPrimaryGrid();
  using Scan = cub::BlockScan<int64_t, kChunkThreads>;
  __shared__ typename Scan::TempStorage scan;
  extern __shared__ int64_t offset[];  // [num_local]: expert j's first grouped index
  int64_t carry = 0;
  for (int32_t j0 = 0; j0 < num_local; j0 += kChunkThreads) {
    const int32_t j = j0 + static_cast<int32_t>(threadIdx.x);
    const int64_t v = j < num_local ? counts[j] : 0;
    int64_t x, total;
    Scan(scan).ExclusiveSum(v, x, total);
    if (j < num_local) offset[j] = carry + x;
    carry += total;
    __syncthreads();  // the scan storage is reused; the offsets are complete after the last
  }
  const int64_t C = (l.S + kChunk - 1) / kChunk;
  const int64_t c = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kChunk;
  if (c >= C) return;
  const int lane = static_cast<int>(threadIdx.x % kChunk);
  const int64_t p = c * kChunk + lane, n_seg = SegmentTokens(l, my_control, lo);
  if (c * kChunk >= n_seg) return;  // a chunk past the segment's tokens: nothing to place
  const size_t tsb = l.token_sideband_bytes();
  PositionRows pr;
  pr.Load(SegmentSideband(my_sideband, buf, l), tsb, p, p < n_seg);
  const unsigned below = (1u << lane) - 1u;
  // Experts in groups of 32: lane jj loads expert j0 + jj's chunk base up front (one load per lane, none
  // waited on inside the loop), the loop reads it by shuffle.
  for (int32_t j0 = 0; j0 < num_local; j0 += kChunk) {
    const int32_t group = min(kChunk, num_local - j0);
    const int32_t my_base = lane < group ? chunk_base[(j0 + lane) * C + c] : 0;
    for (int32_t jj = 0; jj < group; ++jj) {
      const int32_t j = j0 + jj;
      const int64_t hit = pr.RowOn(j);
      const unsigned m = __ballot_sync(0xFFFFFFFFu, hit >= 0);
      const int32_t chunk_first = __shfl_sync(0xFFFFFFFFu, my_base, jj);
      if (hit < 0) continue;
      const int64_t g = offset[j] + chunk_first + __popc(m & below);
      const RowSideband rs = pr.rows[hit];
      if (slot_rows) {  // W = 1: every row is rank 0's own (a row of another rank is not this map's); -1 for a cut row
        const RowKey key = RowIdCodec{l.T, l.K}.decode(rs.row_id);
        if (key.rank == 0) slot_rows[key.token * l.K + key.slot] = g < max_rows ? static_cast<int32_t>(g) : -1;
      }
      if (g >= max_rows) continue;  // beyond grouped's size (a broken capacity bound): the caller reports it
      grouped[g] = GroupedRow{rs.row_id, static_cast<int32_t>(p), rs.local_expert, rs.gate, 0};
      if (inv) inv[p * l.slots_per_token + hit] = static_cast<int32_t>(g);
    }
  }
}

}  // namespace

int64_t ExpandScratchInts(const RegionLayout& l, int32_t num_local) {
  return Chunks(l) * std::max<int64_t>(num_local, 1);
}

Status LaunchExpand(const void* my_sideband, int32_t buf, int64_t lo, const RegionLayout& l, const int64_t* my_control,
                    int32_t num_local, int64_t* counts, GroupedRow* grouped, int64_t max_rows, int32_t* scratch, cudaStream_t s,
                    int32_t* inv, int32_t* slot_rows) {
  if (num_local == 0) return Status::Ok();
  if (num_local < 0 || num_local > kMaxExpandLocalExperts)
    return InvalidArgument("expand: " + std::to_string(num_local) + " local experts, outside [0, " +
                           std::to_string(kMaxExpandLocalExperts) + "] (the kernel's shared memory)");
  const size_t offset_bytes = static_cast<size_t>(num_local) * sizeof(int64_t);
  const int64_t C = Chunks(l);
  const auto blocks = static_cast<unsigned>((C * kChunk + kChunkThreads - 1) / kChunkThreads);
  RDEP_LAUNCH_PDL(ExpandChunkCountKernel, blocks, kChunkThreads, 0, s, my_sideband, buf, lo, l, my_control, num_local, scratch);
  RDEP_LAUNCH_PDL(ExpandScanKernel, static_cast<unsigned>(num_local), kScanThreads, 0, s, C, scratch, counts);
  RDEP_LAUNCH_PDL(ExpandPlaceKernel, blocks, kChunkThreads, offset_bytes, s, my_sideband, buf, lo, l, my_control, num_local, scratch,
                  counts, grouped, max_rows, inv, slot_rows);
  return Status::Ok();
}

}  // namespace rdep::dispatch
