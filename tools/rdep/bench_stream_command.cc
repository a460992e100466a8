// `rdep bench stream`: the weight-distribution kernel of balancing (rdep/dispatch/weight_stream.h) on
// one GPU: experts' weights streamed in tiles to R replica slots, each source tile read once and stored
// to every slot. Baseline in the same run: one cudaMemcpyAsync (device to device) per destination, the
// device's copy rate. Slots on the same GPU stand for ranks sharing it; NVLink figures belong to the
// multi-GPU run. Example:
//   rdep bench stream --hidden 2048 --ffn 1408 --experts 4 --replicas 1,2,4,8 --json stream.json
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "build_commit.h"
#include "cli.h"

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>

#include "bench_util.h"
#include "rdep/core/json.h"
#include "rdep/core/stats.h"
#include "rdep/cuda/check.h"
#include "rdep/dispatch/weight_stream.h"
#endif

namespace {

using rdep::cli::Args;

constexpr const char* kHelp = R"(usage: rdep bench stream [flags]

The weight-distribution kernel on one GPU: --experts experts of 3*H*D_ff bf16 weights each, every one
streamed to R replica slots (R from --replicas) by one launch; the baseline, in the same run, copies
the same bytes with one cudaMemcpyAsync per destination. Prints p50/p99 microseconds (CUDA events,
one stream) and bytes written per second (experts * 3*H*D_ff*2 * R over the p50), and checks that
every slot holds its expert's weights. CUDA builds only.

flags [defaults]:
  --hidden H          [2048]
  --ffn F             [1408]
  --experts N         replicated experts per launch [4]
  --replicas R,R,...  destinations per expert, each in [1, 64] [1,2,4,8]
  --tile-kib K        tile size in KiB [64]
  --blocks B          persistent blocks (0 = two per SM) [0]
  --warmup N          [5]
  --iters N           [50]
  --json FILE         write a JSON receipt
  -h, --help          this page
)";

int Fail(const std::string& m) {
  std::cerr << "rdep bench stream: " << m << "\n";
  return 2;
}

#if defined(RDEP_HAVE_CUDA)

struct StreamRow {
  int64_t replicas = 0;
  double bytes_written = 0;
  std::vector<double> kernel_ms, copy_ms;
  bool correct = false;
};

// Times `fn` (enqueues on `s`) warmup + iters times with events; milliseconds per iteration.
template <typename Fn>
rdep::StatusOr<std::vector<double>> TimeOnStream(cudaStream_t s, int64_t warmup, int64_t iters, Fn&& fn) {
  cudaEvent_t a, b;
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&a));
  RDEP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int64_t i = 0; i < warmup + iters; ++i) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(a, s));
    RDEP_RETURN_IF_ERROR(fn());
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(b, s));
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b));
    float t = 0;
    RDEP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t, a, b));
    if (i >= warmup) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

// One row: N experts to R slots each; the slots are one arena after the sources.
rdep::StatusOr<StreamRow> MeasureStream(unsigned char* src, unsigned char* slots, int64_t experts, int64_t bytes, int64_t R,
                                        int64_t tile, int blocks, int64_t warmup, int64_t iters, cudaStream_t s) {
  std::vector<rdep::dispatch::StreamJob> jobs;
  for (int64_t e = 0; e < experts; ++e) {
    rdep::dispatch::StreamJob j{src + e * bytes, bytes, {}};
    for (int64_t r = 0; r < R; ++r) j.dst.push_back(slots + (e * R + r) * bytes);
    jobs.push_back(j);
  }
  RDEP_ASSIGN_OR_RETURN(auto plan, rdep::dispatch::StreamPlan::Create(jobs, tile));
  StreamRow row;
  row.replicas = R;
  row.bytes_written = static_cast<double>(plan.bytes_written());
  RDEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(slots, 0, static_cast<size_t>(experts * R * bytes), s));
  RDEP_ASSIGN_OR_RETURN(row.kernel_ms, TimeOnStream(s, warmup, iters, [&] { return plan.Launch(s, blocks); }));
  // Every slot holds its expert's bytes: compare the first and last slot of each expert on the host.
  std::vector<unsigned char> want(static_cast<size_t>(bytes)), got(static_cast<size_t>(bytes));
  row.correct = true;
  for (int64_t e = 0; e < experts && row.correct; ++e) {
    RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(want.data(), src + e * bytes, want.size(), cudaMemcpyDeviceToHost));
    for (int64_t r : {int64_t{0}, R - 1}) {
      RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(got.data(), slots + (e * R + r) * bytes, got.size(), cudaMemcpyDeviceToHost));
      row.correct = row.correct && std::memcmp(want.data(), got.data(), want.size()) == 0;
    }
  }
  RDEP_ASSIGN_OR_RETURN(row.copy_ms, TimeOnStream(s, warmup, iters, [&]() -> rdep::Status {
    for (const auto& j : jobs)
      for (void* d : j.dst) RDEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d, j.src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
    return rdep::Status::Ok();
  }));
  return row;
}

void WriteStreamReceipt(const std::string& path, int64_t H, int64_t F, int64_t experts, int64_t tile, int blocks,
                        const std::vector<StreamRow>& rows) {
  rdep::JsonWriter j;
  j.begin_object().field("tool", "rdep bench stream");
  rdep::bench::WriteEnvironment(j, 1);
  j.key("config").begin_object().field("hidden", H).field("ffn", F).field("experts", experts);
  j.field("expert_bytes", 3 * H * F * 2).field("tile_bytes", tile).field("blocks", static_cast<int64_t>(blocks)).end_object();
  j.field("note", "slots on one GPU (ranks sharing it): a copy-efficiency proxy, not NVLink");
  j.key("rows").begin_array();
  for (const auto& r : rows) {
    const double k50 = rdep::Summarize(r.kernel_ms).p50, c50 = rdep::Summarize(r.copy_ms).p50;
    j.begin_object().field("replicas", r.replicas).field("bytes_written", r.bytes_written).field("correct", r.correct);
    j.field("kernel_gb_per_s", r.bytes_written / (k50 * 1e-3) / 1e9).field("memcpy_gb_per_s", r.bytes_written / (c50 * 1e-3) / 1e9);
    rdep::bench::WriteSummary(j, "kernel", r.kernel_ms);
    rdep::bench::WriteSummary(j, "memcpy_baseline", r.copy_ms);
    j.end_object();
  }
  j.end_array().end_object();
  rdep::bench::WriteFile(path, j.str() + "\n");
}

int RunStreamBench(const Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  rdep::cli::Flags f(args);
  const int64_t H = f.get_int("hidden", 2048), F = f.get_int("ffn", 1408), experts = f.get_int("experts", 4);
  auto reps = rdep::cli::ParseList<int64_t>("replicas", f.get_string("replicas", "1,2,4,8"));
  const int64_t tile_kib = f.get_int("tile-kib", 64), blocks = f.get_int("blocks", 0);
  const int64_t warmup = f.get_int("warmup", 5), iters = f.get_int("iters", 50);
  const std::string json = f.get_string("json", "");
  if (auto st = f.Finish(); !st.ok()) return Fail(st.message() + "\n(see rdep bench stream --help)");
  if (!f.positional().empty()) return Fail("unexpected argument '" + f.positional().front() + "'");
  if (!reps.ok()) return Fail(reps.status().message());
  if (H < 1 || H > 65536 || F < 1 || F > 65536) return Fail("--hidden and --ffn must be in [1, 65536]");
  if (experts < 1 || experts > 1024) return Fail("--experts must be in [1, 1024]");
  for (int64_t r : *reps)
    if (r < 1 || r > 64) return Fail("--replicas: each count must be in [1, 64], got " + std::to_string(r));
  if (tile_kib < 1 || tile_kib > 65536) return Fail("--tile-kib must be in [1, 65536]");
  if (blocks < 0 || blocks > 65536) return Fail("--blocks must be in [0, 65536]");
  if (warmup < 0 || warmup > 10000 || iters < 1 || iters > 100000) return Fail("--warmup in [0, 10000], --iters in [1, 100000]");
  if (!json.empty())
    if (auto st = rdep::cli::CheckOutputPath("json", json); !st.ok()) return Fail(st.message());
  const int64_t bytes = 3 * H * F * 2, rmax = *std::max_element(reps->begin(), reps->end());
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return Fail("no CUDA device");
  const double need = static_cast<double>(experts) * static_cast<double>(bytes) * static_cast<double>(1 + rmax);
  if (need > 0.9 * static_cast<double>(free_b))
    return Fail("needs " + std::to_string(need / (1 << 30)) + " GiB of device memory (--experts x 3*H*D_ff*2 x (1 + max --replicas)); " +
                std::to_string(static_cast<double>(free_b) / (1 << 30)) + " GiB free");
  unsigned char *src = nullptr, *slots = nullptr;
  if (cudaMalloc(&src, static_cast<size_t>(experts * bytes)) != cudaSuccess ||
      cudaMalloc(&slots, static_cast<size_t>(experts * rmax * bytes)) != cudaSuccess)
    return Fail("device allocation failed");
  std::vector<unsigned char> init(static_cast<size_t>(experts * bytes));
  for (size_t i = 0; i < init.size(); ++i) init[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
  cudaMemcpy(src, init.data(), init.size(), cudaMemcpyHostToDevice);
  cudaStream_t s;
  cudaStreamCreate(&s);
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  std::printf("weight stream on %s (%d SMs): %lld experts of %.2f MiB (H=%lld, D_ff=%lld, bf16), tile %lld KiB, %s blocks\n",
              p.name, p.multiProcessorCount, static_cast<long long>(experts), static_cast<double>(bytes) / (1 << 20),
              static_cast<long long>(H), static_cast<long long>(F), static_cast<long long>(tile_kib),
              blocks ? std::to_string(blocks).c_str() : "2/SM");
  std::printf("  %8s %12s %12s %10s %12s %12s %10s %8s\n", "replicas", "kernel p50", "kernel p99", "GB/s", "memcpy p50",
              "memcpy p99", "GB/s", "correct");
  std::vector<StreamRow> rows;
  for (int64_t R : *reps) {
    auto row = MeasureStream(src, slots, experts, bytes, R, tile_kib * 1024, static_cast<int>(blocks), warmup, iters, s);
    if (!row.ok()) return Fail(row.status().message());
    const auto k = rdep::Summarize(row->kernel_ms), c = rdep::Summarize(row->copy_ms);
    std::printf("  %8lld %12.1f %12.1f %10.1f %12.1f %12.1f %10.1f %8s\n", static_cast<long long>(R), 1e3 * k.p50, 1e3 * k.p99,
                row->bytes_written / (k.p50 * 1e-3) / 1e9, 1e3 * c.p50, 1e3 * c.p99, row->bytes_written / (c.p50 * 1e-3) / 1e9,
                row->correct ? "yes" : "NO");
    rows.push_back(std::move(*row));
  }
  std::printf("(us; GB/s = bytes written / p50; one GPU, slots in its own memory: not NVLink)\n");
  if (!json.empty()) WriteStreamReceipt(json, H, F, experts, tile_kib * 1024, static_cast<int>(blocks), rows);
  cudaFree(src);
  cudaFree(slots);
  cudaStreamDestroy(s);
  for (const auto& r : rows)
    if (!r.correct) return 1;
  return 0;
}

#else  // !RDEP_HAVE_CUDA

int RunStreamBench(const Args& args) {
  if (rdep::cli::WantsHelp(args)) {
    std::cout << kHelp;
    return 0;
  }
  return Fail("this rdep was built without CUDA (reconfigure with a CUDA compiler)");
}

#endif

const bool kRegistered = rdep::cli::RegisterBench(
    {"stream", "the weight-distribution kernel of balancing: GB/s to R replicas vs cudaMemcpy (one GPU)", &RunStreamBench});

}  // namespace
