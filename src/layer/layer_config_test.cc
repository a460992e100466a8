// MaxSegmentRows: the owner's per-segment row bound that sizes the CUDA layer's row buffers. Its
// arithmetic, and that the rows the capacity rule admits to any owner never exceed it (the host
// reference's acceptance on skewed routing, one segment).
#include <gtest/gtest.h>

#include <sstream>

#include <string>
#include <vector>

#include "rdep/core/capacity.h"
#include "rdep/core/routing.h"
#include "rdep/layer/layer_config.h"

namespace rdep {
namespace {

struct Layer {  // a config, its ownership and region layout
  LayerConfig cfg;
  OwnershipMap own;
  RegionLayout l;
};

Layer Make(double capacity_factor, int32_t slots = 0) {
  const LayerShape s{.tokens = 256, .hidden = 16, .ffn = 8, .experts = 16, .topk = 4, .ranks = 4};
  LayerConfig cfg = MakeLayerConfig(s, CapacityPolicy{.capacity_factor = capacity_factor}, /*segment_tokens=*/s.ranks * s.tokens);
  if (slots > 0) cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = slots};
  OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  const RegionLayout l = MakeRegionLayout(cfg, own, 2);
  return {cfg, own, l};
}

TEST(MaxSegmentRows, DroplessIsTheSegmentsWorstCase) {
  const Layer u = Make(0);
  EXPECT_EQ(MaxSegmentRows(u.cfg, u.l), u.l.S * u.l.slots_per_token);  // 1024 tokens x min(K, E_loc) = 4
}

TEST(MaxSegmentRows, ACapacityBoundsItByEveryExpertFull) {
  const Layer u = Make(1.0);  // capacity ceil(1.0 * 4*256*4 / 16) = 256 rows per expert, 4 local experts
  ASSERT_EQ(u.cfg.capacity.ExpertCapacity(u.cfg.shape), 256);
  EXPECT_EQ(MaxSegmentRows(u.cfg, u.l), 4 * 256);
  const Layer b = Make(1.0, /*slots=*/2);  // main experts and redundant slots: 6 physical instances
  EXPECT_EQ(b.l.L, 6);
  EXPECT_EQ(MaxSegmentRows(b.cfg, b.l), std::min<int64_t>(6 * 256, b.l.S * b.l.slots_per_token));
  const Layer big = Make(1e30);  // a capacity past the worst case (saturated): the segment bound stands
  EXPECT_EQ(MaxSegmentRows(big.cfg, big.l), big.l.S * big.l.slots_per_token);
}

TEST(MaxSegmentRows, NoOwnerIsAdmittedMoreRows) {
  for (double c : {0.5, 1.0, 1.25, 2.0}) {
    const Layer u = Make(c);
    for (const char* routing : {"uniform", "zipf:1", "zipf:2", "one-expert"}) {
      SCOPED_TRACE(std::string(routing) + ", capacity factor " + std::to_string(c));
      auto spec = RoutingSpec::Parse(routing);
      ASSERT_TRUE(spec.ok());
      auto rt = GenerateRouting(u.cfg.shape, *spec);
      ASSERT_TRUE(rt.ok());
      auto acc = ApplyCapacity(u.cfg.shape, *rt, u.cfg.capacity);
      ASSERT_TRUE(acc.ok()) << acc.status();
      std::vector<int64_t> rows(static_cast<size_t>(u.cfg.shape.ranks), 0);
      for (int32_t r = 0; r < u.cfg.shape.ranks; ++r) {
        const RankRouting& rr = (*rt)[static_cast<size_t>(r)];
        for (size_t i = 0; i < rr.experts.size(); ++i)
          if ((*acc)[static_cast<size_t>(r)].accepted[i]) ++rows[static_cast<size_t>(u.own.owner(rr.experts[i]))];
      }
      for (int64_t owner_rows : rows) EXPECT_LE(owner_rows, MaxSegmentRows(u.cfg, u.l));
    }
  }
}

// overlap_segments and gate_in_expert need the sync-free layer (the pipeline also the per-slot return, so
// not owner_reduce); each other setting is refused by name, naming the option too.
TEST(LayerConfigValidate, OverlapSegmentsAndGateInExpertNameWhatTheyNeed) {
  for (const char* option : {"overlap_segments", "gate_in_expert"}) {
    LayerConfig ok = Make(0).cfg;
    ok.expert_compute = ExpertComputeKind::kCutlass;
    (std::string(option) == "overlap_segments" ? ok.overlap_segments : ok.gate_in_expert) = true;
    EXPECT_TRUE(ok.Validate().ok()) << option << ": " << ok.Validate();
    struct Bad {
      const char* names;
      LayerConfig cfg;
    };
    std::vector<Bad> bad;
    bad.push_back({"expert_compute cublaslt", ok});
    bad.back().cfg.expert_compute = ExpertComputeKind::kCublasLt;
    if (std::string(option) == "overlap_segments") {
      bad.push_back({"owner_reduce on", ok});
      bad.back().cfg.owner_reduce = true;
    } else {
      LayerConfig with_reduce = ok;
      with_reduce.owner_reduce = true;
      EXPECT_TRUE(with_reduce.Validate().ok()) << "gate_in_expert with owner_reduce: " << with_reduce.Validate();
    }
    bad.push_back({"balance ultraep", ok});
    bad.back().cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = 2};
    bad.push_back({"nodes 2", ok});
    bad.back().cfg.nodes = NodeConfig{.nodes = 2, .max_nodes = 2};
    for (const Bad& b : bad) {
      const Status st = b.cfg.Validate();
      EXPECT_FALSE(st.ok()) << option << ", " << b.names;
      EXPECT_NE(st.message().find(option), std::string::npos) << st;
      EXPECT_NE(st.message().find(b.names), std::string::npos) << st;
    }
  }
}

// gate_in_expert is printed, and with owner_reduce the owners take dgate's dots (the dots region exists).
TEST(LayerConfigValidate, GateInExpertIsPrintedAndTakesTheDots) {
  LayerConfig c = Make(0).cfg;
  EXPECT_FALSE(OwnersTakeDgateDots(c));
  c.expert_compute = ExpertComputeKind::kCutlass;
  c.gate_in_expert = true;
  std::ostringstream os;
  os << c;
  EXPECT_NE(os.str().find("gate-in-expert"), std::string::npos) << os.str();
  EXPECT_TRUE(OwnersTakeDgateDots(c));
  c.gate_in_expert = false;
  c.owner_reduce = true;
  EXPECT_TRUE(OwnersTakeDgateDots(c));
}

// The owner's output rows (the CUDA layer's "owner.out_rows"): one set when the CUTLASS compute writes dx
// over dout (no balancing: the replica slots run cuBLASLt), two otherwise, and two with overlapped segments
// when there is more than one segment (two segments' rows in flight).
TEST(OwnerOutputRowSets, OneSetOnlyWhereDxGoesOverDout) {
  const LayerConfig base = Make(0).cfg;  // S = W*T: one segment
  const int64_t WT = base.shape.ranks * base.shape.tokens;
  struct Case {
    const char* what;
    ExpertComputeKind compute;
    int32_t slots;
    bool overlap;
    int64_t S;
    bool dx_over_dout;
    int64_t sets;
  };
  const Case cases[] = {
      {"cutlass", ExpertComputeKind::kCutlass, 0, false, WT, true, 1},
      {"cutlass, several segments", ExpertComputeKind::kCutlass, 0, false, WT / 4, true, 1},
      {"cublaslt", ExpertComputeKind::kCublasLt, 0, false, WT, false, 2},
      {"cutlass with balancing", ExpertComputeKind::kCutlass, 2, false, WT, false, 2},
      {"cutlass, overlapped segments", ExpertComputeKind::kCutlass, 0, true, WT / 4, true, 2},
      {"cutlass, overlap asked with one segment", ExpertComputeKind::kCutlass, 0, true, WT, true, 1},
  };
  for (const Case& c : cases) {
    LayerConfig cfg = base;
    cfg.expert_compute = c.compute;
    if (c.slots > 0) cfg.balance = BalanceConfig{.kind = BalanceKind::kUltraEp, .num_slots = c.slots};
    cfg.overlap_segments = c.overlap;
    cfg.segment_tokens = c.S;
    EXPECT_EQ(DxOverDout(cfg), c.dx_over_dout) << c.what;
    EXPECT_EQ(OwnerOutputRowSets(cfg, c.S), c.sets) << c.what;
  }
}

}  // namespace
}  // namespace rdep

namespace rdep {
namespace {

// The payload and sideband are double-buffered only when a call can have several segments (segment s uses
// buffer s % 2); with S >= W*T every call has one segment and one buffer is allocated.
TEST(RegionLayoutBuffers, OneBufferWhenEveryCallHasOneSegment) {
  const LayerShape s{.tokens = 256, .hidden = 16, .ffn = 8, .experts = 16, .topk = 4, .ranks = 4};
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  for (const int64_t S : {int64_t{256}, int64_t{1023}, int64_t{1024}, int64_t{4096}}) {
    SCOPED_TRACE("S=" + std::to_string(S));
    const RegionLayout l = MakeRegionLayout(MakeLayerConfig(s, {}, S), own, 2);
    const int64_t want = S >= s.ranks * s.tokens ? 1 : 2;
    EXPECT_EQ(l.buffers, want);
    EXPECT_EQ(l.payload_bytes(), static_cast<size_t>(want * S * s.hidden * 2));
    EXPECT_EQ(l.sideband_bytes(), static_cast<size_t>(want * S) * l.token_sideband_bytes());
  }
}

// Per-source windows: the context's control copy reads every window as T tokens long, source s's at
// s*T of each owner's stream and this rank's at rank*T of every owner's; counts and loads 0.
TEST(RegionLayoutWindows, TheControlCopyDescribesFixedWindows) {
  const LayerShape s{.tokens = 100, .hidden = 16, .ffn = 8, .experts = 16, .topk = 4, .ranks = 4};
  const OwnershipMap own = *OwnershipMap::Contiguous(s.experts, s.ranks);
  const RegionLayout l = MakeRegionLayout(MakeLayerConfig(s), own, 2);
  const int64_t rank = 2, words = static_cast<int64_t>(l.control_bytes() / sizeof(int64_t));
  std::vector<int64_t> want(static_cast<size_t>(words), 0);
  for (int64_t q = 0; q < l.W; ++q) {
    want[static_cast<size_t>(l.recv_tokens(q))] = 100;
    want[static_cast<size_t>(l.recv_offsets(q))] = q * 100;
    want[static_cast<size_t>(l.send_offsets(q))] = rank * 100;
    want[static_cast<size_t>(l.owner_tokens(q))] = 400;
  }
  for (int64_t w = 0; w < words; ++w) EXPECT_EQ(l.window_word(rank, w), want[static_cast<size_t>(w)]) << "word " << w;
}

TEST(LayerConfigPrint, SourceWindowsOffIsPrinted) {
  LayerConfig c = MakeLayerConfig(LayerShape{.tokens = 8, .hidden = 16, .ffn = 8, .experts = 4, .topk = 2, .ranks = 1});
  std::ostringstream on, off;
  on << c;
  c.source_windows = false;
  off << c;
  EXPECT_EQ(on.str().find("no-source-windows"), std::string::npos) << on.str();
  EXPECT_NE(off.str().find("no-source-windows"), std::string::npos) << off.str();
}

}  // namespace
}  // namespace rdep
