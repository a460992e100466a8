// Training steps of a stack of MoE layers on all local GPUs (CUDA backend, one process, one rank per
// GPU). Each of the L blocks is
//
//   logits_l = x_l · Wr_l                      dense router weight Wr_l [H][E], replicated on every rank
//   (experts_l, gates_l) = top-K softmax(logits_l)             GPU router (rdep/router/gpu_router.h)
//   y_l = MoE_l(x_l; experts_l, gates_l)       CudaMoELayer: dispatch -> expert SwiGLU -> combine
//   x_{l+1} = x_l + y_l                        residual
//
// and the loss of rank r is 0.5 ||x_L - target_r||^2 (each rank computes its own; the printed loss is
// the sum over ranks). Backward runs down the stack: g_L = x_L - target, then per layer
// Backward(g_{l+1}) -> dx_l and g_l = g_{l+1} + dx_l (the residual). Then one SGD step on every
// rank's own experts.
//
// What this example simplifies, on purpose:
//   * The router is frozen and routing is a stop-gradient: dgates from Backward are computed but not
//     propagated (no softmax Jacobian, no dWr, no x -> logits -> gates path into dx). The math for a
//     trainable router is in src/router/router.cc.
//   * A .cc example has no kernels of its own, so the dense glue runs through cuBLAS: the router GEMM is
//     cublasGemmEx (bf16 x bf16 -> fp32 logits, fp32 accumulate; Wr is kept in fp32 on the host and
//     replicated to every GPU as bf16, because cuBLAS wants A and B of one type and x is bf16), the
//     residual adds are cublasAxpyEx (bf16 in/out, fp32 math). The residual stream is bf16.
//   * The loss head runs on the host: per step each rank copies x_L [T][H] down, computes its loss
//     and g_L = x_L - target in fp32, and copies g_L back (T*H*4 bytes of traffic per rank per step).
//   * Weight update. By default CudaMoELayer::ApplySgd steps each layer's bf16 expert weights in
//     place from dw1/dw2, right after that layer's Backward (no fp32 master copy: an update smaller
//     than half a bf16 ulp of a weight is lost). --update rebuild instead keeps fp32 master weights on
//     the host, applies SGD to them from dw1/dw2 and rebuilds every layer after each step — a
//     cross-check of the in-place path, slow, and every rebuild allocates new symmetric regions
//     (CudaDomain cannot free one), so device memory grows per step. Use it for short runs only.
//   * The loss is a sum over T*H elements, so the stable learning rate falls as the rows per expert
//     (W*T*K/E) grow; the default 1e-5 is stable for 1 to 8 GPUs at the default shape.
//
// Printed per step: the loss (sum over ranks of each rank's loss, of the forward before the update),
// the step time (max over ranks of the host wall time from a start barrier to the end of the rank's
// SGD), and, in rebuild mode, the rebuild time. Exits non-zero if the final loss is not below the
// first, or on any error; exits 0 with a message when there is no CUDA device.
//
// Run (after building the target moe_stack_training):
//   build/examples/moe_stack_training                       # all local GPUs (at most 8), defaults below
//   build/examples/moe_stack_training --ranks 2 --layers 2 --steps 20 --tokens 1024 --lr 5e-6
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "rdep/core/ownership.h"
#include "rdep/core/random.h"
#include "rdep/core/reference.h"  // MoEWeights, RandomWeights
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/layer/layer_config.h"
#include "rdep/router/gpu_router.h"
#include "rdep/status.h"
#include "rdep/transport/cuda_domain.h"

namespace {

using rdep::Status;
using rdep::StatusOr;

enum class UpdateMode { kInPlace, kRebuild };

struct Options {
  int64_t layers = 4;
  int64_t steps = 10;
  int64_t ranks = 0;  // 0: all local GPUs, at most 8
  int64_t tokens = 512;
  int64_t hidden = 256;
  int64_t ffn = 512;
  int64_t experts = 16;
  int64_t topk = 2;
  double lr = 1e-5;
  double target_noise = 0.1;  // target = x_0 + target_noise * N(0, 1)
  uint64_t seed = 1;
  UpdateMode update = UpdateMode::kInPlace;
};

constexpr const char* kUsage =
    "usage: moe_stack_training [--layers L] [--steps N] [--ranks W] [--tokens T] [--hidden H] [--ffn F]\n"
    "                          [--experts E] [--topk K] [--lr LR] [--seed S] [--update inplace|rebuild]\n"
    "defaults: --layers 4 --steps 10 --ranks <all local GPUs, at most 8> --tokens 512 --hidden 256 --ffn 512\n"
    "          --experts 16 --topk 2 --lr 1e-5 --seed 1 --update inplace\n";

StatusOr<Options> ParseFlags(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i], value;
    if (name == "-h" || name == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (name.rfind("--", 0) != 0) return rdep::InvalidArgument("unexpected argument '" + name + "'");
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return rdep::InvalidArgument("flag " + name + " needs a value");
    }
    auto as_int = [&](int64_t& out) -> Status {
      char* end = nullptr;
      const long long v = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0') return rdep::InvalidArgument(name + ": not an integer: '" + value + "'");
      out = v;
      return Status::Ok();
    };
    if (name == "--layers") RDEP_RETURN_IF_ERROR(as_int(o.layers));
    else if (name == "--steps") RDEP_RETURN_IF_ERROR(as_int(o.steps));
    else if (name == "--ranks") RDEP_RETURN_IF_ERROR(as_int(o.ranks));
    else if (name == "--tokens") RDEP_RETURN_IF_ERROR(as_int(o.tokens));
    else if (name == "--hidden") RDEP_RETURN_IF_ERROR(as_int(o.hidden));
    else if (name == "--ffn") RDEP_RETURN_IF_ERROR(as_int(o.ffn));
    else if (name == "--experts") RDEP_RETURN_IF_ERROR(as_int(o.experts));
    else if (name == "--topk") RDEP_RETURN_IF_ERROR(as_int(o.topk));
    else if (name == "--seed") {
      int64_t s = 0;
      RDEP_RETURN_IF_ERROR(as_int(s));
      o.seed = static_cast<uint64_t>(s);
    } else if (name == "--lr") {
      char* end = nullptr;
      o.lr = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(o.lr > 0) || !std::isfinite(o.lr))
        return rdep::InvalidArgument("--lr: need a positive number, got '" + value + "'");
    } else if (name == "--update") {
      if (value == "inplace") o.update = UpdateMode::kInPlace;
      else if (value == "rebuild") o.update = UpdateMode::kRebuild;
      else return rdep::InvalidArgument("--update: inplace or rebuild, got '" + value + "'");
    } else {
      return rdep::InvalidArgument("unknown flag " + name + "\n" + kUsage);
    }
  }
  if (o.layers < 1) return rdep::InvalidArgument("--layers must be >= 1");
  if (o.steps < 2) return rdep::InvalidArgument("--steps must be >= 2 (the run checks that the loss falls)");
  if (o.ranks < 0 || o.ranks > 8) return rdep::InvalidArgument("--ranks must be in [1, 8] (0 = all local GPUs)");
  return o;
}

Status CublasStatus(cublasStatus_t s, const char* expr, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Status(rdep::StatusCode::kCudaError, std::string(expr) + " failed at " + file + ":" + std::to_string(line) +
                                                  ": " + cublasGetStatusString(s));
}
#define EXAMPLE_CUBLAS_RETURN_IF_ERROR(expr) RDEP_RETURN_IF_ERROR(CublasStatus((expr), #expr, __FILE__, __LINE__))

// Device memory of one rank. Layouts are row-major.
struct RankState {
  cublasHandle_t blas = nullptr;
  std::vector<__nv_bfloat16*> router_w;  // [L] Wr_l [H][E], bf16 copy of the replicated fp32 weight
  std::vector<__nv_bfloat16*> x;         // [L+1] residual stream x_l [T][H]
  std::vector<float*> logits;            // [L] [T][E]
  std::vector<int32_t*> experts;         // [L] [T][K]
  std::vector<float*> gates, dgates;     // [L] [T][K]
  __nv_bfloat16* y = nullptr;            // [T][H] output of the current layer
  __nv_bfloat16* grad = nullptr;         // [T][H] dL/dx_l while walking down the stack
  __nv_bfloat16* dx = nullptr;           // [T][H] the current layer's dx
  std::vector<float> target;             // host [T][H]
  std::vector<uint16_t> staging;         // host [T][H] bf16 bits: x_L down, g_L up
  std::vector<float> dw_host;            // host scratch for the rebuild update
  double loss = 0, step_ms = 0;

  std::vector<void*> allocations;
  template <typename T>
  Status Alloc(T** p, size_t count) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(p), std::max<size_t>(count, 1) * sizeof(T)));
    allocations.push_back(*p);
    return Status::Ok();
  }
  void Free() {
    for (void* p : allocations) cudaFree(p);
    allocations.clear();
    if (blas) cublasDestroy(blas);
    blas = nullptr;
  }
};

std::vector<uint16_t> ToBf16Bits(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = rdep::FloatToBf16Bits(v[i]);
  return b;
}

// w[e] -= lr * dw for every expert e of `rank` (dw: the rank's local experts, in local order).
void HostSgd(const rdep::OwnershipMap& own, int32_t rank, const std::vector<float>& dw, size_t per_expert, float lr,
             std::vector<float>& w) {
  for (int32_t j = 0; j < own.num_local(rank); ++j) {
    float* dst = w.data() + static_cast<size_t>(own.global_expert(rank, j)) * per_expert;
    const float* src = dw.data() + static_cast<size_t>(j) * per_expert;
    for (size_t i = 0; i < per_expert; ++i) dst[i] -= lr * src[i];
  }
}

int Fail(const Status& s) {
  std::fprintf(stderr, "moe_stack_training: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  auto parsed = ParseFlags(argc, argv);
  if (!parsed.ok()) return Fail(parsed.status());
  Options opt = *parsed;

  const int num_devices = rdep::cuda::DeviceCount();
  if (num_devices == 0) {
    std::printf("moe_stack_training: no CUDA device; nothing to run (skipped)\n");
    return 0;
  }
  if (opt.ranks == 0) opt.ranks = std::min(num_devices, 8);
  if (opt.ranks > num_devices)
    return Fail(rdep::InvalidArgument("--ranks " + std::to_string(opt.ranks) + " but only " +
                                      std::to_string(num_devices) + " CUDA devices"));
  const bool in_place = opt.update == UpdateMode::kInPlace;

  rdep::LayerConfig cfg;
  cfg.shape = {.tokens = opt.tokens, .hidden = opt.hidden, .ffn = opt.ffn, .experts = opt.experts, .topk = opt.topk,
               .ranks = opt.ranks};
  if (Status s = cfg.Validate(); !s.ok()) return Fail(s);
  rdep::kernels::GpuRouterDesc router;
  router.num_experts = opt.experts;
  router.topk = opt.topk;
  router.score = rdep::kernels::RouterScore::kSoftmax;
  router.normalize_topk = true;
  if (Status s = router.Validate(); !s.ok()) return Fail(s);

  const auto L = static_cast<size_t>(opt.layers), W = static_cast<size_t>(opt.ranks);
  const auto T = static_cast<size_t>(opt.tokens), H = static_cast<size_t>(opt.hidden);
  const auto E = static_cast<size_t>(opt.experts), K = static_cast<size_t>(opt.topk);
  const auto lr = static_cast<float>(opt.lr);
  {
    std::ostringstream layer_desc, router_desc;
    layer_desc << cfg;
    router_desc << router;
    std::printf("moe_stack_training: %zu layers of %s\n  router: %s (frozen)\n  update: %s, lr %g, %lld steps\n", L,
                layer_desc.str().c_str(), router_desc.str().c_str(),
                in_place ? "in place (CudaMoELayer::ApplySgd)" : "host fp32 master weights + layer rebuild", opt.lr,
                static_cast<long long>(opt.steps));
  }

  auto domain_or = rdep::CudaDomain::CreateSingleProcess(opt.ranks);
  if (!domain_or.ok()) return Fail(domain_or.status());
  rdep::CudaDomain& domain = **domain_or;
  auto own_or = rdep::OwnershipMap::Contiguous(opt.experts, opt.ranks);
  if (!own_or.ok()) return Fail(own_or.status());
  const rdep::OwnershipMap& own = *own_or;

  // Expert weights (fp32 masters on the host: the layers' initial values, and the rebuild path's
  // state) and the replicated router weights Wr_l ~ N(0, 1/H), so that logits are ~ N(0, 1).
  std::vector<rdep::MoEWeights> master(L);
  std::vector<std::vector<float>> router_w(L, std::vector<float>(H * E));
  for (size_t l = 0; l < L; ++l) {
    master[l] = rdep::RandomWeights(cfg.shape, opt.seed * 1000 + l);
    rdep::Rng rng(opt.seed, 3000 + l);
    for (float& v : router_w[l]) v = static_cast<float>(rng.normal() / std::sqrt(static_cast<double>(H)));
  }
  std::vector<std::unique_ptr<rdep::CudaMoELayer>> layers(L);
  auto build_layers = [&]() -> Status {
    for (size_t l = 0; l < L; ++l) {
      layers[l].reset();  // free the old layer's private buffers first
      RDEP_ASSIGN_OR_RETURN(layers[l], rdep::CudaMoELayer::Create(domain, cfg, own, master[l]));
    }
    return Status::Ok();
  };
  if (Status s = build_layers(); !s.ok()) return Fail(s);

  // Per-rank buffers, inputs x_0 ~ N(0, 1) and targets x_0 + noise * N(0, 1), seeded per rank.
  std::vector<RankState> ranks(W);
  Status st = domain.Run([&](int32_t r) -> Status {
    RankState& rs = ranks[static_cast<size_t>(r)];
    const cudaStream_t stream = domain.stream(r);
    EXAMPLE_CUBLAS_RETURN_IF_ERROR(cublasCreate(&rs.blas));
    EXAMPLE_CUBLAS_RETURN_IF_ERROR(cublasSetStream(rs.blas, stream));
    rs.router_w.resize(L);
    rs.x.resize(L + 1);
    rs.logits.resize(L);
    rs.experts.resize(L);
    rs.gates.resize(L);
    rs.dgates.resize(L);
    for (size_t l = 0; l < L; ++l) {
      RDEP_RETURN_IF_ERROR(rs.Alloc(&rs.router_w[l], H * E));
      RDEP_RETURN_IF_ERROR(rs.Alloc(&rs.logits[l], T * E));
      RDEP_RETURN_IF_ERROR(rs.Alloc(&rs.experts[l], T * K));
      RDEP_RETURN_IF_ERROR(rs.Alloc(&rs.gates[l], T * K));
      RDEP_RETURN_IF_ERROR(rs.Alloc(&rs.dgates[l], T * K));
      const std::vector<uint16_t> wr = ToBf16Bits(router_w[l]);
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(rs.router_w[l], wr.data(), wr.size() * 2, cudaMemcpyHostToDevice, stream));
      RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));  // wr is about to go out of scope
    }
    for (auto& xl : rs.x) RDEP_RETURN_IF_ERROR(rs.Alloc(&xl, T * H));
    RDEP_RETURN_IF_ERROR(rs.Alloc(&rs.y, T * H));
    RDEP_RETURN_IF_ERROR(rs.Alloc(&rs.grad, T * H));
    RDEP_RETURN_IF_ERROR(rs.Alloc(&rs.dx, T * H));
    std::vector<float> x0(T * H);
    rs.target.resize(T * H);
    rdep::Rng rx(opt.seed, 1000 + static_cast<uint64_t>(r)), rt(opt.seed, 2000 + static_cast<uint64_t>(r));
    for (size_t i = 0; i < x0.size(); ++i) {
      x0[i] = rdep::RoundToBf16(static_cast<float>(rx.normal()));
      rs.target[i] = x0[i] + static_cast<float>(opt.target_noise * rt.normal());
    }
    rs.staging = ToBf16Bits(x0);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(rs.x[0], rs.staging.data(), T * H * 2, cudaMemcpyHostToDevice, stream));
    return domain.Synchronize(r);
  });
  if (!st.ok()) return Fail(st);

  // One training step of rank r.
  auto step_fn = [&](int32_t r) -> Status {
    RankState& rs = ranks[static_cast<size_t>(r)];
    const cudaStream_t stream = domain.stream(r);
    const auto n = static_cast<int64_t>(T);
    const float one = 1.0f, zero = 0.0f;
    RDEP_RETURN_IF_ERROR(domain.Barrier(r, rdep::Phase::kTest));  // ranks start the step together
    RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
    const auto t0 = std::chrono::steady_clock::now();

    // Forward down the stack.
    for (size_t l = 0; l < L; ++l) {
      // logits [T][E] = x_l [T][H] · Wr_l [H][E]; column-major, that is logits^T = Wr_l^T · x_l^T.
      EXAMPLE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(rs.blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(E),
                                                  static_cast<int>(T), static_cast<int>(H), &one, rs.router_w[l],
                                                  CUDA_R_16BF, static_cast<int>(E), rs.x[l], CUDA_R_16BF,
                                                  static_cast<int>(H), &zero, rs.logits[l], CUDA_R_32F,
                                                  static_cast<int>(E), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      RDEP_RETURN_IF_ERROR(rdep::kernels::LaunchRouterTopK(router, rs.logits[l], n, nullptr, rs.experts[l],
                                                           rs.gates[l], nullptr, stream));
      RDEP_RETURN_IF_ERROR(layers[l]->Forward(r, rs.experts[l], rs.gates[l], n, rs.x[l], rs.y));
      // x_{l+1} = x_l + y_l
      RDEP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(rs.x[l + 1], rs.x[l], T * H * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, stream));
      EXAMPLE_CUBLAS_RETURN_IF_ERROR(cublasAxpyEx(rs.blas, static_cast<int>(T * H), &one, CUDA_R_32F, rs.y,
                                                  CUDA_R_16BF, 1, rs.x[l + 1], CUDA_R_16BF, 1, CUDA_R_32F));
    }

    // Loss head on the host: loss = 0.5 |x_L - target|^2, g_L = x_L - target.
    RDEP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(rs.staging.data(), rs.x[L], T * H * 2, cudaMemcpyDeviceToHost, stream));
    RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
    double loss = 0;
    for (size_t i = 0; i < T * H; ++i) {
      const float d = rdep::Bf16BitsToFloat(rs.staging[i]) - rs.target[i];
      loss += 0.5 * static_cast<double>(d) * d;
      rs.staging[i] = rdep::FloatToBf16Bits(d);
    }
    rs.loss = loss;
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(rs.grad, rs.staging.data(), T * H * 2, cudaMemcpyHostToDevice, stream));

    // Backward up the stack; each layer steps as soon as its gradients are final.
    for (size_t l = L; l-- > 0;) {
      RDEP_RETURN_IF_ERROR(layers[l]->Backward(r, rs.grad, rs.dx, rs.dgates[l]));  // dgates unused: frozen router
      if (l > 0)  // g_l = g_{l+1} + dx_l (residual)
        EXAMPLE_CUBLAS_RETURN_IF_ERROR(cublasAxpyEx(rs.blas, static_cast<int>(T * H), &one, CUDA_R_32F, rs.dx,
                                                    CUDA_R_16BF, 1, rs.grad, CUDA_R_16BF, 1, CUDA_R_32F));
      if (in_place) {
        RDEP_RETURN_IF_ERROR(layers[l]->ApplySgd(r, lr));
      } else {  // host fp32 masters: this rank's experts only, so ranks write disjoint slices
        RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
        const size_t n1 = master[l].w1_per_expert(), n2 = master[l].w2_per_expert();
        const auto nl = static_cast<size_t>(own.num_local(r));
        rs.dw_host.resize(nl * std::max(n1, n2));
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(rs.dw_host.data(), layers[l]->dw1(r), nl * n1 * 4, cudaMemcpyDeviceToHost));
        HostSgd(own, r, rs.dw_host, n1, lr, master[l].w1);
        RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(rs.dw_host.data(), layers[l]->dw2(r), nl * n2 * 4, cudaMemcpyDeviceToHost));
        HostSgd(own, r, rs.dw_host, n2, lr, master[l].w2);
      }
    }
    RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
    rs.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return Status::Ok();
  };

  std::vector<double> losses;
  for (int64_t step = 0; step < opt.steps; ++step) {
    if (Status s = domain.Run(step_fn); !s.ok()) return Fail(s);
    double loss = 0, step_ms = 0;
    for (const RankState& rs : ranks) {
      loss += rs.loss;
      step_ms = std::max(step_ms, rs.step_ms);
    }
    if (!std::isfinite(loss)) return Fail(rdep::InternalError("loss is not finite at step " + std::to_string(step)));
    losses.push_back(loss);
    std::printf("step %3lld  loss %.6e  step %.3f ms (max over %zu ranks)", static_cast<long long>(step), loss,
                step_ms, W);
    if (!in_place) {
      const auto t0 = std::chrono::steady_clock::now();
      if (Status s = build_layers(); !s.ok()) return Fail(s);
      std::printf("  rebuild %.1f ms",
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::printf("\n");
  }

  st = domain.Run([&](int32_t r) -> Status {
    ranks[static_cast<size_t>(r)].Free();
    return Status::Ok();
  });
  if (!st.ok()) return Fail(st);
  layers.clear();

  const double first = losses.front(), last = losses.back();
  std::printf("loss %.6e -> %.6e (%+.2f%%) over %lld steps\n", first, last, 100.0 * (last - first) / first,
              static_cast<long long>(opt.steps));
  if (!(last < first)) {
    std::fprintf(stderr, "moe_stack_training: FAILED: the loss did not decrease (try a smaller --lr)\n");
    return 1;
  }
  return 0;
}
