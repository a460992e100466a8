// Checked NCCL calls: a failure becomes rdep::Status (kCudaError) naming the call, file and line,
// NCCL's error string and its last-error message (the NCCL counterpart of RDEP_CUDA_RETURN_IF_ERROR
// in check.h). Only for translation units built with NCCL (RDEP_HAVE_NCCL, nccl.h on the include path).
#pragma once

#include <nccl.h>

#include <string>

#include "rdep/status.h"

namespace rdep::cuda {

inline Status NcclStatus(ncclResult_t res, const char* expr, const char* file, int line) {
  if (res == ncclSuccess) return Status::Ok();
  std::string m = std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " + ncclGetErrorString(res);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') m += std::string(" (") + last + ")";
  return Status(StatusCode::kCudaError, m);
}

}  // namespace rdep::cuda

// The Status of one NCCL call (to end a group before returning its first error).
#define RDEP_NCCL_STATUS(expr) ::rdep::cuda::NcclStatus((expr), #expr, __FILE__, __LINE__)
#define RDEP_NCCL_RETURN_IF_ERROR(expr) RDEP_RETURN_IF_ERROR(RDEP_NCCL_STATUS(expr))
