// `rdep bench layer --layers N` (bench_layer_stack.h).
#include "bench_layer_stack.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "rdep/core/reference.h"
#include "rdep/core/stats.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/forward_context.h"

namespace rdep::bench {
namespace {

// One pass on rank r: a device barrier, forward 1..N, an event, backward N..1, an event; then the two
// times (ms) once the stream has finished.
Status StackPass(CudaDomain& domain, const std::vector<CudaMoELayer*>& stack, std::vector<ForwardContext>& ctx, int32_t r,
                 const StackRankIo& io, cudaEvent_t ev[3], double& fwd_ms, double& bwd_ms) {
  cudaStream_t stream = domain.stream(r);
  RDEP_RETURN_IF_ERROR(domain.Barrier(r, Phase::kTest));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[0], stream));
  for (size_t l = 0; l < stack.size(); ++l)
    RDEP_RETURN_IF_ERROR(stack[l]->Forward(r, ctx[l], io.experts, io.gates, io.num_tokens, io.x, io.y));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[1], stream));
  for (size_t l = stack.size(); l-- > 0;) RDEP_RETURN_IF_ERROR(stack[l]->Backward(r, ctx[l], io.dy, io.dx, io.dgates));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[2], stream));
  RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
  float f = 0, b = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&f, ev[0], ev[1]));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&b, ev[1], ev[2]));
  fwd_ms = f;
  bwd_ms = b;
  return Status::Ok();
}

// The untimed pass on rank r, one layer at a time (a failing rank's peers then wait on one barrier, not
// on every queued one): the layers' and the contexts' own counts and the GPU's use, read after the
// forwards.
Status StackMemory(const std::vector<CudaMoELayer*>& stack, std::vector<ForwardContext>& ctx, CudaDomain& domain, int32_t r,
                   const StackRankIo& io, size_t& layer_bytes, size_t& context_bytes, size_t& gpu_used) {
  for (size_t l = 0; l < stack.size(); ++l) {
    RDEP_RETURN_IF_ERROR(stack[l]->Forward(r, ctx[l], io.experts, io.gates, io.num_tokens, io.x, io.y));
    RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
  }
  layer_bytes = context_bytes = 0;
  for (size_t l = 0; l < stack.size(); ++l) {
    layer_bytes += stack[l]->device_bytes(r) + (l == 0 ? stack[l]->shared_bytes() : 0);  // shared by the stack's layers (same size)
    context_bytes += ctx[l].bytes();
  }
  size_t free_b = 0, total_b = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
  gpu_used = total_b - free_b;
  for (size_t l = stack.size(); l-- > 0;) {
    RDEP_RETURN_IF_ERROR(stack[l]->Backward(r, ctx[l], io.dy, io.dx, io.dgates));
    RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
  }
  return Status::Ok();
}

// Rank r's whole run: the untimed pass, then the timed ones (fwd[p], bwd[p] per pass).
Status StackRank(CudaDomain& domain, const std::vector<CudaMoELayer*>& stack, int32_t r, const StackRankIo& io, int64_t passes,
                 size_t& layer_bytes, size_t& context_bytes, size_t& gpu_used, std::vector<double>& fwd, std::vector<double>& bwd) {
  std::vector<ForwardContext> ctx(stack.size());
  cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};
  Status st = Status::Ok();
  for (auto& e : ev)
    if (st.ok() && cudaEventCreate(&e) != cudaSuccess) st = InternalError("rdep bench layer --layers: cudaEventCreate failed");
  if (st.ok()) st = StackMemory(stack, ctx, domain, r, io, layer_bytes, context_bytes, gpu_used);
  for (int64_t p = 0; st.ok() && p < passes; ++p) {
    double f = 0, b = 0;
    st = StackPass(domain, stack, ctx, r, io, ev, f, b);
    fwd.push_back(f);
    bwd.push_back(b);
  }
  for (auto e : ev)
    if (e) cudaEventDestroy(e);
  return st;
}

}  // namespace

StatusOr<StackResult> RunLayerStack(CudaDomain& domain, CudaMoELayer& first, const LayerConfig& cfg, const OwnershipMap& ownership,
                                    uint64_t seed, int32_t layers, int64_t passes, const std::vector<StackRankIo>& io) {
  if (layers < 1) return InvalidArgument("--layers must be >= 1, got " + std::to_string(layers));
  if (passes < 1) return InvalidArgument("stack passes must be >= 1, got " + std::to_string(passes));
  std::vector<std::unique_ptr<CudaMoELayer>> more;
  std::vector<CudaMoELayer*> stack{&first};
  MoEWeights weights = RandomWeights(cfg.shape, seed);
  weights.gate_up = cfg.gate_up;  // i.i.d. draws, read in the layer's layout (as SetupLayerBench)
  for (int32_t l = 1; l < layers; ++l) {
    RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(domain, cfg, ownership, weights));
    stack.push_back(layer.get());
    more.push_back(std::move(layer));
  }
  const size_t W = io.size();
  std::vector<std::vector<double>> fwd(W), bwd(W);
  std::vector<size_t> lb(W, 0), cb(W, 0), used(W, 0);
  RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
    const auto sr = static_cast<size_t>(r);
    return StackRank(domain, stack, r, io[sr], passes, lb[sr], cb[sr], used[sr], fwd[sr], bwd[sr]);
  }));
  StackResult res;
  res.layers = layers;
  res.passes = passes;
  res.layer_bytes_max_rank = *std::max_element(lb.begin(), lb.end());
  res.context_bytes_max_rank = *std::max_element(cb.begin(), cb.end());
  res.gpu_used_max = *std::max_element(used.begin(), used.end());
  res.forward_ms = Percentile(MaxOverRanks(fwd), 50);
  res.backward_ms = Percentile(MaxOverRanks(bwd), 50);
  return res;
}

void PrintLayerStack(const StackResult& r) {
  constexpr double kGiB = 1 << 30;
  std::printf("  stack of %d layers on one domain (a context each; forward 1..%d, then backward %d..1):\n", r.layers, r.layers,
              r.layers);
  std::printf("    per rank (max): layers (their own contexts included) %.3f GiB + contexts after the forwards %.3f GiB = %.3f GiB; GPU memory in use "
              "(cudaMemGetInfo, max over GPUs) %.3f GiB\n",
              static_cast<double>(r.layer_bytes_max_rank) / kGiB, static_cast<double>(r.context_bytes_max_rank) / kGiB,
              static_cast<double>(r.layer_bytes_max_rank + r.context_bytes_max_rank) / kGiB, static_cast<double>(r.gpu_used_max) / kGiB);
  std::printf("    one pass (p50 over %lld passes of the max over ranks): forwards %.3f ms, backwards %.3f ms\n",
              static_cast<long long>(r.passes), r.forward_ms, r.backward_ms);
}

void WriteLayerStack(JsonWriter& j, const StackResult& r) {
  j.key("stack").begin_object().field("layers", static_cast<int64_t>(r.layers));
  j.field("layer_bytes_max_rank", static_cast<int64_t>(r.layer_bytes_max_rank));
  j.field("context_bytes_max_rank", static_cast<int64_t>(r.context_bytes_max_rank));
  j.field("gpu_used_bytes_max", static_cast<int64_t>(r.gpu_used_max));
  j.field("passes", r.passes).field("forward_p50_ms", r.forward_ms).field("backward_p50_ms", r.backward_ms).end_object();
}

}  // namespace rdep::bench
#endif  // RDEP_HAVE_CUDA
