// Internal launchers of the fused element-wise kernels of the expert MLP (src/experts/expert_mlp.cc
// drives them between the GEMMs). Plain declarations: this header compiles in .cc and .cu files.
// Launchers return the launch's cudaError_t (cudaErrorInvalidValue for an unsupported F); the host
// side turns it into a Status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>


namespace rdep::kernels::internal {

// z[r][f] = silu(h[r][f]) * h[r][F + f] for rows [0, rows). h row stride 2F, z row stride F.
// interleaved: h's columns as rdep::mlp::GateUp::kInterleaved8 (gate f at 16*(f/8) + f%8, up 8 after it)
// instead of kSplit (the columns written above); the same for every launcher below.
// Requires F % 8 == 0 and 16-byte aligned pointers (16-byte vector loads). With device_rows (a device
// int64), the rows are min(*device_rows, rows): rows is then the host's upper bound (sizes the grid),
// and the launch needs no host copy of the count.
// With gate (non-null), row r's z is scaled by gate[r * gate_stride] before the one bf16 rounding: the gate
// multiplied before W2 (seeds 002 section 4).
cudaError_t LaunchSwigluForward(const __nv_bfloat16* h, __nv_bfloat16* z, int64_t rows, int64_t F, cudaStream_t stream,
                                const int64_t* device_rows = nullptr, const float* gate = nullptr, int64_t gate_stride = 1,
                                bool interleaved = false);

// From the saved pre-activations h [rows][2F] and dz [rows][F]:
//   z[r][f]      = silu(a) * b                      (recomputed for dW2)
//   dh[r][f]     = dz * b * silu'(a),  dh[r][F + f] = dz * silu(a)      a = h[r][f], b = h[r][F + f]
// fp32 math, bf16 stores. Same requirements as the forward. In place allowed: z may be dz and dh may be h.
cudaError_t LaunchSwigluBackward(const __nv_bfloat16* h, const __nv_bfloat16* dz, __nv_bfloat16* z, __nv_bfloat16* dh,
                                 int64_t rows, int64_t F, cudaStream_t stream, const int64_t* device_rows = nullptr,
                                 bool interleaved = false);

// The same with the gate before W2, one warp per row: dz is the unweighted dz' = dy.W2^T of the row, g its gate
// (gate[r * gate_stride]), s = swiglu(h):
//   dgate[r] = <dz', s>   (fp32, each lane's features in order, then a fixed shuffle tree: deterministic)
//   z[r]     = g * s      (for dW2 = z^T.dy)
//   dh[r]    = swiglu'(h) with dz = g * dz'
// In place allowed as above (z == dz, dh == h). rows bound and device_rows as above; dgate [rows].
cudaError_t LaunchSwigluBackwardGated(const __nv_bfloat16* h, const __nv_bfloat16* dz, const float* gate, int64_t gate_stride,
                                      __nv_bfloat16* z, __nv_bfloat16* dh, float* dgate, int64_t rows, int64_t F, cudaStream_t stream,
                                      const int64_t* device_rows = nullptr, bool interleaved = false);

// Pointer tables for a grouped GEMM: for group g (expert e_g, first row off_g) and operand o,
//   table[o * num_groups + g] = base_o + e_g * expert_stride_o + off_g * row_stride_o   (strides in bytes).
inline constexpr int kMaxGroups = 256;  // keeps the kernel parameter block under 4 KiB
// (placeholder);
struct GroupPointerParams {
  const char* base[3];
  int64_t expert_stride[3];
  int64_t row_stride[3];
  int num_groups;
  int expert[kMaxGroups];
  int64_t row_offset[kMaxGroups];
};
cudaError_t LaunchFillGroupPointers(const GroupPointerParams& p, void** table, cudaStream_t stream);

}  // namespace rdep::kernels::internal
