// LayerConfig: how one MoE layer runs (shape, capacity policy, segment size), printable and
// validated up front.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

#include "rdep/balance/layer_balance.h"
#include "rdep/core/capacity.h"
#include "rdep/core/expert_mlp.h"
#include "rdep/core/ownership.h"
#include "rdep/core/reference.h"
#include "rdep/core/shape.h"
#include "rdep/dispatch/region_layout.h"
#include "rdep/status.h"
#include "rdep/transport/domain.h"
#include "rdep/transport/inter_node.h"

namespace rdep {

inline constexpr int64_t kMaxLoadMatrixExperts = 8192;  // one rank's row is counted in shared memory
inline constexpr int32_t kMaxTransportSms = 1024;        // LayerConfig::transport_sms's bound (no GPU has more)

// Which implementation computes the experts on the CUDA backend (rdep/experts/expert_compute.h).
enum class ExpertComputeKind {
  kCublasLt,  // cuBLASLt (counts on the host: one host wait per forward segment)
  kCutlass,   // CUTLASS grouped GEMMs for sm_90a reading the counts on the device: with one segment per
              // forward and no balancing, the layer then never waits on the host (graph-capturable)
};
const char* ExpertComputeName(ExpertComputeKind k);
// "cublaslt" or "cutlass"; InvalidArgument naming the value otherwise.
StatusOr<ExpertComputeKind> ParseExpertCompute(const std::string& name);
// "split" or "interleaved8" (mlp::GateUpName); InvalidArgument naming the value otherwise.
StatusOr<mlp::GateUp> ParseGateUp(const std::string& name);

struct LayerConfig {
  LayerShape shape;
  CapacityPolicy capacity;         // dropless by default
  int64_t segment_tokens = 0;      // S: token rows an owner receives per segment; 0 = the backend's
                                   // default (host: T; CUDA: W*T, so one segment and no host sync)
  bool load_matrix = false;        // phase 1 also gives every rank the full load matrix Lambda[W][E]
                                   // (the balancer needs it; W*E words per rank; E <= kMaxLoadMatrixExperts)
  BalanceConfig balance;           // replicas of hot experts (host backend so far); on implies load_matrix
  NodeConfig nodes;                // N nodes of W/N ranks: two-phase exchange and node cap M (CUDA: not with
                                   // expert_compute cutlass; not with balancing on either backend)
  ExpertComputeKind expert_compute = ExpertComputeKind::kCublasLt;  // CUDA backend (the host backend computes on the host)
  int32_t transport_sms = 0;       // SM budget of the one-domain exchange's kernels that store into peer memory
                                   // (scatter, return, the owner's reduce and dots): that many blocks of
                                   // kTransportThreads, so at most that many SMs (<= kMaxTransportSms); 0 = grids
                                   // sized by the work (every SM). For leaving SMs to overlapped compute. Not with
                                   // nodes > 1; the replica streaming kernels take none; the host backend ignores it
  bool owner_reduce = false;       // the owner sums its rows of a token before they cross back (gate-weighted
                                   // in forward, plain dx in backward): one row per (token, owner) returns, into
                                   // the slot of the token's first row on that owner, instead of one per slot;
                                   // dgate's dot products are then taken by the owner in backward and return as
                                   // one value per (token, slot) (regions: LayerRegions::dots). Not with nodes > 1
                                   // (the relays reduce already), the sentinel expert or the caller's experts
  int64_t stash_rows = 0;          // the paged stash (seeds 002): > 0 keeps a CUDA sync-free forward's saved owner
                                   // rows (x, the SwiGLU inputs h, with owner_reduce the outputs f) in pages of a
                                   // pool of this many rows per rank, shared by the domain's layers of one shape
                                   // and pool size, instead of each context holding the worst case; the worst
                                   // case is then one transient buffer shared by those layers. A forward whose rows
                                   // do not fit the free pages on some rank still returns its output; every rank's
                                   // backward of it then fails before its exchange, naming the ranks, their rows and
                                   // the pool (dx, dgates and weight gradients NaN). 0 = off. Needs
                                   // expert_compute cutlass, no balancing, one node; not inside a CUDA graph
                                   // capture. The host backend ignores it
  bool overlap_segments = false;   // CUDA: run a forward's and a backward's segments as a pipeline (seeds 000 section
                                   // 3.5): the dispatch of segment s+1 and the return of s-1 in flight while the
                                   // experts compute s, on a second stream per rank; bitwise equal to the sequential
                                   // schedule. With transport_sms > 0 (at most half the GPU's SMs) the expert GEMMs'
                                   // persistent grids leave that many SMs to the transport. Needs the sync-free layer (expert_compute cutlass,
                                   // no balancing, one node) and the per-slot return (not owner_reduce); pays only
                                   // with more than one segment (segment_tokens < W*T). The host backend ignores it
  bool gate_in_expert = false;     // CUDA: the gate multiplied before W2 (seeds 002 section 4): the owner's expert
                                   // compute scales each row's SwiGLU output by its effective gate, so the rows that
                                   // return are weighted already; the front-end sums them with weights 1 and keeps no
                                   // expert outputs for backward (T*K*H values a context less). In backward dy crosses
                                   // unweighted and the owner's compute takes each row's dgate from its saved
                                   // pre-activations, stored into the front-end's dots region (LayerRegions::dots).
                                   // y and the gradients differ from the default by bf16 rounding, within the same
                                   // tolerances. With owner_reduce the owner sums the weighted rows and keeps no
                                   // outputs for dgate either. Needs expert_compute cutlass, no balancing and one
                                   // node; the SwiGLU expert only. The host backend ignores it
  bool source_windows = true;      // CUDA: a Forward (Plan + Run in one call) that is dropless, in one segment, without
                                   // balancing, nodes or the load matrix places each source's tokens in a fixed window
                                   // (source s at s*T) of every owner's stream, so its plan exchanges no counts: no
                                   // owner scan and no routing barriers (region_layout.h). The same outputs bit for
                                   // bit; off = the three phases for every forward (A/B timing). The host backend and
                                   // Plan (the caller's experts need the counts first) always take the three phases
  mlp::GateUp gate_up = mlp::GateUp::kSplit;  // where each expert's W1 (and so its gradient) holds the gate and up
                                   // projections' columns (rdep/core/expert_mlp.h): kSplit (gate | up) or kInterleaved8
                                   // (blocks of 8; needs ffn % 8 == 0), the layout GEMM1's SwiGLU epilogue needs; the
                                   // layer runs the separate SwiGLU kernel with either (the epilogue measured slower).
                                   // Every backend and the reference (MoEWeights::gate_up) read it

  Status Validate() const;
  bool has_load_matrix() const { return load_matrix || balance.enabled(); }
  // Redundant slots per rank the regions and owners provide room for (0 with balancing off).
  int32_t replica_slots() const { return balance.enabled() ? balance.num_slots : 0; }
  int64_t segment() const { return segment_tokens > 0 ? segment_tokens : (shape.tokens > 0 ? shape.tokens : 1); }
};

std::ostream& operator<<(std::ostream& os, const LayerConfig& c);

// A config of this shape, capacity policy and segment size, every other field at its default.
inline LayerConfig MakeLayerConfig(const LayerShape& shape, const CapacityPolicy& capacity = {}, int64_t segment_tokens = 0) {
  LayerConfig c;
  c.shape = shape;
  c.capacity = capacity;
  c.segment_tokens = segment_tokens;
  return c;
}

// The region layout of this config (rdep/dispatch/region_layout.h) for elements of elem_bytes.
RegionLayout MakeRegionLayout(const LayerConfig& c, const OwnershipMap& m, size_t elem_bytes);

// The most grouped rows one owner can hold from one segment (at least 1): S * slots_per_token, and with a
// capacity no more than every physical expert (main and redundant, l.L) full, L * ExpertCapacity: the owner
// scan admits at most the capacity per expert, and the balancer at most that per instance. The owner's
// row buffers (and the sync-free layer's worst-case ones) are sized by it.
int64_t MaxSegmentRows(const LayerConfig& c, const RegionLayout& l);

// True when the owner's backward writes the dx rows over the dout rows: the CUTLASS expert compute allows
// it (ExpertCompute::dx_may_alias_dout), and without balancing, whose replica slots run cuBLASLt.
bool DxOverDout(const LayerConfig& c);
// True when the owners take dgate's dot products in backward and store them into the front-ends' dots
// region (owner_reduce, gate_in_expert on the CUDA backend): the front-end then keeps no expert outputs.
inline bool OwnersTakeDgateDots(const LayerConfig& c) { return c.owner_reduce || c.gate_in_expert; }
// True when the owner keeps its expert outputs f_k from forward to backward for dgate's dots: owner_reduce
// without gate_in_expert (with it the dots come from the SwiGLU' pass's saved pre-activations).
inline bool OwnerKeepsOutputs(const LayerConfig& c) { return c.owner_reduce && !c.gate_in_expert; }
// True when the CUTLASS compute's SwiGLU scratch (scratch_bytes a rank) can live in the rank's return region:
// one rank (no peer stores into it), one segment a call, one node, no balancing, and the region large enough.
// Within a call the scratch is used only inside the owner's expert compute, and the return region only after
// it (the return of the outputs or dx rows, then the combine), so the two never hold live data together; no
// kernel may write into the return region while the compute still reads its scratch (an owner storing its
// outputs straight into the return region would need the scratch elsewhere). The CUDA layer keeps a scratch
// of its own when RDEP_EXPERT_SCRATCH=own (for A/B tests; CudaMoELayer::Create).
bool ScratchInReturnRegion(const LayerConfig& c, const RegionLayout& l, size_t scratch_bytes);
// How many sets of MaxSegmentRows output rows an owner needs (the CUDA layer's shared "owner.out_rows"),
// S the segment's tokens: forward outputs; backward dout rows and dx rows behind them unless DxOverDout;
// with overlapped segments (more than one segment) two segments' rows in flight.
int64_t OwnerOutputRowSets(const LayerConfig& c, int64_t S);

// What every backend's layer checks at Create: a valid config, a domain of W ranks, an ownership
// map and (when given) weights of the layer's shape.
Status ValidateLayerInputs(const LayerConfig& c, int64_t domain_ranks, const OwnershipMap& m);
Status ValidateLayerInputs(const LayerConfig& c, int64_t domain_ranks, const OwnershipMap& m, const MoEWeights& w);

// The caller's expert weights for one rank, bound to a layer instead of its own copy (the PyTorch
// binding's parameters): w1 [E_loc][H][2F], w2 [E_loc][F][H] for the rank's experts in local order
// (MoEWeights' layout per expert), and dw1, dw2 of the same shapes, written (not accumulated) by
// backward. Weights and gradients each come as a pair or not at all; all null = the layer's own.
template <typename Wt, typename G>
struct ExternalWeights {
  const Wt* w1 = nullptr;
  const Wt* w2 = nullptr;
  G* dw1 = nullptr;
  G* dw2 = nullptr;

  Status Validate(int32_t rank) const {
    if ((w1 == nullptr) != (w2 == nullptr) || (dw1 == nullptr) != (dw2 == nullptr))
      return InvalidArgument("expert weights bound to rank " + std::to_string(rank) +
                             ": w1 and w2 (and dw1 and dw2) must be given together");
    if (w1 == nullptr && dw1 != nullptr)
      return InvalidArgument("expert weights bound to rank " + std::to_string(rank) + ": gradients without weights");
    return Status::Ok();
  }
};

// The protocol's four symmetric regions on a domain (host or CUDA), allocated by layout, and with
// LayerConfig::owner_reduce or gate_in_expert a fifth: dots, one value per (token, slot) of dot_bytes each
// (the owners' dgate dot products in backward).
struct LayerRegions {
  RegionId control = -1, payload = -1, sideband = -1, ret = -1, dots = -1;
  // The segment payload, its sideband and the return region acquired as domain regions shared by every
  // layer whose regions have the same sizes (Domain::AcquireShared, "layer.*"): nothing in them outlives
  // a call (a call's peer stores into them all follow one of its own barriers or the previous call's
  // final one, which every rank joins after its reads of that call), so the layers of a stack hold them
  // once. The control words stay per layer (phase 1 publishes them before any barrier of the call).
  bool shared_transport = false;

  // A failure part-way frees what it had allocated (the domain may outlive the layer: C ABI v4).
  static StatusOr<LayerRegions> Allocate(Domain& d, const RegionLayout& l, size_t dot_bytes = 0, bool share_transport = false) {
    LayerRegions r;
    r.shared_transport = share_transport;
    struct Part {
      RegionId* id;
      size_t bytes;
      const char* name;
    };
    const Part parts[] = {{&r.control, l.control_bytes(), "control"},
                          {&r.payload, l.payload_bytes(), "segment.payload"},
                          {&r.sideband, l.sideband_bytes(), "segment.sideband"},
                          {&r.ret, l.return_bytes(), "return"},
                          {&r.dots, static_cast<size_t>(l.T * l.K) * dot_bytes, "dots"}};
    for (const Part& p : parts) {
      if (p.id == &r.dots && dot_bytes == 0) continue;
      const bool shared = share_transport && (p.id == &r.payload || p.id == &r.sideband || p.id == &r.ret);
      StatusOr<RegionId> got = shared ? d.AcquireShared(std::string("layer.") + p.name, p.bytes) : d.AllocateSymmetric(p.bytes, p.name);
      if (!got.ok()) {
        r.Free(d);
        return got.status();
      }
      *p.id = *got;
    }
    return r;
  }
  void Free(Domain& d) const {
    for (RegionId id : {control, dots})
      if (id >= 0) d.FreeSymmetric(id);
    for (RegionId id : {payload, sideband, ret})
      if (id >= 0) shared_transport ? d.ReleaseShared(id) : d.FreeSymmetric(id);
  }
  // Bytes per rank of the shared transport regions (0 when they are the layer's own).
  static size_t SharedTransportBytes(const RegionLayout& l) { return l.payload_bytes() + l.sideband_bytes() + l.return_bytes(); }
};

}  // namespace rdep
