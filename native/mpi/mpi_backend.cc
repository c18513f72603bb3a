// The flat MPI backend: every byte between every pair of ranks goes over
// MPI, and so does the control plane. It is what runs across hosts when
// hierarchical collectives are off (--no-hierarchical-allreduce) or when
// hosts run different numbers of ranks.
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "../futex.h"
#include "communicator.h"
#include "cycle_requests.h"
#include "world.h"

namespace unison {
namespace {

// The peers on this rank's own host, watched through pidfds so that a
// local death is seen at once, as in the shared-memory backend.
class LocalPeers {
 public:
  LocalPeers(const MpiWorld& world) {
    for (int r : world.host_ranks[world.my_host()]) {
      if (r == world.rank) continue;
      const int fd = (int)syscall(SYS_pidfd_open, world.pid[r], 0);
      peers_.push_back({r, world.pid[r], fd});
    }
  }
  ~LocalPeers() {
    for (const Peer& p : peers_)
      if (p.fd >= 0) close(p.fd);
  }
  // The peers that have exited, or "".
  std::string dead() const {
    std::string names;
    for (const Peer& p : peers_) {
      bool exited = false;
      if (p.fd >= 0) {
        struct pollfd f = {p.fd, POLLIN, 0};
        exited = poll(&f, 1, 0) > 0;
      } else {
        exited = kill(p.pid, 0) != 0 && errno == ESRCH;
      }
      if (exited) names += (names.empty() ? "" : ", ") + ("rank " + std::to_string(p.rank) + " (pid " + std::to_string(p.pid) + ")");
    }
    return names;
  }

 private:
  struct Peer {
    int rank, pid, fd;
  };
  std::vector<Peer> peers_;
};

class MpiBackend final : public Backend {
 public:
  MpiBackend(const Config& config, Liveness liveness) : config_(config), liveness_(std::move(liveness)) {}

  // Collective over `parent`. Only the job's own backend asks its peers
  // for cycles; a process set's is driven by the engine's cycles.
  Status start(MPI_Comm parent, bool schedules_cycles) {
    Status s = MpiCommunicator::create(parent, config_, liveness_, &comm_);
    if (!s.ok()) return s;
    if (schedules_cycles) requests_ = std::make_unique<CycleRequests>(comm_->comm());
    return Status::OK();
  }
  ~MpiBackend() override { requests_.reset(); }

  MPI_Comm comm() const { return comm_->comm(); }

  const char* name() const override { return "mpi"; }
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }

  Status exchange(const std::string& mine, std::vector<std::string>* everyone) override {
    return comm_->allgather_strings(mine, everyone);
  }
  Status broadcast_message(std::string* message, int root) override {
    return comm_->broadcast_string(message, root);
  }
  size_t max_message_bytes() const override { return config_.control_message_bytes; }

  // Only the engine thread calls these four, so MPI is never entered from
  // two threads of ours at once.
  uint64_t requested_cycles() const override {
    const uint64_t heard = requests_ ? requests_->heard() : 0;
    if (heard > requested_) requested_ = heard;
    return requested_;
  }
  void request_cycles(uint64_t count) override {
    if (count > requested_) requested_ = count;
    if (requests_) requests_->announce(count);
  }
  uint32_t activity_token() const override { return doorbell_.token(); }
  void wait_for_activity(uint32_t token, double timeout_seconds) override {
    const uint64_t before = requested_;
    poll_with_backoff([&] { return requested_cycles() > before || doorbell_.token() != token; },
                      [&](double pause) { doorbell_.sleep(token, pause); }, timeout_seconds,
                      config_.spin_microseconds * 1e-6, config_.spin_yields_core);
  }
  void wake() override { doorbell_.ring(); }  // any thread: no MPI here

  Status allreduce(const AllreduceOptions& o) override { return comm_->allreduce(o); }
  Status allgather(const AllgatherOptions& o) override { return comm_->allgather(o); }
  Status broadcast(const BroadcastOptions& o) override { return comm_->broadcast(o.buffer, o.bytes, o.root); }
  Status alltoall(const AlltoallOptions& o) override { return comm_->alltoall(o); }
  Status reducescatter(const ReducescatterOptions& o) override { return comm_->reducescatter(o); }

  Status check_peers() override { return liveness_(); }

  Status split(const std::vector<int>& members, int, std::unique_ptr<Backend>* out) override {
    return make_mpi_set_backend(comm_->comm(), members, config_, liveness_, out);
  }

 private:
  Config config_;
  Liveness liveness_;
  std::unique_ptr<MpiCommunicator> comm_;
  std::unique_ptr<CycleRequests> requests_;
  mutable uint64_t requested_ = 0;
  mutable Doorbell doorbell_;
};

}  // namespace

Status make_flat_mpi_backend(const Config& config, const MpiWorld& world, std::unique_ptr<Backend>* out) {
  auto peers = std::make_shared<LocalPeers>(world);
  Liveness liveness = [peers] {
    const std::string dead = peers->dead();
    if (dead.empty()) return Status::OK();
    const bool several = dead.find(", ") != std::string::npos;
    return Status::Error(UNISON_ERR_RANK_FAILED, "unison: " + dead + " exited; collectives with " +
                                                     (several ? "them" : "it") + " can no longer complete");
  };
  auto backend = std::make_unique<MpiBackend>(config, liveness);
  Status s = backend->start(MPI_COMM_WORLD, true);
  if (!s.ok()) return s;
  *out = std::move(backend);
  return Status::OK();
}

Status make_mpi_across_backends(const Config& config, int host, Backend* local, std::unique_ptr<Backend>* world,
                                std::unique_ptr<Backend>* cross) {
  Liveness liveness = [local] { return local->check_peers(); };
  auto everyone = std::make_unique<MpiBackend>(config, liveness);
  Status s = everyone->start(MPI_COMM_WORLD, false);
  if (!s.ok()) return s;
  MPI_Comm split;
  // Keyed by host, so that a rank's place in its cross group is its host's
  // number whatever order mpirun placed the ranks in.
  const int rc = MPI_Comm_split(everyone->comm(), config.local_rank, host, &split);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Comm_split", rc);
  auto group = std::make_unique<MpiBackend>(config, liveness);
  s = group->start(split, config.local_rank == 0);  // the leaders ask each other for cycles
  MPI_Comm_free(&split);
  if (!s.ok()) return s;
  *world = std::move(everyone);
  *cross = std::move(group);
  return Status::OK();
}

Status make_mpi_set_backend(MPI_Comm parent, const std::vector<int>& members, const Config& config,
                            Liveness liveness, std::unique_ptr<Backend>* out) {
  out->reset();
  int rank = 0;
  MPI_Comm_rank(parent, &rank);
  const bool member = std::find(members.begin(), members.end(), rank) != members.end();
  MPI_Comm set;
  int rc = MPI_Comm_split(parent, member ? 0 : MPI_UNDEFINED, rank, &set);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Comm_split for a process set", rc);
  if (!member) return Status::OK();
  auto backend = std::make_unique<MpiBackend>(config, std::move(liveness));
  Status s = backend->start(set, false);
  MPI_Comm_free(&set);
  if (!s.ok()) return s;
  *out = std::move(backend);
  return Status::OK();
}

}  // namespace unison
