#include "handles.h"

#include <chrono>
#include <cstdlib>
#include <string>

#include "caller_activity.h"
#include "cuda/runtime.h"

namespace unison {

void free_result_memory(void* data) {
  if (!free_device_result(data)) std::free(data);
}

Status HandleTable::unknown(int64_t handle) {
  return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                       "unison: unknown handle " + std::to_string(handle) +
                           " (never issued, or already released)");
}

int64_t HandleTable::create(int64_t awaited_by) {
  if (awaited_by != 0) caller_activity::awaited_begin(awaited_by);
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t h = next_++;
  auto node = spare_states_.take();
  if (node.empty()) {
    states_.emplace(h, State()).first->second.awaited_by = awaited_by;
    return h;
  }
  node.key() = h;
  node.mapped() = State();
  node.mapped().awaited_by = awaited_by;
  states_.insert(std::move(node));
  return h;
}

void HandleTable::complete(std::vector<Completion>* batch) {
  if (batch->empty()) return;
  // Callbacks and awaited ops, run and counted after the lock is let go.
  struct Done {
    unison_done_fn fn;
    void* arg;
    int64_t handle;
    int code;
  };
  std::vector<Done> callbacks;
  std::vector<int64_t> awaited;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Completion& c : *batch) {
      auto it = states_.find(c.handle);
      if (it == states_.end()) {
        if (c.result.core_allocated) free_result_memory(c.result.data);
        continue;
      }
      State& state = it->second;
      state.done = true;
      state.status = std::move(c.status);
      state.result = std::move(c.result);
      if (state.awaited_by != 0) awaited.push_back(state.awaited_by);
      if (state.done_fn != nullptr) callbacks.push_back({state.done_fn, state.done_arg, c.handle, state.status.code});
      state.awaited_by = 0;
      state.done_fn = nullptr;
    }
  }
  batch->clear();
  completed_.notify_all();
  for (int64_t key : awaited) caller_activity::awaited_end(key);
  for (const Done& d : callbacks) d.fn(d.arg, d.handle, d.code);
}

void HandleTable::complete(int64_t handle, const Status& status, OpResult result) {
  std::vector<Completion> one(1);
  one[0].handle = handle;
  one[0].status = status;
  one[0].result = std::move(result);
  complete(&one);
}

Status HandleTable::poll(int64_t handle, bool* done) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = states_.find(handle);
  if (it == states_.end()) return unknown(handle);
  *done = it->second.done;
  return Status::OK();
}

Status HandleTable::wait(int64_t handle, double timeout_seconds, bool release_if_ok) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = states_.find(handle);
  if (it == states_.end()) return unknown(handle);
  auto is_done = [&] {
    auto found = states_.find(handle);
    return found == states_.end() || found->second.done;
  };
  if (timeout_seconds < 0) {
    completed_.wait(lock, is_done);
  } else if (!completed_.wait_for(lock, std::chrono::duration<double>(timeout_seconds), is_done)) {
    return Status::Error(UNISON_ERR_TIMEOUT, "unison: op still running");
  }
  it = states_.find(handle);
  if (it == states_.end()) return unknown(handle);
  if (!release_if_ok || !it->second.status.ok()) return it->second.status;
  if (it->second.result.core_allocated) free_result_memory(it->second.result.data);
  spare_states_.erase(states_, it);
  return Status::OK();
}

uint64_t HandleTable::wake_generation() { return wake_generation_.load(); }

bool HandleTable::wait_done_or_woken(int64_t handle, uint64_t generation, double timeout_seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto done = [&] {
    auto found = states_.find(handle);
    return found == states_.end() || found->second.done;
  };
  completed_.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
                      [&] { return done() || wake_generation_ != generation; });
  return done();
}

void HandleTable::wake_waiters() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_generation_.fetch_add(1);
  }
  completed_.notify_all();
}

Status HandleTable::release(int64_t handle) {
  int64_t awaited_by = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = states_.find(handle);
    if (it == states_.end()) return unknown(handle);
    if (it->second.result.core_allocated) free_result_memory(it->second.result.data);
    awaited_by = it->second.awaited_by;  // still pending: nobody waits for it any more
    spare_states_.erase(states_, it);
  }
  if (awaited_by != 0) caller_activity::awaited_end(awaited_by);
  return Status::OK();
}

Status HandleTable::on_done(int64_t handle, unison_done_fn done, void* arg) {
  int code = UNISON_OK;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = states_.find(handle);
    if (it == states_.end()) return unknown(handle);
    if (!it->second.done) {
      it->second.done_fn = done;
      it->second.done_arg = arg;
      return Status::OK();
    }
    code = it->second.status.code;
  }
  done(arg, handle, code);
  return Status::OK();
}

}  // namespace unison
