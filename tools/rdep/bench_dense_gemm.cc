// DenseGemm (bench_dense_gemm.h): cuBLASLt's bf16 GEMM in row-major terms.
#include "bench_dense_gemm.h"

#if defined(RDEP_HAVE_CUDA)
#include <string>

namespace rdep::cli {

DenseGemm::~DenseGemm() {
  if (la_) cublasLtMatrixLayoutDestroy(la_);
  if (lb_) cublasLtMatrixLayoutDestroy(lb_);
  if (ld_) cublasLtMatrixLayoutDestroy(ld_);
  if (op_) cublasLtMatmulDescDestroy(op_);
  if (lt_) cublasLtDestroy(lt_);
}

Status DenseGemm::Init(int64_t m, int64_t n, int64_t k, size_t workspace_bytes) {
  if (m < 1 || n < 1 || k < 1)
    return InvalidArgument("dense GEMM: m, n, k must be >= 1, got " + std::to_string(m) + ", " + std::to_string(n) + ", " +
                           std::to_string(k));
  m_ = m, n_ = n, k_ = k, ws_bytes_ = workspace_bytes;
  const auto um = static_cast<uint64_t>(m), un = static_cast<uint64_t>(n), uk = static_cast<uint64_t>(k);
  cublasLtMatmulPreference_t pref = nullptr;
  int found = 0;
  // Column-major: cuBLASLt's A is B (n x k, ld n), its B is A (k x m, ld k), D is n x m (ld n).
  const bool ok = cublasLtCreate(&lt_) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&la_, CUDA_R_16BF, un, uk, n) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&lb_, CUDA_R_16BF, uk, um, k) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&ld_, CUDA_R_16BF, un, um, n) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes_,
                                                       sizeof ws_bytes_) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulAlgoGetHeuristic(lt_, op_, la_, lb_, ld_, ld_, pref, 1, &heur_, &found) == CUBLAS_STATUS_SUCCESS &&
                  found > 0;
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (!ok)
    return InternalError("dense GEMM: cuBLASLt found no algorithm for " + std::to_string(m) + " x " + std::to_string(n) + " x " +
                         std::to_string(k) + " bf16");
  return Status::Ok();
}

Status DenseGemm::Run(const void* a, const void* b, void* d, void* workspace, cudaStream_t stream) const {
  const float alpha = 1.0f, beta = 0.0f;
  if (cublasLtMatmul(lt_, op_, &alpha, b, la_, a, lb_, &beta, d, ld_, d, ld_, &heur_.algo, workspace, ws_bytes_, stream) !=
      CUBLAS_STATUS_SUCCESS)
    return Status(StatusCode::kCudaError, "dense cublasLtMatmul failed");
  return Status::Ok();
}

}  // namespace rdep::cli
#endif
