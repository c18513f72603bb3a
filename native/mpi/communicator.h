// communicator.h: one MPI communicator of unison's, and the collectives the
// backends run on it.
//
// Every wait is a loop over MPI_Test rather than a blocking MPI call, so a
// wait can look at the ranks it can see die (those on its host) and give up
// after a time limit instead of hanging: a rank that is waited on is always
// inside the same cycle, so it answers within milliseconds unless it is
// dead or frozen.
//
// Reductions are unison's own (reduce.h), not MPI_Op: every rank's input
// for a chunk is gathered to the chunk's owner, which combines them in rank
// order, and the results are gathered back. So every rank ends with the
// same bits as every other, and the same as the shared-memory backend
// computes, for every dtype including float16 and bfloat16.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../data_plane.h"
#include "../config.h"
#include "../status.h"

namespace unison {

using Liveness = std::function<Status()>;

// Waits for `request`. Gives up after `limit_seconds`, or as soon as
// `liveness` reports a dead peer. `idle` waits (the control plane, where a
// peer may be a few milliseconds late) sleep between tests once a short
// spin is over; data waits keep testing, since MPI progresses transfers
// only inside its calls.
Status mpi_wait(MPI_Request* request, const std::string& what, double limit_seconds, const Liveness& liveness,
                double spin_seconds, bool idle);

class MpiCommunicator {
 public:
  // Collective over `parent`: takes a duplicate of it, so that unison's
  // messages never meet the application's.
  static Status create(MPI_Comm parent, const Config& config, Liveness liveness,
                       std::unique_ptr<MpiCommunicator>* out);
  ~MpiCommunicator();

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm comm() const { return comm_; }

  // Control plane.
  Status allgather_strings(const std::string& mine, std::vector<std::string>* everyone);
  Status broadcast_string(std::string* message, int root);

  // Data plane, with the options of data_plane.h.
  Status allreduce(const AllreduceOptions& options);
  Status allgather(const AllgatherOptions& options);
  Status broadcast(void* buffer, size_t bytes, int root);
  Status alltoall(const AlltoallOptions& options);
  Status reducescatter(const ReducescatterOptions& options);

 private:
  MpiCommunicator(MPI_Comm comm, const Config& config, Liveness liveness);
  Status wait(MPI_Request* request, const char* what, size_t bytes);
  Status wait_idle(MPI_Request* request, const char* what);
  Status remember(const Status& s);
  Status allreduce_window(const ReduceSpec& spec, size_t bytes);

  MPI_Comm comm_;
  Config config_;
  Liveness liveness_;
  int rank_ = 0;
  int size_ = 1;
  Status broken_;
  // Scratch kept between calls: the fusion buffer, and what peers send.
  std::vector<char> send_, receive_;
};

}  // namespace unison
