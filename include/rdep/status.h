// Status and StatusOr<T>: how every rdep host call reports failure. No exceptions cross the library
// boundary; callers propagate with RDEP_RETURN_IF_ERROR / RDEP_ASSIGN_OR_RETURN.
#pragma once

#include <optional>
#include <ostream>
#include <string>
#include <utility>

namespace rdep {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // a shape, flag or tensor the caller passed is wrong
  kFailedPrecondition,  // a call made in the wrong state (e.g. backward before forward)
  kTimeout,             // a peer did not arrive within the bound
  kUnavailable,         // a backend or device that is not present
  kInternal,            // a violated invariant inside rdep (a bug)
  kCudaError,           // a CUDA/cuBLAS/NCCL/MPI call failed
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;
  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status TimeoutError(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status)  // NOLINT: implicit by design
      : status_(status.ok() ? InternalError("StatusOr constructed from an OK status without a value") : std::move(status)) {}
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  T&& operator*() && { return std::move(*value_); }
  const T& operator*() const& { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace rdep

#define RDEP_CONCAT_INNER_(a, b) a##b
#define RDEP_CONCAT_(a, b) RDEP_CONCAT_INNER_(a, b)

#define RDEP_RETURN_IF_ERROR_IMPL_(tmp, expr) \
  do {                                        \
    ::rdep::Status tmp = (expr);              \
    if (!tmp.ok()) return tmp;                \
  } while (0)
#define RDEP_RETURN_IF_ERROR(expr) RDEP_RETURN_IF_ERROR_IMPL_(RDEP_CONCAT_(rdep_status_, __COUNTER__), expr)

#define RDEP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define RDEP_ASSIGN_OR_RETURN(lhs, expr) \
  RDEP_ASSIGN_OR_RETURN_IMPL_(RDEP_CONCAT_(rdep_statusor_, __COUNTER__), lhs, expr)
