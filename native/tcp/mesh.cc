#include "mesh.h"
#include "socket.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "../liveness.h"

namespace unison {
namespace {

enum FrameKind : uint32_t {
  kData = 1,     // payload follows
  kCycles = 2,   // length is a cycle count (cycle scheduling)
  kBeat = 3,     // a heartbeat: this rank is alive
  kGoodbye = 4,  // this rank is shutting down; its connection closes next
  kStopped = 5,  // this rank stopped on a failure: channel is its code, the payload its message
};
constexpr size_t kStopNoticeBytes = 4096;  // the longest kStopped message read
// The most of a half-sent data frame a failed run keeps to finish sending
// (keep_half_sent_frames): a ring piece or a small tensor, not a huge one.
constexpr size_t kLongestRestKept = 64u << 20;
// How long a stopping rank keeps sending its stop notices (and the frames
// ahead of them) to peers slow to read them, at most.
constexpr double kStopNoticeSeconds = 2.0;

// How often a waiting rank looks at the clock for heartbeats and silence,
// at the longest.
constexpr int kPollMilliseconds = 50;

}  // namespace

void Moves::send(int peer, const void* data, size_t bytes) {
  // Both sides know a data move's size, so an empty one is skipped by both.
  if (bytes > 0) sends_[peer].push_back({static_cast<const char*>(data), bytes});
}

void Moves::send_message(int peer, const std::string& message) {
  sends_[peer].push_back({message.data(), message.size()});
}

void Moves::receive(int peer, void* data, size_t bytes, std::function<void()> then) {
  if (bytes > 0 || then) receives_[peer].push_back({static_cast<char*>(data), bytes, nullptr, 0, std::move(then)});
}

void Moves::receive_message(int peer, std::string* message, size_t limit) {
  receives_[peer].push_back({nullptr, 0, message, limit, nullptr});
}

Mesh::~Mesh() {
  if (beat_id_ != 0) remove_beat(beat_id_);
  // A goodbye first, so that a peer reading on sees a departure, not a crash.
  for (size_t p = 0; p < connections_.size(); ++p) {
    Connection& c = connections_[p];
    if (c.fd < 0) continue;
    if (!c.sending && !c.closed) {
      const Frame bye{kGoodbye, 0, 0};
      c.outbox.append(reinterpret_cast<const char*>(&bye), sizeof(bye));
      send(c.fd, c.outbox.data() + c.outbox_sent, c.outbox.size() - c.outbox_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    close(c.fd);
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

std::string Mesh::describe(int rank) const {
  const TcpPeer& p = peers_[rank];
  return "rank " + std::to_string(rank) + " (host " + p.host + ", pid " + std::to_string(p.pid) + ")";
}

Status Mesh::fail(const Status& s) {
  if (broken_.ok()) broken_ = s;
  return broken_;
}

Status Mesh::closed_error(int peer, const char* what) const {
  const Connection& c = connections_[peer];
  if (c.stopped_code != 0) return Status::Error(c.stopped_code, c.stopped_on + "; " + describe(peer) + " stopped on that");
  if (c.said_goodbye)
    return Status::Error(UNISON_ERR_SHUT_DOWN, "unison: " + describe(peer) + " has shut down; " + what +
                                                   " cannot complete without it");
  return Status::Error(UNISON_ERR_RANK_FAILED, "unison: " + describe(peer) + " closed its connection during " + what +
                                                   ": it exited or was killed, or its host went away");
}

Status Mesh::left_during_start_up(int peer, const std::string& when) const {
  return Status::Error(UNISON_ERR_RANK_FAILED, "unison: " + describe(peer) + " closed its connection " + when +
                                                   ": it exited, was killed or gave up while the job started");
}

Status Mesh::check_nobody_left(const std::string& when) const {
  std::vector<int> fds;
  for (const Connection& c : connections_) fds.push_back(c.fd);
  const int gone = first_closed(fds);
  return gone < 0 ? Status::OK() : left_during_start_up(gone, when);
}

void Mesh::queue_small_frame(int peer, uint32_t kind, uint32_t channel, uint64_t value) {
  Connection& c = connections_[peer];
  if (c.fd < 0 || c.closed) return;
  const Frame f{kind, channel, value};
  c.outbox.append(reinterpret_cast<const char*>(&f), sizeof(f));
}

// ---- moving bytes -------------------------------------------------------------

Status Mesh::pump_in(int peer, std::deque<Moves::Receive>* receives, uint32_t channel, const char* what,
                     bool* progressed) {
  Connection& c = connections_[peer];
  // The end of a peer's stream is an error only for a receive it leaves
  // unanswered: a rank that shut down closes right after its last send.
  auto ended = [&]() {
    c.closed = true;
    return receives != nullptr && !receives->empty() ? closed_error(peer, what) : Status::OK();
  };
  if (c.closed) return ended();
  for (;;) {
    if (c.stopped_length > 0) {  // a kStopped frame's message, then nothing more
      const size_t have = c.stopped_on.size();
      c.stopped_on.resize(c.stopped_length);
      const ssize_t n = recv(c.fd, &c.stopped_on[have], c.stopped_length - have, MSG_DONTWAIT);
      c.stopped_on.resize(have + (n > 0 ? (size_t)n : 0));
      if (n == 0) return ended();
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Status::OK() : ended();
      *progressed = true;
      if (c.stopped_on.size() < c.stopped_length) continue;
      c.stopped_length = 0;
      c.stopped_code = (int)c.header.channel;
      return ended();
    }
    if (receives != nullptr && !receives->empty() && receives->front().message == nullptr &&
        receives->front().bytes == 0) {
      std::function<void()> then = std::move(receives->front().then);  // an empty move: nothing on the wire
      receives->pop_front();
      if (then) then();
      continue;
    }
    if (!c.header_ready) {
      const ssize_t n = recv(c.fd, reinterpret_cast<char*>(&c.header) + c.header_have, sizeof(Frame) - c.header_have,
                             MSG_DONTWAIT);
      if (n == 0) return ended();
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Status::OK() : ended();
      *progressed = true;
      c.last_heard = monotonic_seconds();
      c.header_have += (size_t)n;
      if (c.header_have < sizeof(Frame)) continue;
      c.header_have = 0;
      switch (c.header.kind) {
        case kCycles: {
          uint64_t& heard = heard_[c.header.channel];
          heard = std::max(heard, c.header.length);
          continue;
        }
        case kBeat:
          continue;
        case kGoodbye:
          c.said_goodbye = true;
          continue;
        case kStopped:
          if (c.header.length == 0 || c.header.length > kStopNoticeBytes || c.header.channel == 0) {
            c.closed = true;
            return fail(Status::Error(UNISON_ERR_INTERNAL, "unison: " + describe(peer) +
                                                               " sent a malformed stop notice during " + what));
          }
          c.stopped_on.clear();
          c.stopped_length = (size_t)c.header.length;
          continue;
        case kData:
          c.header_ready = true;
          c.payload_have = 0;
          break;
        default:
          c.closed = true;
          return fail(Status::Error(UNISON_ERR_INTERNAL, "unison: " + describe(peer) + " sent a frame of unknown kind " +
                                                             std::to_string(c.header.kind) + " during " + what));
      }
    }
    // A data frame waits until a receive is posted for it.
    if (receives == nullptr || receives->empty()) return Status::OK();
    Moves::Receive& r = receives->front();
    const size_t length = (size_t)c.header.length;
    if (c.header.channel != channel || (r.message == nullptr && length != r.bytes) ||
        (r.message != nullptr && length > r.limit))
      return fail(Status::Error(
          UNISON_ERR_INTERNAL,
          "unison: out of step with " + describe(peer) + " during " + what + ": it sent " + std::to_string(length) +
              " bytes on channel " + std::to_string(c.header.channel) + " where " +
              (r.message ? "at most " + std::to_string(r.limit) : std::to_string(r.bytes)) + " were expected on channel " +
              std::to_string(channel)));
    if (r.message != nullptr && c.payload_have == 0) r.message->resize(length);
    char* into = r.message != nullptr ? &(*r.message)[0] : r.data;
    while (c.payload_have < length) {
      const ssize_t n = recv(c.fd, into + c.payload_have, length - c.payload_have, MSG_DONTWAIT);
      if (n == 0) return ended();
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Status::OK() : ended();
      *progressed = true;
      c.last_heard = monotonic_seconds();
      c.payload_have += (size_t)n;
    }
    c.header_ready = false;
    std::function<void()> then = std::move(r.then);
    receives->pop_front();
    if (then) then();
  }
}

Status Mesh::pump_out(int peer, std::deque<Moves::Send>* sends, uint32_t channel, const char* what,
                      bool* progressed) {
  Connection& c = connections_[peer];
  // A peer that has gone needs nothing more from this rank. Whether that is
  // an error depends on why it went, which only reading it can tell (run).
  if (c.cannot_send || c.stopped_code != 0) {
    if (sends != nullptr && (!sends->empty() || c.sending)) c.dropped_sends = true;
    if (sends != nullptr) sends->clear();
    c.sending = false;
    c.outbox.clear();
    c.outbox_sent = 0;
    return Status::OK();
  }
  // After a failed run a frame can stay half sent; the mesh is broken then.
  if (c.sending && (sends == nullptr || sends->empty())) return Status::OK();
  for (;;) {
    ssize_t n;
    if (c.sending) {
      const Moves::Send& s = sends->front();
      iovec parts[2];
      int count = 0;
      const size_t header_left = c.out_sent < sizeof(Frame) ? sizeof(Frame) - c.out_sent : 0;
      if (header_left > 0) parts[count++] = {reinterpret_cast<char*>(&c.out_header) + c.out_sent, header_left};
      const size_t payload_done = c.out_sent - (sizeof(Frame) - header_left);
      parts[count++] = {const_cast<char*>(s.data) + payload_done, s.bytes - payload_done};
      msghdr m{};
      m.msg_iov = parts;
      m.msg_iovlen = count;
      n = sendmsg(c.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_sent += (size_t)n;
        if (c.out_sent == sizeof(Frame) + s.bytes) {
          c.sending = false;
          sends->pop_front();
        }
      }
    } else if (c.outbox_sent < c.outbox.size()) {
      n = send(c.fd, c.outbox.data() + c.outbox_sent, c.outbox.size() - c.outbox_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.outbox_sent += (size_t)n;
        if (c.outbox_sent == c.outbox.size()) c.outbox.clear(), c.outbox_sent = 0;
      }
    } else if (sends != nullptr && !sends->empty()) {
      c.sending = true;
      c.out_header = {kData, channel, sends->front().bytes};
      c.out_sent = 0;
      continue;
    } else {
      return Status::OK();
    }
    if (n > 0) {
      *progressed = true;
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Status::OK();
    // The peer closed its end. It may have left cleanly having taken all it
    // needed (a rank that shut down after the last exchange): what it sent
    // before leaving is still to be read.
    c.cannot_send = true;
    return pump_out(peer, sends, channel, what, progressed);
  }
}

// After a run whose sends to some peer failed: fine if that peer said
// goodbye (it left after taking its part), an error if it just vanished. Its
// goodbye, or the end of its stream, is already on the way: it closed.
Status Mesh::settle_unsent(const char* what) {
  for (int p = 0; p < size(); ++p) {
    Connection& c = connections_[p];
    if (p == rank_ || !c.dropped_sends) continue;
    c.dropped_sends = false;
    const double until = monotonic_seconds() + std::min(1.0, config_.peer_timeout_seconds);
    while (!c.said_goodbye && !c.closed && monotonic_seconds() < until) {
      bool progressed = false;
      pump_in(p, nullptr, 0, what, &progressed);
      if (!progressed) {
        struct pollfd f = {c.fd, POLLIN, 0};
        poll(&f, 1, 10);
      }
    }
    if (!c.said_goodbye) {
      c.closed = true;
      return fail(closed_error(p, what));
    }
  }
  return Status::OK();
}

void Mesh::beat_from_other_planes() {
  // Heartbeats only, queued and sent if due: a data frame half sent (never
  // while another plane waits, in the hierarchical layout's phases) keeps
  // them queued behind it.
  beat_if_due();
  for (int p = 0; p < size(); ++p) {
    if (p == rank_ || connections_[p].outbox.empty()) continue;
    bool progressed = false;
    pump_out(p, nullptr, 0, "a heartbeat", &progressed);
  }
}

void Mesh::beat_if_due() {
  const double now = monotonic_seconds();
  if (now - last_beat_ < beat_interval_) return;
  last_beat_ = now;
  for (int p = 0; p < size(); ++p)
    // Not behind frames still unsent: one queued beat says as much as many.
    if (p != rank_ && connections_[p].outbox.empty()) queue_small_frame(p, kBeat, 0, 0);
}

Status Mesh::run(Moves* moves, uint32_t channel, const char* what) {
  if (!broken_.ok()) return broken_;
  Status s = run_to_the_end(moves, channel, what);
  if (!s.ok()) keep_half_sent_frames(moves);
  return s;
}

void Mesh::keep_half_sent_frames(Moves* moves) {
  for (int p = 0; p < size(); ++p) {
    Connection& c = connections_[p];
    if (p == rank_ || !c.sending || c.cannot_send || moves->sends_[p].empty()) continue;
    const Moves::Send& s = moves->sends_[p].front();
    if (sizeof(Frame) + s.bytes - c.out_sent > kLongestRestKept) continue;
    std::string rest;
    size_t payload_done = 0;
    if (c.out_sent < sizeof(Frame))
      rest.append(reinterpret_cast<const char*>(&c.out_header) + c.out_sent, sizeof(Frame) - c.out_sent);
    else
      payload_done = c.out_sent - sizeof(Frame);
    rest.append(s.data + payload_done, s.bytes - payload_done);
    // Ahead of the small frames queued meanwhile, which wait for it (their
    // outbox_sent is 0 while a data frame is half sent).
    c.outbox.insert(0, rest);
    c.sending = false;
    c.out_sent = 0;
  }
}

Status Mesh::run_to_the_end(Moves* moves, uint32_t channel, const char* what) {
  const double start = monotonic_seconds();
  double next_look = start;
  std::vector<struct pollfd> fds;
  std::vector<int> fd_peer;
  for (;;) {
    bool pending = false, progressed = false;
    for (int p = 0; p < size(); ++p) {
      if (p == rank_) continue;
      auto& sends = moves->sends_[p];
      auto& receives = moves->receives_[p];
      const Connection& c = connections_[p];
      if (sends.empty() && receives.empty() && c.outbox.empty() && !c.sending) continue;
      Status s = pump_out(p, &sends, channel, what, &progressed);
      if (s.ok()) s = pump_in(p, &receives, channel, what, &progressed);
      if (!s.ok()) return fail(s);
    }
    // Counted after every peer's turn: a receive's `then` may have given a
    // peer already passed new moves.
    for (int p = 0; p < size() && !pending; ++p)
      pending = !moves->sends_[p].empty() || !moves->receives_[p].empty() || connections_[p].sending;
    if (!pending) return settle_unsent(what);
    const double now = monotonic_seconds();
    if (now >= next_look) {
      next_look = now + beat_interval_ / 4;
      // Every plane's heartbeats, this mesh's among them (beat_from_other_planes):
      // this rank's own host's ranks may be waiting on it too (liveness.h).
      beat_everywhere();
      // A peer this rank waits on that has sent nothing, not even a
      // heartbeat, for the peer timeout is frozen or cut off.
      for (int p = 0; p < size(); ++p) {
        if (moves->sends_[p].empty() && moves->receives_[p].empty()) continue;
        const double silent = now - std::max(connections_[p].last_heard, start);
        if (silent > config_.peer_timeout_seconds)
          return fail(Status::Error(UNISON_ERR_RANK_FAILED,
                                    "unison: " + describe(p) + " has shown no sign of life for " +
                                        std::to_string((int)silent) + " s during " + what +
                                        " (UNISON_PEER_TIMEOUT_SECONDS is " +
                                        std::to_string((int)config_.peer_timeout_seconds) + ")"));
      }
    }
    if (progressed) continue;
    fds.clear();
    fd_peer.clear();
    for (int p = 0; p < size(); ++p) {
      if (p == rank_) continue;
      const Connection& c = connections_[p];
      const bool out = !moves->sends_[p].empty() || c.sending || !c.outbox.empty();
      const bool in = !moves->receives_[p].empty() || !c.header_ready;
      if (!out && moves->receives_[p].empty()) continue;
      fds.push_back({c.fd, (short)((in ? POLLIN : 0) | (out ? POLLOUT : 0)), 0});
      fd_peer.push_back(p);
    }
    poll(fds.data(), fds.size(), kPollMilliseconds);
  }
}

// ---- cycles, waiting, liveness --------------------------------------------------

void Mesh::announce(uint32_t channel, const std::vector<int>& peers, uint64_t count) {
  bool progressed = false;
  for (int p : peers) {
    if (p == rank_) continue;
    queue_small_frame(p, kCycles, channel, count);
    pump_out(p, nullptr, channel, "a cycle request", &progressed);  // a closed peer shows up in check()
  }
}

uint64_t Mesh::heard(uint32_t channel) {
  // A hierarchical host's leader waits by polling this, never wait(): it
  // must keep its heartbeats going from here.
  beat_if_due();
  drain_everyone();
  auto it = heard_.find(channel);
  return it == heard_.end() ? 0 : it->second;
}

Status Mesh::drain_everyone() {
  Status first;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_ || connections_[p].closed) continue;
    bool progressed = false;
    Status s = pump_out(p, nullptr, 0, "a wait", &progressed);
    if (s.ok()) s = pump_in(p, nullptr, 0, "a wait", &progressed);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

void Mesh::wait(double timeout_seconds) {
  beat_if_due();
  drain_everyone();
  std::vector<struct pollfd> fds;
  for (int p = 0; p < size(); ++p) {
    const Connection& c = connections_[p];
    if (p == rank_ || c.closed) continue;
    // A data frame whose header is in waits for its receive; its payload
    // would make the socket readable without end.
    const short events = (short)((c.header_ready ? 0 : POLLIN) | (c.outbox.empty() ? 0 : POLLOUT));
    if (events != 0) fds.push_back({c.fd, events, 0});
  }
  fds.push_back({wake_fd_, POLLIN, 0});
  const double limit = std::min(timeout_seconds, beat_interval_);
  if (poll(fds.data(), fds.size(), (int)(limit * 1000)) > 0) {
    if (fds.back().revents != 0) {
      uint64_t ignored;
      (void)!read(wake_fd_, &ignored, sizeof(ignored));
    }
    drain_everyone();
  }
}

void Mesh::wake() {
  doorbell_.ring();
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

void Mesh::stopped_on(const Status& cause) {
  const std::string message = cause.message.substr(0, kStopNoticeBytes);
  if (message.empty()) return;
  for (int p = 0; p < size(); ++p) {
    Connection& c = connections_[p];
    if (p == rank_ || c.fd < 0 || c.cannot_send || c.sending) continue;
    const Frame stopped{kStopped, (uint32_t)cause.code, message.size()};
    c.outbox.append(reinterpret_cast<const char*>(&stopped), sizeof(stopped));
    c.outbox += message;
  }
  // A peer reading its part of the failed collective takes the notice at
  // once; one that is slow to read is given a moment, since this rank may
  // exit as soon as its caller hears of the failure. This rank reads
  // nothing more (the mesh is broken from here), so what arrives meanwhile
  // is dropped: a peer stopping at the same moment may be sending the rest
  // of its own frame to this rank, and neither would get through otherwise.
  fail(cause);
  const double until = monotonic_seconds() + std::min(kStopNoticeSeconds, config_.peer_timeout_seconds);
  std::vector<struct pollfd> fds;
  char dropped[1 << 16];
  for (;;) {
    fds.clear();
    for (int p = 0; p < size(); ++p) {
      Connection& c = connections_[p];
      if (p == rank_ || c.fd < 0 || c.closed || c.sending || c.outbox.empty()) continue;
      bool progressed = false;
      pump_out(p, nullptr, 0, "a stop notice", &progressed);
      if (c.outbox.empty()) continue;
      ssize_t got;
      while ((got = recv(c.fd, dropped, sizeof(dropped), MSG_DONTWAIT)) > 0) {
      }
      if (got == 0) {  // it closed: it reads nothing more either
        c.closed = true;
        continue;
      }
      fds.push_back({c.fd, POLLOUT | POLLIN, 0});
    }
    const double left = until - monotonic_seconds();
    if (fds.empty() || left <= 0) return;
    poll(fds.data(), fds.size(), std::min(kPollMilliseconds, (int)(left * 1000) + 1));
  }
}

Status Mesh::check() {
  if (!broken_.ok()) return broken_;
  beat_if_due();
  drain_everyone();
  const double now = monotonic_seconds();
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    const Connection& c = connections_[p];
    if (c.closed && !c.said_goodbye) return closed_error(p, "a wait for it");
    const double silent = now - c.last_heard;
    if (!c.closed && silent > config_.peer_timeout_seconds)
      return Status::Error(UNISON_ERR_RANK_FAILED, "unison: " + describe(p) + " has shown no sign of life for " +
                                                       std::to_string((int)silent) +
                                                       " s (UNISON_PEER_TIMEOUT_SECONDS is " +
                                                       std::to_string((int)config_.peer_timeout_seconds) + ")");
  }
  return Status::OK();
}

}  // namespace unison
