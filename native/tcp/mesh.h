// mesh.h: one authenticated TCP connection between every pair of a job's
// ranks, and the point-to-point moves the TCP backend is built from.
//
// Everything on a connection travels in frames: a 16-byte header (kind,
// channel, length), then, for data, the payload. Data frames carry the
// collectives' bytes and control messages; small frames carry cycle counts
// (backend.h's cycle scheduling) and heartbeats, and may arrive between
// any two data frames. A receive reads a data frame's payload straight into
// its destination, so no byte is staged on the way in.
//
// Ranks issue collectives in the same order (the engine's cycles are
// global), so the data frames between two ranks always pair up. Each carries
// its channel (the process set, or the hierarchical layout's cross group)
// and its length; one that does not match what the receiver expects is
// reported as an error, never read into the wrong buffer.
//
// Only the engine thread calls these, except wake().
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../config.h"
#include "../futex.h"
#include "../status.h"

namespace unison {

struct TcpPeer {
  int rank = 0;
  int pid = 0;
  std::string host;     // as the launcher named it (UNISON_HOSTNAME), else gethostname()
  std::string address;  // where it listens: "ip:port"
};

// A batch of sends and receives, run to completion by Mesh::run. Moves to
// one peer go in the order given; moves to different peers overlap. A
// receive's `then` runs as soon as its bytes are in, and may add moves, so
// a collective can be a pipeline: reduce a piece and pass it on while the
// next piece is still on the wire.
class Moves {
 public:
  explicit Moves(int size) : sends_(size), receives_(size) {}
  // Data moves: both sides know the size, so empty ones are skipped by
  // both (an empty receive's `then` runs at once).
  void send(int peer, const void* data, size_t bytes);
  void receive(int peer, void* data, size_t bytes, std::function<void()> then = nullptr);
  // Messages: only the sender knows the length (up to `limit` bytes), so
  // every message travels, empty or not.
  void send_message(int peer, const std::string& message);
  void receive_message(int peer, std::string* message, size_t limit);

 private:
  friend class Mesh;
  struct Send {
    const char* data;
    size_t bytes;
  };
  struct Receive {
    char* data;
    size_t bytes;
    std::string* message;  // or null
    size_t limit;
    std::function<void()> then;
  };
  std::vector<std::deque<Send>> sends_;
  std::vector<std::deque<Receive>> receives_;
};

class Mesh {
 public:
  // Collective over the job: meets rank 0 at config.rendezvous_address,
  // learns every rank's address from it, and connects every pair. Every
  // connection proves the job's secret both ways before anything else.
  static Status connect(const Config& config, std::shared_ptr<Mesh>* out);
  ~Mesh();

  int rank() const { return rank_; }
  int size() const { return (int)peers_.size(); }
  const std::vector<TcpPeer>& peers() const { return peers_; }
  // Start-up only: an error naming a rank whose connection its far end
  // closed (a rank that died or gave up while the job started), `when`.
  Status check_nobody_left(const std::string& when) const;
  // "rank 3 (host b, pid 4242)", for error messages.
  std::string describe(int rank) const;

  // Runs every move of `moves`. `what` names the collective in errors.
  // After an error the mesh is broken for good: the byte streams between
  // ranks are no longer in step.
  Status run(Moves* moves, uint32_t channel, const char* what);

  // Cycle counts, per channel: tells `peers` that cycles up to `count` are
  // wanted; the highest count any peer has told this rank. Never block.
  void announce(uint32_t channel, const std::vector<int>& peers, uint64_t count);
  uint64_t heard(uint32_t channel);

  // Sleeps until a frame arrives, wake() is called, or the timeout passes.
  void wait(double timeout_seconds);
  void wake();  // any thread
  uint32_t activity_token() const { return doorbell_.token(); }

  // Reads what has arrived, sends heartbeats that are due, and says
  // whether every peer is still connected and has been heard from within
  // the peer timeout.
  Status check();

  // Tells every peer that this rank stopped on `cause` (Backend::stopped_on);
  // each then fails what it waits on from this rank with `cause`, so that
  // it names the rank that failed first, not this one. A notice goes after
  // any data frame a failed run left half sent (keep_half_sent_frames), and
  // waits up to a couple of seconds for a peer slow to read.
  void stopped_on(const Status& cause);

 private:
  struct Frame {
    uint32_t kind;
    uint32_t channel;
    uint64_t length;
  };
  struct Connection {
    int fd = -1;
    // Incoming: a header being read, then (data frames) its payload.
    Frame header{};
    size_t header_have = 0;
    bool header_ready = false;
    size_t payload_have = 0;
    // Outgoing: small frames wait in `outbox` until no data frame is half sent.
    std::string outbox;
    size_t outbox_sent = 0;
    bool sending = false;
    Frame out_header{};
    size_t out_sent = 0;
    double last_heard = 0;
    bool said_goodbye = false;
    // What the peer stopped on (a kStopped frame), being read while
    // stopped_length > 0; once whole, the connection is closed to reading.
    std::string stopped_on;
    size_t stopped_length = 0;
    int stopped_code = 0;
    bool closed = false;        // read the end of the stream, or an error
    bool cannot_send = false;   // a send failed: the peer has gone, perhaps cleanly
    bool dropped_sends = false; // this run had data for it that could not go
  };

  Mesh(const Config& config) : config_(config) {}
  Status run_to_the_end(Moves* moves, uint32_t channel, const char* what);
  // After a failed run: the unsent rest of each data frame it left half sent
  // (up to kLongestRestKept) is copied into that connection's outbox before
  // the run's buffers go, so that the stream stays framed and a stop notice
  // can follow. The peer gets the frame whole: bytes this rank meant to
  // send, which it may use; a frame cut short could only end the stream.
  void keep_half_sent_frames(Moves* moves);
  Status fail(const Status& s);
  Status closed_error(int peer, const char* what) const;
  // A rank whose connection closed while the job started, `when`.
  Status left_during_start_up(int peer, const std::string& when) const;
  Status pump_in(int peer, std::deque<Moves::Receive>* receives, uint32_t channel, const char* what,
                 bool* progressed);
  Status pump_out(int peer, std::deque<Moves::Send>* sends, uint32_t channel, const char* what, bool* progressed);
  void queue_small_frame(int peer, uint32_t kind, uint32_t channel, uint64_t value);
  Status settle_unsent(const char* what);
  void beat_if_due();
  // This rank's heartbeats to every peer, for other planes' waits (liveness.h).
  void beat_from_other_planes();
  Status drain_everyone();

  Config config_;
  int rank_ = 0;
  std::vector<TcpPeer> peers_;
  std::vector<Connection> connections_;  // by rank; none to itself
  std::map<uint32_t, uint64_t> heard_;
  double beat_interval_ = 1.0;
  double last_beat_ = 0;
  int wake_fd_ = -1;  // an eventfd that wake() writes, so that wait()'s poll returns
  Doorbell doorbell_;
  Status broken_;
  int beat_id_ = 0;  // liveness.h
};

}  // namespace unison
