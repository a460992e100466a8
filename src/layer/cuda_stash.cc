// The paged stash of the sync-free layer (LayerConfig::stash_rows; seeds 002, "Paged Stashing").
//
// Without it, every context holds the owner rows of the worst case (SyncFreeSegments() segments of
// MaxSegmentRows rows: x [H], the SwiGLU inputs h [2F] and, with owner_reduce, the outputs f [H]),
// so a stack of L layers holds L worst cases although each forward computes only the rows that
// arrived. With it, the owner computes into one worst-case set of transient rows shared by the
// domain's layers of that size ("stash.rows": nothing in it outlives a call), and at the end of the
// forward the rows that arrived move into pages of a pool shared by the domain's layers of one row
// size and pool size ("stash.pool.*", free list "stash.ring.*"); backward moves them back before its
// owner work and gives the pages back. Memory: one worst case plus the rows the live contexts hold.
// Pages are taken and given back by kernels in the rank's stream order, so no call waits on the host.
//
// Overflow: a forward whose rows need more pages than are free takes none (state -1 and the rows and pages
// it needed, on the device; each segment's rows take whole pages); its output is still
// right (the rows were used before the stash). Before the forward's final barrier each rank stores its
// outcome (rows << 32 | pages needed, or -1) into every rank's flags ("stash.flags": W words), and after it
// copies them to the host, so every rank learns every rank's outcome. The host reads them at backward
// (waiting on the forward's event if it has not completed, which a backward rarely finds): when any
// rank overflowed, every rank fills its dx, dgates and weight gradients with NaN and fails before
// anything collective, naming the ranks, their rows and the pool; no rank computes from missing rows. A context dropped without backward gives its pages back in
// ReleaseRows (the C API's rdep_context_release calls it), or when it is freed while its layer lives
// (a context freed after its layer leaves its pages taken in a pool other layers may share). Not
// inside a CUDA graph capture.
#include <cuda_runtime.h>

#include <string>

#include "layer/cuda_layer_state.h"
#include "layer/cuda_stash_kernels.h"

namespace rdep {

bool CudaMoELayer::Stashing(const RankState& st) const { return config_.stash_rows > 0 && stash_pool_ >= 0 && SyncFree(st); }

// At creation: the shared regions (every rank of the domain takes part, as in the other AcquireShared calls).
Status CudaMoELayer::AcquireStash() {
  if (config_.stash_rows <= 0) return Status::Ok();
  const LayerShape& s = config_.shape;
  if (s.hidden % 8 != 0 || s.ffn % 8 != 0)
    return InvalidArgument("stash_rows: hidden " + std::to_string(s.hidden) + " and ffn " + std::to_string(s.ffn) +
                           " must be multiples of 8 (the stash moves 16-byte vectors)");
  const int64_t pages = (config_.stash_rows + cuda_layer::kStashPageRows - 1) / cuda_layer::kStashPageRows;
  if (pages > (int64_t{1} << 30))
    return InvalidArgument("stash_rows: " + std::to_string(config_.stash_rows) + " rows is more than 2^30 pages of " +
                           std::to_string(cuda_layer::kStashPageRows));
  const int64_t elems = cuda_layer::StashRowElems(s.hidden, s.ffn, OwnerKeepsOutputs(config_));
  const int64_t worst_rows = SyncFreeSegments() * std::max<int64_t>(MaxSegmentRows(config_, layout_), 1);
  if (worst_rows >= (int64_t{1} << 31))  // the overflow outcome word packs rows << 32 | pages
    return InvalidArgument("stash_rows: the worst case's " + std::to_string(worst_rows) + " owner rows a rank is 2^31 or more");
  const auto worst = static_cast<size_t>(worst_rows);
  stash_rows_bytes_ = worst * static_cast<size_t>(elems) * sizeof(__nv_bfloat16);
  stash_pool_bytes_ = static_cast<size_t>(pages * cuda_layer::kStashPageRows * elems) * sizeof(__nv_bfloat16);
  stash_ring_bytes_ = 2 * sizeof(uint64_t) + static_cast<size_t>(pages) * sizeof(int32_t);  // counters, then the ring
  const std::string key = "." + std::to_string(elems);
  RDEP_ASSIGN_OR_RETURN(stash_rows_, domain_.AcquireShared("stash.rows", stash_rows_bytes_));
  RDEP_ASSIGN_OR_RETURN(stash_pool_, domain_.AcquireShared("stash.pool" + key, stash_pool_bytes_));
  RDEP_ASSIGN_OR_RETURN(stash_ring_, domain_.AcquireShared("stash.ring" + key, stash_ring_bytes_));
  // Written before a forward's final barrier and copied to the host right after it, before this rank's next
  // barrier; every stashing forward passes a barrier before it writes again, so no call overwrites another's.
  stash_flags_bytes_ = static_cast<size_t>(s.ranks) * sizeof(int64_t);
  RDEP_ASSIGN_OR_RETURN(stash_flags_, domain_.AcquireShared("stash.flags", stash_flags_bytes_));
  return Status::Ok();
}

// Forward and backward refuse a stream capture before anything collective (every rank alike): the
// overflow is read on the host at backward.
Status CudaMoELayer::RefuseStashInCapture(int32_t rank, const char* call) const {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(domain_.stream(rank), &capture));
  if (capture == cudaStreamCaptureStatusNone) return Status::Ok();
  return FailedPrecondition(std::string(call) + " on rank " + std::to_string(rank) +
                            ": the paged stash (stash_rows) cannot run inside a CUDA graph capture (its overflow is checked on the host)");
}

CudaMoELayer::OwnerRows CudaMoELayer::SavedOwnerRows(int32_t rank, const RankState& st, const Saved& sv) const {
  if (!Stashing(st)) return {sv.x_rows.ptr, sv.h_rows.ptr, OwnerKeepsOutputs(config_) ? sv.f_rows.ptr : nullptr};
  const auto rows = SyncFreeSegments() * std::max<int64_t>(MaxSegmentRows(config_, layout_), 1);
  auto* x = static_cast<__nv_bfloat16*>(domain_.region(rank, stash_rows_));
  __nv_bfloat16* h = x + rows * config_.shape.hidden;
  return {x, h, OwnerKeepsOutputs(config_) ? h + rows * 2 * config_.shape.ffn : nullptr};
}

// A context's page table, state, outcome words and event (once; the rows themselves live in the pool).
Status CudaMoELayer::ReserveStash(Saved& sv) const {
  const int64_t cap = std::max<int64_t>(MaxSegmentRows(config_, layout_), 1);
  RDEP_RETURN_IF_ERROR(sv.stash_pages.Reserve(static_cast<size_t>(cuda_layer::StashMaxPages(SyncFreeSegments(), cap))));
  if (!sv.stash_state.ptr) {  // state[0] = 0: no pages held (a give before any take returns nothing)
    RDEP_RETURN_IF_ERROR(sv.stash_state.Reserve(2));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(sv.stash_state.ptr, 0, 2 * sizeof(int64_t)));
    // On the legacy stream, which the rank's non-blocking stream does not wait for: landed before this call's take.
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  }
  if (!sv.stash_outcomes_host) {
    void* pinned = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, stash_flags_bytes_, cudaHostAllocPortable));
    sv.stash_outcomes_host = static_cast<int64_t*>(pinned);
  }
  if (!sv.stash_taken) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&sv.stash_taken, cudaEventDisableTiming));
  return Status::Ok();
}

cuda_layer::StashPool CudaMoELayer::StashPoolOf(int32_t rank) const {
  cuda_layer::StashPool p;
  p.pages = static_cast<__nv_bfloat16*>(domain_.region(rank, stash_pool_));
  auto* ring = static_cast<char*>(domain_.region(rank, stash_ring_));
  p.counters = reinterpret_cast<uint64_t*>(ring);
  p.ring = reinterpret_cast<int32_t*>(ring + 2 * sizeof(uint64_t));
  p.num_pages = static_cast<int32_t>((stash_ring_bytes_ - 2 * sizeof(uint64_t)) / sizeof(int32_t));
  return p;
}

// Where ctx's rows are on the rank: the transient rows, the segments' device totals, its page table and state.
cuda_layer::StashRows CudaMoELayer::StashView(int32_t rank, const RankState& st, Saved& sv) const {
  const OwnerRows rows = SavedOwnerRows(rank, st, sv);
  const int32_t phys = physical_experts(st);
  const int64_t cap = std::max<int64_t>(MaxSegmentRows(config_, layout_), 1);
  return {rows.x, rows.h, rows.f, config_.shape.hidden, config_.shape.ffn, sv.num_segments, cap, sv.dev_counts.ptr, phys + 1, phys,
          sv.stash_pages.ptr, cuda_layer::StashMaxPages(sv.num_segments, cap), sv.stash_state.ptr};
}

// Forward, after the owner's last segment and before the final barrier (in the rank's stream): the pages
// the rows that arrived need, and this rank's outcome into every rank's flags.
Status CudaMoELayer::StashSaved(int32_t rank, const RankState& st, Saved& sv) {
  cudaStream_t stream = domain_.stream(rank);
  RDEP_RETURN_IF_ERROR(ReserveStash(sv));
  if (sv.stash_held) RDEP_RETURN_IF_ERROR(ReleaseStash(rank, sv));  // forwarded again without a backward
  // Held from the take's launch on (a failed copy launch after it still gives the pages back); a take that
  // never ran leaves state[0] at 0, which gives nothing back.
  sv.stash_held = true;
  // A context freed before its backward (ForwardContext::Release, its destructor) gives its pages back.
  sv.stash_give_back = [this, rank, saved = &sv, alive = alive_] {
    if (alive->load()) (void)ReleaseStash(rank, *saved);
  };
  RDEP_RETURN_IF_ERROR(cuda_layer::LaunchTakePages(StashPoolOf(rank), StashView(rank, st, sv), stream));
  return cuda_layer::LaunchStashOutcomeToPeers(StashView(rank, st, sv), domain_.peer_table(rank, stash_flags_), rank,
                                               static_cast<int32_t>(config_.shape.ranks), stream);
}

// Forward, after its final barrier: the copy into the pages taken (off the barrier's critical path: a hot
// owner's larger copy does not hold the other ranks there), every rank's outcome to the host, and the event
// backward waits on.
Status CudaMoELayer::StashOutcomeAfterBarrier(int32_t rank, const RankState& st, Saved& sv) {
  cudaStream_t stream = domain_.stream(rank);
  RDEP_RETURN_IF_ERROR(cuda_layer::LaunchCopyIntoPages(StashPoolOf(rank), StashView(rank, st, sv), stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sv.stash_outcomes_host, domain_.region(rank, stash_flags_), stash_flags_bytes_,
                                            cudaMemcpyDeviceToHost, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(sv.stash_taken, stream));
  return Status::Ok();
}

// Backward, before anything collective: the pages back into the transient rows, and the pages back to the
// pool. When any rank's forward overflowed (every rank reads the same outcomes), every rank gives its pages
// back, fills its outputs with NaN and fails here, so no rank takes part in an exchange that would compute
// from rows that were not kept.
Status CudaMoELayer::UnstashSaved(int32_t rank, RankState& st, Saved& sv, __nv_bfloat16* dx, float* dgates) {
  if (!sv.stash_held)
    return FailedPrecondition("backward on rank " + std::to_string(rank) + ": the context's stashed rows were given back (ReleaseRows)");
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(sv.stash_taken));  // normally long complete
  std::string overflowed;
  for (int32_t r = 0; r < config_.shape.ranks; ++r) {
    const int64_t needed = static_cast<const volatile int64_t*>(sv.stash_outcomes_host)[r];  // rows << 32 | pages, or -1
    if (needed < 0) continue;
    const int64_t rows = needed >> 32, pages = needed & 0xffffffff;
    overflowed += (overflowed.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " needed " + std::to_string(pages) +
                  (pages == 1 ? " page for " : " pages for ") + std::to_string(rows) + " rows";
  }
  if (overflowed.empty()) {
    RDEP_RETURN_IF_ERROR(cuda_layer::LaunchUnstashRows(StashPoolOf(rank), StashView(rank, st, sv), domain_.stream(rank)));
    sv.stash_held = false;
    return Status::Ok();
  }
  RDEP_RETURN_IF_ERROR(ReleaseStash(rank, sv));
  RDEP_RETURN_IF_ERROR(FillBackwardWithNaN(rank, st, sv, dx, dgates));
  // A sync-free forward's routing check not read yet would otherwise show only at a later call: read it now
  // (this backward fails anyway; the stash is never inside a capture, so the wait is allowed).
  const Status routing = sv.fault_unchecked ? CheckRoutingInput(rank, sv, /*wait=*/true) : Status::Ok();
  const std::string also = routing.ok() ? "" : "; and " + routing.message();
  const int64_t pages = StashPoolOf(rank).num_pages;
  return FailedPrecondition(
      "backward on rank " + std::to_string(rank) + ": at this context's forward the owner rows did not fit the free pages of the paged stash (" +
      overflowed + "; stash_rows " + std::to_string(config_.stash_rows) + ": " + std::to_string(pages) +
      (pages == 1 ? " page of " : " pages of ") + std::to_string(cuda_layer::kStashPageRows) +
      " rows, shared by the domain's layers of this shape; each segment's rows take whole pages), so nothing was kept there; every rank fails this backward before its "
      "exchange, with dx, dgates and the weight gradients NaN. Raise stash_rows, or release contexts that will not run backward (ReleaseRows)" +
      also);
}

// A failed backward's outputs: NaN, not plausible values (0xFF bytes are NaN in bf16 and fp32).
Status CudaMoELayer::FillBackwardWithNaN(int32_t rank, RankState& st, const Saved& sv, __nv_bfloat16* dx, float* dgates) {
  cudaStream_t stream = domain_.stream(rank);
  const LayerShape& s = config_.shape;
  if (dx) RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dx, 0xFF, static_cast<size_t>(sv.num_tokens * s.hidden) * sizeof(__nv_bfloat16), stream));
  if (dgates) RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dgates, 0xFF, static_cast<size_t>(sv.num_tokens * s.topk) * sizeof(float), stream));
  return FillWeightGrads(st, 0xFF, stream);
}

// A context's pages back to the pool without copying (a forward again, or the context dropped).
// Restores the caller's current device (ReleaseRows and a context's destructor run on the caller's thread).
Status CudaMoELayer::ReleaseStash(int32_t rank, Saved& sv) {
  if (!sv.stash_held) return Status::Ok();
  int current = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv.device));
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  const Status given = cuda_layer::LaunchReleaseStash(StashPoolOf(rank), StashView(rank, st, sv), domain_.stream(rank));
  sv.stash_held = false;
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(current));
  return given;
}

}  // namespace rdep
