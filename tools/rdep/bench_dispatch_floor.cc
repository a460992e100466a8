// The floor of `rdep bench dispatch` (bench_dispatch_floor.h). Each rank r owns a source of the rows it sends (a
// fixed pattern) and one receive buffer that holds every peer's rows to it, peer s's at offset sum over s' < s of
// rows[s'][r]; one PeerRowsCopy per rank and direction sends rank r's rows to every peer in rank order.
#include "bench_dispatch_floor.h"

#if defined(RDEP_HAVE_CUDA)

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bench_util.h"
#include "rdep/core/stats.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/peer_rows_copy.h"

namespace rdep::bench {
namespace {

// The row pattern of rank r's source: element j of row i, a hash of (r, i, j) (so no row of one rank equals a shifted
// row of another), never 0xFFFF (the poison of the receive buffers).
uint16_t Pattern(int64_t r, int64_t i, int64_t j) {
  uint64_t x = static_cast<uint64_t>(r) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(i) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(j) * 0x165667B19E3779F9ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint16_t>(x & 0x7FFF);
}

struct FloorRank {
  uint16_t* src = nullptr;
  uint16_t* recv = nullptr;
  int64_t src_rows = 0, recv_rows = 0;
  std::vector<cudaEvent_t> ev;  // 4 an iteration: dispatch start/end, combine start/end
};

int64_t SentBy(const PairRows& rows, size_t s) {
  int64_t n = 0;
  for (size_t q = 0; q < rows.size(); ++q) n += q == s ? 0 : rows[s][q];
  return n;
}
int64_t ReceivedBy(const PairRows& rows, size_t q) {
  int64_t n = 0;
  for (size_t s = 0; s < rows.size(); ++s) n += s == q ? 0 : rows[s][q];
  return n;
}

// Rank s's copy of `rows` into the other ranks' receive buffers.
dispatch::PeerRowsCopy CopyOf(const PairRows& rows, const std::vector<FloorRank>& fr, size_t s, int64_t H) {
  dispatch::PeerRowsCopy c;
  for (size_t q = 0; q < rows.size(); ++q) {
    if (q == s) continue;
    int64_t off = 0;  // the rows of lower-ranked sources to q come first in q's buffer
    for (size_t s2 = 0; s2 < s; ++s2) off += s2 == q ? 0 : rows[s2][q];
    const int32_t i = c.num_destinations++;
    c.dst[i] = fr[q].recv + off * H;
    c.begin[i + 1] = c.begin[i] + rows[s][q];
  }
  return c;
}

// Whether every peer's rows in rank q's receive buffer are the rows its source sent by `rows`' copy.
StatusOr<bool> Landed(const PairRows& rows, const FloorRank& f, size_t q, int64_t H) {
  std::vector<uint16_t> got(static_cast<size_t>(f.recv_rows * H));
  if (!got.empty()) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(got.data(), f.recv, got.size() * 2, cudaMemcpyDeviceToHost));
  int64_t off = 0;
  for (size_t s = 0; s < rows.size(); ++s) {
    if (s == q) continue;
    int64_t first = 0;  // the index of s's first row to q among s's rows sent
    for (size_t q2 = 0; q2 < q; ++q2) first += q2 == s ? 0 : rows[s][q2];
    for (int64_t i = 0; i < rows[s][q]; ++i)
      for (int64_t j = 0; j < H; ++j)
        if (got[static_cast<size_t>((off + i) * H + j)] != Pattern(static_cast<int64_t>(s), first + i, j)) return {false};
    off += rows[s][q];
  }
  return {true};
}

// The check of one table after the timed loops: every receive buffer poisoned, the table's copy once more on every rank,
// then each destination's rows against their senders' pattern; `exact` = every rank's rows landed.
Status CheckTable(CudaDomain& domain, const PairRows& rows, std::vector<FloorRank>& fr, int64_t H, bool& exact) {
  const size_t W = fr.size();
  for (size_t r = 0; r < W; ++r) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(domain.device(static_cast<int32_t>(r))));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(fr[r].recv, 0xFF, static_cast<size_t>(fr[r].recv_rows * H) * 2));
    RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  }
  RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
    const auto sr = static_cast<size_t>(r);
    RDEP_RETURN_IF_ERROR(dispatch::LaunchPeerRowsCopy(fr[sr].src, CopyOf(rows, fr, sr, H), H, domain.stream(r)));
    return domain.Synchronize(r);
  }));
  exact = true;
  for (size_t r = 0; r < W; ++r) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(domain.device(static_cast<int32_t>(r))));
    RDEP_ASSIGN_OR_RETURN(const bool landed, Landed(rows, fr[r], r, H));
    exact = exact && landed;
  }
  return Status::Ok();
}

Status SetUpRank(FloorRank& f, size_t r, int64_t src_rows, int64_t recv_rows, int64_t H, int64_t events, int dev) {
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));
  const size_t bytes = static_cast<size_t>(src_rows + recv_rows) * static_cast<size_t>(H) * 2;
  size_t free_b = 0, total_b = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
  if (bytes + (size_t{256} << 20) > free_b)
    return FailedPrecondition("the floor's buffers on rank " + std::to_string(r) + " need " + std::to_string(bytes >> 20) +
                              " MiB, GPU " + std::to_string(dev) + " has " + std::to_string(free_b >> 20) + " MiB free");
  f.src_rows = src_rows;
  f.recv_rows = recv_rows;
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&f.src, std::max<size_t>(static_cast<size_t>(src_rows * H) * 2, 16)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&f.recv, std::max<size_t>(static_cast<size_t>(recv_rows * H) * 2, 16)));
  std::vector<uint16_t> pattern(static_cast<size_t>(src_rows * H));
  for (int64_t i = 0; i < src_rows; ++i)
    for (int64_t j = 0; j < H; ++j) pattern[static_cast<size_t>(i * H + j)] = Pattern(static_cast<int64_t>(r), i, j);
  if (!pattern.empty()) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(f.src, pattern.data(), pattern.size() * 2, cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));  // a pageable copy's DMA, before non-blocking streams read
  f.ev.resize(static_cast<size_t>(events));
  for (auto& e : f.ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  return Status::Ok();
}

// Rank r's timed loop: per iteration and direction, the host wait, a device barrier, the copy between two events.
Status TimeRank(CudaDomain& domain, int32_t r, FloorRank& f, const dispatch::PeerRowsCopy (&copy)[2], int64_t H, int64_t warmup,
                int64_t iters, const int64_t* launch_ahead_us, std::vector<double> (&ms)[2]) {
  cudaStream_t stream = domain.stream(r);
  for (int64_t i = 0; i < warmup + iters; ++i)
    for (int d = 0; d < 2; ++d) {
      RDEP_RETURN_IF_ERROR(LaunchAhead(stream, launch_ahead_us));
      RDEP_RETURN_IF_ERROR(domain.Barrier(r, Phase::kTest));
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(f.ev[static_cast<size_t>(4 * i + 2 * d)], stream));
      RDEP_RETURN_IF_ERROR(dispatch::LaunchPeerRowsCopy(f.src, copy[d], H, stream));
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(f.ev[static_cast<size_t>(4 * i + 2 * d + 1)], stream));
    }
  RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
  for (int64_t i = warmup; i < warmup + iters; ++i)
    for (int d = 0; d < 2; ++d) {
      float t = 0;
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t, f.ev[static_cast<size_t>(4 * i + 2 * d)], f.ev[static_cast<size_t>(4 * i + 2 * d + 1)]));
      ms[d].push_back(t);
    }
  return Status::Ok();
}

}  // namespace

StatusOr<PeerStoreFloor> RunPeerStoreFloor(CudaDomain& domain, const PairRows& dispatch, const PairRows& combine, int64_t H,
                                           int64_t warmup, int64_t iters, const int64_t* launch_ahead_us) {
  const size_t W = static_cast<size_t>(domain.num_ranks());
  if (dispatch.size() != W || combine.size() != W) return InvalidArgument("peer-store floor: row tables are not W x W");
  if (W - 1 > static_cast<size_t>(dispatch::kMaxPeerCopyDestinations))
    return InvalidArgument("peer-store floor: W=" + std::to_string(W) + " ranks, at most " +
                           std::to_string(dispatch::kMaxPeerCopyDestinations + 1));
  std::vector<FloorRank> fr(W);
  PeerStoreFloor out;
  Status st = Status::Ok();
  for (size_t r = 0; r < W && st.ok(); ++r) {
    const int64_t src = std::max(SentBy(dispatch, r), SentBy(combine, r));
    const int64_t recv = std::max(ReceivedBy(dispatch, r), ReceivedBy(combine, r));
    out.bytes_max_rank = std::max(out.bytes_max_rank, static_cast<size_t>(src + recv) * static_cast<size_t>(H) * 2);
    st = SetUpRank(fr[r], r, src, recv, H, 4 * (warmup + iters), domain.device(static_cast<int32_t>(r)));
  }
  std::vector<std::vector<double>> t[2] = {std::vector<std::vector<double>>(W), std::vector<std::vector<double>>(W)};
  if (st.ok())
    st = domain.Run([&](int32_t r) -> Status {
      const auto sr = static_cast<size_t>(r);
      const dispatch::PeerRowsCopy copy[2] = {CopyOf(dispatch, fr, sr, H), CopyOf(combine, fr, sr, H)};
      std::vector<double> ms[2];
      RDEP_RETURN_IF_ERROR(TimeRank(domain, r, fr[sr], copy, H, warmup, iters, launch_ahead_us, ms));
      t[0][sr] = std::move(ms[0]);
      t[1][sr] = std::move(ms[1]);
      return Status::Ok();
    });
  // The check, after the timed loops, of each table in turn (both are timed on the same buffers).
  bool exact_dispatch = false, exact_combine = false;
  if (st.ok()) st = CheckTable(domain, dispatch, fr, H, exact_dispatch);
  if (st.ok()) st = CheckTable(domain, combine, fr, H, exact_combine);
  for (size_t r = 0; r < W; ++r) {  // freed on every path; a failure here changes no result
    cudaSetDevice(domain.device(static_cast<int32_t>(r)));
    cudaFree(fr[r].src);
    cudaFree(fr[r].recv);
    for (auto e : fr[r].ev) cudaEventDestroy(e);
  }
  RDEP_RETURN_IF_ERROR(st);
  out.dispatch_ms = MaxOverRanks(t[0]);
  out.combine_ms = MaxOverRanks(t[1]);
  out.exact = exact_dispatch && exact_combine;
  return out;
}

}  // namespace rdep::bench

#endif  // RDEP_HAVE_CUDA
