// engine.h: the background thread that negotiates and runs collectives.
//
// One engine per process. Callers enqueue requests from any thread; the
// engine's thread takes them in cycles:
//   1. drain the queue; a request whose tensor was negotiated before (same
//      name and parameters) is expressed as one bit of the response cache,
//      any other is sent in full;
//   2. exchange one CycleMessage with every rank (the backend's control
//      plane); a bit set on every rank means that cached tensor runs now,
//      with no coordinator round trip;
//   3. only if some rank sent full requests: rank 0's Coordinator decides
//      which tensors are ready and broadcasts the responses;
//   4. fuse compatible responses and execute them on the backend, in the
//      same order on every rank, then complete the handles.
// Cycles are collective and start as soon as any rank has work, so a lone
// op waits for no timer, and an idle rank sleeps in the kernel.
//
// The engine's code is in four files: enqueue.cc (the calling side: a
// caller's options checked and turned into a request), engine.cc (the
// cycle: negotiation, process sets, completion), execute.cc (fusion, and
// running each group on host memory or on a GPU plane, side by side) and
// engine_driver.cc (who drives).
//
// Who drives the cycles (engine_driver.cc): the engine's thread, or a caller
// waiting for its op. A lone op handed to the thread would pay for two
// thread hand-offs (wake the engine, then wake the caller), which cost more
// than the op itself, and on a busy machine the woken thread waits for a
// core. So a caller that waits drives the engine itself, on its own core,
// while the thread steps aside; the thread takes over again as soon as no
// caller drives (see wait()).
//
// Process sets: steps 1-4 run per set, each set with its own cache and
// coordinator and over its own backend (Backend::split). The global set's
// exchange says which other sets have work anywhere; right after it, the
// members of each such set run steps 2-4 among themselves, in id order.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "autotune.h"
#include "backend.h"
#include "config.h"
#include "coordinator.h"
#include "data_planes.h"
#include "futex.h"
#include "handles.h"
#include "message.h"
#include "node_pool.h"
#include "response_cache.h"
#include "stall_inspector.h"
#include "timeline.h"

namespace unison {

// One process set as this rank's engine sees it: its ranks, the backend
// its members talk over, and its own negotiation state. Each set negotiates
// among its members only, with its own response cache and coordinator, so
// its ops never wait on ranks outside it.
struct ProcessSetState;

// Whether async ops start at once on the engine's thread (Config::overlap).
bool decide_overlap(const Config& config, const Backend& backend);

class Engine {
 public:
  Engine(const Config& config, std::unique_ptr<Backend> backend, HandleTable* handles);
  ~Engine();

  Status enqueue(const unison_op_options& options, int64_t* handle);
  // unison_group_begin / unison_group_end: this thread's collectives in
  // between are held back and queued together at the end (or, discarded,
  // never run), so one cycle takes the whole group and fuses it.
  void group_begin();
  void group_end(bool discard);
  // Waits for an op of this process, driving the engine from this thread
  // while it waits where the backend allows it; UNISON_ERR_TIMEOUT after
  // `timeout_seconds` (< 0: no limit). release_if_ok: HandleTable::wait's.
  Status wait(int64_t handle, double timeout_seconds, bool release_if_ok = false);
  // A caller polled an op that is not done: queued ops are taken now,
  // not after kUnclaimedSeconds (engine_driver.cc).
  void claim_for_poll();
  // Tells every rank this one is leaving, then stops the thread.
  void stop();
  // Rank 0 writes the timeline; on other ranks these do nothing.
  Status start_timeline(const std::string& path, bool mark_cycles);
  void stop_timeline() { timeline_.stop(); }
  // The settings in force: the autotuner's (the same on every rank), or the
  // configured ones.
  TunedSettings settings() const;
  const Backend& backend() const { return *backend_; }

 private:
  // A request this rank made, and where its bytes are.
  struct Entry {
    Request request;
    int process_set = 0;
    const void* input = nullptr;
    void* output = nullptr;
    int64_t output_bytes = 0;  // ragged ops: capacity of the caller's output
    int64_t handle = 0;
    int cache_position = -1;  // >= 0 while it waits as a cache bit
    const int32_t* input_ready = nullptr;  // unison_op_options::input_ready
    double data_wait_since = -1;           // when it went to waiting_for_data_; < 0: never
    bool data_wait_reported = false;       // warned of (warn_of_late_data)
    // GPU tensors: the device, the caller's stream, and an event recorded
    // on that stream at enqueue; the collective starts after it. The event
    // goes back to its pool when the last copy of the entry is gone.
    int device = UNISON_CPU_DEVICE;
    void* stream = nullptr;
    std::shared_ptr<void> ready;
  };
  friend struct ProcessSetState;

  void start_thread();
  void loop();
  // One step of driving: runs a cycle that is due, asks for one when this
  // rank has work, or looks after waiting ops. Returns 0 when it did
  // something, else how long to wait for activity before the next step.
  // Only the driver calls it (under drive_mutex_).
  double step(bool by_caller);
  // Once a failure has stopped the engine: gives the planes' queued device
  // work the peer timeout to finish, then aborts it (engine_driver.cc).
  void end_stuck_device_work(std::unique_lock<std::mutex>& drive_lock);
  // Lets go of drive_mutex_ and tells callers waiting to drive (wait()).
  void let_go(std::unique_lock<std::mutex>& drive_lock, bool by_caller);
  // Whether the engine's thread should stay parked: a caller drives, or one
  // did a moment ago and is likely to again.
  bool callers_drive() const;
  // Puts an op enqueued at `now` on the queue for the next cycle
  // (queue_mutex_ held); wake_for() follows the last of a batch.
  void queue_for_cycle(Entry&& e, double now);
  // After an enqueue: wakes whoever must take the op.
  void wake_for(int64_t handle);
  // Work of this rank's for a cycle. Queued ops count once they have waited
  // `queue_age` seconds; *claim_in says how long until they would.
  bool has_local_work(double queue_age = 0, double* claim_in = nullptr);
  Status run_cycle();
  // Moves the queue, and the ops whose input has become ready, into their
  // sets; ops whose input is not ready yet go to waiting_for_data_.
  void take_new_requests();
  static bool input_ready(const Entry& e);
  bool data_became_ready() const;
  // The stall inspector's counterpart on the waiting rank: the others see
  // it as missing, and only this rank knows it waits for its own data.
  void warn_of_late_data(double now);
  void build_message(ProcessSetState& set, CycleMessage* message, double now);
  Status exchange(ProcessSetState& set, const CycleMessage& mine, std::vector<CycleMessage>* all);
  Status negotiate(ProcessSetState& set, const std::vector<CycleMessage>& all, double now);
  std::vector<std::vector<const Response*>> fuse(const ProcessSetState& set,
                                                 const std::vector<const Response*>& responses) const;
  void execute(ProcessSetState& set, const std::vector<const Response*>& group);
  // Checks a GPU op's device and pointers and records its input's event.
  Status accept_device_op(const unison_op_options& options, const std::string& what, Entry* entry);
  // The set's plane for `device`, made collectively at its first op.
  Status device_plane(ProcessSetState& set, int device, DevicePlane** out);
  Status add_process_set(const std::vector<int>& ranks, OpResult* result);
  void remove_process_set(int id);
  // Finishes this rank's op `name`; its handle completes at the next
  // publish_completions(), together with the rest of its group.
  void complete(ProcessSetState& set, const std::string& name, const Status& status, OpResult result = OpResult());
  void publish_completions();
  void fail_everything(const Status& status);
  bool stall_check_due(const ProcessSetState& set, double now) const;
  std::vector<Waiting> stalled_candidates(const ProcessSetState& set);
  double oldest_waiting_since(const ProcessSetState& set) const;  // without building the candidates
  void note_arrivals(const ProcessSetState& set, const std::vector<CycleMessage>& all,
                     const std::vector<uint64_t>& anywhere);
  void apply_tuning(const CycleMessage& from_rank_0);
  void switch_cache();

  const Config config_;
  Timeline timeline_;  // before backend_: stopped after the engine thread is gone
  // Settings the autotuner may change, at one cycle on every rank; written by
  // the engine thread, read by settings() under tuned_mutex_.
  mutable std::mutex tuned_mutex_;
  TunedSettings tuned_;
  std::unique_ptr<Autotuner> tuner_;  // rank 0, with UNISON_AUTOTUNE
  bool cache_switched_ = false;       // this cycle: switch_cache() at its end
  bool everyone_blocked_ = false;     // this cycle: every rank reported CycleMessage::kBlocked
  std::unique_ptr<Backend> backend_;
  HandleTable* handles_;

  // Shared with calling threads, under queue_mutex_.
  std::mutex queue_mutex_;
  std::vector<Entry> queue_;
  double queued_since_ = 0;      // when queue_ last became non-empty
  double last_enqueued_at_ = 0;  // the latest op's enqueue
  std::atomic<bool> claimed_by_poll_{false};  // claim_for_poll() since the queue was last taken
  static constexpr double kUnclaimedAtMostFactor = 10;  // see has_local_work
  using NameSet = std::unordered_set<std::string>;
  std::map<int, NameSet> in_flight_;  // names, by process set
  NodePool<NameSet> spare_in_flight_;  // their nodes, kept with the names' memory (node_pool.h)
  // A name enters in_flight_ at enqueue (false: it was there already) and
  // leaves when its op completes or is dropped (queue_mutex_ held).
  bool mark_in_flight(int process_set, const std::string& name);
  void unmark_in_flight(int process_set, const std::string& name);
  std::map<int, std::vector<int>> set_ranks_;  // every process set's ranks, member or not
  Status terminal_;  // set once the engine can no longer run ops
  // Groups open on calling threads (group_begin): nesting depth, and the
  // collectives held back until the outermost group ends.
  struct OpenGroup {
    int depth = 0;
    bool discard = false;  // an inner group was discarded: so is the whole
    std::vector<Entry> held;
  };
  std::map<std::thread::id, OpenGroup> open_groups_;
  // The last group's buffer, emptied, for the next group to fill: grown
  // afresh for each step's 200 gradients, it cost an eighth of their
  // enqueue and negotiation at one rank (reallocated and moved 8 times).
  std::vector<Entry> spare_held_;
  // Unnamed ops numbered by process set: a set's members number their
  // unnamed ops alike, whatever other sets the others have run them in.
  std::map<int, uint64_t> unnamed_ops_;
  std::atomic<bool> stop_requested_{false};

  // The engine thread's own state. Declared after backend_, so the sets'
  // backends are gone before the one they were split from.
  std::map<int, std::unique_ptr<ProcessSetState>> sets_;  // the sets this rank is in, by id
  ProcessSetState* global_ = nullptr;                     // sets_[0]
  int next_set_id_ = 1;  // every rank adds sets in the same order, so ids agree
  // Taken from the queue while their input was not ready (input_ready): the
  // producer (a device stream) has not got there. They join negotiation
  // once it has; the driver looks at least every kDataPollSeconds.
  std::vector<Entry> waiting_for_data_;
  static constexpr double kDataPollSeconds = 1e-4;
  // The batch a cycle takes from queue_ (take_new_requests), empty between
  // cycles. It and queue_ swap buffers every cycle and both keep their
  // capacity: a queue grown from nothing each burst reallocated and moved
  // every Entry at 1, 2, 4, ... 256 ops, a fifth of what an enqueue cost in
  // a burst of 200.
  std::vector<Entry> taken_;
  static constexpr size_t kKeptQueueCapacity = 4096;
  // Ops negotiated or waiting for negotiation (ProcessSetState::pending),
  // and the nodes that left it, kept for the next ops (node_pool.h).
  using PendingTable = std::unordered_map<std::string, Entry>;
  NodePool<PendingTable> spare_pending_;
  void add_pending(ProcessSetState& set, Entry&& e);
  std::vector<Completion> finished_;                // completed, not yet published
  std::vector<std::pair<int, std::string>> finished_names_;  // (process set, name)
  uint64_t cycles_done_ = 0;
  // Driving (engine_driver.cc). The driver, thread or caller, holds
  // drive_mutex_; the state above and the backend belong to it.
  std::mutex drive_mutex_;
  std::atomic<int> callers_driving_{0};      // callers holding or waiting for drive_mutex_
  std::atomic<double> caller_left_at_{-1.0};  // when the last one let go (monotonic seconds)
  Doorbell park_bell_;  // the engine's thread sleeps on it while callers drive
  bool overlap_ = true;  // async ops start at once (Config::overlap, decided)
  bool joined_ = false;         // this rank waits in join
  bool stopped_ = false;
  double last_cycle_start_ = 0;
  std::thread thread_;
};

struct ProcessSetState {
  ProcessSetState(int id, std::vector<int> ranks, int rank, Backend* backend, std::unique_ptr<Backend> owned,
                  const Config& config)
      : id(id), ranks(std::move(ranks)), rank(rank), backend(backend), owned(std::move(owned)),
        cache(config.cache_capacity), coordinator((int)this->ranks.size()), stall_inspector(config) {
    coordinator.set_rank_names(this->ranks, id);
    stall_inspector.set_rank_names(this->ranks, id);
  }
  int size() const { return (int)ranks.size(); }

  const int id;
  const std::vector<int> ranks;     // global ranks, ascending
  const int rank;                   // this rank's place among them
  Backend* const backend;           // its control and data planes
  std::unique_ptr<Backend> owned;   // the backend split for it (null for the global set)
  // Its GPU data planes, by device: made at the set's first op on each, and
  // gone before the backend they stage through.
  std::map<int, std::unique_ptr<DevicePlane>> device_planes;
  ResponseCache cache;
  Coordinator coordinator;          // used on the set's rank 0
  StallInspector stall_inspector;
  Engine::PendingTable pending;  // by name
  std::vector<std::string> to_send;  // names whose request goes in full
  std::vector<uint64_t> invalid_bits;  // stale cache positions to announce in its next cycle
  std::map<int, Waiting> partial_bits;  // set rank 0: cache bits set on some ranks only
  bool fresh = false;         // requests arrived since its last cycle
  bool another_cycle = false;  // its last cycle left work for the next
  // Set rank 0: its coordinator kept ready responses for the next cycle
  // (they did not fit in one message). Its own reason to ask for another
  // cycle: another_cycle also counts the others' asking, and echoing that
  // back kept every rank cycling for good once anyone had asked.
  bool responses_held_back = false;
  bool stall_check = false;    // set rank 0: this cycle inspects stalled tensors
};

}  // namespace unison
