// Orchestration of the RDEP protocol on the CUDA backend (kernels: rdep/transport/dispatch_kernels.h,
// expert MLP: rdep/kernels/expert_mlp.h).
#include "rdep/layer/cuda_moe_layer.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "rdep/core/route_rules.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/kernels/expert_mlp.h"
#include "rdep/transport/dispatch_kernels.h"
#include "layer/sgd_kernel.h"

namespace rdep {

namespace {

using dispatch::bf16_bits;
using dispatch::GroupedRow;

// A device buffer that keeps its allocation across calls and grows only when asked for more.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  Status Reserve(size_t n) {
    if (n <= count) return Status::Ok();
    if (ptr) RDEP_CUDA_RETURN_IF_ERROR(cudaFree(ptr));
    ptr = nullptr;
    count = 0;
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
    count = n;
    return Status::Ok();
  }
  // Grows keeping the first `keep` elements (stream-ordered copy, then a sync before the free).
  Status Grow(size_t n, size_t keep, cudaStream_t s) {
    if (n <= count) return Status::Ok();
    T* fresh = nullptr;
    const size_t want = std::max(n, count + count / 2);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&fresh, want * sizeof(T)));
    if (keep) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(fresh, ptr, keep * sizeof(T), cudaMemcpyDeviceToDevice, s));
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    if (ptr) RDEP_CUDA_RETURN_IF_ERROR(cudaFree(ptr));
    ptr = fresh;
    count = want;
    return Status::Ok();
  }
  void Free() {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    count = 0;
  }
};

const bf16_bits* Bits(const __nv_bfloat16* p) { return reinterpret_cast<const bf16_bits*>(p); }
bf16_bits* Bits(__nv_bfloat16* p) { return reinterpret_cast<bf16_bits*>(p); }

}  // namespace

struct CudaMoELayer::RankState {
  int device = 0;
  int32_t num_local = 0;
  std::unique_ptr<kernels::ExpertMlp> mlp;
  // Weights (bf16) and gradients (fp32) of this rank's experts; ownership map on the device.
  DeviceBuffer<__nv_bfloat16> w1, w2;
  DeviceBuffer<float> dw1, dw2;
  DeviceBuffer<int32_t> owner, local, local_to_global;
  // Front-end context saved by forward (sized for T tokens at Create).
  int64_t num_tokens = 0;
  bool have_forward = false;
  DeviceBuffer<int32_t> experts, tok_index, rank_in_expert;
  DeviceBuffer<float> gates, effective, scratch;
  DeviceBuffer<uint8_t> accepted;
  DeviceBuffer<int64_t> dropped, rows_per_expert, seg_counts;
  DeviceBuffer<__nv_bfloat16> saved_f;  // [T*K][H] returned rows, kept for dgate
  // Owner context: every segment's grouped rows, inputs, pre-activations; outputs of one segment.
  int64_t num_segments = 0;
  std::vector<std::vector<int64_t>> seg_rows;  // host: per segment, rows per local expert
  std::vector<int64_t> seg_base;               // host: first grouped row of each segment
  int64_t total_rows = 0;
  DeviceBuffer<GroupedRow> grouped;
  DeviceBuffer<__nv_bfloat16> x_rows, h_rows, out_rows;
  int64_t* host_counts = nullptr;  // pinned [num_local + W]
  // Input validation: the first faulty routing slot of the last forward (device, then pinned copy).
  DeviceBuffer<unsigned long long> fault;
  unsigned long long* host_fault = nullptr;
  cudaEvent_t fault_copied = nullptr;
  // Profiling: an event pool and the (phase, event) marks of the last forward / backward.
  std::vector<cudaEvent_t> events;
  std::vector<std::pair<int, cudaEvent_t>> marks[2];
};

namespace {
enum MarkPhase { kMarkStart, kMarkRouting, kMarkDispatch, kMarkExpert, kMarkReturn, kMarkCombine };
constexpr size_t kEventsPerCall = 256;
}  // namespace

Status CudaMoELayer::Mark(int32_t rank, RankState& st, bool backward, int phase) {
  if (!profiling_) return Status::Ok();
  auto& marks = st.marks[backward ? 1 : 0];
  if (phase == kMarkStart) marks.clear();
  const size_t slot = (backward ? kEventsPerCall : 0) + marks.size();
  if (marks.size() >= kEventsPerCall) return Status::Ok();  // too many segments to profile: keep the first
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(st.events[slot], domain_.stream(rank)));
  marks.emplace_back(phase, st.events[slot]);
  return Status::Ok();
}

Status CudaMoELayer::EnableProfiling(bool on) {
  profiling_ = on;
  if (!on) return Status::Ok();
  for (auto& st : ranks_) {
    if (!st || !st->events.empty()) continue;
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st->device));
    st->events.resize(2 * kEventsPerCall);
    for (auto& e : st->events) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  }
  return Status::Ok();
}

StatusOr<PhaseTimes> CudaMoELayer::LastPhaseTimes(int32_t rank, bool backward) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  const auto& marks = st.marks[backward ? 1 : 0];
  if (marks.size() < 2) return FailedPrecondition("no profiled call on rank " + std::to_string(rank) + " (EnableProfiling first)");
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(marks.back().second));
  PhaseTimes t;
  for (size_t i = 1; i < marks.size(); ++i) {
    float ms = 0;
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second));
    switch (marks[i].first) {
      case kMarkRouting: t.routing_ms += ms; break;
      case kMarkDispatch: t.dispatch_ms += ms; break;
      case kMarkExpert: t.expert_ms += ms; break;
      case kMarkReturn: t.return_ms += ms; break;
      default: t.combine_ms += ms; break;
    }
  }
  return t;
}

size_t CudaMoELayer::device_bytes(int32_t rank) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  size_t b = layout_.total_bytes();
  b += (st.w1.count + st.w2.count + st.saved_f.count + st.x_rows.count + st.h_rows.count + st.out_rows.count) * 2;
  b += (st.dw1.count + st.dw2.count + st.gates.count + st.effective.count + st.scratch.count) * 4;
  b += (st.experts.count + st.tok_index.count + st.rank_in_expert.count) * 4 + st.accepted.count;
  b += st.grouped.count * sizeof(GroupedRow);
  if (st.mlp) b += st.mlp->workspace_bytes();
  return b;
}

CudaMoELayer::CudaMoELayer(CudaDomain& domain, LayerConfig config, OwnershipMap ownership)
    : domain_(domain), config_(std::move(config)), ownership_(std::move(ownership)) {}

CudaMoELayer::~CudaMoELayer() {
  regions_.Free(domain_);
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (!ranks_[r]) continue;  // driven by another process
    RankState& st = *ranks_[r];
    cudaSetDevice(st.device);
    st.mlp.reset();
    for (auto* b : {&st.w1, &st.w2, &st.saved_f, &st.x_rows, &st.h_rows, &st.out_rows}) b->Free();
    for (auto* b : {&st.dw1, &st.dw2, &st.gates, &st.effective, &st.scratch}) b->Free();
    for (auto* b : {&st.owner, &st.local, &st.local_to_global, &st.experts, &st.tok_index, &st.rank_in_expert}) b->Free();
    for (auto* b : {&st.dropped, &st.rows_per_expert, &st.seg_counts}) b->Free();
    st.accepted.Free();
    st.grouped.Free();
    if (st.host_counts) cudaFreeHost(st.host_counts);
    if (st.host_fault) cudaFreeHost(st.host_fault);
    if (st.fault_copied) cudaEventDestroy(st.fault_copied);
    st.fault.Free();
    for (auto e : st.events) cudaEventDestroy(e);
  }
}

StatusOr<std::unique_ptr<CudaMoELayer>> CudaMoELayer::Create(CudaDomain& domain, const LayerConfig& config_in,
                                                            const OwnershipMap& ownership, const MoEWeights& weights) {
  LayerConfig config = config_in;
  RDEP_RETURN_IF_ERROR(ValidateLayerInputs(config, domain.num_ranks(), ownership, weights));
  const LayerShape& s = config.shape;
  if (s.topk > 1024) return InvalidArgument("cuda layer: K must be <= 1024");
  if (config.segment_tokens == 0) config.segment_tokens = std::max<int64_t>(1, s.ranks * s.tokens);  // worst case: no sync
  {
    // Every process must build the same layer: shape, capacity, segment and ownership map.
    std::vector<int64_t> fp = {s.tokens, s.hidden, s.ffn, s.experts, s.topk, s.ranks, config.segment_tokens};
    int64_t cf;
    std::memcpy(&cf, &config.capacity.capacity_factor, sizeof cf);
    fp.push_back(cf);
    for (int32_t o : ownership.owners()) fp.push_back(o);
    std::vector<uint8_t> bytes(fp.size() * sizeof(int64_t));
    std::memcpy(bytes.data(), fp.data(), bytes.size());
    RDEP_RETURN_IF_ERROR(domain.AgreeAcrossRanks(bytes, "layer config", [](const std::vector<uint8_t>& b) {
      std::vector<int64_t> v(b.size() / sizeof(int64_t));
      std::memcpy(v.data(), b.data(), v.size() * sizeof(int64_t));
      if (v.size() < 8) return std::string("a malformed config");
      double c;
      std::memcpy(&c, &v[7], sizeof c);
      return "T=" + std::to_string(v[0]) + " H=" + std::to_string(v[1]) + " D_ff=" + std::to_string(v[2]) + " E=" +
             std::to_string(v[3]) + " K=" + std::to_string(v[4]) + " W=" + std::to_string(v[5]) + " S=" + std::to_string(v[6]) +
             " capacity=" + std::to_string(c) + (v.size() > 8 ? " (+ownership map)" : "");
    }));
  }
  std::unique_ptr<CudaMoELayer> layer(new CudaMoELayer(domain, config, ownership));
  layer->layout_ = MakeRegionLayout(config, ownership, sizeof(__nv_bfloat16));
  const RegionLayout& l = layer->layout_;
  RDEP_ASSIGN_OR_RETURN(layer->regions_, LayerRegions::Allocate(domain, l));

  const int64_t T = s.tokens, K = s.topk, H = s.hidden, F = s.ffn, W = s.ranks;
  const size_t n1 = weights.w1_per_expert(), n2 = weights.w2_per_expert();
  for (int32_t q = 0; q < W; ++q) {
    if (!domain.is_local(q)) {
      layer->ranks_.push_back(nullptr);  // another process drives rank q
      continue;
    }
    auto st = std::make_unique<RankState>();
    st->device = domain.device(q);
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st->device));
    const int32_t L = ownership.num_local(q);
    st->num_local = L;
    // Weights, converted to bf16 on the host.
    std::vector<uint16_t> b1(static_cast<size_t>(L) * n1), b2(static_cast<size_t>(L) * n2);
    std::vector<int32_t> l2g(static_cast<size_t>(std::max(L, 1)), 0);
    for (int32_t j = 0; j < L; ++j) {
      const auto e = static_cast<size_t>(ownership.global_expert(q, j));
      l2g[static_cast<size_t>(j)] = static_cast<int32_t>(e);
      for (size_t i = 0; i < n1; ++i) b1[static_cast<size_t>(j) * n1 + i] = FloatToBf16Bits(weights.w1[e * n1 + i]);
      for (size_t i = 0; i < n2; ++i) b2[static_cast<size_t>(j) * n2 + i] = FloatToBf16Bits(weights.w2[e * n2 + i]);
    }
    RDEP_RETURN_IF_ERROR(st->w1.Reserve(b1.size()));
    RDEP_RETURN_IF_ERROR(st->w2.Reserve(b2.size()));
    RDEP_RETURN_IF_ERROR(st->dw1.Reserve(b1.size()));
    RDEP_RETURN_IF_ERROR(st->dw2.Reserve(b2.size()));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st->w1.ptr, b1.data(), b1.size() * 2, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st->w2.ptr, b2.data(), b2.size() * 2, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(st->dw1.ptr, 0, b1.size() * sizeof(float)));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(st->dw2.ptr, 0, b2.size() * sizeof(float)));
    RDEP_RETURN_IF_ERROR(st->owner.Reserve(static_cast<size_t>(s.experts)));
    RDEP_RETURN_IF_ERROR(st->local.Reserve(static_cast<size_t>(s.experts)));
    RDEP_RETURN_IF_ERROR(st->local_to_global.Reserve(l2g.size()));
    std::vector<int32_t> locals(static_cast<size_t>(s.experts));
    for (int32_t e = 0; e < s.experts; ++e) locals[static_cast<size_t>(e)] = ownership.local_index(e);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st->owner.ptr, ownership.owners().data(), locals.size() * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st->local.ptr, locals.data(), locals.size() * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st->local_to_global.ptr, l2g.data(), l2g.size() * 4, cudaMemcpyHostToDevice));
    // Front-end buffers for up to T tokens.
    const auto nk = static_cast<size_t>(std::max<int64_t>(T * K, 1));
    RDEP_RETURN_IF_ERROR(st->experts.Reserve(nk));
    RDEP_RETURN_IF_ERROR(st->gates.Reserve(nk));
    RDEP_RETURN_IF_ERROR(st->effective.Reserve(nk));
    RDEP_RETURN_IF_ERROR(st->scratch.Reserve(nk));
    RDEP_RETURN_IF_ERROR(st->accepted.Reserve(nk));
    RDEP_RETURN_IF_ERROR(st->rank_in_expert.Reserve(nk));
    RDEP_RETURN_IF_ERROR(st->tok_index.Reserve(static_cast<size_t>(std::max<int64_t>(W * T, 1))));
    RDEP_RETURN_IF_ERROR(st->saved_f.Reserve(nk * static_cast<size_t>(H)));
    RDEP_RETURN_IF_ERROR(st->dropped.Reserve(1));
    RDEP_RETURN_IF_ERROR(st->rows_per_expert.Reserve(static_cast<size_t>(std::max(L, 1))));
    RDEP_RETURN_IF_ERROR(st->seg_counts.Reserve(static_cast<size_t>(std::max(L, 1))));
    void* pinned = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, sizeof(int64_t) * static_cast<size_t>(L + W + 1), cudaHostAllocPortable));
    st->host_counts = static_cast<int64_t*>(pinned);
    RDEP_RETURN_IF_ERROR(st->fault.Reserve(1));
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, sizeof(unsigned long long), cudaHostAllocPortable));
    st->host_fault = static_cast<unsigned long long*>(pinned);
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&st->fault_copied, cudaEventDisableTiming));
    // Per-segment owner buffers (grouped rows of one segment are at most S * min(K, E_loc)).
    const int64_t seg_rows = l.S * l.slots_per_token;
    if (L > 0) {
      RDEP_ASSIGN_OR_RETURN(st->mlp, kernels::ExpertMlp::Create({L, H, F, std::max<int64_t>(seg_rows, 1)}, st->device));
    }
    // out_rows: forward outputs of a segment; in backward, dout rows then dx rows behind them.
    RDEP_RETURN_IF_ERROR(st->out_rows.Reserve(static_cast<size_t>(2 * std::max<int64_t>(seg_rows, 1) * H)));
    layer->ranks_.push_back(std::move(st));
  }
  return layer;
}

Status CudaMoELayer::ApplySgd(int32_t rank, float lr) {
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_RETURN_IF_ERROR(LaunchSgdBf16(st.w1.ptr, st.dw1.ptr, st.w1.count, lr, domain_.stream(rank)));
  return LaunchSgdBf16(st.w2.ptr, st.dw2.ptr, st.w2.count, lr, domain_.stream(rank));
}

StatusOr<std::vector<float>> CudaMoELayer::CopyWeights(int32_t rank, bool second) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  const auto& b = second ? st.w2 : st.w1;
  const size_t n = st.num_local > 0 ? b.count : 0;
  std::vector<uint16_t> bits(n);
  if (n) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(bits.data(), b.ptr, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = Bf16BitsToFloat(bits[i]);
  return out;
}

float* CudaMoELayer::dw1(int32_t r) const { return ranks_[static_cast<size_t>(r)]->dw1.ptr; }
float* CudaMoELayer::dw2(int32_t r) const { return ranks_[static_cast<size_t>(r)]->dw2.ptr; }
int64_t CudaMoELayer::segments(int32_t r) const { return ranks_[static_cast<size_t>(r)]->num_segments; }

Status CudaMoELayer::Forward(int32_t rank, const int32_t* experts, const float* gates, int64_t num_tokens,
                             const __nv_bfloat16* x, __nv_bfloat16* y) {
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  st.have_forward = false;
  const LayerShape& s = config_.shape;
  const int64_t K = s.topk, W = s.ranks;
  // A bad token count still takes part in the collective with no tokens (the other ranks finish), then fails.
  const bool count_ok = num_tokens >= 0 && num_tokens <= s.tokens;
  const int64_t n = count_ok ? num_tokens : 0;
  RDEP_RETURN_IF_ERROR(domain_.CheckErrors(rank));
  cudaStream_t stream = domain_.stream(rank);
  auto control_of = reinterpret_cast<int64_t* const*>(domain_.peer_table(rank, regions_.control));
  auto* my_control = static_cast<int64_t*>(domain_.region(rank, regions_.control));
  const dispatch::OwnerMapView own{st.owner.ptr, st.local.ptr};
  st.num_tokens = n;
  if (n > 0) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.experts.ptr, experts, static_cast<size_t>(n * K) * 4, cudaMemcpyDeviceToDevice, stream));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.gates.ptr, gates, static_cast<size_t>(n * K) * 4, cudaMemcpyDeviceToDevice, stream));
  }
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.fault.ptr, 0xFF, sizeof(unsigned long long), stream));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchValidateRouting(st.experts.ptr, st.gates.ptr, n, K, static_cast<int32_t>(s.experts),
                                                       st.fault.ptr, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.host_fault, st.fault.ptr, sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(st.fault_copied, stream));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkStart));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.dropped.ptr, 0, sizeof(int64_t), stream));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchExpertRank(st.experts.ptr, n, K, static_cast<int32_t>(s.experts), st.rank_in_expert.ptr, stream));
  // Phase 1: counts into every owner's recv tables.
  RDEP_RETURN_IF_ERROR(dispatch::LaunchCountAndPublish(st.experts.ptr, n, layout_, own, rank, st.tok_index.ptr, control_of, stream));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchCounts));
  // Phase 2: owner scan, capacity, bases published back.
  RDEP_RETURN_IF_ERROR(dispatch::LaunchOwnerScan(layout_, rank, st.num_local, config_.capacity.ExpertCapacity(s), control_of,
                                                 st.rows_per_expert.ptr, stream));
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, Phase::kDispatchOffsets));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchAccept(st.experts.ptr, st.gates.ptr, st.rank_in_expert.ptr, n, layout_, own, my_control,
                                              st.accepted.ptr, st.effective.ptr, st.dropped.ptr, stream));
  if (layout_.S >= W * s.tokens) {
    st.num_segments = 1;  // worst-case-sized segment: every owner's stream fits, no sync needed
  } else {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.host_counts, my_control + layout_.owner_tokens(0), sizeof(int64_t) * static_cast<size_t>(W),
                                              cudaMemcpyDeviceToHost, stream));
    RDEP_RETURN_IF_ERROR(domain_.Synchronize(rank));
    int64_t mx = 0;
    for (int64_t p = 0; p < W; ++p) mx = std::max(mx, st.host_counts[p]);
    st.num_segments = (mx + layout_.S - 1) / layout_.S;
  }
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkRouting));
  RDEP_RETURN_IF_ERROR(Exchange(rank, st, /*backward=*/false, x));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchCombine(static_cast<const bf16_bits*>(domain_.region(rank, regions_.ret)), st.accepted.ptr,
                                               st.effective.ptr, n, K, s.hidden, Bits(y), Bits(st.saved_f.ptr), stream));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, false, kMarkCombine));
  if (!count_ok)
    return InvalidArgument("forward on rank " + std::to_string(rank) + ": num_tokens " + std::to_string(num_tokens) +
                           " outside [0, T=" + std::to_string(s.tokens) + "]; the rank took part with no tokens");
  RDEP_RETURN_IF_ERROR(CheckRoutingInput(rank, st, experts, gates));
  st.have_forward = true;
  return Status::Ok();
}

// The device check of this forward's routing (LaunchValidateRouting) as a Status naming rank, token,
// slot and value. The forward has synchronized its stream by now (segment counts), so the wait on
// the copy's event returns at once.
Status CudaMoELayer::CheckRoutingInput(int32_t rank, RankState& st, const int32_t* experts, const float* gates) {
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(st.fault_copied));
  const unsigned long long key = *st.host_fault;
  if (key == ~0ull) return Status::Ok();
  const auto fault = static_cast<RouteSlotFault>(key & 3);
  const auto i = static_cast<int64_t>(key >> 2), K = config_.shape.topk;
  int32_t e = 0;
  float g = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(&e, experts + i, sizeof e, cudaMemcpyDeviceToHost));  // the caller's values
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(&g, gates + i, sizeof g, cudaMemcpyDeviceToHost));
  return InvalidArgument("forward on rank " + std::to_string(rank) + ": routing " +
                         DescribeRouteSlotFault(fault, i / K, i % K, e, g, config_.shape.experts) +
                         " (the token ran with zero gates so that every rank finished the call)");
}

Status CudaMoELayer::Backward(int32_t rank, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* dgates) {
  RankState& st = *ranks_[static_cast<size_t>(rank)];
  if (!st.have_forward) return FailedPrecondition("backward on rank " + std::to_string(rank) + " without a completed forward");
  if (kind_ != ExpertKind::kSwiGLU) return FailedPrecondition("backward needs the SwiGLU expert kind");
  RDEP_RETURN_IF_ERROR(domain_.CheckErrors(rank));
  const LayerShape& s = config_.shape;
  cudaStream_t stream = domain_.stream(rank);
  RDEP_RETURN_IF_ERROR(Mark(rank, st, true, kMarkStart));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchDgate(Bits(dy), Bits(st.saved_f.ptr), st.gates.ptr, st.accepted.ptr, st.num_tokens, s.topk,
                                             s.hidden, st.scratch.ptr, dgates, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.dw1.ptr, 0, st.dw1.count * sizeof(float), stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.dw2.ptr, 0, st.dw2.count * sizeof(float), stream));
  RDEP_RETURN_IF_ERROR(Mark(rank, st, true, kMarkRouting));
  RDEP_RETURN_IF_ERROR(Exchange(rank, st, /*backward=*/true, dy));
  RDEP_RETURN_IF_ERROR(dispatch::LaunchCombine(static_cast<const bf16_bits*>(domain_.region(rank, regions_.ret)), st.accepted.ptr,
                                               nullptr, st.num_tokens, s.topk, s.hidden, Bits(dx), nullptr, stream));
  return Mark(rank, st, true, kMarkCombine);
}

Status CudaMoELayer::Exchange(int32_t rank, RankState& st, bool backward, const __nv_bfloat16* payload) {
  const LayerShape& s = config_.shape;
  const int64_t H = s.hidden, S = layout_.S;
  cudaStream_t stream = domain_.stream(rank);
  auto* my_control = static_cast<int64_t*>(domain_.region(rank, regions_.control));
  const dispatch::OwnerMapView own{st.owner.ptr, st.local.ptr};
  if (!backward) {
    st.seg_rows.assign(static_cast<size_t>(st.num_segments), {});
    st.seg_base.assign(static_cast<size_t>(st.num_segments), 0);
    st.total_rows = 0;
  }
  for (int64_t seg = 0; seg < st.num_segments; ++seg) {
    const auto buf = static_cast<int32_t>(seg % 2);
    const int64_t lo = seg * S;
    RDEP_RETURN_IF_ERROR(dispatch::LaunchScatter(Bits(payload), st.experts.ptr, st.accepted.ptr, st.effective.ptr, st.tok_index.ptr,
                                                 st.num_tokens, layout_, own, rank, my_control, lo, buf,
                                                 domain_.peer_table(rank, regions_.payload), domain_.peer_table(rank, regions_.sideband), stream));
    RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardSegment : Phase::kDispatchSegment));
    RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkDispatch));
    const auto* seg_payload = static_cast<const bf16_bits*>(domain_.region(rank, regions_.payload)) + static_cast<int64_t>(buf) * S * H;
    if (!backward) {
      // Expand into expert-grouped rows; the GEMMs need the per-expert counts on the host.
      const int64_t base = st.total_rows;
      RDEP_RETURN_IF_ERROR(st.grouped.Grow(static_cast<size_t>(base + S * layout_.slots_per_token), static_cast<size_t>(base), stream));
      RDEP_RETURN_IF_ERROR(dispatch::LaunchExpand(domain_.region(rank, regions_.sideband), buf, lo, layout_, my_control, st.num_local,
                                                  st.seg_counts.ptr, st.grouped.ptr + base, stream));
      if (st.num_local > 0)
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.host_counts, st.seg_counts.ptr, sizeof(int64_t) * static_cast<size_t>(st.num_local),
                                                  cudaMemcpyDeviceToHost, stream));
      RDEP_RETURN_IF_ERROR(domain_.Synchronize(rank));
      std::vector<int64_t> counts(st.host_counts, st.host_counts + st.num_local);
      int64_t m = 0;
      for (int64_t c : counts) m += c;
      st.seg_rows[static_cast<size_t>(seg)] = counts;
      st.seg_base[static_cast<size_t>(seg)] = base;
      st.total_rows += m;
      RDEP_RETURN_IF_ERROR(st.x_rows.Grow(static_cast<size_t>(st.total_rows * H), static_cast<size_t>(base * H), stream));
      RDEP_RETURN_IF_ERROR(st.h_rows.Grow(static_cast<size_t>(st.total_rows * 2 * s.ffn), static_cast<size_t>(base * 2 * s.ffn), stream));
      __nv_bfloat16* xr = st.x_rows.ptr + base * H;
      RDEP_RETURN_IF_ERROR(dispatch::LaunchGatherRows(seg_payload, st.grouped.ptr + base, m, H, false, Bits(xr), stream));
      if (kind_ == ExpertKind::kSentinel) {
        RDEP_RETURN_IF_ERROR(dispatch::LaunchSentinelEcho(Bits(xr), st.grouped.ptr + base, m, H, rank, st.local_to_global.ptr,
                                                          Bits(st.out_rows.ptr), stream));
      } else if (m > 0) {
        RDEP_RETURN_IF_ERROR(st.mlp->Forward(xr, counts.data(), st.w1.ptr, st.w2.ptr, st.h_rows.ptr + base * 2 * s.ffn,
                                             st.out_rows.ptr, stream));
      }
      RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkExpert));
      RDEP_RETURN_IF_ERROR(dispatch::LaunchReturnRows(Bits(st.out_rows.ptr), st.grouped.ptr + base, m, layout_,
                                                      domain_.peer_table(rank, regions_.ret), stream));
      RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkReturn));
    } else {
      const int64_t base = st.seg_base[static_cast<size_t>(seg)];
      const auto& counts = st.seg_rows[static_cast<size_t>(seg)];
      int64_t m = 0;
      for (int64_t c : counts) m += c;
      // dout rows = gate * dy of their token, in the forward's grouped order.
      RDEP_RETURN_IF_ERROR(dispatch::LaunchGatherRows(seg_payload, st.grouped.ptr + base, m, H, true, Bits(st.out_rows.ptr), stream));
      if (m > 0) {  // dx rows go right behind the dout rows in out_rows
        RDEP_RETURN_IF_ERROR(st.mlp->Backward(st.x_rows.ptr + base * H, st.h_rows.ptr + base * 2 * s.ffn, st.out_rows.ptr,
                                              counts.data(), st.w1.ptr, st.w2.ptr, st.out_rows.ptr + m * H, st.dw1.ptr,
                                              st.dw2.ptr, /*accumulate=*/true, stream));
      }
      RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkExpert));
      RDEP_RETURN_IF_ERROR(dispatch::LaunchReturnRows(Bits(st.out_rows.ptr + m * H), st.grouped.ptr + base, m, layout_,
                                                      domain_.peer_table(rank, regions_.ret), stream));
      RDEP_RETURN_IF_ERROR(Mark(rank, st, backward, kMarkReturn));
    }
  }
  RDEP_RETURN_IF_ERROR(domain_.Barrier(rank, backward ? Phase::kBackwardDone : Phase::kReturnDone));
  return Mark(rank, st, backward, kMarkReturn);
}

StatusOr<RankAcceptance> CudaMoELayer::CopyAcceptance(int32_t rank) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  const auto nk = static_cast<size_t>(st.num_tokens * config_.shape.topk);
  RankAcceptance a;
  a.accepted.resize(nk);
  a.effective_gates.resize(nk);
  if (nk) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(a.accepted.data(), st.accepted.ptr, nk, cudaMemcpyDeviceToHost));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(a.effective_gates.data(), st.effective.ptr, nk * 4, cudaMemcpyDeviceToHost));
  }
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(&a.dropped, st.dropped.ptr, sizeof(int64_t), cudaMemcpyDeviceToHost));
  return a;
}

StatusOr<std::vector<OwnerTraceEntry>> CudaMoELayer::CopyOwnerTrace(int32_t rank) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  std::vector<GroupedRow> rows(static_cast<size_t>(st.total_rows));
  if (!rows.empty())
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(rows.data(), st.grouped.ptr, rows.size() * sizeof(GroupedRow), cudaMemcpyDeviceToHost));
  std::vector<OwnerTraceEntry> trace;
  for (int64_t seg = 0; seg < st.num_segments; ++seg) {
    int64_t m = 0;
    for (int64_t c : st.seg_rows[static_cast<size_t>(seg)]) m += c;
    const int64_t base = st.seg_base[static_cast<size_t>(seg)];
    for (int64_t g = 0; g < m; ++g) {
      const GroupedRow& r = rows[static_cast<size_t>(base + g)];
      trace.push_back({r.row_id, r.local_expert, static_cast<int32_t>(seg), g});
    }
  }
  return trace;
}

std::vector<int64_t> CudaMoELayer::owner_rows_per_expert(int32_t rank) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  std::vector<int64_t> total(static_cast<size_t>(st.num_local), 0);
  for (const auto& seg : st.seg_rows)
    for (size_t j = 0; j < seg.size(); ++j) total[j] += seg[j];
  return total;
}

StatusOr<std::vector<float>> CudaMoELayer::CopyExpertOutputs(int32_t rank) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(st.device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(domain_.stream(rank)));
  const auto count = static_cast<size_t>(st.num_tokens * config_.shape.topk * config_.shape.hidden);
  std::vector<uint16_t> bits(count);
  if (count) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(bits.data(), st.saved_f.ptr, count * 2, cudaMemcpyDeviceToHost));
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = Bf16BitsToFloat(bits[i]);
  return out;
}

}  // namespace rdep
