// The backward's SwiGLU' in the epilogue of dz = dout.W2^T (issue 14 item 1): an epilogue visitor node for CUTLASS's
// sm90 TMA warp-specialized ptr-array epilogues (grouped_gemm_sm90_runner.cuh, kind kNT_SwiGLUGrad) that takes the
// accumulator dz (rounded to bf16, as the GEMM's D would be), loads the same features' pre-activations a (gate) and
// b (up) from the group's h rows, writes their gradients dh over them (in place: each element is read, then written,
// by one thread), and hands z = silu(a) * b to the TMA store as D, so that D is z, the operand dW2 reads. The
// element-wise SwiGLU' pass (expert_mlp_kernels.cu) and its 415 MB of traffic at Moonlight's mu = 1536 are then gone;
// what the epilogue adds runs on the consumer warps (docs/perf-notes.md, thirty-sixth session).
//
// A wgmma accumulator fragment holds columns 8c + 2q + {0, 1}: a thread's features come in adjacent pairs, so it
// loads a's and b's as bf16x2 and stores dh's the same way, in either layout of h's columns (GateUp::kSplit: a at
// feature j, b at F + j; kInterleaved8: a at 16*(j/8) + j%8, b 8 after it). All of a subtile's loads are issued
// before its first store (the stores go to the rows loaded from). No row gate: a call with per-row gates keeps the
// pass (its dgate is a row reduction). Rounding is SwigluGradOf's (swiglu_math.cuh), with the same bf16 inputs as
// the pass: the same bits for z and dh. Tree: Sm90EVT<Sm90SwigluGradStore, Sm90AccFetch>.
// Include only from grouped_gemm_sm90_runner.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "experts/swiglu_epilogue_sm90.cuh"
#include "experts/swiglu_math.cuh"

namespace rdep::kernels::internal {

// A fragment's elements as adjacent column pairs (first[p], second[p]: the even column and the one after it, same
// row). ok: every element is in exactly one pair (a wgmma fragment's layout).
template <int N>
struct ColumnPairs {
  int first[N / 2 > 0 ? N / 2 : 1], second[N / 2 > 0 ? N / 2 : 1];
  int count = 0;
  bool ok = true;
};
template <class L, int N>
constexpr ColumnPairs<N> MakeColumnPairs() {
  constexpr FragmentPairs<L, N> t = MakeFragmentPairs<L, N>();
  ColumnPairs<N> c{};
  int covered = 0;
  for (int k = 0; k < N; ++k) {
    if (t.col[k] % 2 != 0) continue;
    if (t.next[k] < 0 || c.count >= N / 2) {
      c.ok = false;
      continue;
    }
    c.first[c.count] = k;
    c.second[c.count] = t.next[k];
    ++c.count;
    covered += 2;
  }
  if (covered != N) c.ok = false;
  return c;
}

struct Sm90SwigluGradStore {
  struct SharedStorage {};
  // ptr_h: a device table of one entry per group, filled by the caller before each launch (as the GEMM's own pointer
  // tables are): the group's first h row, [rows][2F], which the epilogue overwrites with dh.
  struct Arguments {
    __nv_bfloat16** ptr_h = nullptr;
    int64_t ffn = 0;           // F: D's row length (z), half of h's
    bool interleaved = false;  // h's columns as GateUp::kInterleaved8, else kSplit
    bool prefetch = true;      // the epilogue's load warp prefetches each tile's h into L2 (ProducerLoadCallbacks)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_h != nullptr && args.ffn > 0 && args.ffn % 8 == 0;
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

  CUTLASS_HOST_DEVICE Sm90SwigluGradStore() {}
  CUTLASS_HOST_DEVICE Sm90SwigluGradStore(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return params.prefetch; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  // The epilogue's load warp runs a tile's begin() ahead of the consumers (by the load pipeline's stages), so about a
  // mainloop before the tile's epilogue: it asks for the tile's h rows in L2 (cp.async.bulk.prefetch, a row's a and
  // b chunks, 256 bytes each for 128 features; one chunk of both when interleaved), and the epilogue's loads then hit
  // L2 instead of waiting on DRAM subtile by subtile.
  struct ProducerLoadCallbacks : cutlass::epilogue::fusion::EmptyProducerLoadCallbacks {
    CUTLASS_DEVICE ProducerLoadCallbacks(const char* base, int64_t row_bytes, int rows, uint32_t chunk_bytes, int64_t up_bytes, int lane)
        : base(base), row_bytes(row_bytes), rows(rows), chunk_bytes(chunk_bytes), up_bytes(up_bytes), lane(lane) {}
    const char* base;     // the tile's first row, at its first feature's a (null: nothing to prefetch)
    int64_t row_bytes;    // h's row
    int rows;             // the tile's rows in the group
    uint32_t chunk_bytes; // a row's bytes to prefetch from each chunk
    int64_t up_bytes;     // b's chunk less a's (0: one chunk holds both)
    int lane;
    CUTLASS_DEVICE void begin() {
      if (base == nullptr) return;
      for (int r = lane; r < rows; r += 32) {
        const char* row = base + r * row_bytes;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(chunk_bytes) : "memory");
        if (up_bytes != 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row + up_bytes), "r"(chunk_bytes) : "memory");
      }
    }
  };

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const int tm = static_cast<int>(cute::size<0>(args.tile_shape_mnk)), tn = static_cast<int>(cute::size<1>(args.tile_shape_mnk));
    const int m0 = static_cast<int>(m) * tm, n0 = static_cast<int>(n) * tn;
    const int rows = cute::min(tm, static_cast<int>(M) - m0), feats = cute::min(tn, static_cast<int>(N) - n0);
    const char* base = nullptr;
    if (params.prefetch && rows > 0 && feats > 0) {
      const int col = params.interleaved ? 2 * n0 : n0;  // n0 is a multiple of 8
      base = reinterpret_cast<const char*>(params.ptr_h[l] + static_cast<int64_t>(m0) * 2 * params.ffn + col);
    }
    const auto chunk = static_cast<uint32_t>((params.interleaved ? 2 : 1) * feats * 2);  // a multiple of 16 bytes (F % 8 == 0)
    return ProducerLoadCallbacks(base, 2 * params.ffn * 2, rows, chunk, params.interleaved ? 0 : params.ffn * 2, args.thread_idx);
  }

  // CTensor: the thread's coordinates relative to its first element, (CPY, CPY_M, CPY_N, EPI_M, EPI_N);
  // Residue: the group's (M, N) less that first element's coordinate.
  template <class CTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor tCcD, Residue residue, __nv_bfloat16* h, int64_t ffn, bool interleaved, int m0, int n0)
        : tCcD(tCcD), residue(residue), h(h), ffn(ffn), interleaved(interleaved), m0(m0), n0(n0) {}
    CTensor tCcD;
    Residue residue;
    __nv_bfloat16* h;
    int64_t ffn;
    bool interleaved;
    int m0, n0;  // the thread's first element in the group's dz: row, feature

    using SubtileLayout = decltype(cute::take<0, 3>(cute::declval<CTensor>().layout()));
    static_assert(cute::is_static_v<SubtileLayout>, "the SwiGLU' epilogue pairs columns at compile time: a static fragment layout");
    static constexpr int kSubtile = decltype(cute::size(SubtileLayout{}))::value;
    static constexpr FragmentPairs<SubtileLayout, kSubtile> kPairs = MakeFragmentPairs<SubtileLayout, kSubtile>();
    static constexpr ColumnPairs<kSubtile> kCols = MakeColumnPairs<SubtileLayout, kSubtile>();
    static_assert(kCols.ok, "the SwiGLU' epilogue needs each thread's columns in adjacent pairs (a wgmma fragment)");
    static constexpr int kNumPairs = kCols.count;

    // frg_input: the accumulators (Sm90AccFetch), dz. Returns z for D. A visit sees a whole subtile (FragmentSize ==
    // kSubtile, asserted), so every index is a compile-time constant. A pair outside the group (rows past M; F is a
    // multiple of 8, so a pair's columns are both inside or both outside) loads and stores nothing; its z is 0 and
    // the TMA store leaves it out.
    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int,
                                                                    int epi_m, int epi_n,
                                                                    cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      using namespace cute;
      static_assert(FragmentSize == kSubtile, "the SwiGLU' epilogue needs one visit per epilogue subtile");
      Tensor tC_mn = tCcD(_, _, _, epi_m, epi_n);
      const auto c0 = tC_mn(0);
      const int r0 = static_cast<int>(get<0>(c0)), k0 = static_cast<int>(get<1>(c0));
      const bool interior =
          kPairs.max_row < static_cast<int>(get<0>(residue)) - r0 && kPairs.max_col < static_cast<int>(get<1>(residue)) - k0;
      const int64_t up = interleaved ? 8 : ffn;  // b's column less a's
      __nv_bfloat16* at[kNumPairs];
      __nv_bfloat162 a2[kNumPairs], b2[kNumPairs];
      // Every load before the first store.
      cute::for_each(cute::make_int_sequence<kNumPairs>{}, [&](auto P) {
        constexpr int p = decltype(P)::value;
        constexpr int i = kCols.first[p];
        const auto ci = tC_mn(i);
        at[p] = nullptr;
        a2[p] = b2[p] = __floats2bfloat162_rn(0.0f, 0.0f);
        if (interior || elem_less(ci, residue)) {
          const int64_t m = m0 + static_cast<int>(get<0>(ci));
          const int n = n0 + static_cast<int>(get<1>(ci));
          const int col = interleaved ? ((n >> 3) << 4) | (n & 7) : n;
          at[p] = h + m * 2 * ffn + col;
          a2[p] = *reinterpret_cast<const __nv_bfloat162*>(at[p]);
          b2[p] = *reinterpret_cast<const __nv_bfloat162*>(at[p] + up);
        }
      });
      cutlass::Array<ElementInput, FragmentSize> z;
      cute::for_each(cute::make_int_sequence<kNumPairs>{}, [&](auto P) {
        constexpr int p = decltype(P)::value;
        constexpr int i = kCols.first[p], j = kCols.second[p];
        const float2 dd = __bfloat1622float2(__floats2bfloat162_rn(static_cast<float>(frg_input[i]), static_cast<float>(frg_input[j])));
        const float2 a = __bfloat1622float2(a2[p]), b = __bfloat1622float2(b2[p]);
        float z0, z1, dg0, dg1, du0, du1;
        SwigluGradOf(a.x, b.x, dd.x, z0, dg0, du0);
        SwigluGradOf(a.y, b.y, dd.y, z1, dg1, du1);
        z[i] = static_cast<ElementInput>(z0);
        z[j] = static_cast<ElementInput>(z1);
        if (at[p] != nullptr) {
          *reinterpret_cast<__nv_bfloat162*>(at[p]) = __floats2bfloat162_rn(dg0, dg1);
          *reinterpret_cast<__nv_bfloat162*>(at[p] + up) = __floats2bfloat162_rn(du0, du1);
        }
      });
      return z;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const int m0 = static_cast<int>(M) - static_cast<int>(cute::get<0>(args.residue_tCcD));
    const int n0 = static_cast<int>(N) - static_cast<int>(cute::get<1>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(args.tCcD, args.residue_tCcD, params.ptr_h[l],
                                                                                     params.ffn, params.interleaved, m0, n0);
  }
};

}  // namespace rdep::kernels::internal
