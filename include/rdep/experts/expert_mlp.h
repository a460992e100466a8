// Expert compute on the owner: the SwiGLU expert MLP over expert-grouped rows, forward, dgrad and
// wgrad, on one GPU. bf16 activations and weights, fp32 accumulation, fp32 weight gradients.
//
//   forward   h = x.W1            [M][2F]  (gate and up columns placed by desc.gate_up: kSplit puts the gate
//                                           in [0, F) and the up projection in [F, 2F); W1, dW1 and dh alike)
//             z = silu(h_g) * h_u  [M][F]
//             y = z.W2            [M][H]
//   backward  dz   = dout.W2^T,  dW2_e = z_e^T.dout_e
//             dh   = [dz * h_u * silu'(h_g), dz * silu(h_g)]
//             dW1_e = x_e^T.dh_e,  dx = dh.W1^T
//
// Rows are grouped by local expert: expert e owns rows [off_e, off_e + m_e) with off_e the exclusive
// prefix sum of the per-expert counts. Counts may be zero (an empty expert costs no launch; with
// accumulate = false its weight gradients are zeroed).
// Weights, per local expert, row-major (the layout of include/rdep/core/expert_mlp.h, the host
// reference): w1 [E_loc][H][2F], w2 [E_loc][F][H]; gradients dw1, dw2 have the same layout in fp32.
//
// The GEMMs go through cuBLASLt (one matmul per non-empty expert, optionally fanned out over a few
// internal streams that fork from and join back into the caller's stream) or through cuBLAS's grouped
// GEMM (cublasGemmGroupedBatchedEx, one call per GEMM for all experts); SwiGLU and its backward are
// small fused CUDA kernels. Every call is stream-ordered, allocates nothing, never synchronizes the host
// and is CUDA-graph capturable (the plan cache grows on the first call that sees a new row count;
// warm it outside a capture).
//
// Requirements (checked, InvalidArgument otherwise): hidden and ffn multiples of 8; every pointer
// 16-byte aligned; sum of counts <= max_rows. The per-expert counts are a HOST array (the caller copies
// them to the host once per layer call); it is read during the call only.
//
// Exercised by: build/src/experts/experts_test --gtest_filter='ExpertMlp*' and `rdep bench gemm`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>

#include "rdep/core/expert_mlp.h"
#include "rdep/status.h"

namespace rdep::kernels {

// What is asked: the expert shape and the most rows one call may carry (sizes the workspace).
struct ExpertMlpDesc {
  int64_t num_experts = 0;  // E_loc, local experts
  int64_t hidden = 0;       // H
  int64_t ffn = 0;          // F (D_ff)
  int64_t max_rows = 0;     // upper bound on M = sum of rows_per_expert
  mlp::GateUp gate_up = mlp::GateUp::kSplit;  // where W1's (and h's, dW1's) 2F columns hold gate and up

  Status Validate() const;
};
std::ostream& operator<<(std::ostream& os, const ExpertMlpDesc& d);

// How it is computed.
enum class GemmPath {
  kAuto,         // per call: kGrouped when the mean rows per non-empty expert < kAutoGroupedMaxMeanRows,
                 // else kLtPerExpert (measured crossover on H100 at the Moonlight shape: docs/perf-notes.md)
  kLtPerExpert,  // one cuBLASLt matmul per non-empty expert (plans cached per row count); host-bound
                 // at small row counts (~7 us of host time per Hopper cuBLASLt call)
  kGrouped,      // cublasGemmGroupedBatchedEx for the bf16-output GEMMs (one call per GEMM for all
                 // experts: low host cost, but its kernels plateau near 280 TFLOP/s); wgrad on cuBLASLt
};
inline constexpr int64_t kAutoGroupedMaxMeanRows = 256;
const char* GemmPathName(GemmPath p);

struct ExpertMlpConfig {
  GemmPath path = GemmPath::kAuto;
  int num_streams = 8;  // per-expert cuBLASLt work is spread over this many streams (1 = caller's only)
  size_t lt_workspace_bytes = size_t{8} << 20;  // cuBLASLt workspace per stream
};
std::ostream& operator<<(std::ostream& os, const ExpertMlpConfig& c);

class ExpertMlp {
 public:
  // Allocates every workspace (warm cache) on `device`; Forward/Backward allocate nothing.
  static StatusOr<std::unique_ptr<ExpertMlp>> Create(const ExpertMlpDesc& desc, int device,
                                                     const ExpertMlpConfig& config = {});
  ~ExpertMlp();
  ExpertMlp(const ExpertMlp&) = delete;
  ExpertMlp& operator=(const ExpertMlp&) = delete;

  // x [M][H] bf16; rows_per_expert: HOST array [E_loc], sum M <= max_rows; w1, w2 as above.
  // Writes h [M][2F] bf16 (the pre-activations, saved for Backward) and y [M][H] bf16.
  Status Forward(const __nv_bfloat16* x, const int64_t* rows_per_expert, const __nv_bfloat16* w1,
                 const __nv_bfloat16* w2, __nv_bfloat16* h, __nv_bfloat16* y, cudaStream_t stream);

  // dout [M][H] bf16 (the gradient at the expert output, gate already applied), x and h from
  // Forward. Writes dx [M][H] bf16 and dw1 [E_loc][H][2F], dw2 [E_loc][F][H] fp32: overwritten, or
  // added to when accumulate is true (gradient accumulation across micro-batches / layers' replicas).
  Status Backward(const __nv_bfloat16* x, const __nv_bfloat16* h, const __nv_bfloat16* dout,
                  const int64_t* rows_per_expert, const __nv_bfloat16* w1, const __nv_bfloat16* w2,
                  __nv_bfloat16* dx, float* dw1, float* dw2, bool accumulate, cudaStream_t stream);
  // The same with dw1, dw2 written as bf16 (each GEMM accumulates in fp32 and rounds once), overwritten:
  // the gradients of bf16 parameters without an fp32 copy and a cast.
  Status Backward(const __nv_bfloat16* x, const __nv_bfloat16* h, const __nv_bfloat16* dout,
                  const int64_t* rows_per_expert, const __nv_bfloat16* w1, const __nv_bfloat16* w2,
                  __nv_bfloat16* dx, __nv_bfloat16* dw1, __nv_bfloat16* dw2, cudaStream_t stream);

  // Device bytes held by this object (activation scratch, cuBLAS workspaces, pointer tables), and
  // the same before creating one (what Create will allocate for desc and config).
  size_t workspace_bytes() const;
  static size_t WorkspaceBytes(const ExpertMlpDesc& desc, const ExpertMlpConfig& config = {});
  const ExpertMlpDesc& desc() const;
  const ExpertMlpConfig& config() const;

  struct Impl;

 private:
  explicit ExpertMlp(std::unique_ptr<Impl> impl);
  Status BackwardImpl(const __nv_bfloat16* x, const __nv_bfloat16* h, const __nv_bfloat16* dout,
                      const int64_t* rows_per_expert, const __nv_bfloat16* w1, const __nv_bfloat16* w2,
                      __nv_bfloat16* dx, void* dw1, void* dw2, bool bf16_grads, bool accumulate, cudaStream_t stream);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rdep::kernels
