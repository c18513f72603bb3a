// control_plane.h: negotiation's messages, and when a cycle runs.
//
// The engine negotiates each cycle over a ControlPlane: every rank sends
// one small message and learns everyone's (exchange), or the coordinator's
// answer replaces everyone's (broadcast_message). A negotiation cycle is
// collective, so ranks must also agree on when to run one; that is the
// plane's too, since only it knows how its ranks reach each other (a
// counter in shared memory, a frame over TCP, an MPI message). Every rank
// calls these in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace unison {

class ControlPlane {
 public:
  virtual ~ControlPlane() = default;

  // Messages. Everyone receives everyone's message, in rank order.
  virtual Status exchange(const std::string& mine, std::vector<std::string>* everyone) = 0;
  // The root's message replaces everyone else's.
  virtual Status broadcast_message(std::string* message, int root) = 0;
  // The largest message either call carries.
  virtual size_t max_message_bytes() const = 0;

  // Cycle scheduling. Ranks agree on a count of requested cycles and each
  // runs them all. A rank with new work raises the count; raising it, or
  // wake(), ends wait_for_activity().
  virtual uint64_t requested_cycles() const = 0;
  virtual void request_cycles(uint64_t count) = 0;
  virtual uint32_t activity_token() const = 0;  // read before deciding to wait
  virtual void wait_for_activity(uint32_t token, double timeout_seconds) = 0;
  virtual void wake() = 0;  // from any thread of this process
  // Whether wait_for_activity() may run on one thread while another calls
  // the rest: then a caller waiting for its op may drive the engine while
  // the engine's thread still sleeps in it (engine_driver.cc).
  virtual bool callers_may_drive() const { return false; }

  // Peers. OK while every peer is alive; else which one is not.
  virtual Status check_peers() = 0;
  // This rank's engine stopped on `cause` and takes part in nothing more.
  // The plane tells its peers now, and a peer waiting on this rank then
  // fails with `cause`, saying this rank stopped on it. Without this, a
  // survivor that exits on its error is taken for the failure by the
  // survivors slower to notice, and their errors name it, not the rank
  // that died. Not waited on: a peer that cannot be told in passing learns
  // of this rank's end the usual way.
  virtual void stopped_on(const Status& /*cause*/) {}
};

}  // namespace unison
