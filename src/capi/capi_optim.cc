// The C ABI's optimizer calls: AdamW over bf16 parameters with fp32 master weights (rdep_master_adamw), and a
// bf16 gradient moved into an fp32 accumulator (rdep_grad_accumulate), on the host (the references) or queued on
// a CUDA stream.
#include <string>
#include <vector>

#include "capi/capi_internal.h"
#include "rdep/optim/grad_accumulate.h"
#include "rdep/optim/master_adamw.h"
#if defined(RDEP_HAVE_CUDA)
#include "rdep/cuda/check.h"
#endif

namespace rdep::capi {
namespace {

optim::MasterTensor TensorOf(const rdep_adamw_tensor& t) {
  return {t.master, t.exp_avg, t.exp_avg_sq, t.grad, static_cast<uint16_t*>(t.param), t.numel,
          static_cast<optim::GradDtype>(t.grad_dtype)};
}

#if defined(RDEP_HAVE_CUDA)
// Every array of tensor `index` (and grad_scale) must be memory of CUDA device `device`.
Status CheckOnDevice(const void* p, int32_t device, const std::string& what) {
  cudaPointerAttributes a{};
  if (const cudaError_t e = cudaPointerGetAttributes(&a, p); e != cudaSuccess) {
    cudaGetLastError();
    return InvalidArgument(what + ": cudaPointerGetAttributes failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
  if ((a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) || a.device != device)
    return InvalidArgument(what + " is not memory of CUDA device " + std::to_string(device));
  return Status::Ok();
}

Status CheckTensorOnDevice(const optim::MasterTensor& t, int32_t index, int32_t device) {
  if (t.numel == 0) return Status::Ok();
  for (const ByteRange& a : optim::ArraysOf(t))
    RDEP_RETURN_IF_ERROR(CheckOnDevice(a.ptr, device, "adamw tensor " + std::to_string(index) + ": " + a.name));
  return Status::Ok();
}

Status RunOnDevice(const std::vector<optim::MasterTensor>& ts, const optim::AdamWCoeffs& c, const rdep_adamw_step& step) {
  int count = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (step.device >= count)
    return InvalidArgument("adamw: device " + std::to_string(step.device) + " does not exist (" + std::to_string(count) + " CUDA devices)");
  for (size_t i = 0; i < ts.size(); ++i) RDEP_RETURN_IF_ERROR(CheckTensorOnDevice(ts[i], static_cast<int32_t>(i), step.device));
  if (step.grad_scale) RDEP_RETURN_IF_ERROR(CheckOnDevice(step.grad_scale, step.device, "adamw: grad_scale"));
  int previous = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  const bool other = previous != step.device;  // switch (and back) only then: no context made on a device not used
  if (other) RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(step.device));
  Status s = Status::Ok();
  for (const optim::MasterTensor& t : ts) {
    s = optim::LaunchMasterAdamW(t, c, step.grad_scale, static_cast<cudaStream_t>(step.stream));
    if (!s.ok()) break;
  }
  if (other) RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(previous));
  return s;
}

// Device checks, the switch to `device` for the launch (and back), for rdep_grad_accumulate.
Status AccumulateOnDevice(const optim::GradAccumulation& a, int32_t device, void* stream) {
  int count = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (device >= count)
    return InvalidArgument("grad accumulate: device " + std::to_string(device) + " does not exist (" + std::to_string(count) + " CUDA devices)");
  if (a.numel == 0) return Status::Ok();
  RDEP_RETURN_IF_ERROR(CheckOnDevice(a.acc, device, "grad accumulate: acc"));
  RDEP_RETURN_IF_ERROR(CheckOnDevice(a.grad, device, "grad accumulate: grad"));
  int previous = 0;
  RDEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  const bool other = previous != device;
  if (other) RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const Status s = optim::LaunchGradAccumulate(a, static_cast<cudaStream_t>(stream));
  if (other) RDEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(previous));
  return s;
}
#else
Status RunOnDevice(const std::vector<optim::MasterTensor>&, const optim::AdamWCoeffs&, const rdep_adamw_step& step) {
  return Unavailable("adamw: device " + std::to_string(step.device) + ": this build of rdep has no CUDA backend (configured without a CUDA compiler)");
}
Status AccumulateOnDevice(const optim::GradAccumulation&, int32_t device, void*) {
  return Unavailable("grad accumulate: device " + std::to_string(device) +
                     ": this build of rdep has no CUDA backend (configured without a CUDA compiler)");
}
#endif

}  // namespace
}  // namespace rdep::capi

int rdep_master_adamw(const rdep_adamw_tensor* tensors, int32_t count, const rdep_adamw_step* step) {
  using namespace rdep;
  if (!step) return capi::FailInvalid("adamw: step must not be null");
  if (count < 0 || (count > 0 && !tensors))
    return capi::FailInvalid("adamw: count must be >= 0 with tensors not null, got count " + std::to_string(count));
  return capi::Guard([&]() -> Status {
    const optim::AdamWHyper h{step->lr, step->beta1, step->beta2, step->eps, step->weight_decay, step->step};
    RDEP_RETURN_IF_ERROR(optim::CheckHyper(h));
    if (step->device < -1) return InvalidArgument("adamw: device must be -1 (host) or a CUDA device, got " + std::to_string(step->device));
    std::vector<optim::MasterTensor> ts;
    for (int32_t i = 0; i < count; ++i) {
      ts.push_back(capi::TensorOf(tensors[i]));
      RDEP_RETURN_IF_ERROR(optim::CheckTensor(ts.back(), i));
      for (int32_t j = 0; j < i; ++j) RDEP_RETURN_IF_ERROR(optim::CheckDisjoint(ts[static_cast<size_t>(j)], j, ts.back(), i));
    }
    const optim::AdamWCoeffs c = optim::Coeffs(h);
    if (step->device >= 0) return capi::RunOnDevice(ts, c, *step);
    for (const optim::MasterTensor& t : ts) optim::MasterAdamWHost(t, c, step->grad_scale);
    return Status::Ok();
  });
}

int rdep_grad_accumulate(float* acc, const void* grad, int64_t numel, int32_t add, int32_t device, void* stream) {
  using namespace rdep;
  return capi::Guard([&]() -> Status {
    if (add != 0 && add != 1) return InvalidArgument("grad accumulate: add must be 0 (copy) or 1 (add), got " + std::to_string(add));
    if (device < -1) return InvalidArgument("grad accumulate: device must be -1 (host) or a CUDA device, got " + std::to_string(device));
    const optim::GradAccumulation a{acc, static_cast<const uint16_t*>(grad), numel, add == 1};
    RDEP_RETURN_IF_ERROR(optim::CheckGradAccumulation(a));
    if (device >= 0) return capi::AccumulateOnDevice(a, device, stream);
    optim::GradAccumulateHost(a);
    return Status::Ok();
  });
}
