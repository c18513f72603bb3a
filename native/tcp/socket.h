// socket.h: what the mesh needs from the operating system's sockets during
// start-up: addresses, listening, connecting, whole reads and writes with a
// deadline, and the handshake that proves the job's secret.
//
// IPv4 only: every cluster the launcher reaches by host name has it, and it
// keeps address handling to one family.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../status.h"

namespace unison {

// "10.0.0.1:29500" -> ip and port; the host may be a name to resolve.
Status parse_endpoint(const std::string& text, const char* setting, std::string* ip, int* port);

// The local IPv4 address to listen on. `interface` (UNISON_NETWORK_INTERFACE)
// is an interface name such as eth0, an address of this machine, or
// "0.0.0.0" (every interface: only when asked for). When it is empty, the
// address this machine would use to reach `toward`.
Status choose_listen_address(const std::string& interface, const std::string& toward, std::string* ip);

// A listening socket on ip:port (port 0: any free one); *port is set to the
// port bound.
Status listen_on(const std::string& ip, int* port, int backlog, int* fd);

// Connects to ip:port, retrying refused connections until `deadline`
// (monotonic seconds): the peer may not be listening yet. A peer that
// answers nothing is given up at `deadline` too, not after the kernel's
// SYN retries; an abort (start_abort.h) ends the wait as well. With
// `refused_is_final`, a refusal ends it at once: the caller knows the peer
// has been listening, so a refusal means it is gone.
Status connect_to(const std::string& ip, int port, double deadline, const std::string& who, int* fd,
                  bool refused_is_final = false);

// The index of the first socket in `fds` (-1 for none) whose far end
// closed or reset it, or -1. Unread data does not hide a close, and data
// arriving (a started rank's heartbeats) is not one.
int first_closed(const std::vector<int>& fds);

// Accepts one connection, waiting until `deadline`. Meanwhile it watches
// the sockets in `watched` (-1 for none): when the far end of one of them
// closes, it returns an error with *closed set to that one's index, so
// that a wait for a rank cannot outlast one that already failed.
Status accept_before(int listen_fd, double deadline, const std::vector<int>& watched, int* fd, int* closed);

// Whole reads and writes on a blocking-mode socket, giving up at `deadline`.
Status write_all(int fd, const void* data, size_t bytes, double deadline);
Status read_all(int fd, void* data, size_t bytes, double deadline);

// The handshake. Each side sends a fresh random nonce and proves it holds
// the secret by an HMAC over both nonces and its role; neither side reads
// anything else before the other's proof checked out. The accepting side
// waits at most `deadline` for the proof, so a stranger that connects and
// says nothing cannot hold up start-up.
// *cut_off (when given) says whether the acceptor closed the connection
// before the proofs were checked, as a crowded rank 0 does to its oldest
// handshakes (rendezvous.cc), rather than the deadline passing or a proof
// failing.
Status prove_as_acceptor(int fd, const std::string& secret, double deadline);
Status prove_as_connector(int fd, const std::string& secret, double deadline, bool* cut_off = nullptr);

// Sets the options the data plane wants: no Nagle delay, and non-blocking.
void make_data_socket(int fd);

}  // namespace unison
