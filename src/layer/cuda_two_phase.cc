// The two-phase exchange of the CUDA layer (LayerConfig::nodes, seeds 004), the device counterpart of
// the host layer's src/layer/host_two_phase.cc, step for step. Ranks form N nodes of G; the rank with
// local index i of every node is, in its node, the relay of the sources with local index i.
// Plan is the one-domain plan (counts, the owners' capacity decision, stream offsets and accepted set
// over the domain's control words). Run:
//   A. the source packs one record per bundle ((token, node) with an accepted row there: the token's
//      slots on that node, its stream position at each owner of the node, and x) and the device
//      inter-node exchange moves node b's records to the relay in b (after a counts exchange);
//   B. inside each node, per segment: relays scatter the records' rows and sidebands into the owners'
//      segment buffers at the one-domain positions (owners group, compute and accumulate weight
//      gradients exactly as on one domain), barrier, owners compute and return each row to the relay
//      of its source (dispatch::LaunchReturnRowsToRelays); owners clear the headers they read (relays
//      write only the positions of tokens with accepted rows);
//   C. the relay reduces each record's rows in slot order (fp32; the rows kept for dgate) and sends
//      one reduced record per (token, node) back; the source adds the node partials in node order.
// Backward mirrors it with the forward's records: dy crosses once per bundle, owners run the
// one-domain backward on the saved grouped rows, the relay sums dx rows and computes <dy, f_k> in the
// one-domain dgate's order, the source adds dx partials in node order and applies the capacity
// renormalization's backward to the dot products (dgates bitwise the one-domain layer's).
//
// Tests: ctest --test-dir build -R CudaTwoPhase --output-on-failure   (GPU; ranks sharing one GPU)
#include <algorithm>
#include <numeric>
#include <string>

#include "layer/context_access.h"
#include "layer/cuda_layer_state.h"
#include "layer/cuda_two_phase.h"
#include "rdep/core/routing.h"
#include "rdep/core/row_id.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/two_phase_kernels.h"

namespace rdep {

using cuda_layer::Bits;
using cuda_layer::TwoPhaseSaved;
using namespace cuda_layer;  // MarkPhase

namespace cuda_layer {
size_t TwoPhaseBytes(const TwoPhaseSaved* tp) { return tp ? tp->bytes() : 0; }
}  // namespace cuda_layer

namespace {

// Exclusive prefix of per-node record counts: the first record of each node in a node-major buffer.
std::vector<int64_t> Firsts(const std::vector<int64_t>& counts) {
  std::vector<int64_t> first(counts.size(), 0);
  for (size_t b = 1; b < counts.size(); ++b) first[b] = first[b - 1] + counts[b - 1];
  return first;
}

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// The route rows of the records this relay received (their slots with an accepted row on its node):
// the sidebands its scatter wrote. Reads the records' heads (token, source, expert[K]) from the device.
StatusOr<int64_t> RelayedRows(const TwoPhaseSaved& tp, const dispatch::BundleLayout& bl) {
  const int64_t num = Sum(tp.relayed), K = bl.K;
  if (num == 0) return int64_t{0};
  const auto head = static_cast<size_t>(8 + 4 * K);
  std::vector<int32_t> words(static_cast<size_t>(num * (2 + K)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy2D(words.data(), head, tp.relay_in.ptr, static_cast<size_t>(bl.forward_stride()), head,
                                         static_cast<size_t>(num), cudaMemcpyDeviceToHost));
  int64_t rows = 0;
  for (int64_t j = 0; j < num; ++j)
    for (int64_t k = 0; k < K; ++k) rows += words[static_cast<size_t>(j * (2 + K) + 2 + k)] >= 0 ? 1 : 0;
  return rows;
}

}  // namespace

Status CudaMoELayer::ReserveTwoPhase(Saved& sv) const {
  auto tp = std::make_shared<TwoPhaseSaved>();
  tp->device = sv.device;
  const int32_t N = config_.nodes.nodes;
  RDEP_RETURN_IF_ERROR(tp->bundle_index.Reserve(static_cast<size_t>(std::max<int64_t>(N * config_.shape.tokens, 1))));
  RDEP_RETURN_IF_ERROR(tp->words.Reserve(static_cast<size_t>(tp->words_count(N))));
  void* pinned = nullptr;
  RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, sizeof(int64_t) * static_cast<size_t>(tp->words_count(N)), cudaHostAllocPortable));
  tp->host_words = static_cast<int64_t*>(pinned);
  for (cudaEvent_t& e : tp->events) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  tp->sent.assign(static_cast<size_t>(N), 0);
  tp->relayed.assign(static_cast<size_t>(N), 0);
  sv.two_phase = std::move(tp);
  return Status::Ok();
}

Status CudaMoELayer::ReturnRows(int32_t rank, const __nv_bfloat16* rows, const Saved& sv, int64_t base, int64_t m, cudaStream_t stream) {
  if (config_.nodes.nodes > 1)
    return dispatch::LaunchReturnRowsToRelays(Bits(rows), sv.grouped.ptr + base, m, layout_, rank, domain_.peer_table(rank, regions_.ret),
                                              stream);
  return dispatch::LaunchReturnRows(Bits(rows), sv.grouped.ptr + base, m, layout_, domain_.peer_table(rank, regions_.ret), stream);
}

// The three hops of one forward (backward = false: payload x, out y) or backward (payload dy, out dx,
// and dgates). Collective: every rank runs the same barriers and exchanges in the same order.
Status CudaMoELayer::ExchangeTwoPhase(int32_t rank, RankState& st, Saved& sv, bool backward, const __nv_bfloat16* payload,
                                      __nv_bfloat16* out, float* dgates) {
  const LayerShape& s = config_.shape;
  const int32_t N = config_.nodes.nodes, G = config_.nodes.ranks_per_node(s.ranks), node = rank / G;
  const int64_t K = s.topk, H = s.hidden, S = layout_.S, n = sv.num_tokens;
  TwoPhaseSaved& tp = *sv.two_phase;
  const dispatch::BundleLayout bl{K, G, H};
  const dispatch::OwnerMapView own{st.owner.ptr, st.local.ptr};
  cudaStream_t stream = domain_.stream(rank);
  int64_t* words = tp.words.ptr;  // [N] bundles per node, node-cap fault, relayed pairs

  if (!backward) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(tp.events[0], stream));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(words + N, 0xFF, sizeof(int64_t), stream));  // no token over the cap
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(words + N + 1, 0, sizeof(int64_t), stream));
    if (config_.nodes.cap() < N)
      RDEP_RETURN_IF_ERROR(dispatch::LaunchCheckNodeLimit(sv.experts.ptr, n, K, st.owner.ptr, G, config_.nodes.cap(),
                                                          reinterpret_cast<unsigned long long*>(words + N), stream));
    RDEP_RETURN_IF_ERROR(dispatch::LaunchBundleIndex(sv.experts.ptr, sv.accepted.ptr, n, K, st.owner.ptr, G, N, tp.bundle_index.ptr,
                                                     words, stream));
    // Host wait: the record counts size the exchange (and the relays' buffers).
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tp.host_words, words, sizeof(int64_t) * static_cast<size_t>(N + 1),
                                              cudaMemcpyDeviceToHost, stream));
    RDEP_RETURN_IF_ERROR(domain_.Synchronize(rank));
    tp.sent.assign(tp.host_words, tp.host_words + N);
    RDEP_RETURN_IF_ERROR(inter_->ExchangeCounts(rank, tp.sent, tp.relayed, stream));
    const auto relayed = static_cast<size_t>(Sum(tp.relayed)), sent = static_cast<size_t>(Sum(tp.sent));
    RDEP_RETURN_IF_ERROR(tp.send.Reserve(sent * static_cast<size_t>(bl.forward_stride())));
    RDEP_RETURN_IF_ERROR(tp.relay_in.Reserve(relayed * static_cast<size_t>(bl.forward_stride())));
    RDEP_RETURN_IF_ERROR(tp.keep.Reserve(relayed * static_cast<size_t>(K * H)));
  } else {
    RDEP_RETURN_IF_ERROR(tp.send.Reserve(static_cast<size_t>(Sum(tp.sent) * bl.backward_stride())));
    RDEP_RETURN_IF_ERROR(tp.relay_dy.Reserve(static_cast<size_t>(Sum(tp.relayed) * bl.backward_stride())));
  }
  const int64_t rs = bl.reduced_stride(backward);
  RDEP_RETURN_IF_ERROR(tp.reduced.Reserve(static_cast<size_t>(Sum(tp.relayed) * rs)));
  RDEP_RETURN_IF_ERROR(tp.returned.Reserve(static_cast<size_t>(Sum(tp.sent) * rs)));
  const std::vector<int64_t> first_sent = Firsts(tp.sent), first_relayed = Firsts(tp.relayed);
  const int64_t num_relayed = Sum(tp.relayed);

  // A: one record per bundle to the relay with this rank's local index on each node.
  const int64_t stride = backward ? bl.backward_stride() : bl.forward_stride();
  char* recv_base = backward ? tp.relay_dy.ptr : tp.relay_in.ptr;
  RDEP_RETURN_IF_ERROR(dispatch::LaunchPackBundles(Bits(payload), sv.experts.ptr, sv.accepted.ptr, sv.effective.ptr, sv.tok_index.ptr, n,
                                                   layout_, bl, st.owner.ptr, rank, sv.control.ptr, tp.bundle_index.ptr, words, N,
                                                   /*with_meta=*/!backward, tp.send.ptr, stream));
  {
    std::vector<const void*> send(static_cast<size_t>(N));
    std::vector<void*> recv(static_cast<size_t>(N));
    std::vector<int64_t> send_bytes(static_cast<size_t>(N)), recv_bytes(static_cast<size_t>(N));
    for (size_t b = 0; b < static_cast<size_t>(N); ++b) {
      send[b] = tp.send.ptr + first_sent[b] * stride;
      send_bytes[b] = tp.sent[b] * stride;
      recv[b] = recv_base + first_relayed[b] * stride;
      recv_bytes[b] = tp.relayed[b] * stride;
    }
    RDEP_RETURN_IF_ERROR(inter_->AllToAllV(rank, {send, send_bytes, recv, recv_bytes}, stream));
  }
  if (!backward) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(tp.events[1], stream));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkDispatch));

  // B: the RDEP protocol inside the node, per segment, from the relayed records.
  const bf16_bits* rows = nullptr;  // the relayed rows (none: no record came)
  if (num_relayed > 0) rows = reinterpret_cast<const bf16_bits*>(backward ? tp.relay_dy.ptr : tp.relay_in.ptr + bl.meta_bytes());
  if (!backward) {
    sv.seg_rows.assign(static_cast<size_t>(sv.num_segments), {});
    sv.seg_base.assign(static_cast<size_t>(sv.num_segments), 0);
    sv.total_rows = 0;
  }
  const size_t half = static_cast<size_t>(S) * layout_.token_sideband_bytes();
  for (int64_t seg = 0; seg < sv.num_segments; ++seg) {
    const auto buf = static_cast<int32_t>(seg % 2);
    RDEP_RETURN_IF_ERROR(dispatch::LaunchScatterRelayed(tp.relay_in.ptr, num_relayed, bl, rows, stride, layout_, own, node, seg * S, buf,
                                                        /*with_sideband=*/!backward, domain_.peer_table(rank, regions_.payload),
                                                        domain_.peer_table(rank, regions_.sideband), backward ? nullptr : words + N + 1,
                                                        stream));
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardSegment : Phase::kDispatchSegment));
    const auto* seg_payload = static_cast<const bf16_bits*>(domain_.region(rank, regions_.payload)) + static_cast<int64_t>(buf) * S * H;
    if (!backward) {
      RDEP_RETURN_IF_ERROR(OwnerForwardSegment(rank, st, sv, seg, seg_payload));
      // Relays store only the positions of tokens with accepted rows here: the headers this owner read
      // go back to "no rows" before the buffer's next use (ordered by the barriers in between).
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(static_cast<char*>(domain_.region(rank, regions_.sideband)) + buf * half, 0, half, stream));
    } else {
      RDEP_RETURN_IF_ERROR(OwnerBackwardSegment(rank, st, sv, seg, seg_payload));
    }
  }
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardDone : Phase::kReturnDone));
  if (!backward) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(tp.events[2], stream));

  // C: one reduced record per (token, node) back to its source; node partials added in node order.
  RDEP_RETURN_IF_ERROR(dispatch::LaunchReduceAtRelay(tp.relay_in.ptr, num_relayed, bl, layout_,
                                                     static_cast<const bf16_bits*>(domain_.region(rank, regions_.ret)), backward,
                                                     Bits(tp.keep.ptr), reinterpret_cast<const bf16_bits*>(tp.relay_dy.ptr),
                                                     tp.reduced.ptr, stream));
  {
    std::vector<const void*> send(static_cast<size_t>(N));
    std::vector<void*> recv(static_cast<size_t>(N));
    std::vector<int64_t> send_bytes(static_cast<size_t>(N)), recv_bytes(static_cast<size_t>(N));
    for (size_t a = 0; a < static_cast<size_t>(N); ++a) {
      send[a] = tp.reduced.ptr + first_relayed[a] * rs;
      send_bytes[a] = tp.relayed[a] * rs;
      recv[a] = tp.returned.ptr + first_sent[a] * rs;
      recv_bytes[a] = tp.sent[a] * rs;
    }
    RDEP_RETURN_IF_ERROR(inter_->AllToAllV(rank, {send, send_bytes, recv, recv_bytes}, stream));
  }
  if (!backward) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(tp.events[3], stream));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkReturn));
  return dispatch::LaunchCombineNodes(tp.returned.ptr, bl, tp.bundle_index.ptr, words, N, n, backward, Bits(out), sv.experts.ptr,
                                      st.owner.ptr, sv.gates.ptr, sv.accepted.ptr, st.scratch.ptr, dgates, stream);
}

Status CudaMoELayer::RunTwoPhase(int32_t rank, ForwardContext& ctx, RankState& st, Saved& sv, const __nv_bfloat16* x, __nv_bfloat16* y) {
  RDEP_RETURN_IF_ERROR(ExchangeTwoPhase(rank, st, sv, /*backward=*/false, x, y, nullptr));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkCombine));
  RDEP_RETURN_IF_ERROR(CheckRoutingInput(rank, sv, /*wait=*/true));
  RDEP_RETURN_IF_ERROR(CheckNodeCap(rank, sv));
  RDEP_RETURN_IF_ERROR(ArmForward(rank, sv));
  ContextAccess::FinishForward(ctx);
  return Status::Ok();
}

Status CudaMoELayer::BackwardTwoPhase(int32_t rank, RankState& st, Saved& sv, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* dgates) {
  cudaStream_t stream = domain_.stream(rank);
  RDEP_RETURN_IF_ERROR(Mark(rank, st, true, kMarkStart));
  // As on one domain: the first segment's expert compute writes the weight gradients (or zeroes them).
  if (sv.num_segments == 0) RDEP_RETURN_IF_ERROR(FillWeightGrads(st, 0, stream));
  RDEP_RETURN_IF_ERROR(ExchangeTwoPhase(rank, st, sv, /*backward=*/true, dy, dx, dgates));
  return Mark(rank, st, true, kMarkCombine);
}

// The forward's node-limit check (the plan ran every token whatever its nodes: the exchange carries
// any number of bundles), reported after the collective with the host check's message.
Status CudaMoELayer::CheckNodeCap(int32_t rank, const Saved& sv) const {
  if (config_.nodes.cap() >= config_.nodes.nodes) return Status::Ok();
  const TwoPhaseSaved& tp = *sv.two_phase;
  const int32_t N = config_.nodes.nodes;
  int64_t first = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&first, tp.words.ptr + N, sizeof first, cudaMemcpyDeviceToHost, domain_.stream(rank)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  if (first < 0 || first >= sv.num_tokens) return Status::Ok();  // ~0: none
  const int64_t K = config_.shape.topk;
  RankRouting one;
  one.num_tokens = first + 1;
  one.topk = K;
  one.experts.assign(static_cast<size_t>((first + 1) * K), 0);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(one.experts.data() + first * K, sv.experts.ptr + first * K, static_cast<size_t>(K) * 4,
                                       cudaMemcpyDeviceToHost));
  std::vector<int32_t> node_of(static_cast<size_t>(config_.shape.experts));
  const int32_t G = config_.nodes.ranks_per_node(config_.shape.ranks);
  for (int32_t e = 0; e < config_.shape.experts; ++e) node_of[static_cast<size_t>(e)] = ownership_.owner(e) / G;
  const Status limit = CheckNodeLimit(one, node_of, config_.nodes.cap());  // tokens before `first` are on node 0: within any cap
  if (limit.ok()) return InternalError("forward on rank " + std::to_string(rank) + ": the device node-cap check flagged token " +
                                       std::to_string(first) + " but the host rule accepts it");
  return InvalidArgument("forward on rank " + std::to_string(rank) + ": " + limit.message() +
                         " (the token crossed to every node it chose so that every rank finished the call)");
}

// The records LaunchPackBundles and LaunchReduceAtRelay write (rdep/dispatch/two_phase_kernels.h:
// fixed-size, bf16 rows, the metadata padded), and inside the node the scatter's payload row, row
// count and sidebands, and the owners' returned bf16 rows.
model::TwoPhaseWire CudaMoELayer::two_phase_wire() const {
  const LayerShape& s = config_.shape;
  const dispatch::BundleLayout bl{s.topk, config_.nodes.ranks_per_node(s.ranks), s.hidden};
  constexpr int64_t kSideband = sizeof(RowSideband);
  return {.bundle = bl.forward_stride(), .entry = 0, .row = 0, .combine = bl.reduced_stride(false), .pair = 2 * s.hidden + 8,
          .intra_row = kSideband, .return_row = 2 * s.hidden};
}

StatusOr<NodeTraffic> CudaMoELayer::node_traffic(int32_t rank) const {
  RDEP_RETURN_IF_ERROR(CheckLocalRank(rank));
  const Saved* sv = last(rank);
  if (config_.nodes.nodes <= 1 || !sv || !sv->two_phase)
    return FailedPrecondition("node traffic on rank " + std::to_string(rank) + ": no two-phase forward in the layer's own context");
  const TwoPhaseSaved& tp = *sv->two_phase;
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(sv->device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  const int32_t N = config_.nodes.nodes, home = rank / config_.nodes.ranks_per_node(config_.shape.ranks);
  const dispatch::BundleLayout bl{config_.shape.topk, config_.nodes.ranks_per_node(config_.shape.ranks), config_.shape.hidden};
  NodeTraffic t;
  for (int32_t b = 0; b < N; ++b) {
    if (b == home) continue;
    t.inter_dispatch_rows += tp.sent[static_cast<size_t>(b)];
    t.inter_combine_rows += tp.relayed[static_cast<size_t>(b)];
  }
  t.inter_dispatch_bytes = t.inter_dispatch_rows * bl.forward_stride();
  t.inter_combine_bytes = t.inter_combine_rows * bl.reduced_stride(false);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(&t.intra_dispatch_rows, tp.words.ptr + N + 1, sizeof(int64_t), cudaMemcpyDeviceToHost));
  RDEP_ASSIGN_OR_RETURN(const int64_t relayed_rows, RelayedRows(tp, bl));
  const model::TwoPhaseWire wire = two_phase_wire();
  t.intra_dispatch_bytes = t.intra_dispatch_rows * wire.pair + relayed_rows * wire.intra_row;
  t.intra_return_rows = sv->total_rows;  // the owner returned every row it received to a relay
  t.intra_return_bytes = t.intra_return_rows * wire.return_row;
  float ms[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms[i], tp.events[i], tp.events[i + 1]));
  t.dispatch_s = ms[0] * 1e-3;
  t.intra_s = ms[1] * 1e-3;
  t.combine_s = ms[2] * 1e-3;
  return t;
}

// The rows f_k(x_t) of rank `rank`'s last forward stayed at the relays of its local index, one per
// node: gathered from their kept rows (every relay must be driven by this process).
StatusOr<std::vector<float>> CudaMoELayer::CopyExpertOutputsTwoPhase(int32_t rank) const {
  const Saved* mine = last(rank);
  if (!mine) return FailedPrecondition("rank " + std::to_string(rank) + ": no completed forward in the layer's own context");
  const int64_t K = config_.shape.topk, H = config_.shape.hidden;
  const int32_t N = config_.nodes.nodes, G = config_.nodes.ranks_per_node(config_.shape.ranks), home = rank / G;
  const dispatch::BundleLayout bl{K, G, H};
  std::vector<float> out(static_cast<size_t>(mine->num_tokens * K * H), 0.f);
  for (int32_t b = 0; b < N; ++b) {
    const int32_t relay = b * G + rank % G;
    if (!domain_.is_local(relay))
      return FailedPrecondition("expert outputs of rank " + std::to_string(rank) + ": its relay " + std::to_string(relay) +
                                " is driven by another process");
    const Saved* r = last(relay);
    if (!r || !r->two_phase) return FailedPrecondition("expert outputs: relay " + std::to_string(relay) + " has no forward");
    const TwoPhaseSaved& tp = *r->two_phase;
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(relay)));
    const int64_t first = Firsts(tp.relayed)[static_cast<size_t>(home)], num = tp.relayed[static_cast<size_t>(home)];
    if (num == 0) continue;
    std::vector<char> meta(static_cast<size_t>(num * bl.forward_stride()));
    std::vector<uint16_t> kept(static_cast<size_t>(num * K * H));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(meta.data(), tp.relay_in.ptr + first * bl.forward_stride(), meta.size(), cudaMemcpyDeviceToHost));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(kept.data(), tp.keep.ptr + first * K * H, kept.size() * 2, cudaMemcpyDeviceToHost));
    for (int64_t j = 0; j < num; ++j) {
      const char* m = meta.data() + j * bl.forward_stride();
      const auto* words = reinterpret_cast<const int32_t*>(m);
      const int64_t t = words[0];
      for (int64_t k = 0; k < K; ++k) {
        if (words[2 + k] < 0) continue;
        for (int64_t c = 0; c < H; ++c)
          out[static_cast<size_t>((t * K + k) * H + c)] = Bf16BitsToFloat(kept[static_cast<size_t>((j * K + k) * H + c)]);
      }
    }
  }
  return out;
}

}  // namespace rdep
