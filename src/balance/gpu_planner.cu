// The GPU UltraEP quota planner (see gpu_planner.h): one thread block of 1024 threads, state in shared
// memory, bitwise the same plan as the host planner (quota_planner.cc). Any change to the oracle,
// tie-breaking or rounding there must be mirrored here; GpuPlanner.MatchesHost* checks it.
#include "rdep/balance/gpu_planner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>

namespace rdep {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 1024;  // a lane owns ranks lane + 32*j, j < 32: one bit of a uint32 dup mask

#define RDEP_CUDA_RETURN(expr)                                                                              \
  do {                                                                                                      \
    cudaError_t rdep_err_ = (expr);                                                                         \
    if (rdep_err_ != cudaSuccess) {                                                                         \
      (void)cudaGetLastError();                                                                             \
      return Status(StatusCode::kCudaError, std::string(#expr) + " failed at " + __FILE__ + ":" +           \
                                                std::to_string(__LINE__) + ": " + cudaGetErrorString(rdep_err_)); \
    }                                                                                                       \
  } while (0)

// Shared-memory layout, computed identically on host (for the size) and device (for the pointers).
// int64 arrays first (8-byte aligned), then int32 arrays.
struct Layout {
  // int64 offsets (in elements of int64)
  size_t lam, ell, slk, node_lo, node_hi, rec_amount, misc64, n64;
  // int32 offsets (in elements of int32, after the int64 block)
  size_t owner, rank_order, expert_first, expert_order, used, feas, rec_e, rec_t, rec_s, rep_first, rep_count,
      inst_off, misc32, stage, n32;
  // staged: the load matrix is copied into shared memory as int32 (entries < 2^31 checked on host).
  __host__ __device__ Layout(int R, int E, int S, int pw, bool staged) {
    const size_t r = static_cast<size_t>(R), e = static_cast<size_t>(E), rs = r * static_cast<size_t>(S);
    size_t o = 0;
    lam = o; o += e;
    ell = o; o += r;
    slk = o; o += static_cast<size_t>(pw) * r;
    node_lo = o; o += kWarps + 1;
    node_hi = o; o += kWarps + 1;
    rec_amount = o; o += rs;
    misc64 = o; o += 4;  // lo, hi, initial hi, unused
    n64 = o;
    o = 0;
    owner = o; o += e;
    rank_order = o; o += r;
    expert_first = o; o += r + 1;
    expert_order = o; o += e;
    used = o; o += static_cast<size_t>(pw) * r;
    feas = o; o += kWarps + 1;
    rec_e = o; o += rs;
    rec_t = o; o += rs;
    rec_s = o; o += rs;
    rep_first = o; o += e;
    rep_count = o; o += e;
    inst_off = o; o += e + 1;
    misc32 = o; o += 4;  // any feasible, num records, num probes, error
    stage = o; o += staged ? r * e : 0;
    n32 = o;
  }
  __host__ __device__ size_t bytes() const { return n64 * 8 + n32 * 4; }
};

struct KernelArgs {
  const int64_t* load;   // [R*E]
  const int32_t* owner;  // [E]
  int R, E, S, pw, staged;
  int64_t umin;
  int locality;
  int64_t* out_misc;        // [4]: tau, num transfers, num probes, error flag
  int32_t* tr_expert;       // [R*S]
  int32_t* tr_rank;         // [R*S]
  int32_t* tr_slot;         // [R*S]
  int64_t* tr_amount;       // [R*S]
  int32_t* inst_offsets;    // [E+1]
  int32_t* inst_expert;     // [I_max]
  int32_t* inst_rank;       // [I_max]
  int32_t* inst_slot;       // [I_max]
  int64_t* inst_quota;      // [I_max]
  int32_t* slot_expert;     // [R*S]
  int64_t* route;           // [R*I] with the plan's I (<= I_max = E + R*S)
  int64_t* scratch;         // [3*I_max]: residual quota, take, local rows per instance
};

struct Shared {
  int64_t *lam, *ell, *slk, *node_lo, *node_hi, *rec_amount, *misc64;
  int32_t *owner, *rank_order, *expert_first, *expert_order, *used, *feas, *rec_e, *rec_t, *rec_s, *rep_first,
      *rep_count, *inst_off, *misc32, *stage;
};

__device__ Shared Carve(char* base, const Layout& L) {
  Shared s;
  int64_t* b64 = reinterpret_cast<int64_t*>(base);
  int32_t* b32 = reinterpret_cast<int32_t*>(b64 + L.n64);
  s.lam = b64 + L.lam; s.ell = b64 + L.ell; s.slk = b64 + L.slk; s.node_lo = b64 + L.node_lo;
  s.node_hi = b64 + L.node_hi; s.rec_amount = b64 + L.rec_amount; s.misc64 = b64 + L.misc64;
  s.owner = b32 + L.owner; s.rank_order = b32 + L.rank_order; s.expert_first = b32 + L.expert_first;
  s.expert_order = b32 + L.expert_order; s.used = b32 + L.used; s.feas = b32 + L.feas; s.rec_e = b32 + L.rec_e;
  s.rec_t = b32 + L.rec_t; s.rec_s = b32 + L.rec_s; s.rep_first = b32 + L.rep_first; s.rep_count = b32 + L.rep_count;
  s.inst_off = b32 + L.inst_off; s.misc32 = b32 + L.misc32; s.stage = b32 + L.stage;
  return s;
}

// The greedy oracle for one threshold, run by one warp. slk/used are this warp's [R] arrays; lane l
// owns ranks l, l+32, ... (reads and writes only those, so no intra-warp sync is needed for them).
// When record is set, transfers go to the shared record arrays and their count to *num_rec.
__device__ bool WarpProbe(const Shared& s, int64_t tau, int R, int S, int64_t umin, int64_t* slk, int32_t* used,
                          bool record, int* num_rec) {
  const int lane = threadIdx.x & 31;
  for (int t = lane; t < R; t += 32) {
    const int64_t v = tau - s.ell[t];
    slk[t] = v > 0 ? v : 0;
    used[t] = 0;
  }
  __syncwarp();
  int nrec = 0;
  bool feasible = true;
  for (int ri = 0; ri < R; ++ri) {
    const int r = s.rank_order[ri];
    if (s.ell[r] <= tau) break;
    int64_t exc = s.ell[r] - tau;
    for (int k = s.expert_first[r]; k < s.expert_first[r + 1] && exc > 0; ++k) {
      const int e = s.expert_order[k];
      int64_t cap = s.lam[e];
      unsigned dupmask = 0;  // bit j: rank lane + 32*j already hosts e
      while (exc > 0 && cap > 0) {
        long long best_s = 0;
        int best_t = INT_MAX;
        int j = 0;
        for (int t = lane; t < R; t += 32, ++j) {
          if (slk[t] > best_s && used[t] < S && t != r && !((dupmask >> j) & 1u)) {
            best_s = slk[t];
            best_t = t;
          }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          const long long os = __shfl_xor_sync(0xffffffffu, best_s, off);
          const int ot = __shfl_xor_sync(0xffffffffu, best_t, off);
          if (os > best_s || (os == best_s && ot < best_t)) {
            best_s = os;
            best_t = ot;
          }
        }
        if (best_t == INT_MAX) break;
        int64_t d = exc > umin ? exc : umin;  // shed at least u_min (same as the host oracle)
        d = d < best_s ? d : static_cast<int64_t>(best_s);
        d = d < cap ? d : cap;
        if (d < umin) break;
        if ((best_t & 31) == lane) {
          if (record) {
            s.rec_e[nrec] = e;
            s.rec_t[nrec] = best_t;
            s.rec_s[nrec] = used[best_t];
            s.rec_amount[nrec] = d;
          }
          slk[best_t] -= d;
          used[best_t] += 1;
          dupmask |= 1u << (best_t >> 5);
        }
        ++nrec;
        exc = exc > d ? exc - d : 0;
        cap -= d;
        __syncwarp();
      }
    }
    if (exc > 0) {
      feasible = false;
      break;
    }
  }
  if (record) *num_rec = nrec;
  return feasible;
}

__global__ void __launch_bounds__(kThreads, 1) QuotaPlanKernel(KernelArgs a) {
  extern __shared__ __align__(16) char smem[];
  const Layout L(a.R, a.E, a.S, a.pw, a.staged != 0);
  const Shared s = Carve(smem, L);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int R = a.R, E = a.E;
  // Phase 0: stage the load matrix (row-major [R][E]) into shared memory when it fits.
  if (a.staged) {
    for (size_t k = tid; k < static_cast<size_t>(R) * E; k += kThreads) s.stage[k] = static_cast<int32_t>(a.load[k]);
    __syncthreads();
  }
  auto ld = [&](int r, int e) -> int64_t {
    const size_t k = static_cast<size_t>(r) * E + e;
    return a.staged ? static_cast<int64_t>(s.stage[k]) : a.load[k];
  };

  // Phase 1: expert loads, rank loads, the static visiting orders.
  for (int e = tid; e < E; e += kThreads) {
    s.owner[e] = a.owner[e];
    int64_t sum = 0;
    for (int r = 0; r < R; ++r) sum += ld(r, e);
    s.lam[e] = sum;
  }
  __syncthreads();
  for (int r = tid; r <= R; r += kThreads) {
    int64_t sum = 0;
    int before = 0;
    for (int e = 0; e < E; ++e) {
      if (s.owner[e] == r) sum += s.lam[e];
      if (s.owner[e] < r) ++before;
    }
    if (r < R) s.ell[r] = sum;
    s.expert_first[r] = before;
  }
  __syncthreads();
  for (int r = tid; r < R; r += kThreads) {
    int pos = 0;
    for (int q = 0; q < R; ++q) pos += (s.ell[q] > s.ell[r] || (s.ell[q] == s.ell[r] && q < r)) ? 1 : 0;
    s.rank_order[pos] = r;
  }
  for (int e = tid; e < E; e += kThreads) {
    const int o = s.owner[e];
    int pos = s.expert_first[o];
    for (int f = 0; f < E; ++f)
      if (s.owner[f] == o && (s.lam[f] > s.lam[e] || (s.lam[f] == s.lam[e] && f < e))) ++pos;
    s.expert_order[pos] = e;
  }
  if (tid == 0) {
    int64_t total = 0, hi = 0;
    for (int r = 0; r < R; ++r) {
      total += s.ell[r];
      hi = s.ell[r] > hi ? s.ell[r] : hi;
    }
    s.misc64[0] = (total + R - 1) / R;  // lo
    s.misc64[1] = hi;
    s.misc64[2] = hi;
    s.misc32[0] = 0;  // any feasible
    s.misc32[1] = 0;  // records
    s.misc32[2] = 0;  // probes
    s.misc32[3] = 0;  // error
  }
  __syncthreads();

  // Phase 2: speculative binary search. Node n (1-based heap order) holds the interval the host's
  // binary search would have after the decisions on its path; left child = feasible (hi = tau).
  while (true) {
    if (tid == 0) {
      s.node_lo[1] = s.misc64[0];
      s.node_hi[1] = s.misc64[1];
      for (int n = 2; n <= a.pw; ++n) {
        const int64_t plo = s.node_lo[n / 2], phi = s.node_hi[n / 2];
        if (plo < phi) {
          const int64_t tau = plo + (phi - plo) / 2;
          s.node_lo[n] = (n & 1) ? tau + 1 : plo;
          s.node_hi[n] = (n & 1) ? phi : tau;
        } else {
          s.node_lo[n] = plo;
          s.node_hi[n] = phi;
        }
      }
    }
    __syncthreads();
    if (s.misc64[0] >= s.misc64[1]) break;
    if (warp < a.pw) {
      const int n = warp + 1;
      const int64_t lo = s.node_lo[n], hi = s.node_hi[n];
      if (lo < hi) {
        const bool f = WarpProbe(s, lo + (hi - lo) / 2, R, a.S, a.umin, s.slk + static_cast<size_t>(warp) * R,
                                 s.used + static_cast<size_t>(warp) * R, false, nullptr);
        if (lane == 0) s.feas[n] = f ? 1 : 0;
      }
    }
    __syncthreads();
    if (tid == 0) {
      int64_t lo = s.misc64[0], hi = s.misc64[1];
      int n = 1;
      while (n <= a.pw && lo < hi) {
        const int64_t tau = lo + (hi - lo) / 2;
        s.misc32[2] += 1;
        if (s.feas[n]) {
          hi = tau;
          s.misc32[0] = 1;
          n = 2 * n;
        } else {
          lo = tau + 1;
          n = 2 * n + 1;
        }
      }
      s.misc64[0] = lo;
      s.misc64[1] = hi;
    }
    __syncthreads();
  }

  // Phase 3: warp 0 re-runs the solved threshold and records its transfers.
  if (warp == 0 && s.misc32[0]) {
    int nrec = 0;
    WarpProbe(s, s.misc64[1], R, a.S, a.umin, s.slk, s.used, true, &nrec);
    if (lane == 0) s.misc32[1] = nrec;
  }
  __syncthreads();
  const int nrec = s.misc32[1];
  if (tid == 0) {
    a.out_misc[0] = s.misc64[1];
    a.out_misc[1] = nrec;
    a.out_misc[2] = s.misc32[2];
  }
  for (int k = tid; k < nrec; k += kThreads) {
    a.tr_expert[k] = s.rec_e[k];
    a.tr_rank[k] = s.rec_t[k];
    a.tr_slot[k] = s.rec_s[k];
    a.tr_amount[k] = s.rec_amount[k];
  }
  for (int k = tid; k < R * a.S; k += kThreads) a.slot_expert[k] = -1;
  for (int e = tid; e < E; e += kThreads) {
    int first = -1, count = 0;
    for (int k = 0; k < nrec; ++k)
      if (s.rec_e[k] == e) {
        if (first < 0) first = k;
        ++count;
      }
    s.rep_first[e] = first;
    s.rep_count[e] = count;
  }
  __syncthreads();
  if (tid == 0) {
    s.inst_off[0] = 0;
    for (int e = 0; e < E; ++e) s.inst_off[e + 1] = s.inst_off[e] + 1 + s.rep_count[e];
  }
  __syncthreads();
  const int I = s.inst_off[E];
  for (size_t k = tid; k < static_cast<size_t>(R) * I; k += kThreads) a.route[k] = 0;
  for (int e = tid; e <= E; e += kThreads) a.inst_offsets[e] = s.inst_off[e];
  __syncthreads();

  // Phase 4: instance tables and the locality reroute, one thread per expert (same math as
  // SolveReroute: locality, then per source floor + largest remainder over the residual quotas).
  int64_t* ru_all = a.scratch;
  const size_t imax = static_cast<size_t>(E) + static_cast<size_t>(R) * a.S;
  int64_t* take_all = a.scratch + imax;
  int64_t* local_all = a.scratch + 2 * imax;
  for (int e = tid; e < E; e += kThreads) {
    const int b = s.inst_off[e], k = 1 + s.rep_count[e], f = s.rep_first[e];
    int64_t moved = 0;
    for (int c = 0; c < k - 1; ++c) moved += s.rec_amount[f + c];
    a.inst_expert[b] = e;
    a.inst_rank[b] = s.owner[e];
    a.inst_slot[b] = -1;
    a.inst_quota[b] = s.lam[e] - moved;
    for (int c = 0; c < k - 1; ++c) {
      a.inst_expert[b + 1 + c] = e;
      a.inst_rank[b + 1 + c] = s.rec_t[f + c];
      a.inst_slot[b + 1 + c] = s.rec_s[f + c];
      a.inst_quota[b + 1 + c] = s.rec_amount[f + c];
      a.slot_expert[s.rec_t[f + c] * a.S + s.rec_s[f + c]] = e;
    }
    if (k == 1) {
      for (int r = 0; r < R; ++r) a.route[static_cast<size_t>(r) * I + b] = ld(r, e);
      continue;
    }
    auto host = [&](int i) { return i == 0 ? s.owner[e] : s.rec_t[f + i - 1]; };
    auto quota = [&](int i) { return i == 0 ? s.lam[e] - moved : s.rec_amount[f + i - 1]; };
    int64_t* ru = ru_all + b;
    int64_t* take = take_all + b;
    int64_t* local = local_all + b;
    int64_t D = 0;
    for (int i = 0; i < k; ++i) {
      int64_t l = 0;
      if (a.locality) {
        const int64_t lr = ld(host(i), e), q = quota(i);
        l = lr < q ? lr : q;
      }
      local[i] = l;
      a.route[static_cast<size_t>(host(i)) * I + b + i] = l;
      ru[i] = quota(i) - l;
      D += ru[i];
    }
    for (int r = 0; r < R; ++r) {
      int64_t d = ld(r, e);
      for (int i = 0; i < k; ++i)
        if (host(i) == r) d -= local[i];
      if (d == 0) continue;
      if (D <= 0) {
        a.out_misc[3] = 1;
        break;
      }
      int64_t sum = 0;
      for (int i = 0; i < k; ++i) sum += d * ru[i] / D;
      const int64_t left = d - sum;
      for (int i = 0; i < k; ++i) {
        const int64_t ri = d * ru[i] % D;
        int64_t ahead = 0;
        for (int j2 = 0; j2 < k; ++j2) {
          const int64_t rj = d * ru[j2] % D;
          if (rj > ri || (rj == ri && j2 < i)) ++ahead;
        }
        take[i] = d * ru[i] / D + (ahead < left ? 1 : 0);
      }
      for (int i = 0; i < k; ++i) {
        a.route[static_cast<size_t>(r) * I + b + i] += take[i];
        ru[i] -= take[i];
      }
      D -= d;
    }
  }
}

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
  int64_t *route = nullptr, *scratch = nullptr;
  ~DeviceBuffers() {
    for (void* p : {static_cast<void*>(load), static_cast<void*>(owner), static_cast<void*>(misc),
                    static_cast<void*>(tr_expert), static_cast<void*>(tr_rank), static_cast<void*>(tr_slot),
                    static_cast<void*>(tr_amount), static_cast<void*>(inst_offsets), static_cast<void*>(inst_expert),
                    static_cast<void*>(inst_rank), static_cast<void*>(inst_slot), static_cast<void*>(inst_quota),
                    static_cast<void*>(slot_expert), static_cast<void*>(route), static_cast<void*>(scratch)})
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
  for (int pw = 31; pw >= 1; pw = (pw - 1) / 2) {  // 31, 15, 7, 3, 1 warps: 5..1 levels per round
    for (bool staged : {true, false}) {
      if (staged && !stage_ok) continue;
      const size_t bytes = Layout(num_ranks, num_experts, num_slots, pw, staged).bytes();
      if (bytes <= static_cast<size_t>(optin)) return GpuPlannerConfig{bytes, pw, staged};
    }
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

Status Prepare(const std::vector<int64_t>& load, const OwnershipMap& owners, const QuotaConfig& config,
               Prepared* p) {
  RDEP_RETURN_IF_ERROR(ValidateLoad(load, owners));
  RDEP_RETURN_IF_ERROR(config.Validate(owners.num_experts()));
  std::string why;
  if (!GpuPlannerAvailable(&why)) return Unavailable("GPU planner: " + why);
  p->R = owners.num_ranks();
  p->E = owners.num_experts();
  p->S = config.num_slots;
  bool fits32 = true;
  for (int64_t v : load) fits32 = fits32 && v <= INT32_MAX;
  RDEP_ASSIGN_OR_RETURN(p->cfg, ChooseConfig(p->E, p->R, p->S, fits32));
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
  RDEP_RETURN_IF_ERROR(Alloc(&b.scratch, 3 * imax));
  RDEP_CUDA_RETURN(cudaMemcpy(b.load, load.data(), R * E * sizeof(int64_t), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN(cudaMemcpy(b.owner, owners.owners().data(), E * sizeof(int32_t), cudaMemcpyHostToDevice));
  RDEP_CUDA_RETURN(cudaMemset(b.misc, 0, 4 * sizeof(int64_t)));
  RDEP_CUDA_RETURN(cudaFuncSetAttribute(QuotaPlanKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(p->cfg.shared_bytes)));
  KernelArgs& a = p->args;
  a.load = b.load;
  a.owner = b.owner;
  a.R = p->R;
  a.E = p->E;
  a.S = p->S;
  a.pw = p->cfg.probe_warps;
  a.staged = p->cfg.staged_load ? 1 : 0;
  a.umin = config.min_quota;
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
  a.scratch = b.scratch;
  return Status::Ok();
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


StatusOr<BalancePlan> SolveQuotaPlanGpu(const std::vector<int64_t>& load, const OwnershipMap& owners,
                                        const QuotaConfig& config) {
  Prepared p;
  RDEP_RETURN_IF_ERROR(Prepare(load, owners, config, &p));
  RDEP_RETURN_IF_ERROR(Launch(p, nullptr));
  RDEP_CUDA_RETURN(cudaDeviceSynchronize());
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
  RDEP_CUDA_RETURN(cudaMemcpy(plan.route.data(), p.buf.route, R * I * 8, cudaMemcpyDeviceToHost));
  return plan;
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
  std::vector<double> us;
  for (int32_t i = 0; i < iters; ++i) {
    RDEP_CUDA_RETURN(cudaEventRecord(res.start, res.stream));
    RDEP_RETURN_IF_ERROR(Launch(p, res.stream));
    RDEP_CUDA_RETURN(cudaEventRecord(res.stop, res.stream));
    RDEP_CUDA_RETURN(cudaEventSynchronize(res.stop));
    float ms = 0;
    RDEP_CUDA_RETURN(cudaEventElapsedTime(&ms, res.start, res.stop));
    us.push_back(static_cast<double>(ms) * 1000.0);
  }
  int64_t err_flag = 0;
  RDEP_CUDA_RETURN(cudaMemcpy(&err_flag, p.buf.misc + 3, sizeof(err_flag), cudaMemcpyDeviceToHost));
  if (err_flag != 0) return InternalError("GPU planner: reroute found residual demand above residual quota");
  GpuPlannerTiming t;
  t.solve_us = Summarize(us);
  t.samples_us = us;
  t.config = p.cfg;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) t.device_name = prop.name;
  return t;
}

}  // namespace rdep
