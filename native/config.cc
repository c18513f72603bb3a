#include "config.h"

#include <cstdlib>
#include <string>

namespace unison {
namespace {

// The first of the names that is set, or nullptr.
const char* lookup(const char* unison_name, const char* horovod_name) {
  const char* value = std::getenv(unison_name);
  if (value == nullptr && horovod_name != nullptr) value = std::getenv(horovod_name);
  return (value != nullptr && *value != '\0') ? value : nullptr;
}

void read_int(int* field, const char* unison_name, const char* horovod_name = nullptr) {
  if (const char* v = lookup(unison_name, horovod_name)) *field = std::atoi(v);
}

void read_size(size_t* field, const char* unison_name, const char* horovod_name = nullptr) {
  if (const char* v = lookup(unison_name, horovod_name)) *field = (size_t)std::strtoull(v, nullptr, 10);
}

void read_double(double* field, const char* unison_name, const char* horovod_name = nullptr) {
  if (const char* v = lookup(unison_name, horovod_name)) *field = std::strtod(v, nullptr);
}

// Tasks on node `node` from SLURM's compressed list: "2(x3),1" is three
// nodes with 2 tasks, then one with 1.
int slurm_tasks_on_node(const std::string& list, int node) try {
  size_t at = 0;
  while (at < list.size()) {
    size_t used = 0;
    const int tasks = std::stoi(list.substr(at), &used);
    at += used;
    int repeat = 1;
    if (list.compare(at, 2, "(x") == 0) {
      repeat = std::stoi(list.substr(at + 2), &used);
      at += 2 + used + 1;  // past the ')'
    }
    if (node < repeat) return tasks;
    node -= repeat;
    at += 1;  // past the ','
  }
  return 0;
} catch (const std::exception&) {
  return 0;  // not SLURM's format: the MPI backend finds the real figure
}

// The identity an MPI launcher or srun gives its processes. MPI's own answer
// is what the job runs on; these tell init() which launcher it is under.
void read_launcher_identity(Config* c) {
  struct Launcher {
    const char *name, *rank, *size, *local_rank, *local_size;
  };
  static const Launcher kMpiLaunchers[] = {
      {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      // Hydra's PMI variables: MPICH, Intel MPI, MVAPICH.
      {"MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
  };
  for (const Launcher& l : kMpiLaunchers) {
    if (lookup(l.rank, nullptr) == nullptr) continue;
    c->mpi_launcher = l.name;
    read_int(&c->rank, l.rank);
    read_int(&c->size, l.size);
    c->local_rank = c->rank, c->local_size = c->size;
    read_int(&c->local_rank, l.local_rank);
    read_int(&c->local_size, l.local_size);
    return;
  }
  // srun, not the batch script: only a job step has SLURM_STEP_NUM_TASKS.
  if (lookup("SLURM_STEP_NUM_TASKS", nullptr) != nullptr && lookup("SLURM_PROCID", nullptr) != nullptr) {
    c->mpi_launcher = "SLURM";
    read_int(&c->rank, "SLURM_PROCID");
    read_int(&c->size, "SLURM_STEP_NUM_TASKS");
    c->local_rank = c->rank, c->local_size = c->size;
    read_int(&c->local_rank, "SLURM_LOCALID");
    int node = 0;
    read_int(&node, "SLURM_NODEID");
    if (const char* list = lookup("SLURM_STEP_TASKS_PER_NODE", nullptr)) c->local_size = slurm_tasks_on_node(list, node);
  }
}

}  // namespace

Config Config::from_environment() {
  Config c;
  if (lookup("UNISON_RANK", "HOROVOD_RANK") == nullptr) read_launcher_identity(&c);
  read_int(&c.rank, "UNISON_RANK", "HOROVOD_RANK");
  read_int(&c.size, "UNISON_SIZE", "HOROVOD_SIZE");
  if (c.mpi_launcher.empty()) {
    c.local_rank = c.rank;
    c.local_size = c.size;
  }
  read_int(&c.local_rank, "UNISON_LOCAL_RANK", "HOROVOD_LOCAL_RANK");
  read_int(&c.local_size, "UNISON_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE");
  read_int(&c.cross_rank, "UNISON_CROSS_RANK", "HOROVOD_CROSS_RANK");
  read_int(&c.cross_size, "UNISON_CROSS_SIZE", "HOROVOD_CROSS_SIZE");
  if (const char* v = lookup("UNISON_JOB_ID", nullptr)) c.job_id = v;
  if (const char* v = lookup("UNISON_HOSTNAME", "HOROVOD_HOSTNAME")) c.hostname = v;
  int hierarchical = 1;
  read_int(&hierarchical, "UNISON_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE");
  c.hierarchical = hierarchical != 0;

  read_size(&c.fusion_threshold_bytes, "UNISON_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD");
  read_double(&c.cycle_time_ms, "UNISON_CYCLE_TIME", "HOROVOD_CYCLE_TIME");
  read_int(&c.cache_capacity, "UNISON_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY");
  int disable = 0;
  read_int(&disable, "UNISON_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE");
  c.stall_check_enabled = disable == 0;
  read_double(&c.stall_warning_seconds, "UNISON_STALL_CHECK_TIME_SECONDS",
              "HOROVOD_STALL_CHECK_TIME_SECONDS");
  read_double(&c.stall_shutdown_seconds, "UNISON_STALL_SHUTDOWN_TIME_SECONDS",
              "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS");
  read_double(&c.peer_timeout_seconds, "UNISON_PEER_TIMEOUT_SECONDS");
  read_double(&c.start_timeout_seconds, "UNISON_START_TIMEOUT", "HOROVOD_START_TIMEOUT");
  read_size(&c.shm_slot_bytes, "UNISON_SHM_SLOT_BYTES");
  read_size(&c.control_message_bytes, "UNISON_CONTROL_MESSAGE_BYTES");
  read_size(&c.small_allreduce_bytes, "UNISON_SMALL_ALLREDUCE_BYTES");
  read_double(&c.spin_microseconds, "UNISON_SPIN_MICROSECONDS");
  read_int(&c.log_level, "UNISON_LOG_LEVEL", "HOROVOD_LOG_LEVEL");

  if (c.cache_capacity < 0) c.cache_capacity = 0;
  if (c.shm_slot_bytes < 4096) c.shm_slot_bytes = 4096;
  if (c.control_message_bytes < 4096) c.control_message_bytes = 4096;
  return c;
}

}  // namespace unison
