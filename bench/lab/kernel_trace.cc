// Lab: every kernel a process runs, with its start and end on the GPU, for a program that has no tracer of its
// own (rdep bench gemm, the labs). The device machines have no Nsight Systems, and Nsight Compute serializes
// kernels (a kernel's time under it is its time alone, not its time in a chain); CUPTI's activity records
// (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) time kernels as they run, overlapped or not.
//
// A library for LD_PRELOAD: when RDEP_KERNEL_TRACE names a file, it enables the records at load and writes
// them at a normal exit, one line a kernel, tab-separated: start_ns end_ns stream grid block name_id; then one
// line a name, "#name<TAB>id<TAB>name" (demangled where the ABI's demangler can, template arguments kept;
// CUTLASS's kernels stay mangled). bench/lab/kernel_trace_summary.py reads the file.
// - Every process that inherits LD_PRELOAD traces itself (torchrun's workers, compile workers): "%p" in the path
//   becomes the process id, so each writes its own file; a process that ran no kernel writes none (a launcher
//   does not overwrite its worker's file).
// - Records CUPTI could not time (start or end 0, as when it runs out of device memory for them) are left out and
//   counted; those and the records CUPTI dropped are reported on stderr at exit.
// - Written at exit (atexit): a process killed by a signal or ended by _exit writes nothing, nor does a child forked
//   without an exec (it would hold a copy of its parent's records and path).
//   cmake --build build --target kernel_trace        (a CUDA build: build/bench/lab/kernel_trace.so), or alone:
//   g++ -O2 -std=c++17 -shared -fPIC -o /tmp/kernel_trace.so bench/lab/kernel_trace.cc -I/usr/local/cuda/include
//       -L/usr/local/cuda/lib64 -L/usr/local/cuda/lib -lcupti -Wl,-rpath,/usr/local/cuda/lib64:/usr/local/cuda/lib
//   RDEP_KERNEL_TRACE=/tmp/trace.%p.tsv LD_PRELOAD=build/bench/lab/kernel_trace.so build/bin/rdep bench gemm ...
//   python3 bench/lab/kernel_trace_summary.py /tmp/trace.<pid>.tsv
#include <cupti.h>
#include <cxxabi.h>
#include <pthread.h>
#include <unistd.h>

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
  size_t name_id;
};

// Everything the callbacks share; leaked, since the atexit handler may run after other statics are gone.
struct State {
  std::mutex mu;
  std::vector<Kernel> kernels;
  std::map<std::string, size_t> ids;  // mangled name -> id: each name demangled and stored once
  std::vector<std::string> names;     // id -> demangled name
  uint64_t untimed = 0;               // records with start or end 0
  uint64_t incomplete_buffers = 0;    // buffers that ended in a record CUPTI had not finished (kernels still running)
  bool read_error = false;
  std::string path;
};
State* g = nullptr;
bool g_forked = false;  // set in a child of fork(): its records are its parent's

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

size_t NameId(const char* mangled) {  // under g->mu
  const std::string key = mangled ? mangled : "?";
  auto [it, fresh] = g->ids.emplace(key, g->names.size());
  if (fresh) g->names.push_back(Demangled(mangled));
  return it->second;
}

// "%p" in the path becomes this process's id.
std::string ExpandPid(std::string path) {
  for (size_t at = path.find("%p"); at != std::string::npos; at = path.find("%p", at))
    path.replace(at, 2, std::to_string(static_cast<long long>(getpid())));
  return path;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g->mu);
  CUpti_Activity* record = nullptr;
  for (;;) {
    const CUptiResult r = cuptiActivityGetNextRecord(buffer, valid, &record);
    if (r == CUPTI_ERROR_MAX_LIMIT_REACHED) break;  // the buffer's end
    if (r == CUPTI_ERROR_INVALID_KIND) {           // an unfinished record (a forced flush while kernels run): the end
      ++g->incomplete_buffers;
      break;
    }
    if (r != CUPTI_SUCCESS) {
      g->read_error = true;
      Ok(r, "cuptiActivityGetNextRecord (the rest of this buffer is lost)");
      break;
    }
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    // The newest kernel record of CUPTI 13; the fields read here are a prefix that later versions keep.
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    if (k->start == 0 || k->end == 0) {
      ++g->untimed;
      continue;
    }
    g->kernels.push_back({k->start, k->end, k->streamId, {k->gridX, k->gridY, k->gridZ}, {k->blockX, k->blockY, k->blockZ},
                          NameId(k->name)});
  }
  std::free(buffer);
}

void ReportLosses() {
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped) == CUPTI_SUCCESS && dropped > 0)
    std::fprintf(stderr, "kernel_trace: CUPTI dropped %zu records (its buffers were full)\n", dropped);
  if (g->untimed > 0)
    std::fprintf(stderr, "kernel_trace: %llu kernel records without a start or end time left out\n",
                 static_cast<unsigned long long>(g->untimed));
  if (g->incomplete_buffers > 0)
    std::fprintf(stderr, "kernel_trace: %llu buffers ended in unfinished records (kernels still running at exit), left out\n",
                 static_cast<unsigned long long>(g->incomplete_buffers));
  if (g->read_error) std::fprintf(stderr, "kernel_trace: records were lost reading a buffer (above)\n");
}

void WriteAtExit() {
  if (g_forked) return;
  Ok(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(g->mu);
  ReportLosses();
  if (g->kernels.empty()) return;  // a launcher that ran no kernel leaves its workers' files alone
  FILE* f = std::fopen(g->path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", g->path.c_str());
    return;
  }
  std::fprintf(f, "start_ns\tend_ns\tstream\tgrid\tblock\tname_id\n");
  for (const Kernel& k : g->kernels)
    std::fprintf(f, "%llu\t%llu\t%u\t%dx%dx%d\t%dx%dx%d\t%zu\n", static_cast<unsigned long long>(k.start),
                 static_cast<unsigned long long>(k.end), k.stream, k.grid[0], k.grid[1], k.grid[2], k.block[0], k.block[1],
                 k.block[2], k.name_id);
  for (size_t i = 0; i < g->names.size(); ++i) std::fprintf(f, "#name\t%zu\t%s\n", i, g->names[i].c_str());
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu kernels written to %s\n", g->kernels.size(), g->path.c_str());
}

__attribute__((constructor)) void Start() {
  const char* path = std::getenv("RDEP_KERNEL_TRACE");
  if (!path || !*path) return;
  g = new State();
  g->path = ExpandPid(path);
  if (!Ok(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted), "cuptiActivityRegisterCallbacks")) return;
  if (!Ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable")) return;
  pthread_atfork(nullptr, nullptr, [] { g_forked = true; });
  std::atexit(WriteAtExit);
}

}  // namespace
