#include "rdep/transport/cuda_domain.h"

#include <cuda.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <type_traits>

#include "cuda_domain_capture.h"
#include "rdep/cuda/check.h"

namespace rdep {

namespace {

// The driver (cuMem) entry points, resolved through the runtime so that nothing links libcuda: a
// binary built here still loads on a machine without a driver (CI) and reports "no device".
struct DriverApi {
  decltype(&::cuGetErrorName) cuGetErrorName = nullptr;
  decltype(&::cuDeviceGet) cuDeviceGet = nullptr;
  decltype(&::cuDeviceGetAttribute) cuDeviceGetAttribute = nullptr;
  decltype(&::cuMemGetAllocationGranularity) cuMemGetAllocationGranularity = nullptr;
  decltype(&::cuMemCreate) cuMemCreate = nullptr;
  decltype(&::cuMemRelease) cuMemRelease = nullptr;
  decltype(&::cuMemExportToShareableHandle) cuMemExportToShareableHandle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) cuMemImportFromShareableHandle = nullptr;
  decltype(&::cuMemAddressReserve) cuMemAddressReserve = nullptr;
  decltype(&::cuMemAddressFree) cuMemAddressFree = nullptr;
  decltype(&::cuMemMap) cuMemMap = nullptr;
  decltype(&::cuMemUnmap) cuMemUnmap = nullptr;
  decltype(&::cuMemSetAccess) cuMemSetAccess = nullptr;
  bool ok = false;
};

const DriverApi& Driver() {
  static const DriverApi api = [] {
    DriverApi a;
    bool all = true;
    auto get = [&](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q;
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess || !p) {
        cudaGetLastError();
        all = false;
        return;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get("cuGetErrorName", a.cuGetErrorName);
    get("cuDeviceGet", a.cuDeviceGet);
    get("cuDeviceGetAttribute", a.cuDeviceGetAttribute);
    get("cuMemGetAllocationGranularity", a.cuMemGetAllocationGranularity);
    get("cuMemCreate", a.cuMemCreate);
    get("cuMemRelease", a.cuMemRelease);
    get("cuMemExportToShareableHandle", a.cuMemExportToShareableHandle);
    get("cuMemImportFromShareableHandle", a.cuMemImportFromShareableHandle);
    get("cuMemAddressReserve", a.cuMemAddressReserve);
    get("cuMemAddressFree", a.cuMemAddressFree);
    get("cuMemMap", a.cuMemMap);
    get("cuMemUnmap", a.cuMemUnmap);
    get("cuMemSetAccess", a.cuMemSetAccess);
    a.ok = all;
    return a;
  }();
  return api;
}

Status DriverStatus(CUresult r, const char* expr, const char* file, int line) {
  if (r == CUDA_SUCCESS) return Status::Ok();
  const char* name = nullptr;
  if (Driver().cuGetErrorName) Driver().cuGetErrorName(r, &name);
  return Status(StatusCode::kCudaError, std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
                                            (name ? name : "unknown"));
}
#define RDEP_CU_RETURN_IF_ERROR(expr) RDEP_RETURN_IF_ERROR(DriverStatus((expr), #expr, __FILE__, __LINE__))

// What ranks exchange at bootstrap: a mismatch in any field is an error naming the ranks.
struct Hello {
  uint64_t magic;
  uint32_t protocol;
  int32_t world;
  int32_t rank;
  int32_t device;
  char bus_id[32];
  uint64_t build;  // this translation unit's build stamp and the layout of DeviceErrorRecord (shared with peers)
};
constexpr uint64_t kMagic = 0x5244455044304D31ull;  // "RDEPD0M1"
constexpr uint32_t kProtocol = 1;

uint64_t BuildStamp() {
  const std::string s = std::string(__DATE__ " " __TIME__) + "/" + std::to_string(sizeof(DeviceErrorRecord));
  return std::hash<std::string>{}(s);
}

// One region's entry in the exchange at allocation.
struct RegionHello {
  uint64_t bytes;
  uint64_t name_hash;
  unsigned char handle[64];  // cudaIpcMemHandle_t or CUmemFabricHandle
};
static_assert(sizeof(cudaIpcMemHandle_t) <= 64);
static_assert(sizeof(CUmemFabricHandle) <= 64);

// The allocation properties of a fabric-exportable allocation on `dev`, and read-write access from it.
CUmemAllocationProp FabricProp(int dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  return prop;
}

CUmemAccessDesc ReadWriteFrom(int dev) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

}  // namespace

// Ranks sharing a GPU: the host rendezvous of the ranks' threads, and each rank's barrier events by
// epoch parity. A rank re-records its event of parity e&1 only at epoch e+2, which it reaches after
// every rank arrived at e+1, so after every rank enqueued its waits for epoch e: two events suffice.
struct CudaDomain::JoinState {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> arrived;                   // [W] the last epoch each rank arrived at
  std::vector<std::array<Phase, 2>> phase;         // [W][epoch parity] the phase announced
  std::vector<std::array<cudaEvent_t, 2>> events;  // [W][epoch parity], on the rank's device
};

CudaDomain::CudaDomain() = default;

std::vector<int> RoundRobinDevices(int64_t num_ranks, int num_gpus) {
  std::vector<int> d;
  if (num_gpus <= 0) return d;
  for (int64_t r = 0; r < num_ranks; ++r) d.push_back(static_cast<int>(r % num_gpus));
  return d;
}

std::string CudaDomain::placement() const {
  std::ostringstream os;
  if (bootstrap_) {
    const int32_t me = bootstrap_->rank();
    os << "rank " << me << " of " << num_ranks_ << " on GPU " << device(me) << ", one process per GPU";
    return os.str();
  }
  std::map<int, std::vector<int32_t>> by_gpu;
  for (int32_t r = 0; r < num_ranks_; ++r) by_gpu[device(r)].push_back(r);
  os << num_ranks_ << (num_ranks_ == 1 ? " rank" : " ranks") << " on " << by_gpu.size() << (by_gpu.size() == 1 ? " GPU" : " GPUs") << " (";
  bool identity = true;
  for (int32_t r = 0; r < num_ranks_; ++r) identity &= device(r) == r;
  if (identity) {
    os << "rank r on GPU r)";
  } else {
    const char* sep = "";
    for (const auto& [gpu, ranks] : by_gpu) {
      os << sep << "GPU " << gpu << ": rank" << (ranks.size() > 1 ? "s " : " ");
      for (size_t i = 0; i < ranks.size(); ++i) os << (i ? "," : "") << ranks[i];
      sep = "; ";
    }
    os << ")";
  }
  if (shared_) os << "; ranks share GPUs: timings do not measure NVLink";
  return os.str();
}

std::vector<int32_t> CudaDomain::local_ranks() const {
  if (bootstrap_) return {bootstrap_->rank()};
  std::vector<int32_t> r;
  for (int32_t q = 0; q < num_ranks_; ++q) r.push_back(q);
  return r;
}

StatusOr<std::unique_ptr<CudaDomain>> CudaDomain::CreateSingleProcess(int64_t num_ranks, CudaDomainOptions options) {
  const int available = cuda::DeviceCount();
  if (available == 0) return Unavailable("cuda domain: no CUDA device is present");
  if (num_ranks < 1 || num_ranks > kMaxCudaRanks)
    return InvalidArgument("cuda domain: ranks W must be in [1, " + std::to_string(kMaxCudaRanks) + "], got " + std::to_string(num_ranks));
  if (!(options.barrier_timeout_s > 0)) return InvalidArgument("cuda domain: barrier timeout must be > 0 seconds");
  if (options.devices.empty()) {
    if (num_ranks > available)
      return InvalidArgument("cuda domain: W=" + std::to_string(num_ranks) + " ranks need " + std::to_string(num_ranks) +
                             " GPUs in one process, this machine has " + std::to_string(available) +
                             "; to place several ranks on a GPU, give the devices (RoundRobinDevices; rdep: --gpus N)");
    for (int i = 0; i < num_ranks; ++i) options.devices.push_back(i);
  }
  if (static_cast<int64_t>(options.devices.size()) != num_ranks)
    return InvalidArgument("cuda domain: " + std::to_string(options.devices.size()) + " devices given for W=" +
                           std::to_string(num_ranks));
  std::unique_ptr<CudaDomain> d(new CudaDomain());
  d->num_ranks_ = static_cast<int32_t>(num_ranks);
  d->options_ = options;
  d->devices_ = options.devices;
  d->epoch_.assign(static_cast<size_t>(num_ranks), 0);
  for (int32_t r = 0; r < num_ranks; ++r) {
    const int dev = d->devices_[static_cast<size_t>(r)];
    if (dev < 0 || dev >= available)
      return InvalidArgument("cuda domain: rank " + std::to_string(r) + "'s device " + std::to_string(dev) + " does not exist (" +
                             std::to_string(available) + " present)");
  }
  for (int32_t r = 0; r < num_ranks; ++r) {
    const int dev = d->devices_[static_cast<size_t>(r)];
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));
    for (int32_t p = 0; p < num_ranks; ++p) {
      const int peer = d->devices_[static_cast<size_t>(p)];
      if (peer == dev) continue;
      int can = 0;
      RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, dev, peer));
      if (!can)
        return Unavailable("cuda domain: GPU " + std::to_string(dev) + " cannot access GPU " + std::to_string(peer) +
                           " as a peer (no NVLink/P2P path); one-process mode needs peer access");
      cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else RDEP_CUDA_RETURN_IF_ERROR(e);
    }
    cudaStream_t s;
    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    d->streams_.push_back(s);
  }
  void* host = nullptr;
  RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host, sizeof(DeviceErrorRecord) * static_cast<size_t>(num_ranks),
                                          cudaHostAllocMapped | cudaHostAllocPortable));
  d->errors_ = static_cast<DeviceErrorRecord*>(host);
  std::memset(d->errors_, 0, sizeof(DeviceErrorRecord) * static_cast<size_t>(num_ranks));
  for (int32_t r = 0; r < num_ranks; ++r) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(d->device(r)));
    void* dev_ptr = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev_ptr, d->errors_ + r, 0));
    d->errors_dev_.push_back(static_cast<DeviceErrorRecord*>(dev_ptr));
  }
  RDEP_ASSIGN_OR_RETURN(d->barrier_region_,
                        d->AllocateSymmetric(sizeof(uint64_t) * static_cast<size_t>(num_ranks + 1), "barrier"));
  for (int32_t r = 0; r < num_ranks && !d->shared_; ++r)
    for (int32_t p = 0; p < r; ++p) d->shared_ |= d->device(p) == d->device(r);
  d->joins_ = d->shared_ && !d->options_.kernel_barriers;
  if (d->joins_) RDEP_RETURN_IF_ERROR(d->InitJoin());
  d->capture_ = std::make_unique<CaptureState>(static_cast<size_t>(num_ranks));
  return d;
}

Status CudaDomain::InitJoin() {
  join_ = std::make_unique<JoinState>();
  const auto W = static_cast<size_t>(num_ranks_);
  join_->arrived.assign(W, 0);
  join_->phase.assign(W, {Phase::kSmoke, Phase::kSmoke});
  join_->events.assign(W, {nullptr, nullptr});
  for (size_t r = 0; r < W; ++r) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[r]));
    for (auto& e : join_->events[r]) RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<CudaDomain>> CudaDomain::CreateMultiProcess(Bootstrap& boot, CudaDomainOptions options) {
  const int available = cuda::DeviceCount();
  if (available == 0) return Unavailable("cuda domain: no CUDA device is present on rank " + std::to_string(boot.rank()));
  if (!(options.barrier_timeout_s > 0)) return InvalidArgument("cuda domain: barrier timeout must be > 0 seconds");
  const int32_t W = boot.size(), me = boot.rank();
  const int dev = options.devices.empty() ? boot.local_rank() % available : options.devices.front();
  if (dev < 0 || dev >= available) return InvalidArgument("cuda domain: device " + std::to_string(dev) + " does not exist");
  std::unique_ptr<CudaDomain> d(new CudaDomain());
  d->num_ranks_ = W;
  d->options_ = options;
  d->bootstrap_ = &boot;
  d->devices_.assign(static_cast<size_t>(W), -1);
  d->devices_[static_cast<size_t>(me)] = dev;
  d->streams_.assign(static_cast<size_t>(W), nullptr);
  d->epoch_.assign(static_cast<size_t>(W), 0);
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));

  // Fingerprints: same world, same build, every rank on its own GPU.
  Hello hello{};
  hello.magic = kMagic;
  hello.protocol = kProtocol;
  hello.world = W;
  hello.rank = me;
  hello.device = dev;
  RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(hello.bus_id, sizeof hello.bus_id, dev));
  hello.build = BuildStamp();
  std::vector<Hello> all(static_cast<size_t>(W));
  RDEP_RETURN_IF_ERROR(boot.AllGather(&hello, sizeof hello, all.data()));
  for (int32_t r = 0; r < W; ++r) {
    const Hello& h = all[static_cast<size_t>(r)];
    const std::string who = "rank " + std::to_string(r);
    if (h.magic != kMagic || h.protocol != kProtocol) return InvalidArgument("cuda domain bootstrap: " + who + " is not an rdep process of this protocol version");
    if (h.world != W || h.rank != r)
      return InvalidArgument("cuda domain bootstrap: " + who + " believes it is rank " + std::to_string(h.rank) + " of " +
                             std::to_string(h.world) + ", this rank sees W=" + std::to_string(W));
    if (h.build != hello.build)
      return InvalidArgument("cuda domain bootstrap: rank " + std::to_string(me) + " and " + who +
                             " run different rdep builds (mismatched binaries)");
    for (int32_t p = 0; p < r; ++p)
      if (std::strncmp(all[static_cast<size_t>(p)].bus_id, h.bus_id, sizeof h.bus_id) == 0)
        return InvalidArgument("cuda domain bootstrap: ranks " + std::to_string(p) + " and " + std::to_string(r) +
                               " share GPU " + std::string(h.bus_id) + "; give every rank its own GPU, or drive the ranks from one process (rdep check --gpus N)");
  }

  // Transport: fabric handles when every rank's driver supports and permits them, else IPC.
  std::string why_not;
  const char* force = std::getenv("RDEP_TRANSPORT");
  bool fabric_ok = false;
  if (force && std::string(force) == "ipc") why_not = "RDEP_TRANSPORT=ipc";
  else fabric_ok = d->ProbeFabric(&why_not).ok() && why_not.empty();
  const uint8_t mine = fabric_ok ? 1 : 0;
  std::vector<uint8_t> votes(static_cast<size_t>(W));
  RDEP_RETURN_IF_ERROR(boot.AllGather(&mine, 1, votes.data()));
  d->fabric_ = true;
  for (auto v : votes) d->fabric_ &= (v == 1);
  d->transport_ = d->fabric_ ? "fabric" : "ipc";
  if (!d->fabric_) d->transport_ += " (fabric: " + (why_not.empty() ? std::string("not on every rank") : why_not) + ")";

  cudaStream_t s;
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  d->streams_[static_cast<size_t>(me)] = s;
  void* host = nullptr;
  RDEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host, sizeof(DeviceErrorRecord) * static_cast<size_t>(W), cudaHostAllocMapped));
  d->errors_ = static_cast<DeviceErrorRecord*>(host);
  std::memset(d->errors_, 0, sizeof(DeviceErrorRecord) * static_cast<size_t>(W));
  d->errors_dev_.assign(static_cast<size_t>(W), nullptr);
  void* dev_ptr = nullptr;
  RDEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev_ptr, d->errors_ + me, 0));
  d->errors_dev_[static_cast<size_t>(me)] = static_cast<DeviceErrorRecord*>(dev_ptr);
  RDEP_ASSIGN_OR_RETURN(d->barrier_region_, d->AllocateSymmetric(sizeof(uint64_t) * static_cast<size_t>(W + 1), "barrier"));
  return d;
}

Status CudaDomain::ProbeFabric(std::string* why_not) {
  if (!Driver().ok) {
    *why_not = "the driver's cuMem entry points are not available";
    return Status::Ok();
  }
  const int dev = devices_[static_cast<size_t>(bootstrap_->rank())];
  CUdevice cu_dev;
  RDEP_CU_RETURN_IF_ERROR(Driver().cuDeviceGet(&cu_dev, dev));
  int supported = 0;
  if (Driver().cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, cu_dev) != CUDA_SUCCESS || !supported) {
    *why_not = "the driver reports no fabric handle support";
    return Status::Ok();
  }
  const CUmemAllocationProp prop = FabricProp(dev);
  size_t gran = 0;
  RDEP_CU_RETURN_IF_ERROR(Driver().cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemGenericAllocationHandle h;
  if (Driver().cuMemCreate(&h, gran, &prop, 0) != CUDA_SUCCESS) {
    *why_not = "cuMemCreate with a fabric handle type failed (no IMEX channel?)";
    return Status::Ok();
  }
  CUmemFabricHandle fh;
  const CUresult r = Driver().cuMemExportToShareableHandle(&fh, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
  Driver().cuMemRelease(h);
  if (r != CUDA_SUCCESS) *why_not = "exporting a fabric handle failed";
  return Status::Ok();
}

CudaDomain::~CudaDomain() {
  if (join_)
    for (auto& pair : join_->events)
      for (cudaEvent_t e : pair)
        if (e) cudaEventDestroy(e);
  for (auto& r : regions_) FreeRegion(r);
  for (size_t q = 0; q < streams_.size(); ++q)
    if (streams_[q]) {
      cudaSetDevice(devices_[q]);
      cudaStreamDestroy(streams_[q]);
    }
  if (errors_) cudaFreeHost(errors_);
}

void CudaDomain::FreeSymmetric(RegionId id) {
  if (id < 0 || static_cast<size_t>(id) >= regions_.size()) return;
  FreeRegion(regions_[static_cast<size_t>(id)]);
}

void CudaDomain::FreeRegion(Region& r) {
  if (r.freed) return;
  r.freed = true;
  for (int32_t q : local_ranks()) {
    cudaSetDevice(devices_[static_cast<size_t>(q)]);
    if (r.tables[static_cast<size_t>(q)]) cudaFree(r.tables[static_cast<size_t>(q)]);
  }
  if (!bootstrap_) {
    for (size_t q = 0; q < r.base.size(); ++q) {
      cudaSetDevice(devices_[q]);
      cudaFree(r.base[q]);
    }
    return;
  }
  const auto me = static_cast<size_t>(bootstrap_->rank());
  for (size_t q = 0; q < r.base.size(); ++q) {
    if (!r.base[q]) continue;
    if (fabric_) {
      Driver().cuMemUnmap(reinterpret_cast<CUdeviceptr>(r.base[q]), r.mapped_bytes);
      Driver().cuMemAddressFree(reinterpret_cast<CUdeviceptr>(r.base[q]), r.mapped_bytes);
    } else if (q == me) {
      cudaFree(r.base[q]);
    } else {
      cudaIpcCloseMemHandle(r.base[q]);
    }
  }
  if (fabric_ && r.fabric_handle) Driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(r.fabric_handle));
}

StatusOr<RegionId> CudaDomain::AllocateSymmetric(size_t bytes, const std::string& name) {
  if (running_) return FailedPrecondition("cuda domain: AllocateSymmetric(" + name + ") called inside Run");
  Region r;
  r.name = name;
  r.bytes = bytes;
  const size_t W = static_cast<size_t>(num_ranks_);
  r.base.assign(W, nullptr);
  r.tables.assign(W, nullptr);
  if (!bootstrap_) {
    for (size_t q = 0; q < W; ++q) {
      RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[q]));
      void* p = nullptr;
      cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
      if (e != cudaSuccess)
        return Status(StatusCode::kCudaError, "cuda domain: allocating " + std::to_string(bytes) + " bytes for region '" +
                                                  name + "' on GPU " + std::to_string(devices_[q]) + ": " + cudaGetErrorString(e));
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, bytes ? bytes : 1));
      r.base[q] = p;
    }
  } else {
    RDEP_RETURN_IF_ERROR(AllocateLocal(r, bytes));
    RDEP_RETURN_IF_ERROR(OpenPeers(r));
  }
  for (int32_t q : local_ranks()) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[static_cast<size_t>(q)]));
    void** table = nullptr;
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&table, sizeof(void*) * W));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(table, r.base.data(), sizeof(void*) * W, cudaMemcpyHostToDevice));
    r.tables[static_cast<size_t>(q)] = table;
  }
  for (int32_t q : local_ranks()) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[static_cast<size_t>(q)]));
    RDEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  }
  regions_.push_back(std::move(r));
  return static_cast<RegionId>(regions_.size() - 1);
}

// Multi-process: allocate this rank's copy and remember its exportable handle in base[me].
Status CudaDomain::AllocateLocal(Region& r, size_t bytes) {
  const auto me = static_cast<size_t>(bootstrap_->rank());
  const int dev = devices_[me];
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));
  if (!fabric_) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&r.base[me], bytes ? bytes : 1));
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(r.base[me], 0, bytes ? bytes : 1));
    return Status::Ok();
  }
  const CUmemAllocationProp prop = FabricProp(dev);
  size_t gran = 0;
  RDEP_CU_RETURN_IF_ERROR(Driver().cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  r.mapped_bytes = ((std::max<size_t>(bytes, 1) + gran - 1) / gran) * gran;
  CUmemGenericAllocationHandle h;
  RDEP_CU_RETURN_IF_ERROR(Driver().cuMemCreate(&h, r.mapped_bytes, &prop, 0));
  r.fabric_handle = static_cast<uint64_t>(h);
  CUdeviceptr va;
  RDEP_CU_RETURN_IF_ERROR(Driver().cuMemAddressReserve(&va, r.mapped_bytes, gran, 0, 0));
  RDEP_CU_RETURN_IF_ERROR(Driver().cuMemMap(va, r.mapped_bytes, 0, h, 0));
  const CUmemAccessDesc access = ReadWriteFrom(dev);
  RDEP_CU_RETURN_IF_ERROR(Driver().cuMemSetAccess(va, r.mapped_bytes, &access, 1));
  r.base[me] = reinterpret_cast<void*>(va);
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemset(r.base[me], 0, r.mapped_bytes));
  return Status::Ok();
}

// Multi-process: exchange handles (and sizes: a mismatch means the ranks' configurations differ),
// then open every peer's copy.
Status CudaDomain::OpenPeers(Region& r) {
  const auto me = static_cast<size_t>(bootstrap_->rank());
  const int dev = devices_[me];
  RegionHello mine{};
  mine.bytes = r.bytes;
  mine.name_hash = std::hash<std::string>{}(r.name);
  if (fabric_) {
    CUmemFabricHandle fh;
    RDEP_CU_RETURN_IF_ERROR(Driver().cuMemExportToShareableHandle(&fh, static_cast<CUmemGenericAllocationHandle>(r.fabric_handle),
                                                         CU_MEM_HANDLE_TYPE_FABRIC, 0));
    std::memcpy(mine.handle, &fh, sizeof fh);
  } else {
    cudaIpcMemHandle_t ih;
    RDEP_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&ih, r.base[me]));
    std::memcpy(mine.handle, &ih, sizeof ih);
  }
  std::vector<RegionHello> all(static_cast<size_t>(num_ranks_));
  RDEP_RETURN_IF_ERROR(bootstrap_->AllGather(&mine, sizeof mine, all.data()));
  for (size_t q = 0; q < all.size(); ++q)
    if (all[q].bytes != mine.bytes || all[q].name_hash != mine.name_hash)
      return InvalidArgument("cuda domain: symmetric region '" + r.name + "' is " + std::to_string(mine.bytes) +
                             " bytes on rank " + std::to_string(me) + " but rank " + std::to_string(q) + " allocates " +
                             std::to_string(all[q].bytes) + " bytes" +
                             (all[q].name_hash != mine.name_hash ? " for a different region" : "") +
                             ": the ranks' layer configurations differ");
  RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));
  for (size_t q = 0; q < all.size(); ++q) {
    if (q == me) continue;
    if (!fabric_) {
      cudaIpcMemHandle_t ih;
      std::memcpy(&ih, all[q].handle, sizeof ih);
      RDEP_CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&r.base[q], ih, cudaIpcMemLazyEnablePeerAccess));
      continue;
    }
    CUmemFabricHandle fh;
    std::memcpy(&fh, all[q].handle, sizeof fh);
    CUmemGenericAllocationHandle h;
    RDEP_CU_RETURN_IF_ERROR(Driver().cuMemImportFromShareableHandle(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC));
    CUdeviceptr va;
    RDEP_CU_RETURN_IF_ERROR(Driver().cuMemAddressReserve(&va, r.mapped_bytes, 0, 0, 0));
    RDEP_CU_RETURN_IF_ERROR(Driver().cuMemMap(va, r.mapped_bytes, 0, h, 0));
    Driver().cuMemRelease(h);  // the mapping keeps the memory alive
    const CUmemAccessDesc access = ReadWriteFrom(dev);
    RDEP_CU_RETURN_IF_ERROR(Driver().cuMemSetAccess(va, r.mapped_bytes, &access, 1));
    r.base[q] = reinterpret_cast<void*>(va);
  }
  return Status::Ok();
}

void* CudaDomain::region(int32_t rank, RegionId id) const {
  return regions_[static_cast<size_t>(id)].base[static_cast<size_t>(rank)];
}

void* const* CudaDomain::peer_table(int32_t viewer, RegionId id) const {
  return regions_[static_cast<size_t>(id)].tables[static_cast<size_t>(viewer)];
}

size_t CudaDomain::symmetric_bytes_per_rank() const {
  size_t total = 0;
  for (const auto& r : regions_)
    if (!r.freed) total += r.bytes;
  return total;
}

Status CudaDomain::AgreeAcrossRanks(const std::vector<uint8_t>& mine, const std::string& what,
                                    const std::function<std::string(const std::vector<uint8_t>&)>& describe) {
  if (!bootstrap_) return Status::Ok();
  return ::rdep::AgreeAcrossRanks(*bootstrap_, mine, what, describe);
}

Status CudaDomain::Run(const std::function<Status(int32_t rank)>& fn) {
  running_ = true;
  const std::vector<int32_t> local = local_ranks();
  if (local.size() == 1) {  // one local rank (per-process mode, or W = 1): on the calling thread, no spawn
    int caller_device = -1;
    cudaGetDevice(&caller_device);
    Status s = cuda::CudaStatus(cudaSetDevice(device(local[0])), "cudaSetDevice", __FILE__, __LINE__);
    if (s.ok()) {
      try {
        s = fn(local[0]);
      } catch (const std::exception& e) {
        s = InternalError(std::string("unexpected C++ exception: ") + e.what());
      }
    }
    if (caller_device >= 0) cudaSetDevice(caller_device);
    running_ = false;
    if (s.ok()) return s;
    return Status(s.code(), "rank " + std::to_string(local[0]) + ": " + s.message());
  }
  std::vector<Status> status(local.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < local.size(); ++i)
    threads.emplace_back([&, i] {
      const int32_t r = local[i];
      Status s = cuda::CudaStatus(cudaSetDevice(device(r)), "cudaSetDevice", __FILE__, __LINE__);
      try {
        if (s.ok()) s = fn(r);
      } catch (const std::exception& e) {  // an exception must not end the process from a worker thread
        s = InternalError(std::string("unexpected C++ exception: ") + e.what());
      }
      status[i] = std::move(s);
    });
  for (auto& t : threads) t.join();
  running_ = false;
  int first = -1, failed = 0;
  for (size_t i = 0; i < local.size(); ++i)
    if (!status[i].ok()) {
      ++failed;
      // A timeout on a waiting rank is a consequence; prefer a rank that failed for another reason.
      if (first < 0 || (status[static_cast<size_t>(first)].code() == StatusCode::kTimeout && status[i].code() != StatusCode::kTimeout))
        first = static_cast<int>(i);
    }
  if (first < 0) return Status::Ok();
  const Status& s = status[static_cast<size_t>(first)];
  std::ostringstream os;
  os << "rank " << local[static_cast<size_t>(first)] << ": " << s.message();
  if (failed > 1) os << " (and " << failed - 1 << " other rank(s) failed)";
  return Status(s.code(), os.str());
}

Status CudaDomain::Barrier(int32_t rank, Phase phase) {
  if (num_ranks_ == 1) return Status::Ok();  // no peer to wait for: the rank's stream order is the barrier
  if (joins_) return JoinBarrier(rank, phase, ++epoch_[static_cast<size_t>(rank)]);
  // Recorded in a CUDA graph, a failed barrier traps after writing its record: no host call follows a replay to
  // read the record, and the replay must not go on without the peer's data (cuda_barrier.cu).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream(rank), &capture));
  return LaunchPhaseBarrier(peer_table(rank, barrier_region_), rank, num_ranks_, phase, options_.barrier_timeout_s,
                            errors_dev_[static_cast<size_t>(rank)], stream(rank), capture != cudaStreamCaptureStatusNone);
}

Status CudaDomain::TakeForward(int32_t rank, int32_t* armed) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream(rank), &capture));
  return LaunchTakeForward(armed, errors_dev_[static_cast<size_t>(rank)], stream(rank), capture != cudaStreamCaptureStatusNone);
}

Status CudaDomain::JoinBarrier(int32_t rank, Phase phase, uint64_t epoch) {
  JoinState& j = *join_;
  const auto me = static_cast<size_t>(rank);
  const size_t parity = epoch & 1;
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(j.events[me][parity], stream(rank)));
  {
    std::unique_lock<std::mutex> lock(j.mu);
    j.arrived[me] = epoch;
    j.phase[me][parity] = phase;
    j.cv.notify_all();
    const auto all_here = [&] {
      for (uint64_t e : j.arrived)
        if (e < epoch) return false;
      return true;
    };
    const auto bound = std::chrono::duration<double>(options_.barrier_timeout_s);
    if (!j.cv.wait_for(lock, bound, all_here)) {
      std::ostringstream os;
      os << "barrier '" << PhaseName(phase) << "' (#" << epoch << ") timed out after " << options_.barrier_timeout_s
         << " s; no arrival from rank(s) ";
      const char* sep = "";
      for (size_t p = 0; p < j.arrived.size(); ++p)
        if (j.arrived[p] < epoch) {
          os << sep << p;
          sep = ",";
        }
      os << " (host-side join: ranks share a GPU)";
      return TimeoutError(os.str());
    }
    for (size_t p = 0; p < j.arrived.size(); ++p)
      if (j.phase[p][parity] != phase) {
        std::ostringstream os;
        os << "barrier #" << epoch << " phase mismatch: this rank is at '" << PhaseName(phase) << "', rank " << p
           << " is at '" << PhaseName(j.phase[p][parity]) << "'";
        return InternalError(os.str());
      }
  }
  for (size_t p = 0; p < j.events.size(); ++p)
    if (p != me) RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream(rank), j.events[p][parity], 0));
  return Status::Ok();
}

Status CudaDomain::CheckErrors(int32_t rank) {  // rank: the caller names it (Run's prefix, CudaAdapter::CheckDeviceErrors)
  // The device writes this record through a mapped pointer: read it field by field, volatile.
  const volatile DeviceErrorRecord* v = errors_ + rank;
  DeviceErrorRecord e;
  e.code = v->code;
  e.phase = v->phase;
  e.peer = v->peer;
  e.peer_phase = v->peer_phase;
  e.epoch = v->epoch;
  e.peer_epoch = v->peer_epoch;
  if (e.code == 0) return Status::Ok();
  std::ostringstream os;
  if (e.code == 4)
    return FailedPrecondition(
        "a backward ran on a context whose forward had not run since the last backward "
        "on it (a CUDA graph's backward replayed, or recorded again, without its forward's replay, as a second backward of "
        "one forward does); its gradients are not valid, and the domain's calls fail from here on");
  if (e.code == 1) {
    os << "device barrier '" << PhaseName(static_cast<Phase>(e.phase)) << "' (#" << e.epoch << ") timed out after "
       << options_.barrier_timeout_s << " s; no arrival from rank(s) " << e.peer;
    return TimeoutError(os.str());
  }
  if (e.code == 3) {
    os << "device barrier '" << PhaseName(static_cast<Phase>(e.phase)) << "' (#" << e.epoch << "): epochs diverged, rank "
       << e.peer << " is at #" << e.peer_epoch << " ('" << PhaseName(static_cast<Phase>(e.peer_phase))
       << "'), more than one ahead (a rank's barriers ran out of order: a CUDA graph launched while its streams had "
          "work queued, or ranks that called different numbers of barriers)";
    return InternalError(os.str());
  }
  os << "device barrier #" << e.epoch << " phase mismatch: this rank is at '" << PhaseName(static_cast<Phase>(e.phase))
     << "', rank " << e.peer << " is at '" << PhaseName(static_cast<Phase>(e.peer_phase)) << "'";
  return InternalError(os.str());
}

Status CudaDomain::Synchronize(int32_t rank) {
  RDEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream(rank)));
  return CheckErrors(rank);
}

}  // namespace rdep
