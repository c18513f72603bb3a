// backend.cc: which backend a process starts with. The only place that
// knows every backend; each backend folder exposes `<name>_backend_available`
// and `make_<name>_backend` (backend.h) and nothing else.
#include <string>

#include "backend.h"

namespace unison {

bool mpi_carries_job(const Config& config) { return config.size > 1 && !config.mpi_launcher.empty(); }

Status make_backend(Config* config, int generation, std::unique_ptr<Backend>* out) {
  // A job started by mpirun or srun: MPI says who is where and carries the
  // bytes between hosts (mpi/world.cc picks flat or hierarchical).
  if (mpi_carries_job(*config)) return make_mpi_backend(config, generation, out);
  if (config->size == 1) return make_solo_backend(*config, generation, out);
  // A job started by unisonrun across hosts: a rendezvous to meet at.
  if (!config->rendezvous_address.empty()) return make_tcp_backend(config, generation, out);
  if (config->local_size != config->size)
    return Status::Error(UNISON_ERR_UNSUPPORTED,
                         "unison: UNISON_SIZE is " + std::to_string(config->size) + " but UNISON_LOCAL_SIZE is " +
                             std::to_string(config->local_size) +
                             " and no rendezvous is set (UNISON_RENDEZVOUS_ADDR); a job across hosts starts with "
                             "`unisonrun -H` (or mpirun/srun)");
  return make_shm_backend(*config, generation, out);
}

std::string built_backends() {
  std::string names;
  if (solo_backend_available()) names += "solo";
  if (shm_backend_available()) names += ",shm";
  if (tcp_backend_available()) names += ",tcp";
  if (mpi_backend_available()) names += ",mpi";
  return names;
}

}  // namespace unison
