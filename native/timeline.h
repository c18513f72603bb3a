// timeline.h: where each tensor's time goes, as a Chrome trace event file
// (Perfetto and chrome://tracing open it).
//
// Rank 0 writes it: it is the rank that sees every rank's requests arrive.
// Each tensor name gets a row; on it, a span per phase the tensor goes
// through on rank 0:
//   QUEUED            enqueued by the caller, not yet taken by the engine
//   WAIT_FOR_DATA     taken, but its producer has not finished writing the
//                     input (unison_op_options::input_ready, a device stream)
//   NEGOTIATE         taken, until every rank is ready; its end names the
//                     ranks that were last to say so (the ones it waited for)
//   <BACKEND>_<OP>    the collective, named by the backend that ran it
//                     (SHM_ALLREDUCE, TCP_ALLGATHER, HIERARCHICAL_ALLREDUCE,
//                     MPI_BROADCAST...), with the fused group it ran in
// and a row per fused group, "group <first tensor> (+N)", holding the
// backend's own phases where it has them (shared memory: PACK into the
// shared slots, WAIT_FOR_PEERS, REDUCE, UNPACK into the outputs, per window;
// TCP's and MPI's allreduces: PACK, the exchange or MPI call, REDUCE, UNPACK)
// and, with mark_cycles, an instant on a "cycles" row at each negotiation
// cycle.
//
// Recording formats a line and appends it under a mutex; a writer thread
// writes what has gathered every 100 ms and flushes, so a killed job leaves
// a file that ends at its last complete event, without the closing bracket,
// which Chrome's reader (and python -m unison.timeline) accept.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "status.h"

namespace unison {

class Timeline {
 public:
  ~Timeline() { stop(); }

  Status start(const std::string& path, bool mark_cycles);
  void stop();
  // Read before formatting anything: a job without a timeline pays one load.
  // Acquire: a recorder that sees the timeline on also sees what start() set.
  bool active() const { return active_.load(std::memory_order_acquire); }
  bool marking_cycles() const { return active() && mark_cycles_.load(std::memory_order_relaxed); }

  // A span on `tensor`'s row. `args` is a JSON object's members, or empty.
  void begin(const std::string& tensor, const std::string& phase, const std::string& args = "");
  void end(const std::string& tensor, const std::string& phase, const std::string& args = "");
  void cycle_marker();

  // Negotiation: `rank` said, in cycle `cycle`, that `tensor` is ready.
  void arrived(const std::string& tensor, int rank, uint64_t cycle);
  // The JSON array of the ranks that were ready last, if they were later
  // than the others ("[]" when every rank was ready in the same cycle).
  std::string waited_for(const std::string& tensor);

 private:
  void edge(const std::string& tensor, const std::string& phase, char kind, const std::string& args);  // B or E
  void append(const std::string& event);
  int row_of(const std::string& tensor);  // under mutex_
  int64_t now_us() const;
  void write_loop();

  std::atomic<bool> active_{false};
  // Atomic as well as set before active_: the engine thread reads these
  // without the mutex, and a restarted timeline sets them again while a
  // recorder that saw the old one on may still be reading.
  std::atomic<bool> mark_cycles_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::string pending_;  // formatted events not yet written
  bool first_event_ = true;
  bool stopping_ = false;
  std::FILE* file_ = nullptr;
  std::thread writer_;
  std::atomic<int64_t> origin_ns_{0};
  std::map<std::string, int> rows_;
  std::map<std::string, std::map<int, uint64_t>> arrivals_;  // tensor -> rank -> cycle
};

// Lets a backend mark its own phases of the collective that is running,
// without knowing the tensors: the engine names the row of the current
// fused group (its own row, so that a window's phases are written once, not
// once per tensor) around each collective. Costs one thread-local load when
// no timeline is on.
void set_timeline_group(Timeline* timeline, const std::string* row);

class TimelinePhase {
 public:
  explicit TimelinePhase(const char* phase);
  ~TimelinePhase();
  TimelinePhase(const TimelinePhase&) = delete;
  TimelinePhase& operator=(const TimelinePhase&) = delete;

 private:
  const char* phase_;
  bool recording_;
};

std::string json_string(const std::string& text);

}  // namespace unison
