// cycle_requests.h: asking ranks that share no memory for a negotiation cycle.
//
// Within a host a rank raises a counter in shared memory and rings its
// peers' doorbells. Across hosts there is no memory to share, so the count
// travels as a one-word MPI message to each peer, which adopts it if it is
// higher than its own. Counts only grow, so late or duplicate messages are
// harmless, and every rank ends up running every cycle anyone asked for.
//
// MPI offers nothing to sleep on, so a rank that waits for such a message
// polls (poll_with_backoff, futex.h).
#pragma once

#include <mpi.h>

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

}  // namespace unison
