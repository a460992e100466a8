// `rdep bench dispatch`: the transport alone — dispatch (token rows to their experts' owners) and
// combine (rows back, gate-weighted sum) — on W GPUs of this machine (one process), beside an NCCL
// all-to-allv baseline of the same rows measured in the same run.
//
// rdep side: CudaMoELayer with the sentinel expert (a cheap echo replaces the MLP, so only the
// transport is left), profiling marks on. Per iteration and rank:
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
// Example (Moonlight shape, 4 GPUs):
//   NCCL_NVLS_ENABLE=0 rdep bench dispatch --ranks 4 --hidden 2048 --experts 64 --topk 6 --json d.json
#include <iostream>

#include "cli.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "bench_util.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"

#if defined(RDEP_HAVE_NCCL)
#include <nccl.h>
#endif
#endif

namespace {

constexpr const char* kHelp = R"(usage: rdep bench dispatch [flags]

Dispatch and combine alone, on W GPUs of this machine (one process), and in the same run an NCCL
all-to-allv exchange of the same rows. Every time is the max over ranks per iteration (ranks start
together after a device barrier), summarized as p50/p99 over --iters after --warmup.

rdep (CudaMoELayer, sentinel expert: the MLP is replaced by an echo, so only the transport is left;
dropless):
  dispatch = routing + dispatch phases of a forward: counts, owner scan, acceptance, scatter of the
             payload + sideband into the owners' buffers, segment barrier (from the aligned start to
             the moment every token row has landed at its owner)
  combine  = return + combine phases: rows back to their front-ends, final barrier, gate-weighted sum
  forward  = the whole sentinel forward, end to end (includes the echo and one host sync for the
             per-expert row counts)
  Phase times come from CUDA events at the layer's phase boundaries (EnableProfiling).
NCCL baseline (ncclCommInitAll, the ranks' streams, NCCL_NVLS_ENABLE=0 forced):
  dispatch = grouped ncclSend/ncclRecv of the per-destination row counts, their copy to the host and
             a stream sync, then grouped ncclSend/ncclRecv of the rows: one row per (token, slot), as
             a standard EP dispatch sends (self rows included, as all_to_all_single does)
  combine  = the reverse exchange of the same rows (the sizes are known from dispatch)
  Not timed (a lower bound on an NCCL EP layer): packing rows by destination, unpacking, and the
  gate-weighted sum of combine.

Bytes (bf16 rows, 2*H bytes; "remote" = crossing between GPUs, a rank's rows to itself excluded;
dropless, so every (token, slot) row is accepted):
  slot rows          R    = sum over ranks and tokens of K             (one row per (token, slot))
  remote slot rows   R_x  = (token, slot) rows whose expert's owner is not the token's rank
  token-owner pairs  P_x  = distinct (token, owner) pairs with owner != the token's rank
  rdep dispatch bytes = P_x*(2H + 8) + R_x*16   (deduplicated payload: a token crosses once per
                        owner; sideband: an 8-byte row count per token and 16 bytes per row)
  rdep combine bytes  = R_x*2H                   (one returned row per (token, slot))
  NCCL dispatch bytes = R_x*2H + W*(W-1)*8       (payload + count exchange)
  NCCL combine bytes  = R_x*2H
  The few control words of rdep's phases 1-2 ((E_loc+2) int64 per rank pair) are left out.
  algbw (GB/s) = bytes / W / p50 time: average bytes each GPU sends per second of the max-rank time
  (1 GB = 1e9 bytes). Speedup = NCCL p50 / rdep p50.

flags [defaults: the Moonlight shape]:
  --ranks W            GPUs [all, at most 8]     --tokens T   tokens per rank [4096]
  --hidden H [2048]    --experts E [64]          --topk K [6]
  --routing R          uniform | zipf:ALPHA [uniform]
  --warmup N [20]      --iters N [200]           --seed N [1]
  --launch-ahead-us U  before each iteration's barrier, block the stream U microseconds on a host
                       function so the host enqueues the iteration before the GPU starts it
                       (launch latency out of the timing); 0 = off [100]
  --no-nccl            skip the baseline
  --json FILE          write the receipt (raw per-iteration max-rank times included)
  --max-memory-gib G   host memory limit [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]; the
                       layer's estimated device memory must also fit each GPU (checked before allocating)
  -h, --help           this page
The layer is built with D_ff = 16 (the sentinel expert never reads the expert weights; --ffn is not
a flag here).
)";

#if defined(RDEP_HAVE_CUDA)

using rdep::Status;

constexpr int64_t kLayerFfn = 16;  // expert weights the sentinel never touches: keep them small

int Fail(const Status& s) {
  std::cerr << "rdep bench dispatch: " << s.message() << "\n";
  return 1;
}

void CUDART_CB HostSleep(void* us) {
  std::this_thread::sleep_for(std::chrono::microseconds(*static_cast<const int64_t*>(us)));
}

// Blocks `stream` for `*us` microseconds (host function), so the rank's host thread enqueues the
// iteration while the GPU waits. `us` must outlive the call; nothing when *us <= 0.
Status LaunchAhead(cudaStream_t stream, const int64_t* us) {
  if (*us <= 0) return Status::Ok();
  RDEP_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(stream, HostSleep, const_cast<int64_t*>(us)));
  return Status::Ok();
}

// Row accounting of a (dropless) routing: see the help text for the names.
struct RowCounts {
  std::vector<std::vector<int64_t>> slot_rows;  // [W][W]: (token, slot) rows rank r sends to owner q
  int64_t pairs_remote = 0;                     // P_x
  int64_t slots_remote = 0;                     // R_x
  int64_t slots_total = 0;                      // R
  int64_t pairs_total = 0;                      // distinct (token, owner) pairs, self included
};

RowCounts CountRows(const rdep::Routing& routing, const rdep::OwnershipMap& own, int64_t W) {
  RowCounts c;
  c.slot_rows.assign(static_cast<size_t>(W), std::vector<int64_t>(static_cast<size_t>(W), 0));
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

int RunDispatchBench(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  rdep::cli::Flags f(args);
  const int gpus = rdep::cuda::DeviceCount();
  rdep::LayerConfig cfg;
  auto& s = cfg.shape;
  s.ranks = f.get_int("ranks", std::min(gpus, 8));
  s.tokens = f.get_int("tokens", 4096);
  s.hidden = f.get_int("hidden", 2048);
  s.ffn = kLayerFfn;
  s.experts = f.get_int("experts", 64);
  s.topk = f.get_int("topk", 6);
  const std::string routing_name = f.get_string("routing", "uniform");
  const int64_t warmup = f.get_int("warmup", 20), iters = f.get_int("iters", 200);
  const auto seed = static_cast<uint64_t>(f.get_int("seed", 1));
  const int64_t launch_ahead_us = f.get_int("launch-ahead-us", 100);
  const bool no_nccl = f.get_bool("no-nccl");
  const std::string json = f.get_string("json", "");
  auto limits = rdep::cli::ReadLimits(f);
  if (Status st = f.Finish(); !st.ok()) {
    std::cerr << "rdep bench dispatch: " << st.message() << "\n";
    return 2;
  }
  if (!limits.ok()) {
    std::cerr << "rdep bench dispatch: " << limits.status().message() << "\n";
    return 2;
  }
  if (warmup > 1000000 || iters > 1000000) {
    std::cerr << "rdep bench dispatch: --warmup and --iters must be <= 1000000\n";
    return 2;
  }
  if (gpus == 0) {
    std::cerr << "rdep bench dispatch: no CUDA device is present\n";
    return 2;
  }
  if (warmup < 0 || iters < 1 || launch_ahead_us < 0) {
    std::cerr << "rdep bench dispatch: --warmup and --launch-ahead-us must be >= 0, --iters >= 1\n";
    return 2;
  }
  if (s.ranks < 1 || s.ranks > gpus) {
    std::cerr << "rdep bench dispatch: --ranks must be in [1, " << gpus << "] on this machine\n";
    return 2;
  }
  auto spec = rdep::RoutingSpec::Parse(routing_name);
  if (!spec.ok()) return Fail(spec.status());
  spec->seed = seed;
  if (Status st = cfg.Validate(); !st.ok()) {
    std::cerr << "rdep bench dispatch: " << st.message() << "\n";
    return 2;
  }
  // Estimate before allocating; open the receipt before the work.
  if (Status st = rdep::bench::CheckLayerBenchFootprint(cfg, warmup + iters, static_cast<int>(s.ranks), *limits); !st.ok()) {
    std::cerr << "rdep bench dispatch: " << st.message() << "\n";
    return 2;
  }
  if (Status st = rdep::cli::CheckOutputPath("json", json); !st.ok()) {
    std::cerr << "rdep bench dispatch: " << st.message() << "\n";
    return 2;
  }
  auto setup = rdep::bench::SetupLayerBench(cfg, *spec, seed, static_cast<int>(s.ranks));  // one GPU per rank (NCCL baseline)
  if (!setup.ok()) return Fail(setup.status());
  const rdep::OwnershipMap& own = setup->ownership;
  const rdep::Routing& routing = setup->routing;
  const auto& x = setup->x;
  auto& domain = setup->domain;
  auto& layer = setup->layer;
  layer->set_expert_kind(rdep::ExpertKind::kSentinel);

  const auto W = static_cast<size_t>(s.ranks);
  const int32_t Wi = static_cast<int32_t>(s.ranks);
  const int64_t H = s.hidden, K = s.topk;
  const RowCounts rows = CountRows(routing, own, s.ranks);
  const size_t nk = static_cast<size_t>(s.tokens * K), nh = static_cast<size_t>(s.tokens * H);
  struct Bufs {
    int32_t* experts = nullptr;
    float* gates = nullptr;
    __nv_bfloat16 *x = nullptr, *y = nullptr;
    std::vector<cudaEvent_t> ev;
  };
  std::vector<Bufs> bufs(W);
  const int64_t total = warmup + iters;
  std::vector<std::vector<double>> fwd(W);
  std::vector<std::vector<rdep::PhaseTimes>> phases(W);
  std::vector<size_t> layer_bytes(W);
  std::mutex mu;
  int64_t accepted_rows = 0;

  // 1. rdep: the whole sentinel forward, unprofiled; 2. the same with phase marks.
  Status st = domain->Run([&](int32_t r) -> Status {
    Bufs& b = bufs[static_cast<size_t>(r)];
    const auto& rr = routing[static_cast<size_t>(r)];
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.experts, nk * 4));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.gates, nk * 4));
    for (auto** p : {&b.x, &b.y}) RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(p, nh * 2));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.experts, rr.experts.data(), rr.experts.size() * 4, cudaMemcpyHostToDevice));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.gates, rr.gates.data(), rr.gates.size() * 4, cudaMemcpyHostToDevice));
    std::vector<uint16_t> bits(nh);
    const auto& xr = x[static_cast<size_t>(r)];
    for (size_t i = 0; i < bits.size() && i < xr.size(); ++i) bits[i] = rdep::FloatToBf16Bits(xr[i]);
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.x, bits.data(), nh * 2, cudaMemcpyHostToDevice));
    b.ev.resize(static_cast<size_t>(2 * total));
    for (auto& e : b.ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    cudaStream_t stream = domain->stream(r);
    for (int64_t i = 0; i < total; ++i) {
      RDEP_RETURN_IF_ERROR(LaunchAhead(stream, &launch_ahead_us));
      RDEP_RETURN_IF_ERROR(domain->Barrier(r, rdep::Phase::kTest));  // ranks start together
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[static_cast<size_t>(2 * i)], stream));
      RDEP_RETURN_IF_ERROR(layer->Forward(r, b.experts, b.gates, rr.num_tokens, b.x, b.y));
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ev[static_cast<size_t>(2 * i + 1)], stream));
    }
    RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
    for (int64_t i = warmup; i < total; ++i) {
      float ms = 0;
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, b.ev[static_cast<size_t>(2 * i)], b.ev[static_cast<size_t>(2 * i + 1)]));
      fwd[static_cast<size_t>(r)].push_back(ms);
    }
    layer_bytes[static_cast<size_t>(r)] = layer->device_bytes(r);
    RDEP_ASSIGN_OR_RETURN(auto acc, layer->CopyAcceptance(r));
    int64_t a = 0;
    for (auto v : acc.accepted) a += v;
    std::lock_guard<std::mutex> lock(mu);
    accepted_rows += a;
    return Status::Ok();
  });
  if (!st.ok()) return Fail(st);
  if (accepted_rows != rows.slots_total)
    return Fail(rdep::InternalError("accepted rows " + std::to_string(accepted_rows) + " != W*T*K " +
                                    std::to_string(rows.slots_total) + " (the layer should be dropless)"));
  if (Status pe = layer->EnableProfiling(true); !pe.ok()) return Fail(pe);
  st = domain->Run([&](int32_t r) -> Status {
    Bufs& b = bufs[static_cast<size_t>(r)];
    cudaStream_t stream = domain->stream(r);
    for (int64_t i = 0; i < total; ++i) {
      RDEP_RETURN_IF_ERROR(LaunchAhead(stream, &launch_ahead_us));
      RDEP_RETURN_IF_ERROR(domain->Barrier(r, rdep::Phase::kTest));
      RDEP_RETURN_IF_ERROR(layer->Forward(r, b.experts, b.gates, routing[static_cast<size_t>(r)].num_tokens, b.x, b.y));
      RDEP_ASSIGN_OR_RETURN(auto p, layer->LastPhaseTimes(r, false));  // synchronizes this rank
      if (i >= warmup) phases[static_cast<size_t>(r)].push_back(p);
    }
    return domain->Synchronize(r);
  });
  if (!st.ok()) return Fail(st);
  if (Status pe = layer->EnableProfiling(false); !pe.ok()) return Fail(pe);

  const auto rdep_dispatch = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.routing_ms + p.dispatch_ms; });
  const auto rdep_combine = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.return_ms + p.combine_ms; });
  const auto rdep_fwd = rdep::MaxOverRanks(fwd);
  const auto ph_routing = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.routing_ms; });
  const auto ph_scatter = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.dispatch_ms; });
  const auto ph_expert = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.expert_ms; });
  const auto ph_return = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.return_ms; });
  const auto ph_combine = MaxOverRanksOf(phases, [](const rdep::PhaseTimes& p) { return p.combine_ms; });

  // 3. NCCL baseline.
  std::string nccl_state = no_nccl ? "skipped (--no-nccl)" : "unavailable (this build has no NCCL)";
  std::string nccl_version;
  std::vector<double> nccl_dispatch, nccl_combine, nccl_counts;
  size_t nccl_bytes_max = 0;
  bool round_trip_ok = false;
#if defined(RDEP_HAVE_NCCL)
  if (!no_nccl) {
    setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (see the device notes)
    int ver = 0;
    ncclGetVersion(&ver);
    nccl_version = std::to_string(ver);
    std::vector<NcclRank> nr(W);
    std::vector<ncclComm_t> comms(W);
    std::vector<int> devs(W);
    for (size_t r = 0; r < W; ++r) devs[r] = domain->device(static_cast<int32_t>(r));
    if (ncclResult_t res = ncclCommInitAll(comms.data(), Wi, devs.data()); res != ncclSuccess)
      return Fail(rdep::InternalError(std::string("ncclCommInitAll: ") + ncclGetErrorString(res)));
    for (size_t r = 0; r < W; ++r) {
      cudaSetDevice(devs[r]);
      cudaGetLastError();  // NCCL may leave a benign peer-access error (already enabled) pending
      nr[r].comm = comms[r];
    }
    std::vector<std::vector<double>> t_dispatch(W), t_combine(W), t_counts(W);
    std::vector<int> same(W, 0);
    st = domain->Run([&](int32_t r) -> Status {
      NcclRank& n = nr[static_cast<size_t>(r)];
      const auto& rr = routing[static_cast<size_t>(r)];
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
      std::vector<uint16_t> packed(static_cast<size_t>(n.send_rows * H));
      const auto& xr = x[static_cast<size_t>(r)];
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
      n.ev.resize(static_cast<size_t>(5 * total));
      for (auto& e : n.ev) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
      cudaStream_t stream = domain->stream(r);
      // One untimed round trip (NCCL connects its peers lazily), then the check that it is exact.
      RDEP_RETURN_IF_ERROR(NcclDispatch(n, Wi, H, stream, nullptr));
      RDEP_RETURN_IF_ERROR(NcclCombine(n, Wi, H, stream, nullptr));
      std::vector<uint16_t> back(packed.size());
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(back.data(), n.back, back.size() * 2, cudaMemcpyDeviceToHost, stream));
      RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      cudaGetLastError();  // a benign error NCCL's peer setup may leave pending (peer access already enabled)
      same[static_cast<size_t>(r)] = back == packed ? 1 : 0;
      for (int64_t i = 0; i < total; ++i) {
        const cudaEvent_t* ev = n.ev.data() + 5 * i;
        RDEP_RETURN_IF_ERROR(LaunchAhead(stream, &launch_ahead_us));
        RDEP_RETURN_IF_ERROR(domain->Barrier(r, rdep::Phase::kTest));
        RDEP_RETURN_IF_ERROR(NcclDispatch(n, Wi, H, stream, ev));
        RDEP_RETURN_IF_ERROR(LaunchAhead(stream, &launch_ahead_us));
        RDEP_RETURN_IF_ERROR(domain->Barrier(r, rdep::Phase::kTest));
        RDEP_RETURN_IF_ERROR(NcclCombine(n, Wi, H, stream, ev + 3));
      }
      RDEP_RETURN_IF_ERROR(domain->Synchronize(r));
      for (int64_t i = warmup; i < total; ++i) {
        const cudaEvent_t* ev = n.ev.data() + 5 * i;
        float d = 0, c = 0, cnt = 0;
        RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&d, ev[0], ev[2]));
        RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&cnt, ev[0], ev[1]));
        RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&c, ev[3], ev[4]));
        t_dispatch[static_cast<size_t>(r)].push_back(d);
        t_counts[static_cast<size_t>(r)].push_back(cnt);
        t_combine[static_cast<size_t>(r)].push_back(c);
      }
      return Status::Ok();
    });
    for (size_t r = 0; r < W; ++r) {
      cudaSetDevice(devs[r]);
      nccl_bytes_max = std::max(nccl_bytes_max, static_cast<size_t>(2 * nr[r].send_rows + nr[r].recv_rows) * static_cast<size_t>(H) * 2);
      for (void* p : {static_cast<void*>(nr[r].send), static_cast<void*>(nr[r].recv), static_cast<void*>(nr[r].back),
                      static_cast<void*>(nr[r].counts)})
        cudaFree(p);
      if (nr[r].host_counts) cudaFreeHost(nr[r].host_counts);
      for (auto e : nr[r].ev) cudaEventDestroy(e);
    }
    for (auto c : comms) ncclCommDestroy(c);
    if (!st.ok()) return Fail(st);
    nccl_dispatch = rdep::MaxOverRanks(t_dispatch);
    nccl_combine = rdep::MaxOverRanks(t_combine);
    nccl_counts = rdep::MaxOverRanks(t_counts);
    round_trip_ok = std::all_of(same.begin(), same.end(), [](int v) { return v == 1; });
    nccl_state = round_trip_ok ? "ok" : "ROUND TRIP MISMATCH";
  }
#else
  (void)Wi;
#endif
  const bool have_nccl = !nccl_dispatch.empty();

  // Bytes (see the help text) and bandwidths.
  const double row_b = 2.0 * static_cast<double>(H), Wd = static_cast<double>(W);
  const double rdep_dispatch_bytes = static_cast<double>(rows.pairs_remote) * (row_b + 8) + static_cast<double>(rows.slots_remote) * 16;
  const double rdep_combine_bytes = static_cast<double>(rows.slots_remote) * row_b;
  const double nccl_dispatch_bytes = static_cast<double>(rows.slots_remote) * row_b + Wd * (Wd - 1) * 8;
  const double nccl_combine_bytes = static_cast<double>(rows.slots_remote) * row_b;
  auto algbw = [&](double bytes, double ms) { return bytes / Wd / (ms * 1e-3) / 1e9; };
  const auto s_rd = rdep::Summarize(rdep_dispatch), s_rc = rdep::Summarize(rdep_combine), s_rf = rdep::Summarize(rdep_fwd);
  const auto s_nd = rdep::Summarize(nccl_dispatch), s_nc = rdep::Summarize(nccl_combine), s_ncnt = rdep::Summarize(nccl_counts);
  size_t layer_max = 0;
  for (auto b : layer_bytes) layer_max = std::max(layer_max, b);

  std::printf("rdep bench dispatch: %s, routing %s, dropless, %lld GPUs, warmup %lld, iters %lld, launch-ahead %lld us\n",
              [&] { std::ostringstream os; os << "W=" << s.ranks << " T=" << s.tokens << " H=" << s.hidden << " E=" << s.experts
                                              << " K=" << s.topk; return os.str(); }().c_str(),
              spec->name().c_str(), static_cast<long long>(s.ranks), static_cast<long long>(warmup),
              static_cast<long long>(iters), static_cast<long long>(launch_ahead_us));
  std::printf("  rows: slot rows R=%lld (remote R_x=%lld), token-owner pairs %lld (remote P_x=%lld): rdep sends %.3fx the "
              "payload rows of one-row-per-slot\n",
              static_cast<long long>(rows.slots_total), static_cast<long long>(rows.slots_remote),
              static_cast<long long>(rows.pairs_total), static_cast<long long>(rows.pairs_remote),
              rows.slots_remote ? static_cast<double>(rows.pairs_remote) / static_cast<double>(rows.slots_remote) : 0.0);
  std::printf("  %-26s %9s %9s %14s %11s %9s\n", "", "p50 us", "p99 us", "MB sent/GPU", "algbw GB/s", "speedup");
  auto line = [&](const char* name, const rdep::Summary& sm, double bytes, double speedup) {
    std::printf("  %-26s %9.1f %9.1f %14.2f %11.1f %8.2fx\n", name, sm.p50 * 1e3, sm.p99 * 1e3, bytes / Wd / 1e6,
                algbw(bytes, sm.p50), speedup);
  };
  line("rdep dispatch", s_rd, rdep_dispatch_bytes, have_nccl ? s_nd.p50 / s_rd.p50 : NAN);
  if (have_nccl) line("nccl all-to-allv dispatch", s_nd, nccl_dispatch_bytes, 1.0);
  line("rdep combine", s_rc, rdep_combine_bytes, have_nccl ? s_nc.p50 / s_rc.p50 : NAN);
  if (have_nccl) line("nccl all-to-allv combine", s_nc, nccl_combine_bytes, 1.0);
  std::printf("  %-26s %9.1f %9.1f   (whole sentinel forward, unprofiled)\n", "rdep forward", s_rf.p50 * 1e3, s_rf.p99 * 1e3);
  std::printf("  rdep phases (p50 of the max-rank time, us): routing %.1f  scatter %.1f  echo %.1f  return %.1f  combine %.1f\n",
              rdep::Percentile(ph_routing, 50) * 1e3, rdep::Percentile(ph_scatter, 50) * 1e3, rdep::Percentile(ph_expert, 50) * 1e3,
              rdep::Percentile(ph_return, 50) * 1e3, rdep::Percentile(ph_combine, 50) * 1e3);
  if (have_nccl)
    std::printf("  nccl: count exchange p50 %.1f us of the dispatch; round trip %s; NCCL %s\n", s_ncnt.p50 * 1e3,
                round_trip_ok ? "bitwise exact" : "MISMATCH", nccl_version.c_str());
  else
    std::printf("  nccl baseline: %s\n", nccl_state.c_str());
  std::printf("  device memory per rank (max): layer %.3f GiB, nccl buffers %.3f GiB\n", static_cast<double>(layer_max) / (1 << 30),
              static_cast<double>(nccl_bytes_max) / (1 << 30));

  if (!json.empty()) {
    rdep::JsonWriter j;
    j.begin_object().field("tool", "rdep bench dispatch");
    rdep::bench::WriteEnvironment(j, static_cast<int>(s.ranks));
    j.key("workload").begin_object().field("ranks", s.ranks).field("tokens", s.tokens).field("hidden", s.hidden);
    j.field("experts", s.experts).field("topk", s.topk).field("routing", spec->name()).field("capacity", "dropless");
    j.field("layer_ffn", kLayerFfn).field("expert", "sentinel echo").field("segment", layer->layout().S);
    j.field("seed", static_cast<int64_t>(seed)).field("warmup", warmup).field("iters", iters);
    j.field("launch_ahead_us", launch_ahead_us).end_object();
    j.field("normalization",
            "max over ranks per iteration (ranks aligned by a device barrier); rdep dispatch = routing+dispatch phases, "
            "combine = return+combine phases (CUDA events at phase boundaries); algbw = bytes / W / p50 (1 GB = 1e9 B); "
            "speedup = nccl p50 / rdep p50");
    j.key("rows").begin_object().field("slot_rows", rows.slots_total).field("slot_rows_remote", rows.slots_remote);
    j.field("token_owner_pairs", rows.pairs_total).field("token_owner_pairs_remote", rows.pairs_remote).end_object();
    j.key("bytes").begin_object();
    j.field("rdep_dispatch", rdep_dispatch_bytes).field("rdep_combine", rdep_combine_bytes);
    j.field("nccl_dispatch", nccl_dispatch_bytes).field("nccl_combine", nccl_combine_bytes);
    j.field("formula",
            "rdep dispatch = P_x*(2H+8) + R_x*16; rdep combine = R_x*2H; nccl dispatch = R_x*2H + W*(W-1)*8; "
            "nccl combine = R_x*2H (R_x remote (token,slot) rows, P_x remote distinct (token,owner) pairs)");
    j.end_object();
    rdep::bench::WriteSummary(j, "rdep_dispatch", rdep_dispatch);
    rdep::bench::WriteSummary(j, "rdep_combine", rdep_combine);
    rdep::bench::WriteSummary(j, "rdep_forward", rdep_fwd);
    j.key("rdep_phases_p50_ms").begin_object().field("routing", rdep::Percentile(ph_routing, 50));
    j.field("scatter", rdep::Percentile(ph_scatter, 50)).field("echo", rdep::Percentile(ph_expert, 50));
    j.field("return", rdep::Percentile(ph_return, 50)).field("combine", rdep::Percentile(ph_combine, 50)).end_object();
    j.field("rdep_dispatch_algbw_gbps", algbw(rdep_dispatch_bytes, s_rd.p50));
    j.field("rdep_combine_algbw_gbps", algbw(rdep_combine_bytes, s_rc.p50));
    j.field("layer_device_bytes_max_rank", static_cast<int64_t>(layer_max));
    j.key("baseline").begin_object().field("name", "nccl grouped send/recv all-to-allv").field("state", nccl_state);
    j.field("nccl_version", nccl_version).field("nvls", "disabled (NCCL_NVLS_ENABLE=0)");
    if (have_nccl) {
      rdep::bench::WriteSummary(j, "dispatch", nccl_dispatch);
      rdep::bench::WriteSummary(j, "combine", nccl_combine);
      rdep::bench::WriteSummary(j, "count_exchange", nccl_counts);
      j.field("dispatch_algbw_gbps", algbw(nccl_dispatch_bytes, s_nd.p50));
      j.field("combine_algbw_gbps", algbw(nccl_combine_bytes, s_nc.p50));
      j.field("round_trip_exact", round_trip_ok).field("buffer_bytes_max_rank", static_cast<int64_t>(nccl_bytes_max));
      j.field("speedup_dispatch", s_nd.p50 / s_rd.p50).field("speedup_combine", s_nc.p50 / s_rc.p50);
    }
    j.end_object();
    j.end_object();
    if (!rdep::bench::WriteFile(json, j.str())) std::cerr << "rdep bench dispatch: could not write " << json << "\n";
  }
  for (size_t r = 0; r < W; ++r) {
    cudaSetDevice(domain->device(static_cast<int32_t>(r)));
    for (void* p : {static_cast<void*>(bufs[r].experts), static_cast<void*>(bufs[r].gates), static_cast<void*>(bufs[r].x),
                    static_cast<void*>(bufs[r].y)})
      cudaFree(p);
    for (auto e : bufs[r].ev) cudaEventDestroy(e);
  }
  if (have_nccl && !round_trip_ok) {
    std::cerr << "rdep bench dispatch: the NCCL baseline's round trip did not return the rows it sent\n";
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
  std::cerr << "rdep bench dispatch: this build has no CUDA backend\n";
  return 2;
}

#endif

const bool kRegistered = rdep::cli::RegisterBench({"dispatch", "dispatch and combine alone vs an NCCL all-to-allv, max-rank p50/p99",
                                                   &RunDispatchBench});

}  // namespace
