// The GPU UltraEP quota planner (see gpu_planner.h): one thread block of 1024 threads, state in shared
// memory, bitwise the same plan as the host planner (quota_planner.cc). Any change to the oracle,
// tie-breaking or rounding there must be mirrored here; GpuPlanner.MatchesHost* checks it.
#include "rdep/balance/gpu_planner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "gpu_planner/kernel.cuh"
#include "rdep/core/capacity_rules.h"

namespace rdep {
namespace {

using namespace gpu_planner_detail;

#define RDEP_CUDA_RETURN(expr)                                                                              \
  do {                                                                                                      \
    cudaError_t rdep_err_ = (expr);                                                                         \
    if (rdep_err_ != cudaSuccess) {                                                                         \
      (void)cudaGetLastError();                                                                             \
      return Status(StatusCode::kCudaError, std::string(#expr) + " failed at " + __FILE__ + ":" +           \
                                                std::to_string(__LINE__) + ": " + cudaGetErrorString(rdep_err_)); \
    }                                                                                                       \
  } while (0)

// Device buffers of one planner instance.
struct DeviceBuffers {
  int64_t* load = nullptr;
  int32_t* owner = nullptr;
  int64_t* misc = nullptr;
  int32_t *tr_expert = nullptr, *tr_rank = nullptr, *tr_slot = nullptr;
  int64_t* tr_amount = nullptr;
  int32_t *inst_offsets = nullptr, *inst_expert = nullptr, *inst_rank = nullptr, *inst_slot = nullptr;
  int64_t* inst_quota = nullptr;
  int32_t* slot_expert = nullptr;
  int32_t* route = nullptr;
  int64_t *demand = nullptr, *phase = nullptr;
  ~DeviceBuffers() {
    for (void* p : {static_cast<void*>(load), static_cast<void*>(owner), static_cast<void*>(misc),
                    static_cast<void*>(tr_expert), static_cast<void*>(tr_rank), static_cast<void*>(tr_slot),
                    static_cast<void*>(tr_amount), static_cast<void*>(inst_offsets), static_cast<void*>(inst_expert),
                    static_cast<void*>(inst_rank), static_cast<void*>(inst_slot), static_cast<void*>(inst_quota),
                    static_cast<void*>(slot_expert), static_cast<void*>(route), static_cast<void*>(demand),
                    static_cast<void*>(phase)})
      if (p) cudaFree(p);
  }
};

template <typename T>
Status Alloc(T** p, size_t n) {
  RDEP_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(p), std::max<size_t>(n, 1) * sizeof(T)));
  return Status::Ok();
}

StatusOr<GpuPlannerConfig> ChooseConfig(int32_t num_experts, int32_t num_ranks, int32_t num_slots, bool stage_ok) {
  if (num_experts < 1 || num_ranks < 1 || num_slots < 0)
    return InvalidArgument("GPU planner: need E >= 1, R >= 1, N_slot >= 0");
  if (num_ranks > kMaxRanks)
    return InvalidArgument("GPU planner: R=" + std::to_string(num_ranks) + " exceeds the one-block limit of " +
                           std::to_string(kMaxRanks));
  int dev = 0, optin = 0;
  RDEP_CUDA_RETURN(cudaGetDevice(&dev));
  RDEP_CUDA_RETURN(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  // Measurement knobs: RDEP_GPU_PLANNER_PROBE_THREADS = the thread search's probes per round (1..1023,
  // default 128: one warp per scheduler), RDEP_GPU_PLANNER_CHAIN_SHIFT = its first round's chain margin
  // lo >> shift (default 5; 0 = no chain), RDEP_GPU_PLANNER_PROBE_WARPS caps the warp search's probe warps.
  int threads = kDefaultProbeThreads, chain_shift = kDefaultChainShift;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_PROBE_THREADS"); env != nullptr && std::atoi(env) >= 1)
    threads = std::min(kThreads - 1, std::atoi(env));
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_CHAIN_SHIFT"); env != nullptr && std::atoi(env) >= 0)
    chain_shift = std::min(30, std::atoi(env));
  int max_pw = kDefaultProbeWarps;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_PROBE_WARPS"); env != nullptr && std::atoi(env) >= 1)
    max_pw = std::min(31, std::atoi(env));
  // The thread search exists for R <= 64; with it, the warp search only runs for loads >= 2^26. When
  // shared memory is short, the probe threads halve.
  for (int pt = num_ranks <= 64 ? threads : 0;; pt /= 2) {
    for (bool staged : {true, false}) {
      if (staged && !stage_ok) continue;
      for (int pw = 31; pw >= 1; pw = (pw - 1) / 2) {  // 31, 15, 7, 3, 1 warps: 5..1 levels per round
        if (pw > max_pw) continue;
        const size_t bytes = Layout(num_ranks, num_experts, num_slots, pw, pt, staged).bytes();
        if (bytes <= static_cast<size_t>(optin))
          return GpuPlannerConfig{bytes, pw, pt, pt > 0 ? chain_shift : 0, staged};
      }
    }
    if (pt <= 0) break;
  }
  return InvalidArgument("GPU planner: E=" + std::to_string(num_experts) + ", R=" + std::to_string(num_ranks) +
                         ", N_slot=" + std::to_string(num_slots) + " does not fit one block's shared memory (" +
                         std::to_string(optin) + " bytes)");
}

struct Prepared {
  int R = 0, E = 0, S = 0;
  GpuPlannerConfig cfg;
  DeviceBuffers buf;
  KernelArgs args{};
};

// Buffers and kernel arguments for (owners, config); the load is written into buf.load by the caller.
Status PrepareBuffers(const OwnershipMap& owners, const QuotaConfig& config, Prepared* p) {
  RDEP_RETURN_IF_ERROR(config.Validate(owners.num_experts()));
  std::string why;
  if (!GpuPlannerAvailable(&why)) return Unavailable("GPU planner: " + why);
  p->R = owners.num_ranks();
  p->E = owners.num_experts();
  p->S = config.num_slots;
  RDEP_ASSIGN_OR_RETURN(p->cfg, ChooseConfig(p->E, p->R, p->S, true));
  const size_t R = static_cast<size_t>(p->R), E = static_cast<size_t>(p->E), RS = R * static_cast<size_t>(p->S);
  const size_t imax = E + RS;
  DeviceBuffers& b = p->buf;
  RDEP_RETURN_IF_ERROR(Alloc(&b.load, R * E));
  RDEP_RETURN_IF_ERROR(Alloc(&b.owner, E));
  RDEP_RETURN_IF_ERROR(Alloc(&b.misc, 4));
  RDEP_RETURN_IF_ERROR(Alloc(&b.tr_expert, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.tr_rank, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.tr_slot, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.tr_amount, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_offsets, E + 1));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_expert, imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_rank, imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_slot, imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.inst_quota, imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.slot_expert, RS));
  RDEP_RETURN_IF_ERROR(Alloc(&b.route, R * imax));
  RDEP_RETURN_IF_ERROR(Alloc(&b.demand, p->cfg.staged_load ? 0 : R * E));
  RDEP_CUDA_RETURN(cudaMemcpy(b.owner, owners.owners().data(), E * sizeof(int32_t), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN(cudaMemset(b.misc, 0, 4 * sizeof(int64_t)));
  // Both on the legacy stream (the copy from pageable memory may return before its DMA lands), which the callers'
  // non-blocking streams do not wait for.
  RDEP_CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy));
  RDEP_CUDA_RETURN(cudaFuncSetAttribute(QuotaPlanKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(p->cfg.shared_bytes)));
  KernelArgs& a = p->args;
  a.load = b.load;
  a.owner = b.owner;
  a.R = p->R;
  a.E = p->E;
  a.S = p->S;
  a.pw = p->cfg.probe_warps;
  a.pt = p->cfg.probe_threads;
  a.chain_shift = p->cfg.chain_shift;
  // The reroute table lives in the overflow area: pt * R int32 words hold (R | 1) int4 entries per expert.
  // RDEP_GPU_PLANNER_REROUTE_TABLE caps it (0: every expert takes the per-thread reciprocal chain).
  a.rtab_cap = a.pt * a.R / (4 * (a.R | 1));
  // RDEP_GPU_PLANNER_ROUTE_TILE=0: the reroute writes its columns straight to the route, next to the
  // single-instance entries written meanwhile (measurement knob).
  a.route_tile = 1;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_ROUTE_TILE"); env != nullptr) a.route_tile = std::atoi(env) != 0;
  if (const char* env = std::getenv("RDEP_GPU_PLANNER_REROUTE_TABLE"); env != nullptr && std::atoi(env) >= 0)
    a.rtab_cap = std::min(a.rtab_cap, std::atoi(env));
  a.staged = p->cfg.staged_load ? 1 : 0;
  a.umin = config.min_quota;
  a.min_gain = config.min_gain;
  a.locality = config.locality ? 1 : 0;
  a.out_misc = b.misc;
  a.tr_expert = b.tr_expert;
  a.tr_rank = b.tr_rank;
  a.tr_slot = b.tr_slot;
  a.tr_amount = b.tr_amount;
  a.inst_offsets = b.inst_offsets;
  a.inst_expert = b.inst_expert;
  a.inst_rank = b.inst_rank;
  a.inst_slot = b.inst_slot;
  a.inst_quota = b.inst_quota;
  a.slot_expert = b.slot_expert;
  a.route = b.route;
  a.demand = b.demand;
  a.layout = Layout(a.R, a.E, a.S, a.pw, a.pt, a.staged != 0);
  return Status::Ok();
}

Status Prepare(const std::vector<int64_t>& load, const OwnershipMap& owners, const QuotaConfig& config,
               Prepared* p) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  // The device plan counts rows in int32 (a route entry is at most a load entry): every entry must fit.
  for (size_t i = 0; i < load.size(); ++i)
    if (load[i] > INT32_MAX)
      return InvalidArgument("GPU planner: load[" + std::to_string(i / static_cast<size_t>(owners.num_experts())) +
                             "][" + std::to_string(i % static_cast<size_t>(owners.num_experts())) + "] = " +
                             std::to_string(load[i]) + " rows exceeds 2^31 - 1 (the device plan counts rows in int32)");
  RDEP_RETURN_IF_ERROR(PrepareBuffers(owners, config, p));
  RDEP_CUDA_RETURN(cudaMemcpy(p->buf.load, load.data(), load.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy));  // landed before a launch on a non-blocking stream
  return Status::Ok();
}

// The capacity rule on the device: per expert (one thread each), rows admitted from each source in
// source order, written where the planner reads its load.
__global__ void AdmitLoadKernel(const int64_t* load, int R, int E, int64_t capacity, int64_t* admitted) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    SourceOrderAdmission admission{capacity};
    for (int r = 0; r < R; ++r) admitted[static_cast<size_t>(r) * E + e] = admission.Admit(load[static_cast<size_t>(r) * E + e]);
  }
}

Status Launch(const Prepared& p, cudaStream_t stream) {
  QuotaPlanKernel<<<1, kThreads, p.cfg.shared_bytes, stream>>>(p.args);
  RDEP_CUDA_RETURN(cudaGetLastError());
#if defined(RDEP_DEBUG_SYNC)
  RDEP_CUDA_RETURN(cudaStreamSynchronize(stream));
#endif
  return Status::Ok();
}

}  // namespace

bool GpuPlannerAvailable(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(err) + ")";
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device present";
    return false;
  }
  return true;
}

StatusOr<GpuPlannerConfig> GpuPlannerCanImplement(int32_t num_experts, int32_t num_ranks, int32_t num_slots) {
  return ChooseConfig(num_experts, num_ranks, num_slots, true);
}


namespace {

// Copies a solved plan from the device (the stream must be synchronized).
StatusOr<BalancePlan> DownloadPlan(const Prepared& p) {
  int64_t misc[4] = {0, 0, 0, 0};
  RDEP_CUDA_RETURN(cudaMemcpy(misc, p.buf.misc, sizeof(misc), cudaMemcpyDeviceToHost));
  if (misc[3] != 0) return InternalError("GPU planner: reroute found residual demand above residual quota");
  const size_t R = static_cast<size_t>(p.R), E = static_cast<size_t>(p.E), RS = R * static_cast<size_t>(p.S);
  BalancePlan plan;
  plan.num_experts = p.E;
  plan.num_ranks = p.R;
  plan.num_slots = p.S;
  plan.threshold = misc[0];
  plan.instance_offsets.resize(E + 1);
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_offsets.data(), p.buf.inst_offsets, (E + 1) * sizeof(int32_t),
                              cudaMemcpyDeviceToHost));
  const size_t I = static_cast<size_t>(plan.instance_offsets[E]);
  if (I < E || I > E + RS) return InternalError("GPU planner: instance count out of range");
  plan.instance_expert.resize(I);
  plan.instance_rank.resize(I);
  plan.instance_slot.resize(I);
  plan.instance_quota.resize(I);
  plan.slot_expert.resize(RS);
  plan.route.resize(R * I);
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_expert.data(), p.buf.inst_expert, I * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_rank.data(), p.buf.inst_rank, I * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_slot.data(), p.buf.inst_slot, I * 4, cudaMemcpyDeviceToHost));
  RDEP_CUDA_RETURN(cudaMemcpy(plan.instance_quota.data(), p.buf.inst_quota, I * 8, cudaMemcpyDeviceToHost));
  if (RS > 0)
    RDEP_CUDA_RETURN(cudaMemcpy(plan.slot_expert.data(), p.buf.slot_expert, RS * 4, cudaMemcpyDeviceToHost));
  std::vector<int32_t> route32(R * I);
  RDEP_CUDA_RETURN(cudaMemcpy(route32.data(), p.buf.route, R * I * 4, cudaMemcpyDeviceToHost));
  std::copy(route32.begin(), route32.end(), plan.route.begin());
  return plan;
}

}  // namespace

StatusOr<BalancePlan> SolveQuotaPlanGpu(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                        const QuotaConfig& config) {
  Prepared p;
  RDEP_RETURN_IF_ERROR(Prepare(load, owners, config, &p));
  RDEP_RETURN_IF_ERROR(Launch(p, nullptr));
  RDEP_CUDA_RETURN(cudaDeviceSynchronize());
  return DownloadPlan(p);
}

struct DevicePlanner::Impl {
  Prepared p;
};

DevicePlanner::DevicePlanner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DevicePlanner::~DevicePlanner() = default;

StatusOr<std::unique_ptr<DevicePlanner>> DevicePlanner::Create(const OwnershipMap& owners, const QuotaConfig& config) {
  auto impl = std::make_unique<Impl>();
  RDEP_RETURN_IF_ERROR(PrepareBuffers(owners, config, &impl->p));
  return std::unique_ptr<DevicePlanner>(new DevicePlanner(std::move(impl)));
}

Status DevicePlanner::Solve(const int64_t* load_dev, int64_t capacity, CUstream_st* stream) {
  const Prepared& p = impl_->p;
  if (load_dev == nullptr) return InvalidArgument("device planner: the load matrix pointer is null");
  RDEP_CUDA_RETURN(cudaMemsetAsync(p.buf.misc, 0, 4 * sizeof(int64_t), stream));
  AdmitLoadKernel<<<(p.E + 127) / 128, 128, 0, stream>>>(load_dev, p.R, p.E, capacity, p.buf.load);
  RDEP_CUDA_RETURN(cudaGetLastError());
  return Launch(p, stream);
}

DevicePlanView DevicePlanner::view() const {
  const DeviceBuffers& b = impl_->p.buf;
  return DevicePlanView{b.inst_offsets, b.inst_expert, b.inst_rank, b.inst_slot, b.inst_quota, b.slot_expert, b.route, b.load, b.misc};
}

StatusOr<BalancePlan> DevicePlanner::Download(CUstream_st* stream) const {
  RDEP_CUDA_RETURN(cudaStreamSynchronize(stream));
  return DownloadPlan(impl_->p);
}

StatusOr<GpuPlannerTiming> BenchQuotaPlanGpu(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                             const QuotaConfig& config, int32_t warmup, int32_t iters) {
  if (iters < 1 || warmup < 0) return InvalidArgument("GPU planner bench: need iters >= 1 and warmup >= 0");
  Prepared p;
  RDEP_RETURN_IF_ERROR(Prepare(load, owners, config, &p));
  struct Resources {  // released on every return path
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Resources() {
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
      if (stream) cudaStreamDestroy(stream);
    }
  } res;
  RDEP_CUDA_RETURN(cudaStreamCreateWithFlags(&res.stream, cudaStreamNonBlocking));
  RDEP_CUDA_RETURN(cudaEventCreate(&res.start));
  RDEP_CUDA_RETURN(cudaEventCreate(&res.stop));
  for (int32_t i = 0; i < warmup; ++i) RDEP_RETURN_IF_ERROR(Launch(p, res.stream));
  RDEP_CUDA_RETURN(cudaStreamSynchronize(res.stream));
  // Phase boundaries (clock64 of thread 0) of every timed solve, averaged.
  RDEP_RETURN_IF_ERROR(Alloc(&p.buf.phase, kNumPhaseStamps));
  p.args.out_phase = p.buf.phase;
  // setup, search, record, tables + reroute, and of the last: preparation (instance offsets, transfer
  // output), the replicated experts' reroute (longest warp), tables + single-instance routes (longest warp).
  std::vector<double> phase_sum(7, 0.0);
  std::vector<double> us;
  for (int32_t i = 0; i < iters; ++i) {
    RDEP_CUDA_RETURN(cudaEventRecord(res.start, res.stream));
    RDEP_RETURN_IF_ERROR(Launch(p, res.stream));
    RDEP_CUDA_RETURN(cudaEventRecord(res.stop, res.stream));
    RDEP_CUDA_RETURN(cudaEventSynchronize(res.stop));
    float ms = 0;
    RDEP_CUDA_RETURN(cudaEventElapsedTime(&ms, res.start, res.stop));
    us.push_back(static_cast<double>(ms) * 1000.0);
    int64_t stamps[kNumPhaseStamps] = {};
    RDEP_CUDA_RETURN(cudaMemcpy(stamps, p.buf.phase, sizeof(stamps), cudaMemcpyDeviceToHost));
    const int64_t spans[7] = {stamps[1] - stamps[0], stamps[2] - stamps[1], stamps[3] - stamps[2], stamps[7] - stamps[3],
                              stamps[4] - stamps[3], stamps[5] - stamps[4], stamps[6] - stamps[4]};
    for (size_t k = 0; k < 7; ++k) phase_sum[k] += static_cast<double>(spans[k]);
  }
  int64_t err_flag = 0;
  RDEP_CUDA_RETURN(cudaMemcpy(&err_flag, p.buf.misc + 3, sizeof(err_flag), cudaMemcpyDeviceToHost));
  if (err_flag != 0) return InternalError("GPU planner: reroute found residual demand above residual quota");
  GpuPlannerTiming t;
  t.solve_us = Summarize(us);
  t.samples_us = us;
  t.config = p.cfg;
  for (double& c : phase_sum) c /= iters;
  t.phase_cycles = phase_sum;
  int dev = 0, khz = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) == cudaSuccess)
    t.clock_mhz = khz / 1000.0;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) t.device_name = prop.name;
  return t;
}

}  // namespace rdep
