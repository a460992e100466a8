// LayerConfig::owner_reduce's kernels (rdep/dispatch/dispatch_kernels.h): the owner sums a token's rows
// before they cross back, takes dgate's dot products in backward, and the front-end marks the slots
// whose return rows carry those sums. One warp per token (reduce) or per row (dots).
#include <cuda_bf16.h>

#include <algorithm>

#include <string>

#include "rdep/core/row_id.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"
#include "dispatch/warp_rows.cuh"
#include "launch/pdl.h"

namespace rdep::dispatch {
namespace {

using detail::SegmentTokens;

// The lead row of segment position p: the return row of its sideband's first row (slot order).
__device__ __forceinline__ bf16_bits* LeadRow(const char* sideband_base, size_t tsb, int64_t p, const RegionLayout& l,
                                             void* const* return_of) {
  const auto* first = reinterpret_cast<const RowSideband*>(sideband_base + static_cast<size_t>(p) * tsb + sizeof(int64_t));
  const RowKey key = RowIdCodec{l.T, l.K}.decode(first->row_id);
  return static_cast<bf16_bits*>(return_of[key.rank]) + (key.token * l.K + key.slot) * l.H;
}

// One warp per token of the segment; each lane sums kReduceUnroll 16-byte column chunks per pass, two
// rows at a time (the loads are independent of the sums, so 8 per lane are in flight, as in
// WarpCopyVec16; 4 chunks keep the registers under __launch_bounds__(kTransportThreads) without
// spilling), fp32, rows in sideband order, one bf16 rounding, and the pass's chunks stored into the
// front-end's return row together.
constexpr int kReduceUnroll = 4;
__device__ __forceinline__ void WarpReduceRows(const bf16_bits* rows, const GroupedRow* grouped, const int32_t* my_inv,
                                               int64_t num_rows, bool scale_by_gate, int64_t H8, uint4* dst) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (int64_t base = 0; base < H8; base += 32 * kReduceUnroll) {
    float acc[kReduceUnroll][8] = {};
#pragma unroll 2
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t g = my_inv[r];
      const float w = scale_by_gate ? grouped[g].gate : 1.f;
      const uint4* src = reinterpret_cast<const uint4*>(rows) + g * H8;
      uint4 v[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        const int64_t c = base + u * 32 + lane;
        if (c < H8) v[u] = __ldg(src + c);
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u)
        if (base + u * 32 + lane < H8) detail::FmaBf16x8(acc[u], w, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;
      if (c < H8) dst[c] = detail::PackBf16x8(acc[u]);
    }
  }
}

__global__ void __launch_bounds__(kTransportThreads)
ReduceReturnRowsKernel(const bf16_bits* rows, const GroupedRow* grouped, const int32_t* inv, const void* my_sideband,
                       int32_t buf, int64_t lo, RegionLayout l, const int64_t* my_control, bool scale_by_gate,
                       void* const* return_of) {
  cuda::WaitForPrimaryGrid();
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  const int64_t n_seg = SegmentTokens(l, my_control, lo);
  const size_t tsb = l.token_sideband_bytes();
  const char* base = static_cast<const char*>(my_sideband) + static_cast<size_t>(buf) * l.S * tsb;
  // Segment positions are grouped by source, so warps taking them in order would all store into one
  // front-end at a time (one peer link's bandwidth). Warp w takes source w % W's (w / W)-th token instead:
  // the resident warps store into every front-end at once.
  int64_t most = 0;
  for (int64_t s = 0; s < l.W; ++s) most = max(most, my_control[l.recv_tokens(s)]);
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; w < l.W * most; w += warps) {
    const int64_t src = w % l.W, j = w / l.W;
    if (j >= my_control[l.recv_tokens(src)]) continue;
    const int64_t p = my_control[l.recv_offsets(src)] + j - lo;
    if (p < 0 || p >= n_seg) continue;
    const int64_t num_rows = *reinterpret_cast<const int64_t*>(base + static_cast<size_t>(p) * tsb);
    if (num_rows <= 0) continue;
    WarpReduceRows(rows, grouped, inv + p * l.slots_per_token, num_rows, scale_by_gate, l.H / 8,
                   reinterpret_cast<uint4*>(LeadRow(base, tsb, p, l, return_of)));
  }
}

__global__ void __launch_bounds__(kTransportThreads)
OwnerDotsKernel(const bf16_bits* segment_dy, const bf16_bits* f_rows, const GroupedRow* grouped, int64_t M_bound,
                RegionLayout l, void* const* dots_of, const int64_t* device_rows) {
  cuda::WaitForPrimaryGrid();
  const int64_t M = device_rows ? min(*device_rows, M_bound) : M_bound;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  const RowIdCodec codec{l.T, l.K};
  for (int64_t g = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; g < M; g += warps) {
    const GroupedRow gr = grouped[g];
    const float dot = detail::WarpDotBf16(segment_dy + static_cast<int64_t>(gr.token) * l.H, f_rows + g * l.H, l.H);
    if ((threadIdx.x & 31) == 0) {
      const RowKey key = codec.decode(gr.row_id);
      static_cast<float*>(dots_of[key.rank])[key.token * l.K + key.slot] = dot;
    }
  }
}

__global__ void StoreRowDotsKernel(const float* row_dots, const GroupedRow* grouped, int64_t M_bound, RegionLayout l, void* const* dots_of,
                                   const int64_t* device_rows) {
  cuda::WaitForPrimaryGrid();
  const int64_t M = device_rows ? min(*device_rows, M_bound) : M_bound;
  const RowIdCodec codec{l.T, l.K};
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < M; g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const RowKey key = codec.decode(grouped[g].row_id);
    static_cast<float*>(dots_of[key.rank])[key.token * l.K + key.slot] = row_dots[g];
  }
}

__global__ void LeadSlotsKernel(const int32_t* experts, const uint8_t* accepted, int64_t n, int64_t K, RouteTargets targets,
                                uint8_t* lead) {
  cuda::WaitForPrimaryGrid();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t i = t * K + k;
    bool is_lead = accepted[i] != 0;
    for (int64_t j = 0; j < k && is_lead; ++j) {
      const int64_t ij = t * K + j;
      if (accepted[ij] && targets.rank(ij, experts[ij]) == targets.rank(i, experts[i])) is_lead = false;
    }
    lead[i] = is_lead ? 1 : 0;
  }
}

}  // namespace

Status LaunchReduceReturnRows(const bf16_bits* rows, const GroupedRow* grouped, const int32_t* inv, const void* my_sideband,
                              int32_t buf, int64_t lo, const RegionLayout& l, const int64_t* my_control, bool scale_by_gate,
                              void* const* return_of, const void* my_return, cudaStream_t s) {
  if (l.S == 0) return Status::Ok();
  const auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if (l.H % 8 != 0 || !aligned16(rows) || !aligned16(my_return))  // the SwiGLU layer's rows always are (ExpertMlpDesc)
    return InvalidArgument("reduce return rows: needs H % 8 == 0 (H=" + std::to_string(l.H) + ") and 16-byte aligned rows and return region");
  const detail::TransportGrid g = detail::TransportGridFor(l.S, l);
  RDEP_LAUNCH_PDL(ReduceReturnRowsKernel, g.blocks, g.threads, 0, s, rows, grouped, inv, my_sideband, buf, lo, l, my_control,
                  scale_by_gate, return_of);
  return Status::Ok();
}

Status LaunchOwnerDots(const bf16_bits* segment_dy, const bf16_bits* f_rows, const GroupedRow* grouped, int64_t M,
                       const RegionLayout& l, void* const* dots_of, cudaStream_t s, const int64_t* device_rows) {
  if (M == 0) return Status::Ok();
  const detail::TransportGrid g = detail::TransportGridFor(M, l);
  RDEP_LAUNCH_PDL(OwnerDotsKernel, g.blocks, g.threads, 0, s, segment_dy, f_rows, grouped, M, l, dots_of, device_rows);
  return Status::Ok();
}

Status LaunchStoreRowDots(const float* row_dots, const GroupedRow* grouped, int64_t M, const RegionLayout& l, void* const* dots_of,
                          cudaStream_t s, const int64_t* device_rows) {
  if (M == 0) return Status::Ok();
  const int64_t blocks = std::min<int64_t>((M + 255) / 256, 132 * 4);
  RDEP_LAUNCH_PDL(StoreRowDotsKernel, static_cast<unsigned>(blocks), 256, 0, s, row_dots, grouped, M, l, dots_of, device_rows);
  return Status::Ok();
}

Status LaunchLeadSlots(const int32_t* experts, const uint8_t* accepted, int64_t n, int64_t K, RouteTargets targets, uint8_t* lead,
                       cudaStream_t s) {
  if (n == 0) return Status::Ok();
  RDEP_LAUNCH_PDL(LeadSlotsKernel, static_cast<unsigned>((n + 255) / 256), 256, 0, s, experts, accepted, n, K, targets, lead);
  return Status::Ok();
}

}  // namespace rdep::dispatch
