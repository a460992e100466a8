// Launchers of the two-phase exchange's kernels (seeds 004; the CUDA layer's src/layer/cuda_two_phase.cc
// orchestrates them, mirroring the host layer's src/layer/host_two_phase.cc). Raw device pointers and
// a stream; Status back. W = N*G ranks form N nodes of G consecutive ranks; the relay of a source in
// node b is the rank of b with the source's local index (rdep/core/node_rules.h).
//
// A bundle is one (token, destination node) pair with at least one accepted row on that node: it
// crosses nodes once, however many of the token's experts live there. Buffers of bundles are arrays
// of fixed-size records (BundleLayout), node-major where they are sent or received (node b's records
// contiguous, in token order), so the inter-node exchange moves one contiguous range per node:
//
//   forward record  [meta | payload]  meta: int32 token, int32 source rank,
//                                           int32 expert[K]  (-1: the slot has no accepted row on the node)
//                                           float gate[K]    (effective gate g' of the slot, 0 where -1)
//                                           int64 pos[G]     (the token's position in the stream of owner
//                                                             node*G + g, -1 where it has no row there),
//                                     padded to 16 bytes; payload: H bf16 (x), padded to 16 bytes
//   backward record [payload]         H bf16 (dy), padded to 16 bytes (the forward's meta is kept)
//   reduced record  [partial | dots]  H fp32: the node's rows reduced in slot order (forward
//                                     sum g'_k f_k, backward sum dx_k), padded to 16 bytes; backward
//                                     only: float dot[K] (<dy, f_k> for the node's slots, else 0)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rdep/dispatch/dispatch_kernels.h"
#include "rdep/dispatch/region_layout.h"
#include "rdep/status.h"

namespace rdep::dispatch {

struct BundleLayout {
  int64_t K = 0, G = 0, H = 0;

  static RDEP_HD int64_t Align16(int64_t b) { return (b + 15) / 16 * 16; }
  RDEP_HD int64_t gate_offset() const { return 8 + 4 * K; }
  RDEP_HD int64_t pos_offset() const { return (8 + 8 * K + 7) / 8 * 8; }
  RDEP_HD int64_t meta_bytes() const { return Align16(pos_offset() + 8 * G); }
  RDEP_HD int64_t row_bytes() const { return Align16(2 * H); }
  RDEP_HD int64_t forward_stride() const { return meta_bytes() + row_bytes(); }  // forward record
  RDEP_HD int64_t backward_stride() const { return row_bytes(); }                 // backward record
  RDEP_HD int64_t reduced_stride(bool backward) const { return Align16(4 * H) + (backward ? Align16(4 * K) : 0); }
};

// Bundles of this rank's n tokens (one block per destination node): bundle_index[b*n + t] = the
// token's position among this rank's bundles to node b (token order), -1 without an accepted row on
// b; counts[b] = bundles to node b (device int64 [N]).
Status LaunchBundleIndex(const int32_t* experts, const uint8_t* accepted, int64_t n, int64_t K, const int32_t* owner,
                         int32_t G, int32_t N, int32_t* bundle_index, int64_t* counts, cudaStream_t s);

// The records of this rank's bundles into `send` (node-major: node b's first record at
// counts[0] + ... + counts[b-1]). Forward (with_meta): meta (positions from the forward's control
// words `my_control` and tok_index, as LaunchScatter places them) and x; backward: dy rows only.
Status LaunchPackBundles(const bf16_bits* payload, const int32_t* experts, const uint8_t* accepted,
                         const float* effective_gates, const int32_t* tok_index, int64_t n, const RegionLayout& l,
                         const BundleLayout& bl, const int32_t* owner, int32_t rank, const int64_t* my_control,
                         const int32_t* bundle_index, const int64_t* counts, int32_t N, bool with_meta, char* send,
                         cudaStream_t s);

// At a relay of node `node`, one segment [lo, lo+S) of every owner's stream: each received record's
// row goes to each owner of the node whose stream position of it falls in the window, at the position
// the one-domain scatter uses. forward: with its sideband (the record's slots on that owner, slot
// order; row ids by RowIdCodec with the record's source rank); backward: the payload only (the owners
// read the forward's grouped rows). meta: the forward records (num of them, BundleLayout::forward_stride
// apart); rows: the payload rows, row_stride bytes apart. *pairs (nullable) counts the (record, owner)
// pairs written.
Status LaunchScatterRelayed(const char* meta, int64_t num, const BundleLayout& bl, const bf16_bits* rows, int64_t row_stride,
                            const RegionLayout& l, OwnerMapView own, int32_t node, int64_t lo, int32_t buf, bool with_sideband,
                            void* const* payload_of, void* const* sideband_of, int64_t* pairs, cudaStream_t s);

// Owner `owner_rank`: row g of `rows` to the relay of its source in this node (NodeSplit::relay), at
// NodeSplit::relay_return_index of its row id. l.N = N nodes of l.W / N ranks.
Status LaunchReturnRowsToRelays(const bf16_bits* rows, const GroupedRow* grouped, int64_t M, const RegionLayout& l,
                                int32_t owner_rank, void* const* return_of, cudaStream_t s);

// At a relay after every row returned (one block per record): per received record, its node's rows
// from this relay's return region `ret`, reduced in slot order with fp32 accumulation into one
// reduced record of `out` (record j at j * reduced_stride). Forward: sum g'_k f_k, and the rows f_k
// kept at keep[(j*K + k)*H] (0 for slots not on this node) for backward. Backward: sum of the dx rows,
// and dot[k] = <dy, f_k> (dy: the backward record j of dy_rows; f: keep) by the one-domain dgate's
// warp order (bitwise its dot product).
Status LaunchReduceAtRelay(const char* meta, int64_t num, const BundleLayout& bl, const RegionLayout& l, const bf16_bits* ret,
                           bool backward, bf16_bits* keep, const bf16_bits* dy_rows, char* out, cudaStream_t s);

// At the source after the reduced records came back (node-major, node b's in the order of its
// bundles): out[t] = sum over nodes b in node order of the partial of (t, b), fp32, bf16 out (0 for a
// token with no bundle). Backward also: dgates via rdep::RenormalizeTokenGatesBackward from
// d_effective[k] = the dot of slot k from the node of its expert (0 for dropped slots), scratch [n*K].
Status LaunchCombineNodes(const char* returned, const BundleLayout& bl, const int32_t* bundle_index, const int64_t* counts,
                          int32_t N, int64_t n, bool backward, bf16_bits* out, const int32_t* experts, const int32_t* owner,
                          const float* gates, const uint8_t* accepted, float* scratch, float* dgates, cudaStream_t s);

// Node-limited routing: *first_bad = the lowest token whose experts lie on more than `cap` nodes
// (rdep::CountTokenNodes), unchanged when none (set it to ~0 first).
Status LaunchCheckNodeLimit(const int32_t* experts, int64_t n, int64_t K, const int32_t* owner, int32_t G, int64_t cap,
                            unsigned long long* first_bad, cudaStream_t s);

}  // namespace rdep::dispatch
