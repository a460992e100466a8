// `rdep bench dispatch`: the transport alone — dispatch (token rows to their experts' owners) and
// combine (rows back, gate-weighted sum) — on W GPUs of this machine (one process), beside an NCCL
// all-to-allv baseline of the same rows measured in the same run. With --gpus G < W, W ranks share G GPUs
// round-robin (a check of the protocol on fewer GPUs: not NVLink's times, and no NCCL baseline).
//
// rdep side: CudaMoELayer with the sentinel expert (a cheap echo replaces the MLP, so only the
// transport is left; with --owner-reduce the identity expert and LayerConfig::owner_reduce, every output
// checked against x times the token's gate sum), profiling marks on. Per iteration and rank:
//   dispatch = routing + dispatch phases (counts, owner scan, accept, scatter, segment barrier: from
//              the aligned start until every token row has landed at its owner);
//   combine  = return + combine phases (rows back to their front-ends, final barrier, weighted sum);
// then the max over ranks per iteration, p50/p99 over --iters after --warmup. The whole sentinel
// forward is also timed end to end (unprofiled, CUDA events around Forward).
//
// NCCL side (one communicator per GPU from ncclCommInitAll, each rank's stream): the rows a standard
// EP dispatch sends, one row per (token, slot), pre-packed by destination outside the timed region:
//   dispatch = grouped ncclSend/ncclRecv of the per-destination counts (int64) -> copy of the counts
//              to the host + stream sync (the receive sizes must be known on the host) -> grouped
//              ncclSend/ncclRecv of the payload rows;
//   combine  = the reverse payload exchange (sizes already known).
// NVLink multicast is never used: NCCL_NVLS_ENABLE=0 is forced before the communicators exist.
//
// With --nodes N the two-phase exchange instead (host or CUDA backend, no baseline): bench_dispatch_nodes.cc.
//
// Example (Moonlight shape, 4 GPUs):
//   NCCL_NVLS_ENABLE=0 rdep bench dispatch --ranks 4 --hidden 2048 --experts 64 --topk 6 --json d.json
#include <iostream>

#include "bench_dispatch_floor.h"
#include "bench_dispatch_nodes.h"
#include "cli.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "bench_util.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/peer_rows_copy.h"
#include "rdep/layer/cuda_moe_layer.h"

#if defined(RDEP_HAVE_NCCL)
#include <nccl.h>
#endif
#endif

namespace {

constexpr const char* kHelp = R"(usage: rdep bench dispatch [flags]

Dispatch and combine alone, on W GPUs of this machine (one process; --gpus G < W: W ranks sharing G GPUs,
without the NCCL baseline), and in the same run an NCCL all-to-allv exchange of the same rows. Every time
is the max over ranks per iteration (ranks start together after a device barrier), summarized as p50/p99
over --iters after --warmup.

rdep (CudaMoELayer, sentinel expert: the MLP is replaced by an echo, so only the transport is left;
dropless; with --owner-reduce the identity expert, below):
  dispatch = routing + dispatch phases of a forward: counts, owner scan, acceptance, scatter of the
             payload + sideband into the owners' buffers, segment barrier (from the aligned start to
             the moment every token row has landed at its owner)
  combine  = return + combine phases: rows back to their front-ends, final barrier, gate-weighted sum
             (--owner-reduce: each owner first sums its rows of a token, gate-weighted, and one row per
             (token, owner) crosses back, as DeepEP's combine returns one row per (token, rank); the
             front-end sums those; the identity expert f(x) = x replaces the echo, whose rows carry
             identities that a sum would mix, and every output is checked: y = x * sum of gates)
  forward  = the whole sentinel forward, end to end (includes the echo and one host sync for the
             per-expert row counts)
  Phase times come from CUDA events at the layer's phase boundaries (EnableProfiling); the routing
  phase's parts (validation, expert ranks and counts published; the counts barrier; the owner scan and
  the offsets barrier; acceptance) from a separate pass with three more events inside it. The return's
  own stores (from the end of a rank's echo to the end of its returns, before the final barrier; the
  slowest rank's) are printed beside it: under skew the rest is the other ranks waiting for the hot owner.
NCCL baseline (ncclCommInitAll, the ranks' streams, NCCL_NVLS_ENABLE=0 forced):
  dispatch = grouped ncclSend/ncclRecv of the per-destination row counts, their copy to the host and
             a stream sync, then grouped ncclSend/ncclRecv of the rows: one row per (token, slot), as
             a standard EP dispatch sends (self rows included, as all_to_all_single does)
  combine  = the reverse exchange of the same rows (the sizes are known from dispatch)
  Not timed (a lower bound on an NCCL EP layer): packing rows by destination, unpacking, and the
  gate-weighted sum of combine.
Floor (2 <= W <= 9; --no-floor skips it): the payload rows rdep's dispatch and combine move between each
pair of ranks (dispatch P_x, combine R_x or with --owner-reduce P_x), copied into the destinations' memory
by rdep's own row copy (a warp per row, 16-byte vectors, on every SM whatever --transport-sms says) with
nothing else to do: no routing, sideband, rows to the rank itself, placement, barrier after it or sum
(dispatch::LaunchPeerRowsCopy). All ranks copy at once after a device barrier; per iteration the max over
ranks of the copy kernel's time. After the timed loops each direction's copy runs once more into poisoned
buffers and every row is checked. rdep's time over the floor's is what all of that adds to moving the
payload bytes on this machine.

Bytes (bf16 rows, 2*H bytes; "remote" = crossing between GPUs, a rank's rows to itself excluded;
dropless, so every (token, slot) row is accepted):
  slot rows          R    = sum over ranks and tokens of K             (one row per (token, slot))
  remote slot rows   R_x  = (token, slot) rows whose expert's owner is not the token's rank
  token-owner pairs  P_x  = distinct (token, owner) pairs with owner != the token's rank
  rdep dispatch bytes = P_x*(2H + 8) + R_x*16   (deduplicated payload: a token crosses once per
                        owner; sideband: an 8-byte row count per token and 16 bytes per row)
  rdep combine bytes  = R_x*2H                   (one returned row per (token, slot))
                        --owner-reduce: P_x*2H     (one reduced row per (token, owner))
  NCCL dispatch bytes = R_x*2H + W*(W-1)*8       (payload + count exchange)
  NCCL combine bytes  = R_x*2H                   (with --owner-reduce too: the baseline stays a standard
                        EP exchange of one row per (token, slot))
  The few control words of rdep's phases 1-2 ((E_loc+2) int64 per rank pair) are left out.
  algbw (GB/s) = bytes / W / p50 time: average bytes each GPU sends per second of the max-rank time
  (1 GB = 1e9 bytes). Speedup = NCCL p50 / rdep p50.

flags [defaults: the Moonlight shape]:
  --ranks W            ranks [GPUs, at most 8]   --tokens T   tokens per rank [4096]
  --gpus G             ranks round-robin over G local GPUs, 1 <= G <= min(W, GPUs) [min(W, GPUs)]; G < W:
                       ranks share GPUs (times do not measure NVLink; the NCCL baseline is skipped)
  --hidden H [2048]    --experts E [64]          --topk K [6]
  --routing R          uniform | zipf:ALPHA [uniform]
  --warmup N [20]      --iters N [200]           --seed N [1]
  --launch-ahead-us U  before each iteration's barrier, block the stream U microseconds on a host
                       function so the host enqueues the iteration before the GPU starts it
                       (launch latency out of the timing); 0 = off [100]
  --transport-sms N    SM budget of the kernels that store into peer memory (scatter, return): N blocks,
                       so at most N SMs; 0 = grids sized by the work, every SM [0]
  --owner-reduce       the owners reduce before the return (LayerConfig::owner_reduce), identity expert
  --no-source-windows  the three phases for every forward (LayerConfig::source_windows off): by default a
                       dropless forward in one segment places each source's tokens in a fixed window of
                       every owner's stream and its routing exchanges nothing (no counts, owner scan or
                       barriers; the counts barrier and owner scan parts then read 0)
  --no-nccl            skip the baseline
  --no-floor           skip the floor
  --json FILE          write the receipt (raw per-iteration max-rank times included)
  --max-memory-gib G   host memory limit [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]; the
                       layer's estimated device memory must also fit each GPU (checked before allocating)
  -h, --help           this page
The layer is built with D_ff = 16 (the sentinel expert never reads the expert weights; --ffn is not
a flag here).

With --nodes N: the two-phase exchange across N nodes of W/N ranks (seeds 004), on the host backend
(threads of this process: for CI; times are wall times of rank threads, not a network) or the CUDA
backend (one process; ranks sharing a GPU exchange by device copies, ranks on different GPUs by NCCL).
No NCCL baseline. Per rank and phase, the rows and bytes of one forward beside rdep model's
prediction for the same routing (after node limiting and capacity) and their ratio; the command
fails (exit 1) if any iteration's counts differ from the prediction, naming iteration, rank and phase:
  inter-node dispatch   as a source: one row per (token, remote node with an accepted row there)
  intra-node dispatch   as a relay: one row per (relayed token, owner in its node), home node included
  intra-node return     as an owner: its rows back to the relays
  inter-node combine    as a relay: one reduced row per (token, remote source node)
and the time of each hop (inter-node dispatch; scatter, echo and return inside the node; reduce and
the hop back), max over ranks per iteration, p50/p99.
  --nodes N            nodes, N >= 2 dividing W          --max-nodes M  node cap in [1, N] [N]
  --backend B          host | cuda | auto (cuda with a GPU) [auto]
  --ranks W [8]        --gpus G  cuda: ranks round-robin over G GPUs [min(W, GPUs)]
  --tokens T           [host 256, cuda 4096]             --hidden H [host 256, cuda 2048]
  --experts E [64]     --topk K [6]                      --routing R [uniform]
  --capacity-factor C  0 = dropless [0]                  --timeout S  barrier bound [30]
  --warmup N           [host 2, cuda 20]                 --iters N [host 20, cuda 200]
  --seed N [1]         --json FILE                       --max-memory-gib G
Example: rdep bench dispatch --backend host --ranks 8 --nodes 4 --max-nodes 2 --json nodes.json
)";

#if defined(RDEP_HAVE_CUDA)

using rdep::Status;

constexpr int64_t kLayerFfn = 16;  // expert weights the sentinel never touches: keep them small

int Fail(const Status& s) {
  std::cerr << "rdep bench dispatch: " << s.message() << "\n";
  return 1;
}

// Row accounting of a (dropless) routing: see the help text for the names.
struct RowCounts {
  std::vector<std::vector<int64_t>> slot_rows;  // [W][W]: (token, slot) rows rank r sends to owner q
  std::vector<std::vector<int64_t>> pair_rows;  // [W][W]: distinct (token, owner q) pairs of rank r's tokens
  int64_t pairs_remote = 0;                     // P_x
  int64_t slots_remote = 0;                     // R_x
  int64_t slots_total = 0;                      // R
  int64_t pairs_total = 0;                      // distinct (token, owner) pairs, self included
};

RowCounts CountRows(const rdep::Routing& routing, const rdep::OwnershipMap& own, int64_t W) {
  RowCounts c;
  c.slot_rows.assign(static_cast<size_t>(W), std::vector<int64_t>(static_cast<size_t>(W), 0));
  c.pair_rows = c.slot_rows;
  std::vector<int64_t> seen(static_cast<size_t>(W), -1);
  for (int64_t r = 0; r < W; ++r) {
    const auto& rr = routing[static_cast<size_t>(r)];
    std::fill(seen.begin(), seen.end(), -1);
    for (int64_t t = 0; t < rr.num_tokens; ++t) {
      for (int64_t k = 0; k < rr.topk; ++k) {
        const int32_t q = own.owner(rr.experts[static_cast<size_t>(t * rr.topk + k)]);
        ++c.slot_rows[static_cast<size_t>(r)][static_cast<size_t>(q)];
        ++c.slots_total;
        if (q != r) ++c.slots_remote;
        if (seen[static_cast<size_t>(q)] != t) {
          seen[static_cast<size_t>(q)] = t;
          ++c.pair_rows[static_cast<size_t>(r)][static_cast<size_t>(q)];
          ++c.pairs_total;
          if (q != r) ++c.pairs_remote;
        }
      }
    }
  }
  return c;
}

// Per-iteration max over ranks of f(phase times of rank r at iteration i).
template <typename F>
std::vector<double> MaxOverRanksOf(const std::vector<std::vector<rdep::PhaseTimes>>& p, F f) {
  std::vector<std::vector<double>> v(p.size());
  for (size_t r = 0; r < p.size(); ++r)
    for (const auto& x : p[r]) v[r].push_back(f(x));
  return rdep::MaxOverRanks(v);
}

#if defined(RDEP_HAVE_NCCL)
Status NcclStatus(ncclResult_t res, const char* expr, const char* file, int line) {
  if (res == ncclSuccess) return Status::Ok();
  return rdep::InternalError(std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
                             ncclGetErrorString(res) + " (" + ncclGetLastError(nullptr) + ")");
}
#define RDEP_NCCL_RETURN_IF_ERROR(expr) RDEP_RETURN_IF_ERROR(NcclStatus((expr), #expr, __FILE__, __LINE__))

// One rank's buffers of the NCCL baseline. Layouts (rows of H bf16):
//   send  [R_r] rows packed by destination: rows for owner 0, then owner 1, ... (offsets send_off)
//   recv  [sum_s rows s->r] rows packed by source (offsets recv_off, learned in the count exchange)
//   back  [R_r] the combine's destination, same layout as send (a round trip gives back == send)
//   counts[2W] int64: [0,W) rows this rank sends to each rank, [W,2W) rows it receives from each
struct NcclRank {
  ncclComm_t comm = nullptr;
  __nv_bfloat16 *send = nullptr, *recv = nullptr, *back = nullptr;
  int64_t* counts = nullptr;
  int64_t* host_counts = nullptr;  // pinned [2W]
  std::vector<int64_t> send_off, recv_off;
  int64_t send_rows = 0, recv_rows = 0;
  std::vector<cudaEvent_t> ev;  // per iteration: d0 d1 d2 c0 c1
};

// Dispatch of the baseline: the count exchange, the counts to the host, the rows.
// Events: ev[0] start, ev[1] after the count exchange, ev[2] after the rows.
Status NcclDispatch(NcclRank& n, int32_t W, int64_t H, cudaStream_t s, const cudaEvent_t* ev) {
  if (ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[0], s));
  RDEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  for (int32_t q = 0; q < W; ++q) {
    RDEP_NCCL_RETURN_IF_ERROR(ncclSend(n.counts + q, 1, ncclInt64, q, n.comm, s));
    RDEP_NCCL_RETURN_IF_ERROR(ncclRecv(n.counts + W + q, 1, ncclInt64, q, n.comm, s));
  }
  RDEP_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
  if (ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[1], s));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(n.host_counts, n.counts, sizeof(int64_t) * 2 * static_cast<size_t>(W),
                                            cudaMemcpyDeviceToHost, s));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  int64_t so = 0, ro = 0;  // offsets from the counts just received, as a real dispatch must
  for (int32_t q = 0; q < W; ++q) {
    n.send_off[static_cast<size_t>(q)] = so;
    n.recv_off[static_cast<size_t>(q)] = ro;
    so += n.host_counts[q];
    ro += n.host_counts[W + q];
  }
  if (so != n.send_rows || ro != n.recv_rows)
    return rdep::InternalError("nccl baseline: exchanged counts disagree with the routing");
  RDEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  for (int32_t q = 0; q < W; ++q) {
    const auto sq = static_cast<size_t>(q);
    RDEP_NCCL_RETURN_IF_ERROR(ncclSend(n.send + n.send_off[sq] * H, static_cast<size_t>(n.host_counts[q] * H), ncclBfloat16, q,
                                       n.comm, s));
    RDEP_NCCL_RETURN_IF_ERROR(ncclRecv(n.recv + n.recv_off[sq] * H, static_cast<size_t>(n.host_counts[W + q] * H), ncclBfloat16,
                                       q, n.comm, s));
  }
  RDEP_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
  if (ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[2], s));
  return Status::Ok();
}

// Combine of the baseline: every received row goes back to its source (into `back`).
Status NcclCombine(NcclRank& n, int32_t W, int64_t H, cudaStream_t s, const cudaEvent_t* ev) {
  if (ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[0], s));
  RDEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  for (int32_t q = 0; q < W; ++q) {
    const auto sq = static_cast<size_t>(q);
    RDEP_NCCL_RETURN_IF_ERROR(ncclSend(n.recv + n.recv_off[sq] * H, static_cast<size_t>(n.host_counts[W + q] * H), ncclBfloat16,
                                       q, n.comm, s));
    RDEP_NCCL_RETURN_IF_ERROR(ncclRecv(n.back + n.send_off[sq] * H, static_cast<size_t>(n.host_counts[q] * H), ncclBfloat16, q,
                                       n.comm, s));
  }
  RDEP_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
  if (ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[1], s));
  return Status::Ok();
}
#endif  // RDEP_HAVE_NCCL

// ---- setup -----------------------------------------------------------------------------------------

// What the flags ask for, checked.
struct DispatchBenchOptions {
  rdep::LayerConfig cfg;   // shape.ffn = kLayerFfn; dropless
  rdep::RoutingSpec spec;  // seeded with `seed`
  int64_t warmup = 0, iters = 0;
  uint64_t seed = 0;
  int64_t launch_ahead_us = 0;  // the timed loops take its address (LaunchAhead): it outlives them
  bool no_nccl = false;
  bool no_floor = false;
  bool owner_reduce = false;  // LayerConfig::owner_reduce and the identity expert (else the sentinel)
  int64_t gpus = 0;           // ranks round-robin over this many GPUs; fewer than the ranks: ranks share GPUs
  std::string json;
  rdep::cli::Limits limits;
};

int Refuse(const std::string& message) {
  std::cerr << "rdep bench dispatch: " << message << "\n";
  return 2;
}

// Reads and checks the flags in the command's fixed order; 0 when `o` is good, else the exit code
// (2: a refused flag or size, estimate included; 1: an unknown routing).
int ParseDispatchBenchOptions(const rdep::cli::Args& args, DispatchBenchOptions& o) {
  rdep::cli::Flags f(args);
  const int gpus = rdep::cuda::DeviceCount();
  auto& s = o.cfg.shape;
  s.ranks = f.get_int("ranks", std::min(gpus, 8));
  o.gpus = f.get_int("gpus", std::min<int64_t>(s.ranks, gpus));
  s.tokens = f.get_int("tokens", 4096);
  s.hidden = f.get_int("hidden", 2048);
  s.ffn = kLayerFfn;
  s.experts = f.get_int("experts", 64);
  s.topk = f.get_int("topk", 6);
  const std::string routing_name = f.get_string("routing", "uniform");
  o.warmup = f.get_int("warmup", 20);
  o.iters = f.get_int("iters", 200);
  o.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  o.launch_ahead_us = f.get_int("launch-ahead-us", 100);
  o.no_nccl = f.get_bool("no-nccl");
  o.no_floor = f.get_bool("no-floor");
  o.owner_reduce = f.get_bool("owner-reduce");
  o.cfg.owner_reduce = o.owner_reduce;
  o.cfg.source_windows = !f.get_bool("no-source-windows");
  auto transport_sms = rdep::bench::ReadTransportSms(f);
  o.json = f.get_string("json", "");
  auto limits = rdep::cli::ReadLimits(f);
  if (Status st = rdep::bench::CheckBenchFlags(f, limits, o.warmup, o.iters, gpus); !st.ok()) return Refuse(st.message());
  if (!transport_sms.ok()) return Refuse(transport_sms.status().message());
  o.cfg.transport_sms = *transport_sms;
  if (o.warmup < 0 || o.iters < 1 || o.launch_ahead_us < 0)
    return Refuse("--warmup and --launch-ahead-us must be >= 0, --iters >= 1");
  if (s.ranks < 1 || s.ranks > rdep::kMaxCudaRanks)
    return Refuse("--ranks must be in [1, " + std::to_string(rdep::kMaxCudaRanks) + "], got " + std::to_string(s.ranks));
  if (o.gpus < 1 || o.gpus > std::min<int64_t>(gpus, s.ranks))
    return Refuse("--gpus must be in [1, min(--ranks, GPUs)] = [1, " + std::to_string(std::min<int64_t>(gpus, s.ranks)) +
                  "] on this machine, got " + std::to_string(o.gpus));
  auto spec = rdep::RoutingSpec::Parse(routing_name);
  if (!spec.ok()) return Fail(spec.status());
  spec->seed = o.seed;
  o.spec = *spec;
  o.limits = *limits;
  // Estimate before allocating; open the receipt before the work.
  if (Status st = rdep::bench::CheckLayerBenchPlan(o.cfg, o.warmup + o.iters, static_cast<int>(o.gpus), o.limits, o.json);
      !st.ok())
    return Refuse(st.message());
  return 0;
}

// One rank's router output and activations on the device, and its events: 2i / 2i+1 around
// iteration i's forward.
struct RankBuffers {
  int32_t* experts = nullptr;
  float* gates = nullptr;
  __nv_bfloat16 *x = nullptr, *y = nullptr;
  std::vector<cudaEvent_t> ev;
};

// On rank r's thread: allocates `b`, uploads the routing and the activations (bf16) and creates 2
// events per iteration (`total` = warmup + iters).
Status UploadRankBuffers(RankBuffers& b, const rdep::RankRouting& rr, const std::vector<float>& xr, const rdep::LayerShape& s,
                         int64_t total) {
  const size_t nk = static_cast<size_t>(s.tokens * s.topk), nh = static_cast<size_t>(s.tokens * s.hidden);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.experts, nk * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.gates, nk * 4));
  for (auto** p : {&b.x, &b.y}) RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(p, nh * 2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.experts, rr.experts.data(), rr.experts.size() * 4, cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.gates, rr.gates.data(), rr.gates.size() * 4, cudaMemcpyHostToDevice));
  std::vector<uint16_t> bits(nh);
  for (size_t i = 0; i < bits.size() && i < xr.size(); ++i) bits[i] = rdep::FloatToBf16Bits(xr[i]);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.x, bits.data(), nh * 2, cudaMemcpyHostToDevice));
  // The copies ran on the legacy stream (a pageable copy may return before its DMA lands), which the ranks'
  // non-blocking streams do not wait for.
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  b.ev.resize(static_cast<size_t>(2 * total));
  for (auto& e : b.ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  return Status::Ok();
}

void FreeRankBuffers(rdep::CudaDomain& domain, std::vector<RankBuffers>& bufs) {
  for (size_t r = 0; r < bufs.size(); ++r) {
    cudaSetDevice(domain.device(static_cast<int32_t>(r)));
    for (void* p : {static_cast<void*>(bufs[r].experts), static_cast<void*>(bufs[r].gates), static_cast<void*>(bufs[r].x),
                    static_cast<void*>(bufs[r].y)})
      cudaFree(p);
    for (auto e : bufs[r].ev) cudaEventDestroy(e);
  }
}

// ---- run -------------------------------------------------------------------------------------------

// Raw times per rank and what is derived from them (max over ranks per iteration), rdep and NCCL.
struct DispatchBenchResults {
  RowCounts rows;
  // rdep, raw
  std::vector<std::vector<double>> fwd;                // [rank][iteration after warmup], ms, unprofiled
  std::vector<std::vector<rdep::PhaseTimes>> phases;  // [rank][iteration after warmup], profiled
  std::vector<size_t> layer_bytes;                     // [rank]
  int64_t accepted_rows = 0;
  // rdep, per iteration max over ranks
  std::vector<double> rdep_dispatch, rdep_combine, rdep_fwd;
  std::vector<double> ph_routing, ph_scatter, ph_expert, ph_return, ph_combine;
  std::vector<double> ph_return_own;  // the return without its final barrier: the slowest rank's own stores
  // the routing phase in parts, from a separate pass with three more events (EnableProfiling's detail)
  std::vector<double> rt_total, rt_local, rt_counts, rt_scan, rt_accept;  // per iteration, the rank with the longest routing
  // NCCL baseline, per iteration max over ranks
  std::string nccl_state, nccl_version;
  std::vector<double> nccl_dispatch, nccl_combine, nccl_counts;
  size_t nccl_bytes_max = 0;
  bool round_trip_ok = false;
  bool have_nccl = false;
  // the floor (bench_dispatch_floor.h), per iteration max over ranks
  std::string floor_state;
  std::vector<double> floor_dispatch, floor_combine;
  size_t floor_bytes_max = 0;
  bool floor_exact = false;
  // summaries
  rdep::Summary s_rd, s_rc, s_rf, s_nd, s_nc, s_ncnt, s_fd, s_fc;
  size_t layer_max = 0;
};

// Rank r's unprofiled loop: each iteration the launch-ahead wait, a device barrier, an event, the
// sentinel forward, an event; after Synchronize the times past the warmup.
Status TimeRankForward(rdep::CudaDomain& domain, rdep::CudaMoELayer& layer, int32_t r, RankBuffers& b, int64_t n,
                       const DispatchBenchOptions& o, std::vector<double>& fwd) {
  const int64_t total = o.warmup + o.iters;
  cudaStream_t stream = domain.stream(r);
  for (int64_t i = 0; i < total; ++i) {
    RDEP_RETURN_IF_ERROR(rdep::bench::LaunchAhead(stream, &o.launch_ahead_us));
    RDEP_RETURN_IF_ERROR(domain.Barrier(r, rdep::Phase::kTest));  // ranks start together
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[static_cast<size_t>(2 * i)], stream));
    RDEP_RETURN_IF_ERROR(layer.Forward(r, b.experts, b.gates, n, b.x, b.y));
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[static_cast<size_t>(2 * i + 1)], stream));
  }
  RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
  for (int64_t i = o.warmup; i < total; ++i) {
    float ms = 0;
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, b.ev[static_cast<size_t>(2 * i)], b.ev[static_cast<size_t>(2 * i + 1)]));
    fwd.push_back(ms);
  }
  return Status::Ok();
}

// Rank r's profiled loop (the layer's phase marks on): the same iterations, the phase times past the
// warmup.
Status TimeRankPhases(rdep::CudaDomain& domain, rdep::CudaMoELayer& layer, int32_t r, RankBuffers& b, int64_t n,
                      const DispatchBenchOptions& o, std::vector<rdep::PhaseTimes>& phases) {
  const int64_t total = o.warmup + o.iters;
  cudaStream_t stream = domain.stream(r);
  for (int64_t i = 0; i < total; ++i) {
    RDEP_RETURN_IF_ERROR(rdep::bench::LaunchAhead(stream, &o.launch_ahead_us));
    RDEP_RETURN_IF_ERROR(domain.Barrier(r, rdep::Phase::kTest));
    RDEP_RETURN_IF_ERROR(layer.Forward(r, b.experts, b.gates, n, b.x, b.y));
    RDEP_ASSIGN_OR_RETURN(auto p, layer.LastPhaseTimes(r, false));  // synchronizes this rank
    if (i >= o.warmup) phases.push_back(p);
  }
  return domain.Synchronize(r);
}

// The routing phase's parts per iteration, all from the rank whose routing took longest in it (so the
// parts add up to that rank's total; acceptance is the rest).
void SplitRouting(const std::vector<std::vector<rdep::PhaseTimes>>& detail, DispatchBenchResults& res) {
  const size_t iters = detail.empty() ? 0 : detail[0].size();
  for (size_t i = 0; i < iters; ++i) {
    size_t worst = 0;
    for (size_t r = 1; r < detail.size(); ++r)
      if (detail[r][i].routing_ms > detail[worst][i].routing_ms) worst = r;
    const rdep::PhaseTimes& p = detail[worst][i];
    res.rt_total.push_back(p.routing_ms);
    res.rt_local.push_back(p.route_local_ms);
    res.rt_counts.push_back(p.route_counts_ms);
    res.rt_scan.push_back(p.route_scan_ms);
    res.rt_accept.push_back(p.routing_ms - p.route_local_ms - p.route_counts_ms - p.route_scan_ms);
  }
}

// --owner-reduce: rank r's y (the identity expert's) against x * (sum of the token's accepted effective
// gates), elementwise within |x| * sum|g'| * 2^-7 * (1 + 2^-8) (two bf16 roundings, the owner's partial sum
// and y: at most 2^-8 of |x| * sum|g'| plus fp32 noise); the first element off names its token and column.
// A lost, doubled or misplaced row is off by its gate's share of the token.
Status CheckIdentityOutput(const RankBuffers& b, const std::vector<float>& x, const rdep::RankAcceptance& acc, int64_t n,
                           const rdep::LayerShape& s, int32_t r) {
  const int64_t H = s.hidden, K = s.topk;
  std::vector<uint16_t> y(static_cast<size_t>(n * H));
  if (!y.empty()) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(y.data(), b.y, y.size() * 2, cudaMemcpyDeviceToHost));
  for (int64_t t = 0; t < n; ++t) {
    double gsum = 0, gabs = 0;
    for (int64_t k = 0; k < K; ++k) {
      const auto j = static_cast<size_t>(t * K + k);
      if (acc.accepted[j]) gsum += acc.effective_gates[j], gabs += std::fabs(acc.effective_gates[j]);
    }
    for (int64_t c = 0; c < H; ++c) {
      const auto i = static_cast<size_t>(t * H + c);
      const double xv = rdep::Bf16BitsToFloat(rdep::FloatToBf16Bits(x[i])), got = rdep::Bf16BitsToFloat(y[i]);
      if (!(std::fabs(got - xv * gsum) <= std::fabs(xv) * gabs * 0x1p-7 * (1 + 0x1p-8) + 1e-30))
        return rdep::InternalError("--owner-reduce: rank " + std::to_string(r) + " token " + std::to_string(t) + " column " +
                                   std::to_string(c) + ": y " + std::to_string(got) + ", x * sum of gates " + std::to_string(xv * gsum));
    }
  }
  return Status::Ok();
}

// --owner-reduce, after the timed loop: one more forward into y filled with NaN first (so an element no
// call wrote fails), then CheckIdentityOutput. Collective: every rank calls it.
Status VerifyIdentityForward(rdep::CudaDomain& domain, rdep::CudaMoELayer& layer, int32_t r, const RankBuffers& b,
                             const std::vector<float>& x, int64_t n, const rdep::LayerShape& s) {
  cudaStream_t stream = domain.stream(r);
  if (n > 0) RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.y, 0xFF, static_cast<size_t>(n * s.hidden) * 2, stream));
  RDEP_RETURN_IF_ERROR(layer.Forward(r, b.experts, b.gates, n, b.x, b.y));
  RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
  RDEP_ASSIGN_OR_RETURN(auto acc, layer.CopyAcceptance(r));
  return CheckIdentityOutput(b, x, acc, n, s, r);
}

// 1. rdep: the whole sentinel forward, unprofiled (dropless: every row must be accepted); 2. the same
// with phase marks; then the max over ranks per iteration.
Status RunRdepTimings(const DispatchBenchOptions& o, rdep::bench::LayerBenchSetup& setup, std::vector<RankBuffers>& bufs,
                      DispatchBenchResults& res) {
  const rdep::Routing& routing = setup.routing;
  rdep::CudaDomain& domain = *setup.domain;
  rdep::CudaMoELayer& layer = *setup.layer;
  const auto W = static_cast<size_t>(o.cfg.shape.ranks);
  res.fwd.assign(W, {});
  res.phases.assign(W, {});
  res.layer_bytes.assign(W, 0);
  std::mutex mu;
  RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
    const auto sr = static_cast<size_t>(r);
    RDEP_RETURN_IF_ERROR(UploadRankBuffers(bufs[sr], routing[sr], setup.x[sr], o.cfg.shape, o.warmup + o.iters));
    RDEP_RETURN_IF_ERROR(TimeRankForward(domain, layer, r, bufs[sr], routing[sr].num_tokens, o, res.fwd[sr]));
    res.layer_bytes[sr] = layer.device_bytes(r) + layer.shared_bytes();  // one layer: the shared slots are all its own
    if (o.owner_reduce)
      RDEP_RETURN_IF_ERROR(VerifyIdentityForward(domain, layer, r, bufs[sr], setup.x[sr], routing[sr].num_tokens, o.cfg.shape));
    RDEP_ASSIGN_OR_RETURN(auto acc, layer.CopyAcceptance(r));
    int64_t a = 0;
    for (auto v : acc.accepted) a += v;
    std::lock_guard<std::mutex> lock(mu);
    res.accepted_rows += a;
    return Status::Ok();
  }));
  if (res.accepted_rows != res.rows.slots_total)
    return rdep::InternalError("accepted rows " + std::to_string(res.accepted_rows) + " != W*T*K " +
                               std::to_string(res.rows.slots_total) + " (the layer should be dropless)");
  RDEP_RETURN_IF_ERROR(layer.EnableProfiling(true));
  RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
    const auto sr = static_cast<size_t>(r);
    return TimeRankPhases(domain, layer, r, bufs[sr], routing[sr].num_tokens, o, res.phases[sr]);
  }));
  std::vector<std::vector<rdep::PhaseTimes>> detail(W);
  RDEP_RETURN_IF_ERROR(layer.EnableProfiling(true, /*routing_detail=*/true));
  RDEP_RETURN_IF_ERROR(domain.Run([&](int32_t r) -> Status {
    const auto sr = static_cast<size_t>(r);
    return TimeRankPhases(domain, layer, r, bufs[sr], routing[sr].num_tokens, o, detail[sr]);
  }));
  RDEP_RETURN_IF_ERROR(layer.EnableProfiling(false));
  SplitRouting(detail, res);

  const auto& phases = res.phases;
  res.rdep_dispatch = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.routing_ms + p.dispatch_ms; });
  res.rdep_combine = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.return_ms + p.combine_ms; });
  res.rdep_fwd = rdep::MaxOverRanks(res.fwd);
  res.ph_routing = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.routing_ms; });
  res.ph_scatter = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.dispatch_ms; });
  res.ph_expert = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.expert_ms; });
  res.ph_return = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.return_ms; });
  res.ph_return_own = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.return_ms - p.return_wait_ms; });
  res.ph_combine = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.combine_ms; });
  return Status::Ok();
}

#if defined(RDEP_HAVE_NCCL)
// On rank r's thread: the baseline's buffers (see NcclRank), its rows packed by destination on the host
// (untimed) into `packed` and uploaded, `back` poisoned, the send counts on the device, 5 events per
// iteration.
Status SetupNcclRank(NcclRank& n, int32_t r, const rdep::RankRouting& rr, const std::vector<float>& xr, const RowCounts& rows,
                     const rdep::OwnershipMap& own, const DispatchBenchOptions& o, std::vector<uint16_t>& packed) {
  const auto W = static_cast<size_t>(o.cfg.shape.ranks);
  const int64_t H = o.cfg.shape.hidden, K = o.cfg.shape.topk, total = o.warmup + o.iters;
  const auto& mine = rows.slot_rows[static_cast<size_t>(r)];
  n.send_off.assign(W, 0);
  n.recv_off.assign(W, 0);
  std::vector<int64_t> start(W, 0);
  n.send_rows = 0;
  n.recv_rows = 0;
  for (size_t q = 0; q < W; ++q) {
    start[q] = n.send_rows;
    n.send_rows += mine[q];
    n.recv_rows += rows.slot_rows[q][static_cast<size_t>(r)];
  }
  // Pack on the host (untimed): row (t, k) at its destination's next place.
  packed.assign(static_cast<size_t>(n.send_rows * H), 0);
  for (int64_t t = 0; t < rr.num_tokens; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const auto q = static_cast<size_t>((own).owner(rr.experts[static_cast<size_t>(t * K + k)]));
      uint16_t* dst = packed.data() + (start[q]++) * H;
      for (int64_t c = 0; c < H; ++c) dst[c] = rdep::FloatToBf16Bits(xr[static_cast<size_t>(t * H + c)]);
    }
  const auto row_bytes = static_cast<size_t>(H) * 2;
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&n.send, std::max<size_t>(1, static_cast<size_t>(n.send_rows) * row_bytes)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&n.back, std::max<size_t>(1, static_cast<size_t>(n.send_rows) * row_bytes)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&n.recv, std::max<size_t>(1, static_cast<size_t>(n.recv_rows) * row_bytes)));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&n.counts, sizeof(int64_t) * 2 * W));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&n.host_counts, sizeof(int64_t) * 2 * W));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(n.send, packed.data(), static_cast<size_t>(n.send_rows) * row_bytes, cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(n.back, 0xFF, static_cast<size_t>(n.send_rows) * row_bytes));
  // The send counts, on the device as an EP layer's histogram would leave them.
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(n.counts, mine.data(), sizeof(int64_t) * W, cudaMemcpyHostToDevice));
  // The copies and the memset ran on the legacy stream, which the rank's non-blocking stream does not wait for.
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  n.ev.resize(static_cast<size_t>(5 * total));
  for (auto& e : n.ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  return Status::Ok();
}

// One untimed round trip (NCCL connects its peers lazily), then the check that it is exact: `same` = 1
// when `back` holds the rows sent.
Status NcclRoundTrip(NcclRank& n, int32_t W, int64_t H, cudaStream_t stream, const std::vector<uint16_t>& packed, int& same) {
  RDEP_RETURN_IF_ERROR(NcclDispatch(n, W, H, stream, nullptr));
  RDEP_RETURN_IF_ERROR(NcclCombine(n, W, H, stream, nullptr));
  std::vector<uint16_t> back(packed.size());
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(back.data(), n.back, back.size() * 2, cudaMemcpyDeviceToHost, stream));
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  cudaGetLastError();  // a benign error NCCL's peer setup may leave pending (peer access already enabled)
  same = back == packed ? 1 : 0;
  return Status::Ok();
}

// Rank r's timed baseline loop: each iteration the launch-ahead wait, a device barrier, the dispatch
// (events 5i..5i+2), the launch-ahead wait, a device barrier, the combine (events 5i+3, 5i+4); after
// Synchronize the times past the warmup.
Status TimeNcclRank(rdep::CudaDomain& domain, int32_t r, NcclRank& n, const DispatchBenchOptions& o, std::vector<double>& t_dispatch,
                    std::vector<double>& t_counts, std::vector<double>& t_combine) {
  const auto Wi = static_cast<int32_t>(o.cfg.shape.ranks);
  const int64_t H = o.cfg.shape.hidden, total = o.warmup + o.iters;
  cudaStream_t stream = domain.stream(r);
  for (int64_t i = 0; i < total; ++i) {
    const cudaEvent_t* ev = n.ev.data() + 5 * i;
    RDEP_RETURN_IF_ERROR(rdep::bench::LaunchAhead(stream, &o.launch_ahead_us));
    RDEP_RETURN_IF_ERROR(domain.Barrier(r, rdep::Phase::kTest));
    RDEP_RETURN_IF_ERROR(NcclDispatch(n, Wi, H, stream, ev));
    RDEP_RETURN_IF_ERROR(rdep::bench::LaunchAhead(stream, &o.launch_ahead_us));
    RDEP_RETURN_IF_ERROR(domain.Barrier(r, rdep::Phase::kTest));
    RDEP_RETURN_IF_ERROR(NcclCombine(n, Wi, H, stream, ev + 3));
  }
  RDEP_RETURN_IF_ERROR(domain.Synchronize(r));
  for (int64_t i = o.warmup; i < total; ++i) {
    const cudaEvent_t* ev = n.ev.data() + 5 * i;
    float d = 0, c = 0, cnt = 0;
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&d, ev[0], ev[2]));
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&cnt, ev[0], ev[1]));
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&c, ev[3], ev[4]));
    t_dispatch.push_back(d);
    t_counts.push_back(cnt);
    t_combine.push_back(c);
  }
  return Status::Ok();
}

// Frees every rank's baseline buffers and events; returns the largest rank's buffer bytes.
size_t FreeNcclRanks(std::vector<NcclRank>& nr, const std::vector<int>& devs, int64_t H) {
  size_t bytes_max = 0;
  for (size_t r = 0; r < nr.size(); ++r) {
    cudaSetDevice(devs[r]);
    bytes_max = std::max(bytes_max, static_cast<size_t>(2 * nr[r].send_rows + nr[r].recv_rows) * static_cast<size_t>(H) * 2);
    for (void* p : {static_cast<void*>(nr[r].send), static_cast<void*>(nr[r].recv), static_cast<void*>(nr[r].back),
                    static_cast<void*>(nr[r].counts)})
      cudaFree(p);
    if (nr[r].host_counts) cudaFreeHost(nr[r].host_counts);
    for (auto e : nr[r].ev) cudaEventDestroy(e);
  }
  return bytes_max;
}

// 3. The NCCL baseline: one communicator per GPU, every rank's setup, round trip and timed loop, then
// the max over ranks per iteration.
Status RunNcclTimings(const DispatchBenchOptions& o, rdep::bench::LayerBenchSetup& setup, DispatchBenchResults& res) {
  const auto W = static_cast<size_t>(o.cfg.shape.ranks);
  const auto Wi = static_cast<int32_t>(o.cfg.shape.ranks);
  rdep::CudaDomain& domain = *setup.domain;
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (see the device notes)
  int ver = 0;
  ncclGetVersion(&ver);
  res.nccl_version = std::to_string(ver);
  std::vector<NcclRank> nr(W);
  std::vector<ncclComm_t> comms(W);
  std::vector<int> devs(W);
  for (size_t r = 0; r < W; ++r) devs[r] = domain.device(static_cast<int32_t>(r));
  if (ncclResult_t nres = ncclCommInitAll(comms.data(), Wi, devs.data()); nres != ncclSuccess)
    return rdep::InternalError(std::string("ncclCommInitAll: ") + ncclGetErrorString(nres));
  for (size_t r = 0; r < W; ++r) {
    cudaSetDevice(devs[r]);
    cudaGetLastError();  // NCCL may leave a benign peer-access error (already enabled) pending
    nr[r].comm = comms[r];
  }
  std::vector<std::vector<double>> t_dispatch(W), t_combine(W), t_counts(W);
  std::vector<int> same(W, 0);
  Status st = domain.Run([&](int32_t r) -> Status {
    const auto sr = static_cast<size_t>(r);
    NcclRank& n = nr[sr];
    std::vector<uint16_t> packed;
    RDEP_RETURN_IF_ERROR(SetupNcclRank(n, r, setup.routing[sr], setup.x[sr], res.rows, setup.ownership, o, packed));
    RDEP_RETURN_IF_ERROR(NcclRoundTrip(n, Wi, o.cfg.shape.hidden, domain.stream(r), packed, same[sr]));
    return TimeNcclRank(domain, r, n, o, t_dispatch[sr], t_counts[sr], t_combine[sr]);
  });
  res.nccl_bytes_max = FreeNcclRanks(nr, devs, o.cfg.shape.hidden);
  for (auto c : comms) ncclCommDestroy(c);
  RDEP_RETURN_IF_ERROR(st);
  res.nccl_dispatch = rdep::MaxOverRanks(t_dispatch);
  res.nccl_combine = rdep::MaxOverRanks(t_combine);
  res.nccl_counts = rdep::MaxOverRanks(t_counts);
  res.round_trip_ok = std::all_of(same.begin(), same.end(), [](int v) { return v == 1; });
  res.nccl_state = res.round_trip_ok ? "ok" : "ROUND TRIP MISMATCH";
  return Status::Ok();
}
#endif  // RDEP_HAVE_NCCL

// 4. The floor: the same payload rows per rank pair, by rdep's row copy alone (bench_dispatch_floor.h). The
// combine's rows go back from the owners: owner q sends rank s's rows (per slot, or per token with the owner reduce).
Status RunFloor(const DispatchBenchOptions& o, rdep::bench::LayerBenchSetup& setup, DispatchBenchResults& res) {
  const RowCounts& rows = res.rows;
  const size_t W = rows.pair_rows.size();
  rdep::bench::PairRows combine(W, std::vector<int64_t>(W, 0));
  for (size_t s = 0; s < W; ++s)
    for (size_t q = 0; q < W; ++q) combine[q][s] = o.owner_reduce ? rows.pair_rows[s][q] : rows.slot_rows[s][q];
  RDEP_ASSIGN_OR_RETURN(rdep::bench::PeerStoreFloor fl, rdep::bench::RunPeerStoreFloor(*setup.domain, rows.pair_rows, combine,
                                                                                       o.cfg.shape.hidden, o.warmup, o.iters,
                                                                                       &o.launch_ahead_us));
  res.floor_dispatch = std::move(fl.dispatch_ms);
  res.floor_combine = std::move(fl.combine_ms);
  res.floor_bytes_max = fl.bytes_max_rank;
  res.floor_exact = fl.exact;
  res.floor_state = fl.exact ? "ok" : "ROWS MISMATCH";
  return Status::Ok();
}

// ---- report ----------------------------------------------------------------------------------------

// Bytes each side moves (see the help text for the formulas).
struct TransportBytes {
  double rdep_dispatch = 0, rdep_combine = 0, nccl_dispatch = 0, nccl_combine = 0;
  double floor_dispatch = 0;  // the payload rows alone (the floor's combine moves rdep_combine's bytes)
};

TransportBytes CountTransportBytes(const RowCounts& rows, int64_t H, int64_t W, bool owner_reduce) {
  const double row_b = 2.0 * static_cast<double>(H), Wd = static_cast<double>(W);
  TransportBytes b;
  b.rdep_dispatch = static_cast<double>(rows.pairs_remote) * (row_b + 8) + static_cast<double>(rows.slots_remote) * 16;
  b.rdep_combine = static_cast<double>(owner_reduce ? rows.pairs_remote : rows.slots_remote) * row_b;
  b.floor_dispatch = static_cast<double>(rows.pairs_remote) * row_b;
  b.nccl_dispatch = static_cast<double>(rows.slots_remote) * row_b + Wd * (Wd - 1) * 8;
  b.nccl_combine = static_cast<double>(rows.slots_remote) * row_b;
  return b;
}

// algbw in GB/s: bytes / W / time (1 GB = 1e9 bytes).
double AlgBw(double bytes, double ms, int64_t W) { return bytes / static_cast<double>(W) / (ms * 1e-3) / 1e9; }

void PrintDispatchTable(const DispatchBenchOptions& o, const DispatchBenchResults& res, const TransportBytes& bytes) {
  const auto& s = o.cfg.shape;
  const auto& rows = res.rows;
  const bool have_nccl = res.have_nccl;
  std::printf("rdep bench dispatch: %s, routing %s, dropless%s%s, %lld GPUs%s, warmup %lld, iters %lld, launch-ahead %lld us\n",
              [&] { std::ostringstream os; os << "W=" << s.ranks << " T=" << s.tokens << " H=" << s.hidden << " E=" << s.experts
                                              << " K=" << s.topk; return os.str(); }().c_str(),
              o.spec.name().c_str(), o.owner_reduce ? ", owner reduce (identity expert)" : "",
              o.cfg.source_windows ? ", source windows" : ", three phases (no source windows)", static_cast<long long>(o.gpus),
              o.gpus < s.ranks ? " (ranks share GPUs: times do not measure NVLink)" : "",
              static_cast<long long>(o.warmup),
              static_cast<long long>(o.iters), static_cast<long long>(o.launch_ahead_us));
  std::printf("  rows: slot rows R=%lld (remote R_x=%lld), token-owner pairs %lld (remote P_x=%lld): rdep sends %.3fx the "
              "payload rows of one-row-per-slot\n",
              static_cast<long long>(rows.slots_total), static_cast<long long>(rows.slots_remote),
              static_cast<long long>(rows.pairs_total), static_cast<long long>(rows.pairs_remote),
              rows.slots_remote ? static_cast<double>(rows.pairs_remote) / static_cast<double>(rows.slots_remote) : 0.0);
  rdep::bench::PrintTransportSms(o.cfg.transport_sms);
  std::printf("  %-26s %9s %9s %14s %11s %9s\n", "", "p50 us", "p99 us", "MB sent/GPU", "algbw GB/s", "speedup");
  auto line = [&](const char* name, const rdep::Summary& sm, double b, double speedup) {
    std::printf("  %-26s %9.1f %9.1f %14.2f %11.1f %8.2fx\n", name, sm.p50 * 1e3, sm.p99 * 1e3, b / static_cast<double>(s.ranks) / 1e6,
                AlgBw(b, sm.p50, s.ranks), speedup);
  };
  line("rdep dispatch", res.s_rd, bytes.rdep_dispatch, have_nccl ? res.s_nd.p50 / res.s_rd.p50 : NAN);
  if (have_nccl) line("nccl all-to-allv dispatch", res.s_nd, bytes.nccl_dispatch, 1.0);
  line("rdep combine", res.s_rc, bytes.rdep_combine, have_nccl ? res.s_nc.p50 / res.s_rc.p50 : NAN);
  if (have_nccl) line("nccl all-to-allv combine", res.s_nc, bytes.nccl_combine, 1.0);
  std::printf("  %-26s %9.1f %9.1f   (whole %s forward, unprofiled)\n", "rdep forward", res.s_rf.p50 * 1e3, res.s_rf.p99 * 1e3,
              o.owner_reduce ? "identity" : "sentinel");
  std::printf("  rdep phases (p50 of the max-rank time, us): routing %.1f  scatter %.1f  echo %.1f  return %.1f  combine %.1f\n",
              rdep::Percentile(res.ph_routing, 50) * 1e3, rdep::Percentile(res.ph_scatter, 50) * 1e3,
              rdep::Percentile(res.ph_expert, 50) * 1e3, rdep::Percentile(res.ph_return, 50) * 1e3,
              rdep::Percentile(res.ph_combine, 50) * 1e3);
  std::printf("  return in parts (p50 of the max-rank time, us): own stores %.1f (the slowest rank's, before the final barrier; the "
              "rest of the return is waiting there for the last peer)\n",
              rdep::Percentile(res.ph_return_own, 50) * 1e3);
  std::printf("  routing in parts (a separate pass with 3 more events; per iteration the rank with the longest routing, "
              "p50 of each part, us): %.1f = validate, ranks, counts %.1f + counts barrier %.1f + owner scan, offsets barrier "
              "%.1f + accept %.1f\n",
              rdep::Percentile(res.rt_total, 50) * 1e3, rdep::Percentile(res.rt_local, 50) * 1e3,
              rdep::Percentile(res.rt_counts, 50) * 1e3, rdep::Percentile(res.rt_scan, 50) * 1e3,
              rdep::Percentile(res.rt_accept, 50) * 1e3);
  if (have_nccl)
    std::printf("  nccl: count exchange p50 %.1f us of the dispatch; round trip %s; NCCL %s\n", res.s_ncnt.p50 * 1e3,
                res.round_trip_ok ? "bitwise exact" : "MISMATCH", res.nccl_version.c_str());
  else
    std::printf("  nccl baseline: %s\n", res.nccl_state.c_str());
  if (!res.floor_dispatch.empty()) {
    const double Wd = static_cast<double>(s.ranks);
    std::printf("  floor (the same payload rows by rdep's row copy alone, max-rank p50/p99 us): dispatch %.1f/%.1f (%.2f MB/GPU, "
                "%.1f GB/s; rdep %.2fx it), combine %.1f/%.1f (%.2f MB/GPU, %.1f GB/s; rdep %.2fx it); rows %s\n",
                res.s_fd.p50 * 1e3, res.s_fd.p99 * 1e3, bytes.floor_dispatch / Wd / 1e6, AlgBw(bytes.floor_dispatch, res.s_fd.p50, s.ranks),
                res.s_rd.p50 / res.s_fd.p50, res.s_fc.p50 * 1e3, res.s_fc.p99 * 1e3, bytes.rdep_combine / Wd / 1e6,
                AlgBw(bytes.rdep_combine, res.s_fc.p50, s.ranks), res.s_rc.p50 / res.s_fc.p50,
                res.floor_exact ? "landed exactly" : "MISMATCH");
  } else {
    std::printf("  floor: %s\n", res.floor_state.c_str());
  }
  std::printf("  device memory per rank (max): layer %.3f GiB, nccl buffers %.3f GiB, floor buffers %.3f GiB\n",
              static_cast<double>(res.layer_max) / (1 << 30), static_cast<double>(res.nccl_bytes_max) / (1 << 30),
              static_cast<double>(res.floor_bytes_max) / (1 << 30));
}

// The receipt's head: the tool, the environment, the workload, the normalization, rows and bytes.
void WriteDispatchWorkload(rdep::JsonWriter& j, const DispatchBenchOptions& o, int64_t segment, const RowCounts& rows,
                           const TransportBytes& bytes) {
  const auto& s = o.cfg.shape;
  j.begin_object().field("tool", "rdep bench dispatch");
  rdep::bench::WriteEnvironment(j, static_cast<int>(o.gpus));
  j.key("workload").begin_object().field("ranks", s.ranks).field("gpus", o.gpus).field("ranks_share_gpus", o.gpus < s.ranks);
  j.field("tokens", s.tokens).field("hidden", s.hidden);
  j.field("experts", s.experts).field("topk", s.topk).field("routing", o.spec.name()).field("capacity", "dropless");
  j.field("layer_ffn", kLayerFfn).field("expert", o.owner_reduce ? "identity" : "sentinel echo").field("segment", segment);
  j.field("owner_reduce", o.owner_reduce).field("source_windows", o.cfg.source_windows);
  j.field("seed", static_cast<int64_t>(o.seed)).field("warmup", o.warmup).field("iters", o.iters);
  j.field("launch_ahead_us", o.launch_ahead_us).field("transport_sms", static_cast<int64_t>(o.cfg.transport_sms)).end_object();
  j.field("normalization",
          "max over ranks per iteration (ranks aligned by a device barrier); rdep dispatch = routing+dispatch phases, "
          "combine = return+combine phases (CUDA events at phase boundaries); algbw = bytes / W / p50 (1 GB = 1e9 B); "
          "speedup = nccl p50 / rdep p50");
  j.key("rows").begin_object().field("slot_rows", rows.slots_total).field("slot_rows_remote", rows.slots_remote);
  j.field("token_owner_pairs", rows.pairs_total).field("token_owner_pairs_remote", rows.pairs_remote).end_object();
  j.key("bytes").begin_object();
  j.field("rdep_dispatch", bytes.rdep_dispatch).field("rdep_combine", bytes.rdep_combine);
  j.field("nccl_dispatch", bytes.nccl_dispatch).field("nccl_combine", bytes.nccl_combine);
  j.field("formula", std::string("rdep dispatch = P_x*(2H+8) + R_x*16; rdep combine = ") +
                         (o.owner_reduce ? "P_x*2H (owner reduce)" : "R_x*2H") +
                         "; nccl dispatch = R_x*2H + W*(W-1)*8; nccl combine = R_x*2H (R_x remote (token,slot) rows, P_x "
                         "remote distinct (token,owner) pairs)");
  j.end_object();
}

void WriteDispatchReceipt(const DispatchBenchOptions& o, int64_t segment, const DispatchBenchResults& res,
                          const TransportBytes& bytes) {
  const int64_t W = o.cfg.shape.ranks;
  rdep::JsonWriter j;
  WriteDispatchWorkload(j, o, segment, res.rows, bytes);
  rdep::bench::WriteSummary(j, "rdep_dispatch", res.rdep_dispatch);
  rdep::bench::WriteSummary(j, "rdep_combine", res.rdep_combine);
  rdep::bench::WriteSummary(j, "rdep_forward", res.rdep_fwd);
  j.key("rdep_phases_p50_ms").begin_object().field("routing", rdep::Percentile(res.ph_routing, 50));
  j.field("scatter", rdep::Percentile(res.ph_scatter, 50)).field("echo", rdep::Percentile(res.ph_expert, 50));
  j.field("return", rdep::Percentile(res.ph_return, 50)).field("return_own_stores", rdep::Percentile(res.ph_return_own, 50));
  j.field("combine", rdep::Percentile(res.ph_combine, 50)).end_object();
  j.key("rdep_routing_parts_p50_ms").begin_object().field("routing", rdep::Percentile(res.rt_total, 50));
  j.field("local", rdep::Percentile(res.rt_local, 50)).field("counts_barrier", rdep::Percentile(res.rt_counts, 50));
  j.field("scan_offsets_barrier", rdep::Percentile(res.rt_scan, 50)).field("accept", rdep::Percentile(res.rt_accept, 50)).end_object();
  j.field("rdep_dispatch_algbw_gbps", AlgBw(bytes.rdep_dispatch, res.s_rd.p50, W));
  j.field("rdep_combine_algbw_gbps", AlgBw(bytes.rdep_combine, res.s_rc.p50, W));
  j.field("layer_device_bytes_max_rank", static_cast<int64_t>(res.layer_max));
  j.key("baseline").begin_object().field("name", "nccl grouped send/recv all-to-allv").field("state", res.nccl_state);
  j.field("nccl_version", res.nccl_version).field("nvls", "disabled (NCCL_NVLS_ENABLE=0)");
  if (res.have_nccl) {
    rdep::bench::WriteSummary(j, "dispatch", res.nccl_dispatch);
    rdep::bench::WriteSummary(j, "combine", res.nccl_combine);
    rdep::bench::WriteSummary(j, "count_exchange", res.nccl_counts);
    j.field("dispatch_algbw_gbps", AlgBw(bytes.nccl_dispatch, res.s_nd.p50, W));
    j.field("combine_algbw_gbps", AlgBw(bytes.nccl_combine, res.s_nc.p50, W));
    j.field("round_trip_exact", res.round_trip_ok).field("buffer_bytes_max_rank", static_cast<int64_t>(res.nccl_bytes_max));
    j.field("speedup_dispatch", res.s_nd.p50 / res.s_rd.p50).field("speedup_combine", res.s_nc.p50 / res.s_rc.p50);
  }
  j.end_object();
  j.key("floor").begin_object().field("name", "the payload rows per rank pair by dispatch::LaunchPeerRowsCopy alone");
  j.field("state", res.floor_state);
  if (!res.floor_dispatch.empty()) {
    rdep::bench::WriteSummary(j, "dispatch", res.floor_dispatch);
    rdep::bench::WriteSummary(j, "combine", res.floor_combine);
    j.field("dispatch_bytes", bytes.floor_dispatch).field("combine_bytes", bytes.rdep_combine);
    j.field("dispatch_algbw_gbps", AlgBw(bytes.floor_dispatch, res.s_fd.p50, W));
    j.field("combine_algbw_gbps", AlgBw(bytes.rdep_combine, res.s_fc.p50, W));
    j.field("rdep_over_floor_dispatch", res.s_rd.p50 / res.s_fd.p50).field("rdep_over_floor_combine", res.s_rc.p50 / res.s_fc.p50);
    j.field("rows_exact", res.floor_exact).field("buffer_bytes_max_rank", static_cast<int64_t>(res.floor_bytes_max));
  }
  j.end_object();
  j.end_object();
  if (!rdep::bench::WriteFile(o.json, j.str())) std::cerr << "rdep bench dispatch: could not write " << o.json << "\n";
}

// ---- the command -----------------------------------------------------------------------------------

int RunDispatchBench(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  if (rdep::cli::Flags(args).has("nodes")) return rdep::bench::RunDispatchNodesBench(args);
  DispatchBenchOptions o;
  if (int rc = ParseDispatchBenchOptions(args, o); rc != 0) return rc;
  auto setup = rdep::bench::SetupLayerBench(o.cfg, o.spec, o.seed, static_cast<int>(o.gpus));
  if (!setup.ok()) return Fail(setup.status());
  setup->layer->set_expert_kind(o.owner_reduce ? rdep::ExpertKind::kIdentity : rdep::ExpertKind::kSentinel);
  DispatchBenchResults res;
  res.rows = CountRows(setup->routing, setup->ownership, o.cfg.shape.ranks);
  std::vector<RankBuffers> bufs(static_cast<size_t>(o.cfg.shape.ranks));
  if (Status st = RunRdepTimings(o, *setup, bufs, res); !st.ok()) return Fail(st);
  res.floor_state = o.no_floor ? "skipped (--no-floor)"
                    : o.cfg.shape.ranks < 2 ? "none (one rank: no peers)"
                                            : "none (W > " + std::to_string(rdep::dispatch::kMaxPeerCopyDestinations + 1) + ")";
  if (!o.no_floor && o.cfg.shape.ranks >= 2 && o.cfg.shape.ranks <= rdep::dispatch::kMaxPeerCopyDestinations + 1)
    if (Status st = RunFloor(o, *setup, res); !st.ok()) return Fail(st);
  const bool shared = o.gpus < o.cfg.shape.ranks;
  res.nccl_state = o.no_nccl ? "skipped (--no-nccl)"
                   : shared  ? "skipped (ranks share GPUs: NCCL takes one rank a GPU)"
                             : "unavailable (this build has no NCCL)";
#if defined(RDEP_HAVE_NCCL)
  if (!o.no_nccl && !shared)
    if (Status st = RunNcclTimings(o, *setup, res); !st.ok()) return Fail(st);
#endif
  res.have_nccl = !res.nccl_dispatch.empty();
  res.s_rd = rdep::Summarize(res.rdep_dispatch);
  res.s_rc = rdep::Summarize(res.rdep_combine);
  res.s_rf = rdep::Summarize(res.rdep_fwd);
  res.s_nd = rdep::Summarize(res.nccl_dispatch);
  res.s_nc = rdep::Summarize(res.nccl_combine);
  res.s_ncnt = rdep::Summarize(res.nccl_counts);
  res.s_fd = rdep::Summarize(res.floor_dispatch);
  res.s_fc = rdep::Summarize(res.floor_combine);
  for (auto b : res.layer_bytes) res.layer_max = std::max(res.layer_max, b);

  const TransportBytes bytes = CountTransportBytes(res.rows, o.cfg.shape.hidden, o.cfg.shape.ranks, o.owner_reduce);
  PrintDispatchTable(o, res, bytes);
  if (!o.json.empty()) WriteDispatchReceipt(o, setup->layer->layout().S, res, bytes);
  FreeRankBuffers(*setup->domain, bufs);
  if (res.have_nccl && !res.round_trip_ok) {
    std::cerr << "rdep bench dispatch: the NCCL baseline's round trip did not return the rows it sent\n";
    return 1;
  }
  if (!res.floor_dispatch.empty() && !res.floor_exact) {
    std::cerr << "rdep bench dispatch: the floor's copies did not land the rows sent\n";
    return 1;
  }
  return 0;
}

#else

int RunDispatchBench(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  if (rdep::cli::Flags(args).has("nodes")) return rdep::bench::RunDispatchNodesBench(args);
  std::cerr << "rdep bench dispatch: this build has no CUDA backend (the host backend runs only --nodes)\n";
  return 2;
}

#endif

const bool kRegistered = rdep::cli::RegisterBench({"dispatch", "dispatch and combine alone vs an NCCL all-to-allv, max-rank p50/p99",
                                                   &RunDispatchBench});

}  // namespace
