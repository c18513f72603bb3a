// backend.h: the seam between negotiation and the bytes.
//
// The engine decides what runs, in one order on every rank; a Backend moves
// the bytes. A backend also carries the control plane (the small messages
// of negotiation) and tells the engine when a cycle is wanted, because only
// it knows how its ranks reach each other. Everything a backend must do is
// on this screen. Each backend lives in its own folder and exposes
// `<name>_backend_available` and `make_<name>_backend`; where one is not
// built, a stub file answers with an error instead. backend.cc alone
// decides which one a job starts with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "reduce.h"
#include "status.h"

namespace unison {

// One tensor's part of a fused collective: `bytes` read from `input` and
// written to `output` (which may be the same memory).
struct Segment {
  const void* input;
  void* output;
  size_t bytes;
};

struct AllreduceOptions {
  std::vector<Segment> segments;  // read and written as one logical stream
  ReduceSpec reduce;
};

struct AllgatherOptions {
  struct Tensor {
    const void* input;                 // this rank's bytes_per_rank[rank] bytes
    void* output;                      // every rank's bytes, in rank order
    std::vector<size_t> bytes_per_rank;
  };
  std::vector<Tensor> tensors;
};

struct BroadcastOptions {
  void* buffer;  // holds the data on the root; receives it elsewhere
  size_t bytes;
  int root;
};

struct AlltoallOptions {
  const void* input;            // this rank's sends, in receiver order
  void* output;                 // this rank's receives, in sender order
  std::vector<size_t> bytes;    // size*size, [sender][receiver]
};

struct ReducescatterOptions {
  struct Tensor {
    const void* input;                  // the whole tensor
    void* output;                       // this rank's part
    std::vector<size_t> bytes_per_rank; // consecutive parts, in rank order
  };
  std::vector<Tensor> tensors;
  ReduceSpec reduce;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Control plane. Every rank calls these in the same order.
  // Everyone receives everyone's message, in rank order.
  virtual Status exchange(const std::string& mine, std::vector<std::string>* everyone) = 0;
  // The root's message replaces everyone else's.
  virtual Status broadcast_message(std::string* message, int root) = 0;
  // The largest message either call carries.
  virtual size_t max_message_bytes() const = 0;

  // Cycle scheduling. A negotiation cycle is collective, so ranks agree on a
  // count of requested cycles and each runs them all. A rank with new work
  // raises the count; raising it, or wake(), ends wait_for_activity().
  virtual uint64_t requested_cycles() const = 0;
  virtual void request_cycles(uint64_t count) = 0;
  virtual uint32_t activity_token() const = 0;  // read before deciding to wait
  virtual void wait_for_activity(uint32_t token, double timeout_seconds) = 0;
  virtual void wake() = 0;  // from any thread of this process
  // Whether wait_for_activity() may run on one thread while another calls
  // the rest: then a caller waiting for its op may drive the engine while
  // the engine's thread still sleeps in it (engine_driver.cc).
  virtual bool callers_may_drive() const { return false; }

  // Data plane. Every rank calls these with matching options.
  virtual Status allreduce(const AllreduceOptions& options) = 0;
  virtual Status allgather(const AllgatherOptions& options) = 0;
  virtual Status broadcast(const BroadcastOptions& options) = 0;
  virtual Status alltoall(const AlltoallOptions& options) = 0;
  virtual Status reducescatter(const ReducescatterOptions& options) = 0;

  // OK while every peer is alive; else which one is not.
  virtual Status check_peers() = 0;
  // This rank's engine stopped on `cause` and takes part in nothing more.
  // The backend tells its peers now, and a peer waiting on this rank then
  // fails with `cause`, saying this rank stopped on it. Without this, a
  // survivor that exits on its error is taken for the failure by the
  // survivors slower to notice, and their errors name it, not the rank
  // that died. Not waited on: a peer that cannot be told in passing learns
  // of this rank's end the usual way.
  virtual void stopped_on(const Status& /*cause*/) {}

  // For the autotuner: a backend that can run its allreduce both
  // hierarchically and flat switches to `on`, and says it could.
  virtual bool set_hierarchical(bool /*on*/) { return false; }

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
