// The hierarchical backend: shared memory within each host, and a flat
// backend across hosts (MPI or TCP; it only uses the Backend interface).
//
// Every host runs the same number of ranks (the makers check). Local rank l
// of every host belongs to cross group l; the local rank 0s (the leaders)
// also carry the control plane and the cycle requests between hosts.
//
//   allreduce:  each host reduce-scatters over shared memory, so local rank l
//               holds the host's sum of chunk l; cross group l allreduces
//               chunk l across hosts; each host allgathers the chunks over
//               shared memory. Each cross link carries 1/L of the bytes, and
//               the L links of a host run at once.
//   allgather:  each host gathers its ranks' parts over shared memory, the
//               leaders exchange whole hosts, and each leader broadcasts the
//               result over shared memory.
//   broadcast:  to the root's host over shared memory, across the leaders,
//               then within every other host over shared memory.
//   control:    exchange within the host, leaders exchange whole hosts,
//               leaders broadcast the lot within their host.
//   alltoall and reducescatter go flat across the world: every pair of
//               ranks has its own bytes to move, so a host has nothing to
//               combine.
#include "hierarchical.h"

#include <algorithm>
#include <cstring>

#include "byte_stream.h"
#include "copy.h"
#include "dtype.h"
#include "futex.h"

namespace unison {
namespace {

// Length-prefixed strings in one string.
std::string pack(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) {
    const uint32_t n = (uint32_t)p.size();
    out.append(reinterpret_cast<const char*>(&n), sizeof(n));
    out += p;
  }
  return out;
}

std::vector<std::string> unpack(const std::string& packed) {
  std::vector<std::string> parts;
  size_t at = 0;
  while (at + sizeof(uint32_t) <= packed.size()) {
    uint32_t n = 0;
    std::memcpy(&n, packed.data() + at, sizeof(n));
    at += sizeof(n);
    parts.push_back(packed.substr(at, n));
    at += n;
  }
  return parts;
}

class HierarchicalBackend final : public Backend {
 public:
  HierarchicalBackend(const Config& config, const HostLayout& layout)
      : config_(config), host_ranks_(layout.host_ranks), host_of_(layout.host_of), host_(layout.host_of[config.rank]) {}

  Status start(int generation, const MakeAcross& make_across, const std::function<Status()>& start_watch) {
    // The leader polls its cross group while idle, so its shared-memory
    // waits must not spin first: it does its own spinning (wait_for_activity).
    Config local = config_;
    if (leader()) local.idle_spin_microseconds = 0;
    Status s = make_shm_backend(local, generation, &local_, start_watch);
    if (!s.ok()) return s;
    return make_across(local_.get(), &world_, &cross_);
  }

  const char* name() const override { return "hierarchical"; }
  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }

  // ---- control plane -------------------------------------------------------

  Status exchange(const std::string& mine, std::vector<std::string>* everyone) override {
    std::vector<std::string> on_host;
    Status s = local_->exchange(mine, &on_host);
    if (!s.ok()) return s;
    std::string all;
    if (leader()) {
      std::vector<std::string> hosts;
      s = cross_->exchange(pack(on_host), &hosts);
      if (!s.ok()) return s;
      all = pack(hosts);
    }
    s = local_->broadcast_message(&all, 0);
    if (!s.ok()) return s;
    const std::vector<std::string> hosts = unpack(all);
    everyone->assign(config_.size, std::string());
    for (size_t h = 0; h < hosts.size() && h < host_ranks_.size(); ++h) {
      const std::vector<std::string> messages = unpack(hosts[h]);
      for (size_t l = 0; l < messages.size() && l < host_ranks_[h].size(); ++l)
        (*everyone)[host_ranks_[h][l]] = messages[l];
    }
    return Status::OK();
  }

  Status broadcast_message(std::string* message, int root) override {
    return in_three_steps(root, [&](Backend* local, int local_root) { return local->broadcast_message(message, local_root); },
                          [&](int root_host) { return cross_->broadcast_message(message, root_host); });
  }

  // Every rank's message travels together through one shared-memory mailbox.
  size_t max_message_bytes() const override {
    const size_t mailbox = local_->max_message_bytes(), headers = 8 * (size_t)config_.size + 64;
    return mailbox > headers ? (mailbox - headers) / config_.size : 0;  // init refuses 0 (api.cc)
  }

  // ---- cycle scheduling ----------------------------------------------------
  // Within the host the shared-memory counter works as always; the leader
  // carries counts between it and the other hosts' leaders.

  uint64_t requested_cycles() const override {
    // The leader answers with the count it has passed on: reading the
    // counter again could see a local request the other hosts never heard of.
    return leader() ? relay() : local_->requested_cycles();
  }
  void request_cycles(uint64_t count) override {
    local_->request_cycles(count);
    if (leader()) cross_->request_cycles(count);
  }
  uint32_t activity_token() const override { return local_->activity_token(); }
  void wait_for_activity(uint32_t token, double timeout_seconds) override {
    if (!leader()) {
      local_->wait_for_activity(token, timeout_seconds);
      // Peers on other hosts judge this rank alive by what it sends them;
      // the world backend's check sends it (a TCP heartbeat) if one is due.
      world_->check_peers();
      return;
    }
    poll_with_backoff(
        [&] {
          const uint64_t before = local_->requested_cycles();
          return relay() > before || local_->activity_token() != token;
        },
        [&](double pause) { local_->wait_for_activity(token, pause); }, timeout_seconds,
        config_.spin_microseconds * 1e-6, config_.spin_yields_core);
  }
  void wake() override { local_->wake(); }

  // ---- data plane ----------------------------------------------------------

  bool set_hierarchical(bool on) override {
    flat_ = !on;
    return true;
  }

  Status allreduce(const AllreduceOptions& o) override {
    if (flat_) return world_->allreduce(o);  // the autotuner found it faster here
    const int L = config_.local_size, me = config_.local_rank;
    const size_t element = dtype_size(o.reduce.dtype);
    // Scale factors and Average's division belong to the whole job: the
    // host's partial results carry the prescale only, the cross step the
    // postscale and the division by the job's size.
    ReduceSpec within = o.reduce, across = o.reduce;
    within.postscale = 1.0;
    if (within.reduce_op == UNISON_AVERAGE) within.reduce_op = UNISON_SUM;
    across.prescale = 1.0;
    ReducescatterOptions scatter;
    scatter.reduce = within;
    AllgatherOptions gather;
    // Each tensor is cut into L near-equal parts; this rank's parts of all
    // of them, one after another in chunk_, are what it carries across hosts.
    std::vector<std::vector<size_t>> parts(o.segments.size(), std::vector<size_t>(L));
    size_t mine = 0;
    for (size_t i = 0; i < o.segments.size(); ++i) {
      const size_t count = o.segments[i].bytes / element;
      for (int l = 0; l < L; ++l) parts[i][l] = (count * (l + 1) / L - count * l / L) * element;
      mine += parts[i][me];
    }
    chunk_.resize(mine + 1);
    size_t at = 0;
    for (size_t i = 0; i < o.segments.size(); ++i) {
      const Segment& s = o.segments[i];
      scatter.tensors.push_back({s.input, chunk_.data() + at, parts[i]});
      gather.tensors.push_back({chunk_.data() + at, s.output, parts[i]});
      at += parts[i][me];
    }
    Status s = local_->reducescatter(scatter);
    if (s.ok() && mine > 0) s = cross_->allreduce(AllreduceOptions{{{chunk_.data(), chunk_.data(), mine}}, across});
    if (s.ok()) s = local_->allgather(gather);
    return s;
  }

  Status allgather(const AllgatherOptions& o) override {
    // Each host's block: for every tensor, its ranks' parts in local order.
    const int hosts = (int)host_ranks_.size();
    std::vector<size_t> block(hosts, 0);
    for (const auto& t : o.tensors)
      for (int h = 0; h < hosts; ++h)
        for (int r : host_ranks_[h]) block[h] += t.bytes_per_rank[r];
    size_t total = 0;
    std::vector<size_t> block_start(hosts);
    for (int h = 0; h < hosts; ++h) block_start[h] = total, total += block[h];
    everything_.resize(total + 1);
    AllgatherOptions within;
    size_t at = block_start[host_];
    for (const auto& t : o.tensors) {
      AllgatherOptions::Tensor part{t.input, everything_.data() + at, {}};
      for (int r : host_ranks_[host_]) part.bytes_per_rank.push_back(t.bytes_per_rank[r]), at += t.bytes_per_rank[r];
      within.tensors.push_back(part);
    }
    Status s = local_->allgather(within);
    if (s.ok() && leader()) {
      AllgatherOptions across;
      across.tensors.push_back({everything_.data() + block_start[host_], everything_.data(), block});
      s = cross_->allgather(across);
    }
    if (s.ok()) s = local_->broadcast(BroadcastOptions{everything_.data(), total, 0});
    if (!s.ok()) return s;
    // Into each output in global rank order.
    std::vector<size_t> read(block_start);
    std::vector<std::vector<size_t>> where(o.tensors.size(), std::vector<size_t>(config_.size));
    for (size_t i = 0; i < o.tensors.size(); ++i)
      for (int h = 0; h < hosts; ++h)
        for (int r : host_ranks_[h]) where[i][r] = read[h], read[h] += o.tensors[i].bytes_per_rank[r];
    for (size_t i = 0; i < o.tensors.size(); ++i) {
      const auto& t = o.tensors[i];
      size_t written = 0;
      for (int r = 0; r < config_.size; ++r) {
        const size_t n = t.bytes_per_rank[r];
        if (n > 0) copy_bytes(static_cast<char*>(t.output) + written, everything_.data() + where[i][r], n);
        written += n;
      }
    }
    return Status::OK();
  }

  Status broadcast(const BroadcastOptions& o) override {
    return in_three_steps(o.root, [&](Backend* local, int local_root) {
      return local->broadcast(BroadcastOptions{o.buffer, o.bytes, local_root});
    }, [&](int root_host) { return cross_->broadcast(BroadcastOptions{o.buffer, o.bytes, root_host}); });
  }

  Status alltoall(const AlltoallOptions& o) override { return world_->alltoall(o); }
  Status reducescatter(const ReducescatterOptions& o) override { return world_->reducescatter(o); }

  Status check_peers() override {
    Status s = local_->check_peers();
    return s.ok() ? world_->check_peers() : s;
  }
  void stopped_on(const Status& cause) override {
    local_->stopped_on(cause);
    world_->stopped_on(cause);
  }

  // A set within one host needs no MPI: its members get shared memory of
  // their own. A set across hosts goes flat over MPI among its members.
  // Every rank can tell which case it is from `members` alone, so the
  // collective MPI_Comm_split is called by all ranks or by none.
  Status split(const std::vector<int>& members, int set_id, std::unique_ptr<Backend>* out) override {
    out->reset();
    const int first_host = host_of_[members[0]];
    bool one_host = true;
    for (int r : members) one_host &= host_of_[r] == first_host;
    if (!one_host) return world_->split(members, set_id, out);
    if (first_host != host_) return Status::OK();
    const std::vector<int>& here = host_ranks_[host_];
    std::vector<int> local;
    for (int r : members) local.push_back((int)(std::find(here.begin(), here.end(), r) - here.begin()));
    return local_->split(local, set_id, out);
  }

 private:
  bool leader() const { return config_.local_rank == 0; }

  // Leader only: passes this host's cycle count to the other hosts and
  // theirs to this host; returns the count every host has been told of.
  uint64_t relay() const {
    const uint64_t here = local_->requested_cycles();
    cross_->request_cycles(here);
    const uint64_t elsewhere = cross_->requested_cycles();
    if (elsewhere <= here) return here;
    local_->request_cycles(elsewhere);
    return elsewhere;
  }

  // From `root` to everyone: within the root's host, across the leaders,
  // within every other host.
  template <typename WithinHost, typename AcrossHosts>
  Status in_three_steps(int root, WithinHost within_host, AcrossHosts across_hosts) {
    const int root_host = host_of_[root];
    const std::vector<int>& there = host_ranks_[root_host];
    const int root_local = (int)(std::find(there.begin(), there.end(), root) - there.begin());
    Status s;
    if (host_ == root_host) s = within_host(local_.get(), root_local);
    if (s.ok() && leader()) s = across_hosts(root_host);
    if (s.ok() && host_ != root_host) s = within_host(local_.get(), 0);
    return s;
  }

  Config config_;
  std::vector<std::vector<int>> host_ranks_;
  std::vector<int> host_of_;
  int host_;
  // Declared first, destroyed last: the others' liveness may look at it.
  std::unique_ptr<Backend> local_;
  std::unique_ptr<Backend> world_;  // every rank, flat: alltoall, reducescatter, sets across hosts
  bool flat_ = false;               // allreduce over world_ too (the autotuner's choice)
  std::unique_ptr<Backend> cross_;  // this local rank's group, one rank per host
  std::vector<char> chunk_, everything_;
};

}  // namespace

bool HostLayout::same_size_hosts() const {
  for (const auto& ranks : host_ranks)
    if (ranks.size() != host_ranks[0].size()) return false;
  return true;
}

HostLayout layout_of(const std::vector<std::string>& host_names) {
  HostLayout layout;
  std::vector<std::string> seen;
  for (const std::string& name : host_names) {
    const int h = (int)(std::find(seen.begin(), seen.end(), name) - seen.begin());
    if (h == (int)seen.size()) {
      seen.push_back(name);
      layout.host_ranks.emplace_back();
    }
    layout.host_ranks[h].push_back((int)layout.host_of.size());
    layout.host_of.push_back(h);
  }
  return layout;
}

void place_rank(Config* config, int rank, const HostLayout& layout) {
  const int host = layout.host_of[rank];
  const std::vector<int>& mine = layout.host_ranks[host];
  config->rank = rank;
  config->local_size = (int)mine.size();
  config->local_rank = (int)(std::find(mine.begin(), mine.end(), rank) - mine.begin());
  // Cross ranks: the ranks that have the same local rank, one per host.
  config->cross_rank = 0;
  config->cross_size = 0;
  for (int h = 0; h < (int)layout.host_ranks.size(); ++h) {
    if ((int)layout.host_ranks[h].size() <= config->local_rank) continue;
    if (h < host) ++config->cross_rank;
    ++config->cross_size;
  }
  config->host_ranks = mine;
  config->homogeneous = layout.same_size_hosts();
  config->job_id += "-host" + std::to_string(host);
}

Status make_hierarchical_backend(const Config& config, const HostLayout& layout, int generation,
                                 const MakeAcross& make_across, std::unique_ptr<Backend>* out,
                                 const std::function<Status()>& start_watch) {
  auto backend = std::make_unique<HierarchicalBackend>(config, layout);
  Status s = backend->start(generation, make_across, start_watch);
  if (!s.ok()) return s;
  *out = std::move(backend);
  return Status::OK();
}

}  // namespace unison
