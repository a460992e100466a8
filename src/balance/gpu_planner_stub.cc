// The GPU planner's entry points in a build without CUDA: they report Unavailable.
#include "rdep/balance/gpu_planner.h"

namespace rdep {

bool GpuPlannerAvailable(std::string* why) {
  if (why) *why = "rdep was built without CUDA (RDEP_ENABLE_CUDA=OFF or no nvcc)";
  return false;
}

StatusOr<GpuPlannerConfig> GpuPlannerCanImplement(int32_t, int32_t, int32_t) {
  return Unavailable("GPU planner: rdep was built without CUDA");
}

StatusOr<BalancePlan> SolveQuotaPlanGpu(const std::vector<int64_t>&, const OwnershipMap&, const QuotaConfig&) {
  return Unavailable("GPU planner: rdep was built without CUDA");
}

StatusOr<GpuPlannerTiming> BenchQuotaPlanGpu(const std::vector<int64_t>&, const OwnershipMap&, const QuotaConfig&,
                                             int32_t, int32_t) {
  return Unavailable("GPU planner: rdep was built without CUDA");
}

struct DevicePlanner::Impl {};
DevicePlanner::DevicePlanner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DevicePlanner::~DevicePlanner() = default;
StatusOr<std::unique_ptr<DevicePlanner>> DevicePlanner::Create(const OwnershipMap&, const QuotaConfig&) {
  return Unavailable("GPU planner: rdep was built without CUDA");
}
Status DevicePlanner::Solve(const int64_t*, int64_t, CUstream_st*) { return Unavailable("GPU planner: rdep was built without CUDA"); }
DevicePlanView DevicePlanner::view() const { return {}; }
StatusOr<BalancePlan> DevicePlanner::Download(CUstream_st*) const { return Unavailable("GPU planner: rdep was built without CUDA"); }

Status LaunchAssignInstances(const DevicePlanView&, int32_t, int32_t, const int32_t*, const int32_t*, int64_t, const int32_t*,
                             int32_t, uint8_t*, int32_t*, int32_t*, CUstream_st*) {
  return Unavailable("assign instances: rdep was built without CUDA");
}

Status LaunchPlanRelays(const DevicePlanView&, int32_t, int32_t, int32_t, int64_t, double*, int32_t*, int32_t*, int32_t*, int64_t*, int32_t*,
                        CUstream_st*) {
  return Unavailable("plan relays: rdep was built without CUDA");
}

Status LaunchStreamReplicaWeights(const DevicePlanView&, int32_t, int32_t, const int32_t*, const int32_t*, const void*, int64_t,
                                  const void*, int64_t, unsigned char* const*, int64_t, int, CUstream_st*, const DeviceRelayView&) {
  return Unavailable("stream replicas: rdep was built without CUDA");
}

Status LaunchRelayReplicaChunks(const DevicePlanView&, const DeviceRelayView&, int32_t, int32_t, int64_t, unsigned char* const*, int64_t, int,
                                CUstream_st*) {
  return Unavailable("relay replicas: rdep was built without CUDA");
}

Status LaunchReduceReplicaGradients(const DevicePlanView&, int32_t, int32_t, const int32_t*, const int32_t*, float*, int64_t, float*,
                                    int64_t, const float* const*, CUstream_st*) {
  return Unavailable("reduce replicas: rdep was built without CUDA");
}

}  // namespace rdep
