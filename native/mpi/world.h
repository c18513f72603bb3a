// world.h: starting MPI, and who is where.
//
// MPI is started once per process (it cannot be restarted after
// MPI_Finalize, so unison's shutdown leaves it running and it is finalized
// at exit); each init of unison then takes fresh communicators of its own.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../backend.h"
#include "../config.h"
#include "../status.h"

namespace unison {

struct MpiWorld {
  int rank = 0;
  int size = 1;
  std::vector<int> host;                     // each rank's host, numbered by their lowest rank
  std::vector<int> pid;                      // each rank's process id
  std::vector<std::vector<int>> host_ranks;  // each host's ranks, ascending
  int my_host() const { return host[rank]; }
};

// After a collective failed half way, MPI_Finalize at exit could wait for
// peers that will never arrive; a broken job exits without it, and mpirun
// ends the other ranks.
void mark_mpi_broken();

// An error naming the MPI call that failed and MPI's reason.
Status mpi_error(const std::string& what, int code);

// The flat MPI backend; make_mpi_backend (world.cc) picks it or hierarchical.
Status make_flat_mpi_backend(const Config& config, const MpiWorld& world, std::unique_ptr<Backend>* out);
// A process set's backend: flat MPI among `members` (ranks of `parent`),
// collective over `parent`; non-members get null.
Status make_mpi_set_backend(MPI_Comm parent, const std::vector<int>& members, const Config& config,
                            std::function<Status()> liveness, std::unique_ptr<Backend>* out);
// What a hierarchical job runs across hosts (hierarchical.h): MPI among
// every rank, and among the ranks of this one's local rank, keyed by host.
Status make_mpi_across_backends(const Config& config, int host, Backend* local, std::unique_ptr<Backend>* world,
                                std::unique_ptr<Backend>* cross);

}  // namespace unison
