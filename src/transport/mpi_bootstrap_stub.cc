// Builds without MPI: the MPI bootstrap is reported as unavailable.
#include "rdep/transport/bootstrap.h"

namespace rdep {

StatusOr<std::unique_ptr<Bootstrap>> MakeMpiBootstrap() {
  return Unavailable("this build of rdep has no MPI bootstrap (configured without MPI); use a FunctionBootstrap");
}

}  // namespace rdep
