#include "caller_activity.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace unison {
namespace caller_activity {

// What the deadlock test knows of one thread.
struct ThreadRecord {
  int64_t tid = 0;
  // Enqueued outside a graph node, or called a graph that ran a node: a
  // submitter until it exits.
  bool submits = false;
  // Its own thread holds this record and removes it at exit; a record
  // made for a waiting thread by a node's worker is removed once
  // /proc/self/task no longer lists that thread.
  bool attached = false;
  int node_depth = 0;          // inside graph nodes (graph_node_begin)
  int64_t waiting_thread = 0;  // while inside one: who waits for the node
  std::atomic<int> blocked{0};  // BlockedScopes held (touched on every wait, so no lock)
};

namespace {

// Process-wide, not per engine: a thread stays a submitter across a
// shutdown and a new init. Never destroyed, so that threads exiting after
// static destruction has begun still find them.
std::mutex& registry_mutex = *new std::mutex;
auto& threads = *new std::unordered_map<int64_t, ThreadRecord>;  // by Linux thread id; elements never move
std::atomic<double> last_progress{0.0};
// Counts the records made for a thread by another thread (a node's
// waiting thread), so that a thread without a record of its own knows
// when to look for one.
std::atomic<uint64_t> named_by_others{0};
// Pending ops awaited by each key (awaited_begin), and who finds the key's thread.
auto& awaited_ops = *new std::unordered_map<int64_t, int>;
std::atomic<int64_t (*)(int64_t)> waiter_finder{nullptr};

int64_t linux_thread_id() { return static_cast<int64_t>(syscall(SYS_gettid)); }

// This thread's view of its record: the hot paths (enqueue, wait) read
// these instead of taking the lock.
struct Self {
  ThreadRecord* record = nullptr;
  bool submits = false;
  uint64_t looked_at = 0;  // named_by_others when this thread last looked for its record
  ~Self() {
    if (record == nullptr) return;
    std::lock_guard<std::mutex> lock(registry_mutex);
    threads.erase(record->tid);
  }
  // Called with registry_mutex held.
  ThreadRecord& attach() {
    if (record == nullptr) {
      const int64_t tid = linux_thread_id();
      record = &threads[tid];
      record->tid = tid;
      record->attached = true;
      submits = record->submits;  // it may have been named as a waiting thread before
    }
    return *record;
  }
  // A thread that never enqueued may still have been named as a node's
  // waiting thread: a submitter whose own waits must count (PyTorch's
  // step() waiting on allreduces that the GPU's autograd thread started).
  void adopt_a_record_made_by_others() {
    const uint64_t named = named_by_others.load();
    if (record != nullptr || named == looked_at) return;
    looked_at = named;
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (threads.count(linux_thread_id()) != 0) attach();
  }
};

thread_local Self self;

void progress(double now) {
  // Callers and the engine both write; any recent time will do.
  if (now > last_progress.load(std::memory_order_relaxed)) last_progress.store(now, std::memory_order_relaxed);
}

bool alive(int64_t tid) { return access(("/proc/self/task/" + std::to_string(tid)).c_str(), F_OK) == 0; }

// Whether `tid` waits for a graph node whose worker is blocked. Called
// with registry_mutex held.
bool waits_on_a_blocked_node(int64_t tid) {
  for (const auto& [id, t] : threads)
    if (t.node_depth > 0 && t.waiting_thread == tid && t.blocked.load() > 0) return true;
  return false;
}

// Whether `tid` is among the threads found waiting for awaited ops.
bool awaits(const std::vector<int64_t>& waiting, int64_t tid) {
  for (int64_t w : waiting)
    if (w == tid) return true;
  return false;
}

}  // namespace

void note_enqueue(double now, bool awaited) {
  // Only this thread writes its record's node_depth: read without the lock.
  if (!awaited && !self.submits && (self.record == nullptr || self.record->node_depth == 0)) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    self.attach().submits = true;
    self.submits = true;
  }
  progress(now);
}

void note_completion(double now) { progress(now); }

BlockedScope::BlockedScope() {
  self.adopt_a_record_made_by_others();
  counted_ = self.record;
  if (self.record != nullptr) self.record->blocked.fetch_add(1);
}

BlockedScope::~BlockedScope() {
  if (counted_ != nullptr) counted_->blocked.fetch_sub(1);
}

void graph_node_begin(int64_t waiting_thread) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  ThreadRecord& me = self.attach();
  if (me.node_depth++ == 0) me.waiting_thread = waiting_thread == me.tid ? 0 : waiting_thread;
  if (waiting_thread == 0) return;
  // The waiting thread runs graphs that submit, and will again: a
  // submitter from now on, like one that enqueued. It may be this very
  // thread (PyTorch runs a CPU backward's hooks on the caller's thread).
  if (waiting_thread == me.tid) {
    me.submits = self.submits = true;
    return;
  }
  ThreadRecord& waiting = threads[waiting_thread];
  if (waiting.tid == 0) named_by_others.fetch_add(1);  // new
  waiting.tid = waiting_thread;
  waiting.submits = true;
}

void graph_node_end() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (self.record == nullptr || self.record->node_depth == 0) return;
  if (--self.record->node_depth == 0) self.record->waiting_thread = 0;
}

void awaited_begin(int64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  ++awaited_ops[key];
}

void awaited_end(int64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = awaited_ops.find(key);
  if (it != awaited_ops.end() && --it->second <= 0) awaited_ops.erase(it);
}

void set_waiter_finder(int64_t (*finder)(int64_t key)) { waiter_finder.store(finder); }

bool blocked_for(double quiet_seconds, double now) {
  if (now - last_progress.load() < quiet_seconds) return false;  // the usual answer, without the lock
  // The threads that wait for awaited ops, found with no lock held: the
  // finder may take the front end's own locks (Python's).
  std::vector<int64_t> keys;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (const auto& [key, count] : awaited_ops) keys.push_back(key);
  }
  std::vector<int64_t> waiting;
  int64_t (*finder)(int64_t) = waiter_finder.load();
  for (int64_t key : keys) {
    const int64_t tid = finder != nullptr ? finder(key) : 0;
    if (tid > 0) waiting.push_back(tid);
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (int64_t tid : waiting) {
    // It calls graphs that submit, and will again: a submitter from now on.
    ThreadRecord& w = threads[tid];
    if (w.tid == 0) named_by_others.fetch_add(1);  // new
    w.tid = tid;
    w.submits = true;
  }
  // An op that completed while the finder ran is progress: not blocked.
  if (now - last_progress.load() < quiet_seconds) return false;
  bool any = false;
  for (auto it = threads.begin(); it != threads.end();) {
    ThreadRecord& t = it->second;
    if (!t.attached && !alive(t.tid)) {
      it = threads.erase(it);
      continue;
    }
    ++it;
    if (!t.submits && t.node_depth == 0) continue;
    any = true;
    if (t.blocked.load() == 0 && !waits_on_a_blocked_node(t.tid) && !awaits(waiting, t.tid)) return false;
  }
  return any;
}

}  // namespace caller_activity
}  // namespace unison
