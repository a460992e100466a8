// `rdep check`: the validation matrix (smoke, dispatch invariants, forward and gradient parity,
// finite values, segment invariance) for one configuration. Exits 0 only if every check passes.
//   rdep check --backend host --ranks 4 --tokens 256 --hidden 256 --experts 32 --topk 4 --json out.json
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

#include "cli.h"
#include "rdep/cuda/device_count.h"
#include "rdep/model/cost_models.h"
#include "rdep/testing/cuda_validation.h"
#include "rdep/testing/validation.h"
#include "rdep/transport/bootstrap.h"
#include "two_phase_report.h"

namespace {

constexpr const char* kHelp = R"(usage: rdep check [flags]

Runs the validation matrix of the RDEP paper (seeds 000), Table 18, for one configuration and prints a
table; exits 0 if every check passes, 1 if one fails, 2 on bad input (the message names the flag).
  smoke                  domain bootstrap, peer-visible stores, phase barrier
  dispatch invariants    sentinel payloads: each accepted row lands once at its owner's local expert and
                         returns to its own front-end slot; accepted set = the documented capacity rule;
                         rows at owners + dropped = routed rows
  forward parity         y vs the double-precision reference MoE operator
  gradient parity        dx, dgate, dW1, dW2 vs the reference
  finite outputs         every output and gradient finite on every rank
  balancing exactness    (with --balance) y, dx, dgate bitwise equal to the same layer without
                         balancing; dW bitwise for experts without replicas, within 1e-5 for replicated
                         (cuda: y, dx, dgate and each expert's dW within the bf16 relative L2 bound)
  two-phase vs one domain (with --nodes N > 1) dgate and dW bitwise equal to the one-domain layer on the
                         same routing, y and dx within 1e-5 of max (cuda: one bf16 rounding, 1e-2; relays
                         sum a token's rows per node first);
                         inter-node rows = one per (token, remote node) of the routing
  two-phase traffic = rdep model (with --nodes N > 1) every rank's rows and bytes in each phase
                         (inter-node dispatch, intra-node dispatch, intra-node return, inter-node
                         combine) equal rdep model's prediction for the same routing and accepted set,
                         integer for integer; the table prints both
  segment invariance     results bitwise equal with a different segment size S

flags (defaults in brackets):
  --backend B            host | cuda | auto: cuda when this build has CUDA and the machine has a GPU,
                         else host [auto]
  --gpus N               cuda, one process: ranks round-robin over N local GPUs [min(W, GPUs)];
                         N < W: ranks share GPUs (stream-join barriers; the placement is printed)
  --bootstrap B          cuda backend: process (one process drives all W GPUs) or mpi (one process per
                         GPU under mpirun: W = the MPI world size; CUDA IPC or fabric handles)
                         [mpi when launched by mpirun, else process]
  --ranks W              ranks in the domain [4]; the host backend runs at most 4096
  --tokens T             tokens per rank [64]
  --hidden H             hidden size [64]
  --ffn F                expert intermediate size D_ff [128]
  --experts E            experts [16]
  --topk K               experts per token [4]
  --routing R            uniform | zipf:ALPHA | one-expert | sparse [uniform]
  --empty-rank R         give rank R (0 <= R < W) zero tokens [none]
  --capacity-factor C    0 = dropless; else each expert admits ceil(C*W*T*K/E) rows [0]
  --segment S            token rows per owner per segment; 0 = T [0]
  --expert-compute X     cuda: cublaslt | cutlass (grouped GEMMs reading the counts on the GPU: with no
                         balancing the layer never waits on the host, at any --segment) [cublaslt]
  --balance B            off | ultraep | eplb | eplb-exact: replicas of hot experts in redundant slots,
                         planned by every rank from the load matrix after phase 1 (cuda: ultraep on
                         each rank's GPU, the eplb baselines on the host after one sync) [off]
  --slots N              with --balance: redundant slots per rank, N_slot in [0, E] [2]
  --min-quota U          with --balance ultraep: rows a replica carries at least, u_min >= 1 [1]
  --relay-above R        with --balance: experts with more than R replicas get their weights through
                         sqrt(replicas) chunk relays (two stages and a barrier); 0 = never [4]
  --owner-reduce         the owner sums a token's rows before they cross back (one row per (token, owner)
                         instead of one per slot) and takes dgate's dot products in backward (the sentinel
                         checks run without it: they need a row per slot) [off]
  --stash-rows N         cuda, --expert-compute cutlass: the paged stash, the saved expert rows in pages of a
                         pool of N rows per rank between forward and backward (cuda only); 0 = off [0]
  --overlap              cuda, --expert-compute cutlass: the segments as a pipeline (dispatch s+1 and return
                         s-1 beside the compute of s, on a second stream per rank); no --balance or
                         --owner-reduce [off]
  --gate-in-expert       cuda, --expert-compute cutlass: the gate multiplied before W2 (the experts weight their
                         rows; the owners take dgate from the saved pre-activations; with --owner-reduce the
                         owner keeps no expert outputs); no --balance or --nodes [off]
  --gate-up L            split | interleaved8: where W1 holds the gate and up columns (the reference uses the
                         same); interleaved8 is the layout GEMM1's SwiGLU epilogue needs (rdep bench gemm --path
                         cutlass-fused); the layer runs the SwiGLU kernel with either [split]
  --transport-sms N      cuda: SM budget of the kernels that store into peer memory (scatter, return): N
                         blocks, so at most N SMs; 0 = grids sized by the work [0]
  --nodes N              N nodes of W/N ranks: the two-phase exchange (a token crosses once per remote
                         node, to the rank with its local index; cuda: device copies for ranks sharing a
                         GPU, NCCL otherwise; not with --expert-compute cutlass) [1]
  --max-nodes M          node-limited routing: each token keeps the experts of its first M nodes (the
                         rest move to free experts there), in [1, N] [N]
  --seed N               seed for routing, weights and activations [1]
  --timeout SECONDS      bound on every barrier wait [30]
  --json FILE            write a JSON receipt (configuration and each check's result); FILE is opened
                         before the run, so a bad path fails at once
  --max-memory-gib G     refuse a configuration whose estimated host memory exceeds G GiB
                         [$RDEP_MAX_MEMORY_GIB, else 3/4 of physical memory]
  --max-gop N            refuse a configuration whose estimated work exceeds N * 10^9 operations
                         [$RDEP_MAX_GOP, else 2000]
  -h, --help             this page

Before allocating anything the command estimates the run's host memory (and, on the cuda backend,
each GPU's) and its work from the flags, and refuses (exit 2) what exceeds the limits, naming the
flags of the largest part.
)";

#if defined(RDEP_HAVE_CUDA)
// The smallest total memory of the first `ranks` GPUs (0 if none can be queried).
double SmallestGpuBytes(int64_t ranks) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
    cudaGetLastError();
    return 0;
  }
  double smallest = 0;
  for (int d = 0; d < n && d < ranks; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    const auto b = static_cast<double>(p.totalGlobalMem);
    if (smallest == 0 || b < smallest) smallest = b;
  }
  return smallest;
}
#else
double SmallestGpuBytes(int64_t) { return 0; }
#endif

int Refuse(const std::string& message) {
  std::cerr << "rdep check: " << message << "\n";
  return 2;
}

// ---- setup -----------------------------------------------------------------------------------------

// What the flags ask for, checked, and the bootstrap (one process per GPU under MPI) when asked for.
struct CheckOptions {
  rdep::ValidationOptions v;
  std::string backend, bootstrap;  // backend: host or cuda once ResolveCheckBackend ran
  bool ranks_given = false, gpus_given = false, empty_rank_given = false;
  int64_t gpus = 0, empty_rank = -1, seed = 1;
  std::string routing, json, balance;
  bool slots_given = false, min_quota_given = false, relay_above_given = false;
  int64_t relay_above = 4;
  int64_t slots = 2;
  int64_t nodes = 1, max_nodes = 0;
  bool max_nodes_given = false;
  rdep::cli::Limits limits;
  std::unique_ptr<rdep::Bootstrap> boot;
  bool leader = true;  // prints the table and writes the receipt
};

// Reads the flags; 0 when they parse, else 2 with the message.
int ReadCheckFlags(const rdep::cli::Args& args, CheckOptions& c) {
  rdep::cli::Flags f(args);
  rdep::ValidationOptions& o = c.v;
  c.backend = f.get_string("backend", "auto");
  c.bootstrap = f.get_string("bootstrap", rdep::LaunchedUnderMpi() ? "mpi" : "process");
  c.ranks_given = f.has("ranks");
  c.gpus_given = f.has("gpus");
  c.empty_rank_given = f.has("empty-rank");
  c.gpus = f.get_int("gpus", 0);
  auto& s = o.layer.shape;
  s.ranks = f.get_int("ranks", 4);
  s.tokens = f.get_int("tokens", 64);
  s.hidden = f.get_int("hidden", 64);
  s.ffn = f.get_int("ffn", 128);
  s.experts = f.get_int("experts", 16);
  s.topk = f.get_int("topk", 4);
  c.routing = f.get_string("routing", "uniform");
  c.empty_rank = f.get_int("empty-rank", -1);
  o.layer.capacity.capacity_factor = f.get_double("capacity-factor", 0.0);
  o.layer.segment_tokens = f.get_int("segment", 0);
  const std::string expert_compute = f.get_string("expert-compute", "cublaslt");
  c.balance = f.get_string("balance", "off");
  c.slots_given = f.has("slots");
  c.min_quota_given = f.has("min-quota");
  c.relay_above_given = f.has("relay-above");
  c.relay_above = f.get_int("relay-above", 4);
  c.slots = f.get_int("slots", 2);
  o.layer.balance.min_quota = f.get_int("min-quota", 1);
  o.layer.owner_reduce = f.get_bool("owner-reduce");
  o.layer.stash_rows = f.get_int("stash-rows", 0);
  o.layer.overlap_segments = f.get_bool("overlap");
  o.layer.gate_in_expert = f.get_bool("gate-in-expert");
  auto gate_up = rdep::ParseGateUp(f.get_string("gate-up", "split"));
  const int64_t transport_sms = f.get_int("transport-sms", 0);
  c.nodes = f.get_int("nodes", 1);
  c.max_nodes = f.get_int("max-nodes", 0);
  c.max_nodes_given = f.has("max-nodes");
  c.seed = f.get_int("seed", 1);
  o.barrier_timeout_s = f.get_double("timeout", 30.0);
  c.json = f.get_string("json", "");
  auto limits = rdep::cli::ReadLimits(f);
  if (rdep::Status st = f.Finish(); !st.ok()) return Refuse(st.message() + "\n(see rdep check --help)");
  if (!f.positional().empty()) return Refuse("unexpected argument '" + f.positional().front() + "'\n(see rdep check --help)");
  if (!limits.ok()) return Refuse(limits.status().message());
  auto compute = rdep::ParseExpertCompute(expert_compute);
  if (!compute.ok()) return Refuse("--expert-compute: " + compute.status().message());
  o.layer.expert_compute = *compute;
  if (transport_sms < 0 || transport_sms > rdep::kMaxTransportSms)
    return Refuse("--transport-sms must be in [0, " + std::to_string(rdep::kMaxTransportSms) + "] (0 = every SM), got " +
                  std::to_string(transport_sms));
  o.layer.transport_sms = static_cast<int32_t>(transport_sms);
  if (!gate_up.ok()) return Refuse("--gate-up: " + gate_up.status().message());
  o.layer.gate_up = *gate_up;
  if (!std::isfinite(o.barrier_timeout_s) || !(o.barrier_timeout_s > 0))
    return Refuse("--timeout must be a finite number of seconds > 0");
  c.limits = *limits;
  return 0;
}

// The bootstrap (process or mpi) and the backend (host or cuda; auto resolved), and --gpus against
// them; 0 when they agree, else 2 with the message.
int ResolveCheckBackend(CheckOptions& c) {
  auto& s = c.v.layer.shape;
  if (c.bootstrap == "mpi") {
    auto b = rdep::MakeMpiBootstrap();
    if (!b.ok()) return Refuse("--bootstrap mpi: " + b.status().message());
    c.boot = std::move(*b);
    if (c.ranks_given && s.ranks != c.boot->size())
      return Refuse("--ranks " + std::to_string(s.ranks) + " but the MPI world has " + std::to_string(c.boot->size()) +
                    " processes");
    s.ranks = c.boot->size();
    if (c.backend == "auto") c.backend = "cuda";
  } else if (c.bootstrap != "process") {
    return Refuse("unknown bootstrap '" + c.bootstrap + "' (process, mpi)");
  }
  if (c.backend == "auto") c.backend = rdep::CudaDeviceCount() > 0 ? "cuda" : "host";
  if (c.gpus_given && (c.backend != "cuda" || c.boot))
    return Refuse("--gpus places the ranks of one process on GPUs: it needs --backend cuda without --bootstrap mpi");
  if (c.gpus_given && (c.gpus < 1 || c.gpus > rdep::CudaDeviceCount()))
    return Refuse("--gpus must be in [1, " + std::to_string(rdep::CudaDeviceCount()) + "] on this machine, got " +
                  std::to_string(c.gpus));
  if (c.boot && c.backend != "cuda") return Refuse("--bootstrap mpi needs --backend cuda");
  if (c.v.layer.expert_compute != rdep::ExpertComputeKind::kCublasLt && c.backend == "host")
    return Refuse("--expert-compute chooses the CUDA backend's expert compute; the host backend computes on the host");
  if (c.v.layer.overlap_segments && c.backend == "host")
    return Refuse("--overlap is the CUDA layer's segment pipeline; the host backend runs its segments in sequence");
  if (c.v.layer.gate_in_expert && c.backend == "host")
    return Refuse("--gate-in-expert is the CUDA layer's gate before W2; the host backend weights the rows at the combine");
  if (c.v.layer.stash_rows != 0 && c.backend == "host")
    return Refuse("--stash-rows is the CUDA layer's paged stash; the host backend keeps its saved rows on the host");
  c.leader = !c.boot || c.boot->rank() == 0;
  if (c.backend != "host" && c.backend != "cuda") return Refuse("unknown backend '" + c.backend + "' (host, cuda, auto)");
  return 0;
}

// --balance, --slots, --min-quota; 0 when good, else 2 naming the flag.
int CheckBalanceFlags(CheckOptions& c) {
  rdep::BalanceConfig& b = c.v.layer.balance;
  auto kind = rdep::ParseBalanceKind(c.balance);
  if (!kind.ok()) return Refuse("--balance: " + kind.status().message());
  b.kind = *kind;
  if (!b.enabled() && (c.slots_given || c.min_quota_given || c.relay_above_given))
    return Refuse(std::string(c.slots_given ? "--slots" : (c.min_quota_given ? "--min-quota" : "--relay-above")) +
                  " needs --balance ultraep, eplb or eplb-exact");
  if (!b.enabled()) return 0;
  if (c.min_quota_given && b.kind != rdep::BalanceKind::kUltraEp) return Refuse("--min-quota applies to --balance ultraep only");
  const int64_t E = c.v.layer.shape.experts;
  if (c.slots < 0 || c.slots > E)
    return Refuse("--slots must be in [0, E=" + std::to_string(E) + "], got " + std::to_string(c.slots));
  b.num_slots = static_cast<int32_t>(c.slots);
  if (b.min_quota < 1) return Refuse("--min-quota must be >= 1, got " + std::to_string(b.min_quota));
  if (c.relay_above < 0 || c.relay_above > 1000000)
    return Refuse("--relay-above must be in [0, 1000000], got " + std::to_string(c.relay_above));
  b.relay_above = static_cast<int32_t>(c.relay_above);
  return 0;
}

// --nodes, --max-nodes; 0 when good, else 2 naming the flag.
int CheckNodeFlags(CheckOptions& c) {
  const int64_t W = c.v.layer.shape.ranks;
  if (c.nodes < 1 || c.nodes > W || W % c.nodes != 0)
    return Refuse("--nodes must divide --ranks W=" + std::to_string(W) + " (N nodes x G ranks per node = W), got " + std::to_string(c.nodes));
  if (c.max_nodes_given && (c.max_nodes < 1 || c.max_nodes > c.nodes))
    return Refuse("--max-nodes must be in [1, N=" + std::to_string(c.nodes) + "], got " + std::to_string(c.max_nodes));
  if (c.nodes > 1 && c.v.layer.owner_reduce)
    return Refuse("--owner-reduce with --nodes: the relays already reduce each node's rows; use one of them");
  if (c.nodes > 1 && c.v.layer.expert_compute == rdep::ExpertComputeKind::kCutlass)
    return Refuse("--nodes with --expert-compute cutlass: the sync-free owner path has no two-phase exchange yet; use "
                  "--expert-compute cublaslt");
  c.v.layer.nodes = rdep::NodeConfig{static_cast<int32_t>(c.nodes), static_cast<int32_t>(c.max_nodes_given ? c.max_nodes : 0)};
  return 0;
}

// The routing, the layer's shape and the ranks against the backend; 0 when good, else 2.
int CheckCheckShape(CheckOptions& c) {
  rdep::ValidationOptions& o = c.v;
  const auto& s = o.layer.shape;
  auto spec = rdep::RoutingSpec::Parse(c.routing);
  if (!spec.ok()) return Refuse("--routing: " + spec.status().message());
  o.routing = *spec;
  o.routing.seed = static_cast<uint64_t>(c.seed);
  o.routing.empty_rank = c.empty_rank;
  o.seed = static_cast<uint64_t>(c.seed);
  if (int rc = CheckBalanceFlags(c); rc != 0) return rc;
  if (int rc = CheckNodeFlags(c); rc != 0) return rc;
  if (rdep::Status st = o.layer.Validate(); !st.ok()) return Refuse(st.message());
  if (c.empty_rank_given && (c.empty_rank < 0 || c.empty_rank >= s.ranks))
    return Refuse("--empty-rank must be a rank in [0, W=" + std::to_string(s.ranks) + "), got " + std::to_string(c.empty_rank));
  if (c.backend == "host" && s.ranks > 4096)
    return Refuse("--ranks " + std::to_string(s.ranks) + ": the host backend runs at most 4096 ranks (threads)");
  return 0;
}

// Estimate before allocating: refuse what would exhaust memory or run for hours. On the cuda backend
// in one process, ranks placed on the same GPU (--gpus N < W) add up on it. Then the receipt's path
// is opened (leader only). 0 when good, else 2.
int CheckCheckFootprint(CheckOptions& c) {
  const auto& s = c.v.layer.shape;
  rdep::Footprint footprint = rdep::EstimateValidationFootprint(c.v, c.backend == "cuda");
  if (c.backend == "cuda") {
    const int64_t used = c.boot ? s.ranks : (c.gpus_given ? c.gpus : std::min<int64_t>(s.ranks, rdep::CudaDeviceCount()));
    const double per_gpu = c.boot ? 1.0 : std::ceil(static_cast<double>(s.ranks) / static_cast<double>(std::max<int64_t>(used, 1)));
    if (per_gpu > 1)
      for (auto& term : footprint.device) {
        term.amount *= per_gpu;
        term.what += " x " + std::to_string(static_cast<int64_t>(per_gpu)) + " ranks per GPU";
        term.factors.push_back({"gpus", static_cast<double>(used)});
      }
    c.limits.device_bytes = SmallestGpuBytes(used);
  }
  if (rdep::Status st = rdep::cli::CheckFootprint(footprint, c.limits); !st.ok()) return Refuse(st.message());
  if (c.leader) {
    if (rdep::Status st = rdep::cli::CheckOutputPath("json", c.json); !st.ok()) return Refuse(st.message());
  }
  return 0;
}

// ---- run and report --------------------------------------------------------------------------------

// The backend the matrix runs on (it lives until the command returns, as the bootstrap does); 0 with
// `be` set, else 2 with the message.
int MakeCheckBackend(const CheckOptions& c, std::unique_ptr<rdep::ValidationBackend>& be) {
  const auto& s = c.v.layer.shape;
  rdep::StatusOr<std::unique_ptr<rdep::ValidationBackend>> made =
      c.boot ? rdep::MakeCudaMultiProcessBackend(*c.boot, c.v.barrier_timeout_s)
             : (c.backend == "cuda" ? rdep::MakeCudaBackend(s.ranks, c.v.barrier_timeout_s, static_cast<int>(c.gpus))
                                    : rdep::MakeHostBackend(s.ranks, c.v.barrier_timeout_s));
  if (!made.ok()) return Refuse("backend " + c.backend + ": " + made.status().message());
  be = std::move(*made);
  return 0;
}

// Per rank and phase of the two-phase exchange: the measured rows and bytes beside rdep model's
// prediction for this routing (the "two-phase traffic = rdep model" check compares them), the largest
// rank's time per phase, and for comparison the seed's closed form for uniform routing.
void PrintTraffic(const rdep::ValidationReport& rep, const rdep::ValidationOptions& o) {
  double dispatch_s = 0, intra_s = 0, combine_s = 0, sent = 0;
  for (const auto& t : rep.traffic) {
    dispatch_s = std::max(dispatch_s, t.dispatch_s);
    intra_s = std::max(intra_s, t.intra_s);
    combine_s = std::max(combine_s, t.combine_s);
    sent += static_cast<double>(t.inter_dispatch_rows);
  }
  const auto& s = o.layer.shape;
  const bool host = rep.backend == "host";
  std::printf("  two-phase exchange per rank and phase, measured beside rdep model's prediction for this routing (%s):\n",
              host ? "host memory copies, not a network" : "device copies or NCCL between ranks of this machine");
  rdep::cli::PrintTwoPhaseTraffic(rdep::cli::TrafficCounts(rep.traffic), rep.traffic_model, 8);
  std::printf("    time per phase, largest rank (%s): inter-node dispatch %.3f ms, intra-node scatter+experts+return %.3f ms, "
              "inter-node combine %.3f ms\n",
              host ? "wall time of rank threads" : "device time", 1e3 * dispatch_s, 1e3 * intra_s, 1e3 * combine_s);
  rdep::model::CrossNodeArgs args;
  args.nodes = o.layer.nodes.nodes;
  args.topk = s.topk;
  args.tokens = s.tokens;
  args.hidden = s.hidden;
  args.max_nodes = o.layer.nodes.cap() < o.layer.nodes.nodes ? o.layer.nodes.cap() : 0;
  if (auto m = rdep::model::CrossNodeDispatch(args); m.ok())
    std::printf("    for comparison only: mean inter-node rows per rank %.1f here; rdep model cross-node's closed form for "
                "uniform routing %.1f (counts the home node as always visited)\n",
                sent / static_cast<double>(s.ranks), m->ib_rows);
}

void PrintCheckTable(const rdep::ValidationReport& rep, const rdep::ValidationOptions& opts) {
  std::printf("  transport: %s\n", rep.transport.c_str());
  std::printf("  %-30s %-6s %9s  %s\n", "check", "result", "seconds", "detail");
  for (const auto& c : rep.checks)
    std::printf("  %-30s %-6s %9.3f  %s\n", c.name.c_str(), c.skipped ? "skip" : (c.passed ? "PASS" : "FAIL"), c.seconds,
                c.detail.c_str());
  if (rep.symmetric_bytes_per_rank > 0)  // only a completed dispatch run measured them
    std::printf("  symmetric buffers per rank: %.3f MiB (S=%lld)\n",
                static_cast<double>(rep.symmetric_bytes_per_rank) / (1024.0 * 1024.0),
                static_cast<long long>(rep.segment_size));
  if (rep.balanced)
    std::printf("  balance: max/mean rank load %.3f without replicas -> %.3f with %d replicas in %d slots%s; %.3f MiB of "
                "weights streamed per forward (%d experts through chunk relays)\n",
                rep.balance.imbalance_before, rep.balance.imbalance_after, rep.balance.replicas, rep.balance.slots,
                rep.balance.slot_limited ? " (every slot used: more slots would balance further)" : "",
                static_cast<double>(rep.balance.weight_bytes) / (1024.0 * 1024.0), rep.balance.relayed_experts);
  if (!rep.traffic.empty()) PrintTraffic(rep, opts);
  int passed = 0, failed = 0;
  for (const auto& c : rep.checks) (c.passed ? passed : failed) += c.skipped ? 0 : 1;
  std::printf("%d passed, %d failed\n", passed, failed);
}

// The receipt; 0 when written, else 2 with the OS's reason.
int WriteCheckReceipt(const CheckOptions& c, const rdep::ValidationReport& rep) {
  errno = 0;
  std::ofstream out(c.json);
  out << rep.ToJson(c.v) << "\n";
  out.flush();
  if (!out) {
    std::cerr << "rdep check: --json " << c.json << ": write failed: " << std::strerror(errno) << "\n";
    return 2;
  }
  return 0;
}

int RunCheck(const rdep::cli::Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  CheckOptions c;
  if (int rc = ReadCheckFlags(args, c); rc != 0) return rc;
  if (int rc = ResolveCheckBackend(c); rc != 0) return rc;
  if (int rc = CheckCheckShape(c); rc != 0) return rc;
  if (int rc = CheckCheckFootprint(c); rc != 0) return rc;

  if (c.leader) {
    std::cout << "rdep check: backend " << c.backend << ", " << c.v.layer << ", routing " << c.v.routing.name();
    if (c.empty_rank >= 0) std::cout << " (rank " << c.empty_rank << " empty)";
    std::cout << ", seed " << c.seed << std::endl;
  }
  std::unique_ptr<rdep::ValidationBackend> be;
  if (int rc = MakeCheckBackend(c, be); rc != 0) return rc;
  auto rep = rdep::RunValidation(c.v, *be);
  if (!rep.ok()) return Refuse(rep.status().message());
  if (!c.leader) return rep->passed() ? 0 : 1;  // every process evaluated the same gathered results
  PrintCheckTable(*rep, c.v);
  if (!c.json.empty())
    if (int rc = WriteCheckReceipt(c, *rep); rc != 0) return rc;
  return rep->passed() ? 0 : 1;
}

const bool kRegistered = rdep::cli::Register({"check", "run the validation matrix for one configuration", &RunCheck});

}  // namespace
