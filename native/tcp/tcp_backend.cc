// The TCP backend: ranks on different hosts, with no MPI. The launcher
// (`unisonrun -H`) names a rendezvous and a secret; mesh.h connects every
// pair of ranks; this file builds the collectives from point-to-point moves.
//
//   allreduce, small (up to kDirectAllreduceBytes): every rank sends its
//       whole input to every other and reduces all of them in rank order:
//       one round trip, the same bits on every rank, and the same bits as
//       the shared-memory backend.
//   allreduce, large: a ring. Each rank's data is cut into one chunk per
//       rank; N-1 steps of reduce-scatter pass partial sums to the right
//       neighbour until each rank holds one chunk summed over all, then N-1
//       steps of allgather pass the finished chunks round. Chunks move in
//       pieces of kPieceBytes, and a piece is reduced and passed on the
//       moment it arrives, so the wire, the reduction and the next piece
//       overlap. Each rank sends and receives 2(N-1)/N of the data, the
//       least an allreduce can. Every rank ends with the same bits; they are
//       the ring's order of summation, not rank order.
//   allgather, alltoall, reducescatter, broadcast: direct. Each rank sends
//       each peer exactly the bytes that peer needs, all at once. For these
//       a ring moves the same bytes per rank in N-1 rounds instead of one.
//       Reducescatter reduces in rank order, like shared memory.
//
// A process set, or the hierarchical layout's cross group, is a view of the
// same connections: its own member list, and a channel that tags its frames.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "../backend.h"
#include "../copy.h"
#include "../dtype.h"
#include "../hierarchical.h"
#include "../log.h"
#include "../timeline.h"
#include "mesh.h"

namespace unison {
namespace {

// Below this, one round of whole-input exchange beats the ring's 2(N-1)
// rounds (docs/design-notes.md, "Across hosts").
constexpr size_t kDirectAllreduceBytes = 64u << 10;
// Pipeline piece: large enough that a frame's header and system calls are
// noise, small enough that N pieces are in flight well before one chunk is.
constexpr size_t kPieceBytes = 256u << 10;
// Channels of the hierarchical layout's cross groups, out of the way of
// process set ids.
constexpr uint32_t kCrossChannel = 0x80000000u;

class TcpBackend final : public Backend {
 public:
  TcpBackend(std::shared_ptr<Mesh> mesh, std::vector<int> members, uint32_t channel, const Config& config)
      : mesh_(std::move(mesh)), members_(std::move(members)), channel_(channel), config_(config) {
    me_ = (int)(std::find(members_.begin(), members_.end(), mesh_->rank()) - members_.begin());
  }

  const char* name() const override { return "tcp"; }
  int rank() const override { return me_; }
  int size() const override { return (int)members_.size(); }

  // ---- control plane -------------------------------------------------------

  Status exchange(const std::string& mine, std::vector<std::string>* everyone) override {
    everyone->assign(size(), std::string());
    Moves moves(mesh_->size());
    for (int i = 0; i < size(); ++i) {
      if (i == me_) continue;
      moves.send_message(members_[i], mine);
      moves.receive_message(members_[i], &(*everyone)[i], max_message_bytes());
    }
    Status s = mesh_->run(&moves, channel_, "a control message exchange");
    (*everyone)[me_] = mine;
    return s;
  }

  Status broadcast_message(std::string* message, int root) override {
    Moves moves(mesh_->size());
    if (me_ == root) {
      for (int i = 0; i < size(); ++i)
        if (i != me_) moves.send_message(members_[i], *message);
    } else {
      moves.receive_message(members_[root], message, max_message_bytes());
    }
    return mesh_->run(&moves, channel_, "a control message broadcast");
  }

  size_t max_message_bytes() const override { return config_.control_message_bytes; }

  // ---- cycle scheduling ----------------------------------------------------
  // Counts travel as small frames to every member, on this view's channel.

  uint64_t requested_cycles() const override {
    requested_ = std::max(requested_, mesh_->heard(channel_));
    return requested_;
  }
  void request_cycles(uint64_t count) override {
    if (count <= requested_) return;  // told already: counts only grow
    requested_ = count;
    mesh_->announce(channel_, members_, count);
  }
  uint32_t activity_token() const override { return mesh_->activity_token(); }
  void wait_for_activity(uint32_t token, double timeout_seconds) override {
    const uint64_t before = requested_;
    const double until = monotonic_seconds() + timeout_seconds;
    for (;;) {
      if (requested_cycles() > before || mesh_->activity_token() != token) return;
      const double left = until - monotonic_seconds();
      if (left <= 0) return;
      mesh_->wait(left);
    }
  }
  void wake() override { mesh_->wake(); }

  Status check_peers() override { return mesh_->check(); }
  void stopped_on(const Status& cause) override { mesh_->stopped_on(cause); }

  // ---- data plane ----------------------------------------------------------

  Status allreduce(const AllreduceOptions& o) override {
    size_t total = 0;
    for (const Segment& s : o.segments) total += s.bytes;
    if (total <= kDirectAllreduceBytes || size() == 1) return allreduce_direct(o, total);
    // The ring works in place on one run of memory: the output itself when
    // there is one tensor, else a staging buffer.
    char* work;
    if (o.segments.size() == 1) {
      work = static_cast<char*>(o.segments[0].output);
    } else {
      staging_.resize(total);
      work = staging_.data();
    }
    // Prescale once, on the way in; the ring then only combines.
    ReduceSpec in_spec = o.reduce;
    in_spec.postscale = 1.0;
    in_spec.reduce_op = UNISON_SUM;
    const size_t element = dtype_size(o.reduce.dtype);
    size_t at = 0;
    {
      TimelinePhase phase("PACK");
      for (const Segment& s : o.segments) {
        const void* source = s.input;
        if (in_spec.prescale != 1.0) reduce(in_spec, &source, 1, work + at, s.bytes / element);
        else if (work + at != s.input) copy_bytes(work + at, s.input, s.bytes);
        at += s.bytes;
      }
    }
    Status s;
    {
      // Pieces pass round the ring reduced on arrival: the reduce-scatter
      // and the allgather overlap, so they are one phase.
      TimelinePhase phase("RING");
      s = ring_allreduce(o.reduce, work, total);
    }
    if (!s.ok() || o.segments.size() == 1) return s;
    TimelinePhase phase("UNPACK");
    at = 0;
    for (const Segment& seg : o.segments) {
      copy_bytes(seg.output, work + at, seg.bytes);
      at += seg.bytes;
    }
    return s;
  }

  Status allgather(const AllgatherOptions& o) override {
    Moves moves(mesh_->size());
    for (const auto& t : o.tensors) {
      size_t at = 0;
      for (int i = 0; i < size(); ++i) {
        char* place = static_cast<char*>(t.output) + at;
        if (i == me_) {
          if (place != t.input && t.bytes_per_rank[i] > 0) copy_bytes(place, t.input, t.bytes_per_rank[i]);
          for (int j = 0; j < size(); ++j)
            if (j != me_) moves.send(members_[j], t.input, t.bytes_per_rank[i]);
        } else {
          moves.receive(members_[i], place, t.bytes_per_rank[i]);
        }
        at += t.bytes_per_rank[i];
      }
    }
    return mesh_->run(&moves, channel_, "an allgather");
  }

  Status broadcast(const BroadcastOptions& o) override {
    Moves moves(mesh_->size());
    if (me_ == o.root) {
      for (int i = 0; i < size(); ++i)
        if (i != me_) moves.send(members_[i], o.buffer, o.bytes);
    } else {
      moves.receive(members_[o.root], o.buffer, o.bytes);
    }
    return mesh_->run(&moves, channel_, "a broadcast");
  }

  Status alltoall(const AlltoallOptions& o) override {
    const int n = size();
    Moves moves(mesh_->size());
    size_t sent = 0, received = 0;
    for (int i = 0; i < n; ++i) {
      const size_t out_bytes = o.bytes[me_ * n + i], in_bytes = o.bytes[i * n + me_];
      const char* from = static_cast<const char*>(o.input) + sent;
      char* into = static_cast<char*>(o.output) + received;
      if (i == me_) {
        if (out_bytes > 0) move_bytes(into, from, out_bytes);
      } else {
        moves.send(members_[i], from, out_bytes);
        moves.receive(members_[i], into, in_bytes);
      }
      sent += out_bytes;
      received += in_bytes;
    }
    return mesh_->run(&moves, channel_, "an alltoall");
  }

  Status reducescatter(const ReducescatterOptions& o) override {
    const int n = size();
    // Every peer's part for this rank, tensor after tensor.
    size_t incoming = 0;
    for (const auto& t : o.tensors) incoming += t.bytes_per_rank[me_] * (n - 1);
    scratch_.resize(incoming);
    Moves moves(mesh_->size());
    size_t at = 0;
    for (const auto& t : o.tensors) {
      size_t offset = 0;
      for (int i = 0; i < n; ++i) {
        if (i != me_) moves.send(members_[i], static_cast<const char*>(t.input) + offset, t.bytes_per_rank[i]);
        offset += t.bytes_per_rank[i];
      }
      for (int i = 0; i < n; ++i) {
        if (i == me_) continue;
        moves.receive(members_[i], scratch_.data() + at, t.bytes_per_rank[me_]);
        at += t.bytes_per_rank[me_];
      }
    }
    Status s = mesh_->run(&moves, channel_, "a reducescatter");
    if (!s.ok()) return s;
    const size_t element = dtype_size(o.reduce.dtype);
    std::vector<const void*> inputs(n);
    at = 0;
    for (const auto& t : o.tensors) {
      size_t mine = 0;
      for (int i = 0; i < me_; ++i) mine += t.bytes_per_rank[i];
      for (int i = 0; i < n; ++i) {
        if (i == me_) {
          inputs[i] = static_cast<const char*>(t.input) + mine;
        } else {
          inputs[i] = scratch_.data() + at;
          at += t.bytes_per_rank[me_];
        }
      }
      if (t.bytes_per_rank[me_] > 0) reduce(o.reduce, inputs.data(), n, t.output, t.bytes_per_rank[me_] / element);
    }
    return Status::OK();
  }

  // A set is a view of the same connections, with a channel of its own.
  Status split(const std::vector<int>& members, int set_id, std::unique_ptr<Backend>* out) override {
    out->reset();
    if (std::find(members.begin(), members.end(), me_) == members.end()) return Status::OK();
    std::vector<int> ranks;
    for (int i : members) ranks.push_back(members_[i]);
    *out = std::make_unique<TcpBackend>(mesh_, ranks, (uint32_t)set_id, config_);
    return Status::OK();
  }

 private:
  Status allreduce_direct(const AllreduceOptions& o, size_t total) {
    const int n = size();
    scratch_.resize(total * (n - 1));
    Moves moves(mesh_->size());
    // Peer i's input lands at slot(i); segment by segment, so nothing is
    // packed on the way out.
    auto slot = [&](int i) { return scratch_.data() + (size_t)(i < me_ ? i : i - 1) * total; };
    for (int i = 0; i < n; ++i) {
      if (i == me_) continue;
      size_t at = 0;
      for (const Segment& s : o.segments) {
        moves.send(members_[i], s.input, s.bytes);
        moves.receive(members_[i], slot(i) + at, s.bytes);
        at += s.bytes;
      }
    }
    Status s;
    {
      TimelinePhase phase("EXCHANGE");
      s = mesh_->run(&moves, channel_, "an allreduce");
    }
    if (!s.ok()) return s;
    TimelinePhase phase("REDUCE");
    const size_t element = dtype_size(o.reduce.dtype);
    std::vector<const void*> inputs(n);
    size_t at = 0;
    for (const Segment& seg : o.segments) {
      for (int i = 0; i < n; ++i) inputs[i] = i == me_ ? seg.input : slot(i) + at;
      if (seg.bytes > 0) reduce(o.reduce, inputs.data(), n, seg.output, seg.bytes / element);
      at += seg.bytes;
    }
    return Status::OK();
  }

  // The ring on `work` (already prescaled): see the top of the file.
  Status ring_allreduce(const ReduceSpec& spec, char* work, size_t total) {
    const int n = size();
    const size_t element = dtype_size(spec.dtype);
    const size_t count = total / element;
    // Chunk c is elements [count*c/n, count*(c+1)/n); pieces cut each chunk
    // the same way on every rank.
    auto chunk_start = [&](int c) { return count * (size_t)c / n * element; };
    auto chunk_bytes = [&](int c) { return chunk_start(c + 1) - chunk_start(c); };
    const size_t piece = std::max(element, kPieceBytes / element * element);
    size_t widest = 0;
    for (int c = 0; c < n; ++c) widest = std::max(widest, chunk_bytes(c));
    const size_t pieces = (widest + piece - 1) / piece;
    scratch_.resize(widest);
    auto wrap = [&](int c) { return ((c % n) + n) % n; };
    const int right = members_[wrap(me_ + 1)], left = members_[wrap(me_ - 1)];
    ReduceSpec combine = spec;  // partial sums: no scaling, no division
    combine.prescale = combine.postscale = 1.0;
    if (combine.reduce_op == UNISON_AVERAGE) combine.reduce_op = UNISON_SUM;
    ReduceSpec finish = spec;  // once, on the finished chunk
    finish.prescale = 1.0;
    const bool finishing = finish.postscale != 1.0 || (finish.reduce_op == UNISON_AVERAGE && n > 1);

    Moves moves(mesh_->size());
    // Step s of 2(n-1): s < n-1 reduce-scatters, the rest allgather. A
    // piece's arrival at step s queues its part of step s+1, so each piece
    // travels the ring as soon as it can.
    std::function<void(int, size_t)> arrive;
    auto queue_step = [&](int step, size_t p) {
      const int sending = step < n - 1 ? wrap(me_ - step) : wrap(me_ + 1 - (step - (n - 1)));
      const int receiving = wrap(sending - 1);
      const size_t send_at = chunk_start(sending) + p * piece, receive_at = chunk_start(receiving) + p * piece;
      const size_t send_bytes = p * piece < chunk_bytes(sending) ? std::min(piece, chunk_bytes(sending) - p * piece) : 0;
      const size_t receive_bytes =
          p * piece < chunk_bytes(receiving) ? std::min(piece, chunk_bytes(receiving) - p * piece) : 0;
      moves.send(right, work + send_at, send_bytes);
      char* into = step < n - 1 ? scratch_.data() + p * piece : work + receive_at;
      moves.receive(left, into, receive_bytes, [&, step, p, receive_at, receive_bytes] {
        if (step < n - 1 && receive_bytes > 0) {
          const void* inputs[2] = {scratch_.data() + p * piece, work + receive_at};
          reduce(combine, inputs, 2, work + receive_at, receive_bytes / element);
          // The last reduce-scatter step leaves this piece finished here.
          if (step == n - 2 && finishing) {
            const void* done = work + receive_at;
            reduce(finish, &done, 1, work + receive_at, receive_bytes / element);
          }
        }
        if (step + 1 < 2 * (n - 1)) arrive(step + 1, p);
      });
    };
    arrive = queue_step;
    for (size_t p = 0; p < pieces; ++p) queue_step(0, p);
    return mesh_->run(&moves, channel_, "an allreduce");
  }

  std::shared_ptr<Mesh> mesh_;
  std::vector<int> members_;  // mesh ranks, by this view's rank
  uint32_t channel_;
  Config config_;
  int me_ = 0;
  mutable uint64_t requested_ = 0;
  std::vector<char> scratch_, staging_;
};

}  // namespace

bool tcp_backend_available() { return true; }

Status make_tcp_backend(Config* config, int generation, std::unique_ptr<Backend>* out) {
  std::shared_ptr<Mesh> mesh;
  Status s = Mesh::connect(*config, &mesh);
  if (!s.ok()) return s;
  std::vector<std::string> hosts;
  for (const TcpPeer& p : mesh->peers()) hosts.push_back(p.host);
  const HostLayout layout = layout_of(hosts);
  place_rank(config, config->rank, layout);
  const int host_count = (int)layout.host_ranks.size();
  std::vector<int> everyone(config->size);
  for (int r = 0; r < config->size; ++r) everyone[r] = r;
  // A rank that fails or dies before it reaches shared memory has closed
  // its connections: the local ranks waiting for it there learn so.
  const auto nobody_left = [mesh]() { return mesh->check_nobody_left("while the ranks of a host set up shared memory"); };
  if (host_count == 1) return make_shm_backend(*config, generation, out, nobody_left);
  if (config->hierarchical && layout.same_size_hosts() && config->local_size > 1) {
    // Local rank l's group: the l-th rank of every host, in host order.
    std::vector<int> group;
    for (const auto& ranks : layout.host_ranks) group.push_back(ranks[config->local_rank]);
    const Config& c = *config;
    return make_hierarchical_backend(
        c, layout, generation,
        [&](Backend*, std::unique_ptr<Backend>* world, std::unique_ptr<Backend>* cross) {
          *world = std::make_unique<TcpBackend>(mesh, everyone, 0, c);
          *cross = std::make_unique<TcpBackend>(mesh, group, kCrossChannel + (uint32_t)c.local_rank, c);
          return Status::OK();
        },
        out, nobody_left);
  }
  static bool warned = false;  // once per process, not at every init
  if (config->hierarchical && config->local_size > 1 && config->rank == 0 && !warned) {
    warned = true;
    log_message(LogLevel::warning,
                "unison: hosts run different numbers of ranks, so every collective goes over TCP (flat)\n");
  }
  *out = std::make_unique<TcpBackend>(mesh, everyone, 0, *config);
  return Status::OK();
}

}  // namespace unison
