// Grouped GEMMs whose TMA descriptors are built for every group before the launch (GroupedGemmMaps::kPrebuilt).
//
// CUTLASS's ptr-array kernels keep one descriptor per operand per CTA and rewrite it whenever a CTA's next tile
// belongs to another group: the producer warp patches A's and B's in shared memory and copies them out with a
// release fence, each consumer warpgroup does the same for D after waiting for its TMA stores to leave shared
// memory, and the epilogue's load warp for C (with a source operand). With E_loc = 16 groups of about one wave of
// tiles each, a CTA changes group at nearly every tile, and that rewrite sits on the consumers' path
// (docs/perf-notes.md, thirty-fifth session).
//
// Here a small kernel (BuildGroupMapsKernel, one warp per group and operand) writes each group's descriptors into
// tables in device memory after the caller's tables are filled, and the collectives below, derived from CUTLASS's,
// make a group change a pointer change: their tensormaps_perform_update points the CTA at the group's prebuilt
// descriptor and their tensormaps_cp_fence_release does nothing (nothing was written). CUTLASS's kernels call
// these members by name, so only the descriptor handling changes; the loads, the MMAs and the epilogues are
// CUTLASS's. The acquire fence before a descriptor's first use stays. Include only from
// grouped_gemm_sm90_runner.cuh.
#pragma once

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "launch/pdl.h"

namespace rdep::kernels::internal::tiled {

// The mainloop: CUTLASS's ptr-array TMA/wgmma collective, its A and B descriptors read from per-group tables.
template <class Base>
struct GroupMapsMainloop : Base {
  struct Arguments : Base::Arguments {
    const cute::TmaDescriptor* maps_a = nullptr;  // [groups], built by BuildGroupMapsKernel
    const cute::TmaDescriptor* maps_b = nullptr;
  };
  struct Params : Base::Params {
    const cute::TmaDescriptor* maps_a = nullptr;
    const cute::TmaDescriptor* maps_b = nullptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.maps_a = args.maps_a;
    p.maps_b = args.maps_b;
    return p;
  }

  // The descriptors in use: set by tensormaps_perform_update before the first load of each group.
  CUTLASS_DEVICE auto tensormaps_init(Params const&, typename Base::TensorMapStorage&, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor*>(nullptr), static_cast<cute::TmaDescriptor*>(nullptr));
  }
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(typename Base::TensorMapStorage&, Params const& params,
                                                cute::tuple<cute::TmaDescriptor*, cute::TmaDescriptor*>& maps,
                                                ProblemShapeMNKL, int32_t next_group) {
    cute::get<0>(maps) = const_cast<cute::TmaDescriptor*>(params.maps_a + next_group);
    cute::get<1>(maps) = const_cast<cute::TmaDescriptor*>(params.maps_b + next_group);
  }
  template <class MapA, class MapB>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(typename Base::TensorMapStorage&, cute::tuple<MapA, MapB> const&) {}
};

// The epilogue: CUTLASS's ptr-array TMA epilogue, its D (and C) descriptors read from per-group tables.
template <class Base>
struct GroupMapsEpilogue : Base {
  using Base::Base;
  struct Arguments : Base::Arguments {
    const cute::TmaDescriptor* maps_c = nullptr;  // [groups]; unused without a source operand
    const cute::TmaDescriptor* maps_d = nullptr;
  };
  struct Params : Base::Params {
    const cute::TmaDescriptor* maps_c = nullptr;
    const cute::TmaDescriptor* maps_d = nullptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.maps_c = args.maps_c;
    p.maps_d = args.maps_d;
    return p;
  }

  CUTLASS_DEVICE auto load_init(Params const&, typename Base::TensorMapStorage&, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor*>(nullptr));
  }
  CUTLASS_DEVICE auto store_init(Params const&, typename Base::TensorMapStorage&, int32_t, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor*>(nullptr));
  }
  template <bool IsLoad, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(typename Base::TensorMapStorage&, Params const& params,
                                                cute::TmaDescriptor*& map, ProblemShapeMNKL, int32_t next_group,
                                                int32_t = 0) {
    map = const_cast<cute::TmaDescriptor*>((IsLoad ? params.maps_c : params.maps_d) + next_group);
  }
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(typename Base::TensorMapStorage&, cute::TmaDescriptor const*, int32_t = 0) {}
};

// One descriptor: the TMA atom's descriptor with the group's address, extents and strides (bytes), staged in
// shared memory and copied to `dst` with a release fence (the whole warp calls it).
template <class Atom, class Element, class Layout>
__device__ void BuildGroupMap(Atom const& atom, Element const* ptr, Layout const& layout, cute::TmaDescriptor& staging,
                              const cute::TmaDescriptor* dst) {
  if (cute::elect_one_sync()) {
    staging = *atom.get_tma_descriptor();
    cute::tma_descriptor_replace_addr_in_shared_mem(staging, ptr);
    cute::array<uint32_t, 5> extents = {1, 1, 1, 1, 1};
    cute::array<uint64_t, 5> strides = {0, 0, 0, 0, 0};
    cute::detail::fill_tma_gmem_shape_stride(atom, cute::make_tensor(static_cast<Element const*>(nullptr), layout), extents,
                                             strides);
    for (uint64_t& s : strides) s = s * cute::sizeof_bits_v<Element> / 8;
    cute::tma_descriptor_replace_dims_strides_in_shared_mem(staging, extents, strides);
  }
  __syncwarp();
  cute::tma_descriptor_cp_fence_release(dst, staging);
  __syncwarp();
}

// The grid is groups x 4 operands, a warp each (the releases of one group's descriptors in parallel): block (g, o)
// writes group g's descriptor o. D (m x n) and, with a source operand, C whenever the group has tiles (m, n > 0:
// CUTLASS's scheduler counts tiles from m and n); A (m x k) and B (n x k) when it also has a K loop (k > 0; callers
// give such groups m = 0 anyway, grouped_gemm_sm90.h). A group without tiles gets none: its descriptors are never
// read. Launched with PDL (launch/pdl.h): it waits for the stream's previous kernel (which may be this GEMM reading
// the tables) before anything else.
enum GroupMapOperand : unsigned { kMapA = 0, kMapB = 1, kMapD = 2, kMapC = 3, kGroupMapOperands = 4 };

template <class Kernel>
__global__ void __launch_bounds__(32) BuildGroupMapsKernel(typename Kernel::Params params) {
  rdep::cuda::WaitForPrimaryGrid();
  __shared__ cute::TmaDescriptor staging;
  const int g = static_cast<int>(blockIdx.x);
  const auto problem = params.problem_shape.get_problem_shape(g);
  const int m = cute::get<0>(problem), n = cute::get<1>(problem), k = cute::get<2>(problem);
  if (m <= 0 || n <= 0) return;
  auto const& ml = params.mainloop;
  auto const& ep = params.epilogue;
  using cute::_1;
  switch (blockIdx.y) {
    case kMapA:
      if (k > 0)
        BuildGroupMap(ml.tma_load_a, ml.ptr_A[g], cute::make_layout(cute::make_shape(m, k, _1{}), ml.dA[g]), staging, ml.maps_a + g);
      break;
    case kMapB:
      if (k > 0)
        BuildGroupMap(ml.tma_load_b, ml.ptr_B[g], cute::make_layout(cute::make_shape(n, k, _1{}), ml.dB[g]), staging, ml.maps_b + g);
      break;
    case kMapD:
      BuildGroupMap(ep.tma_store_d, ep.ptr_D[g], cute::make_layout(cute::make_shape(m, n, _1{}), ep.dD[g]), staging, ep.maps_d + g);
      break;
    default:
      if constexpr (!cute::is_void_v<typename Kernel::CollectiveEpilogue::ElementC>) {
        if (ep.ptr_C != nullptr)
          BuildGroupMap(ep.tma_load_c, ep.ptr_C[g], cute::make_layout(cute::make_shape(m, n, _1{}), ep.dC[g]), staging, ep.maps_c + g);
      }
  }
}

}  // namespace rdep::kernels::internal::tiled
