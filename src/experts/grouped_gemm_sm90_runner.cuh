// The CUTLASS side of the sm_90a grouped GEMMs (grouped_gemm_sm90.h): one kernel configuration per
// (kind, tile), the runner that owns its device tables, and MakeTiledImpl<Tile>, which the translation
// unit of each tile (generated from grouped_gemm_sm90_tile.cu.in) instantiates; the builds of the
// configurations run in parallel. Include only from those files.
//
// The kernels: KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong} (TMA loads whose descriptors the
// kernel rewrites per group, or, with GroupedGemmMaps::kPrebuilt, reads from tables a small kernel writes before
// each launch: grouped_gemm_sm90_group_maps.cuh; wgmma, fp32 accumulation), a persistent grid of one CTA per SM walking the
// tiles of every group (PersistentTileSchedulerSm90Group); with no host copy of the problem sizes the
// grid is sized from the SM count. Epilogue: D = acc (+ beta*C for the fp32 weight gradients, C = D)
// through TMA stores; kNN_SwiGLU also writes z = swiglu(D) from the registers (swiglu_epilogue_sm90.cuh).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "experts/grouped_gemm_sm90.h"
#include "experts/grouped_gemm_sm90_group_maps.cuh"
#include "experts/swiglu_epilogue_sm90.cuh"
#include "launch/pdl.h"
#include "rdep/cuda/check.h"

namespace rdep::kernels::internal {

// A tile configuration: CTA tile M x N x 64, cluster M x N, and the kernel schedule (cooperative: two
// consumer warpgroups share one tile; pingpong: each consumer warpgroup owns a tile, their mainloops
// and epilogues alternate).
template <int kM, int kN, int kClusterM, int kClusterN, bool kPingpong>
struct TileConfig {
  using TileShape = cute::Shape<cute::Int<kM>, cute::Int<kN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using MainloopSchedule = cute::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

template <GroupedGemmTile T> struct TileOf;
template <> struct TileOf<GroupedGemmTile::kCoop128x128> : TileConfig<128, 128, 1, 1, false> {};
template <> struct TileOf<GroupedGemmTile::kCoop128x256> : TileConfig<128, 256, 1, 1, false> {};
template <> struct TileOf<GroupedGemmTile::kCoop128x128C1x2> : TileConfig<128, 128, 1, 2, false> {};
template <> struct TileOf<GroupedGemmTile::kCoop256x128C1x2> : TileConfig<256, 128, 1, 2, false> {};
template <> struct TileOf<GroupedGemmTile::kPing128x128> : TileConfig<128, 128, 1, 1, true> {};
template <> struct TileOf<GroupedGemmTile::kPing128x128C2x1> : TileConfig<128, 128, 2, 1, true> {};
template <> struct TileOf<GroupedGemmTile::kCoop256x128C2x1> : TileConfig<256, 128, 2, 1, false> {};
template <> struct TileOf<GroupedGemmTile::kCoop128x256C2x1> : TileConfig<128, 256, 2, 1, false> {};

namespace tiled {


using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
static_assert(sizeof(ProblemShape::UnderlyingProblemShape) == sizeof(GemmProblem), "GemmProblem mirrors cute::Shape<int,int,int>");

// One kernel configuration: bf16 A and B in the given layouts (CUTLASS's convention: A is M x K, B is
// K x N), D row-major, C (void = no source) for beta. FusionTree: void = D = alpha*acc + beta*C, else the
// epilogue visitor tree (kNN_SwiGLU's). kGroupMaps: every group's TMA descriptors built before the launch
// (grouped_gemm_sm90_group_maps.cuh) instead of rewritten in the kernel at each change of group.
template <class ElementD_, class LayoutA_, class LayoutB_, class ElementC_, class Tile, class FusionTree = void,
          bool kGroupMaps_ = false>
struct Config {
  static constexpr bool kSwiglu = !cute::is_void_v<FusionTree>;
  static constexpr bool kGroupMaps = kGroupMaps_;
  using Fusion = cute::conditional_t<kSwiglu, FusionTree, cutlass::epilogue::fusion::LinearCombination<ElementD_, float, ElementC_, float>>;
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementC = ElementC_;
  using ElementD = ElementD_;
  using LayoutA = LayoutA_;
  using LayoutB = LayoutB_;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 8, kAlignB = 8;  // 16 bytes of bf16
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using TileShape = typename Tile::TileShape;
  using ClusterShape = typename Tile::ClusterShape;
  using CutlassEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
      typename Tile::EpilogueSchedule, Fusion>::CollectiveOp;
  using Epilogue = cute::conditional_t<kGroupMaps, GroupMapsEpilogue<CutlassEpilogue>, CutlassEpilogue>;
  using CutlassMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA, ElementB, LayoutB*, kAlignB, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Tile::MainloopSchedule>::CollectiveOp;
  using Mainloop = cute::conditional_t<kGroupMaps, GroupMapsMainloop<CutlassMainloop>, CutlassMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
using SwigluTree = cutlass::epilogue::fusion::Sm90EVT<Sm90SwigluZStore, cutlass::epilogue::fusion::Sm90AccFetch>;
template <class Tile, bool kMaps> using ConfigNN = Config<cutlass::bfloat16_t, RowMajor, RowMajor, void, Tile, void, kMaps>;
template <class Tile, bool kMaps>  // B stored [n][k]
using ConfigNT = Config<cutlass::bfloat16_t, RowMajor, ColumnMajor, void, Tile, void, kMaps>;
template <class Tile, bool kMaps>  // A stored [k][m]
using ConfigTN_F32 = Config<float, ColumnMajor, RowMajor, float, Tile, void, kMaps>;
template <class Tile, bool kMaps> using ConfigTN_BF16 = Config<cutlass::bfloat16_t, ColumnMajor, RowMajor, void, Tile, void, kMaps>;
template <class Tile, bool kMaps> using ConfigNN_SwiGLU = Config<cutlass::bfloat16_t, RowMajor, RowMajor, void, Tile, SwigluTree, kMaps>;

// A device allocation freed with its owner.
struct DeviceBytes {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBytes() = default;
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() {
    if (ptr) cudaFree(ptr);
  }
  Status Allocate(size_t n) {
    bytes = n;
    return cuda::CudaStatus(cudaMalloc(&ptr, n > 0 ? n : 1), "cudaMalloc (grouped GEMM tables)", __FILE__, __LINE__);
  }
};

// Every stride of these kernels has one dynamic entry (the leading dimension) beside a static 1 (and
// a static 0 for the group mode); make_cute_packed_stride sets it from the shape's M (column-major
// kinds) or K (row-major kinds): passing ld for both sets it to ld either way.
template <class Stride>
Stride LeadingDimStride(int64_t ld) {
  return cutlass::make_cute_packed_stride(Stride{}, cute::make_shape(static_cast<int>(ld), static_cast<int>(ld), 1));
}

template <class Cfg>
class Runner final : public GroupedGemmSm90 {
 public:
  using Gemm = typename Cfg::Gemm;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideC = typename Gemm::GemmKernel::InternalStrideC;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;
  using ElementA = typename Cfg::ElementA;
  using ElementB = typename Cfg::ElementB;
  using ElementD = typename Cfg::ElementD;
  using ElementC = cute::conditional_t<cute::is_void_v<typename Cfg::ElementC>, ElementD, typename Cfg::ElementC>;
  static constexpr bool kHasSource = !cute::is_void_v<typename Cfg::ElementC>;

  Runner(GroupedGemmKind kind, GroupedGemmTile tile, int32_t groups, int device)
      : kind_(kind), tile_(tile), groups_(groups), device_(device) {}

  Status Init(int64_t lda, int64_t ldb, int64_t ldd) {
    const auto G = static_cast<size_t>(groups_);
    RDEP_RETURN_IF_ERROR(problems_.Allocate(G * sizeof(GemmProblem)));
    if constexpr (Cfg::kGroupMaps) RDEP_RETURN_IF_ERROR(maps_.Allocate(4 * G * sizeof(cute::TmaDescriptor)));
    RDEP_RETURN_IF_ERROR(ptr_a_.Allocate(G * sizeof(void*)));
    RDEP_RETURN_IF_ERROR(ptr_b_.Allocate(G * sizeof(void*)));
    RDEP_RETURN_IF_ERROR(ptr_d_.Allocate(G * sizeof(void*)));
    RDEP_RETURN_IF_ERROR(stride_a_.Allocate(G * sizeof(StrideA)));
    RDEP_RETURN_IF_ERROR(stride_b_.Allocate(G * sizeof(StrideB)));
    RDEP_RETURN_IF_ERROR(stride_d_.Allocate(G * sizeof(StrideD)));
    if constexpr (Cfg::kSwiglu) {
      if (ldd % 16 != 0)
        return InvalidArgument(std::string("grouped GEMM ") + GroupedGemmKindName(kind_) + ": ldd = " + std::to_string(ldd) +
                               " must be a multiple of 16 (2F, F a multiple of 8)");
      ldz_ = ldd / 2;
      RDEP_RETURN_IF_ERROR(ptr_z_.Allocate(G * sizeof(void*)));
      RDEP_RETURN_IF_ERROR(ptr_gate_.Allocate(G * sizeof(void*)));
      RDEP_RETURN_IF_ERROR(gate_stride_.Allocate(sizeof(int64_t)));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(ptr_z_.ptr, 0, G * sizeof(void*)));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(ptr_gate_.ptr, 0, G * sizeof(void*)));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(gate_stride_.ptr, 0, sizeof(int64_t)));
    }
    const std::vector<StrideA> sa(G, LeadingDimStride<StrideA>(lda));
    const std::vector<StrideB> sb(G, LeadingDimStride<StrideB>(ldb));
    const std::vector<StrideD> sd(G, LeadingDimStride<StrideD>(ldd));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(stride_a_.ptr, sa.data(), G * sizeof(StrideA), cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(stride_b_.ptr, sb.data(), G * sizeof(StrideB), cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(stride_d_.ptr, sd.data(), G * sizeof(StrideD), cudaMemcpyHostToDevice));
    // No group has rows yet: a Run before the caller fills the tables writes nothing.
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(problems_.ptr, 0, G * sizeof(GemmProblem)));
    hw_ = cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename Gemm::GemmKernel>(device_);
    typename Gemm::Arguments args = Arguments(0.0f);
    if (gemm_.can_implement(args) != cutlass::Status::kSuccess)
      return InvalidArgument(std::string("grouped GEMM ") + GroupedGemmKindName(kind_) + ": CUTLASS cannot implement lda=" +
                             std::to_string(lda) + " ldb=" + std::to_string(ldb) + " ldd=" + std::to_string(ldd));
    RDEP_RETURN_IF_ERROR(workspace_.Allocate(Gemm::get_workspace_size(args)));
    return Prepare(0.0f, nullptr);
  }

  GroupedGemmKind kind() const override { return kind_; }
  GroupedGemmTile tile() const override { return tile_; }
  GroupedGemmMaps maps() const override { return Cfg::kGroupMaps ? GroupedGemmMaps::kPrebuilt : GroupedGemmMaps::kInKernel; }
  int32_t num_groups() const override { return groups_; }
  size_t device_bytes() const override {
    return problems_.bytes + ptr_a_.bytes + ptr_b_.bytes + ptr_d_.bytes + stride_a_.bytes + stride_b_.bytes + stride_d_.bytes +
           workspace_.bytes + ptr_z_.bytes + ptr_gate_.bytes + gate_stride_.bytes + maps_.bytes;
  }
  GemmProblem* problems() override { return static_cast<GemmProblem*>(problems_.ptr); }
  const void** ptr_a() override { return static_cast<const void**>(ptr_a_.ptr); }
  const void** ptr_b() override { return static_cast<const void**>(ptr_b_.ptr); }
  void** ptr_d() override { return static_cast<void**>(ptr_d_.ptr); }
  void** ptr_z() override { return static_cast<void**>(ptr_z_.ptr); }
  const float** ptr_gate() override { return static_cast<const float**>(ptr_gate_.ptr); }
  int64_t* gate_stride() override { return static_cast<int64_t*>(gate_stride_.ptr); }

  Status LimitSms(int32_t sms) override {
    if (sms < 0) return InvalidArgument("grouped GEMM: sms must be >= 0 (0 = every SM), got " + std::to_string(sms));
    const int device_sms = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device_);
    hw_ = cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename Gemm::GemmKernel>(device_, sms == 0 ? 0 : std::min(sms, device_sms));
    if (sms > 0) hw_.max_active_clusters = 0;  // else clustered tiles size their grid by the whole device's occupancy
    typename Gemm::Arguments args = Arguments(0.0f);
    if (Gemm::get_workspace_size(args) > workspace_.bytes)  // a smaller grid needs no more; checked all the same
      return InternalError(std::string("grouped GEMM ") + GroupedGemmKindName(kind_) + ": workspace grows with " + std::to_string(sms) + " SMs");
    return Prepare(prepared_beta_ < 0.0f ? 0.0f : prepared_beta_, nullptr);
  }

  Status Run(float beta, cudaStream_t stream) override {
    if (beta != 0.0f && !kHasSource)
      return InvalidArgument(std::string("grouped GEMM ") + GroupedGemmKindName(kind_) + ": beta must be 0 (no source operand)");
    if (beta != prepared_beta_) RDEP_RETURN_IF_ERROR(Prepare(beta, stream));
    if constexpr (Cfg::kGroupMaps) {  // every group's descriptors from the tables the caller just filled
      RDEP_LAUNCH_PDL(BuildGroupMapsKernel<typename Gemm::GemmKernel>, dim3(static_cast<unsigned>(groups_), kGroupMapOperands), dim3(32),
                      0, stream, gemm_.params());
    }
    if (gemm_.run(stream) != cutlass::Status::kSuccess)
      return InternalError(std::string("grouped GEMM ") + GroupedGemmKindName(kind_) + ": CUTLASS run failed");
    return cuda::CudaStatus(cudaGetLastError(), "grouped GEMM launch", __FILE__, __LINE__);
  }

 private:
  // Builds the kernel parameters (TMA descriptors, the shared-memory attribute) for `beta`. Every
  // other argument is fixed at Create (the tables' addresses, strides, hardware), so a Run with the
  // same beta launches the parameters built last: no host work beyond the launch. Launches nothing.
  Status Prepare(float beta, cudaStream_t stream) {
    if (gemm_.initialize(Arguments(beta), workspace_.ptr, stream) != cutlass::Status::kSuccess)
      return InternalError(std::string("grouped GEMM ") + GroupedGemmKindName(kind_) + ": CUTLASS initialize failed");
    prepared_beta_ = beta;
    return Status::Ok();
  }

  typename Gemm::Arguments Arguments(float beta) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {groups_, static_cast<typename ProblemShape::UnderlyingProblemShape*>(problems_.ptr), nullptr};
    args.mainloop.ptr_A = static_cast<const ElementA**>(ptr_a_.ptr);
    args.mainloop.dA = static_cast<StrideA*>(stride_a_.ptr);
    args.mainloop.ptr_B = static_cast<const ElementB**>(ptr_b_.ptr);
    args.mainloop.dB = static_cast<StrideB*>(stride_b_.ptr);
    if constexpr (Cfg::kSwiglu) {
      auto& z = args.epilogue.thread.op_1;  // Sm90EVT<node, child>: op_0 the child (AccFetch), op_1 the node
      z.ptr_z = static_cast<__nv_bfloat16**>(ptr_z_.ptr);
      z.ptr_gate = static_cast<const float* const*>(ptr_gate_.ptr);
      z.gate_stride = static_cast<const int64_t*>(gate_stride_.ptr);
      z.ldz = ldz_;
    } else {
      auto& fusion = args.epilogue.thread;
      fusion.alpha = 1.0f;
      fusion.beta = beta;
      fusion.alpha_ptr = nullptr;
      fusion.beta_ptr = nullptr;
    }
    if constexpr (kHasSource) {  // C is D: the weight gradient accumulates in place
      args.epilogue.ptr_C = static_cast<const ElementC**>(ptr_d_.ptr);
      args.epilogue.dC = static_cast<StrideC*>(stride_d_.ptr);
    } else {
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    }
    args.epilogue.ptr_D = static_cast<ElementD**>(ptr_d_.ptr);
    args.epilogue.dD = static_cast<StrideD*>(stride_d_.ptr);
    if constexpr (Cfg::kGroupMaps) {  // tables of G descriptors each: A, B, D, C
      const auto* maps = static_cast<const cute::TmaDescriptor*>(maps_.ptr);
      args.mainloop.maps_a = maps;
      args.mainloop.maps_b = maps + groups_;
      args.epilogue.maps_d = maps + 2 * groups_;
      args.epilogue.maps_c = maps + 3 * groups_;
    }
    args.hw_info = hw_;
    return args;
  }

  GroupedGemmKind kind_;
  GroupedGemmTile tile_;
  int32_t groups_;
  int device_;
  cutlass::KernelHardwareInfo hw_;
  DeviceBytes problems_, ptr_a_, ptr_b_, ptr_d_, stride_a_, stride_b_, stride_d_, workspace_;
  DeviceBytes ptr_z_, ptr_gate_, gate_stride_;  // kNN_SwiGLU only
  DeviceBytes maps_;                            // kGroupMaps only: 4 x G TMA descriptors
  int64_t ldz_ = 0;
  Gemm gemm_;
  float prepared_beta_ = -1.0f;  // the beta gemm_'s parameters were built for (0 or 1 after Init)
};

template <class Cfg>
StatusOr<std::unique_ptr<GroupedGemmSm90>> Make1(GroupedGemmKind kind, GroupedGemmTile tile, int32_t groups, int64_t lda,
                                                 int64_t ldb, int64_t ldd, int device) {
  auto r = std::make_unique<Runner<Cfg>>(kind, tile, groups, device);
  RDEP_RETURN_IF_ERROR(r->Init(lda, ldb, ldd));
  return std::unique_ptr<GroupedGemmSm90>(std::move(r));
}

// The configuration of one kind (ConfigNN, ...) with the descriptors `maps` asks for.
template <template <class, bool> class Cfg, class Tile>
StatusOr<std::unique_ptr<GroupedGemmSm90>> Make(GroupedGemmKind kind, GroupedGemmTile tile, GroupedGemmMaps maps, int32_t groups,
                                                int64_t lda, int64_t ldb, int64_t ldd, int device) {
  if (maps == GroupedGemmMaps::kPrebuilt) return Make1<Cfg<Tile, true>>(kind, tile, groups, lda, ldb, ldd, device);
  return Make1<Cfg<Tile, false>>(kind, tile, groups, lda, ldb, ldd, device);
}

}  // namespace tiled

// The body of each tile's MakeTiled.
template <GroupedGemmTile T>
StatusOr<std::unique_ptr<GroupedGemmSm90>> MakeTiledImpl(GroupedGemmKind kind, int32_t groups, int64_t lda, int64_t ldb,
                                                         int64_t ldd, int device, GroupedGemmMaps maps) {
  using Tile = TileOf<T>;
  switch (kind) {
    case GroupedGemmKind::kNN: return tiled::Make<tiled::ConfigNN, Tile>(kind, T, maps, groups, lda, ldb, ldd, device);
    case GroupedGemmKind::kNT: return tiled::Make<tiled::ConfigNT, Tile>(kind, T, maps, groups, lda, ldb, ldd, device);
    case GroupedGemmKind::kTN_F32: return tiled::Make<tiled::ConfigTN_F32, Tile>(kind, T, maps, groups, lda, ldb, ldd, device);
    case GroupedGemmKind::kTN_BF16: return tiled::Make<tiled::ConfigTN_BF16, Tile>(kind, T, maps, groups, lda, ldb, ldd, device);
    case GroupedGemmKind::kNN_SwiGLU:
      if constexpr (GroupedGemmTileHasSwiglu(T))
        return tiled::Make<tiled::ConfigNN_SwiGLU, Tile>(kind, T, maps, groups, lda, ldb, ldd, device);
      else
        return Unavailable(std::string("grouped GEMM NN + SwiGLU: tile ") + GroupedGemmTileName(T) +
                             " is not built with the SwiGLU epilogue (GroupedGemmTileHasSwiglu)");
  }
  return InvalidArgument("grouped GEMM: unknown kind");
}

}  // namespace rdep::kernels::internal
