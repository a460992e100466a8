// Lab: every kernel a process runs, with its start and end on the GPU, for a program that has no tracer of its
// own (rdep bench gemm, the labs). The device machines have no Nsight Systems, and Nsight Compute serializes
// kernels (a kernel's time under it is its time alone, not its time in a chain); CUPTI's activity records
// (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) time kernels as they run, overlapped or not.
//
// A library for LD_PRELOAD: when RDEP_KERNEL_TRACE names a file, it enables the records at load and writes
// them at exit, one line a kernel, tab-separated: start_ns end_ns stream grid block name_id; then one line a
// name, "#name<TAB>id<TAB>name" (demangled where the ABI's demangler can, template arguments kept; CUTLASS's
// kernels stay mangled). bench/lab/kernel_trace_summary.py reads the file.
//   cmake --build build --target kernel_trace        (a CUDA build: build/bench/lab/kernel_trace.so), or alone:
//   g++ -O2 -std=c++17 -shared -fPIC -o /tmp/kernel_trace.so bench/lab/kernel_trace.cc -I/usr/local/cuda/include
//       -L/usr/local/cuda/lib64 -L/usr/local/cuda/lib -lcupti   (one line)
//   RDEP_KERNEL_TRACE=/tmp/trace.tsv LD_PRELOAD=build/bench/lab/kernel_trace.so build/bin/rdep bench gemm --mu 1536 ...
//   python3 bench/lab/kernel_trace_summary.py /tmp/trace.tsv
#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Kernel {
  uint64_t start, end;
  uint32_t stream;
  int32_t grid[3], block[3];
  std::string name;
};

std::mutex g_mu;
std::vector<Kernel>* g_kernels = nullptr;  // leaked: written from the atexit handler, after other statics may be gone
const char* g_path = nullptr;

constexpr size_t kBufferBytes = size_t{8} << 20;

bool Ok(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return true;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, msg ? msg : "?");
  return false;
}

std::string Demangled(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : name;
  std::free(d);
  for (char& c : out)
    if (c == '\t' || c == '\n') c = ' ';
  return out;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::vector<Kernel> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    got.push_back({k->start, k->end, k->streamId, {k->gridX, k->gridY, k->gridZ}, {k->blockX, k->blockY, k->blockZ},
                   Demangled(k->name)});
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& k : got) g_kernels->push_back(std::move(k));
}

void WriteAtExit() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(g_mu);
  FILE* f = std::fopen(g_path, "w");
  if (!f) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", g_path);
    return;
  }
  std::map<std::string, size_t> ids;  // names are long (CUTLASS's ~1.3 KB): each written once
  std::vector<const std::string*> names;
  std::fprintf(f, "start_ns\tend_ns\tstream\tgrid\tblock\tname_id\n");
  for (const auto& k : *g_kernels) {
    auto [it, fresh] = ids.emplace(k.name, names.size());
    if (fresh) names.push_back(&it->first);
    std::fprintf(f, "%llu\t%llu\t%u\t%dx%dx%d\t%dx%dx%d\t%zu\n", static_cast<unsigned long long>(k.start),
                 static_cast<unsigned long long>(k.end), k.stream, k.grid[0], k.grid[1], k.grid[2], k.block[0], k.block[1],
                 k.block[2], it->second);
  }
  for (size_t i = 0; i < names.size(); ++i) std::fprintf(f, "#name\t%zu\t%s\n", i, names[i]->c_str());
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu kernels written to %s\n", g_kernels->size(), g_path);
}

__attribute__((constructor)) void Start() {
  g_path = std::getenv("RDEP_KERNEL_TRACE");
  if (!g_path || !*g_path) return;
  g_kernels = new std::vector<Kernel>();
  if (!Ok(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted), "cuptiActivityRegisterCallbacks")) return;
  if (!Ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable")) return;
  std::atexit(WriteAtExit);
}

}  // namespace
