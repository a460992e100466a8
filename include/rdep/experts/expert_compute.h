// Expert compute behind one interface (DESIGN.md, "Expert compute"): the owner's expert-grouped rows
// in, expert outputs out (forward), dgrad and wgrad (backward), with the per-expert row counts read
// from DEVICE memory, so the layer needs no host round trip to call it. Implementations say whether
// a call may synchronize the host (graph_safe), and how much device memory they hold, which callers
// can learn before creating one (ExpertComputeWorkspaceBytes).
//
//   cuBLASLt (MakeCublasLtExpertCompute): the ExpertMlp of rdep/experts/expert_mlp.h (cuBLASLt GEMMs
//   + fused SwiGLU). Its GEMMs need the counts on the host: it copies them and synchronizes the stream,
//   unless the caller passes a host mirror it already has (ExpertRows::host_counts). Not graph-safe.
//   The fallback and the A/B reference for the fused sm_90a kernels that will implement this interface.
//
// Rows of local expert e are [off_e, off_e + m_e), off_e the exclusive prefix sum of the counts; the
// math and layouts are those of rdep/experts/expert_mlp.h.
// An object's calls share its internal buffers: they must run in stream order (one stream, or calls
// on different streams ordered by the caller with events); use one object per concurrent stream.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rdep/experts/expert_mlp.h"
#include "rdep/status.h"

namespace rdep::kernels {

// One batch of expert-grouped rows.
struct ExpertRows {
  const int64_t* counts = nullptr;       // DEVICE [E_loc] rows per local expert
  int64_t max_rows = 0;                  // host bound on their sum (<= the desc's max_rows)
  const int64_t* host_counts = nullptr;  // optional: the same counts on the host, if the caller has them
  // Optional, the CUTLASS compute only (seeds 002 section 4, the gate multiplied before W2): row r's gate at
  // DEVICE gate[r * gate_stride] (a field of the caller's row records). Forward then writes the weighted
  // output g * swiglu(x.W1).W2 (the SwiGLU output scaled before its bf16 rounding); Backward takes dout
  // UNWEIGHTED (dy), applies the gate itself and writes dgate[r] = <dout_r . W2^T, swiglu(h_r)> (the dot of
  // dy with the row's unweighted output, fp32, deterministic) into DEVICE dgate [max_rows].
  const float* gate = nullptr;
  int64_t gate_stride = 1;               // in floats, >= 1
  float* dgate = nullptr;                // Backward with gate: required
};

// The local experts' weights. Room for per-block scales (FP8 later); null for bf16 weights.
struct ExpertWeightsView {
  const __nv_bfloat16* w1 = nullptr;  // [E_loc][H][2F]
  const __nv_bfloat16* w2 = nullptr;  // [E_loc][F][H]
  const float* w1_scales = nullptr;
  const float* w2_scales = nullptr;
};

// Weight gradients in the weights' layout: fp32 (dw1, dw2), or bf16 (dw1_bf16, dw2_bf16, set instead:
// the gradients of bf16 parameters, written once, never accumulated).
struct ExpertGradsView {
  float* dw1 = nullptr;
  float* dw2 = nullptr;
  __nv_bfloat16* dw1_bf16 = nullptr;
  __nv_bfloat16* dw2_bf16 = nullptr;
  bool bf16() const { return dw1_bf16 != nullptr; }
};

class ExpertCompute {
 public:
  virtual ~ExpertCompute() = default;
  virtual const char* name() const = 0;
  // True when no call synchronizes the host (a layer using it can be captured in a CUDA graph).
  virtual bool graph_safe() const = 0;
  // Device bytes this object holds.
  virtual size_t workspace_bytes() const = 0;
  virtual const ExpertMlpDesc& desc() const = 0;

  // x [M][H] bf16 -> h [M][2F] bf16 (pre-activations, kept for Backward), y [M][H] bf16 (with rows.gate: weighted).
  virtual Status Forward(const ExpertRows& rows, const __nv_bfloat16* x, const ExpertWeightsView& w, __nv_bfloat16* h,
                         __nv_bfloat16* y, cudaStream_t stream) = 0;
  // dout [M][H] (gate applied), x and h from Forward -> dx [M][H]; weight gradients overwritten, or
  // added to when accumulate is true. h is consumed: an implementation may overwrite it (the CUTLASS
  // compute writes the SwiGLU inputs' gradient dh there, which saves a scratch of 2*F values a row), so
  // a caller that runs Backward twice on one forward keeps a copy. dx may be dout itself when
  // dx_may_alias_dout() (dout is then read completely before dx is written); never x or h, which the
  // weight gradients read after dx is written.
  virtual Status Backward(const ExpertRows& rows, const __nv_bfloat16* x, __nv_bfloat16* h,
                          const __nv_bfloat16* dout, const ExpertWeightsView& w, __nv_bfloat16* dx,
                          const ExpertGradsView& grads, bool accumulate, cudaStream_t stream) = 0;
  // True when Backward accepts dx == dout (the owner's output rows then need one set, not two).
  virtual bool dx_may_alias_dout() const { return false; }
};

// The sync-free implementation for sm_90a (src/experts/cutlass_expert_compute.cu): the six GEMMs as
// CUTLASS ptr-array grouped GEMMs (TMA + wgmma, persistent, one launch per GEMM for all experts)
// whose problem sizes and pointers a setup kernel writes from the DEVICE counts, SwiGLU kernels
// bounded by the device's row total. graph_safe() is true: no call reads the counts on the host.
// rows.max_rows bounds the counts' sum (a larger sum computes nothing and the next call reports it).
// Requires hidden and ffn multiples of 8, num_experts <= 1024, 16-byte aligned pointers; weight
// gradients fp32 (accumulate or overwrite) or bf16 (overwrite). Unavailable in a build without
// CUTLASS (RDEP_HAVE_CUTLASS) or on a GPU other than sm_90.
// tiles: the kernel configuration of each GEMM by name (coop_128x128, coop_128x256, coop_128x128_c1x2,
// coop_256x128_c1x2, ping_128x128, ping_128x128_c2x1, coop_256x128_c2x1, coop_128x256_c2x1; "" = that
// GEMM's default, chosen by measurement: docs/perf-notes.md, "CUTLASS tiles"); an unknown
// name is InvalidArgument naming the field. The layer (CudaMoELayer, so rdep.torch and the C ABI too) takes
// the defaults; RDEP_CUTLASS_TILES=G1/G2/DZ/DX/DW2/DW1 (or one TILE) in the environment overrides them for
// every CUTLASS layer the process creates: tuning without a rebuild (ParseCutlassTileSpec's format).
struct CutlassTiles {
  std::string gemm1;     // h = x.W1
  std::string gemm2;     // y = z.W2
  std::string dgrad_z;   // dz = dout.W2^T
  std::string dgrad_x;   // dx = dh.W1^T
  std::string wgrad_w2;  // dW2 = z^T.dout (fp32 or bf16 gradients)
  std::string wgrad_w1;  // dW1 = x^T.dh
  // With desc.gate_up = kInterleaved8, true makes GEMM1's epilogue write the SwiGLU output z beside h (no separate
  // pass; gemm1 must then be coop_128x128, coop_128x256 or ping_128x128). Off by default: on an H200 it measured
  // slower than GEMM1 plus the separate SwiGLU kernel (docs/perf-notes.md, "GEMM1's SwiGLU in its epilogue").
  bool swiglu_epilogue = false;
  int32_t gemm_sms = 0;  // the GEMMs' persistent grids use at most this many SMs, leaving the rest to kernels on
                         // other streams (CudaMoELayer's overlapped segments); 0 = every SM. Same results
};
// scratch: null (the object allocates its own), or CutlassExpertScratchBytes(desc) bytes of device memory on
// `device`, 16-byte aligned, that it uses for the SwiGLU activations z (forward) and dz, then z in its place
// (backward; dh goes over the caller's h) instead of allocating them: nothing in it outlives a call. Objects whose calls never overlap (calls in one
// stream's order) may share one scratch: the layers of one size on a domain do (CudaMoELayer,
// "expert.scratch"). workspace_bytes() then leaves it out; the caller keeps it alive as long as the object.
StatusOr<std::unique_ptr<ExpertCompute>> MakeCutlassExpertCompute(const ExpertMlpDesc& desc, int device,
                                                                  const CutlassTiles& tiles = {}, void* scratch = nullptr);
// The bytes of a CUTLASS expert compute's SwiGLU scratch: desc.max_rows rows of ffn bf16 values.
size_t CutlassExpertScratchBytes(const ExpertMlpDesc& desc);
// The tile names this build has (empty without CUTLASS).
std::vector<std::string> CutlassTileNames();
// A tile spec as `rdep bench gemm --path cutlass:SPEC` and RDEP_CUTLASS_TILES take it: TILE (every GEMM) or
// G1/G2/DZ/DX/DW2/DW1 (CutlassTiles' order, an empty field keeps that GEMM's default). Only the shape is checked
// here (InvalidArgument naming `what`); MakeCutlassExpertCompute checks the names.
StatusOr<CutlassTiles> ParseCutlassTileSpec(const std::string& spec, const std::string& what);

// What MakeCublasLtExpertCompute(desc, ..., config) will allocate on the device.
size_t ExpertComputeWorkspaceBytes(const ExpertMlpDesc& desc, const ExpertMlpConfig& config = {});

StatusOr<std::unique_ptr<ExpertCompute>> MakeCublasLtExpertCompute(const ExpertMlpDesc& desc, int device,
                                                                   const ExpertMlpConfig& config = {});

}  // namespace rdep::kernels
