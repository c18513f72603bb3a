// backend.h: what a job runs on between its ranks' host memory.
//
// A Backend is both planes of one group of ranks (a job, or a process set
// split from it): the control plane that negotiation and cycles run on
// (control_plane.h) and the data plane that moves host tensors
// (data_plane.h), since the two share their ranks' connections. Only a
// backend can be split into a process set's. A GPU's planes are data planes
// alone, made over their set's backend (data_planes.cc chooses which).
//
// Each backend lives in its own folder and exposes `<name>_backend_available`
// and `make_<name>_backend`; where one is not built, a stub file answers
// with an error instead. backend.cc alone decides which one a job starts
// with.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "control_plane.h"
#include "data_plane.h"

namespace unison {

class Backend : public DataPlane, public ControlPlane {
 public:
  // Process sets. Collective over every rank of this backend, called in
  // the same order everywhere: a backend among `members` (ascending ranks
  // of this one) that carries one process set's control messages and data.
  // Members get it in *out, the others null. The engine schedules cycles on
  // this backend only, so the new one's scheduling methods go unused.
  // `set_id` keeps its resources apart from other sets'.
  virtual Status split(const std::vector<int>& members, int set_id, std::unique_ptr<Backend>* out) = 0;
};

// The backend this process's job needs (backend.cc decides, from the
// launcher's settings in `config`, which MPI may complete).
Status make_backend(Config* config, int generation, std::unique_ptr<Backend>* out);
// Whether make_backend gives this job to MPI: an MPI launcher started it
// with more than one rank.
bool mpi_carries_job(const Config& config);
// The backends this build has, as "solo,shm,mpi".
std::string built_backends();

// The single-process null object: every collective is a local copy.
bool solo_backend_available();
Status make_solo_backend(const Config& config, int generation, std::unique_ptr<Backend>* out);
// Shared memory between the processes of one host. `start_watch`, when
// given, runs while start-up waits for the other local ranks; an error from
// it ends the wait (a job across hosts passes its TCP mesh's check that no
// rank has gone, which would otherwise be waited for until the start timeout).
bool shm_backend_available();
Status make_shm_backend(const Config& config, int generation, std::unique_ptr<Backend>* out,
                        const std::function<Status()>& start_watch = nullptr);
// A job started by mpirun or srun (mpi/): shared memory within each host and
// MPI across hosts, or MPI alone. Fills in `config`'s identity from MPI.
// Where no MPI was found at build time, a stub answers with an error that
// says how to get one.
bool mpi_backend_available();
Status make_mpi_backend(Config* config, int generation, std::unique_ptr<Backend>* out);
// Whether MPI has been started in this process at MPI_THREAD_MULTIPLE, so
// that the application may call it from any thread beside unison's.
bool mpi_lets_every_thread_call();
// A job started by `unisonrun -H` (tcp/): shared memory within each host and
// TCP across hosts, or TCP alone. Meets the other ranks at the launcher's
// rendezvous, and fills in `config`'s identity from what they say.
bool tcp_backend_available();
Status make_tcp_backend(Config* config, int generation, std::unique_ptr<Backend>* out);

}  // namespace unison
