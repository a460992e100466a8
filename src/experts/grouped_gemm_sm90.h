// Grouped GEMMs for sm_90a whose per-group problem sizes and operand pointers live in DEVICE memory
// (CUTLASS 3 ptr-array kernels: TMA + wgmma, warp-specialized cooperative or pingpong, persistent tile
// scheduler over all groups; the tile configuration is chosen at Create from GroupedGemmTile), so a caller can fill them in a kernel from device-resident per-expert row counts
// and launch without a host round trip. bf16 operands, fp32 accumulation. Internal to rdep::experts.
//
// One GroupedGemmSm90 serves one GEMM of the expert MLP for G groups (local experts). Its kinds:
//   kNN      D[m][n] bf16 = A[m][k] . B[k][n]            A, B row-major     (forward: x.W1, z.W2)
//   kNT      D[m][n] bf16 = A[m][k] . B[n][k]^T          A, B row-major     (dgrad: dout.W2^T, dh.W1^T)
//   kTN_F32  D[m][n] fp32 = A[k][m]^T . B[k][n] + beta.D  A, B row-major     (wgrad: z^T.dout, x^T.dh)
//   kTN_BF16 D[m][n] bf16 = A[k][m]^T . B[k][n]          (wgrad into bf16 gradients, overwritten)
//   kNN_SwiGLU  kNN, and z[m][j] = silu(D[m][gate j]) * D[m][up j] (times the row's gate if given) with
//            D's columns as rdep::mlp::GateUp::kInterleaved8 (forward: h = x.W1 and z in one pass);
//            z's row length is ldd / 2; tables ptr_z(), ptr_gate() per group, *gate_stride() (device)
// Every operand is dense row-major with its row length fixed per kind and object (lda, ldb, ldd given
// at Create), so only the group's (m, n, k) and its three pointers change from call to call: the
// caller writes them into problems(), ptr_a(), ptr_b(), ptr_d() (device arrays of G entries) on the
// stream before Run. A group with m, n or k = 0 must be given m = 0 (no tiles: its D is not written).
// Requirements (checked at Create): lda, ldb, ldd multiples of 8 (16-byte rows for TMA); every pointer
// written into the tables 16-byte aligned.
//
// Exercised by: build/src/experts/experts_test --gtest_filter='GroupedGemmSm90*:CutlassExpertCompute*'
// Tiles measured against each other: build/bin/rdep bench gemm --path cutlass --cutlass-tiles all
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "rdep/status.h"

namespace rdep::kernels::internal {

enum class GroupedGemmKind { kNN, kNT, kTN_F32, kTN_BF16, kNN_SwiGLU };
const char* GroupedGemmKindName(GroupedGemmKind k);

// The kernel configurations built (grouped_gemm_sm90_runner.cuh): CTA tile M x N (x 64 of K), cluster
// (C<m>x<n>; none = 1x1), cooperative (two consumer warpgroups on one tile) or pingpong (a tile per
// consumer warpgroup, alternating). Names: coop_128x128, coop_128x256, coop_128x128_c1x2, ...
enum class GroupedGemmTile {
  kCoop128x128,
  kCoop128x256,
  kCoop128x128C1x2,
  kCoop256x128C1x2,
  kPing128x128,
  kPing128x128C2x1,
  kCoop256x128C2x1,
  kCoop128x256C2x1,
};
inline constexpr GroupedGemmTile kGroupedGemmTiles[] = {GroupedGemmTile::kCoop128x128,     GroupedGemmTile::kCoop128x256,
                                                       GroupedGemmTile::kCoop128x128C1x2, GroupedGemmTile::kCoop256x128C1x2,
                                                       GroupedGemmTile::kPing128x128,     GroupedGemmTile::kPing128x128C2x1,
                                                       GroupedGemmTile::kCoop256x128C2x1, GroupedGemmTile::kCoop128x256C2x1};
const char* GroupedGemmTileName(GroupedGemmTile t);
// The tiles built with kNN_SwiGLU (each kind a tile has costs compile time; these are GEMM1's candidates).
constexpr bool GroupedGemmTileHasSwiglu(GroupedGemmTile t) {
  return t == GroupedGemmTile::kCoop128x128 || t == GroupedGemmTile::kCoop128x256 || t == GroupedGemmTile::kPing128x128;
}
StatusOr<GroupedGemmTile> ParseGroupedGemmTile(const std::string& name);

// How a kernel gets each group's TMA descriptors (A, B, D and C). kInKernel: CUTLASS's ptr-array kernels keep one
// per operand per CTA and rewrite it whenever the CTA's next tile is in another group. kPrebuilt: Run first
// launches a small kernel that writes every group's descriptors into tables (4 x G x 128 bytes), and a change of
// group in the GEMM is a change of pointer (grouped_gemm_sm90_group_maps.cuh). The results are the same bits. On an
// H200 the expert MLP's forward+backward took 1.5-3% less with kPrebuilt at E_loc = 16 and mu 128..3072, the W = 1
// Moonlight layer's 3-4% less (docs/perf-notes.md, thirty-fifth session); kInKernel stays for the A/B.
enum class GroupedGemmMaps { kInKernel, kPrebuilt };
const char* GroupedGemmMapsName(GroupedGemmMaps m);
// RDEP_GROUPED_GEMM_MAPS=prebuilt|kernel in the environment, else kPrebuilt. An other value is InvalidArgument.
StatusOr<GroupedGemmMaps> DefaultGroupedGemmMaps();

// One group's problem size, as the kernel reads it (cute::Shape<int, int, int>: m, n, k).
struct GemmProblem {
  int32_t m, n, k;
};

class GroupedGemmSm90 {
 public:
  // lda, ldb, ldd: the row lengths (elements) of A, B and D as stored (row-major), the same for every
  // group. device: the GPU the arrays and workspace live on.
  // maps: null = DefaultGroupedGemmMaps().
  static StatusOr<std::unique_ptr<GroupedGemmSm90>> Create(GroupedGemmKind kind, int32_t num_groups, int64_t lda,
                                                           int64_t ldb, int64_t ldd, int device,
                                                           GroupedGemmTile tile = GroupedGemmTile::kCoop128x128,
                                                           const GroupedGemmMaps* maps = nullptr);
  virtual ~GroupedGemmSm90() = default;
  virtual GroupedGemmKind kind() const = 0;
  virtual GroupedGemmTile tile() const = 0;
  virtual GroupedGemmMaps maps() const = 0;
  virtual int32_t num_groups() const = 0;
  virtual size_t device_bytes() const = 0;

  // Device arrays of num_groups() entries the caller fills before Run.
  virtual GemmProblem* problems() = 0;
  virtual const void** ptr_a() = 0;
  virtual const void** ptr_b() = 0;
  virtual void** ptr_d() = 0;
  // kNN_SwiGLU only (null otherwise): per group, its first z row and its first row's gate (null = no gate);
  // one device int64, the gates' stride in floats.
  virtual void** ptr_z() { return nullptr; }
  virtual const float** ptr_gate() { return nullptr; }
  virtual int64_t* gate_stride() { return nullptr; }

  // The persistent grid's size: at most `sms` CTAs (one per SM), leaving the others free for kernels on
  // other streams (the overlapped layer's transport); 0 = every SM of the device. The tiles each CTA
  // computes change, not how any tile is computed: results are the same bits. Launches nothing.
  virtual Status LimitSms(int32_t sms) = 0;

  // Enqueues the grouped GEMM on `stream` (with kPrebuilt, the descriptors' kernel first). beta (kTN_F32 only): 0
  // overwrites D, 1 adds to it. Never synchronizes the host; capturable in a CUDA graph.
  virtual Status Run(float beta, cudaStream_t stream) = 0;
};

// Whether this build has the CUTLASS kernels and the device can run them (sm_90); why not otherwise.
bool GroupedGemmSm90Available(int device, std::string* why);

// Create's work for one tile, defined in that tile's translation unit (generated from
// grouped_gemm_sm90_tile.cu.in by src/experts/CMakeLists.txt).
template <GroupedGemmTile T>
StatusOr<std::unique_ptr<GroupedGemmSm90>> MakeTiled(GroupedGemmKind kind, int32_t groups, int64_t lda, int64_t ldb,
                                                     int64_t ldd, int device, GroupedGemmMaps maps);

}  // namespace rdep::kernels::internal
