// The router on the GPU: fp32 logits [n][E] -> scores (softmax or sigmoid) -> (group-limited) top-K
// -> gates, plus an optional per-expert histogram. The same semantics as the host reference
// rdep::Route (include/rdep/router/router.h) without Sinkhorn or the losses:
//
//   s_t      = softmax(l_t) or sigmoid(l_t)
//   sel_t,e  = s_t,e + b_e                   (b: optional aux-loss-free bias, selection only)
//   mask     = keep topk_groups of num_groups contiguous groups ranked by the sum of their top-2 sel,
//              then max_nodes of the nodes (node_of_expert) ranked by the sum of their top-2 unmasked sel
//   I_t      = top-K of sel over the unmasked experts, descending; ties go to the lower expert id
//              (and, for groups and nodes, to the lower group or node id)
//   g_t,k    = c * s_t,I_k / sum_j s_t,I_j   (normalize_topk)   or   c * s_t,I_k
//
// Precision. With fp64_scores (the default) the scores, selection keys and gates are computed in
// double exactly as the host does, so experts agree with rdep::Route bit for bit except where two
// double values differ in their last ulp, and gates agree to the fp32 rounding. With fp64_scores off
// everything is fp32; without a bias the selection then ranks the logits themselves (the same order
// as the scores, immune to fp32 saturation), with a bias it ranks fp32 s + b, which can order
// near-ties (relative gap ~1e-7) differently from the host.
//
// One warp per token (a persistent grid-stride loop); a lane holds experts lane + 32*j; top-K is K
// rounds of a warp argmax on order-preserving integer keys (redux.sync max/min, sm_80+). Logits must
// be finite (the host Route rejects others; here the result for a non-finite row is unspecified).
// The launch is asynchronous, never synchronizes, allocates nothing, and is CUDA-graph safe.
//
// Exercised by src/router/gpu_router_test.cc (build target router_kernel_test).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <ostream>

#include "rdep/status.h"

#if __cplusplus >= 202002L
#include "rdep/router/router.h"  // C++20 only: for FromRouterConfig (device code builds as C++17)
#endif

namespace rdep::kernels {

inline constexpr int64_t kMaxRouterExperts = 512;  // a lane holds at most 16 experts
inline constexpr int64_t kMaxRouterTopK = 16;
inline constexpr int64_t kMaxRouterGroups = 32;  // a lane holds at most one group
inline constexpr int64_t kMaxRouterNodes = 32;   // a lane scores at most one node

// Mirrors rdep::ScoreFunction (router.h is C++20 and cannot be included by device code).
enum class RouterScore { kSoftmax, kSigmoid };

struct GpuRouterDesc {
  int64_t num_experts = 0;  // E, in [1, 512]
  int64_t topk = 0;         // K, in [1, min(E, 16)]
  RouterScore score = RouterScore::kSoftmax;
  bool normalize_topk = true;   // gates of a token renormalized to sum to 1 before scaling
  double scaling_factor = 1.0;  // c: multiplies every gate (finite, > 0)
  // Group-limited top-k: E split into num_groups contiguous groups, topk_groups of them kept.
  // num_groups = 1 disables it; num_groups <= 32 and must divide E; K <= topk_groups * E/num_groups.
  int64_t num_groups = 1;
  int64_t topk_groups = 1;
  // Node-limited routing (seeds 004): a token keeps the experts of max_nodes of the num_nodes nodes.
  // num_nodes = 0 disables it; num_nodes <= 32. node_of_expert is a device array [E] of node ids in
  // [0, num_nodes) the caller uploads (the launch refuses a null one); the kept nodes must hold at
  // least K experts (rdep::RouterConfig::Validate checks that on the host).
  int64_t num_nodes = 0;
  int64_t max_nodes = 0;
  const int32_t* node_of_expert = nullptr;
  bool fp64_scores = true;  // see "Precision" above

  Status Validate() const;
};

std::ostream& operator<<(std::ostream& os, const GpuRouterDesc& d);

// Routes num_tokens tokens on `stream`. Layouts (row-major, device pointers):
//   logits            [num_tokens][E] fp32
//   bias              [E] fp32 or nullptr (added to the scores for selection only)
//   experts           [num_tokens][K] int32, descending selection score
//   gates             [num_tokens][K] fp32
//   tokens_per_expert [E] int32 or nullptr; overwritten (zeroed on the stream, then counted)
// num_tokens may be 0 (then only tokens_per_expert is zeroed). Returns kInvalidArgument for a
// description or pointer the kernel cannot take, kCudaError for a failed launch.
Status LaunchRouterTopK(const GpuRouterDesc& desc, const float* logits, int64_t num_tokens, const float* bias,
                        int32_t* experts, float* gates, int32_t* tokens_per_expert, cudaStream_t stream);

#if __cplusplus >= 202002L
// The GPU description of a host router configuration; Sinkhorn has no GPU form here and is rejected
// (losses: the caller computes them elsewhere, so a config with loss coefficients is accepted and the
// coefficients ignored). Node-limited routing: the description carries num_nodes and max_nodes; the
// caller uploads c.node_of_expert and sets node_of_expert to the device copy.
inline StatusOr<GpuRouterDesc> FromRouterConfig(const RouterConfig& c) {
  if (c.sinkhorn) return InvalidArgument("gpu router: Sinkhorn routing is not supported");
  GpuRouterDesc d;
  d.num_experts = c.num_experts;
  d.topk = c.topk;
  d.score = c.score_function == ScoreFunction::kSoftmax ? RouterScore::kSoftmax : RouterScore::kSigmoid;
  d.normalize_topk = c.normalize_topk;
  d.scaling_factor = c.scaling_factor;
  d.num_groups = c.num_groups;
  d.topk_groups = c.topk_groups;
  if (c.max_nodes > 0) {
    d.num_nodes = c.num_nodes();
    d.max_nodes = c.max_nodes;
    for (int32_t n : c.node_of_expert)
      if (n >= d.num_nodes)
        return InvalidArgument("gpu router: node ids must be 0..N-1 without gaps; node " + std::to_string(n) + " with " +
                               std::to_string(d.num_nodes) + " distinct nodes");
  }
  RDEP_RETURN_IF_ERROR(d.Validate());
  return d;
}
#endif

}  // namespace rdep::kernels
