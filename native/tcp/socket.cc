#include "socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "../futex.h"
#include "../start_abort.h"
#include "sha256.h"

namespace unison {
namespace {

Status error(const std::string& message) { return Status::Error(UNISON_ERR_RANK_FAILED, "unison: " + message); }

Status system_error(const std::string& what) { return error(what + ": " + std::strerror(errno)); }

sockaddr_in to_sockaddr(const std::string& ip, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
  return a;
}

// The longest a start-up wait sleeps before it looks at start_up_aborted().
constexpr int kAbortCheckMilliseconds = 50;

int poll_slice(double left) { return std::min(kAbortCheckMilliseconds, (int)(left * 1000) + 1); }

// Waits for `events` on fd until the deadline: OK when they came, else
// why not (the deadline passed, or the start-up was aborted).
Status wait_for(int fd, short events, double deadline, const char* timed_out) {
  for (;;) {
    if (Status aborted = start_up_aborted(); !aborted.ok()) return aborted;
    const double left = deadline - monotonic_seconds();
    if (left <= 0) return error(timed_out);
    struct pollfd p = {fd, events, 0};
    const int n = poll(&p, 1, poll_slice(left));
    if (n > 0) return Status::OK();
    if (n < 0 && errno != EINTR) return Status::OK();  // let the read or write report it
  }
}

constexpr size_t kNonceBytes = 16;

std::string random_nonce() {
  std::string nonce(kNonceBytes, '\0');
  size_t have = 0;
  while (have < kNonceBytes) {
    const ssize_t n = getrandom(&nonce[have], kNonceBytes - have, 0);
    if (n > 0) have += (size_t)n;
  }
  return nonce;
}

// What a side proves: that it knows the secret, bound to both nonces and
// to its role, so that a proof cannot be replayed or reflected back.
Digest proof(const std::string& secret, const char* role, const std::string& acceptor_nonce,
             const std::string& connector_nonce) {
  const std::string text = std::string("unison ") + role + acceptor_nonce + connector_nonce;
  return hmac_sha256(secret, text.data(), text.size());
}

}  // namespace

Status parse_endpoint(const std::string& text, const char* setting, std::string* ip, int* port) {
  const size_t colon = text.rfind(':');
  char* end = nullptr;
  const long parsed = colon == std::string::npos ? -1 : std::strtol(text.c_str() + colon + 1, &end, 10);
  if (colon == std::string::npos || colon == 0 || *end != '\0' || parsed < 1 || parsed > 65535)
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                         std::string("unison: ") + setting + "='" + text + "' is not host:port");
  *port = (int)parsed;
  const std::string host = text.substr(0, colon);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr)
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT, std::string("unison: ") + setting + "='" + text +
                                                          "': cannot resolve " + host + " (" + gai_strerror(rc) + ")");
  char buffer[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, buffer, sizeof(buffer));
  freeaddrinfo(found);
  *ip = buffer;
  return Status::OK();
}

Status choose_listen_address(const std::string& interface, const std::string& toward, std::string* ip) {
  if (!interface.empty()) {
    in_addr parsed{};
    if (inet_pton(AF_INET, interface.c_str(), &parsed) == 1) {
      *ip = interface;  // bind() below says so if it is not this machine's
      return Status::OK();
    }
    ifaddrs* list = nullptr;
    if (getifaddrs(&list) != 0) return system_error("getifaddrs");
    std::string names;
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      names += std::string(names.empty() ? "" : ", ") + i->ifa_name;
      if (interface == i->ifa_name) {
        char buffer[INET_ADDRSTRLEN] = {0};
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buffer, sizeof(buffer));
        *ip = buffer;
        freeifaddrs(list);
        return Status::OK();
      }
    }
    freeifaddrs(list);
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: UNISON_NETWORK_INTERFACE='" + interface +
                                                          "' is neither an IPv4 address nor an interface of this "
                                                          "host with one (this host has: " + names + ")");
  }
  // The address the routing table picks for reaching `toward`: connecting
  // a UDP socket sends nothing but settles its source address.
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return system_error("socket");
  sockaddr_in target = to_sockaddr(toward, 9);
  sockaddr_in local{};
  socklen_t length = sizeof(local);
  const bool routed = connect(fd, reinterpret_cast<sockaddr*>(&target), sizeof(target)) == 0 &&
                      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  close(fd);
  if (!routed) return system_error("no route from this host to " + toward);
  char buffer[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &local.sin_addr, buffer, sizeof(buffer));
  *ip = buffer;
  return Status::OK();
}

Status listen_on(const std::string& ip, int* port, int backlog, int* fd) {
  *fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (*fd < 0) return system_error("socket");
  const int one = 1;
  setsockopt(*fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a = to_sockaddr(ip, *port);
  if (bind(*fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(*fd, backlog) != 0) {
    Status s = system_error("cannot listen on " + ip + ":" + std::to_string(*port));
    close(*fd);
    *fd = -1;
    return s;
  }
  socklen_t length = sizeof(a);
  getsockname(*fd, reinterpret_cast<sockaddr*>(&a), &length);
  *port = ntohs(a.sin_port);
  return Status::OK();
}

namespace {

// connect(), bounded by `deadline` and by an abort: 0, or why it failed (an
// errno). A blocking connect() to a host that answers nothing (powered off,
// or dropping SYNs) waits out the kernel's SYN retries, about two minutes
// whatever UNISON_START_TIMEOUT says; so it runs non-blocking, and the wait
// for its outcome is sliced like every other start-up wait.
int connect_before(int fd, const sockaddr_in& a, double deadline, Status* aborted) {
  const int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int reason = connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0 ? 0 : errno;
  if (reason == EINPROGRESS) {
    if (!wait_for(fd, POLLOUT, deadline, "").ok()) {
      *aborted = start_up_aborted();  // an abort lasts the start-up; if none, the deadline passed
      reason = aborted->ok() ? ETIMEDOUT : ECANCELED;
    } else {
      socklen_t length = sizeof(reason);
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &reason, &length) != 0) reason = errno;
    }
  }
  fcntl(fd, F_SETFL, flags);
  return reason;
}

}  // namespace

Status connect_to(const std::string& ip, int port, double deadline, const std::string& who, int* fd,
                  bool refused_is_final) {
  double pause = 0.01;
  for (;;) {
    *fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (*fd < 0) return system_error("socket");
    Status aborted;
    const int reason = connect_before(*fd, to_sockaddr(ip, port), deadline, &aborted);
    if (reason == 0) return Status::OK();
    close(*fd);
    *fd = -1;
    if (!aborted.ok()) return aborted;
    const bool worth_retrying = (reason == ECONNREFUSED && !refused_is_final) || reason == ETIMEDOUT ||
                                reason == EHOSTUNREACH || reason == ENETUNREACH || reason == EINTR;
    if (!worth_retrying || monotonic_seconds() + pause > deadline) {
      errno = reason;
      return system_error("cannot connect to " + who + " at " + ip + ":" + std::to_string(port));
    }
    if (aborted = start_up_aborted(); !aborted.ok()) return aborted;
    std::this_thread::sleep_for(std::chrono::duration<double>(pause));
    pause = std::min(pause * 2, 0.1);
  }
}

int first_closed(const std::vector<int>& fds) {
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] < 0) continue;
    // POLLRDHUP, not POLLIN: a peer past start-up may already be sending
    // heartbeats, which are not a close.
    pollfd p{fds[i], POLLRDHUP, 0};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) return (int)i;
  }
  return -1;
}

Status accept_before(int listen_fd, double deadline, const std::vector<int>& watched, int* fd, int* closed) {
  *fd = -1;
  for (;;) {
    // The watched and an abort are looked at every slice (poll_slice).
    *closed = first_closed(watched);
    if (*closed >= 0) return error("a connection closed during start-up");
    if (Status aborted = start_up_aborted(); !aborted.ok()) return aborted;
    const double left = deadline - monotonic_seconds();
    if (left <= 0) return error("timed out waiting for connections");
    pollfd p{listen_fd, POLLIN, 0};
    const int n = poll(&p, 1, poll_slice(left));
    if (n > 0) break;
    if (n < 0 && errno != EINTR) return system_error("poll");
  }
  *fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (*fd < 0) return system_error("accept");
  return Status::OK();
}

Status write_all(int fd, const void* data, size_t bytes, double deadline) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    if (Status s = wait_for(fd, POLLOUT, deadline, "timed out sending during start-up"); !s.ok()) return s;
    const ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return system_error("send during start-up");
    p += n;
    bytes -= (size_t)n;
  }
  return Status::OK();
}

Status read_all(int fd, void* data, size_t bytes, double deadline) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    if (Status s = wait_for(fd, POLLIN, deadline, "timed out receiving during start-up"); !s.ok()) return s;
    const ssize_t n = recv(fd, p, bytes, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n == 0) return error("the connection closed during start-up");
    if (n < 0) return system_error("recv during start-up");
    p += n;
    bytes -= (size_t)n;
  }
  return Status::OK();
}

Status prove_as_acceptor(int fd, const std::string& secret, double deadline) {
  const std::string mine = random_nonce();
  Status s = write_all(fd, mine.data(), mine.size(), deadline);
  // Exactly a nonce and a proof, of fixed size: a stranger gets nothing
  // more read, and nothing is allocated for it.
  char answer[kNonceBytes + 32];
  if (s.ok()) s = read_all(fd, answer, sizeof(answer), deadline);
  if (!s.ok()) return s;
  const std::string theirs(answer, kNonceBytes);
  Digest claimed;
  std::memcpy(claimed.data(), answer + kNonceBytes, claimed.size());
  if (!equal_in_constant_time(claimed, proof(secret, "connects", mine, theirs)))
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: a connection without the job's secret was refused");
  const Digest ours = proof(secret, "accepts", mine, theirs);
  return write_all(fd, ours.data(), ours.size(), deadline);
}

Status prove_as_connector(int fd, const std::string& secret, double deadline, bool* cut_off) {
  // Cut off: the acceptor closed the connection before either side had
  // checked the other's proof (the read or write failed on a closed
  // connection, not on the deadline).
  auto io = [&](Status s) {
    if (cut_off != nullptr) *cut_off = !s.ok() && monotonic_seconds() < deadline;
    return s;
  };
  char theirs[kNonceBytes];
  Status s = io(read_all(fd, theirs, sizeof(theirs), deadline));
  if (!s.ok()) return s;
  const std::string acceptor_nonce(theirs, sizeof(theirs));
  const std::string mine = random_nonce();
  const Digest ours = proof(secret, "connects", acceptor_nonce, mine);
  std::string answer = mine + std::string(reinterpret_cast<const char*>(ours.data()), ours.size());
  s = io(write_all(fd, answer.data(), answer.size(), deadline));
  Digest claimed;
  if (s.ok()) s = io(read_all(fd, claimed.data(), claimed.size(), deadline));
  if (!s.ok()) return s;
  if (!equal_in_constant_time(claimed, proof(secret, "accepts", acceptor_nonce, mine)))
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                         "unison: the rank this one connected to does not hold the job's secret (UNISON_SECRET_KEY "
                         "differs between ranks, or something else answered on that port)");
  return Status::OK();
}

void make_data_socket(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

}  // namespace unison
