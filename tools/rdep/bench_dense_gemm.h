// A cuBLASLt bf16 GEMM in the benchmarks' row-major terms, D[m][n] = A[m][k] . B[k][n] (fp32 accumulation, bf16
// out; cuBLASLt's column-major D^T = B^T . A^T), set up once and run many times: `rdep bench gemm`'s dense ceiling
// (n^3) and its dense GEMMs on the same rows as the expert MLP (all rows through one expert's weights).
#pragma once

#include <cstddef>
#include <cstdint>

#include "rdep/status.h"

#if defined(RDEP_HAVE_CUDA)
#include <cublasLt.h>
#include <cuda_runtime.h>

namespace rdep::cli {

class DenseGemm {
 public:
  DenseGemm() = default;
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;
  ~DenseGemm();
  // Creates the descriptors and picks cuBLASLt's first heuristic answer for m x n x k with up to
  // workspace_bytes of workspace. m, n, k >= 1.
  Status Init(int64_t m, int64_t n, int64_t k, size_t workspace_bytes);
  // Enqueues D = A . B on `stream` (workspace: workspace_bytes of device memory).
  Status Run(const void* a, const void* b, void* d, void* workspace, cudaStream_t stream) const;
  double flops() const { return 2.0 * static_cast<double>(m_) * static_cast<double>(n_) * static_cast<double>(k_); }

 private:
  int64_t m_ = 0, n_ = 0, k_ = 0;
  size_t ws_bytes_ = 0;
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, ld_ = nullptr;
  cublasLtMatmulHeuristicResult_t heur_{};
};

}  // namespace rdep::cli
#endif
