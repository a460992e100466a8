// The owner's expansion (LaunchExpand, expand_kernels.cu) on the GPU against a host stable counting sort
// of the same sideband, exactly: the rows per local expert, every grouped row (row id, segment position,
// local expert, gate) with each expert's rows in segment order after the earlier experts', inv for each
// (position, sideband row), nothing written at or past max_rows and nothing past the segment's token
// count. Fresh random sidebands, outputs poisoned first. Covers a segment window past the first (lo > 0,
// buffer 1), S not a multiple of the 32-position chunk, positions with more rows than the kernel keeps in
// registers, more local experts than a block has threads, and a max_rows that cuts the last experts.
// The slot-map cases give rows real identities (token = the position across both buffers, distinct slots
// per token; every seventh token rank 1's) and check slot_rows: each placed rank-0 row's grouped index at
// its slot, -1 at the slot of a row cut by max_rows, nothing else written. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "experts/experts_test_util.h"
#include "rdep/core/random.h"
#include "rdep/core/row_id.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/dispatch_kernels.h"

namespace rdep::dispatch {
namespace {

using kernels::test_util::Dev;

struct ExpandCase {
  std::string name;
  int64_t S, spt;       // positions per segment buffer, sideband rows per position
  int32_t num_local;
  int64_t stream_tokens;  // the owner's token stream (its sources' counts sum to it)
  int64_t lo;             // the window's first stream position (buffer = (lo / S) % 2)
  double fill;            // chance a position's slot r holds a row (each position has at least one)
  int64_t max_rows;       // -1: every row fits
  bool with_inv;
  bool with_slot_rows = false;  // row ids encode (rank, token, slot); slot_rows checked
};
void PrintTo(const ExpandCase& c, std::ostream* os) { *os << c.name; }

class Expand : public ::testing::TestWithParam<ExpandCase> {};

TEST_P(Expand, MatchesAHostStableSortExactly) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const ExpandCase& c = GetParam();
  RegionLayout l;
  l.W = 3, l.L = c.num_local, l.S = c.S, l.H = 8, l.T = c.with_slot_rows ? 2 * c.S : 1 << 20, l.K = c.spt, l.slots_per_token = c.spt,
  l.elem_bytes = 2;
  const RowIdCodec codec{l.T, l.K};
  const int32_t buf = static_cast<int32_t>((c.lo / c.S) % 2);
  const int64_t n_seg = std::clamp<int64_t>(c.stream_tokens - c.lo, 0, c.S);
  // The sideband of both buffers: random rows (distinct local experts per position) everywhere, so rows
  // past the segment's token count would show if read.
  const size_t tsb = l.token_sideband_bytes();
  std::vector<char> sideband(2 * static_cast<size_t>(c.S) * tsb, 0);
  Rng rng(1234 + static_cast<uint64_t>(c.S));
  std::vector<int32_t> pool(static_cast<size_t>(c.num_local));
  for (int64_t q = 0; q < 2 * c.S; ++q) {
    char* sb = sideband.data() + static_cast<size_t>(q) * tsb;
    for (int32_t j = 0; j < c.num_local; ++j) pool[static_cast<size_t>(j)] = j;
    int64_t rows = 0;
    std::vector<RowSideband> rs;
    std::vector<int64_t> slots(static_cast<size_t>(c.spt));  // distinct slots of token q, in a random order
    for (int64_t k = 0; k < c.spt; ++k) slots[static_cast<size_t>(k)] = k;
    for (int64_t k = c.spt - 1; k > 0; --k) std::swap(slots[static_cast<size_t>(k)], slots[rng.below(static_cast<uint64_t>(k + 1))]);
    for (int64_t r = 0; r < std::min<int64_t>(c.spt, c.num_local); ++r) {
      if (r > 0 && rng.uniform() >= c.fill) continue;
      const auto pick = static_cast<size_t>(rows + static_cast<int64_t>(rng.below(static_cast<uint64_t>(c.num_local - rows))));
      std::swap(pool[static_cast<size_t>(rows)], pool[pick]);
      const uint64_t id = c.with_slot_rows ? codec.encode(q % 7 == 3 ? 1 : 0, q, slots[static_cast<size_t>(r)]) : rng.next();
      rs.push_back(RowSideband{id, pool[static_cast<size_t>(rows)], static_cast<float>(rng.uniform())});
      ++rows;
    }
    std::memcpy(sb, &rows, sizeof(int64_t));
    std::memcpy(sb + sizeof(int64_t), rs.data(), rs.size() * sizeof(RowSideband));
  }
  // Host: the stable sort of the window's rows by local expert.
  std::vector<int64_t> want_counts(static_cast<size_t>(c.num_local), 0);
  const char* seg = sideband.data() + static_cast<size_t>(buf) * static_cast<size_t>(c.S) * tsb;
  auto row_at = [&](int64_t p, int64_t r) {
    RowSideband x;
    std::memcpy(&x, seg + static_cast<size_t>(p) * tsb + sizeof(int64_t) + static_cast<size_t>(r) * sizeof(RowSideband), sizeof(x));
    return x;
  };
  auto rows_at = [&](int64_t p) {
    int64_t n;
    std::memcpy(&n, seg + static_cast<size_t>(p) * tsb, sizeof(n));
    return n;
  };
  for (int64_t p = 0; p < n_seg; ++p)
    for (int64_t r = 0; r < rows_at(p); ++r) ++want_counts[static_cast<size_t>(row_at(p, r).local_expert)];
  std::vector<int64_t> next(static_cast<size_t>(c.num_local), 0);
  for (int32_t j = 1; j < c.num_local; ++j) next[static_cast<size_t>(j)] = next[static_cast<size_t>(j - 1)] + want_counts[static_cast<size_t>(j - 1)];
  const int64_t total = next.back() + want_counts.back();
  const int64_t max_rows = c.max_rows < 0 ? total : c.max_rows;
  std::vector<GroupedRow> want_grouped(static_cast<size_t>(total), GroupedRow{~0ull, -1, -1, -1.f, -1});
  std::vector<int32_t> want_inv(static_cast<size_t>(c.S * c.spt), -1);
  constexpr int32_t kUnwritten = 0x7F7F7F7F;  // slot_rows' fill: distinct from the -1 a cut row's slot gets
  std::vector<int32_t> want_slot_rows(c.with_slot_rows ? static_cast<size_t>(l.T * l.K) : 1, kUnwritten);
  for (int64_t p = 0; p < n_seg; ++p)
    for (int64_t r = 0; r < rows_at(p); ++r) {
      const RowSideband x = row_at(p, r);
      const int64_t g = next[static_cast<size_t>(x.local_expert)]++;
      const RowKey key = codec.decode(x.row_id);
      if (c.with_slot_rows && key.rank == 0)
        want_slot_rows[static_cast<size_t>(key.token * l.K + key.slot)] = g < max_rows ? static_cast<int32_t>(g) : -1;
      if (g >= max_rows) continue;
      want_grouped[static_cast<size_t>(g)] = GroupedRow{x.row_id, static_cast<int32_t>(p), x.local_expert, x.gate, 0};
      want_inv[static_cast<size_t>(p * c.spt + r)] = static_cast<int32_t>(g);
    }
  // Device: the control words give the stream's length (split over the sources).
  std::vector<int64_t> control(l.control_bytes() / sizeof(int64_t), 0);
  control[static_cast<size_t>(l.recv_tokens(0))] = c.stream_tokens / 2;
  control[static_cast<size_t>(l.recv_tokens(2))] = c.stream_tokens - c.stream_tokens / 2;
  Dev<char> sb_dev(sideband.size());
  Dev<int64_t> control_dev(control.size()), counts(static_cast<size_t>(c.num_local));
  Dev<GroupedRow> grouped(static_cast<size_t>(std::max<int64_t>(total, 1)));
  Dev<int32_t> inv(want_inv.size()), scratch(static_cast<size_t>(ExpandScratchInts(l, c.num_local)));
  Dev<int32_t> slot_rows(want_slot_rows.size());
  sb_dev.Upload(sideband);
  control_dev.Upload(control);
  counts.Poison();
  grouped.Poison();
  inv.Poison();
  scratch.Poison();
  slot_rows.Upload(std::vector<int32_t>(want_slot_rows.size(), kUnwritten));
  for (int pass = 0; pass < 2; ++pass) {  // the scratch holds the last launch's values: a second launch must not care
    ASSERT_TRUE(LaunchExpand(sb_dev.p, buf, c.lo, l, control_dev.p, c.num_local, counts.p, grouped.p, max_rows, scratch.p, nullptr,
                             c.with_inv ? inv.p : nullptr, c.with_slot_rows ? slot_rows.p : nullptr)
                    .ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(counts.Download(), want_counts) << "pass " << pass;
    const std::vector<GroupedRow> got = grouped.Download();
    for (int64_t g = 0; g < total; ++g) {
      const GroupedRow& a = got[static_cast<size_t>(g)];
      if (g >= max_rows) {  // untouched: still the poison bytes
        ASSERT_EQ(a.row_id, ~0ull) << "row " << g << " at or past max_rows " << max_rows;
        continue;
      }
      const GroupedRow& b = want_grouped[static_cast<size_t>(g)];
      ASSERT_TRUE(a.row_id == b.row_id && a.token == b.token && a.local_expert == b.local_expert &&
                  std::memcmp(&a.gate, &b.gate, 4) == 0 && a.pad == 0)
          << "row " << g << " pass " << pass;
    }
    if (c.with_inv) {
      EXPECT_EQ(inv.Download(), want_inv) << "pass " << pass;
    }
    if (c.with_slot_rows) {
      EXPECT_EQ(slot_rows.Download(), want_slot_rows) << "pass " << pass;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Expand,
    ::testing::Values(ExpandCase{"moonlight_owner", 16384, 6, 16, 13500, 0, 0.8, -1, true},
                      ExpandCase{"second_window_buffer1", 1000, 4, 16, 2500, 1000, 0.5, -1, true},
                      ExpandCase{"odd_S_partial", 777, 3, 5, 700, 0, 0.6, -1, false},
                      ExpandCase{"empty_window", 512, 6, 16, 300, 512, 0.5, -1, true},
                      ExpandCase{"rows_beyond_registers", 300, 12, 20, 300, 0, 0.9, -1, true},
                      ExpandCase{"more_experts_than_threads", 2048, 8, 300, 2000, 0, 0.9, -1, true},
                      ExpandCase{"max_rows_cuts", 1024, 6, 16, 1024, 0, 0.7, 2000, true},
                      ExpandCase{"one_expert", 96, 1, 1, 64, 0, 1.0, -1, true},
                      ExpandCase{"slot_rows_moonlight", 4096, 6, 64, 4096, 0, 0.9, -1, false, true},
                      ExpandCase{"slot_rows_second_window", 1000, 4, 16, 1700, 1000, 0.6, -1, true, true},
                      ExpandCase{"slot_rows_max_rows_cuts", 1024, 6, 16, 1024, 0, 0.7, 2000, true, true}),
    [](const ::testing::TestParamInfo<ExpandCase>& i) { return i.param.name; });

}  // namespace
}  // namespace rdep::dispatch
