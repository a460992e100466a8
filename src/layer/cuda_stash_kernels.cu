// The paged stash's kernels (cuda_stash_kernels.h). Copies move 16-byte vectors: H and F are multiples
// of 8 (the layer checks it before it stashes), so every row's arrays start on 16-byte boundaries.
#include "layer/cuda_stash_kernels.h"

#include <cstdint>

#include "rdep/cuda/check.h"

namespace rdep::cuda_layer {
namespace {

constexpr int kVec = 8;  // bf16 per 16-byte vector
constexpr int kCopyThreads = 256;  // H = 2048: one column of x per thread
constexpr int kRingThreads = 128;

// Segment s's rows, as the sync-free forward left them: [0, seg_cap].
__device__ int64_t SegmentRows(const StashRows& r, int64_t s) {
  const int64_t m = r.counts[s * r.count_stride + r.count_at];
  return m < 0 ? 0 : (m > r.seg_cap ? r.seg_cap : m);
}

__device__ int64_t PagesFor(int64_t rows) { return (rows + kStashPageRows - 1) / kStashPageRows; }

// Takes the pages for every segment's rows, in segment order, or none (state[0] = -1) when too few are free.
__global__ void TakePagesKernel(StashPool pool, StashRows r) {
  __shared__ int64_t need, first;
  __shared__ bool fits;
  if (threadIdx.x == 0) {
    int64_t rows = 0, pages = 0;
    for (int64_t s = 0; s < r.segments; ++s) {
      const int64_t m = SegmentRows(r, s);
      rows += m;
      pages += PagesFor(m);
    }
    const uint64_t taken = pool.counters[0], returned = pool.counters[1];
    const auto free_pages = static_cast<int64_t>(pool.num_pages) - static_cast<int64_t>(taken - returned);
    fits = pages <= free_pages;
    need = pages;
    first = static_cast<int64_t>(taken);
    r.state[1] = rows << 32 | pages;  // rows < 2^31 (the worst case's), pages < 2^30 (AcquireStash's limit)
    if (fits) {
      r.state[0] = pages;
      pool.counters[0] = taken + static_cast<uint64_t>(pages);
    } else {
      r.state[0] = -1;
    }
  }
  __syncthreads();
  if (!fits) return;
  for (int64_t i = threadIdx.x; i < need; i += blockDim.x) {
    const int64_t k = (first + i) % pool.num_pages;
    r.page_table[i] = pool.ring[k] ^ static_cast<int32_t>(k);
  }
}

// Gives back the pages a context holds (state[0] > 0) and leaves it holding none.
__global__ void GivePagesKernel(StashPool pool, StashRows r) {
  __shared__ int64_t held, first;
  if (threadIdx.x == 0) {
    held = r.state[0];
    first = static_cast<int64_t>(pool.counters[1]);
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < held; i += blockDim.x) {
    const int64_t k = (first + i) % pool.num_pages;
    pool.ring[k] = r.page_table[i] ^ static_cast<int32_t>(k);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (held > 0) pool.counters[1] = static_cast<uint64_t>(first + held);
    r.state[0] = 0;
  }
}

constexpr int kRowsInFlight = 8;  // rows each thread loads before it stores (bytes in flight per SM)

// Moves one array of a page's rows: `vecs` 16-byte vectors per row, row i at t + i * t_stride in the
// transient rows and at p + i * p_stride in the page (strides in vectors). Thread c takes column c of
// kRowsInFlight rows at a time: a row's vectors are adjacent threads' (coalesced), the loads of those
// rows in flight together. p null: fill the transient rows with `fill`.
__device__ void MoveArray(uint4* t, int64_t t_stride, uint4* p, int64_t p_stride, int64_t vecs, int64_t rows, bool to_pool,
                          uint4 fill) {
  for (int64_t c = threadIdx.x; c < vecs; c += blockDim.x) {
    for (int64_t i0 = 0; i0 < rows; i0 += kRowsInFlight) {
      uint4 v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (i0 + u < rows) v[u] = !p ? fill : (to_pool ? t[(i0 + u) * t_stride + c] : p[(i0 + u) * p_stride + c]);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (i0 + u < rows) {
          if (to_pool) p[(i0 + u) * p_stride + c] = v[u];
          else t[(i0 + u) * t_stride + c] = v[u];
        }
    }
  }
}

// One block per page of the context (blockIdx.x = its index in the page table): copies the page's rows
// between the pool and the transient rows. to_pool false with state[0] = -1 (the pool overflowed at
// forward) fills the rows the forward computed with NaN instead (defensive: the layer's backward fails on
// every rank before it would copy such a context back).
__global__ void CopyPagesKernel(StashPool pool, StashRows r, int64_t row_elems, bool to_pool) {
  const int64_t held = r.state[0];
  const bool poison = !to_pool && held < 0;
  const auto p = static_cast<int64_t>(blockIdx.x);
  if (!poison && p >= held) return;
  // The segment of page p and its first row there: the pages of segment s follow those of s - 1.
  int64_t seg = 0, row0 = -1, rows = 0;
  for (int64_t s = 0, before = 0; s < r.segments; ++s) {
    const int64_t m = SegmentRows(r, s), n = PagesFor(m);
    if (p < before + n) {
      seg = s;
      row0 = (p - before) * kStashPageRows;
      rows = m - row0 < kStashPageRows ? m - row0 : kStashPageRows;
      break;
    }
    before += n;
  }
  if (row0 < 0) return;
  const int64_t t0 = seg * r.seg_cap + row0;  // the page's first transient row
  const int64_t hv = r.H / kVec, fv = 2 * r.F / kVec, pv = row_elems / kVec;
  auto* page = poison ? nullptr : reinterpret_cast<uint4*>(pool.pages + static_cast<int64_t>(r.page_table[p]) * kStashPageRows * row_elems);
  const uint32_t two = 0x7FC07FC0u;  // two bf16 quiet NaNs
  const uint4 nan_vec = make_uint4(two, two, two, two);
  MoveArray(reinterpret_cast<uint4*>(r.x) + t0 * hv, hv, page, pv, hv, rows, to_pool, nan_vec);
  MoveArray(reinterpret_cast<uint4*>(r.h) + t0 * fv, fv, page ? page + hv : nullptr, pv, fv, rows, to_pool, nan_vec);
  if (r.f) MoveArray(reinterpret_cast<uint4*>(r.f) + t0 * hv, hv, page ? page + hv + fv : nullptr, pv, hv, rows, to_pool, nan_vec);
}

int64_t RowElems(const StashRows& r) { return StashRowElems(r.H, r.F, r.f != nullptr); }

Status CheckArgs(const StashPool& pool, const StashRows& r) {
  if (pool.num_pages < 1 || !pool.pages || !pool.ring || !pool.counters)
    return InvalidArgument("stash: the pool has no pages");
  if (r.H % kVec != 0 || r.F % kVec != 0)
    return InvalidArgument("stash: hidden " + std::to_string(r.H) + " and ffn " + std::to_string(r.F) + " must be multiples of 8");
  if (!r.x || !r.h || !r.counts || !r.page_table || !r.state || r.segments < 0 || r.seg_cap < 0)
    return InvalidArgument("stash: a context's rows, counts, page table or state is missing");
  return Status::Ok();
}

// One thread per rank p: this rank's outcome into word `rank` of p's flags region.
__global__ void StashOutcomeKernel(const int64_t* state, void* const* peer_flags, int32_t rank, int32_t ranks) {
  const int32_t p = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (p < ranks) static_cast<volatile int64_t*>(peer_flags[p])[rank] = state[0] < 0 ? state[1] : -1;
}

}  // namespace

Status LaunchTakePages(const StashPool& pool, const StashRows& r, cudaStream_t stream) {
  RDEP_RETURN_IF_ERROR(CheckArgs(pool, r));
  TakePagesKernel<<<1, kRingThreads, 0, stream>>>(pool, r);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchCopyIntoPages(const StashPool& pool, const StashRows& r, cudaStream_t stream) {
  RDEP_RETURN_IF_ERROR(CheckArgs(pool, r));
  if (r.max_pages > 0) {
    CopyPagesKernel<<<static_cast<unsigned>(r.max_pages), kCopyThreads, 0, stream>>>(pool, r, RowElems(r), /*to_pool=*/true);
    RDEP_CUDA_CHECK_LAUNCH();
  }
  return Status::Ok();
}

Status LaunchUnstashRows(const StashPool& pool, const StashRows& r, cudaStream_t stream) {
  RDEP_RETURN_IF_ERROR(CheckArgs(pool, r));
  if (r.max_pages > 0) {
    CopyPagesKernel<<<static_cast<unsigned>(r.max_pages), kCopyThreads, 0, stream>>>(pool, r, RowElems(r), /*to_pool=*/false);
    RDEP_CUDA_CHECK_LAUNCH();
  }
  GivePagesKernel<<<1, kRingThreads, 0, stream>>>(pool, r);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchReleaseStash(const StashPool& pool, const StashRows& r, cudaStream_t stream) {
  RDEP_RETURN_IF_ERROR(CheckArgs(pool, r));
  GivePagesKernel<<<1, kRingThreads, 0, stream>>>(pool, r);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status LaunchStashOutcomeToPeers(const StashRows& r, void* const* peer_flags, int32_t rank, int32_t ranks, cudaStream_t stream) {
  if (ranks <= 0) return Status::Ok();
  if (!r.state || !peer_flags) return InvalidArgument("stash: the outcome's state or flags region is missing");
  StashOutcomeKernel<<<(ranks + 127) / 128, 128, 0, stream>>>(r.state, peer_flags, rank, ranks);
  RDEP_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace rdep::cuda_layer
