// Byte layout of the peer-visible regions of the RDEP protocol, shared by the host and CUDA
// backends (usable in device code). Token deduplication: a token that chose several experts on one
// owner crosses once; its sideband lists its rows on that owner (at most slots_per_token =
// min(K, max E_loc)) and the owner expands it into expert-grouped rows.
//
// control (int64 words, per rank; "this rank" = q):
//   recv_counts_by_src   [W][L]  rows source s has for q's local expert j (phase 1, written by s)
//   recv_tokens_by_src   [W]     tokens source s sends to q, before capacity (phase 1, written by s)
//   recv_offsets_by_src  [W]     q's exclusive scan of recv_tokens_by_src: s's base in q's token stream
//   send_admitted_by_dst [W][L]  rows owner d admits from q for d's local expert j (phase 2, written by d)
//   send_offsets_by_dst  [W]     base of q's tokens in owner d's token stream (phase 2, written by d)
//   owner_stream_tokens  [W]     tokens owner d receives in total (phase 2, written by d to every rank)
//   load_matrix          [W][E]  rows source s routes to expert e, the full load matrix Lambda (phase 1,
//                                written by s to every rank); present only when E_load = E > 0
// Per-source windows (CudaMoELayer's forward when dropless with one segment, LayerConfig::source_windows):
// source s's tokens take [s*T, s*T + n) of every owner's stream, n its tokens for that owner, so the
// bases are known without phase 2; no control words are exchanged. The source clears the sideband's row
// count of each position past its n in the window (those positions carry no rows), and the context's
// copy of the control words is window_word's: every window read as T tokens long.
// segment payload  [B][S][H] activations (the backend's element type; B = 2, double-buffered, when a call can
//                  have several segments; B = 1 when S >= W*T, since every call then has one segment: buffer 0)
// segment sideband [B][S] x { int64 num_rows; RowSideband rows[slots_per_token] }
// return           [N][T*K][H] returned rows, placed at (t*K+k) decoded from row_id (N = 1); with N
//                  nodes, at a relay, at (source node, t, k) for the sources with its local index
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define RDEP_HD __host__ __device__
#else
#define RDEP_HD
#endif

namespace rdep {

// Sideband of one route row as it travels to its owner (seeds 000 A.1 metadata region).
struct RowSideband {
  uint64_t row_id;       // ((r*T)+t)*K+k
  int32_t local_expert;  // lambda(e) at the owner
  float gate;            // effective (capacity-renormalized) gate g'
};
static_assert(sizeof(RowSideband) == 16);

// Threads per block of a peer-storing kernel under an SM budget (RegionLayout::transport_sms > 0): N such
// blocks occupy at most N SMs (the scheduler spreads them; two may share one), 16 warps each, each warp
// with a whole 2048-wide row of loads in flight.
inline constexpr int kTransportThreads = 512;

struct RegionLayout {
  int64_t W = 0, L = 0, S = 0, H = 0, T = 0, K = 0, slots_per_token = 0;
  int64_t elem_bytes = 0;
  int64_t E_load = 0;  // E when every rank holds the full load matrix (LayerConfig::load_matrix), else 0
  int64_t N = 1;       // nodes: the return region holds rows for N sources (two-phase relays)
  int64_t transport_sms = 0;  // LayerConfig::transport_sms: the peer-storing kernels' grid (0 = sized by work)
  int64_t buffers = 2;        // payload and sideband buffers: segment s uses buffer s % 2 (1 buffer: one segment a call)

  // control offsets, in int64 words
  RDEP_HD int64_t recv_counts(int64_t src, int64_t j) const { return src * L + j; }
  RDEP_HD int64_t recv_tokens(int64_t src) const { return W * L + src; }
  RDEP_HD int64_t recv_offsets(int64_t src) const { return W * L + W + src; }
  RDEP_HD int64_t send_admitted(int64_t dst, int64_t j) const { return W * L + 2 * W + dst * L + j; }
  RDEP_HD int64_t send_offsets(int64_t dst) const { return 2 * W * L + 2 * W + dst; }
  RDEP_HD int64_t owner_tokens(int64_t owner) const { return 2 * W * L + 3 * W + owner; }
  RDEP_HD int64_t load(int64_t src, int64_t e) const { return 2 * W * L + 4 * W + src * E_load + e; }
  RDEP_HD size_t control_bytes() const { return static_cast<size_t>(2 * W * L + 4 * W + W * E_load) * sizeof(int64_t); }
  // Word w of rank's control copy under per-source windows: recv_tokens T (a window's extent), recv_offsets
  // s*T, send_offsets rank*T, owner_tokens W*T; the counts and the load matrix, never exchanged, 0.
  RDEP_HD int64_t window_word(int64_t rank, int64_t w) const {
    if (w >= W * L && w < W * L + W) return T;
    if (w >= W * L + W && w < W * L + 2 * W) return (w - W * L - W) * T;
    if (w >= 2 * W * L + 2 * W && w < 2 * W * L + 3 * W) return rank * T;
    if (w >= 2 * W * L + 3 * W && w < 2 * W * L + 4 * W) return W * T;
    return 0;
  }
  RDEP_HD size_t token_sideband_bytes() const {
    return sizeof(int64_t) + static_cast<size_t>(slots_per_token) * sizeof(RowSideband);
  }
  RDEP_HD size_t payload_bytes() const { return static_cast<size_t>(buffers * S * H * elem_bytes); }
  RDEP_HD size_t sideband_bytes() const { return static_cast<size_t>(buffers * S) * token_sideband_bytes(); }
  RDEP_HD size_t return_bytes() const { return static_cast<size_t>(N * T * K * H * elem_bytes); }
  RDEP_HD size_t total_bytes() const { return control_bytes() + payload_bytes() + sideband_bytes() + return_bytes(); }
};

// The identity-revealing echo an owner returns instead of the MLP output in the dispatch invariants
// check (every field exact in bf16 as in fp32): out[0..5] = bytes 0..5 of row_id, out[6..7] = owner
// rank (low, high byte), out[8..9] = global expert id (low, high byte), out[c] = x[c] for c >= 10.
// Columns beyond H are dropped.
constexpr int64_t kSentinelFields = 10;
RDEP_HD inline float SentinelField(uint64_t row_id, int32_t owner, int32_t expert, int64_t c) {
  if (c < 6) return static_cast<float>((row_id >> (8 * c)) & 0xFF);
  if (c < 8) return static_cast<float>((static_cast<uint32_t>(owner) >> (8 * (c - 6))) & 0xFF);
  return static_cast<float>((static_cast<uint32_t>(expert) >> (8 * (c - 8))) & 0xFF);
}

}  // namespace rdep
