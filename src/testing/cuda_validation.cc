#include "rdep/testing/cuda_validation.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/transport/cuda_domain.h"

namespace rdep {
namespace {

// Host data of one rank on its device, freed at scope exit.
struct RankInputs {
  int32_t* experts = nullptr;
  float* gates = nullptr;
  __nv_bfloat16 *x = nullptr, *y = nullptr, *dy = nullptr, *dx = nullptr;
  float* dgates = nullptr;
  ~RankInputs() {
    for (void* p : {static_cast<void*>(experts), static_cast<void*>(gates), static_cast<void*>(x), static_cast<void*>(y),
                    static_cast<void*>(dy), static_cast<void*>(dx), static_cast<void*>(dgates)})
      if (p) cudaFree(p);
  }
};

Status UploadBf16(const std::vector<float>& v, __nv_bfloat16** out) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = FloatToBf16Bits(v[i]);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(out, std::max<size_t>(bits.size(), 1) * 2));
  if (!bits.empty()) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(*out, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  return Status::Ok();
}

Status PoisonedBf16(size_t n, __nv_bfloat16** out) {
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(out, std::max<size_t>(n, 1) * 2));
  return cuda::CudaStatus(cudaMemset(*out, 0xFF, std::max<size_t>(n, 1) * 2), "poison", __FILE__, __LINE__);  // NaN
}

StatusOr<std::vector<float>> DownloadBf16(const __nv_bfloat16* p, size_t n) {
  std::vector<uint16_t> bits(n);
  if (n) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(bits.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = Bf16BitsToFloat(bits[i]);
  return out;
}

// Byte (de)serialization of per-rank results, to gather them across processes.
struct Blob {
  std::vector<uint8_t> bytes;
  size_t at = 0;
  template <typename T>
  void put(const std::vector<T>& v) {
    const uint64_t n = v.size();
    put_raw(&n, sizeof n);
    put_raw(v.data(), n * sizeof(T));
  }
  template <typename T>
  void put_value(const T& v) { put_raw(&v, sizeof v); }
  void put_raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  }
  template <typename T>
  std::vector<T> get() {
    uint64_t n = 0;
    get_raw(&n, sizeof n);
    std::vector<T> v(n);
    get_raw(v.data(), n * sizeof(T));
    return v;
  }
  template <typename T>
  T get_value() {
    T v;
    get_raw(&v, sizeof v);
    return v;
  }
  void get_raw(void* p, size_t n) {
    if (n) std::memcpy(p, bytes.data() + at, n);
    at += n;
  }
};

// In multi-process mode each process filled only its own rank's slot: exchange the slots so every
// process holds all W (the checks then run identically everywhere).
template <typename T, typename Put, typename Get>
Status GatherSlots(CudaDomain& d, std::vector<T>& slots, Put put, Get get) {
  if (!d.bootstrap()) return Status::Ok();
  Blob mine;
  put(mine, slots[static_cast<size_t>(d.bootstrap()->rank())]);
  RDEP_ASSIGN_OR_RETURN(auto all, AllGatherBytes(*d.bootstrap(), mine.bytes));
  for (size_t r = 0; r < all.size(); ++r) {
    Blob b{std::move(all[r]), 0};
    get(b, slots[r]);
  }
  return Status::Ok();
}

Status Upload(RankInputs& in, const RankRouting& rr, const std::vector<float>& x, int64_t H) {
  const size_t nk = rr.experts.size();
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&in.experts, std::max<size_t>(nk, 1) * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&in.gates, std::max<size_t>(nk, 1) * 4));
  if (nk) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(in.experts, rr.experts.data(), nk * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(in.gates, rr.gates.data(), nk * 4, cudaMemcpyHostToDevice));
  }
  RDEP_RETURN_IF_ERROR(UploadBf16(x, &in.x));
  RDEP_RETURN_IF_ERROR(PoisonedBf16(static_cast<size_t>(rr.num_tokens * H), &in.y));
  // The copies and the memset ran on the legacy stream (a pageable copy may return before its DMA lands), which the
  // layer's non-blocking streams do not wait for.
  return cuda::CudaStatus(cudaStreamSynchronize(cudaStreamLegacy), "inputs", __FILE__, __LINE__);
}

class CudaBackend final : public ValidationBackend {
 public:
  explicit CudaBackend(std::unique_ptr<CudaDomain> d) : domain_(std::move(d)) {}
  std::string name() const override { return "cuda"; }
  std::string transport() const override {
    return domain_->transport_name() + (domain_->bootstrap() ? "" : ", one process") + "; " + domain_->placement();
  }
  bool bf16() const override { return true; }

  Status Smoke(std::string* detail) override {
    const int32_t W = domain_->num_ranks();
    RDEP_ASSIGN_OR_RETURN(RegionId region, domain_->AllocateSymmetric(sizeof(int64_t) * static_cast<size_t>(W), "smoke"));
    int64_t wrong = 0;
    std::vector<int64_t> wrong_by_rank(static_cast<size_t>(W), 0);
    RDEP_RETURN_IF_ERROR(domain_->Run([&](int32_t r) -> Status {
      RDEP_RETURN_IF_ERROR(LaunchSmokeStore(domain_->peer_table(r, region), r, W, domain_->stream(r)));
      RDEP_RETURN_IF_ERROR(domain_->Barrier(r, Phase::kSmoke));
      RDEP_RETURN_IF_ERROR(domain_->Synchronize(r));
      std::vector<int64_t> got(static_cast<size_t>(W));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(got.data(), domain_->region(r, region), got.size() * 8, cudaMemcpyDeviceToHost));
      for (int32_t p = 0; p < W; ++p)
        if (got[static_cast<size_t>(p)] != 1000 * p + r) ++wrong_by_rank[static_cast<size_t>(r)];
      return Status::Ok();
    }));
    for (auto v : wrong_by_rank) wrong += v;
    if (domain_->bootstrap()) {  // every process checked its own slots: sum the counts
      std::vector<int64_t> all(static_cast<size_t>(W));
      RDEP_RETURN_IF_ERROR(domain_->bootstrap()->AllGather(&wrong, sizeof wrong, all.data()));
      wrong = 0;
      for (auto v : all) wrong += v;
    }
    if (wrong) return InternalError(std::to_string(wrong) + " peer slots wrong after the device barrier");
    *detail = std::to_string(W) + " ranks, " + domain_->transport_name() + ", kernel peer stores visible after " +
              (W == 1 ? "stream order (W = 1: no barrier)"
                      : domain_->joins_barriers() ? "stream-join barrier (ranks share GPUs)" : "device barrier");
    return Status::Ok();
  }

  StatusOr<SentinelRun> Sentinel(const LayerConfig& cfg, const OwnershipMap& own, const MoEWeights& w, const Routing& routing,
                                 const std::vector<std::vector<float>>& x) override {
    RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain_, cfg, own, w));
    layer->set_expert_kind(ExpertKind::kSentinel);
    const int32_t W = domain_->num_ranks();
    SentinelRun run;
    run.acceptance.resize(static_cast<size_t>(W));
    run.traces.resize(static_cast<size_t>(W));
    run.rows_per_expert.resize(static_cast<size_t>(W));
    run.expert_out.resize(static_cast<size_t>(W));
    struct Slot {
      RankAcceptance acc;
      std::vector<OwnerTraceEntry> trace;
      std::vector<int64_t> rows;
      std::vector<float> out;
      int64_t segments = 0;
    };
    std::vector<Slot> slots(static_cast<size_t>(W));
    RDEP_RETURN_IF_ERROR(domain_->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      RankInputs in;
      RDEP_RETURN_IF_ERROR(Upload(in, routing[i], x[i], cfg.shape.hidden));
      RDEP_RETURN_IF_ERROR(layer->Forward(r, in.experts, in.gates, routing[i].num_tokens, in.x, in.y));
      RDEP_RETURN_IF_ERROR(domain_->Synchronize(r));
      Slot& sl = slots[i];
      RDEP_ASSIGN_OR_RETURN(sl.acc, layer->CopyAcceptance(r));
      RDEP_ASSIGN_OR_RETURN(sl.trace, layer->CopyOwnerTrace(r));
      sl.rows = layer->owner_rows_per_expert(r);
      if (cfg.nodes.nodes <= 1) {
        RDEP_ASSIGN_OR_RETURN(sl.out, layer->CopyExpertOutputs(r));
      }
      sl.segments = layer->segments(r);
      return Status::Ok();
    }));
    if (cfg.nodes.nodes > 1)  // two-phase: the rows stayed at the relays, read once every rank has finished
      for (int32_t r : domain_->local_ranks()) {
        RDEP_ASSIGN_OR_RETURN(slots[static_cast<size_t>(r)].out, layer->CopyExpertOutputs(r));
      }
    RDEP_RETURN_IF_ERROR(GatherSlots(
        *domain_, slots,
        [](Blob& b, const Slot& sl) {
          b.put(sl.acc.accepted);
          b.put(sl.acc.effective_gates);
          b.put_value(sl.acc.dropped);
          b.put(sl.trace);
          b.put(sl.rows);
          b.put(sl.out);
          b.put_value(sl.segments);
        },
        [](Blob& b, Slot& sl) {
          sl.acc.accepted = b.get<uint8_t>();
          sl.acc.effective_gates = b.get<float>();
          sl.acc.dropped = b.get_value<int64_t>();
          sl.trace = b.get<OwnerTraceEntry>();
          sl.rows = b.get<int64_t>();
          sl.out = b.get<float>();
          sl.segments = b.get_value<int64_t>();
        }));
    for (size_t q = 0; q < slots.size(); ++q) {
      run.acceptance[q] = std::move(slots[q].acc);
      run.traces[q] = std::move(slots[q].trace);
      run.rows_per_expert[q] = std::move(slots[q].rows);
      run.expert_out[q] = std::move(slots[q].out);
      run.segments = std::max(run.segments, slots[q].segments);
    }
    run.segment_size = layer->layout().S;
    run.symmetric_bytes_per_rank = layer->layout().total_bytes();
    return run;
  }

  StatusOr<LayerRun> ForwardBackward(const LayerConfig& cfg, const OwnershipMap& own, const MoEWeights& w,
                                     const Routing& routing, const std::vector<std::vector<float>>& x,
                                     const std::vector<std::vector<float>>& dy) override {
    RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain_, cfg, own, w));
    const int32_t W = domain_->num_ranks();
    const int64_t H = cfg.shape.hidden, K = cfg.shape.topk;
    LayerRun out;
    out.y.resize(static_cast<size_t>(W));
    out.dx.resize(static_cast<size_t>(W));
    out.dgates.resize(static_cast<size_t>(W));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    out.dw1.assign(w.w1.size(), nan);
    out.dw2.assign(w.w2.size(), nan);
    const size_t n1 = w.w1_per_expert(), n2 = w.w2_per_expert();
    std::vector<std::vector<float>> d1s(static_cast<size_t>(W)), d2s(static_cast<size_t>(W));
    std::vector<int64_t> segs(static_cast<size_t>(W), 0);
    std::vector<NodeTraffic> traffic(static_cast<size_t>(W));
    RDEP_RETURN_IF_ERROR(domain_->Run([&](int32_t r) -> Status {
      const auto i = static_cast<size_t>(r);
      const auto n = static_cast<size_t>(routing[i].num_tokens);
      RankInputs in;
      RDEP_RETURN_IF_ERROR(Upload(in, routing[i], x[i], H));
      RDEP_RETURN_IF_ERROR(UploadBf16(dy[i], &in.dy));
      RDEP_RETURN_IF_ERROR(PoisonedBf16(n * static_cast<size_t>(H), &in.dx));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&in.dgates, std::max<size_t>(n * static_cast<size_t>(K), 1) * 4));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(in.dgates, 0xFF, std::max<size_t>(n * static_cast<size_t>(K), 1) * 4));
      RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));  // dy, dx and dgates landed (Upload's comment)
      RDEP_RETURN_IF_ERROR(layer->Forward(r, in.experts, in.gates, routing[i].num_tokens, in.x, in.y));
      RDEP_RETURN_IF_ERROR(layer->Backward(r, in.dy, in.dx, in.dgates));
      RDEP_RETURN_IF_ERROR(domain_->Synchronize(r));
      RDEP_ASSIGN_OR_RETURN(out.y[i], DownloadBf16(in.y, n * static_cast<size_t>(H)));
      RDEP_ASSIGN_OR_RETURN(out.dx[i], DownloadBf16(in.dx, n * static_cast<size_t>(H)));
      out.dgates[i].resize(n * static_cast<size_t>(K));
      if (!out.dgates[i].empty())
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.dgates[i].data(), in.dgates, out.dgates[i].size() * 4, cudaMemcpyDeviceToHost));
      const int32_t L = own.num_local(r);
      d1s[i].resize(static_cast<size_t>(L) * n1);
      d2s[i].resize(static_cast<size_t>(L) * n2);
      if (L > 0) {
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(d1s[i].data(), layer->dw1(r), d1s[i].size() * 4, cudaMemcpyDeviceToHost));
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(d2s[i].data(), layer->dw2(r), d2s[i].size() * 4, cudaMemcpyDeviceToHost));
      }
      segs[i] = layer->segments(r);
      if (cfg.nodes.nodes > 1) {
        RDEP_ASSIGN_OR_RETURN(traffic[i], layer->node_traffic(r));
      }
      return Status::Ok();
    }));
    if (cfg.nodes.nodes > 1) out.wire = layer->two_phase_wire();
    if (cfg.balance.enabled()) {  // the plan is the same on every rank: any local one tells
      const int32_t r0 = domain_->local_ranks().front();
      RDEP_ASSIGN_OR_RETURN(out.balance, layer->balance_telemetry(r0));
      RDEP_ASSIGN_OR_RETURN(BalancePlan plan, layer->balance_plan(r0));
      for (int32_t e = 0; e < plan.num_experts; ++e)
        out.instances.push_back(plan.instance_offsets[static_cast<size_t>(e) + 1] - plan.instance_offsets[static_cast<size_t>(e)]);
    }
    struct Slot {
      std::vector<float> y, dx, dg, d1, d2;
      int64_t segments = 0;
      NodeTraffic traffic;
    };
    std::vector<Slot> slots(static_cast<size_t>(W));
    for (size_t q = 0; q < slots.size(); ++q)
      slots[q] = {std::move(out.y[q]), std::move(out.dx[q]), std::move(out.dgates[q]), std::move(d1s[q]), std::move(d2s[q]), segs[q],
                  traffic[q]};
    RDEP_RETURN_IF_ERROR(GatherSlots(
        *domain_, slots,
        [](Blob& b, const Slot& sl) {
          for (const auto* v : {&sl.y, &sl.dx, &sl.dg, &sl.d1, &sl.d2}) b.put(*v);
          b.put_value(sl.segments);
          b.put_value(sl.traffic);
        },
        [](Blob& b, Slot& sl) {
          for (auto* v : {&sl.y, &sl.dx, &sl.dg, &sl.d1, &sl.d2}) *v = b.get<float>();
          sl.segments = b.get_value<int64_t>();
          sl.traffic = b.get_value<NodeTraffic>();
        }));
    for (int32_t q = 0; q < W; ++q) {
      Slot& sl = slots[static_cast<size_t>(q)];
      out.y[static_cast<size_t>(q)] = std::move(sl.y);
      out.dx[static_cast<size_t>(q)] = std::move(sl.dx);
      out.dgates[static_cast<size_t>(q)] = std::move(sl.dg);
      out.segments = std::max(out.segments, sl.segments);
      if (cfg.nodes.nodes > 1) out.traffic.push_back(sl.traffic);
      for (int32_t j = 0; j < own.num_local(q); ++j) {
        const auto e = static_cast<size_t>(own.global_expert(q, j));
        std::copy_n(sl.d1.data() + static_cast<size_t>(j) * n1, n1, out.dw1.data() + e * n1);
        std::copy_n(sl.d2.data() + static_cast<size_t>(j) * n2, n2, out.dw2.data() + e * n2);
      }
    }
    return out;
  }

 private:
  std::unique_ptr<CudaDomain> domain_;
};

}  // namespace

StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaMultiProcessBackend(Bootstrap& bootstrap, double barrier_timeout_s) {
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateMultiProcess(bootstrap, {.barrier_timeout_s = barrier_timeout_s, .devices = {}}));
  return std::unique_ptr<ValidationBackend>(new CudaBackend(std::move(domain)));
}

StatusOr<std::unique_ptr<ValidationBackend>> MakeCudaBackend(int64_t num_ranks, double barrier_timeout_s, int num_gpus) {
  const int present = cuda::DeviceCount();
  if (present == 0) return Unavailable("cuda backend: no CUDA device is present");
  if (num_gpus < 0 || num_gpus > present)
    return InvalidArgument("cuda backend: " + std::to_string(num_gpus) + " GPUs asked for, this machine has " + std::to_string(present));
  if (num_ranks < 1) return InvalidArgument("cuda backend: ranks W must be >= 1, got " + std::to_string(num_ranks));
  if (num_gpus == 0) num_gpus = static_cast<int>(std::min<int64_t>(num_ranks, present));
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(num_ranks, {.barrier_timeout_s = barrier_timeout_s,
                                                                                  .devices = RoundRobinDevices(num_ranks, num_gpus)}));
  return std::unique_ptr<ValidationBackend>(new CudaBackend(std::move(domain)));
}

}  // namespace rdep
