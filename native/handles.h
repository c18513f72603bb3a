// handles.h: what the caller holds while an op runs, and what it reads
// back when the op is done. Waiting happens here, on a condition variable,
// with no lock held by the engine while it moves bytes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "node_pool.h"
#include "status.h"  // and unison.h

namespace unison {

struct OpResult {
  void* data = nullptr;         // the output buffer
  bool core_allocated = false;  // data was allocated by the core (free_result_memory frees it)
  int64_t bytes = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> received_splits;
  int join_rank = -1;
  bool unused_everywhere = false;  // allreduce, reducescatter: every rank's contribution was a placeholder
  int process_set_id = -1;  // add_process_set: the new set
};

// Frees a result the core allocated: host memory, or device memory
// (cuda/runtime.h) for a GPU op's.
void free_result_memory(void* data);

// One finished op, as the engine hands it over.
struct Completion {
  int64_t handle = 0;
  Status status;
  OpResult result;
};

class HandleTable {
 public:
  // awaited_by: the op's key for the thread that waits for it without a
  // wait (unison_op_options.awaited_by), 0 for none; counted as awaited
  // (caller_activity.h) until the op completes or its handle is released.
  int64_t create(int64_t awaited_by = 0);
  // Marks the ops done and wakes the waiters once for the whole batch: a
  // fused group of 200 tensors must not wake a waiting caller 200 times.
  void complete(std::vector<Completion>* batch);
  void complete(int64_t handle, const Status& status, OpResult result = OpResult());
  // UNISON_ERR_INVALID_ARGUMENT for an unknown handle.
  Status poll(int64_t handle, bool* done);
  // The op's status, or UNISON_ERR_TIMEOUT while it still runs. With
  // release_if_ok, a handle whose op succeeded is released in the same
  // call (and any result the core allocated freed).
  Status wait(int64_t handle, double timeout_seconds, bool release_if_ok = false);
  // For a caller waiting to drive the engine (engine_driver.cc): read
  // wake_generation() first; then wait_done_or_woken() returns true once
  // the op is done, or false after wake_waiters() was called since that
  // read (the driver let go), or after the timeout.
  uint64_t wake_generation();
  bool wait_done_or_woken(int64_t handle, uint64_t generation, double timeout_seconds);
  void wake_waiters();
  // Reads a completed op's result under the lock; fn(status, result).
  template <typename Fn>
  Status with_result(int64_t handle, Fn&& fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = states_.find(handle);
    if (it == states_.end()) return unknown(handle);
    if (!it->second.done)
      return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: handle " + std::to_string(handle) + " has not completed");
    fn(it->second.status, it->second.result);
    return Status::OK();
  }
  Status release(int64_t handle);
  // unison_on_done: `done` is called once the op completes, after the
  // table's lock is let go, so that it may read and release the handle;
  // at once, on this thread, if it has completed already.
  Status on_done(int64_t handle, unison_done_fn done, void* arg);

 private:
  struct State {
    bool done = false;
    Status status;
    OpResult result;
    int64_t awaited_by = 0;
    unison_done_fn done_fn = nullptr;
    void* done_arg = nullptr;
  };
  static Status unknown(int64_t handle);
  std::mutex mutex_;
  std::condition_variable completed_;
  std::unordered_map<int64_t, State> states_;
  NodePool<std::unordered_map<int64_t, State>> spare_states_;  // released handles' nodes
  int64_t next_ = 1;
  // Read without the lock (every blocking wait reads it first); changed
  // under it, so a waiter checking it under the lock misses no wake.
  std::atomic<uint64_t> wake_generation_{0};
};

}  // namespace unison
