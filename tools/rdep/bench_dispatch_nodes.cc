// `rdep bench dispatch --nodes N [--max-nodes M]`: the two-phase exchange (seeds 004) alone, on the
// host backend (threads of this process) or the CUDA backend (one process, ranks round-robin over
// --gpus GPUs; device copies between ranks sharing a GPU, NCCL between GPUs). The layer runs the
// sentinel expert (an echo), so only the transport is left. Per iteration and rank the layer's
// NodeTraffic gives the rows and bytes of each phase and the time of its three hops; every iteration's
// counts must equal rdep model's prediction for the same routing (rdep/model/two_phase_traffic.h),
// else the command fails (exit 1) naming the iteration, rank and phase.
//   setup  ParseNodesOptions (flags, exit 2 naming the flag) -> MakeNodesWorkload (routing after node
//          limiting, accepted set, prediction needs the backend's wire format: after the run)
//   run    RunHostNodes / RunCudaNodes -> NodesRun (per-iteration, per-rank NodeTraffic)
//   report CompareNodes, PrintNodesTable, WriteNodesReceipt
// Example (host, CI-sized): rdep bench dispatch --backend host --ranks 8 --nodes 4 --max-nodes 2
#include "bench_dispatch_nodes.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_receipt.h"
#include "build_commit.h"
#include "rdep/core/capacity.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/cuda/device_count.h"
#include "rdep/layer/host_moe_layer.h"
#include "rdep/model/two_phase_traffic.h"
#include "rdep/testing/validation.h"
#include "rdep/transport/host_domain.h"
#include "two_phase_report.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>

#include "rdep/cuda/bf16.h"
#include "rdep/cuda/check.h"
#include "rdep/layer/cuda_moe_layer.h"
#include "rdep/transport/cuda_domain.h"
#endif

namespace rdep::bench {

namespace {

constexpr int64_t kNodesFfn = 16;  // expert weights the sentinel never reads: keep them small

int Refuse(const std::string& message) {
  std::cerr << "rdep bench dispatch: " << message << "\n";
  return 2;
}

// ---- setup -----------------------------------------------------------------------------------------

struct NodesOptions {
  std::string backend;  // host or cuda once parsed
  LayerConfig cfg;      // shape.ffn = kNodesFfn; nodes; capacity
  RoutingSpec spec;
  int64_t warmup = 0, iters = 0, gpus = 0;
  uint64_t seed = 1;
  double timeout_s = 30;
  std::string json;
  cli::Limits limits;
};

// The flags this form does not take (they belong to the one-domain form with its NCCL baseline).
int RefuseOneDomainFlags(const cli::Flags& f) {
  for (const char* flag : {"no-nccl", "launch-ahead-us"})
    if (f.has(flag)) return Refuse(std::string("--") + flag + " belongs to the one-domain form; --nodes has no NCCL baseline");
  if (f.has("owner-reduce"))  // LayerConfig::owner_reduce is refused with nodes: the relays already reduce each node's rows
    return Refuse("--owner-reduce belongs to the one-domain form; with --nodes the relays already reduce each node's rows");
  return 0;
}

// --backend, then the defaults of the backend (host: CI-sized; cuda: the Moonlight shape).
int ReadNodesBackend(cli::Flags& f, NodesOptions& o) {
  o.backend = f.get_string("backend", "auto");
  if (o.backend == "auto") o.backend = CudaDeviceCount() > 0 ? "cuda" : "host";
  if (o.backend != "host" && o.backend != "cuda") return Refuse("--backend must be host, cuda or auto, got '" + o.backend + "'");
#if !defined(RDEP_HAVE_CUDA)
  if (o.backend == "cuda") return Refuse("--backend cuda: this build has no CUDA backend");
#endif
  if (o.backend == "cuda" && CudaDeviceCount() == 0) return Refuse("--backend cuda: no CUDA device is present");
  return 0;
}

int ReadNodesFlags(const cli::Args& args, NodesOptions& o) {
  cli::Flags f(args);
  if (int rc = ReadNodesBackend(f, o); rc != 0) return rc;
  const bool host = o.backend == "host";
  auto& s = o.cfg.shape;
  s.ranks = f.get_int("ranks", 8);
  s.tokens = f.get_int("tokens", host ? 256 : 4096);
  s.hidden = f.get_int("hidden", host ? 256 : 2048);
  s.ffn = kNodesFfn;
  s.experts = f.get_int("experts", 64);
  s.topk = f.get_int("topk", 6);
  const int64_t nodes = f.get_int("nodes", 1), max_nodes = f.get_int("max-nodes", 0);
  const bool max_given = f.has("max-nodes");
  o.cfg.capacity.capacity_factor = f.get_double("capacity-factor", 0.0);
  const std::string routing = f.get_string("routing", "uniform");
  o.warmup = f.get_int("warmup", host ? 2 : 20);
  o.iters = f.get_int("iters", host ? 20 : 200);
  o.gpus = f.get_int("gpus", 0);
  const bool gpus_given = f.has("gpus");
  o.seed = static_cast<uint64_t>(f.get_int("seed", 1));
  o.timeout_s = f.get_double("timeout", 30.0);
  o.json = f.get_string("json", "");
  auto limits = cli::ReadLimits(f);
  if (int rc = RefuseOneDomainFlags(f); rc != 0) return rc;
  if (Status st = f.Finish(); !st.ok()) return Refuse(st.message() + "\n(see rdep bench dispatch --help)");
  if (!limits.ok()) return Refuse(limits.status().message());
  o.limits = *limits;
  if (s.ranks < 1 || s.ranks > 4096) return Refuse("--ranks must be in [1, 4096], got " + std::to_string(s.ranks));
  if (nodes < 2 || s.ranks % nodes != 0)
    return Refuse("--nodes must divide --ranks W=" + std::to_string(s.ranks) + " and be >= 2 (N nodes x G ranks per node = W), got " +
                  std::to_string(nodes));
  if (max_given && (max_nodes < 1 || max_nodes > nodes))
    return Refuse("--max-nodes must be in [1, N=" + std::to_string(nodes) + "], got " + std::to_string(max_nodes));
  o.cfg.nodes = NodeConfig{static_cast<int32_t>(nodes), static_cast<int32_t>(max_given ? max_nodes : 0)};
  if (o.warmup < 0 || o.warmup > 1000000 || o.iters < 1 || o.iters > 1000000)
    return Refuse("--warmup must be in [0, 1000000] and --iters in [1, 1000000]");
  if (!(o.timeout_s > 0) || o.timeout_s > 1e6) return Refuse("--timeout must be a number of seconds in (0, 1e6]");
  if (gpus_given && (host || o.gpus < 1 || o.gpus > CudaDeviceCount()))
    return Refuse("--gpus needs --backend cuda and must be in [1, " + std::to_string(CudaDeviceCount()) + "] on this machine");
  if (!gpus_given) o.gpus = std::min<int64_t>(s.ranks, std::max(CudaDeviceCount(), 1));
  auto spec = RoutingSpec::Parse(routing);
  if (!spec.ok()) return Refuse("--routing: " + spec.status().message());
  o.spec = *spec;
  o.spec.seed = o.seed;
  return 0;
}

// The shape against the layer's rules and the machine: a host estimate (the validation matrix's terms
// cover the layer's buffers) and the receipt's path, before anything is allocated.
int CheckNodesPlan(NodesOptions& o) {
  if (Status st = o.cfg.Validate(); !st.ok()) return Refuse(st.message());
  ValidationOptions vo;
  vo.layer = o.cfg;
  Footprint fp = EstimateValidationFootprint(vo, o.backend == "cuda");
  fp.work.clear();  // no reference operator here: the sentinel echo, iterations x rows copied
  const double rows = static_cast<double>(o.cfg.shape.ranks * o.cfg.shape.tokens * o.cfg.shape.topk);
  fp.work.push_back({"iterations x route rows x H (copies)", {{"ranks", static_cast<double>(o.cfg.shape.ranks)},
                                                              {"tokens", static_cast<double>(o.cfg.shape.tokens)},
                                                              {"hidden", static_cast<double>(o.cfg.shape.hidden)},
                                                              {"iters", static_cast<double>(o.warmup + o.iters)}},
                     o.backend == "host" ? 8 * rows * static_cast<double>(o.cfg.shape.hidden * (o.warmup + o.iters)) : 0});
  if (Status st = cli::CheckFootprint(fp, o.limits); !st.ok()) return Refuse(st.message());
  if (Status st = cli::CheckOutputPath("json", o.json); !st.ok()) return Refuse(st.message());
  return 0;
}

// The workload both backends run: the routing after node limiting, its accepted set, the inputs.
struct NodesWorkload {
  OwnershipMap own;
  Routing routing;
  std::vector<RankAcceptance> accepted;
  MoEWeights weights;
  std::vector<std::vector<float>> x;
};

StatusOr<NodesWorkload> MakeNodesWorkload(const NodesOptions& o) {
  const LayerShape& s = o.cfg.shape;
  RDEP_ASSIGN_OR_RETURN(OwnershipMap own, OwnershipMap::Contiguous(s.experts, s.ranks));
  RDEP_ASSIGN_OR_RETURN(Routing routing, GenerateRouting(s, o.spec));
  if (o.cfg.nodes.cap() < o.cfg.nodes.nodes) {
    const int32_t G = o.cfg.nodes.ranks_per_node(s.ranks);
    std::vector<int32_t> node_of(static_cast<size_t>(s.experts));
    for (int32_t e = 0; e < s.experts; ++e) node_of[static_cast<size_t>(e)] = own.owner(e) / G;
    RDEP_RETURN_IF_ERROR(LimitRoutingNodes(routing, node_of, o.cfg.nodes.cap()));
  }
  RDEP_ASSIGN_OR_RETURN(auto accepted, ApplyCapacity(s, routing, o.cfg.capacity));
  auto x = RandomActivations(s, routing, o.seed + 1);
  return NodesWorkload{std::move(own), std::move(routing), std::move(accepted), RandomWeights(s, o.seed), std::move(x)};
}

// ---- run -------------------------------------------------------------------------------------------

struct NodesRun {
  std::vector<std::vector<NodeTraffic>> traffic;  // [iteration after warmup][rank]
  model::TwoPhaseWire wire;                       // the layer's record sizes
  std::string transport;
};

StatusOr<NodesRun> RunHostNodes(const NodesOptions& o, const NodesWorkload& wl) {
  const LayerShape& s = o.cfg.shape;
  RDEP_ASSIGN_OR_RETURN(auto domain, HostDomain::Create(s.ranks, {.barrier_timeout_s = o.timeout_s}));
  RDEP_ASSIGN_OR_RETURN(auto layer, HostMoELayer::Create(*domain, o.cfg, wl.own, wl.weights));
  layer->set_expert_kind(ExpertKind::kSentinel);
  NodesRun run;
  run.transport = "host threads (one process); times are wall times of rank threads, not a network";
  run.wire = layer->two_phase_wire();
  run.traffic.assign(static_cast<size_t>(o.iters), std::vector<NodeTraffic>(static_cast<size_t>(s.ranks)));
  RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    std::vector<float> y(static_cast<size_t>(wl.routing[i].num_tokens * s.hidden));
    for (int64_t it = 0; it < o.warmup + o.iters; ++it) {
      RDEP_RETURN_IF_ERROR(layer->Forward(r, wl.routing[i], wl.x[i], y));
      if (it >= o.warmup) run.traffic[static_cast<size_t>(it - o.warmup)][i] = layer->node_traffic(r);
    }
    return Status::Ok();
  }));
  return run;
}

#if defined(RDEP_HAVE_CUDA)
// One rank's router output and activations (bf16) on its GPU.
struct NodesRankInputs {
  int32_t* experts = nullptr;
  float* gates = nullptr;
  void *x = nullptr, *y = nullptr;
  ~NodesRankInputs() {
    for (void* p : {static_cast<void*>(experts), static_cast<void*>(gates), x, y}) cudaFree(p);
  }
};

Status UploadNodesInputs(NodesRankInputs& in, const RankRouting& rr, const std::vector<float>& xr) {
  const size_t nk = std::max<size_t>(rr.experts.size(), 1), nh = std::max<size_t>(xr.size(), 1);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&in.experts, nk * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&in.gates, nk * 4));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&in.x, nh * 2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&in.y, nh * 2));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(in.experts, rr.experts.data(), rr.experts.size() * 4, cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(in.gates, rr.gates.data(), rr.gates.size() * 4, cudaMemcpyHostToDevice));
  std::vector<uint16_t> bits(xr.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = FloatToBf16Bits(xr[i]);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(in.x, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  return cuda::CudaStatus(cudaStreamSynchronize(cudaStreamLegacy), "inputs", __FILE__, __LINE__);  // the DMA, before the ranks' streams read
}

// Per iteration: a device barrier (ranks start together), the sentinel forward, then the layer's
// NodeTraffic (it synchronizes the rank's stream; its times are CUDA events around the three hops).
StatusOr<NodesRun> RunCudaNodes(const NodesOptions& o, const NodesWorkload& wl) {
  const LayerShape& s = o.cfg.shape;
  RDEP_ASSIGN_OR_RETURN(auto domain, CudaDomain::CreateSingleProcess(s.ranks, {.barrier_timeout_s = o.timeout_s,
                                                                               .devices = RoundRobinDevices(s.ranks, static_cast<int>(o.gpus))}));
  RDEP_ASSIGN_OR_RETURN(auto layer, CudaMoELayer::Create(*domain, o.cfg, wl.own, wl.weights));
  layer->set_expert_kind(ExpertKind::kSentinel);
  NodesRun run;
  run.transport = "cuda, one process, " + std::to_string(s.ranks) + " ranks on " + std::to_string(o.gpus) +
                  " GPUs (device copies between ranks sharing a GPU, NCCL between GPUs); device time (CUDA events)";
  run.wire = layer->two_phase_wire();
  run.traffic.assign(static_cast<size_t>(o.iters), std::vector<NodeTraffic>(static_cast<size_t>(s.ranks)));
  RDEP_RETURN_IF_ERROR(domain->Run([&](int32_t r) -> Status {
    const auto i = static_cast<size_t>(r);
    NodesRankInputs in;
    RDEP_RETURN_IF_ERROR(UploadNodesInputs(in, wl.routing[i], wl.x[i]));
    for (int64_t it = 0; it < o.warmup + o.iters; ++it) {
      RDEP_RETURN_IF_ERROR(domain->Barrier(r, Phase::kTest));
      RDEP_RETURN_IF_ERROR(layer->Forward(r, in.experts, in.gates, wl.routing[i].num_tokens, static_cast<const __nv_bfloat16*>(in.x),
                                          static_cast<__nv_bfloat16*>(in.y)));
      RDEP_ASSIGN_OR_RETURN(NodeTraffic t, layer->node_traffic(r));
      if (it >= o.warmup) run.traffic[static_cast<size_t>(it - o.warmup)][i] = t;
    }
    return domain->Synchronize(r);
  }));
  return run;
}
#else
StatusOr<NodesRun> RunCudaNodes(const NodesOptions&, const NodesWorkload&) {
  return FailedPrecondition("this build has no CUDA backend");
}
#endif

// ---- report ----------------------------------------------------------------------------------------

struct NodesReport {
  std::vector<model::RankPhaseTraffic> predicted, measured;  // measured: the last iteration
  std::string mismatch;                                      // "" when every iteration equals the prediction
  std::vector<double> dispatch_ms, intra_ms, combine_ms;     // per iteration, max over ranks
};

StatusOr<NodesReport> CompareNodes(const NodesOptions& o, const NodesWorkload& wl, const NodesRun& run) {
  NodesReport rep;
  RDEP_ASSIGN_OR_RETURN(rep.predicted, model::PredictTwoPhaseTraffic(wl.routing, wl.accepted, wl.own, o.cfg.nodes.nodes, run.wire));
  for (size_t it = 0; it < run.traffic.size(); ++it) {
    rep.measured = cli::TrafficCounts(run.traffic[it]);
    if (rep.mismatch.empty())
      if (std::string m = model::FirstTrafficMismatch(rep.measured, rep.predicted); !m.empty())
        rep.mismatch = "iteration " + std::to_string(it) + ", " + m;
    double d = 0, in = 0, c = 0;
    for (const auto& t : run.traffic[it]) {
      d = std::max(d, 1e3 * t.dispatch_s);
      in = std::max(in, 1e3 * t.intra_s);
      c = std::max(c, 1e3 * t.combine_s);
    }
    rep.dispatch_ms.push_back(d);
    rep.intra_ms.push_back(in);
    rep.combine_ms.push_back(c);
  }
  return rep;
}

void PrintNodesTable(const NodesOptions& o, const NodesRun& run, const NodesReport& rep) {
  const auto& s = o.cfg.shape;
  std::cout << "rdep bench dispatch --nodes: backend " << o.backend << ", " << o.cfg << ", routing " << o.spec.name()
            << ", sentinel echo, warmup " << o.warmup << ", iters " << o.iters << "\n  transport: " << run.transport << "\n";
  std::printf("  bytes per rank and phase (one forward), measured beside rdep model's prediction for this routing:\n");
  cli::PrintTwoPhaseTraffic(rep.measured, rep.predicted, 16);
  std::printf("  time per phase, max over %lld ranks per iteration (%s):\n", static_cast<long long>(s.ranks),
              o.backend == "host" ? "host threads: not a network, not a GPU" : "device time");
  std::printf("    %-44s %10s %10s\n", "phase", "p50 ms", "p99 ms");
  auto line = [](const char* name, const std::vector<double>& ms) {
    const Summary sm = Summarize(ms);
    std::printf("    %-44s %10.3f %10.3f\n", name, sm.p50, sm.p99);
  };
  line("inter-node dispatch", rep.dispatch_ms);
  line("intra-node: scatter, sentinel echo, return", rep.intra_ms);
  line("inter-node combine (reduce at relay + hop)", rep.combine_ms);
  std::printf("  traffic = rdep model: %s\n", rep.mismatch.empty() ? "every iteration, every rank and phase (rows and bytes)"
                                                                   : ("DIFFERS: " + rep.mismatch).c_str());
}

void WriteNodesReceipt(const NodesOptions& o, const NodesRun& run, const NodesReport& rep) {
  const auto& s = o.cfg.shape;
  JsonWriter j;
  j.begin_object().field("tool", "rdep bench dispatch --nodes").field("backend", o.backend).field("transport", run.transport);
  j.key("software").begin_object().field("rdep_commit", cli::kBuildCommit).end_object();
  j.key("workload").begin_object().field("ranks", s.ranks).field("tokens", s.tokens).field("hidden", s.hidden);
  j.field("experts", s.experts).field("topk", s.topk).field("routing", o.spec.name()).field("capacity_factor", o.cfg.capacity.capacity_factor);
  j.field("nodes", static_cast<int64_t>(o.cfg.nodes.nodes)).field("max_nodes", static_cast<int64_t>(o.cfg.nodes.cap()));
  j.field("layer_ffn", kNodesFfn).field("expert", "sentinel echo").field("seed", static_cast<int64_t>(o.seed));
  j.field("warmup", o.warmup).field("iters", o.iters).end_object();
  j.field("normalization", o.backend == "host" ? "max over ranks per iteration of each phase's wall time on rank threads (host: not a network)"
                                               : "max over ranks per iteration of each hop's device time (CUDA events)");
  j.field("traffic_equals_model", rep.mismatch.empty()).field("mismatch", rep.mismatch);
  j.key("per_rank").begin_array();
  for (size_t r = 0; r < rep.measured.size(); ++r) {
    j.begin_object();
    for (const model::PhaseField& f : model::kTwoPhaseFields) {
      const double pb = static_cast<double>(rep.predicted[r].*f.bytes);
      j.key(f.name).begin_object().field("rows", rep.measured[r].*f.rows).field("model_rows", rep.predicted[r].*f.rows);
      j.field("bytes", rep.measured[r].*f.bytes).field("model_bytes", rep.predicted[r].*f.bytes);
      j.field("ratio", pb > 0 ? static_cast<double>(rep.measured[r].*f.bytes) / pb : 1.0).end_object();
    }
    j.end_object();
  }
  j.end_array();
  WriteSummary(j, "inter_dispatch", rep.dispatch_ms);
  WriteSummary(j, "intra_node", rep.intra_ms);
  WriteSummary(j, "inter_combine", rep.combine_ms);
  j.end_object();
  if (!WriteFile(o.json, j.str())) std::cerr << "rdep bench dispatch: could not write " << o.json << "\n";
}

}  // namespace

int RunDispatchNodesBench(const cli::Args& args) {
  NodesOptions o;
  if (int rc = ReadNodesFlags(args, o); rc != 0) return rc;
  if (int rc = CheckNodesPlan(o); rc != 0) return rc;
  auto wl = MakeNodesWorkload(o);
  if (!wl.ok()) return Refuse(wl.status().message());
  auto run = o.backend == "host" ? RunHostNodes(o, *wl) : RunCudaNodes(o, *wl);
  if (!run.ok()) {
    std::cerr << "rdep bench dispatch: " << run.status().message() << "\n";
    return 1;
  }
  auto rep = CompareNodes(o, *wl, *run);
  if (!rep.ok()) {
    std::cerr << "rdep bench dispatch: " << rep.status().message() << "\n";
    return 1;
  }
  PrintNodesTable(o, *run, *rep);
  if (!o.json.empty()) WriteNodesReceipt(o, *run, *rep);
  if (!rep->mismatch.empty()) {
    std::cerr << "rdep bench dispatch: measured traffic differs from rdep model: " << rep->mismatch << "\n";
    return 1;
  }
  return 0;
}

}  // namespace rdep::bench
