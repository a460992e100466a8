// Lab (compute-sanitizer's initcheck on rdep): which writes does initcheck see? The thirty-first session's
// `scripts/sanitize.sh initcheck` flagged 127,136 "uninitialized __global__ memory reads" in experts_test, all in
// the SwiGLU backward's load of dz, a buffer that only a cuBLASLt GEMM writes, while the tests' results (dx through
// that dz) matched the host. This program writes fresh cudaMalloc buffers in four ways, checks every value on the
// host, then reads each buffer with its own kernel (Read<case>), so that initcheck's report names the case it flags:
//   Plain  a kernel's st.global
//   Bulk   a TMA bulk store (cp.async.bulk.global.shared::cta) from shared memory
//   LtDz   cublasLtMatmul as ExpertMlp's kDz runs it (dz = dout . W2^T, m 129, F 64, H 128; bf16 out)
//   LtBig  the same at the Moonlight expert's F and H (m 1024, F 1408, H 2048)
// Run (on the device):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/icp bench/lab/initcheck_probe.cu -lcublasLt
//   /tmp/icp && compute-sanitizer --tool initcheck --print-limit 10000000 /tmp/icp 2>&1 |
//     grep -oE "of size [0-9,]+ bytes|at Read[A-Za-z]+" | sort | uniq -c
// The four buffers have distinct sizes (Plain 256 KiB, Bulk 128 KiB, LtDz 16,512 B, LtBig 2.75 MiB), so the
// reports of the host's cudaMemcpy reads name the buffer by size, and a kernel's reads by the kernel.
// A flagged Read<case> whose values the host confirmed means initcheck did not see that kind of write.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lab_check.h"

#define LK(x)                                                                               \
  do {                                                                                      \
    const cublasStatus_t s_ = (x);                                                          \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                      \
      std::fprintf(stderr, "%s:%d: %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

namespace {

constexpr int kBulkBytes = 4096;  // one block's bulk store

// Sums a buffer's 16-byte words into *sink (so the loads cannot be dropped). One kernel per case: initcheck's
// report names the kernel, hence the case.
__device__ void SumWords(const uint4* p, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  atomicXor(sink, acc);
}
__global__ void ReadPlain(const uint4* p, int64_t n, unsigned* sink) { SumWords(p, n, sink); }
__global__ void ReadBulk(const uint4* p, int64_t n, unsigned* sink) { SumWords(p, n, sink); }
__global__ void ReadLtDz(const uint4* p, int64_t n, unsigned* sink) { SumWords(p, n, sink); }
__global__ void ReadLtBig(const uint4* p, int64_t n, unsigned* sink) { SumWords(p, n, sink); }

__global__ void WritePlain(uint32_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    p[i] = static_cast<uint32_t>(i * 2654435761u);
}

// Block b fills 4 KiB of shared memory and stores it to p + b * 4 KiB with one bulk copy.
__global__ void WriteBulk(uint32_t* p) {
  __shared__ alignas(128) uint32_t buf[kBulkBytes / 4];
  for (int i = threadIdx.x; i < kBulkBytes / 4; i += blockDim.x)
    buf[i] = static_cast<uint32_t>((blockIdx.x * (kBulkBytes / 4) + i) * 2654435761u);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t dst = reinterpret_cast<uint64_t>(p + blockIdx.x * (kBulkBytes / 4));
    const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(buf));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "n"(kBulkBytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

int CheckWords(const std::vector<uint32_t>& h, const char* name) {
  for (size_t i = 0; i < h.size(); ++i)
    if (h[i] != static_cast<uint32_t>(i * 2654435761u)) {
      std::printf("%s: word %zu is %u, expected %u\n", name, i, h[i], static_cast<uint32_t>(i * 2654435761u));
      return 1;
    }
  std::printf("%-6s %zu words written as expected\n", name, h.size());
  return 0;
}

float Bf(__nv_bfloat16 v) { return __bfloat162float(v); }

// dz[m][F] = dout[m][H] . W2[F][H]^T through cuBLASLt, as ExpertMlp's kDz plan describes it; checks rows on the
// host (every row's first and last columns, and every column of rows 0, m/2 and m-1).
int LtDz(cublasLtHandle_t lt, int64_t m, int64_t F, int64_t H, const char* name, __nv_bfloat16** out) {
  std::vector<__nv_bfloat16> a(m * H), b(F * H);
  for (int64_t i = 0; i < m * H; ++i) a[i] = __float2bfloat16(static_cast<float>((i * 7) % 13) / 13.0f - 0.5f);
  for (int64_t i = 0; i < F * H; ++i) b[i] = __float2bfloat16(static_cast<float>((i * 5) % 11) / 11.0f - 0.5f);
  __nv_bfloat16 *da, *db, *dc;
  CK(cudaMalloc(&da, a.size() * 2));
  CK(cudaMalloc(&db, b.size() * 2));
  CK(cudaMalloc(&dc, m * F * 2));  // never written but by the GEMM
  CK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  cublasLtMatmulDesc_t op;
  LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;  // cuBLAS "A" = W2 (col-major H x F), "B" = dout
  LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  cublasLtMatrixLayout_t la, lb, lc;
  LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, H, F, H));
  LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, H, m, H));
  LK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, F, m, F));
  cublasLtMatmulPreference_t pref;
  LK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws_bytes = 32u << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  LK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found));
  if (found == 0) {
    std::printf("%s: no cuBLASLt algorithm\n", name);
    return 1;
  }
  const float alpha = 1.0f, beta = 0.0f;
  LK(cublasLtMatmul(lt, op, &alpha, db, la, da, lb, &beta, dc, lc, dc, lc, &heur.algo, ws, ws_bytes, 0));
  CK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> c(m * F);
  CK(cudaMemcpy(c.data(), dc, c.size() * 2, cudaMemcpyDeviceToHost));
  int bad = 0, checked = 0;
  const auto check = [&](int64_t r, int64_t f) {
    double ref = 0;
    for (int64_t k = 0; k < H; ++k) ref += double(Bf(a[r * H + k])) * double(Bf(b[f * H + k]));
    const double got = Bf(c[r * F + f]);
    ++checked;
    if (!(std::fabs(got - ref) <= 0.02 * std::fabs(ref) + 0.05)) ++bad;
  };
  for (int64_t r = 0; r < m; ++r) check(r, 0), check(r, F - 1);
  for (int64_t r : {int64_t{0}, m / 2, m - 1})
    for (int64_t f = 0; f < F; ++f) check(r, f);
  std::printf("%-6s m %ld F %ld H %ld: %d of %d checked values off the host's\n", name, (long)m, (long)F, (long)H, bad,
              checked);
  cudaFree(da), cudaFree(db), cudaFree(ws);
  *out = dc;
  return bad != 0;
}

}  // namespace

int main() {
  int fails = 0;
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(sink, 0, 4));
  const int blocks = 64, bulk_blocks = 32;
  const int64_t words = int64_t{blocks} * kBulkBytes / 4, bulk_words = int64_t{bulk_blocks} * kBulkBytes / 4;
  uint32_t *plain, *bulk;
  CK(cudaMalloc(&plain, words * 4));
  CK(cudaMalloc(&bulk, bulk_words * 4));
  WritePlain<<<blocks, 256>>>(plain, words);
  WriteBulk<<<bulk_blocks, 128>>>(bulk);
  CK(cudaDeviceSynchronize());
  std::vector<uint32_t> h(words);
  CK(cudaMemcpy(h.data(), plain, words * 4, cudaMemcpyDeviceToHost));
  fails += CheckWords(h, "Plain");
  h.resize(bulk_words);
  CK(cudaMemcpy(h.data(), bulk, bulk_words * 4, cudaMemcpyDeviceToHost));
  fails += CheckWords(h, "Bulk");
  cublasLtHandle_t lt;
  LK(cublasLtCreate(&lt));
  __nv_bfloat16 *dz_small, *dz_big;
  fails += LtDz(lt, 129, 64, 128, "LtDz", &dz_small);
  fails += LtDz(lt, 1024, 1408, 2048, "LtBig", &dz_big);
  ReadPlain<<<blocks, 256>>>(reinterpret_cast<const uint4*>(plain), words / 4, sink);
  ReadBulk<<<blocks, 256>>>(reinterpret_cast<const uint4*>(bulk), bulk_words / 4, sink);
  ReadLtDz<<<blocks, 256>>>(reinterpret_cast<const uint4*>(dz_small), 129 * 64 / 8, sink);
  ReadLtBig<<<blocks, 256>>>(reinterpret_cast<const uint4*>(dz_big), int64_t{1024} * 1408 / 8, sink);
  CK(cudaDeviceSynchronize());
  std::printf("%s\n", fails ? "FAILED: a write did not land as expected" : "every write landed as expected");
  return fails ? 1 : 0;
}
