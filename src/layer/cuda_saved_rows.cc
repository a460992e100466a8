// Where a CUDA context's saved rows come from (CudaMoELayer::SetRowAllocator): the caller's allocator
// (rdep.torch: PyTorch's caching allocator, on the caller's stream) or cudaMalloc. With an allocator the
// rows are the caller's memory between a context's ReleaseRows and its next forward (which takes them
// again), so a training step's other work (the optimizer) can reuse them; without one they stay with the
// context, as pooled contexts keep them.
#include <algorithm>
#include <cstdint>
#include <string>

#include "layer/context_access.h"
#include "layer/cuda_layer_state.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {

Status CudaMoELayer::SetRowAllocator(const RowAllocator& a) {
  if ((a.alloc == nullptr) != (a.free == nullptr))
    return InvalidArgument("row allocator: alloc and free must both be set or both be null");
  for (auto& st : ranks_)
    if (st) st->rows = a;
  return Status::Ok();
}

void CudaMoELayer::SetCallerStream(int32_t rank, cudaStream_t stream) {
  if (rank >= 0 && rank < config_.shape.ranks && ranks_[static_cast<size_t>(rank)]) ranks_[static_cast<size_t>(rank)]->caller_stream = stream;
}

Status CudaMoELayer::ReserveSavedF(const RankState& st, Saved& sv) const {
  const auto n = static_cast<size_t>(std::max<int64_t>(config_.shape.tokens * config_.shape.topk, 1)) * static_cast<size_t>(config_.shape.hidden);
  return cuda_layer::ReserveRows(sv.saved_f, n, st.rows, st.device, st.caller_stream);
}

size_t CudaMoELayer::row_allocator_bytes(int32_t rank) const {
  if (!CheckLocalRank(rank).ok()) return 0;
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  if (!st.rows.alloc) return 0;
  const auto piece = [](size_t elems) {  // one request of `elems` bf16 values (ReserveRows), aligned
    const size_t bytes = std::max<size_t>(elems, 1) * sizeof(__nv_bfloat16);
    return (bytes + kRowAllocAlign - 1) / kRowAllocAlign * kRowAllocAlign;
  };
  const auto H = static_cast<size_t>(config_.shape.hidden), F = static_cast<size_t>(config_.shape.ffn);
  size_t b = 0;
  if (!OwnersTakeDgateDots(config_))  // ReserveSavedF
    b += piece(static_cast<size_t>(std::max<int64_t>(config_.shape.tokens * config_.shape.topk, 1)) * H);
  if (SyncFree(st) && !Stashing(st)) {  // ReserveSyncFree
    const auto rows = static_cast<size_t>(SyncFreeSegments()) * static_cast<size_t>(MaxSegmentRows(config_, layout_));
    b += piece(rows * H) + piece(rows * 2 * F) + (OwnerKeepsOutputs(config_) ? piece(rows * H) : 0);
  }
  return b;
}

// Before a call that may plan a forward in ctx, on the caller's thread: the caller's stream, and the rows
// a released context gave back taken again here rather than inside the collective, so that an allocator
// with no memory fails the call before any rank starts it (a context's first rows come with the context,
// inside the call, as cudaMalloc'd ones always did).
Status CudaMoELayer::PrepareRows(int32_t rank, ForwardContext& ctx, cudaStream_t caller) {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  st.caller_stream = caller;
  Saved* sv = st.rows.alloc ? ContextAccess::StateOf<Saved>(ctx, id_, rank) : nullptr;
  if (!sv) return Status::Ok();
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  if (!OwnersTakeDgateDots(config_)) RDEP_RETURN_IF_ERROR(ReserveSavedF(st, *sv));
  if (SyncFree(st)) RDEP_RETURN_IF_ERROR(ReserveSyncFree(st, *sv));
  return Status::Ok();
}

Status CudaMoELayer::ReleaseRows(ForwardContext& ctx) {
  const int32_t rank = ctx.rank();
  Saved* sv = CheckLocalRank(rank).ok() ? ContextAccess::StateOf<Saved>(ctx, id_, rank) : nullptr;
  if (!sv) return Status::Ok();
  bool freed = false;
  for (auto* b : {&sv->saved_f, &sv->x_rows, &sv->h_rows, &sv->f_rows})
    if (b->ext.free) {
      b->Free();
      freed = true;
    }
  if (sv->stash_held) {  // the pool's pages go back (cuda_stash.cc)
    RDEP_RETURN_IF_ERROR(ReleaseStash(rank, *sv));
    freed = true;
  }
  if (freed) ContextAccess::Abandon(ctx);  // its forward's rows are gone: a backward is refused, not run on null rows
  return Status::Ok();
}

void CudaMoELayer::RebaseRows(ForwardContext& ctx, const void* old_base, size_t bytes, void* new_base) {
  const int32_t rank = ctx.rank();
  Saved* sv = CheckLocalRank(rank).ok() ? ContextAccess::StateOf<Saved>(ctx, id_, rank) : nullptr;
  if (!sv) return;
  const auto lo = reinterpret_cast<uintptr_t>(old_base), to = reinterpret_cast<uintptr_t>(new_base);
  for (auto* b : {&sv->saved_f, &sv->x_rows, &sv->h_rows, &sv->f_rows}) {
    const auto at = reinterpret_cast<uintptr_t>(b->ptr);
    if (b->ptr && at >= lo && at - lo < bytes) b->ptr = reinterpret_cast<__nv_bfloat16*>(to + (at - lo));
  }
}

}  // namespace rdep
