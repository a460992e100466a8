// The two-phase exchange's kernels (rdep/dispatch/two_phase_kernels.h; record layouts there). Placement
// comes from scans in token order and from the forward's stream positions, never from atomics, so
// every record and every owner slot is where the host layer (src/layer/host_two_phase.cc) puts it.
#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>

#include "rdep/core/capacity_rules.h"
#include "rdep/core/node_rules.h"
#include "rdep/core/row_id.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/two_phase_kernels.h"
#include "dispatch/warp_rows.cuh"

namespace rdep::dispatch {
namespace {

using detail::Bf;
using detail::ToBf;
using detail::WarpCopyRow;

constexpr int kScanThreads = 512;
using BlockScan = cub::BlockScan<int, kScanThreads>;

// A forward record's meta fields (BundleLayout).
struct MetaView {
  const char* p;
  BundleLayout bl;
  __device__ int32_t token() const { return reinterpret_cast<const int32_t*>(p)[0]; }
  __device__ int32_t source() const { return reinterpret_cast<const int32_t*>(p)[1]; }
  __device__ int32_t expert(int64_t k) const { return reinterpret_cast<const int32_t*>(p + 8)[k]; }
  __device__ float gate(int64_t k) const { return reinterpret_cast<const float*>(p + bl.gate_offset())[k]; }
  __device__ int64_t pos(int64_t g) const { return reinterpret_cast<const int64_t*>(p + bl.pos_offset())[g]; }
};

// First record of node b in a node-major buffer: counts[0] + ... + counts[b-1].
__device__ __forceinline__ int64_t FirstOf(const int64_t* counts, int32_t b) {
  int64_t first = 0;
  for (int32_t a = 0; a < b; ++a) first += counts[a];
  return first;
}

__global__ void BundleIndexKernel(const int32_t* experts, const uint8_t* accepted, int64_t n, int64_t K, const int32_t* owner,
                                  int32_t G, int32_t* bundle_index, int64_t* counts) {
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ int64_t running;
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  for (int64_t base = 0; base < n; base += kScanThreads) {
    const int64_t t = base + threadIdx.x;
    int has = 0;
    if (t < n)
      for (int64_t k = 0; k < K && !has; ++k) has = accepted[t * K + k] && owner[experts[t * K + k]] / G == b;
    int pos = 0, total = 0;
    BlockScan(scan).ExclusiveSum(has, pos, total);
    if (t < n) bundle_index[b * n + t] = has ? static_cast<int32_t>(running + pos) : -1;
    __syncthreads();
    if (threadIdx.x == 0) running += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) counts[b] = running;
}

// One warp per (node b, token t).
__global__ void PackBundlesKernel(const bf16_bits* payload, const int32_t* experts, const uint8_t* accepted, const float* effective,
                                  const int32_t* tok_index, int64_t n, RegionLayout l, BundleLayout bl, const int32_t* owner,
                                  int32_t rank, const int64_t* my_control, const int32_t* bundle_index, const int64_t* counts,
                                  int32_t N, bool with_meta, char* send) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  const int64_t K = bl.K, G = bl.G;
  const int64_t stride = with_meta ? bl.forward_stride() : bl.backward_stride();
  for (int64_t item = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; item < N * n; item += warps) {
    const auto b = static_cast<int32_t>(item / n);
    const int64_t t = item % n;
    const int32_t i = bundle_index[b * n + t];
    if (i < 0) continue;
    char* rec = send + (FirstOf(counts, b) + i) * stride;
    if (with_meta && lane == 0) {
      auto* words = reinterpret_cast<int32_t*>(rec);
      words[0] = static_cast<int32_t>(t);
      words[1] = rank;
      auto* gate = reinterpret_cast<float*>(rec + bl.gate_offset());
      auto* pos = reinterpret_cast<int64_t*>(rec + bl.pos_offset());
      for (int64_t g = 0; g < G; ++g) pos[g] = -1;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = experts[t * K + k];
        const int32_t q = owner[e];
        const bool on = accepted[t * K + k] && q / G == b;
        words[2 + k] = on ? e : -1;
        gate[k] = on ? effective[t * K + k] : 0.f;
        if (on) pos[q % G] = my_control[l.send_offsets(q)] + tok_index[static_cast<int64_t>(q) * n + t];
      }
    }
    WarpCopyRow(payload + t * l.H, reinterpret_cast<bf16_bits*>(rec + (with_meta ? bl.meta_bytes() : 0)), l.H);
  }
}

// One warp per received record.
__global__ void ScatterRelayedKernel(const char* meta, int64_t num, BundleLayout bl, const bf16_bits* rows, int64_t row_stride,
                                     RegionLayout l, OwnerMapView own, int32_t node, int64_t lo, int32_t buf, bool with_sideband,
                                     void* const* payload_of, void* const* sideband_of, int64_t* pairs) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  const size_t tsb = l.token_sideband_bytes();
  const RowIdCodec codec{l.T, l.K};
  for (int64_t j = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; j < num; j += warps) {
    const MetaView m{meta + j * bl.forward_stride(), bl};
    const auto* row = reinterpret_cast<const bf16_bits*>(reinterpret_cast<const char*>(rows) + j * row_stride);
    for (int64_t g = 0; g < bl.G; ++g) {
      const int64_t pos = m.pos(g);
      if (pos < lo || pos >= lo + l.S) continue;  // also pos = -1: no row of the token at this owner
      const int64_t q = static_cast<int64_t>(node) * bl.G + g, slot = pos - lo;
      if (with_sideband && lane == 0) {
        char* sb = static_cast<char*>(sideband_of[q]) + (static_cast<size_t>(buf) * l.S + slot) * tsb;
        auto* out = reinterpret_cast<RowSideband*>(sb + sizeof(int64_t));
        int64_t num_rows = 0;
        for (int64_t k = 0; k < bl.K; ++k) {
          const int32_t e = m.expert(k);
          if (e >= 0 && own.owner[e] == q) out[num_rows++] = RowSideband{codec.encode(m.source(), m.token(), k), own.local[e], m.gate(k)};
        }
        *reinterpret_cast<int64_t*>(sb) = num_rows;
        if (pairs) atomicAdd(reinterpret_cast<unsigned long long*>(pairs), 1ull);
      }
      WarpCopyRow(row, static_cast<bf16_bits*>(payload_of[q]) + (static_cast<int64_t>(buf) * l.S + slot) * l.H, l.H);
    }
  }
}

__global__ void ReturnRowsToRelaysKernel(const bf16_bits* rows, const GroupedRow* grouped, int64_t M, RegionLayout l, int32_t owner_rank,
                                         void* const* return_of) {
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  const RowIdCodec codec{l.T, l.K};
  const NodeSplit split{l.W / l.N};
  for (int64_t g = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; g < M; g += warps) {
    const RowKey key = codec.decode(grouped[g].row_id);
    bf16_bits* dst = static_cast<bf16_bits*>(return_of[split.relay(owner_rank, key.rank)]) + split.relay_return_index(key, l.T, l.K) * l.H;
    WarpCopyRow(rows + g * l.H, dst, l.H);
  }
}

// One block per record: threads over the H columns (fp32 sums in slot order, as CombineKernel), then
// (backward) warp 0 the dot products per slot.
__global__ void ReduceAtRelayKernel(const char* meta, BundleLayout bl, RegionLayout l, const bf16_bits* ret, bool backward,
                                    bf16_bits* keep, const bf16_bits* dy_rows, char* out) {
  const int64_t j = blockIdx.x, K = bl.K, H = bl.H;
  const MetaView m{meta + j * bl.forward_stride(), bl};
  const NodeSplit split{l.W / l.N};
  const RowKey key0{m.source(), m.token(), 0};
  const int64_t first_row = split.relay_return_index(key0, l.T, l.K);  // slot k at first_row + k
  auto* partial = reinterpret_cast<float*>(out + j * bl.reduced_stride(backward));
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      bf16_bits* kept = keep + (j * K + k) * H + c;
      if (m.expert(k) < 0) {
        if (!backward) *kept = 0;
        continue;
      }
      const bf16_bits v = ret[(first_row + k) * H + c];
      if (!backward) {
        *kept = v;
        acc += m.gate(k) * Bf(v);
      } else {
        acc += 1.f * Bf(v);  // as CombineKernel without weights
      }
    }
    partial[c] = acc;
  }
  if (backward && threadIdx.x < 32) {
    auto* dots = reinterpret_cast<float*>(out + j * bl.reduced_stride(true) + BundleLayout::Align16(4 * H));
    const bf16_bits* dy = reinterpret_cast<const bf16_bits*>(reinterpret_cast<const char*>(dy_rows) + j * bl.backward_stride());
    for (int64_t k = 0; k < K; ++k) {
      const float dot = m.expert(k) >= 0 ? detail::WarpDotBf16(dy, keep + (j * K + k) * H, H) : 0.f;  // DgateKernel's order
      if (threadIdx.x == 0) dots[k] = dot;
    }
  }
}

// One block per token.
__global__ void CombineNodesKernel(const char* returned, BundleLayout bl, const int32_t* bundle_index, const int64_t* counts, int32_t N,
                                   int64_t n, bool backward, bf16_bits* out, const int32_t* experts, const int32_t* owner,
                                   const float* gates, const uint8_t* accepted, float* scratch, float* dgates) {
  const int64_t t = blockIdx.x, K = bl.K, H = bl.H, stride = bl.reduced_stride(backward);
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    int64_t first = 0;
    for (int32_t b = 0; b < N; ++b) {  // node order
      const int32_t i = bundle_index[b * n + t];
      if (i >= 0) acc += reinterpret_cast<const float*>(returned + (first + i) * stride)[c];
      first += counts[b];
    }
    out[t * H + c] = ToBf(acc);
  }
  if (backward && threadIdx.x == 0) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = t * K + k;
      float d = 0.f;
      if (accepted[i]) {
        const int32_t b = owner[experts[i]] / static_cast<int32_t>(bl.G);
        const int64_t rec = FirstOf(counts, b) + bundle_index[b * n + t];
        d = reinterpret_cast<const float*>(returned + rec * stride + BundleLayout::Align16(4 * H))[k];
      }
      scratch[i] = d;
    }
    // as rdep::RenormalizeGatesBackward (math in double), float in and out: DgateKernel's call
    RenormalizeTokenGatesBackward(gates + t * K, accepted + t * K, K, scratch + t * K, dgates + t * K);
  }
}

struct OwnerNode {
  const int32_t* owner;
  int32_t G;
  __device__ int64_t operator()(int32_t e) const { return owner[e] / G; }
};

__global__ void CheckNodeLimitKernel(const int32_t* experts, int64_t n, int64_t K, const int32_t* owner, int32_t G, int64_t cap,
                                     unsigned long long* first_bad) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n; t += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (CountTokenNodes(experts + t * K, K, OwnerNode{owner, G}) > cap) atomicMin(first_bad, static_cast<unsigned long long>(t));
}

unsigned WarpBlocks(int64_t items) {
  const int64_t blocks = (items * 32 + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);
}

unsigned ColumnThreads(int64_t H) { return H >= 256 ? 256u : static_cast<unsigned>((H + 31) / 32 * 32); }

}  // namespace

Status LaunchBundleIndex(const int32_t* experts, const uint8_t* accepted, int64_t n, int64_t K, const int32_t* owner, int32_t G,
                         int32_t N, int32_t* bundle_index, int64_t* counts, cudaStream_t s) {
  if (N <= 0 || G <= 0) return InvalidArgument("bundle index: N and G must be >= 1");
  BundleIndexKernel<<<static_cast<unsigned>(N), kScanThreads, 0, s>>>(experts, accepted, n, K, owner, G, bundle_index, counts);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchPackBundles(const bf16_bits* payload, const int32_t* experts, const uint8_t* accepted, const float* effective_gates,
                         const int32_t* tok_index, int64_t n, const RegionLayout& l, const BundleLayout& bl, const int32_t* owner,
                         int32_t rank, const int64_t* my_control, const int32_t* bundle_index, const int64_t* counts, int32_t N,
                         bool with_meta, char* send, cudaStream_t s) {
  if (n == 0) return Status::Ok();
  PackBundlesKernel<<<WarpBlocks(N * n), 256, 0, s>>>(payload, experts, accepted, effective_gates, tok_index, n, l, bl, owner, rank,
                                                      my_control, bundle_index, counts, N, with_meta, send);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchScatterRelayed(const char* meta, int64_t num, const BundleLayout& bl, const bf16_bits* rows, int64_t row_stride,
                            const RegionLayout& l, OwnerMapView own, int32_t node, int64_t lo, int32_t buf, bool with_sideband,
                            void* const* payload_of, void* const* sideband_of, int64_t* pairs, cudaStream_t s) {
  if (num == 0) return Status::Ok();
  ScatterRelayedKernel<<<WarpBlocks(num), 256, 0, s>>>(meta, num, bl, rows, row_stride, l, own, node, lo, buf, with_sideband, payload_of,
                                                       sideband_of, pairs);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchReturnRowsToRelays(const bf16_bits* rows, const GroupedRow* grouped, int64_t M, const RegionLayout& l, int32_t owner_rank,
                                void* const* return_of, cudaStream_t s) {
  if (M == 0) return Status::Ok();
  ReturnRowsToRelaysKernel<<<WarpBlocks(M), 256, 0, s>>>(rows, grouped, M, l, owner_rank, return_of);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchReduceAtRelay(const char* meta, int64_t num, const BundleLayout& bl, const RegionLayout& l, const bf16_bits* ret,
                           bool backward, bf16_bits* keep, const bf16_bits* dy_rows, char* out, cudaStream_t s) {
  if (num == 0) return Status::Ok();
  if (num > 0x7FFFFFFF) return InvalidArgument("reduce at relay: " + std::to_string(num) + " records exceed the grid");
  ReduceAtRelayKernel<<<static_cast<unsigned>(num), ColumnThreads(bl.H), 0, s>>>(meta, bl, l, ret, backward, keep, dy_rows, out);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchCombineNodes(const char* returned, const BundleLayout& bl, const int32_t* bundle_index, const int64_t* counts, int32_t N,
                          int64_t n, bool backward, bf16_bits* out, const int32_t* experts, const int32_t* owner, const float* gates,
                          const uint8_t* accepted, float* scratch, float* dgates, cudaStream_t s) {
  if (n == 0) return Status::Ok();
  CombineNodesKernel<<<static_cast<unsigned>(n), ColumnThreads(bl.H), 0, s>>>(returned, bl, bundle_index, counts, N, n, backward, out,
                                                                              experts, owner, gates, accepted, scratch, dgates);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchCheckNodeLimit(const int32_t* experts, int64_t n, int64_t K, const int32_t* owner, int32_t G, int64_t cap,
                            unsigned long long* first_bad, cudaStream_t s) {
  if (n == 0) return Status::Ok();
  CheckNodeLimitKernel<<<static_cast<unsigned>((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024), 256, 0, s>>>(experts, n, K, owner, G, cap,
                                                                                                          first_bad);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace rdep::dispatch
