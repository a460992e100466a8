// The SwiGLU expert MLP for one row, host side, in any floating type (double for the reference,
// float for the host backend):  E(x) = W2 . (silu(x.W1g) * x.W1u)
// Weight layout of one expert (row-major, the layout the CUDA kernels use too):
//   w1 [H][2F]: the gate projection W1g and the up projection W1u, their columns placed by GateUp
//               (kSplit: W1g in [0, F), W1u in [F, 2F)); h, dh and dw1 place their 2F columns the same way
//   w2 [F][H]
#pragma once

#include <cmath>
#include <cstdint>

namespace rdep::mlp {

// Where w1's (and h's) 2F columns hold gate feature j and up feature j.
//   kSplit         gate j at j, up j at F + j (the layout of TorchTitan's w1 | w3 side by side)
//   kInterleaved8  blocks of 8 features: gate j at 16 * (j / 8) + j % 8, up j 8 columns after it; needs
//                  F % 8 == 0 (else columns fall past 2F: callers validate, as LayerConfig, ExpertMlpDesc and
//                  MoEWeights do). A thread of a wgmma accumulator tile holds both columns of a feature, which
//                  GEMM1's SwiGLU epilogue needs (CutlassTiles::swiglu_epilogue).
enum class GateUp : int32_t { kSplit = 0, kInterleaved8 = 1 };
inline int64_t GateCol(int64_t j, int64_t /*F*/, GateUp l) {
  return l == GateUp::kSplit ? j : 16 * (j / 8) + j % 8;
}
inline int64_t UpCol(int64_t j, int64_t F, GateUp l) { return l == GateUp::kSplit ? F + j : 16 * (j / 8) + j % 8 + 8; }
inline const char* GateUpName(GateUp l) { return l == GateUp::kSplit ? "split" : "interleaved8"; }

// `rows` rows of 2F columns (w1, h, dh, dw1) from layout `from` to layout `to`: dst = src moved, not in place.
template <typename T>
void MoveGateUp(const T* src, T* dst, size_t rows, int64_t F, GateUp from, GateUp to) {
  for (size_t r = 0; r < rows; ++r) {
    const T* s = src + r * static_cast<size_t>(2 * F);
    T* d = dst + r * static_cast<size_t>(2 * F);
    for (int64_t j = 0; j < F; ++j) {
      d[GateCol(j, F, to)] = s[GateCol(j, F, from)];
      d[UpCol(j, F, to)] = s[UpCol(j, F, from)];
    }
  }
}

template <typename T>
inline T sigmoid(T a) { return T(1) / (T(1) + std::exp(-a)); }

// h[2F] = x . w1 (pre-activations), z[F] = silu(h_g) * h_u, out[H] = z . w2.
// Weights are stored as W (float) and accumulated in Acc.
template <typename Acc, typename X, typename Wt>
void Forward(const X* x, const Wt* w1, const Wt* w2, int64_t H, int64_t F, Acc* h, Acc* z, Acc* out,
             GateUp layout = GateUp::kSplit) {
  for (int64_t c = 0; c < 2 * F; ++c) h[c] = Acc(0);
  for (int64_t i = 0; i < H; ++i) {
    const Acc xi = static_cast<Acc>(x[i]);
    const Wt* row = w1 + i * 2 * F;
    for (int64_t c = 0; c < 2 * F; ++c) h[c] += xi * static_cast<Acc>(row[c]);
  }
  for (int64_t f = 0; f < F; ++f) {
    const Acc a = h[GateCol(f, F, layout)];
    z[f] = a * sigmoid(a) * h[UpCol(f, F, layout)];
  }
  for (int64_t o = 0; o < H; ++o) out[o] = Acc(0);
  for (int64_t f = 0; f < F; ++f) {
    const Wt* row = w2 + f * H;
    for (int64_t o = 0; o < H; ++o) out[o] += z[f] * static_cast<Acc>(row[o]);
  }
}

// Backward of one row given dout[H] (the gradient at the expert output, gate already applied),
// the saved pre-activations h[2F] and x. Accumulates dw1 += x^T dh, dw2 += z^T dout, and writes dx.
// scratch needs 3F entries.
template <typename Acc, typename X, typename Wt, typename G>
void Backward(const X* x, const Wt* w1, const Wt* w2, int64_t H, int64_t F, const Acc* h, const Acc* dout,
              G* dw1, G* dw2, Acc* dx, Acc* scratch, GateUp layout = GateUp::kSplit) {
  Acc* z = scratch;
  Acc* dh = scratch + F;  // [2F], columns as h's
  for (int64_t f = 0; f < F; ++f) {
    const Acc a = h[GateCol(f, F, layout)];
    z[f] = a * sigmoid(a) * h[UpCol(f, F, layout)];
  }
  for (int64_t f = 0; f < F; ++f) {
    const Wt* row = w2 + f * H;
    G* drow = dw2 + f * H;
    Acc dz = Acc(0);
    for (int64_t o = 0; o < H; ++o) {
      dz += dout[o] * static_cast<Acc>(row[o]);
      drow[o] += static_cast<G>(z[f] * dout[o]);
    }
    const int64_t gc = GateCol(f, F, layout), uc = UpCol(f, F, layout);
    const Acc a = h[gc], b = h[uc], s = sigmoid(a);
    const Acc silu = a * s, dsilu = s * (Acc(1) + a * (Acc(1) - s));
    dh[gc] = dz * b * dsilu;
    dh[uc] = dz * silu;
  }
  for (int64_t i = 0; i < H; ++i) {
    const Acc xi = static_cast<Acc>(x[i]);
    const Wt* row = w1 + i * 2 * F;
    G* drow = dw1 + i * 2 * F;
    Acc acc = Acc(0);
    for (int64_t c = 0; c < 2 * F; ++c) {
      acc += dh[c] * static_cast<Acc>(row[c]);
      drow[c] += static_cast<G>(xi * dh[c]);
    }
    dx[i] = acc;
  }
}

}  // namespace rdep::mlp
