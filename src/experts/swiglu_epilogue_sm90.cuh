// GEMM1's SwiGLU in its epilogue (issue 14 item 1): an epilogue visitor node for CUTLASS's sm90 TMA
// warp-specialized epilogues (the ptr-array kind of grouped_gemm_sm90_runner.cuh) that, beside the usual
// D = h store, writes z = silu(h_gate) * h_up (times the row's gate, when given) straight from the
// accumulator registers into the group's z rows. W1 must place its columns as GateUp::kInterleaved8
// (gate feature j at column 16*(j/8) + j%8, up feature j 8 columns after it): a wgmma accumulator
// fragment holds columns 8c + 2q + {0, 1} for every c, so each thread has both columns of its features,
// and z needs no second pass over h. Tree: Sm90EVT<Sm90SwigluZStore, Sm90AccFetch> (D = acc).
//
// Rounding is the element-wise kernel's (swiglu_math.cuh): a and b are the bf16 values stored in h, so
// the fused and unfused forwards give the same z bits.
// Include only from grouped_gemm_sm90_runner.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "experts/swiglu_math.cuh"

namespace rdep::kernels::internal {

struct Sm90SwigluZStore {
  struct SharedStorage {};
  // Device tables of one entry per group, filled by the caller before each launch (as the GEMM's own
  // pointer tables are): the group's first z row, its first row's gate (a null entry or table: no gate),
  // and the gates' stride in floats (one device value for all groups).
  struct Arguments {
    __nv_bfloat16** ptr_z = nullptr;
    const float* const* ptr_gate = nullptr;
    const int64_t* gate_stride = nullptr;
    int64_t ldz = 0;  // z row length (F, half of h's)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_z != nullptr && args.ldz > 0 && args.ldz % 8 == 0;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90SwigluZStore() {}
  CUTLASS_HOST_DEVICE Sm90SwigluZStore(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  // For a thread's fragment of one epilogue subtile (coordinates by the static layout L, relative to its
  // first element): row[k], col[k]; partner[k], the element 8 columns on in k's row (the up column of a gate
  // column); next[k], the element 1 column on; -1 where there is none. kind[k] for the fast path, where the
  // thread's first column n0 has n0 % 16 in {0, 2, 4, 6} (a wgmma fragment's), so that k is a gate column
  // iff col[k] % 16 < 8: 2 = stores z of k and next[k] (bf16x2), 1 = stores z of k alone, 0 = stored by its
  // left neighbour or no gate column. Built at compile time, so the unrolled visits index registers by
  // constants.
  template <class L, int N>
  struct Pairs {
    int row[N], col[N], partner[N], next[N], kind[N];
    int max_row = 0, max_col = 0;
    bool fast = true;  // the fast path's assumptions hold: every col % 8 < 2, every col % 16 < 8 has its partner
  };
  template <class L, int N>
  static constexpr Pairs<L, N> MakePairs() {
    Pairs<L, N> t{};
    constexpr L layout{};
    for (int k = 0; k < N; ++k) {
      const auto ck = layout(k);
      t.row[k] = static_cast<int>(cute::get<0>(ck));
      t.col[k] = static_cast<int>(cute::get<1>(ck));
      t.max_row = t.row[k] > t.max_row ? t.row[k] : t.max_row;
      t.max_col = t.col[k] > t.max_col ? t.col[k] : t.max_col;
    }
    for (int k = 0; k < N; ++k) {
      t.partner[k] = -1;
      t.next[k] = -1;
      for (int j = 0; j < N; ++j) {
        if (t.row[j] != t.row[k]) continue;
        if (t.col[j] == t.col[k] + 8) t.partner[k] = j;
        if (t.col[j] == t.col[k] + 1) t.next[k] = j;
      }
    }
    for (int k = 0; k < N; ++k) {
      const bool gate = t.partner[k] >= 0 && t.col[k] % 16 < 8;
      const int nx = t.next[k];
      t.kind[k] = !gate ? 0 : (t.col[k] % 2 == 0 && nx >= 0 && t.partner[nx] >= 0 && t.col[nx] % 16 < 8) ? 2 : 1;
    }
    for (int k = 0; k < N; ++k)  // the right element of a pair is its left neighbour's
      if (t.kind[k] == 2) t.kind[t.next[k]] = 0;
    for (int k = 0; k < N; ++k)
      if (t.col[k] % 8 >= 2 || (t.col[k] % 16 < 8 && t.partner[k] < 0)) t.fast = false;
    return t;
  }

  // CTensor: the thread's coordinates relative to its first element, (CPY, CPY_M, CPY_N, EPI_M, EPI_N);
  // Residue: the group's (M, N) less that first element's coordinate.
  template <class CTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor tCcD, Residue residue, __nv_bfloat16* z, const float* gate,
                                          int64_t gate_stride, int64_t ldz, int m0, int n0)
        : tCcD(tCcD), residue(residue), z(z), gate(gate), gate_stride(gate_stride), ldz(ldz), m0(m0), n0(n0) {}
    CTensor tCcD;
    Residue residue;
    __nv_bfloat16* z;
    const float* gate;
    int64_t gate_stride, ldz;
    int m0, n0;  // the thread's first element in the group's h

    using SubtileLayout = decltype(cute::take<0, 3>(cute::declval<CTensor>().layout()));
    static_assert(cute::is_static_v<SubtileLayout>, "the SwiGLU epilogue pairs columns at compile time: a static fragment layout");
    static constexpr int kSubtile = decltype(cute::size(SubtileLayout{}))::value;

    CUTLASS_DEVICE float Z(float acc_gate, float acc_up, int64_t m) const {
      const float a = __bfloat162float(__float2bfloat16_rn(acc_gate));
      const float b = __bfloat162float(__float2bfloat16_rn(acc_up));
      const float s = SwigluOf(a, b);
      return gate ? gate[m * gate_stride] * s : s;
    }

    static constexpr Pairs<SubtileLayout, kSubtile> kPairs = MakePairs<SubtileLayout, kSubtile>();

    // frg_input: the accumulators (Sm90AccFetch), passed on unchanged as D. A visit sees a whole subtile
    // (FragmentSize == kSubtile, asserted), so every index below is a compile-time constant: the values stay
    // in registers. Each gate column's z is stored with its right neighbour's when that is a gate column of
    // the fragment too (bf16x2), else alone.
    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int,
                                                                    int epi_m, int epi_n,
                                                                    cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      using namespace cute;
      static_assert(FragmentSize == kSubtile, "the SwiGLU epilogue needs one visit per epilogue subtile");
      Tensor tC_mn = tCcD(_, _, _, epi_m, epi_n);
      // The subtile's first element (the table's coordinates are relative to it) in the group's h.
      const auto c0 = tC_mn(0);
      const int r0 = static_cast<int>(get<0>(c0)), k0 = static_cast<int>(get<1>(c0));
      const int mb = m0 + r0, nb = n0 + k0;
      if (kPairs.fast && (nb & 9) == 0 && kPairs.max_row < static_cast<int>(get<0>(residue)) - r0 &&
          kPairs.max_col < static_cast<int>(get<1>(residue)) - k0) {
        // The fragment lies inside the group's h and starts on a gate column pair: every choice is static.
        __nv_bfloat16* zt = z + static_cast<int64_t>(mb) * ldz + (nb >> 4) * 8 + (nb & 7);
        cute::for_each(cute::make_int_sequence<FragmentSize>{}, [&](auto I) {
          constexpr int i = decltype(I)::value;
          constexpr int kind = kPairs.kind[i];
          if constexpr (kind != 0) {
            constexpr int p = kPairs.partner[i];
            constexpr int zcol = (kPairs.col[i] / 16) * 8 + kPairs.col[i] % 8;
            __nv_bfloat16* dst = zt + kPairs.row[i] * ldz + zcol;
            const float w = gate ? __ldg(gate + (mb + kPairs.row[i]) * gate_stride) : 1.0f;
            if constexpr (kind == 2) {
              constexpr int nx = kPairs.next[i];
              constexpr int px = kPairs.partner[nx];
              const float2 a = __bfloat1622float2(__floats2bfloat162_rn(static_cast<float>(frg_input[i]), static_cast<float>(frg_input[nx])));
              const float2 b = __bfloat1622float2(__floats2bfloat162_rn(static_cast<float>(frg_input[p]), static_cast<float>(frg_input[px])));
              const float s0 = SwigluOf(a.x, b.x), s1 = SwigluOf(a.y, b.y);
              *reinterpret_cast<__nv_bfloat162*>(dst) = gate ? __floats2bfloat162_rn(w * s0, w * s1) : __floats2bfloat162_rn(s0, s1);
            } else {
              const float a = __bfloat162float(__float2bfloat16_rn(static_cast<float>(frg_input[i])));
              const float b = __bfloat162float(__float2bfloat16_rn(static_cast<float>(frg_input[p])));
              const float s = SwigluOf(a, b);
              *dst = __float2bfloat16_rn(gate ? w * s : s);
            }
          }
        });
        return frg_input;
      }
      // Edge tiles (rows past the group's, columns past 2F) and any other fragment start: checked per element.
      cute::for_each(cute::make_int_sequence<FragmentSize>{}, [&](auto I) {
        constexpr int i = decltype(I)::value;
        constexpr int p = kPairs.partner[i];
        if constexpr (p >= 0) {  // else i is no gate column (its up column is not in the fragment)
          auto ci = tC_mn(i);
          const int n = n0 + static_cast<int>(get<1>(ci));
          if ((n & 8) == 0 && elem_less(ci, residue)) {
            const int64_t m = m0 + static_cast<int>(get<0>(ci));
            __nv_bfloat16* dst = z + m * ldz + (n >> 4) * 8 + (n & 7);
            constexpr int nx = kPairs.next[i];
            constexpr int px = nx >= 0 ? kPairs.partner[nx] : -1;
            constexpr bool left_pairs = i > 0 && kPairs.next[i > 0 ? i - 1 : 0] == i && kPairs.partner[i > 0 ? i - 1 : 0] >= 0;
            const float zi = Z(static_cast<float>(frg_input[i]), static_cast<float>(frg_input[p]), m);
            if constexpr (px >= 0) {
              if ((n & 1) == 0 && elem_less(tC_mn(nx), residue)) {
                *reinterpret_cast<__nv_bfloat162*>(dst) =
                    __floats2bfloat162_rn(zi, Z(static_cast<float>(frg_input[nx]), static_cast<float>(frg_input[px]), m));
                return;
              }
            }
            if constexpr (left_pairs) {
              if ((n & 1) == 1) return;  // stored with its left neighbour
            }
            *dst = __float2bfloat16_rn(zi);
          }
        }
      });
      return frg_input;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const int m0 = static_cast<int>(M) - static_cast<int>(cute::get<0>(args.residue_tCcD));
    const int n0 = static_cast<int>(N) - static_cast<int>(cute::get<1>(args.residue_tCcD));
    const float* gate = params.ptr_gate ? params.ptr_gate[l] : nullptr;
    const int64_t gate_stride = gate ? *params.gate_stride : 0;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(args.tCcD, args.residue_tCcD, params.ptr_z[l], gate,
                                                                                     gate_stride, params.ldz, m0, n0);
  }
};

}  // namespace rdep::kernels::internal
