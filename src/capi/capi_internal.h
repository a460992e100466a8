// What the C ABI's translation units share: the per-thread error message, the exception guard that keeps
// C++ exceptions from crossing the ABI, and the domain handle (rdep_domain) that layers hold.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "rdep/capi.h"
#include "rdep/status.h"
#include "rdep/transport/bootstrap.h"
#include "rdep/transport/domain.h"

// A domain and what it needs to live: the bootstrap of the per-process mode (declared before the domain,
// so it is destroyed after it). Reference-counted: the creator holds one reference and every layer on
// the domain one more (capi.h).
struct rdep_domain {
  rdep_domain_spec spec{};
  std::unique_ptr<rdep::Bootstrap> bootstrap;
  std::unique_ptr<rdep::Domain> domain;
  // One collective on the domain at a time: every layer's calls, and the creation and destruction of
  // its layers (AllocateSymmetric / FreeSymmetric are not callable during Run).
  std::mutex call_mu;
  std::atomic<int32_t> refs{1};
  std::atomic<int32_t> layers{0};
};

namespace rdep::capi {

// The calling thread's last error message (rdep_last_error).
std::string& LastError();

inline int Fail(const Status& s) {
  LastError() = s.message();
  return static_cast<int>(s.code());
}
inline int FailInvalid(const std::string& m) { return Fail(InvalidArgument(m)); }

// Writes s into the caller's buffer (truncated to cap - 1 bytes, NUL-terminated) and its full length
// into *needed: the describe calls' contract.
inline void CopyOutString(const std::string& s, char* buf, size_t cap, size_t* needed) {
  if (needed) *needed = s.size();
  if (buf && cap > 0) {
    const size_t n = s.size() < cap - 1 ? s.size() : cap - 1;
    std::memcpy(buf, s.data(), n);
    buf[n] = '\0';
  }
}

// Runs fn (returning a Status) and turns its error, or any C++ exception, into a code and message.
template <typename Fn>
int Guard(Fn fn) {
  try {
    const Status s = fn();
    if (s.ok()) return 0;
    return Fail(s);
  } catch (const std::bad_alloc&) {
    return Fail(Unavailable("out of host memory"));
  } catch (const std::exception& e) {
    return Fail(InternalError(std::string("unexpected C++ exception: ") + e.what()));
  } catch (...) {
    return Fail(InternalError("unexpected C++ exception"));
  }
}

// The domain fields of a layer spec, as a domain spec (rdep_layer_create's own domain).
rdep_domain_spec DomainSpecOf(const rdep_layer_spec& spec);
// Checks spec (messages start with `what`, e.g. "layer spec") and makes the domain, holding one reference.
StatusOr<rdep_domain*> CreateDomain(const rdep_domain_spec& spec, const std::string& what);
// A layer spec's domain fields against the domain it is created on: InvalidArgument naming the field.
Status CheckLayerOnDomain(const rdep_layer_spec& spec, const rdep_domain& domain);
void RetainDomain(rdep_domain* d);
// Drops a reference; the last one frees the domain.
void ReleaseDomain(rdep_domain* d);

}  // namespace rdep::capi
