// The C ABI's domains (rdep/capi.h, version 4): rdep_domain handles, reference-counted, made from a
// domain spec checked field by field, and the check of a layer spec against the domain it is created on.
// Exercise: build/src/capi/capi_test --gtest_filter='CApiDomain*'
#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "capi/capi_internal.h"
#include "capi/layer_adapter.h"

namespace rdep::capi {

std::string& LastError() {
  thread_local std::string message;
  return message;
}

namespace {

const char* BackendText(int32_t backend) {
  switch (backend) {
    case RDEP_BACKEND_HOST: return "0 (host)";
    case RDEP_BACKEND_CUDA_ONE_PROCESS: return "1 (cuda, one process)";
    case RDEP_BACKEND_CUDA_PER_PROCESS: return "2 (cuda, per process)";
  }
  return "unknown";
}

Status CheckDomainSpec(const rdep_domain_spec& s, const std::string& what) {
  if (s.backend < RDEP_BACKEND_HOST || s.backend > RDEP_BACKEND_CUDA_PER_PROCESS)
    return InvalidArgument(what + ": backend " + std::to_string(s.backend) + " is not 0 (host), 1 (cuda, one process) or 2 (cuda, per process)");
  if (s.world_size < 1) return InvalidArgument(what + ": world_size must be >= 1, got " + std::to_string(s.world_size));
  if (s.backend == RDEP_BACKEND_CUDA_PER_PROCESS && (s.process_rank < 0 || s.process_rank >= s.world_size))
    return InvalidArgument(what + ": process_rank " + std::to_string(s.process_rank) + " outside [0, world_size=" +
                           std::to_string(s.world_size) + ")");
  if (!(s.barrier_timeout_s >= 0) || !std::isfinite(s.barrier_timeout_s))
    return InvalidArgument(what + ": barrier_timeout_s must be finite and >= 0 (0 = the default)");
  if (s.backend == RDEP_BACKEND_CUDA_PER_PROCESS && !s.allgather)
    return InvalidArgument(what + ": allgather is required by the per-process CUDA backend");
  return Status::Ok();
}

}  // namespace

rdep_domain_spec DomainSpecOf(const rdep_layer_spec& spec) {
  rdep_domain_spec d{};
  d.struct_size = sizeof(rdep_domain_spec);
  d.backend = spec.backend;
  d.world_size = spec.world_size;
  d.num_gpus = spec.num_gpus;
  d.process_rank = spec.process_rank;
  d.device = spec.device;
  d.barrier_timeout_s = spec.barrier_timeout_s;
  d.allgather = spec.allgather;
  d.allgather_user = spec.allgather_user;
  return d;
}

StatusOr<rdep_domain*> CreateDomain(const rdep_domain_spec& spec, const std::string& what) {
  RDEP_RETURN_IF_ERROR(CheckDomainSpec(spec, what));
  auto d = std::make_unique<rdep_domain>();
  d->spec = spec;
  DomainSpec ds;
  ds.num_ranks = spec.world_size;
  ds.barrier_timeout_s = spec.barrier_timeout_s > 0 ? spec.barrier_timeout_s : 30.0;
  if (spec.backend == RDEP_BACKEND_HOST) {
    ds.kind = DomainSpec::Kind::kHost;
    RDEP_ASSIGN_OR_RETURN(d->domain, MakeDomain(ds));
  } else {
    if (spec.backend == RDEP_BACKEND_CUDA_PER_PROCESS) {
      rdep_allgather_fn fn = spec.allgather;
      void* user = spec.allgather_user;
      d->bootstrap = std::make_unique<FunctionBootstrap>(
          spec.process_rank, spec.world_size, [fn, user](const void* send, size_t bytes, void* recv) -> Status {
            const int rc = fn(user, send, bytes, recv);
            return rc == 0 ? Status::Ok() : InternalError("layer bootstrap: the caller's allgather failed (" + std::to_string(rc) + ")");
          });
      ds.kind = DomainSpec::Kind::kCudaPerProcess;
      ds.bootstrap = d->bootstrap.get();
      ds.device = spec.device;
    } else {
      ds.kind = DomainSpec::Kind::kCudaOneProcess;
      ds.num_gpus = spec.num_gpus;
    }
    RDEP_ASSIGN_OR_RETURN(d->domain, MakeCudaDomain(ds, what));
  }
  return d.release();
}

Status CheckLayerOnDomain(const rdep_layer_spec& s, const rdep_domain& domain) {
  const rdep_domain_spec& d = domain.spec;
  const std::string who = "layer spec on a domain: ";
  if (s.backend != d.backend)
    return InvalidArgument(who + "backend " + BackendText(s.backend) + " differs from the domain's " + BackendText(d.backend));
  if (s.world_size != d.world_size)
    return InvalidArgument(who + "world_size " + std::to_string(s.world_size) + " differs from the domain's " + std::to_string(d.world_size));
  // The other domain fields: 0 (the domain's) or the domain's value.
  auto same_or_zero = [&](const char* field, auto mine, auto its) -> Status {
    if (mine == decltype(mine){} || mine == its) return Status::Ok();
    std::ostringstream os;
    os << who << field << " " << mine << " differs from the domain's " << its << " (leave it 0 on a layer created on a domain)";
    return InvalidArgument(os.str());
  };
  RDEP_RETURN_IF_ERROR(same_or_zero("num_gpus", s.num_gpus, d.num_gpus));
  RDEP_RETURN_IF_ERROR(same_or_zero("process_rank", s.process_rank, d.process_rank));
  RDEP_RETURN_IF_ERROR(same_or_zero("device", s.device, d.device));
  RDEP_RETURN_IF_ERROR(same_or_zero("barrier_timeout_s", s.barrier_timeout_s, d.barrier_timeout_s));
  if (s.allgather && s.allgather != d.allgather)
    return InvalidArgument(who + "allgather differs from the domain's (leave it null on a layer created on a domain)");
  RDEP_RETURN_IF_ERROR(same_or_zero("allgather_user", s.allgather_user, d.allgather_user));
  return Status::Ok();
}

void RetainDomain(rdep_domain* d) { d->refs.fetch_add(1, std::memory_order_relaxed); }

void ReleaseDomain(rdep_domain* d) {
  if (!d || d->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  try {
    if (d->spec.backend != RDEP_BACKEND_HOST) {
      WithCallerDevice([&] { d->domain.reset(); });  // CUDA teardown selects the ranks' devices
    }
    delete d;
  } catch (...) {
  }
}

}  // namespace rdep::capi

using rdep::capi::FailInvalid;
using rdep::capi::Guard;

extern "C" {

int rdep_domain_create(const rdep_domain_spec* spec, rdep_domain** out) {
  if (!spec || !out) return FailInvalid("spec and out must not be null");
  *out = nullptr;
  if (spec->struct_size != static_cast<int32_t>(sizeof(rdep_domain_spec)))
    return FailInvalid("domain spec: struct_size " + std::to_string(spec->struct_size) + " != " +
                       std::to_string(sizeof(rdep_domain_spec)) + " (caller built against another rdep/capi.h)");
  return Guard([&]() -> rdep::Status {
    RDEP_ASSIGN_OR_RETURN(*out, rdep::capi::CreateDomain(*spec, "domain spec"));
    return rdep::Status::Ok();
  });
}

void rdep_domain_destroy(rdep_domain* domain) { rdep::capi::ReleaseDomain(domain); }

int rdep_domain_local_ranks(const rdep_domain* d, int32_t* first, int32_t* count) {
  if (!d || !first || !count) return FailInvalid("domain, first and count must not be null");
  const std::vector<int32_t> ranks = d->domain->local_ranks();
  *first = ranks.empty() ? 0 : ranks.front();
  *count = static_cast<int32_t>(ranks.size());
  return 0;
}

int rdep_domain_device(const rdep_domain* d, int32_t rank, int32_t* device) {
  if (!d || !device) return FailInvalid("domain and device must not be null");
  for (int32_t r : d->domain->local_ranks())
    if (r == rank) {
      *device = d->spec.backend == RDEP_BACKEND_HOST ? -1 : rdep::capi::CudaDomainDevice(*d->domain, rank);
      return 0;
    }
  return FailInvalid("rank " + std::to_string(rank) + " is not driven by this process");
}

int rdep_domain_num_layers(const rdep_domain* d, int32_t* count) {
  if (!d || !count) return FailInvalid("domain and count must not be null");
  *count = d->layers.load();
  return 0;
}

int rdep_domain_memory(const rdep_domain* d, size_t* symmetric_bytes_per_rank, size_t* shared_bytes_per_rank) {
  if (!d) return FailInvalid("domain is null");
  auto* m = const_cast<rdep_domain*>(d);
  return Guard([&]() -> rdep::Status {
    std::lock_guard<std::mutex> call(m->call_mu);  // not while a layer allocates or frees regions
    if (symmetric_bytes_per_rank) *symmetric_bytes_per_rank = d->domain->symmetric_bytes_per_rank();
    if (shared_bytes_per_rank) *shared_bytes_per_rank = d->domain->shared_bytes_per_rank();
    return rdep::Status::Ok();
  });
}

int rdep_domain_describe(const rdep_domain* d, char* buf, size_t cap, size_t* needed) {
  if (!d) return FailInvalid("domain is null");
  return Guard([&]() -> rdep::Status {
    std::ostringstream os;
    os << d->domain->backend_name() << " domain, W=" << d->domain->num_ranks() << ": " << d->domain->placement() << " ("
       << d->domain->transport_name() << ")";
    rdep::capi::CopyOutString(os.str(), buf, cap, needed);
    return rdep::Status::Ok();
  });
}

}  // extern "C"
