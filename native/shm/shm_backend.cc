// The shared-memory backend: the ranks of one host exchange everything
// through one POSIX shared-memory segment (segment.h), and wait for each
// other on futexes in it.
//
// Every collective is a sequence of rounds. In a round each rank stages
// (part of) its data into its own slot, all ranks meet at a barrier, and
// each then reads what it needs straight out of the others' slots. The
// fusion buffer is the slot itself: fused tensors are copied into it once,
// piece by piece, and never packed anywhere else first.
//
// How many times each byte moves in an allreduce of S bytes on N ranks:
//   stage:   the (N-1)/N of the input that other ranks reduce is copied into
//            the slot once;
//   reduce:  each rank reads its own 1/N chunk from its tensor and the same
//            chunk from the N-1 other slots, and writes the result to its
//            slot and, in the same pass, to its output;
//   gather:  the (N-1)/N of the result reduced by others is copied once
//            into the output.
// So each input byte is copied in at most once and each output byte written
// once, which is within a factor of two of a single memcpy of the tensor.
// Small allreduces (config.small_allreduce_bytes) skip the split: everyone
// stages everything and reduces everything, saving one barrier.
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../backend.h"
#include "../byte_stream.h"
#include "../copy.h"
#include "../dtype.h"
#include "../liveness.h"
#include "../timeline.h"
#include "segment.h"

namespace unison {
namespace {

size_t round_down(size_t n, size_t to) { return n / to * to; }

class ShmBackend final : public Backend {
 public:
  explicit ShmBackend(const Config& config) : config_(config) {}
  ~ShmBackend() override {
    // A rank that leaves (shutdown, often after a failure elsewhere) says so:
    // its process lives on, and peers still waiting on it should hear now,
    // not after the peer timeout.
    if (beat_id_ != 0) remove_beat(beat_id_);
    if (me_ != nullptr) me_->left.store(1);
    for (int fd : pidfds_)
      if (fd >= 0) close(fd);
  }

  Status start(int generation, const ShmSegment::HearCreator& hear_creator = nullptr,
               const ShmSegment::StartWatch& watch = nullptr) {
    generation_ = generation;
    Status s = segment_.open(config_, generation, hear_creator, watch);
    if (!s.ok()) return s;
    rank_ = config_.local_rank;
    size_ = config_.local_size;
    half_bytes_ = segment_.header()->slot_half_bytes;
    me_ = segment_.rank_area(rank_);
    beat_id_ = add_beat([this] { beat(); });  // beaten by this process's waits on other planes too
    // Peer exits are noticed through pidfds, which become readable the
    // moment a process ends, child of ours or not. Kernels without them
    // fall back to kill(pid, 0) and the heartbeat. A set asks the job's
    // backend instead (job_).
    pidfds_.assign(size_, -1);
    for (int r = 0; r < size_ && job_ == nullptr; ++r)
      if (r != rank_) pidfds_[r] = (int)syscall(SYS_pidfd_open, segment_.rank_area(r)->pid.load(), 0);
    return Status::OK();
  }

  const char* name() const override { return "shm"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // ---- control plane -------------------------------------------------------

  Status exchange(const std::string& mine, std::vector<std::string>* everyone) override {
    const int half = next_mailbox_half();
    Status s = post_message(mine, half);
    if (s.ok()) s = arrive_and_wait();
    if (!s.ok()) return s;
    everyone->resize(size_);
    for (int r = 0; r < size_; ++r)
      (*everyone)[r].assign(segment_.mailbox(r, half),
                            segment_.rank_area(r)->message_bytes[half].load(std::memory_order_acquire));
    return Status::OK();
  }

  Status broadcast_message(std::string* message, int root) override {
    const int half = next_mailbox_half();
    Status s = rank_ == root ? post_message(*message, half) : Status::OK();
    if (s.ok()) s = arrive_and_wait();
    if (!s.ok()) return s;
    if (rank_ != root)
      message->assign(segment_.mailbox(root, half),
                      segment_.rank_area(root)->message_bytes[half].load(std::memory_order_acquire));
    return Status::OK();
  }

  size_t max_message_bytes() const override { return segment_.header()->message_half_bytes; }

  // ---- cycle scheduling ----------------------------------------------------

  uint64_t requested_cycles() const override {
    return segment_.header()->requested_cycles.load(std::memory_order_acquire);
  }

  void request_cycles(uint64_t count) override {
    std::atomic<uint64_t>& requested = segment_.header()->requested_cycles;
    uint64_t seen = requested.load();
    while (seen < count && !requested.compare_exchange_weak(seen, count)) {
    }
    for (int r = 0; r < size_; ++r) segment_.rank_area(r)->bell.ring();
  }

  uint32_t activity_token() const override { return me_->bell.token(); }

  void wait_for_activity(uint32_t token, double timeout_seconds) override {
    beat();
    // A short spin first: when cycles come back to back (a training step's
    // gradients), the next request usually arrives within microseconds.
    const double spin = config_.idle_spin_microseconds >= 0 ? config_.idle_spin_microseconds : config_.spin_microseconds;
    const double spin_until = monotonic_seconds() + spin * 1e-6;
    while (monotonic_seconds() < spin_until) {
      for (int i = 0; i < 64; ++i) {
        if (me_->bell.token() != token) return;
        spin_step(config_.spin_yields_core);
      }
    }
    me_->bell.sleep(token, timeout_seconds);
    beat();
  }

  void wake() override { me_->bell.ring(); }
  // wait_for_activity() reads the bell and writes the heartbeat, both atomic.
  bool callers_may_drive() const override { return true; }

  // ---- liveness ------------------------------------------------------------

  void stopped_on(const Status& cause) override {
    if (me_ == nullptr || job_ != nullptr) return;  // a set's members are told by the job's segment
    const size_t n = std::min(cause.message.size(), kStoppedOnBytes - 1);
    std::memcpy(me_->stopped_on, cause.message.data(), n);
    me_->stopped_on[n] = '\0';
    me_->stopped_code.store(cause.code, std::memory_order_release);
    me_->left.store(1);
    // Peers asleep in a barrier or between cycles look now.
    segment_.header()->barrier_bell.ring();
    for (int r = 0; r < size_; ++r) segment_.rank_area(r)->bell.ring();
  }

  Status check_peers() override {
    if (!broken_.ok()) return broken_;
    beat_everywhere();  // this one, and this process's other planes (liveness.h)
    if (job_ != nullptr) {
      // A set: whether a member lives is the job's segment's to say, and
      // the set's to say only whether a member has left it.
      Status s = job_->check_peers();
      if (!s.ok()) return broken_ = s;
      return check_left();
    }
    // Name every peer that has exited, not just the first found: when one
    // rank dies, the survivors that notice first exit too, and a slower
    // survivor must still name the rank that started it.
    std::vector<bool> exited(size_, false);
    std::vector<struct pollfd> fds;
    for (int r = 0; r < size_; ++r)
      if (pidfds_[r] >= 0) fds.push_back({pidfds_[r], POLLIN, 0});
    if (!fds.empty() && poll(fds.data(), fds.size(), 0) > 0)
      for (const auto& f : fds)
        for (int r = 0; r < size_; ++r)
          if (f.revents != 0 && pidfds_[r] == f.fd) exited[r] = true;
    // A peer that stopped on a failure and then exited is not the failure:
    // what it stopped on is (check_left).
    std::string dead;
    int dead_count = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (pidfds_[r] < 0 && kill(segment_.rank_area(r)->pid.load(), 0) != 0 && errno == ESRCH) exited[r] = true;
      if (exited[r] && segment_.rank_area(r)->stopped_code.load(std::memory_order_acquire) == 0)
        dead += (dead_count++ ? ", " : "") + describe(r);
    }
    if (dead_count) return fail(dead + " exited", dead_count > 1);
    Status s = check_left();
    if (!s.ok()) return s;
    const int64_t now = monotonic_nanoseconds();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      double silent = (double)(now - segment_.rank_area(r)->heartbeat_ns.load()) * 1e-9;
      if (silent > config_.peer_timeout_seconds)
        return fail(describe(r) + " has shown no sign of life for " + std::to_string((int)silent) +
                    " s (UNISON_PEER_TIMEOUT_SECONDS is " + std::to_string((int)config_.peer_timeout_seconds) + ")");
    }
    return Status::OK();
  }

  // A set's members map a segment of their own, named after the set; the
  // other ranks have nothing to do. Sets are removed before the job's
  // backend (Engine::sets_), so job_ outlives every set made from it.
  Status split(const std::vector<int>& members, int set_id, std::unique_ptr<Backend>* out) override {
    out->reset();
    // Every rank of this host hears, over the job's control plane, whether
    // the set's first member could create its segment. If not (no room in
    // /dev/shm), every one fails with its reason at once: the members would
    // otherwise wait the start timeout for a segment that never comes, not
    // beating the job's heartbeat meanwhile, and the others would hold a set
    // that exists nowhere.
    auto hear_creator = [this, set_id, creator = members[0]](const Status& mine) -> Status {
      std::vector<std::string> heard;
      Status s = exchange(rank_ == creator && !mine.ok() ? "failed:" + mine.message : std::string("ok"), &heard);
      if (!s.ok()) return s;
      if (heard[creator] == "ok") return Status::OK();
      std::string why = heard[creator].substr(std::strlen("failed:"));
      if (rank_ == creator) return Status::Error(UNISON_ERR_INTERNAL, why);
      if (why.rfind("unison: ", 0) == 0) why.erase(0, std::strlen("unison: "));
      return Status::Error(UNISON_ERR_INTERNAL, "unison: process set " + std::to_string(set_id) + ": " +
                                                    describe(creator) + ", its first member on this host, failed: " +
                                                    why);
    };
    auto me = std::find(members.begin(), members.end(), rank_);
    if (me == members.end()) return hear_creator(Status::OK());
    Config sub = config_;
    sub.local_rank = (int)(me - members.begin());
    sub.local_size = (int)members.size();
    sub.host_ranks.clear();
    for (int r : members) sub.host_ranks.push_back(config_.host_ranks.empty() ? r : config_.host_ranks[r]);
    sub.job_id += "-set" + std::to_string(set_id);
    auto set = std::make_unique<ShmBackend>(sub);
    set->job_ = job_ != nullptr ? job_ : this;
    Status s = set->start(generation_, hear_creator);
    if (!s.ok()) return s;
    *out = std::move(set);
    return Status::OK();
  }

  // ---- data plane ----------------------------------------------------------

  Status allreduce(const AllreduceOptions& o) override {
    ByteStream in, out;
    for (const Segment& s : o.segments) {
      in.append(s.input, s.bytes);
      out.append(s.output, s.bytes);
    }
    const size_t element = dtype_size(o.reduce.dtype);
    const size_t window = round_down(half_bytes_, element * size_);
    for (size_t lo = 0; lo < in.size(); lo += window) {
      const size_t hi = std::min(in.size(), lo + window);
      const int half = next_slot_half();
      Status s = hi - lo <= config_.small_allreduce_bytes
                     ? reduce_everywhere(o.reduce, in, out, lo, hi, half)
                     : reduce_scatter_gather(o.reduce, in, out, lo, hi, half);
      if (!s.ok()) return s;
    }
    return Status::OK();
  }

  Status allgather(const AllgatherOptions& o) override {
    // Rank r's bytes form one stream: its part of each tensor in turn. Its
    // readers scatter that stream into their outputs at r's offsets.
    ByteStream mine;
    std::vector<ByteStream> destinations(size_);
    for (const auto& t : o.tensors) {
      size_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        destinations[r].append(static_cast<char*>(t.output) + offset, t.bytes_per_rank[r]);
        offset += t.bytes_per_rank[r];
      }
      mine.append(t.input, t.bytes_per_rank[rank_]);
    }
    size_t longest = 0;
    for (const ByteStream& d : destinations) longest = std::max(longest, d.size());
    copy_own_part(mine, destinations[rank_]);
    for (size_t lo = 0; lo < longest; lo += half_bytes_) {
      const size_t hi = std::min(longest, lo + half_bytes_);
      const int half = next_slot_half();
      if (lo < mine.size()) mine.read(lo, std::min(hi, mine.size()), segment_.slot(rank_, half));
      Status s = arrive_and_wait();
      if (!s.ok()) return s;
      for (int r = 0; r < size_; ++r) {
        if (r == rank_ || lo >= destinations[r].size()) continue;
        destinations[r].write(lo, std::min(hi, destinations[r].size()), segment_.slot(r, half));
      }
    }
    return Status::OK();
  }

  Status broadcast(const BroadcastOptions& o) override {
    char* buffer = static_cast<char*>(o.buffer);
    for (size_t lo = 0; lo < o.bytes; lo += half_bytes_) {
      const size_t n = std::min(o.bytes - lo, half_bytes_);
      const int half = next_slot_half();
      if (rank_ == o.root) copy_bytes(segment_.slot(rank_, half), buffer + lo, n);
      Status s = arrive_and_wait();
      if (!s.ok()) return s;
      if (rank_ != o.root) copy_bytes(buffer + lo, segment_.slot(o.root, half), n);
    }
    return Status::OK();
  }

  Status alltoall(const AlltoallOptions& o) override {
    const size_t n = (size_t)size_;
    auto bytes = [&](size_t sender, size_t receiver) { return o.bytes[sender * n + receiver]; };
    // Where each sender's part for this rank starts in the sender's stream,
    // and where it lands in this rank's output.
    std::vector<size_t> send_offset(n, 0), receive_offset(n, 0), stream_bytes(n, 0);
    size_t received = 0;
    for (size_t s = 0; s < n; ++s) {
      for (size_t r = 0; r < n; ++r) {
        if (r < (size_t)rank_) send_offset[s] += bytes(s, r);
        stream_bytes[s] += bytes(s, r);
      }
      receive_offset[s] = received;
      received += bytes(s, rank_);
    }
    const char* input = static_cast<const char*>(o.input);
    char* output = static_cast<char*>(o.output);
    if (bytes(rank_, rank_) > 0)
      move_bytes(output + receive_offset[rank_], input + send_offset[rank_], bytes(rank_, rank_));
    const size_t longest = *std::max_element(stream_bytes.begin(), stream_bytes.end());
    for (size_t lo = 0; lo < longest; lo += half_bytes_) {
      const size_t hi = std::min(longest, lo + half_bytes_);
      const int half = next_slot_half();
      if (lo < stream_bytes[rank_])
        copy_bytes(segment_.slot(rank_, half), input + lo, std::min(hi, stream_bytes[rank_]) - lo);
      Status s = arrive_and_wait();
      if (!s.ok()) return s;
      for (size_t sender = 0; sender < n; ++sender) {
        if (sender == (size_t)rank_) continue;
        const size_t begin = std::max(lo, send_offset[sender]);
        const size_t end = std::min(hi, send_offset[sender] + bytes(sender, rank_));
        if (begin < end)
          copy_bytes(output + receive_offset[sender] + (begin - send_offset[sender]),
                      segment_.slot(sender, half) + (begin - lo), end - begin);
      }
    }
    return Status::OK();
  }

  Status reducescatter(const ReducescatterOptions& o) override {
    // Each rank's input is cut into one stream per owner: the bytes that
    // owner r reduces, tensor after tensor. A window takes the next equal
    // share of every owner's stream, side by side in the slot, so every
    // rank reduces its share of every window at once. (Cut in stream
    // order instead, a large tensor's first half would be one rank's
    // alone, and the others would wait through its windows.)
    std::vector<ByteStream> by_owner(size_);
    ByteStream mine;
    for (const auto& t : o.tensors) {
      size_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        by_owner[r].append(static_cast<const char*>(t.input) + offset, t.bytes_per_rank[r]);
        offset += t.bytes_per_rank[r];
      }
      mine.append(t.output, t.bytes_per_rank[rank_]);
    }
    size_t longest = 0;
    for (const ByteStream& b : by_owner) longest = std::max(longest, b.size());
    const size_t element = dtype_size(o.reduce.dtype);
    const size_t share = round_down(half_bytes_ / size_, element);
    if (share == 0)  // a slot half holds at least 4 KiB: more than 512 ranks on one host
      return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: reducescatter: a shared-memory slot half of " +
                                                       std::to_string(half_bytes_) + " bytes is too small for " +
                                                       std::to_string(size_) + " ranks; raise UNISON_SHM_SLOT_BYTES");
    std::vector<const void*> inputs(size_);
    for (size_t lo = 0; lo < longest; lo += share) {
      const size_t hi = lo + share;
      const int half = next_slot_half();
      char* slot = segment_.slot(rank_, half);
      for (int r = 0; r < size_; ++r)
        if (lo < by_owner[r].size()) by_owner[r].read(lo, std::min(hi, by_owner[r].size()), slot + r * share);
      Status s = arrive_and_wait();
      if (!s.ok()) return s;
      if (lo >= mine.size()) continue;
      const size_t n = std::min(hi, mine.size()) - lo;
      for (int r = 0; r < size_; ++r) inputs[r] = segment_.slot(r, half) + rank_ * share;
      // The reduction goes straight into the output where this share of it
      // is one piece of memory; across a tensor boundary, through staging.
      bool contiguous = true;
      char* direct = nullptr;
      mine.for_each(lo, lo + n, [&](size_t at, char* p, size_t m) {
        if (at == lo && m == n) direct = p; else contiguous = false;
      });
      if (contiguous && direct != nullptr) {
        reduce(o.reduce, inputs.data(), size_, direct, n / element);
      } else {
        std::vector<char> staging(n);
        reduce(o.reduce, inputs.data(), size_, staging.data(), n / element);
        mine.write(lo, lo + n, staging.data());
      }
    }
    return Status::OK();
  }

 private:
  // Every rank reduces the whole window from every slot: one barrier.
  Status reduce_everywhere(const ReduceSpec& spec, const ByteStream& in, const ByteStream& out,
                           size_t lo, size_t hi, int half) {
    {
      TimelinePhase phase("PACK");
      in.read(lo, hi, segment_.slot(rank_, half));
    }
    Status s = waited();
    if (!s.ok()) return s;
    TimelinePhase phase("REDUCE_INTO_OUTPUT");
    const size_t element = dtype_size(spec.dtype);
    std::vector<const void*> inputs(size_);
    out.for_each(lo, hi, [&](size_t at, char* p, size_t n) {
      for (int r = 0; r < size_; ++r) inputs[r] = segment_.slot(r, half) + (at - lo);
      reduce(spec, inputs.data(), size_, p, n / element);
    });
    return Status::OK();
  }

  // Rank r reduces chunk r of the window into its own slot, then everyone
  // copies every chunk out: two barriers, each byte reduced once.
  Status reduce_scatter_gather(const ReduceSpec& spec, const ByteStream& in, const ByteStream& out,
                               size_t lo, size_t hi, int half) {
    const size_t element = dtype_size(spec.dtype);
    const size_t count = (hi - lo) / element;
    std::vector<size_t> bounds(size_ + 1);
    for (int r = 0; r <= size_; ++r) bounds[r] = lo + count * r / size_ * element;
    char* mine = segment_.slot(rank_, half);
    const size_t my_begin = bounds[rank_], my_end = bounds[rank_ + 1];
    {
      TimelinePhase phase("PACK");
      in.read(lo, my_begin, mine);
      in.read(my_end, hi, mine + (my_end - lo));
    }
    Status s = waited();
    if (!s.ok()) return s;
    // The reduced chunk goes to this rank's slot for the peers and, in the
    // same pass, to its own output, so the gather skips it.
    std::vector<const void*> inputs(size_);
    {
      TimelinePhase phase("REDUCE");
      in.for_each(my_begin, my_end, [&](size_t at, char* p, size_t n) {
        out.for_each(at, at + n, [&](size_t piece, char* q, size_t bytes) {
          for (int r = 0; r < size_; ++r)
            inputs[r] = r == rank_ ? p + (piece - at) : segment_.slot(r, half) + (piece - lo);
          reduce(spec, inputs.data(), size_, mine + (piece - lo), bytes / element, q);
        });
      });
    }
    s = waited();
    if (!s.ok()) return s;
    TimelinePhase phase("UNPACK");
    for (int r = 0; r < size_; ++r)
      if (r != rank_) out.write(bounds[r], bounds[r + 1], segment_.slot(r, half) + (bounds[r] - lo));
    return Status::OK();
  }

  // arrive_and_wait, shown on the timeline: time spent waiting for the
  // slowest rank is not time spent moving bytes.
  Status waited() {
    TimelinePhase phase("WAIT_FOR_PEERS");
    return arrive_and_wait();
  }

  void copy_own_part(const ByteStream& from, const ByteStream& to) {
    from.for_each(0, from.size(), [&](size_t at, char* p, size_t n) {
      to.for_each(at, at + n, [&](size_t at2, char* q, size_t m) {
        if (q != p + (at2 - at)) move_bytes(q, p + (at2 - at), m);
      });
    });
  }

  Status post_message(const std::string& message, int half) {
    if (message.size() > segment_.header()->message_half_bytes)
      return Status::Error(UNISON_ERR_INTERNAL, "unison: control message of " +
                                                    std::to_string(message.size()) +
                                                    " bytes exceeds UNISON_CONTROL_MESSAGE_BYTES");
    std::memcpy(segment_.mailbox(rank_, half), message.data(), message.size());
    me_->message_bytes[half].store((uint32_t)message.size(), std::memory_order_release);
    return Status::OK();
  }

  int next_mailbox_half() { return (int)(mailbox_calls_++ & 1); }
  int next_slot_half() { return (int)(slot_rounds_++ & 1); }

  // The barrier: announce this step, then wait until every rank has.
  Status arrive_and_wait() {
    if (!broken_.ok()) return broken_;
    beat_everywhere_if_due();
    const uint64_t step = ++step_;
    me_->arrived.store(step, std::memory_order_release);
    segment_.header()->barrier_bell.ring();
    auto everyone_arrived = [&] {
      for (int r = 0; r < size_; ++r)
        if (segment_.rank_area(r)->arrived.load(std::memory_order_acquire) < step) return false;
      return true;
    };
    if (everyone_arrived()) return Status::OK();
    const double spin_until = monotonic_seconds() + config_.spin_microseconds * 1e-6;
    while (monotonic_seconds() < spin_until) {
      for (int i = 0; i < 32; ++i) {
        if (everyone_arrived()) return Status::OK();
        spin_step(config_.spin_yields_core);
      }
    }
    Doorbell& bell = segment_.header()->barrier_bell;
    for (;;) {
      const uint32_t token = bell.token();
      if (everyone_arrived()) return Status::OK();
      bell.sleep(token, kLivenessInterval);
      if (everyone_arrived()) return Status::OK();
      Status s = check_peers();
      if (!s.ok()) return s;
    }
  }

  void beat() { me_->heartbeat_ns.store(monotonic_nanoseconds(), std::memory_order_relaxed); }

  // Ranks that keep pace with each other never sleep in arrive_and_wait,
  // and so never beat there. A long collective in one set (a large
  // allreduce between two ranks of a loaded machine) then left them silent
  // for the peer timeout to the ranks waiting on them in another set, which
  // named them dead. So each arrival beats every plane, at most once per
  // liveness interval: a clock read per round otherwise.
  void beat_everywhere_if_due() {
    const int64_t now = monotonic_nanoseconds();
    if (now - last_beat_everywhere_ns_ < (int64_t)(kLivenessInterval * 1e9)) return;
    last_beat_everywhere_ns_ = now;
    beat_everywhere();
  }

  // A peer that left: one that stopped on a failure is reported with it,
  // before one that shut down (perhaps on hearing of that failure).
  Status check_left() {
    int shut_down = -1;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || !segment_.rank_area(r)->left.load()) continue;
      const RankArea* area = segment_.rank_area(r);
      const int code = area->stopped_code.load(std::memory_order_acquire);
      if (code != 0)
        return broken_ = Status::Error(code, std::string(area->stopped_on) + "; " + describe(r) + " stopped on that");
      if (shut_down < 0) shut_down = r;
    }
    if (shut_down < 0) return Status::OK();
    return broken_ = Status::Error(UNISON_ERR_SHUT_DOWN, "unison: " + describe(shut_down) +
                                                             " has shut down; no more collectives can run with it");
  }

  std::string describe(int rank) const {
    const int global = config_.host_ranks.empty() ? rank : config_.host_ranks[rank];
    return "rank " + std::to_string(global) + " (pid " + std::to_string(segment_.rank_area(rank)->pid.load()) + ")";
  }

  Status fail(const std::string& what, bool several = false) {
    broken_ = Status::Error(UNISON_ERR_RANK_FAILED, "unison: " + what + "; collectives with " +
                                                        (several ? "them" : "it") + " can no longer complete");
    return broken_;
  }

  // How often a waiting rank looks at its peers: a dead peer is noticed
  // within this long (pidfd) or within the peer timeout (a frozen one).
  static constexpr double kLivenessInterval = 0.05;

  Config config_;
  int generation_ = 0;
  // A set's segment: the job's backend, whose segment says which ranks
  // live. The set's own heartbeats would not: a rank beats a segment only
  // while it waits in it, so a member that had not waited in its set for
  // the peer timeout looked dead to one that had (trainers in a set older
  // than 10 s, on a loaded machine, failed as "no sign of life"). The job's
  // segment is beaten by every rank's engine while it idles, and by any of
  // its sets' waits through this. Null for the job's own.
  ShmBackend* job_ = nullptr;
  ShmSegment segment_;
  int rank_ = 0;
  int size_ = 1;
  size_t half_bytes_ = 0;
  RankArea* me_ = nullptr;
  int beat_id_ = 0;  // liveness.h
  std::vector<int> pidfds_;
  uint64_t step_ = 0;
  uint64_t mailbox_calls_ = 0;
  uint64_t slot_rounds_ = 0;
  int64_t last_beat_everywhere_ns_ = 0;
  Status broken_;
};

}  // namespace

bool shm_backend_available() { return true; }

Status make_shm_backend(const Config& config, int generation, std::unique_ptr<Backend>* out,
                        const std::function<Status()>& start_watch) {
  if (config.job_id.empty())
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                         "unison: UNISON_SIZE is " + std::to_string(config.size) +
                             " but UNISON_JOB_ID is not set; start multi-rank jobs with unisonrun");
  auto backend = std::make_unique<ShmBackend>(config);
  Status s = backend->start(generation, nullptr, start_watch);
  if (!s.ok()) return s;
  *out = std::move(backend);
  return Status::OK();
}

}  // namespace unison
