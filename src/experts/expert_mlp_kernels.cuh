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
// Requires F % 8 == 0 and 16-byte aligned pointers (16-byte vector loads). With device_rows (a device
// int64), the rows are min(*device_rows, rows): rows is then the host's upper bound (sizes the grid),
// and the launch needs no host copy of the count.
cudaError_t LaunchSwigluForward(const __nv_bfloat16* h, __nv_bfloat16* z, int64_t rows, int64_t F, cudaStream_t stream,
                                const int64_t* device_rows = nullptr);

// From the saved pre-activations h [rows][2F] and dz [rows][F]:
//   z[r][f]      = silu(a) * b                      (recomputed for dW2)
//   dh[r][f]     = dz * b * silu'(a),  dh[r][F + f] = dz * silu(a)      a = h[r][f], b = h[r][F + f]
// fp32 math, bf16 stores. Same requirements as the forward. In place allowed: z may be dz and dh may be h.
cudaError_t LaunchSwigluBackward(const __nv_bfloat16* h, const __nv_bfloat16* dz, __nv_bfloat16* z, __nv_bfloat16* dh,
                                 int64_t rows, int64_t F, cudaStream_t stream, const int64_t* device_rows = nullptr);

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
