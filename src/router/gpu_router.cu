// The GPU router (see include/rdep/router/gpu_router.h): one warp per token, softmax/sigmoid scores,
// optional group limit, top-K by K rounds of a warp argmax, gates, and a block-local histogram.
// Any change to the tie-breaking or the arithmetic of the host router (src/router/router.cc) must be
// mirrored here; router_kernel_test (GpuRouter.*) checks the two against each other.
// status.h's StatusOr assigns a Status in a constructor, which nvcc's front end flags (#2810) because
// Status is [[nodiscard]]; the host compilers do not.
#pragma nv_diag_suppress 2810
#include "rdep/router/gpu_router.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "rdep/cuda/check.h"
#include "launch/pdl.h"

namespace rdep::kernels {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;

struct Params {
  const float* logits;          // [n][E]
  const float* bias;            // [E] or nullptr
  int32_t* experts;             // [n][K]
  float* gates;                 // [n][K]
  int32_t* tokens_per_expert;   // [E] or nullptr (zeroed by the launcher)
  int64_t num_tokens;
  int num_experts;
  int topk;
  int num_groups;   // 1 = no group limit
  int group_size;   // E / num_groups
  int topk_groups;
  int num_nodes;                 // node-limited routing: 0 = off
  int max_nodes;                 // M nodes kept per token
  const int32_t* node_of_expert;  // [E] node of each expert (device)
  bool softmax;
  bool normalize;
  bool logit_keys;  // rank the logits themselves (fp32, no bias, no groups or nodes: the same order as the scores)
  double scaling_factor;
};

template <typename T>
__device__ __forceinline__ T Exp(T x);
template <>
__device__ __forceinline__ float Exp<float>(float x) { return expf(x); }
template <>
__device__ __forceinline__ double Exp<double>(double x) { return exp(x); }

// exp(l - max) in Acc (the difference of two floats is exact in double, as on the host).
template <typename Acc>
__device__ __forceinline__ Acc SoftmaxNumerator(float l, float mx) {
  return Exp<Acc>(static_cast<Acc>(l) - static_cast<Acc>(mx));
}

// The score of one expert: exp(l - max) / sum (softmax) or 1 / (1 + exp(-l)) (sigmoid). Always the
// same arithmetic for the same logit, so a recomputed score equals the one that was ranked.
template <typename Acc>
__device__ __forceinline__ Acc ScoreOf(bool softmax, float l, float mx, Acc sum) {
  if (softmax) return SoftmaxNumerator<Acc>(l, mx) / sum;
  return Acc(1) / (Acc(1) + Exp<Acc>(-static_cast<Acc>(l)));
}

template <typename T>
__device__ __forceinline__ T NegInf() { return -static_cast<T>(INFINITY); }

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

// Order-preserving maps of keys to unsigned integers: a > b  <=>  Bits(a) > Bits(b), and -0 == +0
// (x + 0 turns -0 into +0). Every finite key maps above 0, so 0 marks a taken, masked or padding expert.
__device__ __forceinline__ uint32_t OrderedBits(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ uint64_t OrderedBits(double f) {
  const auto u = static_cast<uint64_t>(__double_as_longlong(f + 0.0));
  return (u >> 63) != 0 ? ~u : (u | (1ull << 63));
}

template <typename Acc>
using KeyBits = std::conditional_t<std::is_same_v<Acc, double>, uint64_t, uint32_t>;

// Warp maximum with the sm_80+ redux instruction (32 bits at a time).
__device__ __forceinline__ uint32_t WarpMaxBits(uint32_t v) { return __reduce_max_sync(kFullMask, v); }
__device__ __forceinline__ uint64_t WarpMaxBits(uint64_t v) {
  const auto v_hi = static_cast<uint32_t>(v >> 32);
  const uint32_t hi = __reduce_max_sync(kFullMask, v_hi);
  const uint32_t lo = __reduce_max_sync(kFullMask, v_hi == hi ? static_cast<uint32_t>(v) : 0u);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Every lane offers (bits, idx) with distinct idx; returns, on every lane, the idx of the largest bits,
// the lowest idx among equal bits (the host's tie rule).
template <typename Bits>
__device__ __forceinline__ int WarpArgMax(Bits bits, int idx) {
  const Bits best = WarpMaxBits(bits);
  return static_cast<int>(__reduce_min_sync(kFullMask, bits == best ? static_cast<uint32_t>(idx) : 0xFFFFFFFFu));
}

// Keeps `keep` of the warp's sets (lane s < num_sets offers set s with `score`), best first, ties to
// the lower set id, as the host's KeepBestSets does; true on the lanes whose set is kept.
template <typename Acc>
__device__ __forceinline__ bool KeepBestLanes(Acc score, int num_sets, int keep, int lane) {
  using Bits = KeyBits<Acc>;
  bool kept = false;
  for (int r = 0; r < keep; ++r) {
    const Bits bits = lane < num_sets && !kept ? OrderedBits(score) : Bits(0);
    if (lane == WarpArgMax(bits, lane)) kept = true;
  }
  return kept;
}

// Keeps the two largest values offered in a >= b.
template <typename Acc>
__device__ __forceinline__ void TopTwo(Acc v, Acc& a, Acc& b) {
  if (v > a) {
    b = a;
    a = v;
  } else if (v > b) {
    b = v;
  }
}

// Lane `lane` of a warp holds experts e = lane + 32*j, j < kVpt (coalesced row loads). Keys are kept
// as OrderedBits; padding (e >= E), masked and taken experts carry 0, and K <= unmasked experts, so
// they are never chosen.
//
// Dynamic shared memory, in this order:
//   keys  Acc[kWarpsPerBlock][E]   only with kLimited (groups or nodes): a warp's selection keys, for
//                                  the set scans (-inf once an expert is masked by the group limit)
//   hist  int32[E]                 only with tokens_per_expert: the block's histogram
template <int kVpt, typename Acc, bool kLimited>
__global__ void __launch_bounds__(kThreads, 1) RouterTopKKernel(const Params p) {
  cuda::WaitForPrimaryGrid();
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int num_e = p.num_experts, k = p.topk;
  Acc* warp_keys = reinterpret_cast<Acc*>(smem) + static_cast<size_t>(warp) * num_e;
  int32_t* hist = reinterpret_cast<int32_t*>(smem + (kLimited ? sizeof(Acc) * kWarpsPerBlock * num_e : 0));
  const bool count = p.tokens_per_expert != nullptr;
  if (count) {
    for (int i = static_cast<int>(threadIdx.x); i < num_e; i += kThreads) hist[i] = 0;
    __syncthreads();
  }

  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; t < p.num_tokens; t += warps_total) {
    const float* row = p.logits + t * num_e;
    // l: the logits; key: the selection keys. The scores themselves are not kept: the score of a
    // chosen expert is recomputed from its logit by the same arithmetic (ScoreOf), which saves registers.
    using Bits = KeyBits<Acc>;
    float l[kVpt];
    Bits key[kVpt];
#pragma unroll
    for (int j = 0; j < kVpt; ++j) {
      const int e = lane + kWarpSize * j;
      l[j] = e < num_e ? __ldg(row + e) : -INFINITY;
    }

    // Scores, as the host computes them: exp(l - max) / sum, or 1 / (1 + exp(-l)).
    float mx = 0.0f;
    Acc sum = 1;
    if (p.softmax) {
      mx = l[0];
#pragma unroll
      for (int j = 1; j < kVpt; ++j) mx = fmaxf(mx, l[j]);
      mx = WarpMax(mx);
      sum = 0;
#pragma unroll
      for (int j = 0; j < kVpt; ++j) sum += lane + kWarpSize * j < num_e ? SoftmaxNumerator<Acc>(l[j], mx) : Acc(0);
      sum = WarpSum(sum);
    }
#pragma unroll
    for (int j = 0; j < kVpt; ++j) {
      const int e = lane + kWarpSize * j;
      if (e >= num_e) {
        key[j] = 0;
      } else if (p.logit_keys) {
        key[j] = OrderedBits(static_cast<Acc>(l[j]));
      } else {
        const Acc s = ScoreOf<Acc>(p.softmax, l[j], mx, sum);
        const Acc sel = p.bias != nullptr ? s + static_cast<Acc>(__ldg(p.bias + e)) : s;
        key[j] = OrderedBits(sel);
        if constexpr (kLimited) warp_keys[e] = sel;
      }
    }

    if constexpr (kLimited) {
      __syncwarp();
      if (p.num_groups > 1) {
        // Group g = experts [g*gs, (g+1)*gs), scored by the sum of its two largest keys (one when gs = 1);
        // lane g scores group g. Keep topk_groups groups, best first, ties to the lower group id.
        const int gs = p.group_size;
        Acc group_score = 0;
        if (lane < p.num_groups) {
          Acc a = NegInf<Acc>(), b = NegInf<Acc>();
          for (int i = 0; i < gs; ++i) TopTwo(warp_keys[lane * gs + i], a, b);
          group_score = b == NegInf<Acc>() ? a : a + b;
        }
        __syncwarp();
        const bool keep = KeepBestLanes(group_score, p.num_groups, p.topk_groups, lane);
#pragma unroll
        for (int j = 0; j < kVpt; ++j) {
          const int e = lane + kWarpSize * j;
          const int kept = __shfl_sync(kFullMask, keep ? 1 : 0, e < num_e ? e / gs : 0);
          if (!kept) {
            key[j] = 0;
            if (e < num_e) warp_keys[e] = NegInf<Acc>();  // masked for the node scan
          }
        }
        __syncwarp();
      }
      if (p.num_nodes > 0) {
        // Node n (lane n) is scored by the sum of the two largest keys of its experts that the group
        // limit left (the host's KeepBestSets over node_of_expert); keep max_nodes of them.
        Acc node_score = 0;
        if (lane < p.num_nodes) {
          Acc a = NegInf<Acc>(), b = NegInf<Acc>();
          for (int e = 0; e < num_e; ++e)
            if (__ldg(p.node_of_expert + e) == lane) TopTwo(warp_keys[e], a, b);
          node_score = b == NegInf<Acc>() ? a : a + b;
        }
        const bool keep = KeepBestLanes(node_score, p.num_nodes, p.max_nodes, lane);
#pragma unroll
        for (int j = 0; j < kVpt; ++j) {
          const int e = lane + kWarpSize * j;
          const int kept = __shfl_sync(kFullMask, keep ? 1 : 0, e < num_e ? __ldg(p.node_of_expert + e) : 0);
          if (!kept) key[j] = 0;
        }
      }
      __syncwarp();  // the next token overwrites warp_keys
    }

    // Top-K: K rounds of a warp argmax; lane r keeps the r-th expert.
    int my_expert = 0;
    for (int r = 0; r < k; ++r) {
      Bits bv = key[0];
      int bj = 0;
#pragma unroll
      for (int j = 1; j < kVpt; ++j) {
        if (key[j] > bv) {  // strict: within a lane the ids ascend with j, so ties keep the lower id
          bv = key[j];
          bj = j;
        }
      }
      const int w = WarpArgMax(bv, lane + kWarpSize * bj);
      // Take w out (written as a compare per slot, not key[w / 32], so the keys stay in registers).
#pragma unroll
      for (int j = 0; j < kVpt; ++j) key[j] = lane + kWarpSize * j == w ? Bits(0) : key[j];
      if (lane == r) my_expert = w;
    }
    // The chosen logit is re-read (an L1 hit) and its score recomputed with the ranked arithmetic.
    const Acc my_score = lane < k ? ScoreOf<Acc>(p.softmax, __ldg(row + my_expert), mx, sum) : Acc(0);

    // Gates: c * s / sum over the top-K (fixed butterfly order: deterministic), or c * s.
    const Acc total = WarpSum(my_score);
    if (lane < k) {
      Acc g = my_score;
      if (p.normalize) g = g / total;
      g = g * static_cast<Acc>(p.scaling_factor);
      p.experts[t * k + lane] = my_expert;
      p.gates[t * k + lane] = static_cast<float>(g);
      if (count) atomicAdd(&hist[my_expert], 1);
    }
  }

  if (count) {
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < num_e; i += kThreads)
      if (hist[i] != 0) atomicAdd(&p.tokens_per_expert[i], hist[i]);
  }
}

template <int kVpt, typename Acc, bool kLimited>
Status Launch(const Params& p, cudaStream_t stream) {
  const auto router_top_k_kernel = RouterTopKKernel<kVpt, Acc, kLimited>;
  const size_t e = static_cast<size_t>(p.num_experts);
  const size_t smem = (kLimited ? sizeof(Acc) * kWarpsPerBlock * e : 0) +
                      (p.tokens_per_expert != nullptr ? sizeof(int32_t) * e : 0);
  int device = 0, sms = 0, per_sm = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  RDEP_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, router_top_k_kernel, kThreads, smem));
  const int64_t wanted = (p.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t resident = static_cast<int64_t>(sms) * std::max(per_sm, 1);
  const auto blocks = static_cast<unsigned>(std::min(wanted, resident));
  RDEP_LAUNCH_PDL(router_top_k_kernel, blocks, kThreads, smem, stream, p);
  return Status::Ok();
}

// Turns E into the compile-time experts-per-lane count (1, 2, 4, 8 or 16).
template <typename F>
Status DispatchExpertsPerLane(int64_t num_experts, F&& f) {
  if (num_experts <= 32) return f(std::integral_constant<int, 1>{});
  if (num_experts <= 64) return f(std::integral_constant<int, 2>{});
  if (num_experts <= 128) return f(std::integral_constant<int, 4>{});
  if (num_experts <= 256) return f(std::integral_constant<int, 8>{});
  if (num_experts <= 512) return f(std::integral_constant<int, 16>{});
  return InvalidArgument("gpu router: no kernel for num_experts = " + std::to_string(num_experts));
}

}  // namespace

Status GpuRouterDesc::Validate() const {
  const std::string p = "gpu router: ";
  if (num_experts < 1 || num_experts > kMaxRouterExperts)
    return InvalidArgument(p + "num_experts must be in [1, " + std::to_string(kMaxRouterExperts) + "], got " +
                           std::to_string(num_experts));
  if (topk < 1 || topk > std::min(num_experts, kMaxRouterTopK))
    return InvalidArgument(p + "topk must be in [1, min(num_experts, " + std::to_string(kMaxRouterTopK) + ")], got " +
                           std::to_string(topk) + " with num_experts = " + std::to_string(num_experts));
  if (!std::isfinite(scaling_factor) || scaling_factor <= 0)
    return InvalidArgument(p + "scaling_factor must be finite and > 0");
  if (num_groups < 1 || num_groups > kMaxRouterGroups)
    return InvalidArgument(p + "num_groups must be in [1, " + std::to_string(kMaxRouterGroups) + "], got " +
                           std::to_string(num_groups));
  if (num_experts % num_groups != 0)
    return InvalidArgument(p + "num_groups (" + std::to_string(num_groups) + ") does not divide num_experts (" +
                           std::to_string(num_experts) + ")");
  if (topk_groups < 1 || topk_groups > num_groups)
    return InvalidArgument(p + "topk_groups must be in [1, num_groups=" + std::to_string(num_groups) + "], got " +
                           std::to_string(topk_groups));
  if (max_nodes < 0 || max_nodes > num_nodes || num_nodes > kMaxRouterNodes || (num_nodes > 0 && max_nodes < 1))
    return InvalidArgument(p + "node-limited routing needs num_nodes in [1, " + std::to_string(kMaxRouterNodes) +
                           "] and max_nodes in [1, num_nodes] (both 0 = off), got num_nodes = " + std::to_string(num_nodes) +
                           ", max_nodes = " + std::to_string(max_nodes));
  if (num_groups > 1 && topk > topk_groups * (num_experts / num_groups))
    return InvalidArgument(p + "topk (" + std::to_string(topk) + ") exceeds the experts in topk_groups kept groups (" +
                           std::to_string(topk_groups * (num_experts / num_groups)) + ")");
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const GpuRouterDesc& d) {
  os << "GpuRouterDesc{E=" << d.num_experts << " K=" << d.topk
     << " score=" << (d.score == RouterScore::kSoftmax ? "softmax" : "sigmoid")
     << " normalize_topk=" << (d.normalize_topk ? "yes" : "no") << " scale=" << d.scaling_factor;
  if (d.num_groups > 1) os << " groups=" << d.topk_groups << "/" << d.num_groups;
  if (d.num_nodes > 0) os << " nodes=" << d.max_nodes << "/" << d.num_nodes;
  return os << " precision=" << (d.fp64_scores ? "fp64" : "fp32") << "}";
}

Status LaunchRouterTopK(const GpuRouterDesc& desc, const float* logits, int64_t num_tokens, const float* bias,
                        int32_t* experts, float* gates, int32_t* tokens_per_expert, cudaStream_t stream) {
  RDEP_RETURN_IF_ERROR(desc.Validate());
  if (num_tokens < 0) return InvalidArgument("gpu router: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  if (num_tokens > 0 && (logits == nullptr || experts == nullptr || gates == nullptr))
    return InvalidArgument("gpu router: logits, experts and gates must be non-null when num_tokens > 0");
  if (tokens_per_expert != nullptr)
    RDEP_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(tokens_per_expert, 0, sizeof(int32_t) * static_cast<size_t>(desc.num_experts), stream));
  if (desc.num_nodes > 0 && desc.node_of_expert == nullptr)
    return InvalidArgument("gpu router: node-limited routing needs node_of_expert (a device array of E node ids)");
  if (num_tokens == 0) return Status::Ok();

  Params p{};
  p.logits = logits;
  p.bias = bias;
  p.experts = experts;
  p.gates = gates;
  p.tokens_per_expert = tokens_per_expert;
  p.num_tokens = num_tokens;
  p.num_experts = static_cast<int>(desc.num_experts);
  p.topk = static_cast<int>(desc.topk);
  p.num_groups = static_cast<int>(desc.num_groups);
  p.group_size = static_cast<int>(desc.num_experts / desc.num_groups);
  p.topk_groups = static_cast<int>(desc.topk_groups);
  p.num_nodes = static_cast<int>(desc.num_nodes);
  p.max_nodes = static_cast<int>(desc.max_nodes);
  p.node_of_expert = desc.node_of_expert;
  p.softmax = desc.score == RouterScore::kSoftmax;
  p.normalize = desc.normalize_topk;
  const bool grouped = desc.num_groups > 1 || desc.num_nodes > 0;
  p.logit_keys = !desc.fp64_scores && bias == nullptr && !grouped;
  p.scaling_factor = desc.scaling_factor;

  return DispatchExpertsPerLane(desc.num_experts, [&](auto vpt) -> Status {
    constexpr int kVpt = decltype(vpt)::value;
    if (desc.fp64_scores)
      return grouped ? Launch<kVpt, double, true>(p, stream) : Launch<kVpt, double, false>(p, stream);
    return grouped ? Launch<kVpt, float, true>(p, stream) : Launch<kVpt, float, false>(p, stream);
  });
}

}  // namespace rdep::kernels
