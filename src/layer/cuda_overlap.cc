// The overlapped segment pipeline (LayerConfig::overlap_segments; seeds 000 section 3.5): while the
// experts compute segment s on the rank's compute stream, the domain's stream returns segment s-1's
// rows and scatters segment s+1. The kernels, their inputs and their order within each stream are the
// sequential schedule's (CudaMoELayer::Exchange), so the results are the same bits; only what runs
// beside what changes. The domain's stream (comm) and the compute stream (comp), per segment s:
//   comm  scatter s -> [wait read s-1] -> barrier s -> dispatched -> [wait computed s-1 -> return s-1
//         -> returned[(s-1)%2]]
//   comp  wait dispatched -> [wait returned[s%2] (return s-2)] -> expand, gather s -> read -> expert
//         compute s -> computed
// then comm: wait computed -> return of the last segment -> the final barrier. Why each wait:
//   - read s-1 before barrier s: a peer passes barrier s only after this rank arrives, and only then
//     scatters segment s+1 into the payload and sideband half that segment s-1 used here;
//   - dispatched before the compute: the peers' rows of segment s have landed;
//   - return s-2 before compute s: both use the same half of the owner's output rows (two halves of cap
//     rows; forward the expert outputs, backward the dout rows with the dx rows written over them). The
//     domain's stream returns s-2 before it scatters s, so "dispatched s" implies it today; the explicit
//     wait keeps it true if that order changes (scripts/mutate_overlap.sh: the other waits each guard a
//     race the delayed tests catch);
//   - computed s-1 before return s-1, and the last computed before the final barrier, which the
//     combine and the next call follow on the domain's stream: the compute stream has joined.
// The pipeline fills only with more than one segment (segment_tokens < W*T); each wait is a stream wait,
// so nothing here waits on the host and a CUDA graph captures it (the compute stream forks from and
// joins the capturing stream). Marks on the domain's stream (EnableProfiling) read as that stream's
// critical path: dispatch = scatter and barrier, expert = waiting for the compute, return = the return.
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "layer/context_access.h"
#include "layer/cuda_layer_state.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {

using cuda_layer::Bits;
using dispatch::bf16_bits;

namespace {

void CUDART_CB SleepNs(void* ns) { std::this_thread::sleep_for(std::chrono::nanoseconds(reinterpret_cast<intptr_t>(ns))); }

// SetPipelineDelaysForTesting: the stream waits ns nanoseconds here (nothing when 0); the value travels
// in the callback's argument, read when the delay is enqueued.
Status DelayForTesting(cudaStream_t stream, int64_t ns) {
  if (ns > 0) RDEP_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(stream, SleepNs, reinterpret_cast<void*>(static_cast<intptr_t>(ns))));
  return Status::Ok();
}

}  // namespace

Status CudaMoELayer::CreateOverlap(RankState& st) const {
  const auto make = [&]() -> Status {
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&st.compute_stream, cudaStreamNonBlocking));
    RankState::OverlapEvents& ev = st.overlap;
    for (cudaEvent_t* e : {&ev.start, &ev.dispatched, &ev.read, &ev.computed, &ev.returned[0], &ev.returned[1]})
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    return Status::Ok();
  };
  Status s = make();
  if (!s.ok()) DestroyOverlap(st);  // what was made before the failure
  return s;
}

void CudaMoELayer::DestroyOverlap(RankState& st) {  // the rank's device is current
  RankState::OverlapEvents& ev = st.overlap;
  for (cudaEvent_t* e : {&ev.start, &ev.dispatched, &ev.read, &ev.computed, &ev.returned[0], &ev.returned[1]})
    if (*e) cudaEventDestroy(*e), *e = nullptr;
  if (st.compute_stream) cudaStreamDestroy(st.compute_stream), st.compute_stream = nullptr;
}

bool CudaMoELayer::Overlapped(const RankState& st, const Saved& sv, bool backward) const {
  return config_.overlap_segments && st.compute_stream && SyncFree(st) && sv.num_segments > 1 && (!backward || sv.counts_on_device);
}

// On an error past the fork the compute stream is joined back into the domain's stream (best effort) so
// that the next call, or another layer sharing the output rows and scratch, is ordered after its work.
Status CudaMoELayer::ExchangeOverlapped(int32_t rank, RankState& st, Saved& sv, bool backward, const __nv_bfloat16* payload) {
  Status s = RunPipeline(rank, st, sv, backward, payload);
  if (!s.ok() && cudaEventRecord(st.overlap.computed, st.compute_stream) == cudaSuccess)
    (void)cudaStreamWaitEvent(domain_.stream(rank), st.overlap.computed, 0);
  return s;
}

Status CudaMoELayer::RunPipeline(int32_t rank, RankState& st, Saved& sv, bool backward, const __nv_bfloat16* payload) {
  const int64_t S = layout_.S, H = config_.shape.hidden, cap = MaxSegmentRows(config_, layout_);
  cudaStream_t comm = domain_.stream(rank), comp = st.compute_stream;
  RankState::OverlapEvents& ev = st.overlap;
  const dispatch::RouteTargets targets = Targets(st, sv);
  if (!backward) {
    sv.seg_rows.assign(static_cast<size_t>(sv.num_segments), {});
    sv.seg_base.assign(static_cast<size_t>(sv.num_segments), 0);
    sv.total_rows = 0;
    RDEP_RETURN_IF_ERROR(ReserveSyncFree(st, sv));  // a no-op unless the context was made before (its first use)
  }
  // Segment s's expert outputs (forward) or dout rows, then dx rows (backward): a half of the output rows by s % 2.
  const auto out_rows = [&](int64_t seg) { return OutRows(rank) + (seg % 2) * cap * H; };
  const auto return_rows = [&](int64_t seg) -> Status {  // on comm, once the compute stream has computed seg
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comm, ev.computed, 0));
    RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, cuda_layer::kMarkExpert));
    RDEP_RETURN_IF_ERROR(DelayForTesting(comm, pipeline_delay_ns_[1]));
    RDEP_RETURN_IF_ERROR(ReturnSyncFree(rank, st, sv, seg, out_rows(seg), comm));
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.returned[seg % 2], comm));
    return Mark(rank, st, backward, cuda_layer::kMarkReturn);
  };
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.start, comm));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comp, ev.start, 0));
  for (int64_t seg = 0; seg < sv.num_segments; ++seg) {
    const auto buf = static_cast<int32_t>(seg % 2);
    RDEP_RETURN_IF_ERROR(dispatch::LaunchScatter(Bits(payload), sv.experts.ptr, sv.accepted.ptr, sv.effective.ptr, sv.tok_index.ptr,
                                                 sv.num_tokens, layout_, targets, rank, sv.control.ptr, seg * S, buf,
                                                 domain_.peer_table(rank, regions_.payload), domain_.peer_table(rank, regions_.sideband), comm));
    if (seg > 0) RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comm, ev.read, 0));  // segment seg-1's half is read
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardSegment : Phase::kDispatchSegment));
    RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, cuda_layer::kMarkDispatch));
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.dispatched, comm));
    if (seg > 0) RDEP_RETURN_IF_ERROR(return_rows(seg - 1));  // beside segment seg's compute
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comp, ev.dispatched, 0));
    if (seg >= 2) RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comp, ev.returned[seg % 2], 0));  // segment seg-2 returned
    const auto* seg_payload = static_cast<const bf16_bits*>(domain_.region(rank, regions_.payload)) + static_cast<int64_t>(buf) * S * H;
    RDEP_RETURN_IF_ERROR(DelayForTesting(comp, pipeline_delay_ns_[0]));
    if (!backward) RDEP_RETURN_IF_ERROR(ComputeForwardSyncFree(rank, st, sv, seg, seg_payload, out_rows(seg), comp, ev.read));
    else RDEP_RETURN_IF_ERROR(ComputeBackwardSyncFree(rank, st, sv, seg, seg_payload, out_rows(seg), comp, ev.read));
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.computed, comp));
  }
  RDEP_RETURN_IF_ERROR(return_rows(sv.num_segments - 1));  // joins the compute stream into comm
  return FinishExchange(rank, st, sv, backward);
}

}  // namespace rdep
