// Fused element-wise kernels of the expert MLP: SwiGLU forward, SwiGLU backward (recomputing z for
// dW2; with the gate before W2, also each row's dgate: one warp per row), and the pointer-table fill of
// the grouped-GEMM path. Each thread handles 8 consecutive features (one 16-byte vector of bf16) of one
// row; the grid strides over rows x F/8 vectors (the gated backward: over rows, a warp each).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "experts/expert_mlp_kernels.cuh"
#include "experts/swiglu_math.cuh"
#include "launch/pdl.h"

namespace rdep::kernels::internal {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // bf16 per 16-byte vector

union Vec8 {
  uint4 raw;
  __nv_bfloat162 pair[4];
};

__device__ __forceinline__ float Sigmoid(float a) { return SwigluSigmoid(a); }

// The rows to process: the host count, or (device_rows non-null) the device count capped by it (a
// negative device count, an overflowed call's, is 0).
__device__ __forceinline__ int64_t NumVec(const int64_t* device_rows, int64_t rows, int64_t vec_per_row) {
  const int64_t r = device_rows ? max(int64_t{0}, min(*device_rows, rows)) : rows;
  return r * vec_per_row;
}

__global__ void SwigluForwardKernel(const __nv_bfloat16* __restrict__ h, __nv_bfloat16* __restrict__ z,
                                    const int64_t* device_rows, int64_t rows, int64_t vec_per_row, int64_t F,
                                    const float* __restrict__ gate, int64_t gate_stride, bool interleaved) {
  cuda::WaitForPrimaryGrid();
  const int64_t num_vec = NumVec(device_rows, rows, vec_per_row);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_vec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / vec_per_row, col = (i - row * vec_per_row) * kVec;
    const float w = gate ? gate[row * gate_stride] : 1.0f;
    const __nv_bfloat16* hr = h + row * 2 * F;
    Vec8 g, u, out;
    g.raw = *reinterpret_cast<const uint4*>(hr + GateVecCol(col, interleaved));
    u.raw = *reinterpret_cast<const uint4*>(hr + UpVecCol(col, F, interleaved));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = __bfloat1622float2(g.pair[j]);
      const float2 b = __bfloat1622float2(u.pair[j]);
      out.pair[j] = gate ? __floats2bfloat162_rn(w * SwigluOf(a.x, b.x), w * SwigluOf(a.y, b.y))
                         : __floats2bfloat162_rn(SwigluOf(a.x, b.x), SwigluOf(a.y, b.y));
    }
    *reinterpret_cast<uint4*>(z + row * F + col) = out.raw;
  }
}

// The SwiGLU backward of one vector: loads its three inputs before it stores anything, so it is right in
// place too (z == dz, dh == h: each element is read and written by one thread only).
__device__ __forceinline__ void SwigluBackwardVec(const __nv_bfloat16* h, const __nv_bfloat16* dz, __nv_bfloat16* z,
                                                  __nv_bfloat16* dh, int64_t i, int64_t vec_per_row, int64_t F, bool interleaved) {
  const int64_t row = i / vec_per_row, col = (i - row * vec_per_row) * kVec;
  const int64_t gc = GateVecCol(col, interleaved), uc = UpVecCol(col, F, interleaved);
  const __nv_bfloat16* hr = h + row * 2 * F;
  Vec8 g, u, d, zo, dg, du;
  g.raw = *reinterpret_cast<const uint4*>(hr + gc);
  u.raw = *reinterpret_cast<const uint4*>(hr + uc);
  d.raw = *reinterpret_cast<const uint4*>(dz + row * F + col);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 a = __bfloat1622float2(g.pair[j]);
    const float2 b = __bfloat1622float2(u.pair[j]);
    const float2 dd = __bfloat1622float2(d.pair[j]);
    const float sx = Sigmoid(a.x), sy = Sigmoid(a.y);
    const float silu_x = a.x * sx, silu_y = a.y * sy;
    const float dsilu_x = sx * (1.0f + a.x * (1.0f - sx)), dsilu_y = sy * (1.0f + a.y * (1.0f - sy));
    zo.pair[j] = __floats2bfloat162_rn(silu_x * b.x, silu_y * b.y);
    dg.pair[j] = __floats2bfloat162_rn(dd.x * b.x * dsilu_x, dd.y * b.y * dsilu_y);
    du.pair[j] = __floats2bfloat162_rn(dd.x * silu_x, dd.y * silu_y);
  }
  *reinterpret_cast<uint4*>(z + row * F + col) = zo.raw;
  __nv_bfloat16* dhr = dh + row * 2 * F;
  *reinterpret_cast<uint4*>(dhr + gc) = dg.raw;
  *reinterpret_cast<uint4*>(dhr + uc) = du.raw;
}

// Separate buffers (the cuBLASLt compute): __restrict__ lets the loads take the read-only path.
__global__ void SwigluBackwardKernel(const __nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ dz,
                                     __nv_bfloat16* __restrict__ z, __nv_bfloat16* __restrict__ dh, const int64_t* device_rows,
                                     int64_t rows, int64_t vec_per_row, int64_t F, bool interleaved) {
  cuda::WaitForPrimaryGrid();
  const int64_t num_vec = NumVec(device_rows, rows, vec_per_row);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_vec; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    SwigluBackwardVec(h, dz, z, dh, i, vec_per_row, F, interleaved);
}

// In place (z == dz, dh == h: the CUTLASS compute's backward): no __restrict__.
__global__ void SwigluBackwardInPlaceKernel(const __nv_bfloat16* h, const __nv_bfloat16* dz, __nv_bfloat16* z, __nv_bfloat16* dh,
                                            const int64_t* device_rows, int64_t rows, int64_t vec_per_row, int64_t F,
                                            bool interleaved) {
  cuda::WaitForPrimaryGrid();
  const int64_t num_vec = NumVec(device_rows, rows, vec_per_row);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_vec; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    SwigluBackwardVec(h, dz, z, dh, i, vec_per_row, F, interleaved);
}

// The gate before W2, one warp per row (LaunchSwigluBackwardGated). Each element is read and written by one
// lane, loads before stores: right in place. No __restrict__ (z may be dz, dh may be h).
__global__ void SwigluBackwardGatedKernel(const __nv_bfloat16* h, const __nv_bfloat16* dz, const float* gate, int64_t gate_stride,
                                          __nv_bfloat16* z, __nv_bfloat16* dh, float* dgate, const int64_t* device_rows,
                                          int64_t rows_bound, int64_t vec_per_row, int64_t F, bool interleaved) {
  cuda::WaitForPrimaryGrid();
  const int64_t rows = device_rows ? max(int64_t{0}, min(*device_rows, rows_bound)) : rows_bound;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / 32;
  for (int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; row < rows; row += warps) {
    const float w = gate[row * gate_stride];
    float dot = 0.0f;
    for (int64_t v = lane; v < vec_per_row; v += 32) {
      const int64_t col = v * kVec;
      const int64_t gc = GateVecCol(col, interleaved), uc = UpVecCol(col, F, interleaved);
      const __nv_bfloat16* hr = h + row * 2 * F;
      Vec8 g, u, d, zo, dg, du;
      g.raw = *reinterpret_cast<const uint4*>(hr + gc);
      u.raw = *reinterpret_cast<const uint4*>(hr + uc);
      d.raw = *reinterpret_cast<const uint4*>(dz + row * F + col);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 a = __bfloat1622float2(g.pair[j]);
        const float2 b = __bfloat1622float2(u.pair[j]);
        const float2 dd = __bfloat1622float2(d.pair[j]);
        const float sx = Sigmoid(a.x), sy = Sigmoid(a.y);
        const float silu_x = a.x * sx, silu_y = a.y * sy;
        const float s_x = silu_x * b.x, s_y = silu_y * b.y;
        dot = fmaf(dd.x, s_x, dot);
        dot = fmaf(dd.y, s_y, dot);
        const float gx = w * dd.x, gy = w * dd.y;  // dz = g * dz'
        const float dsilu_x = sx * (1.0f + a.x * (1.0f - sx)), dsilu_y = sy * (1.0f + a.y * (1.0f - sy));
        zo.pair[j] = __floats2bfloat162_rn(w * s_x, w * s_y);
        dg.pair[j] = __floats2bfloat162_rn(gx * b.x * dsilu_x, gy * b.y * dsilu_y);
        du.pair[j] = __floats2bfloat162_rn(gx * silu_x, gy * silu_y);
      }
      *reinterpret_cast<uint4*>(z + row * F + col) = zo.raw;
      __nv_bfloat16* dhr = dh + row * 2 * F;
      *reinterpret_cast<uint4*>(dhr + gc) = dg.raw;
      *reinterpret_cast<uint4*>(dhr + uc) = du.raw;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) dgate[row] = dot;
  }
}

__global__ void FillGroupPointersKernel(const GroupPointerParams p, void** table) {
  cuda::WaitForPrimaryGrid();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 3 * p.num_groups) return;
  const int o = i / p.num_groups, g = i - o * p.num_groups;
  table[i] = const_cast<char*>(p.base[o] + p.expert[g] * p.expert_stride[o] + p.row_offset[g] * p.row_stride[o]);
}

int GridFor(int64_t num_vec) {
  // Enough blocks to fill the GPU a few times over; the grid-stride loop covers the rest.
  const int64_t blocks = (num_vec + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 132 * 16 ? blocks : 132 * 16);
}

}  // namespace

cudaError_t LaunchSwigluForward(const __nv_bfloat16* h, __nv_bfloat16* z, int64_t rows, int64_t F, cudaStream_t stream,
                                const int64_t* device_rows, const float* gate, int64_t gate_stride, bool interleaved) {
  if (rows <= 0) return cudaSuccess;
  if (F % kVec != 0) return cudaErrorInvalidValue;
  const int64_t vec_per_row = F / kVec;
  return cuda::LaunchPdlError(SwigluForwardKernel, GridFor(rows * vec_per_row), kThreads, 0, stream, h, z, device_rows, rows,
                              vec_per_row, F, gate, gate_stride, interleaved);
}

cudaError_t LaunchSwigluBackwardGated(const __nv_bfloat16* h, const __nv_bfloat16* dz, const float* gate, int64_t gate_stride,
                                      __nv_bfloat16* z, __nv_bfloat16* dh, float* dgate, int64_t rows, int64_t F, cudaStream_t stream,
                                      const int64_t* device_rows, bool interleaved) {
  if (rows <= 0) return cudaSuccess;
  if (F % kVec != 0 || !gate || !dgate) return cudaErrorInvalidValue;
  const int64_t warps_per_block = kThreads / 32;
  const int64_t blocks = std::min<int64_t>((rows + warps_per_block - 1) / warps_per_block, 132 * 16);
  return cuda::LaunchPdlError(SwigluBackwardGatedKernel, static_cast<unsigned>(blocks), kThreads, 0, stream, h, dz, gate, gate_stride,
                              z, dh, dgate, device_rows, rows, F / kVec, F, interleaved);
}

cudaError_t LaunchSwigluBackward(const __nv_bfloat16* h, const __nv_bfloat16* dz, __nv_bfloat16* z, __nv_bfloat16* dh,
                                 int64_t rows, int64_t F, cudaStream_t stream, const int64_t* device_rows, bool interleaved) {
  if (rows <= 0) return cudaSuccess;
  if (F % kVec != 0) return cudaErrorInvalidValue;
  const int64_t vec_per_row = F / kVec;
  const int grid = GridFor(rows * vec_per_row);
  if (static_cast<const void*>(z) == dz || static_cast<const void*>(dh) == h)
    return cuda::LaunchPdlError(SwigluBackwardInPlaceKernel, grid, kThreads, 0, stream, h, dz, z, dh, device_rows, rows, vec_per_row,
                                F, interleaved);
  return cuda::LaunchPdlError(SwigluBackwardKernel, grid, kThreads, 0, stream, h, dz, z, dh, device_rows, rows, vec_per_row, F,
                              interleaved);
}

cudaError_t LaunchFillGroupPointers(const GroupPointerParams& p, void** table, cudaStream_t stream) {
  if (p.num_groups <= 0) return cudaSuccess;
  const int n = 3 * p.num_groups;
  return cuda::LaunchPdlError(FillGroupPointersKernel, (n + 127) / 128, 128, 0, stream, p, table);
}

}  // namespace rdep::kernels::internal
