// The MPI bootstrap (MPI_COMM_WORLD). Built when CMake finds MPI.
#include <mpi.h>

#include "rdep/transport/bootstrap.h"

namespace rdep {
namespace {

class MpiBootstrap final : public Bootstrap {
 public:
  MpiBootstrap(int32_t rank, int32_t size) : rank_(rank), size_(size) {}
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  Status AllGather(const void* send, size_t bytes, void* recv) override {
    if (bytes > static_cast<size_t>(INT32_MAX)) return InvalidArgument("mpi bootstrap: allgather of more than 2 GiB");
    const int rc = MPI_Allgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return Status(StatusCode::kUnavailable, "MPI_Allgather failed with code " + std::to_string(rc));
    return Status::Ok();
  }

 private:
  int32_t rank_, size_;
};

}  // namespace

StatusOr<std::unique_ptr<Bootstrap>> MakeMpiBootstrap() {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      return Unavailable("MPI_Init_thread failed");
    std::atexit([] {
      int fin = 0;
      MPI_Finalized(&fin);
      if (!fin) MPI_Finalize();
    });
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::unique_ptr<Bootstrap>(new MpiBootstrap(rank, size));
}

}  // namespace rdep
