// The sync-free expert compute for sm_90a (rdep/experts/expert_compute.h, MakeCutlassExpertCompute):
// the expert MLP's six GEMMs as CUTLASS ptr-array grouped GEMMs (grouped_gemm_sm90.h) whose problem
// sizes and operand pointers a one-block setup kernel writes from the DEVICE per-expert counts, and
// the SwiGLU kernels bounded by the device's total row count. No call reads the counts on the host,
// so a layer that uses it can be captured in a CUDA graph.
//
//   Forward   setup (offsets, tables, total)  ->  h = x.W1 (NN)  ->  z = swiglu(h)  ->  y = z.W2 (NN)
//             With W1 as GateUp::kInterleaved8 (and tiles.swiglu_epilogue), GEMM1's epilogue writes z beside h
//             (kNN_SwiGLU): no SwiGLU pass.
//   Backward  setup  ->  dz = dout.W2^T (NT)  ->  z, dh = swiglu'(h, dz)  ->  dW2 (+)= z^T.dout (TN)
//             With per-row gates (ExpertRows::gate): z = g * swiglu(h) in forward; in backward dout is dy,
//             the SwiGLU' kernel (a warp per row) takes dgate = <dz, swiglu(h)>, z = g * swiglu(h) and dh
//             from g * dz; the GEMMs are the same
//             ->  dx = dh.W1^T (NT),  dW1 (+)= x^T.dh (TN)  ->  zero the gradients of empty experts
//             (overwrite mode only: their TN groups have no tiles)
// Memory: one scratch of F values a row. Backward writes z over dz and dh over the caller's h (both
// in place, element by element in one thread), and runs dW2 before dx, so dx may be dout itself
// (dx_may_alias_dout): the owner then needs one set of output rows.
// Counts that sum beyond the call's rows.max_rows cannot be computed without overflowing the buffers:
// the setup kernel then computes nothing (every group empty, the total -1, outputs and gradients
// untouched) and raises a fault in host-mapped memory that the next call reports once
// (FailedPrecondition naming the sum). The scan caps each count at max_rows + 1, so corrupt counts
// cannot wrap the int64 sum. A captured graph's replays are not calls: a fault raised there shows at
// the next eager call (or CheckCall of a later one).
// One object serves one stream at a time: its tables, total and internal buffer (z, dz) are
// shared by its calls, so calls on different streams must be ordered by the caller.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "experts/expert_mlp_kernels.cuh"
#include "experts/grouped_gemm_sm90.h"
#include "rdep/cuda/check.h"
#include "rdep/experts/expert_compute.h"
#include "launch/pdl.h"

namespace rdep::kernels {
namespace {

using internal::GemmProblem;
using internal::GroupedGemmKind;
using internal::GroupedGemmSm90;
using internal::GroupedGemmTile;

// Each GEMM's kernel configuration. The defaults are the fastest of the tiles per GEMM over mu in
// 128..3072 at the Moonlight expert (E_loc 16, H 2048, F 1408) on an H100 (bench/lab/grouped_gemm_tiles;
// docs/perf-notes.md, "CUTLASS tiles"). An H200 sweep favoured ping_128x128 for the first three GEMMs
// alone, but the whole MLP and the layer were slower with it (docs/perf-notes.md, "CUTLASS tiles on an H200").
struct RoleTiles {
  GroupedGemmTile g1 = GroupedGemmTile::kCoop128x256;
  GroupedGemmTile g2 = GroupedGemmTile::kCoop128x256;
  GroupedGemmTile dz = GroupedGemmTile::kCoop128x128;
  GroupedGemmTile dx = GroupedGemmTile::kCoop128x256;
  GroupedGemmTile dw2 = GroupedGemmTile::kCoop128x256;
  GroupedGemmTile dw1 = GroupedGemmTile::kPing128x128C2x1;
};

StatusOr<RoleTiles> ResolveTiles(const CutlassTiles& names) {
  RoleTiles t;
  for (auto [name, role, out] : {std::tuple{&names.gemm1, "gemm1", &t.g1}, {&names.gemm2, "gemm2", &t.g2},
                                 {&names.dgrad_z, "dgrad_z", &t.dz}, {&names.dgrad_x, "dgrad_x", &t.dx},
                                 {&names.wgrad_w2, "wgrad_w2", &t.dw2}, {&names.wgrad_w1, "wgrad_w1", &t.dw1}}) {
    if (name->empty()) continue;
    auto tile = internal::ParseGroupedGemmTile(*name);
    if (!tile.ok()) return InvalidArgument(std::string("cutlass expert compute: tiles.") + role + ": " + tile.status().message());
    *out = *tile;
  }
  return t;
}

constexpr int kMaxExperts = 1024;  // one setup block, a thread per local expert

// One grouped GEMM's device tables, as the setup kernel fills them.
struct GemmTables {
  GemmProblem* problems;
  const void** a;
  const void** b;
  void** d;
};

struct ForwardSetup {
  const int64_t* counts;
  int32_t experts;
  int64_t H, F, max_rows;
  const __nv_bfloat16 *x, *w1, *w2;
  __nv_bfloat16 *h, *z, *y;
  GemmTables g1, g2;
  // GEMM1 with the SwiGLU epilogue (else null): its z and gate tables, the gates' stride (device)
  void** g1_z;
  const float** g1_gate;
  int64_t* g1_gate_stride;
  const float* gate;  // rows' gates or null
  int64_t gate_stride;
  int64_t* total;  // device: the rows this call computes (-1 after an overflow)
  int64_t* fault;  // device view of a host-mapped word: the total that overflowed, sticky
};

struct BackwardSetup {
  const int64_t* counts;
  int32_t experts;
  int64_t H, F, max_rows;
  const __nv_bfloat16 *x, *dout, *w1, *w2;
  __nv_bfloat16 *z, *dh, *dx;  // z: dz, then z in its place; dh: the caller's h, overwritten
  void *dw1, *dw2;  // fp32 or bf16, [E][H][2F], [E][F][H]
  int64_t grad_elem_bytes;
  GemmTables gdz, gdx, gdw2, gdw1;
  int64_t* total;
  int64_t* fault;
};

// Expert e's rows as the setup kernels read them: negative counts are 0, counts above max_rows are
// max_rows + 1 (already an overflow; the cap keeps the sum of up to kMaxExperts counts in int64).
__device__ int64_t ClampedCount(const int64_t* counts, int32_t experts, int e, int64_t max_rows) {
  if (e >= experts) return 0;
  const int64_t c = counts[e];
  return c <= 0 ? 0 : (c > max_rows ? max_rows + 1 : c);
}

// Exclusive scan of the clamped counts in one block (thread e holds expert e); returns expert e's
// first row and leaves the sum in *sum.
__device__ int64_t ExpertOffset(const int64_t* counts, int32_t experts, int64_t max_rows, int64_t* sum) {
  __shared__ int64_t scan[kMaxExperts];
  const int e = static_cast<int>(threadIdx.x);
  const int64_t m = ClampedCount(counts, experts, e, max_rows);
  scan[e] = m;
  __syncthreads();
  for (int step = 1; step < kMaxExperts; step <<= 1) {
    const int64_t add = e >= step ? scan[e - step] : 0;
    __syncthreads();
    scan[e] += add;
    __syncthreads();
  }
  *sum = scan[kMaxExperts - 1];
  return scan[e] - m;
}

// Thread 0 writes the call's total (-1 after an overflow, which it also raises); all learn whether it fits.
__device__ bool PublishTotal(int64_t sum, int64_t max_rows, int64_t* total, int64_t* fault) {
  const bool fits = sum <= max_rows;
  if (threadIdx.x == 0) {
    *total = fits ? sum : -1;
    if (!fits) *reinterpret_cast<volatile int64_t*>(fault) = sum;
  }
  return fits;
}

__device__ void SetGroup(const GemmTables& t, int e, int32_t m, int32_t n, int32_t k, const void* a, const void* b, void* d) {
  t.problems[e] = GemmProblem{m, n, k};
  t.a[e] = a;
  t.b[e] = b;
  t.d[e] = d;
}

__global__ void __launch_bounds__(kMaxExperts) ForwardSetupKernel(ForwardSetup p) {
  cuda::WaitForPrimaryGrid();
  int64_t sum = 0;
  const int64_t off = ExpertOffset(p.counts, p.experts, p.max_rows, &sum);
  const int e = static_cast<int>(threadIdx.x);
  const bool fits = PublishTotal(sum, p.max_rows, p.total, p.fault);
  if (e >= p.experts) return;
  const auto m = static_cast<int32_t>(fits ? ClampedCount(p.counts, p.experts, e, p.max_rows) : 0);
  const int64_t H = p.H, F = p.F;
  SetGroup(p.g1, e, m, static_cast<int32_t>(2 * F), static_cast<int32_t>(H), p.x + off * H, p.w1 + e * H * 2 * F, p.h + off * 2 * F);
  SetGroup(p.g2, e, m, static_cast<int32_t>(H), static_cast<int32_t>(F), p.z + off * F, p.w2 + e * F * H, p.y + off * H);
  if (p.g1_z) {
    p.g1_z[e] = p.z + off * F;
    p.g1_gate[e] = p.gate ? p.gate + off * p.gate_stride : nullptr;
    if (e == 0) *p.g1_gate_stride = p.gate_stride;
  }
}

__global__ void __launch_bounds__(kMaxExperts) BackwardSetupKernel(BackwardSetup p) {
  cuda::WaitForPrimaryGrid();
  int64_t sum = 0;
  const int64_t off = ExpertOffset(p.counts, p.experts, p.max_rows, &sum);
  const int e = static_cast<int>(threadIdx.x);
  const bool fits = PublishTotal(sum, p.max_rows, p.total, p.fault);
  if (e >= p.experts) return;
  const auto m = static_cast<int32_t>(fits ? ClampedCount(p.counts, p.experts, e, p.max_rows) : 0);
  const int64_t H = p.H, F = p.F;
  auto* dw1 = static_cast<char*>(p.dw1) + e * H * 2 * F * p.grad_elem_bytes;
  auto* dw2 = static_cast<char*>(p.dw2) + e * F * H * p.grad_elem_bytes;
  const auto h32 = static_cast<int32_t>(H), f32 = static_cast<int32_t>(F);
  SetGroup(p.gdz, e, m, f32, h32, p.dout + off * H, p.w2 + e * F * H, p.z + off * F);
  SetGroup(p.gdx, e, m, h32, 2 * f32, p.dh + off * 2 * F, p.w1 + e * H * 2 * F, p.dx + off * H);
  // Weight gradients: M x N = F x H and H x 2F, K = the expert's rows; an empty expert has no tiles.
  SetGroup(p.gdw2, e, m > 0 ? f32 : 0, h32, m, p.z + off * F, p.dout + off * H, dw2);
  SetGroup(p.gdw1, e, m > 0 ? h32 : 0, 2 * f32, m, p.x + off * H, p.dh + off * 2 * F, dw1);
}

// Overwrite mode: an expert without rows gets zero weight gradients (its TN groups wrote nothing).
// An overflowed call (total -1) computed nothing and leaves every gradient untouched.
__global__ void ZeroEmptyExpertGradsKernel(const int64_t* counts, const int64_t* total, char* dw1, char* dw2, int64_t bytes1,
                                           int64_t bytes2) {
  cuda::WaitForPrimaryGrid();
  const int e = static_cast<int>(blockIdx.y);
  if (counts[e] > 0 || *total < 0) return;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * 16; i < bytes1 + bytes2;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * 16) {
    char* p = i < bytes1 ? dw1 + e * bytes1 + i : dw2 + e * bytes2 + (i - bytes1);
    *reinterpret_cast<uint4*>(p) = make_uint4(0, 0, 0, 0);
  }
}

class CutlassExpertCompute final : public ExpertCompute {
 public:
  CutlassExpertCompute(const ExpertMlpDesc& d, int device, const RoleTiles& tiles, bool swiglu_epilogue, void* scratch)
      : desc_(d),
        device_(device),
        tiles_(tiles),
        fused_swiglu_(swiglu_epilogue),
        external_scratch_(scratch) {}
  ~CutlassExpertCompute() override {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device_);
    if (!external_scratch_ && z_) cudaFree(z_);
    if (total_) cudaFree(total_);
    if (fault_host_) cudaFreeHost(fault_host_);
    gemms_.reset();
    cudaSetDevice(current);
  }

  // Every GEMM's persistent grid at most `sms` CTAs (GroupedGemmSm90::LimitSms; 0 = every SM).
  Status LimitSms(int32_t sms) {
    Gemms& g = *gemms_;
    for (auto* m : {&g.g1, &g.g2, &g.dz, &g.dx, &g.dw2, &g.dw1, &g.dw2_bf16, &g.dw1_bf16}) RDEP_RETURN_IF_ERROR((*m)->LimitSms(sms));
    return Status::Ok();
  }

  Status Init() {
    const auto E = static_cast<int32_t>(desc_.num_experts);
    const int64_t H = desc_.hidden, F = desc_.ffn;
    auto make = [&](GroupedGemmKind k, int64_t lda, int64_t ldb, int64_t ldd, GroupedGemmTile tile,
                    std::unique_ptr<GroupedGemmSm90>& out) -> Status {
      RDEP_ASSIGN_OR_RETURN(out, GroupedGemmSm90::Create(k, E, lda, ldb, ldd, device_, tile));
      return Status::Ok();
    };
    gemms_ = std::make_unique<Gemms>();
    Gemms& g = *gemms_;
    const RoleTiles& t = tiles_;
    if (fused_swiglu_ && !internal::GroupedGemmTileHasSwiglu(t.g1))
      return InvalidArgument(std::string("cutlass expert compute: tiles.gemm1 = ") + internal::GroupedGemmTileName(t.g1) +
                             " has no SwiGLU epilogue (built: coop_128x128, coop_128x256, ping_128x128); name one of those or set "
                             "tiles.swiglu_epilogue = false");
    RDEP_RETURN_IF_ERROR(make(fused_swiglu_ ? GroupedGemmKind::kNN_SwiGLU : GroupedGemmKind::kNN, H, 2 * F, 2 * F, t.g1,
                              g.g1));  // h [m][2F] = x [m][H] . W1 [H][2F] (and z [m][F], fused)
    RDEP_RETURN_IF_ERROR(make(GroupedGemmKind::kNN, F, H, H, t.g2, g.g2));               // y [m][H] = z [m][F] . W2 [F][H]
    RDEP_RETURN_IF_ERROR(make(GroupedGemmKind::kNT, H, H, F, t.dz, g.dz));               // dz [m][F] = dout [m][H] . (W2 [F][H])^T
    RDEP_RETURN_IF_ERROR(make(GroupedGemmKind::kNT, 2 * F, 2 * F, H, t.dx, g.dx));       // dx [m][H] = dh [m][2F] . (W1 [H][2F])^T
    RDEP_RETURN_IF_ERROR(make(GroupedGemmKind::kTN_F32, F, H, H, t.dw2, g.dw2));         // dW2 [F][H] = (z [m][F])^T . dout [m][H]
    RDEP_RETURN_IF_ERROR(make(GroupedGemmKind::kTN_F32, H, 2 * F, 2 * F, t.dw1, g.dw1)); // dW1 [H][2F] = (x [m][H])^T . dh [m][2F]
    RDEP_RETURN_IF_ERROR(make(GroupedGemmKind::kTN_BF16, F, H, H, t.dw2, g.dw2_bf16));
    RDEP_RETURN_IF_ERROR(make(GroupedGemmKind::kTN_BF16, H, 2 * F, 2 * F, t.dw1, g.dw1_bf16));
    if (external_scratch_) {
      z_ = static_cast<__nv_bfloat16*>(external_scratch_);
    } else {
      void* p = nullptr;
      RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(CutlassExpertScratchBytes(desc_), 16)));
      z_ = static_cast<__nv_bfloat16*>(p);
    }
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&total_, sizeof(int64_t)));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(total_, 0, sizeof(int64_t)));
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));  // the memset's legacy stream: before any call's stream writes it
    void* pinned = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, sizeof(int64_t), cudaHostAllocMapped | cudaHostAllocPortable));
    fault_host_ = static_cast<int64_t*>(pinned);
    *fault_host_ = -1;
    void* mapped = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&mapped, pinned, 0));
    fault_dev_ = static_cast<int64_t*>(mapped);
    return Status::Ok();
  }

  const char* name() const override { return "cutlass-grouped-sm90"; }
  bool graph_safe() const override { return true; }
  size_t workspace_bytes() const override {
    size_t b = (external_scratch_ ? 0 : CutlassExpertScratchBytes(desc_)) + sizeof(int64_t);
    if (gemms_)
      for (const auto* g : gemms_->all()) b += g->device_bytes();
    return b;
  }
  const ExpertMlpDesc& desc() const override { return desc_; }

  Status Forward(const ExpertRows& rows, const __nv_bfloat16* x, const ExpertWeightsView& w, __nv_bfloat16* h, __nv_bfloat16* y,
                 cudaStream_t stream) override {
    RDEP_RETURN_IF_ERROR(CheckCall(rows, w));
    Gemms& g = *gemms_;
    const ForwardSetup p{rows.counts, static_cast<int32_t>(desc_.num_experts), desc_.hidden, desc_.ffn, rows.max_rows, x, w.w1,
                         w.w2, h, z_, y, Tables(*g.g1), Tables(*g.g2), g.g1->ptr_z(), g.g1->ptr_gate(), g.g1->gate_stride(),
                         rows.gate, rows.gate_stride, total_, fault_dev_};
    RDEP_LAUNCH_PDL(ForwardSetupKernel, 1, kMaxExperts, 0, stream, p);
    RDEP_RETURN_IF_ERROR(g.g1->Run(0.0f, stream));
    if (!fused_swiglu_)
      RDEP_CUDA_RETURN_IF_ERROR(internal::LaunchSwigluForward(h, z_, rows.max_rows, desc_.ffn, stream, total_, rows.gate,
                                                              rows.gate_stride, Interleaved()));
    return g.g2->Run(0.0f, stream);
  }

  bool dx_may_alias_dout() const override { return true; }

  Status Backward(const ExpertRows& rows, const __nv_bfloat16* x, __nv_bfloat16* h, const __nv_bfloat16* dout,
                  const ExpertWeightsView& w, __nv_bfloat16* dx, const ExpertGradsView& grads, bool accumulate,
                  cudaStream_t stream) override {
    RDEP_RETURN_IF_ERROR(CheckCall(rows, w));
    if (!h) return InvalidArgument("cutlass expert compute: h (the forward's pre-activations) is null");
    if (rows.gate && !rows.dgate) return InvalidArgument("cutlass expert compute: rows.gate without rows.dgate (each row's gate gradient)");
    if (grads.bf16() && accumulate)
      return InvalidArgument("cutlass expert compute: bf16 weight gradients are written once (accumulate must be false)");
    Gemms& g = *gemms_;
    GroupedGemmSm90& gdw2 = grads.bf16() ? *g.dw2_bf16 : *g.dw2;
    GroupedGemmSm90& gdw1 = grads.bf16() ? *g.dw1_bf16 : *g.dw1;
    void* dw1 = grads.bf16() ? static_cast<void*>(grads.dw1_bf16) : static_cast<void*>(grads.dw1);
    void* dw2 = grads.bf16() ? static_cast<void*>(grads.dw2_bf16) : static_cast<void*>(grads.dw2);
    if (!dw1 || !dw2) return InvalidArgument("cutlass expert compute: weight gradients are null");
    const int64_t elem = grads.bf16() ? 2 : 4;
    const BackwardSetup p{rows.counts, static_cast<int32_t>(desc_.num_experts), desc_.hidden, desc_.ffn, rows.max_rows, x, dout,
                          w.w1, w.w2, z_, h, dx, dw1, dw2, elem, Tables(*g.dz), Tables(*g.dx), Tables(gdw2),
                          Tables(gdw1), total_, fault_dev_};
    RDEP_LAUNCH_PDL(BackwardSetupKernel, 1, kMaxExperts, 0, stream, p);
    RDEP_RETURN_IF_ERROR(g.dz->Run(0.0f, stream));
    if (rows.gate)  // in place; dgate per row from dz' = dout.W2^T and the recomputed swiglu(h)
      RDEP_CUDA_RETURN_IF_ERROR(internal::LaunchSwigluBackwardGated(h, z_, rows.gate, rows.gate_stride, z_, h, rows.dgate, rows.max_rows,
                                                                    desc_.ffn, stream, total_, Interleaved()));
    else  // in place
      RDEP_CUDA_RETURN_IF_ERROR(internal::LaunchSwigluBackward(h, z_, z_, h, rows.max_rows, desc_.ffn, stream, total_, Interleaved()));
    const float beta = accumulate ? 1.0f : 0.0f;
    RDEP_RETURN_IF_ERROR(gdw2.Run(beta, stream));  // the last reader of dout: dx may go over it
    RDEP_RETURN_IF_ERROR(g.dx->Run(0.0f, stream));
    RDEP_RETURN_IF_ERROR(gdw1.Run(beta, stream));
    if (accumulate) return Status::Ok();
    const int64_t H = desc_.hidden, F = desc_.ffn;
    const dim3 grid(64, static_cast<unsigned>(desc_.num_experts));
    RDEP_LAUNCH_PDL(ZeroEmptyExpertGradsKernel, grid, 256, 0, stream, rows.counts, total_, static_cast<char*>(dw1),
                    static_cast<char*>(dw2), H * 2 * F * elem, F * H * elem);
    return Status::Ok();
  }

 private:
  struct Gemms {
    std::unique_ptr<GroupedGemmSm90> g1, g2, dz, dx, dw2, dw1, dw2_bf16, dw1_bf16;
    std::vector<const GroupedGemmSm90*> all() const {
      return {g1.get(), g2.get(), dz.get(), dx.get(), dw2.get(), dw1.get(), dw2_bf16.get(), dw1_bf16.get()};
    }
  };

  static GemmTables Tables(GroupedGemmSm90& g) { return {g.problems(), g.ptr_a(), g.ptr_b(), g.ptr_d()}; }
  bool Interleaved() const { return desc_.gate_up == mlp::GateUp::kInterleaved8; }

  // Host checks of a call, and the fault a previous call's setup raised (read from mapped memory: no
  // synchronization; a fault of a call still in flight shows at a later call).
  Status CheckCall(const ExpertRows& rows, const ExpertWeightsView& w) {
    if (!rows.counts) return InvalidArgument("cutlass expert compute: rows.counts (device per-expert counts) is null");
    if (rows.max_rows < 0 || rows.max_rows > desc_.max_rows)
      return InvalidArgument("cutlass expert compute: rows.max_rows " + std::to_string(rows.max_rows) + " outside [0, desc.max_rows=" +
                             std::to_string(desc_.max_rows) + "]");
    if (!w.w1 || !w.w2) return InvalidArgument("cutlass expert compute: weights are null");
    if (rows.gate && rows.gate_stride < 1)
      return InvalidArgument("cutlass expert compute: rows.gate_stride " + std::to_string(rows.gate_stride) + " must be >= 1");
    if (w.w1_scales || w.w2_scales) return InvalidArgument("cutlass expert compute: scaled (FP8) weights are not supported");
    auto* fault_word = reinterpret_cast<volatile int64_t*>(fault_host_);
    if (const int64_t fault = *fault_word; fault >= 0) {
      *fault_word = -1;  // reported once
      return FailedPrecondition("cutlass expert compute: an earlier call's counts summed to " + std::to_string(fault) +
                                " rows or more, beyond its rows.max_rows; that call computed nothing (its outputs are stale)");
    }
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return Status::Ok();
  }

  ExpertMlpDesc desc_;
  int device_;
  RoleTiles tiles_;
  bool fused_swiglu_;  // GEMM1 writes z in its epilogue (W1 kInterleaved8 and tiles.swiglu_epilogue)
  std::unique_ptr<Gemms> gemms_;
  void* external_scratch_ = nullptr;  // the caller's z (MakeCutlassExpertCompute's scratch), or null
  __nv_bfloat16* z_ = nullptr;        // [max_rows][F]: z forward; dz, then z over it, backward
  int64_t* total_ = nullptr;
  int64_t* fault_host_ = nullptr;
  int64_t* fault_dev_ = nullptr;
};

}  // namespace

std::vector<std::string> CutlassTileNames() {
  std::vector<std::string> names;
  for (GroupedGemmTile t : internal::kGroupedGemmTiles) names.emplace_back(internal::GroupedGemmTileName(t));
  return names;
}

StatusOr<std::unique_ptr<ExpertCompute>> MakeCutlassExpertCompute(const ExpertMlpDesc& desc, int device,
                                                                  const CutlassTiles& tiles, void* scratch) {
  RDEP_RETURN_IF_ERROR(desc.Validate());
  RDEP_ASSIGN_OR_RETURN(const RoleTiles roles, ResolveTiles(tiles));
  if (tiles.swiglu_epilogue && desc.gate_up != mlp::GateUp::kInterleaved8)
    return InvalidArgument(std::string("cutlass expert compute: tiles.swiglu_epilogue needs desc.gate_up interleaved8 (got ") +
                           mlp::GateUpName(desc.gate_up) + "): a tile holds both columns of a feature only then");
  if (desc.num_experts > kMaxExperts)
    return InvalidArgument("cutlass expert compute: num_experts " + std::to_string(desc.num_experts) + " > " +
                           std::to_string(kMaxExperts) + " local experts");
  if (desc.max_rows > (int64_t{1} << 31) - 1 || desc.hidden > (int64_t{1} << 30) || desc.ffn > (int64_t{1} << 29))
    return InvalidArgument("cutlass expert compute: max_rows, hidden and 2*ffn must fit the kernels' 32-bit problem sizes");
  std::string why;
  if (!internal::GroupedGemmSm90Available(device, &why)) return Unavailable("cutlass expert compute: " + why);
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  if (reinterpret_cast<uintptr_t>(scratch) % 16 != 0)
    return InvalidArgument("cutlass expert compute: scratch must be 16-byte aligned");
  auto c = std::make_unique<CutlassExpertCompute>(desc, device, roles, tiles.swiglu_epilogue, scratch);
  RDEP_RETURN_IF_ERROR(c->Init());
  if (tiles.gemm_sms != 0) RDEP_RETURN_IF_ERROR(c->LimitSms(tiles.gemm_sms));
  return std::unique_ptr<ExpertCompute>(std::move(c));
}

}  // namespace rdep::kernels
