// LayerConfig: how one MoE layer runs (shape, capacity policy, segment size), printable and
// validated up front; plus the byte layout of the peer-visible regions the protocol uses, shared by
// every backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>

#include "rdep/core/capacity.h"
#include "rdep/core/ownership.h"
#include "rdep/core/shape.h"
#include "rdep/status.h"

namespace rdep {

struct LayerConfig {
  LayerShape shape;
  CapacityPolicy capacity;         // dropless by default
  int64_t segment_tokens = 0;      // S: token rows an owner receives per segment; 0 = T (at least 1)

  Status Validate() const;
  int64_t segment() const { return segment_tokens > 0 ? segment_tokens : (shape.tokens > 0 ? shape.tokens : 1); }
};

std::ostream& operator<<(std::ostream& os, const LayerConfig& c);

// Sideband of one route row as it travels to its owner (seeds 000 A.1 metadata region).
struct RowSideband {
  uint64_t row_id;       // ((r*T)+t)*K+k
  int32_t local_expert;  // lambda(e) at the owner
  float gate;            // effective (capacity-renormalized) gate g'
};
static_assert(sizeof(RowSideband) == 16);

// Region layout for a domain of W ranks and one layer config. Token deduplication: a token that
// chose several experts on one owner crosses once; its sideband lists its rows on that owner
// (at most slots_per_token = min(K, max E_loc) of them) and the owner expands it.
//
// control (int64 words, per rank; "this rank" = q):
//   recv_counts_by_src   [W][L]  rows source s has for q's local expert j (phase 1, written by s)
//   recv_tokens_by_src   [W]     tokens source s sends to q, before capacity (phase 1, written by s)
//   recv_offsets_by_src  [W]     q's exclusive scan of recv_tokens_by_src: s's base in q's token stream
//   send_admitted_by_dst [W][L]  rows owner d admits from q for d's local expert j (phase 2, written by d)
//   send_offsets_by_dst  [W]     base of q's tokens in owner d's token stream (phase 2, written by d)
//   owner_stream_tokens  [W]     tokens owner d receives in total (phase 2, written by d to every rank)
// segment payload  [2][S][H] activations (double-buffered; element type of the backend)
// segment sideband [2][S] x { int64 num_rows; RowSideband rows[slots_per_token] }
// return           [T*K][H] returned rows, placed at (t*K+k) decoded from row_id
struct RegionLayout {
  int64_t W = 0, L = 0, S = 0, H = 0, T = 0, K = 0, slots_per_token = 0;
  size_t elem_bytes = 0;

  static RegionLayout For(const LayerConfig& c, const OwnershipMap& m, size_t elem_bytes);
  // control offsets, in int64 words
  int64_t recv_counts(int64_t src, int64_t j) const { return src * L + j; }
  int64_t recv_tokens(int64_t src) const { return W * L + src; }
  int64_t recv_offsets(int64_t src) const { return W * L + W + src; }
  int64_t send_admitted(int64_t dst, int64_t j) const { return W * L + 2 * W + dst * L + j; }
  int64_t send_offsets(int64_t dst) const { return 2 * W * L + 2 * W + dst; }
  int64_t owner_tokens(int64_t owner) const { return 2 * W * L + 3 * W + owner; }
  size_t control_bytes() const { return static_cast<size_t>(2 * W * L + 4 * W) * sizeof(int64_t); }
  size_t token_sideband_bytes() const { return sizeof(int64_t) + static_cast<size_t>(slots_per_token) * sizeof(RowSideband); }
  size_t payload_bytes() const { return 2 * static_cast<size_t>(S * H) * elem_bytes; }
  size_t sideband_bytes() const { return 2 * static_cast<size_t>(S) * token_sideband_bytes(); }
  size_t return_bytes() const { return static_cast<size_t>(T * K * H) * elem_bytes; }
  size_t total_bytes() const { return control_bytes() + payload_bytes() + sideband_bytes() + return_bytes(); }
};

}  // namespace rdep
