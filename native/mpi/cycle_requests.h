// cycle_requests.h: asking ranks that share no memory for a negotiation cycle.
//
// Within a host a rank raises a counter in shared memory and rings its
// peers' doorbells. Across hosts there is no memory to share, so the count
// travels as a one-word MPI message to each peer, which adopts it if it is
// higher than its own. Counts only grow, so late or duplicate messages are
// harmless, and every rank ends up running every cycle anyone asked for.
//
// MPI offers nothing to sleep on, so a rank that waits for such a message
// polls (poll_with_backoff).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <vector>

#include "../futex.h"

namespace unison {

class CycleRequests {
 public:
  // Tells, and hears from, every other rank of `comm`.
  explicit CycleRequests(MPI_Comm comm);
  ~CycleRequests();

  // Tells every peer that cycles up to `count` are wanted; never blocks.
  void announce(uint64_t count);
  // The highest count any peer has announced so far; never blocks.
  uint64_t heard();

 private:
  struct Sent {
    uint64_t count;
    MPI_Request request;
  };
  void post_receive();

  MPI_Comm comm_;
  std::vector<int> peers_;
  uint64_t announced_ = 0;
  uint64_t heard_ = 0;
  uint64_t incoming_ = 0;
  MPI_Request receive_ = MPI_REQUEST_NULL;
  std::deque<Sent> sent_;  // a deque never moves its elements, which MPI is writing from
};

// Waits until `arrived()` or `timeout_seconds`: spins for `spin_seconds`,
// then calls `sleep(pause)` (which may end early) with pauses doubling to
// 1 ms. That bounds what a lone op pays when every other rank is idle, at a
// cost of a thousand wake-ups a second for an idle engine.
template <typename Arrived, typename Sleep>
void poll_with_backoff(Arrived arrived, Sleep sleep, double timeout_seconds, double spin_seconds) {
  constexpr double kLongestPause = 1e-3;
  const double start = monotonic_seconds();
  double pause = 20e-6;
  for (;;) {
    if (arrived()) return;
    const double waited = monotonic_seconds() - start;
    if (waited >= timeout_seconds) return;
    if (waited < spin_seconds) {
      cpu_relax();
      continue;
    }
    sleep(std::min(pause, timeout_seconds - waited));
    pause = std::min(pause * 2, kLongestPause);
  }
}

}  // namespace unison
