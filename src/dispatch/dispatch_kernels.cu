// The RDEP protocol kernels (see rdep/dispatch/dispatch_kernels.h) after phase 1 (routing_kernels.cu):
// the owner scan and acceptance, the scatter, the gather, the return and the combine; the owner's
// expansion is in expand_kernels.cu. Placement is computed by scans in token order, never by atomics on
// positions, so every layout is deterministic and identical to the host backend's.
#include <cuda_bf16.h>

#include <cstdlib>
#include <string>

#include <cub/block/block_reduce.cuh>

#include "rdep/core/capacity_rules.h"
#include "rdep/core/row_id.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"
#include "dispatch/warp_rows.cuh"
#include "launch/pdl.h"

namespace rdep::dispatch {
namespace {

using detail::Bf;
using detail::ToBf;
using detail::SegmentTokens;
using detail::WarpBlocks;
using detail::WarpCopyRow;
using detail::WarpScaleRow;

__global__ void OwnerScanKernel(RegionLayout l, int32_t rank, int32_t num_local, int64_t capacity,
                                int64_t* const* control_of, int64_t* rows_per_expert) {
  cuda::WaitForPrimaryGrid();
  const int64_t* mine = control_of[rank];
  for (int j = static_cast<int>(threadIdx.x); j < num_local; j += blockDim.x) {
    SourceOrderAdmission admission{capacity};
    int64_t sum = 0;
    for (int64_t s = 0; s < l.W; ++s) {
      const int64_t admitted = admission.Admit(mine[l.recv_counts(s, j)]);
      sum += admitted;
      control_of[s][l.send_admitted(rank, j)] = admitted;
    }
    rows_per_expert[j] = sum;
  }
  if (threadIdx.x == 0) {
    int64_t base = 0;
    for (int64_t s = 0; s < l.W; ++s) {
      control_of[rank][l.recv_offsets(s)] = base;
      control_of[s][l.send_offsets(rank)] = base;
      base += mine[l.recv_tokens(s)];
    }
    for (int64_t p = 0; p < l.W; ++p) control_of[p][l.owner_tokens(rank)] = base;
  }
}

__global__ void AcceptKernel(const int32_t* experts, const float* gates, const int32_t* rank_in_expert, int64_t n,
                             RegionLayout l, OwnerMapView own, const int64_t* my_control, int64_t* control_copy,
                             uint8_t* accepted, float* effective, int64_t* dropped) {
  cuda::WaitForPrimaryGrid();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (control_copy && t < static_cast<int64_t>(l.control_bytes() / sizeof(int64_t))) control_copy[t] = my_control[t];
  if (t >= n) return;
  const int64_t K = l.K;
  int64_t drops = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t i = t * K + k;
    const int32_t e = experts[i];
    // rank_in_expert null: dropless, every row admitted (the admitted counts are not read)
    const bool acc = rank_in_expert == nullptr || rank_in_expert[i] < my_control[l.send_admitted(own.owner[e], own.local[e])];
    accepted[i] = acc ? 1 : 0;
    if (!acc) ++drops;
  }
  RenormalizeTokenGates(gates + t * K, accepted + t * K, K, effective + t * K);  // as rdep::RenormalizeGates
  if (drops) atomicAdd(reinterpret_cast<unsigned long long*>(dropped), static_cast<unsigned long long>(drops));
}

__global__ void RenormalizeAcceptedKernel(const float* gates, const uint8_t* accepted, int64_t n, int64_t K, float* effective,
                                          int64_t* dropped) {
  cuda::WaitForPrimaryGrid();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  int64_t drops = 0;
  for (int64_t k = 0; k < K; ++k) drops += accepted[t * K + k] ? 0 : 1;
  RenormalizeTokenGates(gates + t * K, accepted + t * K, K, effective + t * K);  // as rdep::RenormalizeGates
  if (drops) atomicAdd(reinterpret_cast<unsigned long long*>(dropped), static_cast<unsigned long long>(drops));
}

// One (token t, owner q) pair of phase 3 by a warp: t's sideband entry in q's segment buffer (its rows on
// q in slot order: row_id, physical local index, effective gate) and, when it has rows there, its payload
// row. Nothing when t sends nothing to q or its stream position falls outside this segment's window.
// Every load that waits on no other is issued first (the head of t's payload row, t's stream position
// at q, q's send offset, t's first 32 slots), so a pair waits on one chain (a slot's expert, then its
// owner) under its row's loads, where loading each value where it is used waited on them in turn
// (position, send offset, slots, owner, gate, row). That chain is what a pair costs when few warps take
// many pairs each: under an SM budget of 16 at W = 2 the scatter took 86 us loading the row once its
// destination was known and 74 loading it first (docs/perf-notes.md).
__device__ __forceinline__ void ScatterTokenToOwner(int64_t t, int64_t q, const bf16_bits* payload, const int32_t* experts,
                                                    const uint8_t* accepted, const float* effective, const int32_t* tok_index,
                                                    int64_t n, const RegionLayout& l, const RouteTargets& targets, int32_t rank,
                                                    const int64_t* my_control, int64_t lo, int32_t buf, void* const* payload_of,
                                                    void* const* sideband_of) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const bf16_bits* row = payload + t * l.H;
  detail::WarpRowHead head;
  int32_t e = 0;  // slot k's expert, acceptance and gate in lane k % 32
  bool acc = false;
  float gate = 0.f;
  head.Load(row, l.H);
  if (lane < l.K) e = experts[t * l.K + lane], acc = accepted[t * l.K + lane] != 0, gate = effective[t * l.K + lane];
  const int32_t idx = tok_index[q * n + t];
  const int64_t offset = my_control[l.send_offsets(q)];
  if (idx < 0) return;
  const int64_t slot = offset + idx - lo;
  if (slot < 0 || slot >= l.S) return;
  const size_t tsb = l.token_sideband_bytes();
  const RowIdCodec codec{l.T, l.K};
  char* sb = static_cast<char*>(sideband_of[q]) + (static_cast<size_t>(buf) * l.S + slot) * tsb;
  auto* rows = reinterpret_cast<RowSideband*>(sb + sizeof(int64_t));
  int num_rows = 0;
  for (int64_t k0 = 0; k0 < l.K; k0 += 32) {
    const int64_t k = k0 + lane;
    if (k0 > 0 && k < l.K) e = experts[t * l.K + k], acc = accepted[t * l.K + k] != 0, gate = effective[t * l.K + k];
    const bool take = k < l.K && acc && targets.rank(t * l.K + k, e) == q;
    const unsigned mask = __ballot_sync(0xFFFFFFFFu, take);
    if (take) {
      const int pos = num_rows + __popc(mask & ((1u << lane) - 1u));
      rows[pos] = RowSideband{codec.encode(rank, t, k), targets.local(t * l.K + k, e), gate};
    }
    num_rows += __popc(mask);
  }
  if (lane == 0) *reinterpret_cast<int64_t*>(sb) = num_rows;
  if (num_rows == 0) return;
  head.Store(row, static_cast<bf16_bits*>(payload_of[q]) + (static_cast<int64_t>(buf) * l.S + slot) * l.H, l.H);
}

// Per-source windows (window_tokens non-null): every position of this rank's window in each owner's
// stream past its tokens there gets a row count of 0 in the sideband, a thread each, so that the
// owner's expansion, which reads every window whole, finds no rows in them (whatever an earlier call left).
__device__ __forceinline__ void ClearWindowTails(const int64_t* window_tokens, const RegionLayout& l, const int64_t* my_control,
                                                 int64_t lo, int32_t buf, void* const* sideband_of) {
  if (window_tokens == nullptr) return;
  const size_t tsb = l.token_sideband_bytes();
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < l.W * l.T; i += threads) {
    const int64_t q = i / l.T, j = i % l.T;
    if (j < window_tokens[q]) continue;
    const int64_t slot = my_control[l.send_offsets(q)] + j - lo;
    if (slot < 0 || slot >= l.S) continue;
    *reinterpret_cast<int64_t*>(static_cast<char*>(sideband_of[q]) + (static_cast<size_t>(buf) * l.S + slot) * tsb) = 0;
  }
}

// A warp per token, its owners in order (RDEP_SCATTER=token, kept for A/B timing: on 4x H100 the pair
// kernel below took dispatch from 266 to 202 us at the Moonlight shape, 805 to 551 us at DeepSeek-V3's).
__global__ void __launch_bounds__(kTransportThreads)
ScatterKernel(const bf16_bits* payload, const int32_t* experts, const uint8_t* accepted,
              const float* effective, const int32_t* tok_index, int64_t n, RegionLayout l,
              RouteTargets targets, int32_t rank, const int64_t* my_control, int64_t lo, int32_t buf,
              void* const* payload_of, void* const* sideband_of, const int64_t* window_tokens) {
  cuda::WaitForPrimaryGrid();
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  for (int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; t < n; t += warps)
    for (int64_t q = 0; q < l.W; ++q)
      ScatterTokenToOwner(t, q, payload, experts, accepted, effective, tok_index, n, l, targets, rank, my_control, lo, buf,
                          payload_of, sideband_of);
  ClearWindowTails(window_tokens, l, my_control, lo, buf, sideband_of);
}

// A warp per (token, owner) pair (the default): a token's stores to its owners proceed in parallel, from
// neighbouring warps that read its row from L2, so more peer stores are in flight per SM.
__global__ void __launch_bounds__(kTransportThreads)
ScatterPairKernel(const bf16_bits* payload, const int32_t* experts, const uint8_t* accepted,
                  const float* effective, const int32_t* tok_index, int64_t n, RegionLayout l,
                  RouteTargets targets, int32_t rank, const int64_t* my_control, int64_t lo, int32_t buf,
                  void* const* payload_of, void* const* sideband_of, const int64_t* window_tokens) {
  cuda::WaitForPrimaryGrid();
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; i < n * l.W; i += warps)
    ScatterTokenToOwner(i / l.W, i % l.W, payload, experts, accepted, effective, tok_index, n, l, targets, rank, my_control, lo, buf,
                        payload_of, sideband_of);
  ClearWindowTails(window_tokens, l, my_control, lo, buf, sideband_of);
}

// The rows a launch covers: M, or (device_rows non-null) the device count capped by it.
__device__ __forceinline__ int64_t RowsNow(const int64_t* device_rows, int64_t M) {
  return device_rows ? min(*device_rows, M) : M;
}

__global__ void GatherRowsKernel(const bf16_bits* src, const GroupedRow* grouped, int64_t M_bound, int64_t H, bool scale,
                                 bf16_bits* out, const int64_t* device_rows) {
  cuda::WaitForPrimaryGrid();
  const int64_t M = RowsNow(device_rows, M_bound);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  for (int64_t g = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; g < M; g += warps) {
    const GroupedRow gr = grouped[g];
    const bf16_bits* s = src + static_cast<int64_t>(gr.token) * H;
    bf16_bits* d = out + g * H;
    if (scale) WarpScaleRow(s, d, H, gr.gate);
    else WarpCopyRow(s, d, H);
  }
}

__global__ void SumCountsKernel(const int64_t* counts, int32_t n, int64_t* total) {
  cuda::WaitForPrimaryGrid();
  using Reduce = cub::BlockReduce<int64_t, 256>;
  __shared__ typename Reduce::TempStorage tmp;
  int64_t mine = 0;
  for (int32_t i = static_cast<int32_t>(threadIdx.x); i < n; i += 256) mine += counts[i];
  const int64_t sum = Reduce(tmp).Sum(mine);
  if (threadIdx.x == 0) *total = sum;
}

__global__ void SentinelEchoKernel(const bf16_bits* x, const GroupedRow* grouped, int64_t M, int64_t H, int32_t rank,
                                   const int32_t* local_to_global, bf16_bits* out) {
  cuda::WaitForPrimaryGrid();
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  for (int64_t g = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; g < M; g += warps) {
    const GroupedRow gr = grouped[g];
    const int32_t expert = local_to_global[gr.local_expert];
    for (int64_t c = lane; c < H; c += 32)
      out[g * H + c] = c < kSentinelFields ? ToBf(SentinelField(gr.row_id, rank, expert, c)) : x[g * H + c];
  }
}

// A prime (Knuth's multiplicative hash constant) above any segment's row count: ReturnRowsKernel's order.
constexpr int64_t kReturnSpread = 2654435761LL;

// A row's loads are issued before its row id, which names where it goes, comes back (as the scatter's:
// under 16 SMs at W = 2 the per-slot return's own stores took 174 us against 202 loading the row after).
__global__ void __launch_bounds__(kTransportThreads)
ReturnRowsKernel(const bf16_bits* rows, const GroupedRow* grouped, int64_t M_bound, RegionLayout l,
                 void* const* return_of, const int64_t* device_rows, bool spread_order) {
  cuda::WaitForPrimaryGrid();
  const int64_t M = RowsNow(device_rows, M_bound);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  const RowIdCodec codec{l.T, l.K};
  // Grouped rows are ordered by expert, then by segment position, and positions by source, so a window of
  // consecutive rows (what the resident warps hold at a time) goes mostly to one front-end when an expert
  // has many rows (skewed routing): one peer link's bandwidth of W - 1. Warp w takes row (w * P) mod M
  // instead (P prime and M < P, so a bijection on [0, M) and w * P < 2^63): each window spreads over the
  // owner's rows, so over its destinations in their proportions. The rows land where they did. Where
  // P = ±1 mod M (M divides P - 1 = 2^4*3*5*17*31^2*677 or P + 1, e.g. M = 240 or 4080) the order is the
  // grouped one or its reverse: still every row once, only without the spread.
  // RDEP_RETURN_ORDER=grouped keeps the grouped order (A/B timing).
  const bool spread = spread_order && M < kReturnSpread && M > 0;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; w < M; w += warps) {
    const int64_t g = spread ? (w * kReturnSpread) % M : w;
    detail::WarpRowHead head;
    head.Load(rows + g * l.H, l.H);
    const RowKey key = codec.decode(grouped[g].row_id);
    head.Store(rows + g * l.H, static_cast<bf16_bits*>(return_of[key.rank]) + (key.token * l.K + key.slot) * l.H, l.H);
  }
}

// Slot i's row in the combine's input: row i of the return region, or (row_of: the owner's rows in place at
// W = 1) row row_of[i]; -1 for an index outside [0, row_bound) (a broken capacity bound: the slot adds nothing).
__device__ __forceinline__ int64_t CombineRow(int64_t i, const int32_t* row_of, int64_t row_bound) {
  if (!row_of) return i;
  const int64_t r = row_of[i];
  return r >= 0 && r < row_bound ? r : -1;
}

// y[t] = sum over k of (weights[t*K+k] or 1) * ret[t*K+k], fp32 in slot order k = 0..K-1 (one fused
// multiply-add per slot, so the vector kernel below gives the same bits); save (when given) keeps each
// returned row (zeros for a dropped slot), the rows dgate reads in backward. With row_of, slot i's row is
// ret[row_of[i]] (CombineRow).
__global__ void CombineKernel(const bf16_bits* ret, const uint8_t* accepted, const float* weights, int64_t K, int64_t H,
                              bf16_bits* y, bf16_bits* save, const int32_t* row_of, int64_t row_bound) {
  cuda::WaitForPrimaryGrid();
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = t * K + k;
      const int64_t r = accepted[i] ? CombineRow(i, row_of, row_bound) : -1;
      if (r < 0) {
        if (save) save[i * H + c] = 0;
        continue;
      }
      const bf16_bits v = ret[r * H + c];
      if (save) save[i * H + c] = v;
      acc = __fmaf_rn(weights ? weights[i] : 1.f, Bf(v), acc);
    }
    y[t * H + c] = ToBf(acc);
  }
}

// The same with 16-byte accesses (8 bf16 per thread and load) for H % 8 == 0 and 16-byte aligned rows:
// the combine reads K rows and writes K saved rows and one output row per token, so it is bound by
// bytes; 2-byte accesses left it at about a third of the copy rate (docs/perf-notes.md).
__global__ void CombineKernelVec8(const uint4* ret, const uint8_t* accepted, const float* weights, int64_t K, int64_t H8,
                                  uint4* y, uint4* save, const int32_t* row_of, int64_t row_bound) {
  cuda::WaitForPrimaryGrid();
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < H8; c += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = t * K + k;
      const int64_t r = accepted[i] ? CombineRow(i, row_of, row_bound) : -1;
      if (r < 0) {
        if (save) save[i * H8 + c] = make_uint4(0u, 0u, 0u, 0u);
        continue;
      }
      const uint4 v = ret[r * H8 + c];
      if (save) save[i * H8 + c] = v;
      detail::FmaBf16x8(acc, weights ? weights[i] : 1.f, v);
    }
    y[t * H8 + c] = detail::PackBf16x8(acc);
  }
}

__global__ void DgateKernel(const bf16_bits* dy, const bf16_bits* f, const float* gates, const uint8_t* accepted, int64_t n,
                            int64_t K, int64_t H, float* scratch, float* dgates, const float* dots) {
  cuda::WaitForPrimaryGrid();
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  for (int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; t < n; t += warps) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = t * K + k;
      const float dot = !accepted[i] ? 0.f : dots ? dots[i] : detail::WarpDotBf16(dy + t * H, f + i * H, H);  // the relays' order too
      if (lane == 0) scratch[i] = dot;
    }
    __syncwarp();
    if (lane == 0)  // as rdep::RenormalizeGatesBackward (math in double), float in and out
      RenormalizeTokenGatesBackward(gates + t * K, accepted + t * K, K, scratch + t * K, dgates + t * K);
  }
}


}  // namespace

Status LaunchOwnerScan(const RegionLayout& l, int32_t rank, int32_t num_local, int64_t capacity, int64_t* const* control_of,
                       int64_t* rows_per_expert, cudaStream_t s) {
  RDEP_LAUNCH_PDL(OwnerScanKernel, 1, 256, 0, s, l, rank, num_local, capacity, control_of, rows_per_expert);
  return Status::Ok();
}

Status LaunchAccept(const int32_t* experts, const float* gates, const int32_t* rank_in_expert, int64_t n,
                    const RegionLayout& l, OwnerMapView own, const int64_t* my_control, int64_t* control_copy,
                    uint8_t* accepted, float* effective_gates, int64_t* dropped, cudaStream_t s) {
  const int64_t words = control_copy ? static_cast<int64_t>(l.control_bytes() / sizeof(int64_t)) : 0;
  const int64_t threads = std::max(n, words);
  if (threads == 0) return Status::Ok();
  RDEP_LAUNCH_PDL(AcceptKernel, static_cast<unsigned>((threads + 255) / 256), 256, 0, s, experts, gates, rank_in_expert, n, l, own,
                  my_control, control_copy, accepted, effective_gates, dropped);
  return Status::Ok();
}

Status LaunchRenormalizeAccepted(const float* gates, const uint8_t* accepted, int64_t n, int64_t K, float* effective_gates,
                                 int64_t* dropped, cudaStream_t s) {
  if (n == 0) return Status::Ok();
  RDEP_LAUNCH_PDL(RenormalizeAcceptedKernel, static_cast<unsigned>((n + 255) / 256), 256, 0, s, gates, accepted, n, K, effective_gates,
                  dropped);
  return Status::Ok();
}

Status LaunchScatter(const bf16_bits* payload, const int32_t* experts, const uint8_t* accepted, const float* effective_gates,
                     const int32_t* tok_index, int64_t n, const RegionLayout& l, RouteTargets targets, int32_t rank,
                     const int64_t* my_control, int64_t lo, int32_t buf, void* const* payload_of, void* const* sideband_of,
                     cudaStream_t s, const int64_t* window_tokens) {
  if (n == 0 && window_tokens == nullptr) return Status::Ok();  // with windows, the tails are cleared still
  static const std::string k = [] {  // the kernel's shape, for A/B timing: pair (default) | token; read once
    const char* v = std::getenv("RDEP_SCATTER");
    return std::string(v ? v : "pair");
  }();
  if (k == "pair") {
    const detail::TransportGrid g = detail::TransportGridFor(std::max<int64_t>(n * l.W, 1), l);
    RDEP_LAUNCH_PDL(ScatterPairKernel, g.blocks, g.threads, 0, s, payload, experts, accepted, effective_gates, tok_index, n, l,
                    targets, rank, my_control, lo, buf, payload_of, sideband_of, window_tokens);
  } else if (k == "token") {
    const detail::TransportGrid g = detail::TransportGridFor(std::max<int64_t>(n, 1), l);
    RDEP_LAUNCH_PDL(ScatterKernel, g.blocks, g.threads, 0, s, payload, experts, accepted, effective_gates, tok_index, n, l, targets,
                    rank, my_control, lo, buf, payload_of, sideband_of, window_tokens);
  } else {
    return InvalidArgument("RDEP_SCATTER='" + k + "': expected pair (a warp per (token, owner), the default) or token (a warp per token)");
  }
  return Status::Ok();
}

Status LaunchGatherRows(const bf16_bits* segment_payload, const GroupedRow* grouped, int64_t M, int64_t H,
                        bool scale_by_gate, bf16_bits* out, cudaStream_t s, const int64_t* device_rows) {
  if (M == 0) return Status::Ok();
  RDEP_LAUNCH_PDL(GatherRowsKernel, WarpBlocks(M), 256, 0, s, segment_payload, grouped, M, H, scale_by_gate, out, device_rows);
  return Status::Ok();
}

Status LaunchSumCounts(const int64_t* counts, int32_t n, int64_t* total, cudaStream_t s) {
  if (n < 0 || n > (1 << 20)) return InvalidArgument("sum counts: n=" + std::to_string(n) + " outside [0, 2^20]");
  RDEP_LAUNCH_PDL(SumCountsKernel, 1, 256, 0, s, counts, n, total);
  return Status::Ok();
}

Status LaunchSentinelEcho(const bf16_bits* x_rows, const GroupedRow* grouped, int64_t M, int64_t H, int32_t rank,
                          const int32_t* local_to_global, bf16_bits* out, cudaStream_t s) {
  if (M == 0) return Status::Ok();
  RDEP_LAUNCH_PDL(SentinelEchoKernel, WarpBlocks(M), 256, 0, s, x_rows, grouped, M, H, rank, local_to_global, out);
  return Status::Ok();
}

Status LaunchReturnRows(const bf16_bits* rows, const GroupedRow* grouped, int64_t M, const RegionLayout& l,
                        void* const* return_of, cudaStream_t s, const int64_t* device_rows) {
  static const std::string order = [] {  // the rows' order, for A/B timing: spread (default) | grouped; read once
    const char* v = std::getenv("RDEP_RETURN_ORDER");
    return std::string(v ? v : "spread");
  }();
  if (order != "spread" && order != "grouped")
    return InvalidArgument("RDEP_RETURN_ORDER='" + order + "': expected spread (rows in a prime-stride order, the default) or grouped");
  if (M == 0) return Status::Ok();  // after the check: a rank without rows refuses a bad value as its peers do
  const bool spread = order == "spread";
  const detail::TransportGrid g = detail::TransportGridFor(M, l);
  RDEP_LAUNCH_PDL(ReturnRowsKernel, g.blocks, g.threads, 0, s, rows, grouped, M, l, return_of, device_rows, spread);
  return Status::Ok();
}

Status LaunchCombine(const bf16_bits* ret, const uint8_t* accepted, const float* weights, int64_t n, int64_t K, int64_t H,
                     bf16_bits* y, bf16_bits* save, cudaStream_t s, const int32_t* row_of, int64_t row_bound) {
  if (n == 0) return Status::Ok();
  const auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if (H % 8 == 0 && aligned16(ret) && aligned16(y) && (save == nullptr || aligned16(save))) {
    const int64_t H8 = H / 8;
    const int threads = H8 >= 256 ? 256 : static_cast<int>(((H8 + 31) / 32) * 32);
    RDEP_LAUNCH_PDL(CombineKernelVec8, static_cast<unsigned>(n), threads, 0, s, reinterpret_cast<const uint4*>(ret), accepted, weights,
                    K, H8, reinterpret_cast<uint4*>(y), reinterpret_cast<uint4*>(save), row_of, row_bound);
    return Status::Ok();
  }
  const int threads = H >= 256 ? 256 : static_cast<int>(((H + 31) / 32) * 32);
  RDEP_LAUNCH_PDL(CombineKernel, static_cast<unsigned>(n), threads, 0, s, ret, accepted, weights, K, H, y, save, row_of, row_bound);
  return Status::Ok();
}

Status LaunchDgate(const bf16_bits* dy, const bf16_bits* saved_f, const float* gates, const uint8_t* accepted, int64_t n,
                   int64_t K, int64_t H, float* scratch, float* dgates, cudaStream_t s, const float* dots) {
  if (n == 0) return Status::Ok();
  RDEP_LAUNCH_PDL(DgateKernel, WarpBlocks(n), 256, 0, s, dy, saved_f, gates, accepted, n, K, H, scratch, dgates, dots);
  return Status::Ok();
}

}  // namespace rdep::dispatch
