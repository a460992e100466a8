// The cuBLASLt implementation of ExpertCompute: ExpertMlp behind the device-counts interface.
#include "rdep/experts/expert_compute.h"

#include <algorithm>
#include <string>
#include <vector>

#include "rdep/cuda/check.h"

namespace rdep::kernels {
namespace {

class CublasLtExpertCompute final : public ExpertCompute {
 public:
  CublasLtExpertCompute(std::unique_ptr<ExpertMlp> mlp, int64_t* pinned) : mlp_(std::move(mlp)), pinned_(pinned) {}
  ~CublasLtExpertCompute() override {
    if (pinned_) cudaFreeHost(pinned_);
  }
  const char* name() const override { return "cublaslt"; }
  bool graph_safe() const override { return false; }
  size_t workspace_bytes() const override { return mlp_->workspace_bytes(); }
  const ExpertMlpDesc& desc() const override { return mlp_->desc(); }

  Status Forward(const ExpertRows& rows, const __nv_bfloat16* x, const ExpertWeightsView& w, __nv_bfloat16* h,
                 __nv_bfloat16* y, cudaStream_t stream) override {
    RDEP_ASSIGN_OR_RETURN(const int64_t* counts, HostCounts(rows, w, stream));
    return mlp_->Forward(x, counts, w.w1, w.w2, h, y, stream);
  }

  Status Backward(const ExpertRows& rows, const __nv_bfloat16* x, __nv_bfloat16* h, const __nv_bfloat16* dout,
                  const ExpertWeightsView& w, __nv_bfloat16* dx, const ExpertGradsView& g, bool accumulate,
                  cudaStream_t stream) override {
    RDEP_ASSIGN_OR_RETURN(const int64_t* counts, HostCounts(rows, w, stream));
    if (g.bf16()) {
      if (accumulate) return InvalidArgument("expert compute (cublaslt): bf16 weight gradients are overwritten, never accumulated");
      return mlp_->Backward(x, h, dout, counts, w.w1, w.w2, dx, g.dw1_bf16, g.dw2_bf16, stream);
    }
    return mlp_->Backward(x, h, dout, counts, w.w1, w.w2, dx, g.dw1, g.dw2, accumulate, stream);
  }

 private:
  // The counts on the host: the caller's mirror, or a copy after a stream synchronization.
  StatusOr<const int64_t*> HostCounts(const ExpertRows& rows, const ExpertWeightsView& w, cudaStream_t stream) {
    if (w.w1_scales || w.w2_scales) return InvalidArgument("expert compute (cublaslt): scaled (FP8) weights are not supported");
    if (rows.gate || rows.dgate)
      return InvalidArgument("expert compute (cublaslt): per-row gates (rows.gate, rows.dgate) need the cutlass expert compute");
    if (rows.max_rows < 0 || rows.max_rows > desc().max_rows)
      return InvalidArgument("expert compute (cublaslt): max_rows " + std::to_string(rows.max_rows) + " outside [0, " +
                             std::to_string(desc().max_rows) + "]");
    if (rows.host_counts) return rows.host_counts;
    if (!rows.counts) return InvalidArgument("expert compute (cublaslt): no counts (device or host)");
    const auto E = static_cast<size_t>(desc().num_experts);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pinned_, rows.counts, E * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return static_cast<const int64_t*>(pinned_);
  }

  std::unique_ptr<ExpertMlp> mlp_;
  int64_t* pinned_;  // [E_loc] host mirror of the counts
};

}  // namespace

size_t ExpertComputeWorkspaceBytes(const ExpertMlpDesc& desc, const ExpertMlpConfig& config) {
  return ExpertMlp::WorkspaceBytes(desc, config);
}

size_t CutlassExpertScratchBytes(const ExpertMlpDesc& desc) {
  return static_cast<size_t>(std::max<int64_t>(desc.max_rows, 0)) * static_cast<size_t>(std::max<int64_t>(desc.ffn, 0)) * 2;
}

StatusOr<std::unique_ptr<ExpertCompute>> MakeCublasLtExpertCompute(const ExpertMlpDesc& desc, int device,
                                                                   const ExpertMlpConfig& config) {
  RDEP_ASSIGN_OR_RETURN(std::unique_ptr<ExpertMlp> mlp, ExpertMlp::Create(desc, device, config));
  void* pinned = nullptr;
  RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, sizeof(int64_t) * static_cast<size_t>(std::max<int64_t>(desc.num_experts, 1)),
                                          cudaHostAllocPortable));
  return std::unique_ptr<ExpertCompute>(new CublasLtExpertCompute(std::move(mlp), static_cast<int64_t*>(pinned)));
}

StatusOr<CutlassTiles> ParseCutlassTileSpec(const std::string& spec, const std::string& what) {
  std::vector<std::string> f(1);  // the '/'-separated fields, empty ones kept
  for (char ch : spec) {
    if (ch == '/') f.emplace_back();
    else f.back() += ch;
  }
  if (f.size() == 1) f.assign(6, f[0]);
  if (f.size() != 6)
    return InvalidArgument(what + " = '" + spec + "': give one tile (every GEMM) or six, G1/G2/DZ/DX/DW2/DW1 (" +
                           std::to_string(f.size()) + " fields given)");
  CutlassTiles t;
  t.gemm1 = f[0], t.gemm2 = f[1], t.dgrad_z = f[2], t.dgrad_x = f[3], t.wgrad_w2 = f[4], t.wgrad_w1 = f[5];
  return t;
}

}  // namespace rdep::kernels
