// Compiled instead of the rest of this folder when no MPI was found at
// build time (build_ffi.py): asking for MPI says how to get it.
#include "../backend.h"

namespace unison {

bool mpi_backend_available() { return false; }
bool mpi_lets_every_thread_call() { return false; }

Status make_mpi_backend(Config* config, int, std::unique_ptr<Backend>*) {
  return Status::Error(
      UNISON_ERR_UNSUPPORTED,
      "unison: this process was started by " + config->mpi_launcher + " as rank " + std::to_string(config->rank) +
          " of " + std::to_string(config->size) +
          ", but this unison was built without MPI (no mpicc was on PATH when it was installed). Install an MPI "
          "(`pip install mpich`, or `apt install libopenmpi-dev openmpi-bin`), then reinstall unison with its mpicc "
          "on PATH (`UNISON_WITH_MPI=1 pip install --no-build-isolation -e .` in a checkout); `unisonrun "
          "--check-build` then lists MPI. Within one host, `unisonrun -np N` needs no MPI at all.");
}

}  // namespace unison
