// The two-phase exchange of the host layer (LayerConfig::nodes, seeds 004). Ranks form N nodes of G;
// the rank with local index i of every node is the relay, in its node, of the sources with local
// index i. Forward: a source sends each token once to every other node holding an accepted row of it
// (to the relay with its local index), with the token's rows there and their stream positions;
// inside each node the relays scatter the tokens to the owners as the one-domain protocol does (same
// streams, positions, sidebands and capacity decision, so owners group, compute and accumulate weight
// gradients exactly as without nodes); owners return rows to the relay; the relay reduces each
// token's rows on its node in slot order (fp32) and sends one row per (token, node) back; the source
// adds the node partials in node order. Backward mirrors it: dy crosses once per (token, node), the
// relay computes dgate's dot products <dy, f_k> from the rows it kept and reduces dx rows, and the
// source adds dx partials in node order and applies the capacity renormalization's backward.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <tuple>

#include "layer/context_access.h"
#include "layer/host_layer_state.h"
#include "rdep/core/capacity.h"
#include "rdep/core/node_rules.h"
#include "rdep/core/row_id.h"

namespace rdep {

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void PutBytes(std::vector<std::byte>& b, const void* p, size_t n) {
  const auto* c = static_cast<const std::byte*>(p);
  b.insert(b.end(), c, c + n);
}
template <typename T>
void Put(std::vector<std::byte>& b, const T& v) {
  PutBytes(b, &v, sizeof(T));
}

struct Reader {
  const std::byte* p;
  const std::byte* end;
  explicit Reader(const std::vector<std::byte>& v) : p(v.data()), end(v.data() + v.size()) {}
  bool done() const { return p >= end; }
  void Read(void* dst, size_t n) {
    std::memcpy(dst, p, n);
    p += n;
  }
  template <typename T>
  T Get() {
    T v;
    Read(&v, sizeof(T));
    return v;
  }
};

// Per node: (token, owner, stream position) of every (token, owner) pair with an accepted row there,
// by token then owner.
std::vector<std::vector<std::tuple<int32_t, int32_t, int64_t>>> PairsByNode(const std::vector<std::vector<int32_t>>& tokens_to,
                                                                            const std::vector<int64_t>& stream_base,
                                                                            const std::vector<int32_t>& dest_rank, int64_t K,
                                                                            int32_t N, int32_t G) {
  std::vector<std::vector<std::tuple<int32_t, int32_t, int64_t>>> pairs(static_cast<size_t>(N));
  for (size_t q = 0; q < tokens_to.size(); ++q)
    for (size_t i = 0; i < tokens_to[q].size(); ++i) {
      const int32_t t = tokens_to[q][i];
      bool any = false;
      for (int64_t k = 0; k < K && !any; ++k) any = dest_rank[static_cast<size_t>(t * K + k)] == static_cast<int32_t>(q);
      if (any) pairs[q / static_cast<size_t>(G)].emplace_back(t, static_cast<int32_t>(q), stream_base[q] + static_cast<int64_t>(i));
    }
  for (auto& v : pairs) std::stable_sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return std::get<0>(x) < std::get<0>(y); });
  return pairs;
}

}  // namespace

float* HostMoELayer::ReturnRow(int32_t owner, uint64_t row_id) const {
  const int64_t T = config_.shape.tokens, K = config_.shape.topk, H = config_.shape.hidden;
  const RowKey key = RowIdCodec{T, K}.decode(row_id);
  if (config_.nodes.nodes == 1) return domain_.region_as<float>(static_cast<int32_t>(key.rank), regions_.ret) + (key.token * K + key.slot) * H;
  const NodeSplit split{config_.nodes.ranks_per_node(config_.shape.ranks)};  // the rule the CUDA kernels use too
  const auto relay = static_cast<int32_t>(split.relay(owner, key.rank));
  return domain_.region_as<float>(relay, regions_.ret) + split.relay_return_index(key, T, K) * H;
}

// The inter-node hop out: tokens (forward: with their rows and stream positions) to the relays; the
// relay's side parses what it received into st.relayed (forward) and the rows of relay_in.
Status HostMoELayer::SendToRelays(int32_t rank, Saved& st, bool backward, std::span<const float> payload,
                                  std::vector<float>& relay_in) {
  const int32_t N = config_.nodes.nodes, G = config_.nodes.ranks_per_node(config_.shape.ranks), home = rank / G;
  const int64_t K = config_.shape.topk, H = config_.shape.hidden;
  const RowIdCodec codec{config_.shape.tokens, K};
  const RankAcceptance& acc = st.acceptance;
  const auto pairs = PairsByNode(st.tokens_to, st.stream_base, st.dest_rank, K, N, G);
  std::vector<std::vector<std::byte>> send(static_cast<size_t>(N)), recv;
  std::vector<RowSideband> rows;
  for (int32_t b = 0; b < N; ++b) {
    auto& out = send[static_cast<size_t>(b)];
    const auto& v = pairs[static_cast<size_t>(b)];
    for (size_t i = 0; i < v.size();) {
      const int32_t t = std::get<0>(v[i]);
      size_t j = i;
      while (j < v.size() && std::get<0>(v[j]) == t) ++j;
      Put<int32_t>(out, t);
      if (!backward) {
        Put<int32_t>(out, static_cast<int32_t>(j - i));
        for (size_t e = i; e < j; ++e) {
          const int32_t q = std::get<1>(v[e]);
          rows.clear();
          for (int64_t k = 0; k < K; ++k) {
            const auto idx = static_cast<size_t>(t * K + k);
            if (acc.accepted[idx] && st.dest_rank[idx] == q)
              rows.push_back(RowSideband{codec.encode(rank, t, k), st.dest_local[idx], acc.effective_gates[idx]});
          }
          Put<int32_t>(out, q);
          Put<int32_t>(out, static_cast<int32_t>(rows.size()));
          Put<int64_t>(out, std::get<2>(v[e]));
          PutBytes(out, rows.data(), rows.size() * sizeof(RowSideband));
        }
      }
      PutBytes(out, payload.data() + t * H, static_cast<size_t>(H) * sizeof(float));
      if (b != home && !backward) ++st.traffic.inter_dispatch_rows;
      i = j;
    }
    if (b != home && !backward) st.traffic.inter_dispatch_bytes += static_cast<int64_t>(out.size());
  }
  RDEP_RETURN_IF_ERROR(inter_->AllToAllV(rank, send, recv));

  relay_in.clear();
  if (!backward) st.relayed.clear();
  size_t next = 0;
  for (int32_t a = 0; a < N; ++a) {
    Reader r(recv[static_cast<size_t>(a)]);
    while (!r.done()) {
      const auto t = r.Get<int32_t>();
      if (!backward) {
        Saved::Relayed rel;
        rel.src_node = a;
        rel.token = t;
        rel.entries.resize(static_cast<size_t>(r.Get<int32_t>()));
        for (auto& en : rel.entries) {
          en.owner = r.Get<int32_t>();
          en.rows.resize(static_cast<size_t>(r.Get<int32_t>()));
          en.pos = r.Get<int64_t>();
          r.Read(en.rows.data(), en.rows.size() * sizeof(RowSideband));
          rel.rows.insert(rel.rows.end(), en.rows.begin(), en.rows.end());
          st.traffic.intra_dispatch_rows += 1;
        }
        std::sort(rel.rows.begin(), rel.rows.end(), [](const RowSideband& x, const RowSideband& y) { return x.row_id < y.row_id; });
        st.relayed.push_back(std::move(rel));
      } else if (next >= st.relayed.size() || st.relayed[next].src_node != a || st.relayed[next].token != t) {
        return InternalError("two-phase backward on rank " + std::to_string(rank) + ": node " + std::to_string(a) +
                             " sent token " + std::to_string(t) + " out of the forward's order");
      } else {
        ++next;
      }
      relay_in.resize(relay_in.size() + static_cast<size_t>(H));
      r.Read(relay_in.data() + relay_in.size() - static_cast<size_t>(H), static_cast<size_t>(H) * sizeof(float));
    }
  }
  if (backward && next != st.relayed.size())
    return InternalError("two-phase backward on rank " + std::to_string(rank) + ": " + std::to_string(next) + " of " +
                         std::to_string(st.relayed.size()) + " relayed tokens came back");
  return Status::Ok();
}

// Inside the node, one segment: every relayed (token, owner) pair whose stream position falls in the
// segment's window goes to the owner's payload and sideband, as the one-domain scatter places it.
// Returns the bytes written (payload rows, row counts, sidebands).
int64_t HostMoELayer::ScatterRelayed(const Saved& st, int64_t seg, std::span<const float> relay_in) {
  const int64_t S = layout_.S, H = config_.shape.hidden, buf = seg % 2, lo = seg * S;
  const size_t tsb = layout_.token_sideband_bytes();
  int64_t bytes = 0;
  for (size_t j = 0; j < st.relayed.size(); ++j)
    for (const auto& en : st.relayed[j].entries) {
      if (en.pos < lo || en.pos >= lo + S) continue;
      const int64_t slot = en.pos - lo;
      std::copy_n(relay_in.data() + static_cast<int64_t>(j) * H, H, domain_.region_as<float>(en.owner, regions_.payload) + (buf * S + slot) * H);
      std::byte* hdr = domain_.region(en.owner, regions_.sideband) + static_cast<size_t>(buf * S + slot) * tsb;
      const auto num_rows = static_cast<int64_t>(en.rows.size());
      std::memcpy(hdr, &num_rows, sizeof(int64_t));
      std::memcpy(hdr + sizeof(int64_t), en.rows.data(), en.rows.size() * sizeof(RowSideband));
      bytes += H * static_cast<int64_t>(sizeof(float)) + static_cast<int64_t>(sizeof(int64_t) + en.rows.size() * sizeof(RowSideband));
    }
  return bytes;
}

// After every owner returned its rows to this relay: per relayed token, its rows on this node reduced
// in slot order (forward: sum of g'_k f_k, the f_k kept for dgate; backward: sum of the dx rows, and
// <dy, f_k> per slot in double), one record per token to its source's node.
void HostMoELayer::ReduceAtRelay(int32_t rank, Saved& st, bool backward, std::span<const float> relay_in,
                                 std::vector<std::vector<std::byte>>& send) {
  const int32_t G = config_.nodes.ranks_per_node(config_.shape.ranks), home = rank / G;
  const int64_t K = config_.shape.topk, H = config_.shape.hidden;
  const RowIdCodec codec{config_.shape.tokens, K};
  send.assign(static_cast<size_t>(config_.nodes.nodes), {});
  if (!backward) {
    int64_t rows = 0;
    for (auto& rel : st.relayed) {
      rel.out = rows;
      rows += static_cast<int64_t>(rel.rows.size());
    }
    st.relay_out.assign(static_cast<size_t>(rows * H), 0.f);
  }
  std::vector<float> acc(static_cast<size_t>(H));
  std::vector<double> dots(static_cast<size_t>(K));
  for (size_t j = 0; j < st.relayed.size(); ++j) {
    const auto& rel = st.relayed[j];
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(dots.begin(), dots.end(), 0.0);
    for (size_t r = 0; r < rel.rows.size(); ++r) {
      const RowSideband& row = rel.rows[r];
      const float* f = ReturnRow(rank, row.row_id);
      float* kept = st.relay_out.data() + (rel.out + static_cast<int64_t>(r)) * H;
      if (!backward) {
        std::copy_n(f, H, kept);
        for (int64_t c = 0; c < H; ++c) acc[static_cast<size_t>(c)] += row.gate * f[c];
      } else {
        const float* dy = relay_in.data() + static_cast<int64_t>(j) * H;
        double dot = 0;
        for (int64_t c = 0; c < H; ++c) dot += static_cast<double>(dy[c]) * kept[c];
        dots[static_cast<size_t>(codec.decode(row.row_id).slot)] = dot;
        for (int64_t c = 0; c < H; ++c) acc[static_cast<size_t>(c)] += f[c];
      }
    }
    auto& out = send[static_cast<size_t>(rel.src_node)];
    Put<int32_t>(out, rel.token);
    PutBytes(out, acc.data(), acc.size() * sizeof(float));
    if (backward) PutBytes(out, dots.data(), dots.size() * sizeof(double));
    if (rel.src_node != home && !backward) ++st.traffic.inter_combine_rows;
  }
  if (!backward)
    for (int32_t a = 0; a < config_.nodes.nodes; ++a)
      if (a != home) st.traffic.inter_combine_bytes += static_cast<int64_t>(send[static_cast<size_t>(a)].size());
}

Status HostMoELayer::ExchangeTwoPhase(int32_t rank, Saved& st, bool backward, std::span<const float> payload,
                                      std::vector<std::vector<std::byte>>& returned) {
  auto t0 = Clock::now();
  std::vector<float> relay_in;
  RDEP_RETURN_IF_ERROR(SendToRelays(rank, st, backward, payload, relay_in));
  if (!backward) st.traffic.dispatch_s = Since(t0);
  t0 = Clock::now();
  for (int64_t seg = 0; seg < st.num_segments; ++seg) {
    const int64_t scattered = ScatterRelayed(st, seg, relay_in);
    if (!backward) st.traffic.intra_dispatch_bytes += scattered;
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardSegment : Phase::kDispatchSegment));
    OwnerSegment(rank, st, seg, backward);
  }
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardDone : Phase::kReturnDone));
  if (!backward) st.traffic.intra_s = Since(t0);
  t0 = Clock::now();
  std::vector<std::vector<std::byte>> send;
  ReduceAtRelay(rank, st, backward, relay_in, send);
  RDEP_RETURN_IF_ERROR(inter_->AllToAllV(rank, send, returned));
  if (!backward) st.traffic.combine_s = Since(t0);
  return Status::Ok();
}

Status HostMoELayer::RunTwoPhase(int32_t rank, Saved& st, std::span<const float> x, std::span<float> y) {
  const int64_t H = config_.shape.hidden;
  std::vector<std::vector<std::byte>> returned;
  RDEP_RETURN_IF_ERROR(ExchangeTwoPhase(rank, st, /*backward=*/false, x, returned));
  std::fill(y.begin(), y.end(), 0.f);
  std::vector<float> part(static_cast<size_t>(H));
  for (const auto& from : returned) {  // node order
    Reader r(from);
    while (!r.done()) {
      const auto t = r.Get<int32_t>();
      r.Read(part.data(), part.size() * sizeof(float));
      float* yt = y.data() + t * H;
      for (int64_t c = 0; c < H; ++c) yt[c] += part[static_cast<size_t>(c)];
    }
  }
  return Status::Ok();
}

Status HostMoELayer::BackwardTwoPhase(int32_t rank, Saved& st, std::span<const float> dy, std::span<float> dx,
                                      std::span<float> dgates) {
  const int64_t K = config_.shape.topk, H = config_.shape.hidden, n = st.num_tokens;
  std::vector<std::vector<std::byte>> returned;
  RDEP_RETURN_IF_ERROR(ExchangeTwoPhase(rank, st, /*backward=*/true, dy, returned));
  std::fill(dx.begin(), dx.end(), 0.f);
  std::vector<double> d_eff(static_cast<size_t>(n * K), 0.0), dots(static_cast<size_t>(K)), d_g(static_cast<size_t>(K));
  std::vector<float> part(static_cast<size_t>(H));
  for (size_t b = 0; b < returned.size(); ++b) {  // node order
    Reader r(returned[b]);
    while (!r.done()) {
      const auto t = r.Get<int32_t>();
      r.Read(part.data(), part.size() * sizeof(float));
      r.Read(dots.data(), dots.size() * sizeof(double));
      float* dxt = dx.data() + t * H;
      for (int64_t c = 0; c < H; ++c) dxt[c] += part[static_cast<size_t>(c)];
      for (int64_t k = 0; k < K; ++k) {
        const auto idx = static_cast<size_t>(t * K + k);
        if (node_of_expert_[static_cast<size_t>(st.routing.experts[idx])] == static_cast<int32_t>(b)) d_eff[idx] = dots[static_cast<size_t>(k)];
      }
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    RenormalizeGatesBackward(st.routing.gates.data() + t * K, st.acceptance.accepted.data() + t * K, K, d_eff.data() + t * K, d_g.data());
    for (int64_t k = 0; k < K; ++k) dgates[static_cast<size_t>(t * K + k)] = static_cast<float>(d_g[static_cast<size_t>(k)]);
  }
  return Status::Ok();
}

const NodeTraffic& HostMoELayer::node_traffic(int32_t rank) const { return last(rank).traffic; }

// The records SendToRelays and ReduceAtRelay write (fp32 rows): a bundle is int32 token, int32 entries,
// per entry int32 owner, int32 rows, int64 stream position and the rows' sidebands, then the row; a
// reduced record is int32 token and the row. Inside the node: ScatterRelayed, OwnerSegment's returns.
model::TwoPhaseWire HostMoELayer::two_phase_wire() const {
  const int64_t row = config_.shape.hidden * int64_t{sizeof(float)};
  constexpr int64_t kI32 = sizeof(int32_t), kI64 = sizeof(int64_t), kSideband = sizeof(RowSideband);
  return {.bundle = 2 * kI32 + row, .entry = 2 * kI32 + kI64, .row = kSideband, .combine = kI32 + row, .pair = row + kI64,
          .intra_row = kSideband, .return_row = row};
}

}  // namespace rdep
