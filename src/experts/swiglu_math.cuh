// The SwiGLU arithmetic shared by the element-wise kernels (expert_mlp_kernels.cu) and GEMM1's SwiGLU
// epilogue (swiglu_epilogue_sm90.cuh), so that the two forwards round alike: the same bf16 inputs give the
// same bf16 z, bit for bit. Device code only.
#pragma once

#include <cstdint>

namespace rdep::kernels::internal {

// __fdividef (2 ulp; 0 when the denominator overflows to inf, so silu(a) -> -0 for very negative a) rather than
// the IEEE division's ~10-instruction sequence: in GEMM1's epilogue these instructions sit between the tensor
// core's tiles.
__device__ __forceinline__ float SwigluSigmoid(float a) { return __fdividef(1.0f, 1.0f + __expf(-a)); }

// silu(a) * b, fp32, in the order every rdep kernel evaluates it.
__device__ __forceinline__ float SwigluOf(float a, float b) { return a * SwigluSigmoid(a) * b; }

// The first column of the 8-feature vector starting at feature `col` (a multiple of 8) in an h row of 2F
// columns: the gate's, and the up projection's (rdep::mlp::GateUp; interleaved = kInterleaved8).
__device__ __forceinline__ int64_t GateVecCol(int64_t col, bool interleaved) { return interleaved ? 2 * col : col; }
__device__ __forceinline__ int64_t UpVecCol(int64_t col, int64_t F, bool interleaved) { return interleaved ? 2 * col + 8 : F + col; }

}  // namespace rdep::kernels::internal
