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

#include "backend.h"
#include "config.h"
#include "coordinator.h"
#include "handles.h"
#include "message.h"
#include "response_cache.h"
#include "stall_inspector.h"

namespace unison {

class Engine {
 public:
  Engine(const Config& config, std::unique_ptr<Backend> backend, HandleTable* handles);
  ~Engine();

  Status enqueue(const unison_op_options& options, int64_t* handle);
  // Tells every rank this one is leaving, then stops the thread.
  void stop();
  const Backend& backend() const { return *backend_; }

 private:
  // A request this rank made, and where its bytes are.
  struct Entry {
    Request request;
    const void* input = nullptr;
    void* output = nullptr;
    int64_t handle = 0;
    int cache_position = -1;  // >= 0 while it waits as a cache bit
  };

  void loop();
  bool has_local_work();
  Status run_cycle();
  void take_new_requests(CycleMessage* message);
  std::vector<std::vector<const Response*>> fuse(const std::vector<const Response*>& responses) const;
  void execute(const std::vector<const Response*>& group);
  // Finishes this rank's op `name`; its handle completes at the next
  // publish_completions(), together with the rest of its group.
  void complete(const std::string& name, const Status& status, OpResult result = OpResult());
  void publish_completions();
  void fail_everything(const Status& status);
  std::vector<Waiting> stalled_candidates();
  double oldest_waiting_since() const;  // of stalled_candidates(), without building them

  const Config config_;
  std::unique_ptr<Backend> backend_;
  HandleTable* handles_;

  // Shared with calling threads, under queue_mutex_.
  std::mutex queue_mutex_;
  std::vector<Entry> queue_;
  std::unordered_set<std::string> in_flight_;
  Status terminal_;  // set once the engine can no longer run ops
  uint64_t unnamed_ops_ = 0;
  std::atomic<bool> stop_requested_{false};

  // The engine thread's own state.
  std::unordered_map<std::string, Entry> pending_;  // by name
  std::vector<std::string> to_send_;                // names whose request goes in full
  ResponseCache cache_;
  Coordinator coordinator_;                         // used on rank 0
  StallInspector stall_inspector_;
  std::map<int, Waiting> partial_bits_;             // rank 0: cache bits set on some ranks only
  std::vector<Completion> finished_;                // completed, not yet published
  std::vector<std::string> finished_names_;
  uint64_t cycles_done_ = 0;
  bool another_cycle_ = false;  // the last cycle left work for the next
  bool joined_ = false;         // this rank waits in join
  bool anyone_joined_ = false;  // as of the last cycle
  bool stopped_ = false;
  double last_cycle_start_ = 0;
  std::thread thread_;
};

}  // namespace unison
