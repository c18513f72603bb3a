// Mesh::connect: how a job's ranks find each other and connect.
//
//   1. Every rank listens on its own address (socket.h: the interface that
//      reaches rank 0, unless one is named); rank 0 listens on the
//      rendezvous port the launcher chose.
//   2. Every other rank connects to rank 0, the two prove the job's secret
//      to each other, and the rank says who it is and where it listens.
//   3. Rank 0 checks the ranks agree (size, no rank twice) and sends every
//      rank the whole table, or the reason the job cannot start.
//   4. Each rank connects to every lower rank but 0, proving the secret
//      again, and accepts the higher ones. Rank 0's connections from step 2
//      are its mesh connections.
// Then the listening sockets close: nothing can connect to a running job.
//
// Whoever can reach a listening port can connect before the job's ranks do.
// So every accepted connection proves the secret on a thread of its own
// (Handshakes): a stranger that connects and says nothing costs its own
// thread for at most kStrangerSeconds, never the ranks queued behind it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "mesh.h"
#include "socket.h"
#include "../liveness.h"
#include "../log.h"
#include "../start_abort.h"

namespace unison {
namespace {

// Start-up messages: a 4-byte length, then text. Only read after the
// sender proved the secret, and never longer than this.
constexpr uint32_t kLongestStartMessage = 1u << 20;

Status send_text(int fd, const std::string& text, double deadline) {
  const uint32_t n = (uint32_t)text.size();
  Status s = write_all(fd, &n, sizeof(n), deadline);
  return s.ok() ? write_all(fd, text.data(), text.size(), deadline) : s;
}

Status read_text(int fd, std::string* text, double deadline) {
  uint32_t n = 0;
  Status s = read_all(fd, &n, sizeof(n), deadline);
  if (!s.ok()) return s;
  if (n > kLongestStartMessage)
    return Status::Error(UNISON_ERR_INTERNAL, "unison: a start-up message of " + std::to_string(n) + " bytes");
  text->resize(n);
  return read_all(fd, &(*text)[0], n, deadline);
}

std::string peer_address(int fd) {
  sockaddr_in a{};
  socklen_t length = sizeof(a);
  getpeername(fd, reinterpret_cast<sockaddr*>(&a), &length);
  char buffer[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &a.sin_addr, buffer, sizeof(buffer));
  return std::string(buffer) + ":" + std::to_string(ntohs(a.sin_port));
}

std::string this_host(const Config& config) {
  if (!config.hostname.empty()) return config.hostname;
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// One rank's line of the table: "rank pid ip:port host".
std::string table_line(const TcpPeer& p) {
  return std::to_string(p.rank) + " " + std::to_string(p.pid) + " " + p.address + " " + p.host + "\n";
}

// The next space-separated word of `text` from *at, as a whole int.
bool next_int(const std::string& text, size_t* at, int* value) {
  const size_t end = std::min(text.find(' ', *at), text.size());
  const std::string word = text.substr(*at, end - *at);
  char* stop = nullptr;
  const long v = std::strtol(word.c_str(), &stop, 10);
  if (word.empty() || *stop != '\0') return false;
  *value = (int)v;
  *at = std::min(end + 1, text.size());
  return true;
}

// Parsed by hand, not with iostreams: a process may hold a libstdc++ older
// than the one unison was compiled against, and its stream locales are the
// part that then breaks (a crash seen on a gVisor sandbox).
bool parse_table_line(const std::string& line, TcpPeer* p) {
  size_t at = 0;
  if (!next_int(line, &at, &p->rank) || !next_int(line, &at, &p->pid)) return false;
  const size_t end = line.find(' ', at);
  if (end == std::string::npos || end == at) return false;
  p->address = line.substr(at, end - at);
  p->host = line.substr(end + 1);
  while (!p->host.empty() && (p->host.back() == '\n' || p->host.back() == '\r')) p->host.pop_back();
  return true;
}

// Closes every socket it was given unless released: start-up can fail at
// any step.
struct Sockets {
  std::vector<int> fds;
  ~Sockets() {
    for (int fd : fds)
      if (fd >= 0) close(fd);
  }
};

// How long a connection may take to prove the job's secret.
constexpr double kStrangerSeconds = 5.0;

// The handshakes of the connections one listener accepted, run side by
// side: each proves the secret and reads its hello on its own thread, and
// the accepting loop takes the finished ones. At most `most` at a time:
// past that, the one running longest is ended to make room. A rank proves
// itself within a round trip, so the oldest is the likeliest stranger, and
// strangers cannot fill every place for 5 s at a time (refusing the new
// connection instead would let them: a crowd arriving just before a rank
// kept it out past a 10 s start timeout). Owns every socket it was given
// until next() hands one out; the destructor ends the handshakes still
// running (shutdown() makes their reads return) and closes theirs.
class Handshakes {
 public:
  struct Done {
    int fd = -1;
    Status status;
    std::string hello;
    std::string from;
  };

  Handshakes(const std::string& secret, double deadline, size_t most)
      : secret_(secret), deadline_(deadline), most_(most) {}

  ~Handshakes() {
    std::map<int, std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Running& r : running_) shutdown(r.fd, SHUT_RDWR);
      threads.swap(threads_);
    }
    for (auto& [fd, t] : threads) t.join();
    for (const Done& d : done_) close(d.fd);
  }

  // Takes `fd` over; false when it ended the oldest handshake to do so.
  bool start(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    bool made_room = false;
    size_t unproven = 0;
    for (const Running& r : running_) unproven += !r.proven && !r.ending;
    if (unproven >= most_) {
      // running_ is in start order. One that proved the secret is a rank,
      // reading its hello: never ended.
      for (Running& r : running_)
        if (!r.proven && !r.ending) {
          shutdown(r.fd, SHUT_RDWR);
          r.ending = made_room = true;
          break;
        }
    }
    running_.push_back({fd, false, false});
    threads_.emplace(fd, std::thread([this, fd] {
      Done d;
      d.fd = fd;
      d.from = peer_address(fd);
      d.status = prove_as_acceptor(fd, secret_, std::min(deadline_, monotonic_seconds() + kStrangerSeconds));
      if (d.status.ok()) {
        std::lock_guard<std::mutex> lock(mutex_);
        find(fd)->proven = true;
      }
      // A connection that proved the secret is a rank: it gets the time left.
      if (d.status.ok()) d.status = read_text(fd, &d.hello, deadline_);
      std::lock_guard<std::mutex> lock(mutex_);
      running_.erase(find(fd));
      done_.push_back(std::move(d));
    }));
    return !made_room;
  }

  // A finished handshake, if any; its socket is the caller's from here.
  // Its thread is joined here (it has finished, or is returning), so that
  // a stream of strangers leaves no finished threads piling up.
  bool next(Done* out) {
    std::thread finished;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (done_.empty()) return false;
      *out = std::move(done_.front());
      done_.pop_front();
      const auto it = threads_.find(out->fd);
      finished = std::move(it->second);
      threads_.erase(it);
    }
    finished.join();
    return true;
  }

 private:
  struct Running {
    int fd;
    bool proven;  // it proved the secret: a rank
    bool ending;  // ended to make room
  };
  std::vector<Running>::iterator find(int fd) {
    return std::find_if(running_.begin(), running_.end(), [fd](const Running& r) { return r.fd == fd; });
  }

  const std::string secret_;
  const double deadline_;
  const size_t most_;
  std::mutex mutex_;
  std::vector<Running> running_;  // in the order they started
  std::deque<Done> done_;
  std::map<int, std::thread> threads_;  // by socket: a socket is open, so its number unique, until next() joins
};

// Accepts on `listener` until `deadline`, starting each connection's
// handshake and calling `take` with each one that finished, proven or not,
// until `take` says the loop is done (returns false). Fails when a watched
// connection closes (*closed says which) or the deadline passes.
template <typename Take>
Status accept_handshakes(int listener, double deadline, const std::vector<int>& watched, const std::string& secret,
                         size_t most, int* closed, Take take) {
  Handshakes handshakes(secret, deadline, most);
  bool warned_full = false, warned_accept = false;
  for (;;) {
    Handshakes::Done done;
    while (handshakes.next(&done))
      if (!take(done)) return Status::OK();
    // Short slices, so that finished handshakes are taken within ~20 ms.
    int fd = -1;
    *closed = -1;
    const double slice = std::min(deadline, monotonic_seconds() + 0.02);
    Status s = accept_before(listener, slice, watched, &fd, closed);
    if (*closed >= 0) return s;
    if (Status aborted = start_up_aborted(); !aborted.ok()) return aborted;
    if (s.ok()) {
      if (!handshakes.start(fd) && !warned_full) {
        log_message(LogLevel::warning,
                    "unison: %zu connections are proving themselves at once; ending the oldest for each new one\n",
                    most);
        warned_full = true;
      }
    } else if (monotonic_seconds() >= deadline) {
      return s;
    } else if (s.message.find("timed out") == std::string::npos) {
      // accept() failed (file descriptors ran out): try again shortly.
      if (!warned_accept) log_message(LogLevel::warning, "%s; still accepting\n", s.message.c_str());
      warned_accept = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

}  // namespace

Status Mesh::connect(const Config& config, std::shared_ptr<Mesh>* out) {
  const double deadline = monotonic_seconds() + config.start_timeout_seconds;
  const int size = config.size, me = config.rank;
  std::string rendezvous_ip;
  int rendezvous_port = 0;
  Status s = parse_endpoint(config.rendezvous_address, "UNISON_RENDEZVOUS_ADDR:UNISON_RENDEZVOUS_PORT", &rendezvous_ip,
                            &rendezvous_port);
  if (!s.ok()) return s;
  std::string my_ip;
  s = choose_listen_address(config.network_interface, rendezvous_ip, &my_ip);
  if (!s.ok()) return s;
  // Rank 0 listens where the others will look for it, unless an interface
  // was named for it.
  if (me == 0 && config.network_interface.empty()) my_ip = rendezvous_ip;

  auto mesh = std::shared_ptr<Mesh>(new Mesh(config));
  mesh->rank_ = me;
  mesh->connections_.resize(size);
  mesh->peers_.resize(size);
  Sockets sockets;  // owns every fd until the mesh does
  sockets.fds.assign(size, -1);
  int listener = -1;
  int port = me == 0 ? rendezvous_port : 0;
  // A deep queue: where a crowd of connections fills it, the kernel drops
  // a rank's connection attempt, which its kernel retries a second later,
  // then three, then seven.
  s = listen_on(my_ip, &port, size + 256, &listener);
  if (!s.ok()) {
    if (me == 0) s.message += " (the rendezvous port: pick another with unisonrun --rendezvous-port)";
    return s;
  }
  Sockets listening{{listener}};
  TcpPeer mine{me, (int)getpid(), this_host(config), my_ip + ":" + std::to_string(port)};
  mesh->peers_[me] = mine;
  const std::string secret = config.secret_key;

  // ---- steps 2 and 3: everyone meets rank 0 -------------------------------------
  std::string table;
  if (me == 0) {
    std::vector<bool> seen(size, false);
    std::string problem;
    int joined = 1, closed = -1;
    s = Status::OK();
    if (size > 1)
      s = accept_handshakes(listener, deadline, sockets.fds, secret, (size_t)size + 64, &closed,
                            [&](Handshakes::Done& done) {
                              if (!done.status.ok()) {
                                log_message(LogLevel::warning, "unison: rank 0 refused a connection from %s: %s\n",
                                            done.from.c_str(), done.status.message.c_str());
                                close(done.fd);
                                return true;
                              }
                              const std::string& hello = done.hello;
                              TcpPeer p;
                              int their_size = 0;
                              size_t at = 0;
                              if (!next_int(hello, &at, &their_size) || !parse_table_line(hello.substr(at), &p) ||
                                  p.rank <= 0 || p.rank >= size) {
                                problem = "a rank said it is '" + hello + "', which is not a rank of a job of " +
                                          std::to_string(size);
                              } else if (their_size != size) {
                                problem = "rank " + std::to_string(p.rank) + " (host " + p.host +
                                          ") was told the job has " + std::to_string(their_size) +
                                          " ranks, rank 0 that it has " + std::to_string(size);
                              } else if (seen[p.rank]) {
                                problem = "two processes (on hosts " + mesh->peers_[p.rank].host + " and " + p.host +
                                          ") both say they are rank " + std::to_string(p.rank);
                              }
                              if (!problem.empty()) {
                                close(done.fd);
                                return false;
                              }
                              seen[p.rank] = true;
                              mesh->peers_[p.rank] = p;
                              sockets.fds[p.rank] = done.fd;
                              return ++joined < size;
                            });
    if (closed >= 0) return mesh->left_during_start_up(closed, "before every rank had reached rank 0");
    if (Status aborted = start_up_aborted(); !aborted.ok()) return aborted;
    if (!s.ok())
      return Status::Error(UNISON_ERR_RANK_FAILED,
                           "unison: only " + std::to_string(joined) + " of " + std::to_string(size) +
                               " ranks reached rank 0 within " + std::to_string((int)config.start_timeout_seconds) +
                               " s (UNISON_START_TIMEOUT)");
    table = problem.empty() ? "ok\n" : "error " + problem + "\n";
    for (const TcpPeer& p : mesh->peers_) table += table_line(p);
    for (int r = 1; r < size; ++r)
      if (sockets.fds[r] >= 0) send_text(sockets.fds[r], table, deadline);
    if (!problem.empty()) return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: cannot start the job: " + problem);
  } else {
    for (int attempt = 1;; ++attempt) {
      int fd = -1;
      s = connect_to(rendezvous_ip, rendezvous_port, deadline, "rank 0", &fd);
      if (!s.ok()) return s;
      sockets.fds[0] = fd;
      bool cut_off = false;
      s = prove_as_connector(fd, secret, deadline, &cut_off);
      if (s.ok() || !cut_off) break;
      // Rank 0 cuts a handshake off when strangers crowd it (Handshakes):
      // connect again while time is left. (So does a rank 0 that was given
      // another secret, which says so in its own log.)
      close(fd);
      sockets.fds[0] = -1;
      if (monotonic_seconds() + 0.05 >= deadline) {
        s.message += " (rank 0 closed all " + std::to_string(attempt) +
                     " of this rank's connections before the handshake finished)";
        return s;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (s.ok()) s = send_text(sockets.fds[0], std::to_string(size) + " " + table_line(mine), deadline);
    if (s.ok()) s = read_text(sockets.fds[0], &table, deadline);
    if (!s.ok()) return s;
    std::vector<std::string> lines;
    for (size_t at = 0; at < table.size();) {
      const size_t end = std::min(table.find('\n', at), table.size());
      lines.push_back(table.substr(at, end - at));
      at = end + 1;
    }
    if (!lines.empty() && lines[0].rfind("error ", 0) == 0)
      return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: cannot start the job: " + lines[0].substr(6));
    for (size_t i = 1; i < lines.size(); ++i) {
      TcpPeer p;
      if (parse_table_line(lines[i], &p) && p.rank >= 0 && p.rank < size) mesh->peers_[p.rank] = p;
    }
  }

  // ---- step 4: every pair ----------------------------------------------------------
  for (int lower = 1; lower < me; ++lower) {
    std::string ip;
    int their_port = 0;
    s = parse_endpoint(mesh->peers_[lower].address, "a rank's address", &ip, &their_port);
    int fd = -1;
    // It listened before it reached rank 0 and listens until every rank
    // above it has connected, this one included: a refusal means it is gone.
    if (s.ok()) s = connect_to(ip, their_port, deadline, mesh->describe(lower), &fd, /*refused_is_final=*/true);
    if (Status aborted = start_up_aborted(); !aborted.ok()) return aborted;
    if (!s.ok())
      return Status::Error(UNISON_ERR_RANK_FAILED, s.message + "; it was listening when it reached rank 0, so it "
                                                               "exited, was killed or gave up since");
    sockets.fds[lower] = fd;
    s = prove_as_connector(fd, secret, deadline);
    if (s.ok()) s = send_text(fd, std::to_string(me), deadline);
    if (Status aborted = start_up_aborted(); !aborted.ok()) return aborted;
    if (!s.ok()) return Status::Error(s.code, s.message + " (with " + mesh->describe(lower) + ")");
  }
  int higher = std::max(me + 1, 1), closed = -1;
  s = Status::OK();
  if (me > 0 && higher < size)
    // Watching the connections made so far: a rank above that died before
    // connecting here never will, and rank 0, which has then finished its
    // start-up, fails on that death and closes; this rank learns it so.
    s = accept_handshakes(listener, deadline, sockets.fds, secret, (size_t)(size - me) + 64, &closed,
                          [&](Handshakes::Done& done) {
                            const int who = done.status.ok() ? std::atoi(done.hello.c_str()) : -1;
                            if (!done.status.ok() || who <= me || who >= size || sockets.fds[who] >= 0) {
                              log_message(LogLevel::warning, "unison: rank %d refused a connection from %s: %s\n", me,
                                          done.from.c_str(),
                                          done.status.ok() ? ("it claimed to be rank " + done.hello).c_str()
                                                           : done.status.message.c_str());
                              close(done.fd);
                              return true;
                            }
                            sockets.fds[who] = done.fd;
                            return ++higher < size;
                          });
  if (closed >= 0) {
    std::string missing;
    for (int r = me + 1; r < size; ++r)
      if (sockets.fds[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    return mesh->left_during_start_up(closed, "while rank " + std::to_string(me) + " waited for rank(s) " + missing +
                                                  " to connect");
  }
  if (Status aborted = start_up_aborted(); !aborted.ok()) return aborted;
  if (!s.ok())
    return Status::Error(UNISON_ERR_RANK_FAILED,
                         "unison: rank " + std::to_string(me) + " timed out waiting for the ranks above it to connect");

  const double now = monotonic_seconds();
  for (int r = 0; r < size; ++r) {
    if (r == me) continue;
    make_data_socket(sockets.fds[r]);
    mesh->connections_[r].fd = sockets.fds[r];
    mesh->connections_[r].last_heard = now;
    sockets.fds[r] = -1;
  }
  mesh->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  mesh->beat_interval_ = std::min(1.0, std::max(0.05, config.peer_timeout_seconds / 5));
  Mesh* raw = mesh.get();  // the destructor removes the beat before the mesh goes
  mesh->beat_id_ = add_beat([raw] { raw->beat_from_other_planes(); });
  *out = std::move(mesh);
  return Status::OK();
}

}  // namespace unison
