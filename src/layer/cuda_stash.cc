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
// Overflow: a forward whose rows need more pages than are free takes none; its output is still
// right (the rows were used before the stash), the host learns it at backward (waiting on the
// forward's event if it has not completed, which a backward rarely finds), and the backward still
// takes part in the collective (the other ranks need this owner) with its rows filled with NaN, then
// fails naming the rows and the pool. A context dropped without backward gives its pages back in
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
  const int64_t elems = cuda_layer::StashRowElems(s.hidden, s.ffn, config_.owner_reduce);
  const auto worst = static_cast<size_t>(SyncFreeSegments() * std::max<int64_t>(MaxSegmentRows(config_, layout_), 1));
  stash_rows_bytes_ = worst * static_cast<size_t>(elems) * sizeof(__nv_bfloat16);
  stash_pool_bytes_ = static_cast<size_t>(pages * cuda_layer::kStashPageRows * elems) * sizeof(__nv_bfloat16);
  stash_ring_bytes_ = 2 * sizeof(uint64_t) + static_cast<size_t>(pages) * sizeof(int32_t);  // counters, then the ring
  const std::string key = "." + std::to_string(elems);
  RDEP_ASSIGN_OR_RETURN(stash_rows_, domain_.AcquireShared("stash.rows", stash_rows_bytes_));
  RDEP_ASSIGN_OR_RETURN(stash_pool_, domain_.AcquireShared("stash.pool" + key, stash_pool_bytes_));
  RDEP_ASSIGN_OR_RETURN(stash_ring_, domain_.AcquireShared("stash.ring" + key, stash_ring_bytes_));
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
  if (!Stashing(st)) return {sv.x_rows.ptr, sv.h_rows.ptr, config_.owner_reduce ? sv.f_rows.ptr : nullptr};
  const auto rows = SyncFreeSegments() * std::max<int64_t>(MaxSegmentRows(config_, layout_), 1);
  auto* x = static_cast<__nv_bfloat16*>(domain_.region(rank, stash_rows_));
  __nv_bfloat16* h = x + rows * config_.shape.hidden;
  return {x, h, config_.owner_reduce ? h + rows * 2 * config_.shape.ffn : nullptr};
}

// A context's page table, state, fault word and event (once; the rows themselves live in the pool).
Status CudaMoELayer::ReserveStash(Saved& sv) const {
  const int64_t cap = std::max<int64_t>(MaxSegmentRows(config_, layout_), 1);
  RDEP_RETURN_IF_ERROR(sv.stash_pages.Reserve(static_cast<size_t>(cuda_layer::StashMaxPages(SyncFreeSegments(), cap))));
  if (!sv.stash_state.ptr) {  // state[0] = 0: no pages held (a give before any take returns nothing)
    RDEP_RETURN_IF_ERROR(sv.stash_state.Reserve(2));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(sv.stash_state.ptr, 0, 2 * sizeof(int64_t)));
  }
  if (!sv.stash_fault_host) {
    void* pinned = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, sizeof(int64_t), cudaHostAllocMapped | cudaHostAllocPortable));
    sv.stash_fault_host = static_cast<int64_t*>(pinned);
    *sv.stash_fault_host = -1;
    void* mapped = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&mapped, pinned, 0));
    sv.stash_fault_dev = static_cast<int64_t*>(mapped);
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
          sv.stash_pages.ptr, cuda_layer::StashMaxPages(sv.num_segments, cap), sv.stash_state.ptr, sv.stash_fault_dev};
}

// Forward, after the owner's last segment (in the rank's stream): the rows that arrived into pages.
Status CudaMoELayer::StashSaved(int32_t rank, const RankState& st, Saved& sv) {
  cudaStream_t stream = domain_.stream(rank);
  RDEP_RETURN_IF_ERROR(ReserveStash(sv));
  if (sv.stash_held) RDEP_RETURN_IF_ERROR(ReleaseStash(rank, sv));  // forwarded again without a backward
  // Held from the take's launch on (a failed copy launch after it still gives the pages back); a take that
  // never ran leaves state[0] at 0, which gives nothing back. The take re-arms the fault word itself.
  sv.stash_held = true;
  RDEP_RETURN_IF_ERROR(cuda_layer::LaunchStashRows(StashPoolOf(rank), StashView(rank, st, sv), stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(sv.stash_taken, stream));
  // A context freed before its backward (ForwardContext::Release, its destructor) gives its pages back.
  sv.stash_give_back = [this, rank, saved = &sv, alive = alive_] {
    if (alive->load()) (void)ReleaseStash(rank, *saved);
  };
  return Status::Ok();
}

// Backward, before the owner's first segment: the pages back into the transient rows (or NaN there
// after an overflow, reported in *overflow for the end of the call), and the pages back to the pool.
Status CudaMoELayer::UnstashSaved(int32_t rank, const RankState& st, Saved& sv, Status* overflow) {
  if (!sv.stash_held)
    return FailedPrecondition("backward on rank " + std::to_string(rank) + ": the context's stashed rows were given back (ReleaseRows)");
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(sv.stash_taken));  // normally long complete
  const int64_t needed = *reinterpret_cast<const volatile int64_t*>(sv.stash_fault_host);
  RDEP_RETURN_IF_ERROR(cuda_layer::LaunchUnstashRows(StashPoolOf(rank), StashView(rank, st, sv), domain_.stream(rank)));
  sv.stash_held = false;
  if (needed >= 0) {
    const int64_t pages = StashPoolOf(rank).num_pages;
    *overflow = FailedPrecondition(
        "backward on rank " + std::to_string(rank) + ": the forward's " + std::to_string(needed) +
        " owner rows did not fit the free pages of the paged stash (stash_rows " + std::to_string(config_.stash_rows) + ": " +
        std::to_string(pages) + (pages == 1 ? " page of " : " pages of ") + std::to_string(cuda_layer::kStashPageRows) +
        " rows, shared by the domain's layers of this shape), so nothing was stashed; this backward's weight gradients and dx are NaN. "
        "Raise stash_rows, or release contexts that will not run backward (ReleaseRows)");
  }
  return Status::Ok();
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
