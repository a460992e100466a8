// Route-row identity (seeds 000 eq. 7): row_id = ((r*T)+t)*K + k, 64-bit and lossless.
// Every accepted (rank r, token t, slot k) carries it through dispatch, owner compute and return;
// the front-end places a returned row only by decoding it. Host and device code (the CUDA scatter
// and return kernels) both encode and decode through RowIdCodec.
#pragma once

#include <cstdint>

namespace rdep {

struct RowKey {
  int64_t rank = 0;
  int64_t token = 0;
  int64_t slot = 0;
  // Spelled out (not "= default"): CUDA translation units are C++17.
  friend constexpr bool operator==(const RowKey& a, const RowKey& b) {
    return a.rank == b.rank && a.token == b.token && a.slot == b.slot;
  }
  friend constexpr bool operator!=(const RowKey& a, const RowKey& b) { return !(a == b); }
};

struct RowIdCodec {
  int64_t tokens = 0;  // T
  int64_t topk = 0;    // K

#if defined(__CUDACC__)
  __host__ __device__
#endif
  constexpr uint64_t encode(int64_t rank, int64_t token, int64_t slot) const {
    return static_cast<uint64_t>((rank * tokens + token) * topk + slot);
  }
#if defined(__CUDACC__)
  __host__ __device__
#endif
  constexpr RowKey decode(uint64_t row_id) const {
    const auto id = static_cast<int64_t>(row_id);
    const int64_t rt = id / topk;
    return RowKey{tokens ? rt / tokens : 0, tokens ? rt % tokens : 0, id % topk};
  }
};

}  // namespace rdep
