// The CUDA layer with the caller's own experts (Plan, Dispatch, Combine, CombineBackward,
// DispatchBackward): a caller that runs the layer's own expert compute (the cuBLASLt ExpertCompute,
// same description, same bf16 weights) on the received rows gets the layer's Forward and Backward
// bit for bit (y, dx, dgates, dW1, dW2), at W = 1 and with W = 4 ranks sharing the GPUs present,
// with capacity drops; the received row ids equal the host layer's; more than one segment is refused
// naming segment_tokens. At W = 1 both combines read the rows in place (the default) or, with
// RDEP_W1_RETURN=copy when the layers are made, copy them into the return region first. Skips without a GPU.
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/device_count.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/layer/host_moe_layer.h"

namespace rdep {
namespace {

struct Case {
  const char* name;
  int32_t W;
  double capacity;
  const char* routing;
  const char* w1_return = nullptr;  // RDEP_W1_RETURN when the layers are made (null: unset)
};

struct Problem {
  LayerShape shape;
  OwnershipMap own;
  MoEWeights w;
  LayerConfig config;
  Routing routing;
  std::vector<std::vector<float>> x, dy;
  const char* w1_return;
  explicit Problem(const Case& c)
      : shape{.tokens = 48, .hidden = 64, .ffn = 32, .experts = 12, .topk = 3, .ranks = c.W},
        own(*OwnershipMap::Contiguous(12, c.W)),
        w(RandomWeights(shape, 1)),
        config(MakeLayerConfig(shape, {.capacity_factor = c.capacity})),
        routing(*GenerateRouting(shape, *RoutingSpec::Parse(c.routing))),
        x(RandomActivations(shape, routing, 2)),
        dy(RandomActivations(shape, routing, 3)),
        w1_return(c.w1_return) {}
};

// Per rank: y, dx (bf16 bits), dgates, dW1, dW2 (fp32), the received row ids.
struct Result {
  std::vector<std::vector<uint16_t>> y, dx;
  std::vector<std::vector<float>> dg, dw1, dw2;
  std::vector<std::vector<uint64_t>> ids;
  explicit Result(size_t W) : y(W), dx(W), dg(W), dw1(W), dw2(W), ids(W) {}
};

// W ranks round-robin over the GPUs present (sharing them when fewer).
StatusOr<std::unique_ptr<CudaDomain>> MakeSharedDomain(int64_t W) {
  const int gpus = cuda::DeviceCount();
  return CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(W, std::min<int>(static_cast<int>(W), gpus))});
}

Status DownloadOutputs(CudaDomain& d, int32_t r, const Batch& b, const Problem& p, float* dw1, float* dw2, Result& out) {
  const auto i = static_cast<size_t>(r);
  const int64_t H = p.shape.hidden, F = p.shape.ffn;
  RDEP_RETURN_IF_ERROR(d.Synchronize(r));
  RDEP_ASSIGN_OR_RETURN(out.y[i], Download(reinterpret_cast<const uint16_t*>(b.y), static_cast<size_t>(b.n * H)));
  RDEP_ASSIGN_OR_RETURN(out.dx[i], Download(reinterpret_cast<const uint16_t*>(b.dx), static_cast<size_t>(b.n * H)));
  RDEP_ASSIGN_OR_RETURN(out.dg[i], Download(b.dg, static_cast<size_t>(b.n * p.shape.topk)));
  const auto L = static_cast<size_t>(p.own.num_local(r));
  RDEP_ASSIGN_OR_RETURN(out.dw1[i], Download(dw1, L * static_cast<size_t>(H * 2 * F)));
  RDEP_ASSIGN_OR_RETURN(out.dw2[i], Download(dw2, L * static_cast<size_t>(F * H)));
  return Status::Ok();
}

Result RunLayer(Problem& p) {
  Result out(static_cast<size_t>(p.shape.ranks));
  auto domain = MakeSharedDomain(p.shape.ranks);
  EXPECT_TRUE(domain.ok()) << domain.status();
  auto layer = [&] {
    const ScopedEnv env("RDEP_W1_RETURN", p.w1_return);
    return CudaMoELayer::Create(**domain, p.config, p.own, p.w);
  }();
  EXPECT_TRUE(layer.ok()) << layer.status();
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[i], p.x[i], p.dy[i], p.shape.hidden, b));
    RDEP_RETURN_IF_ERROR((*layer)->Forward(r, b.e, b.g, b.n, b.x, b.y));
    RDEP_RETURN_IF_ERROR((*layer)->Backward(r, b.dy, b.dx, b.dg));
    return DownloadOutputs(**domain, r, b, p, (*layer)->dw1(r), (*layer)->dw2(r), out);
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// The caller's side on one rank: the cuBLASLt expert compute the layer uses, on the received rows.
struct CallerExperts {
  std::unique_ptr<kernels::ExpertCompute> mlp;
  __nv_bfloat16 *w1 = nullptr, *w2 = nullptr, *recv = nullptr, *h = nullptr, *out = nullptr, *d_out = nullptr, *d_recv = nullptr;
  float *dw1 = nullptr, *dw2 = nullptr;
  int64_t* counts = nullptr;
  ~CallerExperts() {
    for (void* q : {static_cast<void*>(w1), static_cast<void*>(w2), static_cast<void*>(recv), static_cast<void*>(h),
                    static_cast<void*>(out), static_cast<void*>(d_out), static_cast<void*>(d_recv), static_cast<void*>(dw1),
                    static_cast<void*>(dw2), static_cast<void*>(counts)})
      if (q) cudaFree(q);
  }
};

Status PrepareExperts(const Problem& p, const CudaMoELayer& layer, int32_t r, int device, CallerExperts& ex) {
  const int64_t H = p.shape.hidden, F = p.shape.ffn, L = p.own.num_local(r);
  const int64_t max_rows = std::max<int64_t>(layer.layout().S * layer.layout().slots_per_token, 1);
  if (L > 0) {
    RDEP_ASSIGN_OR_RETURN(ex.mlp, kernels::MakeCublasLtExpertCompute({L, H, F, max_rows}, device));
  }
  std::vector<float> w1, w2;  // the rank's experts in local order, as the layer uploads its own
  for (int32_t j = 0; j < L; ++j) {
    const auto e = static_cast<size_t>(p.own.global_expert(r, j));
    w1.insert(w1.end(), p.w.w1.begin() + static_cast<int64_t>(e * p.w.w1_per_expert()),
              p.w.w1.begin() + static_cast<int64_t>((e + 1) * p.w.w1_per_expert()));
    w2.insert(w2.end(), p.w.w2.begin() + static_cast<int64_t>(e * p.w.w2_per_expert()),
              p.w.w2.begin() + static_cast<int64_t>((e + 1) * p.w.w2_per_expert()));
  }
  RDEP_RETURN_IF_ERROR(UploadBf16(w1, &ex.w1));
  RDEP_RETURN_IF_ERROR(UploadBf16(w2, &ex.w2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&ex.dw1, std::max<size_t>(w1.size(), 1) * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&ex.dw2, std::max<size_t>(w2.size(), 1) * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(ex.dw1, 0, std::max<size_t>(w1.size(), 1) * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(ex.dw2, 0, std::max<size_t>(w2.size(), 1) * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the domain's non-blocking streams do not wait for it
  return Status::Ok();
}

Status AllocRows(int64_t M, int64_t H, int64_t F, CallerExperts& ex) {
  const auto rows = static_cast<size_t>(std::max<int64_t>(M, 1));
  for (__nv_bfloat16** q : {&ex.recv, &ex.out, &ex.d_out, &ex.d_recv})
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(q, rows * static_cast<size_t>(H) * 2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&ex.h, rows * static_cast<size_t>(2 * F) * 2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(ex.recv, 0xFF, rows * static_cast<size_t>(H) * 2));  // poisoned (bf16 NaN)
  RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // landed before the domain's non-blocking streams write
  return Status::Ok();
}

Result RunRows(Problem& p) {
  Result out(static_cast<size_t>(p.shape.ranks));
  auto domain = MakeSharedDomain(p.shape.ranks);
  EXPECT_TRUE(domain.ok()) << domain.status();
  auto layer = [&] {
    const ScopedEnv env("RDEP_W1_RETURN", p.w1_return);
    return CudaMoELayer::Create(**domain, p.config, p.own);  // no weights: the caller computes
  }();
  EXPECT_TRUE(layer.ok()) << layer.status();
  CudaMoELayer& l = **layer;
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    const int64_t H = p.shape.hidden, F = p.shape.ffn, n = p.routing[i].num_tokens;
    cudaStream_t stream = (*domain)->stream(r);
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[i], p.x[i], p.dy[i], H, b));
    CallerExperts ex;
    RDEP_RETURN_IF_ERROR(PrepareExperts(p, l, r, (*domain)->device(r), ex));
    ForwardContext ctx;
    RDEP_RETURN_IF_ERROR(l.Plan(r, ctx, b.e, b.g, n));
    RDEP_ASSIGN_OR_RETURN(std::vector<int64_t> counts, l.recv_counts(ctx));
    const int64_t M = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    RDEP_RETURN_IF_ERROR(AllocRows(M, H, F, ex));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&ex.counts, std::max<size_t>(counts.size(), 1) * 8));
    if (!counts.empty())
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(ex.counts, counts.data(), counts.size() * 8, cudaMemcpyHostToDevice));
    RDEP_RETURN_IF_ERROR(l.Dispatch(r, ctx, b.x, n, ex.recv, M));
    const kernels::ExpertRows rows{ex.counts, M, counts.data()};
    const kernels::ExpertWeightsView w{ex.w1, ex.w2};
    if (M > 0) RDEP_RETURN_IF_ERROR(ex.mlp->Forward(rows, ex.recv, w, ex.h, ex.out, stream));
    RDEP_RETURN_IF_ERROR(l.Combine(r, ctx, ex.out, M, b.y, n));
    RDEP_RETURN_IF_ERROR(l.CombineBackward(r, ctx, b.dy, n, ex.d_out, M, b.dg));
    if (M > 0) RDEP_RETURN_IF_ERROR(ex.mlp->Backward(rows, ex.recv, ex.h, ex.d_out, w, ex.d_recv, {ex.dw1, ex.dw2}, true, stream));
    RDEP_RETURN_IF_ERROR(l.DispatchBackward(r, ctx, ex.d_recv, M, b.dx, n));
    RDEP_ASSIGN_OR_RETURN(out.ids[i], l.recv_row_ids(ctx));
    return DownloadOutputs(**domain, r, b, p, ex.dw1, ex.dw2, out);
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// The host layer's received row ids for the same routing (the order the CUDA layer must match).
std::vector<std::vector<uint64_t>> HostRowIds(const Problem& p) {
  auto domain = *HostDomain::Create(p.shape.ranks, {.barrier_timeout_s = 20});
  auto layer = *HostMoELayer::Create(*domain, p.config, p.own);
  std::vector<std::vector<uint64_t>> ids(static_cast<size_t>(p.shape.ranks));
  EXPECT_TRUE(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    ForwardContext ctx;
    RDEP_RETURN_IF_ERROR(layer->Plan(r, ctx, p.routing[i]));
    RDEP_ASSIGN_OR_RETURN(std::vector<int64_t> c, layer->recv_counts(ctx));
    std::vector<float> recv(static_cast<size_t>(std::accumulate(c.begin(), c.end(), int64_t{0}) * p.shape.hidden));
    RDEP_RETURN_IF_ERROR(layer->Dispatch(r, ctx, p.x[i], recv));
    RDEP_ASSIGN_OR_RETURN(ids[i], layer->recv_row_ids(ctx));
    return Status::Ok();
  }).ok());
  return ids;
}

class CudaRows : public ::testing::TestWithParam<Case> {};

TEST_P(CudaRows, CallerExpertsEqualTheLayerBitwise) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Problem p(GetParam());
  const Result want = RunLayer(p);
  const Result got = RunRows(p);
  const std::vector<std::vector<uint64_t>> host_ids = HostRowIds(p);
  for (size_t i = 0; i < static_cast<size_t>(p.shape.ranks); ++i) {
    EXPECT_FALSE(want.y[i].empty()) << "rank " << i;
    EXPECT_EQ(got.y[i], want.y[i]) << "y, rank " << i;
    EXPECT_EQ(got.dx[i], want.dx[i]) << "dx, rank " << i;
    EXPECT_EQ(got.dg[i], want.dg[i]) << "dgates, rank " << i;
    EXPECT_EQ(got.dw1[i], want.dw1[i]) << "dW1, rank " << i;
    EXPECT_EQ(got.dw2[i], want.dw2[i]) << "dW2, rank " << i;
    EXPECT_EQ(got.ids[i], host_ids[i]) << "received row ids, rank " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda_bf16, CudaRows,
                         ::testing::Values(Case{"W1_E12_K3_uniform", 1, 0.0, "uniform"},
                                           Case{"W1_zipf_capacity_drops", 1, 0.9, "zipf:1.2"},
                                           Case{"W1_zipf_capacity_drops_rows_copied", 1, 0.9, "zipf:1.2", "copy"},
                                           Case{"W4_shared_E12_K3_zipf_capacity_drops", 4, 0.9, "zipf:1.2"}),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(CudaRows_Errors, SeveralSegmentsAreRefusedNamingTheSegment) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Problem p(Case{"segments", 2, 0.0, "uniform"});
  p.config.segment_tokens = 16;
  auto domain = MakeSharedDomain(2);
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto layer = CudaMoELayer::Create(**domain, p.config, p.own);
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<std::string> msg(2);
  ASSERT_TRUE((*domain)->Run([&](int32_t r) -> Status {
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[static_cast<size_t>(r)], p.x[static_cast<size_t>(r)], p.dy[static_cast<size_t>(r)],
                                p.shape.hidden, b));
    ForwardContext ctx;
    RDEP_RETURN_IF_ERROR((*layer)->Plan(r, ctx, b.e, b.g, b.n));
    msg[static_cast<size_t>(r)] = (*layer)->recv_counts(ctx).status().message();
    return (*domain)->Synchronize(r);
  }).ok());
  for (const auto& m : msg) EXPECT_NE(m.find("need one segment per forward (segment_tokens 0 or >= W*T = 96; this layer has S = 16)"),
                                      std::string::npos) << m;
}

}  // namespace
}  // namespace rdep
#endif
