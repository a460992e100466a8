// The paged stash of the sync-free layer (LayerConfig::stash_rows; seeds 002, "Paged Stashing"): the
// kernels that move a forward's saved owner rows between the worst-case transient rows shared by a
// domain's layers and pages of a per-rank pool shared by the same layers, so that a context holds only
// the rows its forward really computed. Internal to the layer library (cuda_stash.cc drives them).
//
// The pool: `pages` pages of kStashPageRows rows, each row row_elems bf16 values laid out as the
// transient's three arrays are ([x: H][h: 2F][f: H when the owner keeps its outputs, else none]). Its free list is a
// ring of page ids with two counters, pages ever taken and ever given back, all zero when the region
// is made: slot k of the ring holds id ^ (k % pages), so a zero-filled ring lists every page once
// (page k at slot k). A context takes n pages from slot `taken` on and gives them back at slot
// `returned` on; every kernel runs in the rank's stream order, so one thread updates the counters.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "rdep/status.h"

namespace rdep::cuda_layer {

inline constexpr int64_t kStashPageRows = 64;

struct StashPool {
  __nv_bfloat16* pages = nullptr;  // [pages][kStashPageRows][row_elems]
  int32_t* ring = nullptr;         // [pages]
  uint64_t* counters = nullptr;    // [0] taken, [1] returned
  int32_t num_pages = 0;
};

// Where a context's rows are: the transient arrays of its segments (segment s's rows start at row
// s * seg_cap of each), its rows per segment on the device (counts[s * count_stride + count_at], the
// sync-free segment totals), and its page table and state on the device: state[0] = pages held
// (-1: the pool could not hold the rows, nothing was stashed), state[1] = rows << 32 | pages it needed.
struct StashRows {
  __nv_bfloat16* x = nullptr;  // [segments * seg_cap][H]
  __nv_bfloat16* h = nullptr;  // [segments * seg_cap][2F]
  __nv_bfloat16* f = nullptr;  // [segments * seg_cap][H], or null (OwnerKeepsOutputs false)
  int64_t H = 0, F = 0;
  int64_t segments = 0, seg_cap = 0;
  const int64_t* counts = nullptr;
  int64_t count_stride = 0, count_at = 0;
  int32_t* page_table = nullptr;  // [max_pages]
  int64_t max_pages = 0;          // segments * ceil(seg_cap / kStashPageRows)
  int64_t* state = nullptr;       // [2]
};

inline int64_t StashRowElems(int64_t H, int64_t F, bool with_f) { return H + 2 * F + (with_f ? H : 0); }
inline int64_t StashMaxPages(int64_t segments, int64_t seg_cap) {
  return segments * ((seg_cap + kStashPageRows - 1) / kStashPageRows);
}

// Forward, after the owner's last segment: takes the pages the rows need; when the pool has too few free
// pages, takes none and sets state[0] = -1 (state[1] = rows << 32 | pages needed, either way).
Status LaunchTakePages(const StashPool& pool, const StashRows& r, cudaStream_t stream);
// Then (in the same stream) copies the rows into the pages taken (nothing after an overflow).
Status LaunchCopyIntoPages(const StashPool& pool, const StashRows& r, cudaStream_t stream);
// Backward, before the owner's first segment: copies the held pages back into the transient rows
// (a context with state[0] = -1 copies nothing) and gives the pages back.
Status LaunchUnstashRows(const StashPool& pool, const StashRows& r, cudaStream_t stream);
// Gives a context's pages back without copying (a context dropped before its backward); state[0] = 0.
Status LaunchReleaseStash(const StashPool& pool, const StashRows& r, cudaStream_t stream);
// After LaunchTakePages, before the forward's final barrier: rank `rank`'s outcome into word `rank` of
// every rank's flags region (peer_flags: the region's peer table, `ranks` entries): rows << 32 | pages
// it needed when its pool overflowed, else -1. After the barrier each rank's region holds every rank's outcome.
Status LaunchStashOutcomeToPeers(const StashRows& r, void* const* peer_flags, int32_t rank, int32_t ranks, cudaStream_t stream);

}  // namespace rdep::cuda_layer
