// Bootstrap: how the ranks of a multi-process domain exchange the few bytes they need at setup
// (memory handles, configuration fingerprints). It is one collective: an allgather of bytes. rdep
// ships an MPI implementation; a framework plugs in its own (torch.distributed: all_gather of a byte
// tensor) through FunctionBootstrap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "rdep/status.h"

namespace rdep {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  // Every rank contributes `bytes` bytes; recv receives size()*bytes, rank-major. Collective.
  virtual Status AllGather(const void* send, size_t bytes, void* recv) = 0;
  // Ranks on this host, when the launcher says (OMPI_COMM_WORLD_LOCAL_RANK, LOCAL_RANK); else rank().
  virtual int32_t local_rank() const;
};

// A caller-supplied allgather.
class FunctionBootstrap final : public Bootstrap {
 public:
  using AllGatherFn = std::function<Status(const void* send, size_t bytes, void* recv)>;
  FunctionBootstrap(int32_t rank, int32_t size, AllGatherFn fn) : rank_(rank), size_(size), fn_(std::move(fn)) {}
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  Status AllGather(const void* send, size_t bytes, void* recv) override { return fn_(send, bytes, recv); }

 private:
  int32_t rank_, size_;
  AllGatherFn fn_;
};

// MPI_COMM_WORLD (initializing MPI if needed). Unavailable in a build without MPI.
StatusOr<std::unique_ptr<Bootstrap>> MakeMpiBootstrap();
bool LaunchedUnderMpi();  // OMPI_COMM_WORLD_SIZE / PMI_SIZE set by the launcher

// All ranks' variable-size byte strings (two allgathers: sizes, then padded payloads).
StatusOr<std::vector<std::vector<uint8_t>>> AllGatherBytes(Bootstrap& boot, const std::vector<uint8_t>& mine);

// Checks that every rank passed the same bytes; on a mismatch names the first differing rank and
// `what` (e.g. "layer config"), with each side's description from describe(bytes).
Status AgreeAcrossRanks(Bootstrap& boot, const std::vector<uint8_t>& mine, const std::string& what,
                        const std::function<std::string(const std::vector<uint8_t>&)>& describe);

}  // namespace rdep
