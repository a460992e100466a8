// The CUDA layer with the CUTLASS expert compute (LayerConfig::expert_compute = kCutlass): no host
// wait in Forward or Backward, in one segment or several (S < W*T: the worst case's ceil(W*T/S)
// segments, those past the rows received empty). Against the same layer with the cuBLASLt compute
// (W = 1 and W = 4 ranks sharing the GPUs present, capacity drops, segments, owner_reduce): y, dx,
// dgates, dW1, dW2 within ||a-b||/||b|| <= 2e-2 and the routing metadata (acceptance) bitwise; a W = 1
// forward and backward captured in a CUDA graph (any host synchronization inside would break the
// capture), in one segment and in four (also as the overlapped pipeline), and replayed on new inputs in
// the same buffers equals eager calls bitwise; two CUTLASS layers on one domain, sharing the compute's scratch, run
// interleaved equal each alone bitwise. Skips without a GPU, CUTLASS or sm_90.
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdlib>
#include <ostream>
#include <string>
#include <tuple>

#include "layer/cuda_test_util.h"
#include "rdep/cuda/device_count.h"
#include "rdep/experts/expert_compute.h"
#include "rdep/layer/cuda_moe_layer.h"

namespace rdep {
namespace {

struct Problem : SmallProblem {  // the same weights in every problem; activations from `seed`
  Problem(int32_t W, const char* spec, uint64_t seed) : SmallProblem(W, spec, 1, seed) {}
};

struct Outputs {
  std::vector<std::vector<uint16_t>> y, dx;
  std::vector<std::vector<float>> dg, dw1, dw2;
  std::vector<RankAcceptance> acc;
  std::vector<int64_t> segments, rows;  // per rank: the forward's segments, the rows its experts received
  explicit Outputs(size_t W) : y(W), dx(W), dg(W), dw1(W), dw2(W), acc(W), segments(W), rows(W) {}
};

// A layer's setting in these tests: capacity factor (0 = dropless), segment tokens (0 = W*T), owner_reduce.
struct Setting {
  double capacity = 0;
  int64_t segment = 0;
  bool owner_reduce = false;
};
void PrintTo(const Setting& s, std::ostream* os) {
  *os << "{capacity " << s.capacity << ", segment " << s.segment << ", owner_reduce " << s.owner_reduce << "}";
}

// Rank r's results of its last forward and backward (b's outputs, the layer's gradients) into out.
Status Collect(CudaMoELayer& layer, const Problem& p, const Batch& b, int32_t r, Outputs& out) {
  const auto i = static_cast<size_t>(r);
  const int64_t H = p.shape.hidden, F = p.shape.ffn;
  RDEP_ASSIGN_OR_RETURN(out.acc[i], layer.CopyAcceptance(r));
  RDEP_ASSIGN_OR_RETURN(out.y[i], Download(reinterpret_cast<const uint16_t*>(b.y), static_cast<size_t>(b.n * H)));
  RDEP_ASSIGN_OR_RETURN(out.dx[i], Download(reinterpret_cast<const uint16_t*>(b.dx), static_cast<size_t>(b.n * H)));
  RDEP_ASSIGN_OR_RETURN(out.dg[i], Download(b.dg, static_cast<size_t>(b.n * p.shape.topk)));
  const auto L = static_cast<size_t>(p.own.num_local(r));
  RDEP_ASSIGN_OR_RETURN(out.dw1[i], Download(layer.dw1(r), L * static_cast<size_t>(H * 2 * F)));
  RDEP_ASSIGN_OR_RETURN(out.dw2[i], Download(layer.dw2(r), L * static_cast<size_t>(F * H)));
  out.segments[i] = layer.segments(r);
  for (int64_t c : layer.owner_rows_per_expert(r)) out.rows[i] += c;
  return Status::Ok();
}

Outputs RunLayer(Problem& p, ExpertComputeKind kind, const Setting& set) {
  const auto W = static_cast<size_t>(p.shape.ranks);
  Outputs out(W);
  const int gpus = cuda::DeviceCount();
  auto domain = CudaDomain::CreateSingleProcess(p.shape.ranks, {.barrier_timeout_s = 20,
                                                                .devices = RoundRobinDevices(p.shape.ranks, std::min<int>(static_cast<int>(W), gpus))});
  EXPECT_TRUE(domain.ok()) << domain.status();
  if (!domain.ok()) return out;
  LayerConfig cfg = MakeLayerConfig(p.shape, {.capacity_factor = set.capacity});
  cfg.expert_compute = kind;
  cfg.segment_tokens = set.segment;
  cfg.owner_reduce = set.owner_reduce;
  auto layer = CudaMoELayer::Create(**domain, cfg, p.own, p.w);
  EXPECT_TRUE(layer.ok()) << layer.status();
  if (!layer.ok()) return out;
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    Batch b;
    RDEP_RETURN_IF_ERROR(Upload(p.routing[static_cast<size_t>(r)], p.x[static_cast<size_t>(r)], p.dy[static_cast<size_t>(r)], p.shape.hidden, b));
    RDEP_RETURN_IF_ERROR((*layer)->Forward(r, b.e, b.g, b.n, b.x, b.y));
    RDEP_RETURN_IF_ERROR((*layer)->Backward(r, b.dy, b.dx, b.dg));
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    return Collect(**layer, p, b, r, out);
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

double RelL2(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    n += b[i] * b[i];
  }
  return n > 0 ? std::sqrt(d / n) : std::sqrt(d);
}
std::vector<double> Widen(const std::vector<uint16_t>& v) {
  std::vector<double> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = Bf16BitsToFloat(v[i]);
  return o;
}
std::vector<double> Widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

class CudaSyncFree : public ::testing::TestWithParam<std::tuple<int32_t, Setting>> {};

TEST_P(CudaSyncFree, CutlassComputeMatchesCublasLt) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  const auto [W, set] = GetParam();
  Problem p(W, "zipf:1.2", 3);
  const Outputs lt = RunLayer(p, ExpertComputeKind::kCublasLt, set);
  const Outputs cut = RunLayer(p, ExpertComputeKind::kCutlass, set);
  const int64_t wt = W * p.shape.tokens, S = set.segment > 0 ? set.segment : wt;
  for (size_t i = 0; i < static_cast<size_t>(W); ++i) {
    EXPECT_EQ(cut.acc[i].accepted, lt.acc[i].accepted) << "rank " << i;
    EXPECT_EQ(cut.acc[i].effective_gates, lt.acc[i].effective_gates) << "rank " << i;
    // The sync-free layer runs the worst case's segments; the cuBLASLt one those the owners' streams need.
    EXPECT_EQ(cut.segments[i], (wt + S - 1) / S) << "rank " << i;
    EXPECT_LE(lt.segments[i], cut.segments[i]) << "rank " << i;
    EXPECT_EQ(cut.rows[i], lt.rows[i]) << "rows received, rank " << i;
    EXPECT_LE(RelL2(Widen(cut.y[i]), Widen(lt.y[i])), 1e-2) << "y, rank " << i;
    EXPECT_LE(RelL2(Widen(cut.dx[i]), Widen(lt.dx[i])), 2e-2) << "dx, rank " << i;
    EXPECT_LE(RelL2(Widen(cut.dg[i]), Widen(lt.dg[i])), 2e-2) << "dgates, rank " << i;
    EXPECT_LE(RelL2(Widen(cut.dw1[i]), Widen(lt.dw1[i])), 2e-2) << "dW1, rank " << i;
    EXPECT_LE(RelL2(Widen(cut.dw2[i]), Widen(lt.dw2[i])), 2e-2) << "dW2, rank " << i;
  }
  if (set.segment > 0 && set.segment < wt) {  // several segments really ran with rows in more than one
    int64_t most = 0;
    for (int64_t g : lt.segments) most = std::max(most, g);
    EXPECT_GT(most, 1) << "the routing left every owner's stream inside one segment: the case tests nothing more";
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda_bf16, CudaSyncFree,
                         ::testing::Values(std::tuple{1, Setting{}}, std::tuple{4, Setting{}}, std::tuple{4, Setting{.capacity = 0.8}},
                                           std::tuple{1, Setting{.segment = 16}}, std::tuple{4, Setting{.segment = 24}},
                                           std::tuple{4, Setting{.capacity = 0.8, .segment = 32}},
                                           std::tuple{4, Setting{.segment = 40, .owner_reduce = true}}),
                         [](const ::testing::TestParamInfo<std::tuple<int32_t, Setting>>& i) {
                           const Setting& s = std::get<1>(i.param);
                           return "W" + std::to_string(std::get<0>(i.param)) + (s.capacity > 0 ? "_capacity_drops" : "") +
                                  (s.segment > 0 ? "_S" + std::to_string(s.segment) : "") + (s.owner_reduce ? "_owner_reduce" : "");
                         });

// The captured layers' config: the CUTLASS compute with the given segment tokens, pipeline and gate placement.
LayerConfig GraphConfig(const LayerShape& shape, int64_t segment_tokens, bool overlap, bool gate_in_expert) {
  LayerConfig cfg = MakeLayerConfig(shape);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  cfg.segment_tokens = segment_tokens;
  cfg.overlap_segments = overlap;
  cfg.gate_in_expert = gate_in_expert;
  return cfg;
}

// W = 1: Forward + Backward captured once on the rank's stream (a host wait inside would end the
// capture with an error), replayed after new routing and activations were written into the same
// device buffers: bitwise the eager results on those inputs.
// With overlap_segments the capture forks the rank's compute stream from the capturing stream and
// joins it back (cuda_overlap.cc); with gate_in_expert the dgates come through the dots region.
// fresh_context: the captured calls run in a context no forward used before (its buffers are made inside the
// capture, as when CUDA graph trees record a new forward node while another forward's context is live), under the
// global capture mode (torch.cuda.graph's default, the strictest).
class CudaSyncFree_Graph : public ::testing::TestWithParam<std::tuple<int64_t, bool, bool, bool>> {};  // segment tokens, overlap, gate, fresh_context

TEST_P(CudaSyncFree_Graph, W1_CapturedLayerReplaysLikeEagerCalls) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  Problem first(1, "uniform", 5), second(1, "zipf:1.5", 9);
  auto domain = CudaDomain::CreateSingleProcess(1, {.barrier_timeout_s = 20, .devices = {}});
  ASSERT_TRUE(domain.ok()) << domain.status();
  const LayerConfig cfg = GraphConfig(first.shape, std::get<0>(GetParam()), std::get<1>(GetParam()), std::get<2>(GetParam()));
  auto layer = CudaMoELayer::Create(**domain, cfg, first.own, first.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const int64_t H = first.shape.hidden, n = first.routing[0].num_tokens;
  ASSERT_EQ(second.routing[0].num_tokens, n);
  const bool fresh_context = std::get<3>(GetParam());
  Batch b;
  ForwardContext ctx, warm_ctx;
  std::vector<uint16_t> y_graph, dx_graph, y_eager, dx_eager;
  std::vector<float> dg_graph, dg_eager;
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    cudaStream_t stream = (*domain)->stream(r);
    RDEP_RETURN_IF_ERROR(Upload(first.routing[0], first.x[0], first.dy[0], H, b));
    auto step_in = [&](ForwardContext& c) -> Status {
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, c, b.e, b.g, n, b.x, b.y));
      return (*layer)->Backward(r, c, b.dy, b.dx, b.dg);
    };
    auto step = [&]() -> Status { return step_in(ctx); };
    // Eager first: the layer's buffers (and, unless fresh_context, the captured context's) are made outside the capture.
    RDEP_RETURN_IF_ERROR(step_in(fresh_context ? warm_ctx : ctx));
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    cudaGraph_t graph = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(
        cudaStreamBeginCapture(stream, fresh_context ? cudaStreamCaptureModeGlobal : cudaStreamCaptureModeThreadLocal));
    const Status captured = step();
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    RDEP_RETURN_IF_ERROR(captured);  // the layer's own error first: it names the cause
    RDEP_CUDA_RETURN_IF_ERROR(ended);
    cudaGraphExec_t exec = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
    // New inputs in the same buffers, then the replay.
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.e, second.routing[0].experts.data(), second.routing[0].experts.size() * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.g, second.routing[0].gates.data(), second.routing[0].gates.size() * 4, cudaMemcpyHostToDevice));
    Batch fresh;
    RDEP_RETURN_IF_ERROR(Upload(second.routing[0], second.x[0], second.dy[0], H, fresh));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.x, fresh.x, static_cast<size_t>(n * H) * 2, cudaMemcpyDeviceToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.dy, fresh.dy, static_cast<size_t>(n * H) * 2, cudaMemcpyDeviceToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the legacy-stream copies landed before the non-blocking stream reads
    RDEP_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream));
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    RDEP_ASSIGN_OR_RETURN(y_graph, Download(reinterpret_cast<const uint16_t*>(b.y), static_cast<size_t>(n * H)));
    RDEP_ASSIGN_OR_RETURN(dx_graph, Download(reinterpret_cast<const uint16_t*>(b.dx), static_cast<size_t>(n * H)));
    RDEP_ASSIGN_OR_RETURN(dg_graph, Download(b.dg, static_cast<size_t>(n * first.shape.topk)));
    RDEP_RETURN_IF_ERROR(step());  // eager on the same (second) inputs
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    RDEP_ASSIGN_OR_RETURN(y_eager, Download(reinterpret_cast<const uint16_t*>(b.y), static_cast<size_t>(n * H)));
    RDEP_ASSIGN_OR_RETURN(dx_eager, Download(reinterpret_cast<const uint16_t*>(b.dx), static_cast<size_t>(n * H)));
    RDEP_ASSIGN_OR_RETURN(dg_eager, Download(b.dg, static_cast<size_t>(n * first.shape.topk)));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(y_graph, y_eager);
  EXPECT_EQ(dx_graph, dx_eager);
  EXPECT_EQ(dg_graph, dg_eager);
  EXPECT_EQ((*layer)->overlapped(ctx, 0), cfg.overlap_segments) << "the captured forward ran the pipeline (S16: 4 segments)";
}

INSTANTIATE_TEST_SUITE_P(Cuda_bf16, CudaSyncFree_Graph,
                         ::testing::Values(std::tuple{int64_t{0}, false, false, false}, std::tuple{int64_t{16}, false, false, false},
                                           std::tuple{int64_t{16}, true, false, false}, std::tuple{int64_t{0}, false, true, false},
                                           std::tuple{int64_t{16}, true, true, false}, std::tuple{int64_t{0}, false, false, true},
                                           std::tuple{int64_t{0}, false, true, true}, std::tuple{int64_t{16}, true, true, true}),
                         [](const ::testing::TestParamInfo<std::tuple<int64_t, bool, bool, bool>>& i) {
                           const int64_t seg = std::get<0>(i.param);
                           return (seg > 0 ? "S" + std::to_string(seg) : std::string("one_segment")) + (std::get<1>(i.param) ? "_overlap" : "") +
                                  (std::get<2>(i.param) ? "_gate_in_expert" : "") + (std::get<3>(i.param) ? "_fresh_context" : "");
                         });

// W = 2 and 4 ranks round-robin over the GPUs present (up to W of them): on one GPU every rank shares it
// (host-join barriers); with W or more GPUs each rank has its own (barrier kernels, which count their epochs
// on the device); in between, several ranks a GPU (joins). Every rank's Forward + Backward
// captured as one graph through CudaDomain::BeginCapture / EndCapture (the ranks' streams joined to the
// first rank's capture; the barriers between ranks become event edges, or barrier kernels between GPUs),
// launched by the first rank after new routing and activations were written into every rank's buffers,
// twice on different inputs: y, dx, dgates, dW1, dW2 and the acceptance bitwise those of eager calls on the
// same inputs each time.
class CudaSyncFree_GraphRanks : public ::testing::TestWithParam<std::tuple<int32_t, int64_t, bool, bool>> {};  // W, segment tokens, overlap, gate

// Writes `p`'s routing, x and dy for rank r into b's buffers (the ones a graph captured).
Status WriteInputs(const Problem& p, int32_t r, int64_t H, Batch& b) {
  const auto i = static_cast<size_t>(r);
  const int64_t n = p.routing[i].num_tokens;
  if (n != b.n) return InternalError("the problems' token counts differ");
  Batch fresh;
  RDEP_RETURN_IF_ERROR(Upload(p.routing[i], p.x[i], p.dy[i], H, fresh));
  const size_t nk = p.routing[i].experts.size();
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.e, fresh.e, nk * 4, cudaMemcpyDeviceToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.g, fresh.g, nk * 4, cudaMemcpyDeviceToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.x, fresh.x, static_cast<size_t>(n * H) * 2, cudaMemcpyDeviceToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.dy, fresh.dy, static_cast<size_t>(n * H) * 2, cudaMemcpyDeviceToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return Status::Ok();
}

TEST_P(CudaSyncFree_GraphRanks, OneGraphOfAllRanksReplaysLikeEagerCalls) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  const int32_t W = std::get<0>(GetParam());
  Problem first(W, "uniform", 5);
  const Problem replays[2] = {Problem(W, "zipf:1.5", 9), Problem(W, "zipf:1.1", 13)};
  auto domain = CudaDomain::CreateSingleProcess(W, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(W, std::min(W, cuda::DeviceCount()))});
  ASSERT_TRUE(domain.ok()) << domain.status();
  const LayerConfig cfg = GraphConfig(first.shape, std::get<1>(GetParam()), std::get<2>(GetParam()), std::get<3>(GetParam()));
  auto layer = CudaMoELayer::Create(**domain, cfg, first.own, first.w);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const int64_t H = first.shape.hidden;
  std::vector<Batch> b(static_cast<size_t>(W));
  std::vector<Outputs> graph_out(2, Outputs(static_cast<size_t>(W))), eager_out(2, Outputs(static_cast<size_t>(W)));
  std::barrier sync(W);
  int launched = 0;
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    const int64_t n = first.routing[i].num_tokens;
    RDEP_RETURN_IF_ERROR(Upload(first.routing[i], first.x[i], first.dy[i], H, b[i]));
    auto step = [&]() -> Status {  // the layer's own context: Collect reads its acceptance
      RDEP_RETURN_IF_ERROR((*layer)->Forward(r, b[i].e, b[i].g, n, b[i].x, b[i].y));
      return (*layer)->Backward(r, b[i].dy, b[i].dx, b[i].dg);
    };
    RDEP_RETURN_IF_ERROR(step());  // eager first: the context's buffers are made outside the capture
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    RDEP_RETURN_IF_ERROR((*domain)->BeginCapture(r));
    const Status captured = step();
    auto graph = (*domain)->EndCapture(r);  // collective: every rank ends the capture, whatever happened
    if (graph.ok() && *graph && !captured.ok()) cudaGraphDestroy(*graph);
    RDEP_RETURN_IF_ERROR(captured);
    RDEP_RETURN_IF_ERROR(graph.status());
    cudaGraphExec_t exec = nullptr;
    Status made = Status::Ok();
    if (*graph) {
      made = cuda::CudaStatus(cudaGraphInstantiate(&exec, *graph, 0), "cudaGraphInstantiate", __FILE__, __LINE__);
      cudaGraphDestroy(*graph);
      ++launched;
    }
    // Two replays, each on new inputs in every rank's buffers, each followed by eager calls on the same inputs
    // (a barrier whose synchronization held only in the first replay would show in the second). Every rank
    // reaches every rendezvous whatever failed before it.
    Status st = made;
    for (int k = 0; k < 2; ++k) {
      if (st.ok()) st = WriteInputs(replays[k], r, H, b[i]);
      sync.arrive_and_wait();  // every rank's inputs are in place
      Status replayed = st;
      if (exec && replayed.ok()) {
        replayed = cuda::CudaStatus(cudaGraphLaunch(exec, (*domain)->stream(r)), "cudaGraphLaunch", __FILE__, __LINE__);
        if (replayed.ok()) replayed = (*domain)->Synchronize(r);
        for (int32_t q = 0; q < W && replayed.ok(); ++q) replayed = (*domain)->CheckErrors(q);
      }
      sync.arrive_and_wait();  // the replay finished (or failed) before any rank reads or runs again
      if (!replayed.ok()) {  // the others' eager calls below would wait for this rank at their barriers
        st = replayed;
        continue;
      }
      if (st.ok()) st = Collect(**layer, first, b[i], r, graph_out[static_cast<size_t>(k)]);
      if (st.ok()) st = step();  // eager on the same inputs
      if (st.ok()) st = (*domain)->Synchronize(r);
      if (st.ok()) st = Collect(**layer, first, b[i], r, eager_out[static_cast<size_t>(k)]);
    }
    if (exec) cudaGraphExecDestroy(exec);
    return st;
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(launched, 1) << "one rank holds the graph";
  for (size_t k = 0; k < 2; ++k)
    for (int32_t r = 0; r < W; ++r) {
      const auto i = static_cast<size_t>(r);
      EXPECT_EQ(graph_out[k].y[i], eager_out[k].y[i]) << "replay " << k << ", rank " << r;
      EXPECT_EQ(graph_out[k].dx[i], eager_out[k].dx[i]) << "replay " << k << ", rank " << r;
      EXPECT_EQ(graph_out[k].dg[i], eager_out[k].dg[i]) << "replay " << k << ", rank " << r;
      EXPECT_EQ(graph_out[k].dw1[i], eager_out[k].dw1[i]) << "replay " << k << ", rank " << r;
      EXPECT_EQ(graph_out[k].dw2[i], eager_out[k].dw2[i]) << "replay " << k << ", rank " << r;
      EXPECT_EQ(graph_out[k].acc[i].accepted, eager_out[k].acc[i].accepted) << "replay " << k << ", rank " << r;
    }
  EXPECT_NE(graph_out[0].y, graph_out[1].y) << "the two replays ran on different inputs";
}

INSTANTIATE_TEST_SUITE_P(Cuda_bf16, CudaSyncFree_GraphRanks,
                         ::testing::Values(std::tuple{4, int64_t{0}, false, false}, std::tuple{4, int64_t{16}, true, true},
                                           std::tuple{2, int64_t{0}, false, false}, std::tuple{2, int64_t{16}, true, true}),
                         [](const ::testing::TestParamInfo<std::tuple<int32_t, int64_t, bool, bool>>& i) {
                           return "W" + std::to_string(std::get<0>(i.param)) +
                                  (std::get<1>(i.param) > 0 ? "_S16_overlap_gate_in_expert" : "_one_segment");
                         });

// Two CUTLASS layers of one size on a domain share the compute's SwiGLU scratch ("expert.scratch") and the
// owner's output rows: run interleaved (A forward, B forward, A backward, B backward, so B's calls run
// between A's two) they give bitwise what each gives alone on a domain of its own, W = 4 ranks sharing
// the GPUs present. The domain holds the shared bytes once; a cuBLASLt layer of the same size on it shares
// the transport regions, and its output rows (two sets, not one) are its own.
TEST(CudaSyncFree_SharedScratch, W4_TwoLayersInterleavedEqualEachAlone) {
  std::string why;
  if (!CutlassLayerAvailable(&why)) GTEST_SKIP() << why;
  Problem pa(4, "zipf:1.2", 3), pb(4, "uniform", 11);
  const Outputs a_alone = RunLayer(pa, ExpertComputeKind::kCutlass, Setting{}), b_alone = RunLayer(pb, ExpertComputeKind::kCutlass, Setting{});
  auto domain = CudaDomain::CreateSingleProcess(4, {.barrier_timeout_s = 20, .devices = RoundRobinDevices(4, std::min(4, cuda::DeviceCount()))});
  ASSERT_TRUE(domain.ok()) << domain.status();
  LayerConfig cfg = MakeLayerConfig(pa.shape);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  auto la = CudaMoELayer::Create(**domain, cfg, pa.own, pa.w);
  ASSERT_TRUE(la.ok()) << la.status();
  auto lb = CudaMoELayer::Create(**domain, cfg, pb.own, pb.w);
  ASSERT_TRUE(lb.ok()) << lb.status();
  ASSERT_GT((*la)->shared_transport_bytes(), 0u) << "one domain: the transport regions are shared";
  EXPECT_EQ((*domain)->shared_bytes_per_rank(), (*la)->shared_row_bytes() + (*la)->shared_transport_bytes())
      << "two layers of one size: one set of shared rows and transport regions";
  Outputs a_shared(4), b_shared(4);
  Status s = (*domain)->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    Batch ba, bb;
    RDEP_RETURN_IF_ERROR(Upload(pa.routing[i], pa.x[i], pa.dy[i], pa.shape.hidden, ba));
    RDEP_RETURN_IF_ERROR(Upload(pb.routing[i], pb.x[i], pb.dy[i], pb.shape.hidden, bb));
    RDEP_RETURN_IF_ERROR((*la)->Forward(r, ba.e, ba.g, ba.n, ba.x, ba.y));
    RDEP_RETURN_IF_ERROR((*lb)->Forward(r, bb.e, bb.g, bb.n, bb.x, bb.y));
    RDEP_RETURN_IF_ERROR((*la)->Backward(r, ba.dy, ba.dx, ba.dg));
    RDEP_RETURN_IF_ERROR((*lb)->Backward(r, bb.dy, bb.dx, bb.dg));
    RDEP_RETURN_IF_ERROR((*domain)->Synchronize(r));
    RDEP_RETURN_IF_ERROR(Collect(**la, pa, ba, r, a_shared));
    return Collect(**lb, pb, bb, r, b_shared);
  });
  ASSERT_TRUE(s.ok()) << s;
  for (auto [shared, alone, name] : {std::tuple{&a_shared, &a_alone, "A"}, {&b_shared, &b_alone, "B"}})
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(shared->y[i], alone->y[i]) << name << " y, rank " << i;
      EXPECT_EQ(shared->dx[i], alone->dx[i]) << name << " dx, rank " << i;
      EXPECT_EQ(shared->dg[i], alone->dg[i]) << name << " dgates, rank " << i;
      EXPECT_EQ(shared->dw1[i], alone->dw1[i]) << name << " dW1, rank " << i;
      EXPECT_EQ(shared->dw2[i], alone->dw2[i]) << name << " dW2, rank " << i;
    }
  // The CUTLASS layer: one set of output rows (dx over dout) and a scratch of D_ff values a row; a cuBLASLt
  // layer: two sets (dx behind dout), no scratch there, so its output rows are a region of their own.
  const int64_t cap = MaxSegmentRows(cfg, (*la)->layout()), H = pa.shape.hidden, F = pa.shape.ffn;  // the layer's S (W*T here)
  EXPECT_EQ((*la)->shared_row_bytes(), static_cast<size_t>(cap * (H + F) * 2));
  LayerConfig lt_cfg = MakeLayerConfig(pa.shape);
  auto lt = CudaMoELayer::Create(**domain, lt_cfg, pa.own, pa.w);
  ASSERT_TRUE(lt.ok()) << lt.status();
  EXPECT_EQ((*lt)->shared_row_bytes(), static_cast<size_t>(2 * cap * H * 2));
  EXPECT_EQ((*lt)->shared_transport_bytes(), (*la)->shared_transport_bytes());
  EXPECT_EQ((*domain)->shared_bytes_per_rank(), (*la)->shared_row_bytes() + (*lt)->shared_row_bytes() + (*la)->shared_transport_bytes())
      << "the cuBLASLt layer reuses the transport regions and has output rows of its own size";
}

TEST(CudaSyncFree_Errors, CutlassOnANonHopperOrCutlassLessBuildIsNamed) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::string why;
  if (CutlassLayerAvailable(&why)) GTEST_SKIP() << "the CUTLASS compute is available here";
  Problem p(1, "uniform", 1);
  LayerConfig cfg = MakeLayerConfig(p.shape);
  cfg.expert_compute = ExpertComputeKind::kCutlass;
  const Status st = CreateStatus(p, cfg);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("expert compute cutlass"), std::string::npos) << st;
}

}  // namespace
}  // namespace rdep
#endif
