// The expert MLP's host side: shape checks, the per-expert GEMM plans (cuBLASLt descriptors and the
// heuristic's algorithm, cached per (GEMM, row count)), the stream fan-out, and the grouped-GEMM path.
//
// Every GEMM here is row-major C[M][N] = op(A)[M][K] . op(B)[K][N]. cuBLAS is column-major, so each is
// issued as C^T = op(B)^T . op(A)^T: cuBLAS's "A" is our B, its "B" is our A, m = N, n = M.
//
// The six GEMMs, for expert e with m rows starting at row off (x_e = x + off*H, and so on):
//   kFwd1  h_e  [m][2F] = x_e [m][H]   . W1_e [H][2F]
//   kFwd2  y_e  [m][H]  = z_e [m][F]   . W2_e [F][H]
//   kDz    dz_e [m][F]  = dout_e[m][H] . W2_e^T          (W2_e stored [F][H])
//   kDx    dx_e [m][H]  = dh_e [m][2F] . W1_e^T          (W1_e stored [H][2F])
//   kDw2   dW2_e[F][H]  = z_e^T . dout_e    (z_e stored [m][F]),  fp32 out, K = m
//   kDw1   dW1_e[H][2F] = x_e^T . dh_e      (x_e stored [m][H]),  fp32 out, K = m
#include "rdep/experts/expert_mlp.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "experts/expert_mlp_kernels.cuh"
#include "launch/pdl.h"
#include "rdep/cuda/check.h"

namespace rdep::kernels {
namespace {

Status CublasStatus(cublasStatus_t s, const char* expr, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Status(StatusCode::kCudaError, std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
                                            cublasGetStatusName(s) + " (" + cublasGetStatusString(s) + ")");
}
#define RDEP_CUBLAS_RETURN_IF_ERROR(expr) RDEP_RETURN_IF_ERROR(CublasStatus((expr), #expr, __FILE__, __LINE__))

// A launcher of expert_mlp_kernels.cu; with RDEP_DEBUG_SYNC also synchronizes (RDEP_CUDA_CHECK_LAUNCH). A bad
// RDEP_PDL is named first (the launchers return a bare cudaErrorInvalidValue for it).
#define RDEP_LAUNCH(expr)                                      \
  do {                                                         \
    RDEP_RETURN_IF_ERROR(::rdep::cuda::CheckPdlSetting());     \
    RDEP_CUDA_RETURN_IF_ERROR(expr);                           \
    RDEP_CUDA_CHECK_LAUNCH();                                  \
  } while (0)

// kDw2b, kDw1b: the weight gradients written as bf16 (fp32 accumulation inside the GEMM, one rounding).
enum GemmKind : int { kFwd1 = 0, kFwd2, kDz, kDx, kDw2, kDw1, kDw2b, kDw1b, kNumKinds };
const char* const kKindNames[kNumKinds] = {"fwd1", "fwd2", "dz", "dx", "dw2", "dw1", "dw2(bf16)", "dw1(bf16)"};

// A row-major GEMM C[M][N] = op(A) . op(B) with leading dimensions (elements) of the stored matrices.
struct RowGemm {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  cudaDataType_t c_type = CUDA_R_16BF;
};

RowGemm Describe(GemmKind kind, int64_t m, int64_t H, int64_t F) {
  switch (kind) {
    case kFwd1: return {false, false, m, 2 * F, H, H, 2 * F, 2 * F, CUDA_R_16BF};
    case kFwd2: return {false, false, m, H, F, F, H, H, CUDA_R_16BF};
    case kDz: return {false, true, m, F, H, H, H, F, CUDA_R_16BF};
    case kDx: return {false, true, m, H, 2 * F, 2 * F, 2 * F, H, CUDA_R_16BF};
    case kDw2: return {true, false, F, H, m, F, H, H, CUDA_R_32F};
    case kDw1: return {true, false, H, 2 * F, m, H, 2 * F, 2 * F, CUDA_R_32F};
    case kDw2b: return {true, false, F, H, m, F, H, H, CUDA_R_16BF};
    case kDw1b: return {true, false, H, 2 * F, m, H, 2 * F, 2 * F, CUDA_R_16BF};
    default: return {};
  }
}

// One cached cuBLASLt matmul: descriptors and the heuristic's first algorithm.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

void DestroyPlan(LtPlan& p) {
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  p = {};
}

// Switches to `device` for the scope when it is not current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) {
      if (cudaSetDevice(device) == cudaSuccess) switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

Status ExpertMlpDesc::Validate() const {
  std::ostringstream os;
  os << *this;
  if (num_experts <= 0) return InvalidArgument("ExpertMlpDesc: num_experts must be positive: " + os.str());
  if (hidden <= 0 || ffn <= 0) return InvalidArgument("ExpertMlpDesc: hidden and ffn must be positive: " + os.str());
  if (hidden % 8 != 0 || ffn % 8 != 0)
    return InvalidArgument("ExpertMlpDesc: hidden and ffn must be multiples of 8 (16-byte rows): " + os.str());
  if (max_rows < 0) return InvalidArgument("ExpertMlpDesc: max_rows must be >= 0: " + os.str());
  if (gate_up != mlp::GateUp::kSplit && gate_up != mlp::GateUp::kInterleaved8)
    return InvalidArgument("ExpertMlpDesc: gate_up must be kSplit or kInterleaved8: " + os.str());
  if (max_rows > (int64_t{1} << 31) - 1 || 2 * ffn > (int64_t{1} << 31) - 1)
    return InvalidArgument("ExpertMlpDesc: dimensions must fit in int32: " + os.str());
  return Status::Ok();
}

std::ostream& operator<<(std::ostream& os, const ExpertMlpDesc& d) {
  return os << "ExpertMlpDesc{E_loc=" << d.num_experts << " H=" << d.hidden << " F=" << d.ffn
            << " max_rows=" << d.max_rows << " gate_up=" << mlp::GateUpName(d.gate_up) << "}";
}

const char* GemmPathName(GemmPath p) {
  switch (p) {
    case GemmPath::kAuto: return "auto";
    case GemmPath::kLtPerExpert: return "lt";
    case GemmPath::kGrouped: return "grouped";
  }
  return "?";
}

std::ostream& operator<<(std::ostream& os, const ExpertMlpConfig& c) {
  return os << "ExpertMlpConfig{path=" << GemmPathName(c.path) << " streams=" << c.num_streams
            << " lt_workspace=" << c.lt_workspace_bytes << "}";
}

struct ExpertMlp::Impl {
  ExpertMlpDesc desc;
  ExpertMlpConfig config;
  int device = 0;
  bool Interleaved() const { return desc.gate_up == mlp::GateUp::kInterleaved8; }
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  // Fan-out streams: slot 0 is the caller's stream, slots 1.. are ours.
  std::vector<cudaStream_t> side;
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> join;
  // Device memory, one allocation carved into:
  //   z   [max_rows][F]  bf16   (forward activation; recomputed in backward)
  //   dz  [max_rows][F]  bf16
  //   dh  [max_rows][2F] bf16
  //   lt workspace       [num_slots][lt_workspace_bytes]
  //   pointer tables     [kNumKinds][3][kMaxGroups] void*   (grouped path)
  char* mem = nullptr;
  size_t mem_bytes = 0;
  __nv_bfloat16 *z = nullptr, *dz = nullptr, *dh = nullptr;
  char* lt_ws = nullptr;
  void** tables = nullptr;
  std::unordered_map<uint64_t, LtPlan> plans;
  // Host scratch sized at Create (no allocation per call).
  std::vector<int64_t> offsets;  // [E+1]
  std::vector<int> order;        // experts by descending rows
  std::vector<int64_t> slot_load;
  std::vector<int> slot_of;      // expert -> stream slot

  ~Impl() {
    for (auto& [key, plan] : plans) DestroyPlan(plan);
    for (cudaStream_t s : side) cudaStreamDestroy(s);
    for (cudaEvent_t e : join) cudaEventDestroy(e);
    if (fork) cudaEventDestroy(fork);
    if (mem) cudaFree(mem);
    if (lt) cublasLtDestroy(lt);
    if (blas) cublasDestroy(blas);
  }

  int num_slots() const { return std::max(1, config.num_streams); }
  bool has_grouped() const { return config.path != GemmPath::kLtPerExpert; }
  // The path of this call (offsets filled by CheckCall).
  bool UseGrouped(const int64_t* rows) const {
    if (config.path != GemmPath::kAuto) return config.path == GemmPath::kGrouped;
    int64_t nonempty = 0;
    for (int64_t e = 0; e < desc.num_experts; ++e) nonempty += rows[e] > 0;
    return offsets.back() < kAutoGroupedMaxMeanRows * nonempty;
  }

  StatusOr<const LtPlan*> Plan(GemmKind kind, int64_t m) {
    const uint64_t key = (static_cast<uint64_t>(kind) << 40) | static_cast<uint64_t>(m);
    auto it = plans.find(key);
    if (it != plans.end()) return &it->second;
    const RowGemm g = Describe(kind, m, desc.hidden, desc.ffn);
    LtPlan p;
    Status st = BuildPlan(g, &p);
    if (!st.ok()) {
      DestroyPlan(p);
      return Status(st.code(), std::string("expert MLP GEMM ") + kKindNames[kind] + " (rows " + std::to_string(m) +
                                   "): " + st.message());
    }
    return &plans.emplace(key, p).first->second;
  }

  Status BuildPlan(const RowGemm& g, LtPlan* p) {
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // cuBLAS "A" = our B, cuBLAS "B" = our A (see the file head).
    const cublasOperation_t ta = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
    // Stored our-B: row-major [K][N] (col-major N x K) or, transposed, [N][K] (col-major K x N).
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, g.trans_b ? u(g.K) : u(g.N),
                                                           g.trans_b ? u(g.N) : u(g.K), g.ldb));
    // Stored our-A: row-major [M][K] (col-major K x M) or, transposed, [K][M] (col-major M x K).
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, g.trans_a ? u(g.M) : u(g.K),
                                                           g.trans_a ? u(g.K) : u(g.M), g.lda));
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&p->c, g.c_type, u(g.N), u(g.M), g.ldc));
    cublasLtMatmulPreference_t pref = nullptr;
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = config.lt_workspace_bytes;
    cublasStatus_t s =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulAlgoGetHeuristic(lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    RDEP_CUBLAS_RETURN_IF_ERROR(s);
    if (found == 0) return Unavailable("cuBLASLt has no algorithm for this GEMM");
    p->algo = result.algo;
    return Status::Ok();
  }

  // Runs GEMM `kind` for expert e on `stream` with workspace slot `slot`. a, b: our A and B; c: output.
  Status RunLt(GemmKind kind, int64_t m, const void* a, const void* b, void* c, float beta, int slot,
               cudaStream_t stream) {
    RDEP_ASSIGN_OR_RETURN(const LtPlan* p, Plan(kind, m));
    const float alpha = 1.0f;
    void* ws = lt_ws + static_cast<size_t>(slot) * config.lt_workspace_bytes;
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(lt, p->op, &alpha, b, p->a, a, p->b, &beta, c, p->c, c, p->c,
                                               &p->algo, ws, config.lt_workspace_bytes, stream));
    return Status::Ok();
  }

  Status CheckCall(const int64_t* rows_per_expert, std::initializer_list<const void*> ptrs) {
    if (rows_per_expert == nullptr) return InvalidArgument("ExpertMlp: rows_per_expert (a host array) is null");
    int64_t total = 0;
    offsets[0] = 0;
    for (int64_t e = 0; e < desc.num_experts; ++e) {
      if (rows_per_expert[e] < 0)
        return InvalidArgument("ExpertMlp: rows_per_expert[" + std::to_string(e) + "] is negative");
      total += rows_per_expert[e];
      offsets[static_cast<size_t>(e) + 1] = total;
    }
    if (total > desc.max_rows)
      return InvalidArgument("ExpertMlp: " + std::to_string(total) + " rows exceed max_rows " +
                             std::to_string(desc.max_rows));
    for (const void* q : ptrs) {
      if (total > 0 && q == nullptr) return InvalidArgument("ExpertMlp: a null tensor pointer");
      if (!Aligned16(q)) return InvalidArgument("ExpertMlp: tensor pointers must be 16-byte aligned");
    }
    return Status::Ok();
  }

  // Assigns non-empty experts to stream slots, largest first onto the least-loaded slot, and forks the
  // side streams off `stream`. Returns the number of slots used.
  Status Fork(const int64_t* rows, cudaStream_t stream, int* used) {
    const int S = num_slots();
    const int E = static_cast<int>(desc.num_experts);
    for (int e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return rows[a] > rows[b]; });
    std::fill(slot_load.begin(), slot_load.end(), 0);
    int nonempty = 0;
    for (int e : order) {
      if (rows[e] == 0) {
        slot_of[static_cast<size_t>(e)] = -1;
        continue;
      }
      ++nonempty;
      const auto best = std::min_element(slot_load.begin(), slot_load.end()) - slot_load.begin();
      slot_of[static_cast<size_t>(e)] = static_cast<int>(best);
      slot_load[static_cast<size_t>(best)] += rows[e];
    }
    *used = std::min(S, nonempty);
    if (*used > 1) {
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork, stream));
      for (int s = 1; s < *used; ++s) RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side[static_cast<size_t>(s - 1)], fork, 0));
    }
    return Status::Ok();
  }

  Status Join(int used, cudaStream_t stream) {
    for (int s = 1; s < used; ++s) {
      RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(join[static_cast<size_t>(s - 1)], side[static_cast<size_t>(s - 1)]));
      RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, join[static_cast<size_t>(s - 1)], 0));
    }
    return Status::Ok();
  }

  cudaStream_t SlotStream(int slot, cudaStream_t stream) const {
    return slot == 0 ? stream : side[static_cast<size_t>(slot - 1)];
  }

  // Grouped path: one cublasGemmGroupedBatchedEx over the non-empty experts for a bf16-output GEMM.
  // a_base/b_base/c_base with per-expert and per-row byte strides (0 for none).
  struct Operand {
    const void* base;
    int64_t expert_stride, row_stride;  // bytes
  };
  Status RunGrouped(GemmKind kind, const int64_t* rows, Operand A, Operand B, Operand C, cudaStream_t stream) {
    internal::GroupPointerParams pp{};
    int G = 0;
    for (int64_t e = 0; e < desc.num_experts; ++e) {
      if (rows[e] == 0) continue;
      pp.expert[G] = static_cast<int>(e);
      pp.row_offset[G] = offsets[static_cast<size_t>(e)];
      ++G;
    }
    if (G == 0) return Status::Ok();
    pp.num_groups = G;
    // cuBLAS operand order: its A = our B, its B = our A.
    const Operand ops[3] = {B, A, C};
    for (int o = 0; o < 3; ++o) {
      pp.base[o] = static_cast<const char*>(ops[o].base);
      pp.expert_stride[o] = ops[o].expert_stride;
      pp.row_stride[o] = ops[o].row_stride;
    }
    void** table = tables + static_cast<size_t>(kind) * 3 * internal::kMaxGroups;
    RDEP_LAUNCH(internal::LaunchFillGroupPointers(pp, table, stream));
    // Host arrays per group (group_size 1 each: row counts differ).
    cublasOperation_t ta[internal::kMaxGroups], tb[internal::kMaxGroups];
    int m[internal::kMaxGroups], n[internal::kMaxGroups], k[internal::kMaxGroups];
    int lda[internal::kMaxGroups], ldb[internal::kMaxGroups], ldc[internal::kMaxGroups], gs[internal::kMaxGroups];
    float alpha[internal::kMaxGroups], beta[internal::kMaxGroups];
    for (int g = 0; g < G; ++g) {
      const RowGemm d = Describe(kind, rows[pp.expert[g]], desc.hidden, desc.ffn);
      ta[g] = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
      tb[g] = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
      m[g] = static_cast<int>(d.N);
      n[g] = static_cast<int>(d.M);
      k[g] = static_cast<int>(d.K);
      lda[g] = static_cast<int>(d.ldb);
      ldb[g] = static_cast<int>(d.lda);
      ldc[g] = static_cast<int>(d.ldc);
      gs[g] = 1;
      alpha[g] = 1.0f;
      beta[g] = 0.0f;
    }
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas, stream));
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(blas, lt_ws, config.lt_workspace_bytes));
    RDEP_CUBLAS_RETURN_IF_ERROR(cublasGemmGroupedBatchedEx(
        blas, ta, tb, m, n, k, alpha, reinterpret_cast<const void* const*>(table), CUDA_R_16BF, lda,
        reinterpret_cast<const void* const*>(table + G), CUDA_R_16BF, ldb, beta, table + 2 * G, CUDA_R_16BF, ldc, G,
        gs, CUBLAS_COMPUTE_32F));
    return Status::Ok();
  }
};

namespace {
// The one device allocation of an ExpertMlp, by part (256-byte aligned).
struct Layout {
  size_t z = 0, dz = 0, dh = 0, ws = 0, tables = 0;
  size_t total() const { return z + dz + dh + ws + tables; }
};
Layout MemoryLayout(const ExpertMlpDesc& desc, const ExpertMlpConfig& config) {
  const auto align = [](size_t v) { return (v + 255) & ~size_t{255}; };
  const size_t rows = static_cast<size_t>(desc.max_rows), F = static_cast<size_t>(desc.ffn);
  const bool grouped = config.path != GemmPath::kLtPerExpert;
  const auto slots = static_cast<size_t>(std::max(1, config.num_streams));  // Impl::num_slots
  Layout l;
  l.z = align(rows * F * 2);
  l.dz = l.z;
  l.dh = align(rows * 2 * F * 2);
  l.ws = slots * config.lt_workspace_bytes;
  l.tables = grouped ? align(sizeof(void*) * kNumKinds * 3 * internal::kMaxGroups) : 0;
  return l;
}
}  // namespace

size_t ExpertMlp::WorkspaceBytes(const ExpertMlpDesc& desc, const ExpertMlpConfig& config) {
  return MemoryLayout(desc, config).total();
}

ExpertMlp::ExpertMlp(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ExpertMlp::~ExpertMlp() = default;
size_t ExpertMlp::workspace_bytes() const { return impl_->mem_bytes; }
const ExpertMlpDesc& ExpertMlp::desc() const { return impl_->desc; }
const ExpertMlpConfig& ExpertMlp::config() const { return impl_->config; }

StatusOr<std::unique_ptr<ExpertMlp>> ExpertMlp::Create(const ExpertMlpDesc& desc, int device,
                                                       const ExpertMlpConfig& config) {
  RDEP_RETURN_IF_ERROR(desc.Validate());
  if (config.num_streams < 1 || config.num_streams > 16)
    return InvalidArgument("ExpertMlpConfig: num_streams must be in [1, 16]");
  if (config.lt_workspace_bytes % 256 != 0)
    return InvalidArgument("ExpertMlpConfig: lt_workspace_bytes must be a multiple of 256");
  if (config.path != GemmPath::kLtPerExpert && desc.num_experts > internal::kMaxGroups)
    return InvalidArgument("ExpertMlp: the grouped path supports at most " + std::to_string(internal::kMaxGroups) +
                           " local experts");
  if (device < 0 || device >= cuda::DeviceCount()) return Unavailable("ExpertMlp: no CUDA device " + std::to_string(device));
  DeviceGuard guard(device);
  auto impl = std::make_unique<Impl>();
  impl->desc = desc;
  impl->config = config;
  impl->device = device;
  RDEP_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&impl->lt));
  if (impl->has_grouped()) RDEP_CUBLAS_RETURN_IF_ERROR(cublasCreate(&impl->blas));
  const int S = impl->num_slots();
  for (int s = 1; s < S; ++s) {
    cudaStream_t st = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    impl->side.push_back(st);
    cudaEvent_t ev = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    impl->join.push_back(ev);
  }
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&impl->fork, cudaEventDisableTiming));
  const Layout lay = MemoryLayout(desc, config);
  const size_t z_bytes = lay.z, dz_bytes = lay.dz, dh_bytes = lay.dh, ws_bytes = lay.ws, table_bytes = lay.tables;
  impl->mem_bytes = lay.total();
  RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->mem, std::max<size_t>(impl->mem_bytes, 256)));
  char* p = impl->mem;
  impl->z = reinterpret_cast<__nv_bfloat16*>(p);
  p += z_bytes;
  impl->dz = reinterpret_cast<__nv_bfloat16*>(p);
  p += dz_bytes;
  impl->dh = reinterpret_cast<__nv_bfloat16*>(p);
  p += dh_bytes;
  impl->lt_ws = p;
  p += ws_bytes;
  impl->tables = table_bytes ? reinterpret_cast<void**>(p) : nullptr;
  const size_t E = static_cast<size_t>(desc.num_experts);
  impl->offsets.assign(E + 1, 0);
  impl->order.assign(E, 0);
  impl->slot_of.assign(E, -1);
  impl->slot_load.assign(static_cast<size_t>(S), 0);
  return std::unique_ptr<ExpertMlp>(new ExpertMlp(std::move(impl)));
}

Status ExpertMlp::Forward(const __nv_bfloat16* x, const int64_t* rows_per_expert, const __nv_bfloat16* w1,
                          const __nv_bfloat16* w2, __nv_bfloat16* h, __nv_bfloat16* y, cudaStream_t stream) {
  Impl& I = *impl_;
  RDEP_RETURN_IF_ERROR(I.CheckCall(rows_per_expert, {x, w1, w2, h, y}));
  const int64_t H = I.desc.hidden, F = I.desc.ffn, E = I.desc.num_experts;
  const int64_t M = I.offsets[static_cast<size_t>(E)];
  if (M == 0) return Status::Ok();
  DeviceGuard guard(I.device);
  const int64_t kB = 2;  // bytes per bf16
  if (I.UseGrouped(rows_per_expert)) {
    RDEP_RETURN_IF_ERROR(I.RunGrouped(kFwd1, rows_per_expert, {x, 0, H * kB}, {w1, H * 2 * F * kB, 0}, {h, 0, 2 * F * kB}, stream));
    RDEP_LAUNCH(internal::LaunchSwigluForward(h, I.z, M, F, stream, nullptr, nullptr, 1, I.Interleaved()));
    RDEP_RETURN_IF_ERROR(I.RunGrouped(kFwd2, rows_per_expert, {I.z, 0, F * kB}, {w2, F * H * kB, 0}, {y, 0, H * kB}, stream));
    return Status::Ok();
  }
  // Per-expert chains (GEMM1 -> SwiGLU -> GEMM2) spread over the stream slots.
  int used = 0;
  RDEP_RETURN_IF_ERROR(I.Fork(rows_per_expert, stream, &used));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m = rows_per_expert[e];
    if (m == 0) continue;
    const int slot = I.slot_of[static_cast<size_t>(e)];
    cudaStream_t s = I.SlotStream(slot, stream);
    const int64_t off = I.offsets[static_cast<size_t>(e)];
    RDEP_RETURN_IF_ERROR(I.RunLt(kFwd1, m, x + off * H, w1 + e * H * 2 * F, h + off * 2 * F, 0.0f, slot, s));
    RDEP_LAUNCH(internal::LaunchSwigluForward(h + off * 2 * F, I.z + off * F, m, F, s, nullptr, nullptr, 1, I.Interleaved()));
    RDEP_RETURN_IF_ERROR(I.RunLt(kFwd2, m, I.z + off * F, w2 + e * F * H, y + off * H, 0.0f, slot, s));
  }
  return I.Join(used, stream);
}

Status ExpertMlp::Backward(const __nv_bfloat16* x, const __nv_bfloat16* h, const __nv_bfloat16* dout,
                           const int64_t* rows_per_expert, const __nv_bfloat16* w1, const __nv_bfloat16* w2,
                           __nv_bfloat16* dx, float* dw1, float* dw2, bool accumulate, cudaStream_t stream) {
  return BackwardImpl(x, h, dout, rows_per_expert, w1, w2, dx, dw1, dw2, /*bf16_grads=*/false, accumulate, stream);
}

Status ExpertMlp::Backward(const __nv_bfloat16* x, const __nv_bfloat16* h, const __nv_bfloat16* dout,
                           const int64_t* rows_per_expert, const __nv_bfloat16* w1, const __nv_bfloat16* w2,
                           __nv_bfloat16* dx, __nv_bfloat16* dw1, __nv_bfloat16* dw2, cudaStream_t stream) {
  return BackwardImpl(x, h, dout, rows_per_expert, w1, w2, dx, dw1, dw2, /*bf16_grads=*/true, /*accumulate=*/false, stream);
}

Status ExpertMlp::BackwardImpl(const __nv_bfloat16* x, const __nv_bfloat16* h, const __nv_bfloat16* dout,
                               const int64_t* rows_per_expert, const __nv_bfloat16* w1, const __nv_bfloat16* w2,
                               __nv_bfloat16* dx, void* dw1_out, void* dw2_out, bool bf16_grads, bool accumulate,
                               cudaStream_t stream) {
  Impl& I = *impl_;
  RDEP_RETURN_IF_ERROR(I.CheckCall(rows_per_expert, {x, h, dout, w1, w2, dx}));
  if (dw1_out == nullptr || dw2_out == nullptr) return InvalidArgument("ExpertMlp::Backward: null weight gradient");
  if (!Aligned16(dw1_out) || !Aligned16(dw2_out)) return InvalidArgument("ExpertMlp: tensor pointers must be 16-byte aligned");
  // Gradients as bytes: expert e's dW1 starts at e * H * 2F elements of grad_bytes each.
  const size_t grad_bytes = bf16_grads ? 2 : 4;
  auto* dw1 = static_cast<char*>(dw1_out);
  auto* dw2 = static_cast<char*>(dw2_out);
  const GemmKind kind_dw1 = bf16_grads ? kDw1b : kDw1, kind_dw2 = bf16_grads ? kDw2b : kDw2;
  const int64_t H = I.desc.hidden, F = I.desc.ffn, E = I.desc.num_experts;
  const int64_t M = I.offsets[static_cast<size_t>(E)];
  DeviceGuard guard(I.device);
  const float beta = accumulate ? 1.0f : 0.0f;
  // Overwrite semantics: an empty expert's gradient is zero (runs of empty experts in one memset each).
  if (!accumulate) {
    for (int64_t e = 0; e < E;) {
      if (rows_per_expert[e] != 0) {
        ++e;
        continue;
      }
      int64_t end = e;
      while (end < E && rows_per_expert[end] == 0) ++end;
      const size_t n = static_cast<size_t>(end - e);
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dw1 + e * H * 2 * F * grad_bytes, 0, n * static_cast<size_t>(H * 2 * F) * grad_bytes, stream));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dw2 + e * F * H * grad_bytes, 0, n * static_cast<size_t>(F * H) * grad_bytes, stream));
      e = end;
    }
  }
  if (M == 0) return Status::Ok();
  const int64_t kB = 2;
  if (I.UseGrouped(rows_per_expert)) {
    RDEP_RETURN_IF_ERROR(I.RunGrouped(kDz, rows_per_expert, {dout, 0, H * kB}, {w2, F * H * kB, 0}, {I.dz, 0, F * kB}, stream));
    RDEP_LAUNCH(internal::LaunchSwigluBackward(h, I.dz, I.z, I.dh, M, F, stream, nullptr, I.Interleaved()));
    // dx grouped on the caller's stream, concurrently with the weight gradients (fp32 out, per expert on
    // the fanned-out streams; slot 0 is the caller's stream, so its workspace use stays ordered).
    int used = 0;
    RDEP_RETURN_IF_ERROR(I.Fork(rows_per_expert, stream, &used));
    RDEP_RETURN_IF_ERROR(I.RunGrouped(kDx, rows_per_expert, {I.dh, 0, 2 * F * kB}, {w1, H * 2 * F * kB, 0}, {dx, 0, H * kB}, stream));
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = rows_per_expert[e];
      if (m == 0) continue;
      const int slot = I.slot_of[static_cast<size_t>(e)];
      cudaStream_t s = I.SlotStream(slot, stream);
      const int64_t off = I.offsets[static_cast<size_t>(e)];
      RDEP_RETURN_IF_ERROR(I.RunLt(kind_dw2, m, I.z + off * F, dout + off * H, dw2 + e * F * H * grad_bytes, beta, slot, s));
      RDEP_RETURN_IF_ERROR(I.RunLt(kind_dw1, m, x + off * H, I.dh + off * 2 * F, dw1 + e * H * 2 * F * grad_bytes, beta, slot, s));
    }
    return I.Join(used, stream);
  }
  int used = 0;
  RDEP_RETURN_IF_ERROR(I.Fork(rows_per_expert, stream, &used));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m = rows_per_expert[e];
    if (m == 0) continue;
    const int slot = I.slot_of[static_cast<size_t>(e)];
    cudaStream_t s = I.SlotStream(slot, stream);
    const int64_t off = I.offsets[static_cast<size_t>(e)];
    __nv_bfloat16* z = I.z + off * F;
    __nv_bfloat16* dz = I.dz + off * F;
    __nv_bfloat16* dh = I.dh + off * 2 * F;
    RDEP_RETURN_IF_ERROR(I.RunLt(kDz, m, dout + off * H, w2 + e * F * H, dz, 0.0f, slot, s));
    RDEP_LAUNCH(internal::LaunchSwigluBackward(h + off * 2 * F, dz, z, dh, m, F, s, nullptr, I.Interleaved()));
    RDEP_RETURN_IF_ERROR(I.RunLt(kDx, m, dh, w1 + e * H * 2 * F, dx + off * H, 0.0f, slot, s));
    RDEP_RETURN_IF_ERROR(I.RunLt(kind_dw2, m, z, dout + off * H, dw2 + e * F * H * grad_bytes, beta, slot, s));
    RDEP_RETURN_IF_ERROR(I.RunLt(kind_dw1, m, x + off * H, dh, dw1 + e * H * 2 * F * grad_bytes, beta, slot, s));
  }
  return I.Join(used, stream);
}

}  // namespace rdep::kernels
