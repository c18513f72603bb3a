// Starts MPI, learns from it who is where, and picks the backend:
//   one host                          shared memory alone (nothing crosses a host)
//   several hosts, the same number of ranks on each, hierarchical on
//                                     shared memory within hosts, MPI across
//   otherwise                         MPI between every pair of ranks (flat)
#include "world.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "../hierarchical.h"
#include "../log.h"
#include "../signals.h"
#include "../start_abort.h"
#include "communicator.h"

namespace unison {
namespace {

std::atomic<bool> broken{false};
pid_t mpi_started_in = 0;

// MPI_Finalize waits for every other rank to finalize too. A process that
// is failing (non-zero exit status) must not wait for ranks that may run on
// for hours: it leaves without, and mpirun ends the job because of it. A
// process forked from the rank inherits this handler and MPI's state, and
// its MPI_Finalize would speak for the rank on the rank's own connection to
// mpirun, which mpirun then closes under the rank; so only the process that
// started MPI finalizes it.
void finalize_at_exit(int status, void*) {
  if (getpid() != mpi_started_in) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && status == 0 && !broken.load()) MPI_Finalize();
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    default: return "MPI_THREAD_MULTIPLE";
  }
}

// MPI_Init_thread, watched. Both MPICH and Open MPI wait inside MPI_Init
// until every rank of the job has called it (they exchange addresses there),
// and nothing bounds that wait: a rank that never calls init() would hold
// the others in MPI_Init for ever, whatever UNISON_START_TIMEOUT says. So MPI
// starts on a thread of its own, and init() waits for that thread as long as
// the start timeout allows. Past it, init() fails naming the setting, and the
// thread stays inside MPI, where nothing can end it. The process remains
// usable for everything but MPI: the next init() waits for the same MPI_Init
// again (a rank that was only slow arrives then), and exiting ends the thread,
// whereupon mpirun ends the job. The one thing this changes for the
// application: MPI_Is_thread_main is now true on that thread, not on Python's.
struct MpiStart {
  std::mutex mutex;
  std::condition_variable done_changed;
  bool done = false;
  int rc = MPI_SUCCESS;
};
std::shared_ptr<MpiStart> mpi_starting;  // the MPI_Init under way or finished; set once, by init's thread

Status wait_for_mpi_init(const std::shared_ptr<MpiStart>& start, double timeout_seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  std::unique_lock<std::mutex> lock(start->mutex);
  while (!start->done) {
    // In slices, so that an aborted start-up (start_abort.h) ends the wait too.
    Status aborted = start_up_aborted();
    if (!aborted.ok()) return aborted;
    if (std::chrono::steady_clock::now() >= deadline)
      return Status::Error(UNISON_ERR_RANK_FAILED,
                           "unison: MPI_Init did not return within " + std::to_string((int)timeout_seconds) +
                               " s (UNISON_START_TIMEOUT): not every rank of the job called init(); this rank "
                               "cannot use MPI until they do");
    start->done_changed.wait_for(lock, std::chrono::milliseconds(20));
  }
  if (start->rc != MPI_SUCCESS) return mpi_error("MPI_Init_thread", start->rc);
  return Status::OK();
}

// MPI_Init once per process. unison's background thread makes MPI calls,
// so it needs at least MPI_THREAD_SERIALIZED; it asks for MULTIPLE so that
// an application using MPI itself (mpi4py) may do so from any thread, and
// the thread that finalizes MPI at exit need not be the one that started it.
Status start_mpi(const Config& config) {
  int initialized = 0, finalized = 0;
  if (mpi_starting == nullptr) {  // MPI_Initialized must not run beside a MPI_Init
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized)
      return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: MPI has been finalized in this process and cannot be "
                                                   "started again; leave MPI_Finalize to unison (it runs at exit)");
    if (!initialized) {
      auto start = std::make_shared<MpiStart>();
      {
        AsyncSignalsBlocked blocked;  // for this thread and those MPI starts (signals.h)
        std::thread([start] {
          int provided = 0;
          const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
          std::lock_guard<std::mutex> lock(start->mutex);
          start->rc = rc;
          start->done = true;
          start->done_changed.notify_all();
        }).detach();
      }
      mpi_starting = start;
    }
  }
  if (mpi_starting != nullptr) {
    Status s = wait_for_mpi_init(mpi_starting, config.start_timeout_seconds);
    if (!s.ok()) return s;
    if (mpi_started_in == 0) {
      mpi_started_in = getpid();
      on_exit(finalize_at_exit, nullptr);  // glibc's atexit that is told the exit status
    }
  }
  int level = 0;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_SERIALIZED)
    return Status::Error(UNISON_ERR_UNSUPPORTED,
                         std::string("unison: MPI runs at ") + thread_level_name(level) +
                             ", but unison's background thread calls MPI and needs MPI_THREAD_SERIALIZED or "
                             "MPI_THREAD_MULTIPLE; if the application initializes MPI, ask for MPI_THREAD_MULTIPLE");
  return Status::OK();
}

// Start-up waits for every rank to call init, which may take a while
// (imports), but not for ever.
Status wait_for_start(MPI_Request* request, const Config& config) {
  Status s = mpi_wait(request, "start-up", config.start_timeout_seconds, nullptr, config.spin_microseconds * 1e-6, true);
  if (s.code == UNISON_ERR_RANK_FAILED && s.message.find("no answer") != std::string::npos)
    s.message = "unison: not every rank called init() within " + std::to_string((int)config.start_timeout_seconds) +
                " s (UNISON_START_TIMEOUT)";
  return s;
}

// Every rank's host name and pid. This and the job id go over
// MPI_COMM_WORLD itself: they come before any communicator of unison's.
Status learn_world(const Config& config, MpiWorld* world) {
  struct Identity {
    char host[256];
    int64_t pid;
  };
  Identity mine{};
  std::string host = config.hostname;
  if (host.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  std::strncpy(mine.host, host.c_str(), sizeof(mine.host) - 1);
  mine.pid = getpid();
  MPI_Comm_rank(MPI_COMM_WORLD, &world->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world->size);
  std::vector<Identity> all(world->size);
  MPI_Request request;
  int rc = MPI_Iallgather(&mine, sizeof(Identity), MPI_BYTE, all.data(), sizeof(Identity), MPI_BYTE, MPI_COMM_WORLD,
                          &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Iallgather of host names", rc);
  Status s = wait_for_start(&request, config);
  if (!s.ok()) return s;
  std::vector<std::string> names;
  for (const Identity& id : all) {
    std::string name(id.host, strnlen(id.host, sizeof(id.host)));
    int h = 0;
    while (h < (int)names.size() && names[h] != name) ++h;
    if (h == (int)names.size()) {
      names.push_back(name);
      world->host_ranks.emplace_back();
    }
    world->host_ranks[h].push_back((int)world->host.size());
    world->host.push_back(h);
    world->pid.push_back((int)id.pid);
  }
  return Status::OK();
}

// One name for the job's shared memory, chosen by rank 0.
Status agree_on_job_id(const Config& config, const MpiWorld& world, std::string* job_id) {
  char id[64] = {0};
  if (world.rank == 0) {
    std::random_device random;
    std::snprintf(id, sizeof(id), "mpi%d-%08x", (int)getpid(), (unsigned)random());
  }
  MPI_Request request;
  int rc = MPI_Ibcast(id, sizeof(id), MPI_CHAR, 0, MPI_COMM_WORLD, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Ibcast of the job id", rc);
  Status s = wait_for_start(&request, config);
  if (!s.ok()) return s;
  *job_id = id;
  return Status::OK();
}

}  // namespace

void mark_mpi_broken() { broken.store(true); }

Status mpi_error(const std::string& what, int code) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return Status::Error(UNISON_ERR_RANK_FAILED, "unison: " + what + " failed: " + std::string(text, length));
}

bool mpi_backend_available() { return true; }

bool mpi_lets_every_thread_call() {
  int initialized = 0, finalized = 0, level = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return false;
  MPI_Query_thread(&level);
  return level == MPI_THREAD_MULTIPLE;
}

Status make_mpi_backend(Config* config, int generation, std::unique_ptr<Backend>* out) {
  Status s = start_mpi(*config);
  if (!s.ok()) return s;
  MpiWorld world;
  s = learn_world(*config, &world);
  if (!s.ok()) return s;
  if (world.size != config->size)
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                         "unison: " + config->mpi_launcher + " says this job has " + std::to_string(config->size) +
                             " ranks but MPI says " + std::to_string(world.size) +
                             ": unison was built against another MPI than the one that started it (under srun, "
                             "the MPI must support SLURM's PMI)");
  HostLayout layout;
  layout.host_of = world.host;
  layout.host_ranks = world.host_ranks;
  // unisonrun names the job (and removes what a crash leaves under that
  // name); under a plain mpirun rank 0 chooses a name.
  if (config->job_id.empty()) s = agree_on_job_id(*config, world, &config->job_id);
  if (!s.ok()) return s;
  place_rank(config, world.rank, layout);

  const int hosts = (int)world.host_ranks.size();
  if (config->hierarchical && hosts == 1) return make_shm_backend(*config, generation, out);
  if (config->hierarchical && layout.same_size_hosts() && config->local_size > 1) {
    const int host = world.my_host();
    return make_hierarchical_backend(*config, layout, generation,
                                     [&](Backend* local, std::unique_ptr<Backend>* across, std::unique_ptr<Backend>* cross) {
                                       return make_mpi_across_backends(*config, host, local, across, cross);
                                     },
                                     out);
  }
  if (config->hierarchical && config->local_size > 1 && config->rank == 0)
    log_message(LogLevel::warning,
                "unison: hosts run different numbers of ranks, so every collective goes over MPI (flat)\n");
  return make_flat_mpi_backend(*config, world, out);
}

}  // namespace unison
