// hierarchical.h: a job across hosts built from a shared-memory backend
// within each host and a flat backend across them (hierarchical.cc says how
// each collective is split). MPI and TCP each build one (mpi/world.cc,
// tcp/tcp_backend.cc).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"

namespace unison {

// Who is where, with hosts numbered in the order of their lowest rank.
struct HostLayout {
  std::vector<int> host_of;                  // each rank's host
  std::vector<std::vector<int>> host_ranks;  // each host's ranks, ascending
  bool same_size_hosts() const;
};

// The layout of ranks whose hosts are called `host_names` (by rank).
HostLayout layout_of(const std::vector<std::string>& host_names);

// Sets config's local and cross identity and host_ranks for `rank`, and
// gives the host's shared memory a name of its own.
void place_rank(Config* config, int rank, const HostLayout& layout);

// The flat backends across hosts, made once the local one exists (their
// liveness may look at it): `world` holds every rank; `cross` the ranks of
// this rank's local rank, one per host in host order. The leaders' cross
// group carries cycle requests between hosts, so it must schedule cycles
// (backend.h) the way a job's own backend does.
using MakeAcross = std::function<Status(Backend* local, std::unique_ptr<Backend>* world,
                                        std::unique_ptr<Backend>* cross)>;

// `start_watch` goes to the local shared-memory start-up (make_shm_backend).
Status make_hierarchical_backend(const Config& config, const HostLayout& layout, int generation,
                                 const MakeAcross& make_across, std::unique_ptr<Backend>* out,
                                 const std::function<Status()>& start_watch = nullptr);

}  // namespace unison
