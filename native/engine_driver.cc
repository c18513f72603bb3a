// engine_driver.cc: who drives the engine's cycles, and when.
//
// The engine's state is driven by one thread at a time, the holder of
// drive_mutex_: the engine's own thread, or a caller waiting for its op.
//
// Why callers drive. A lone op handed to the engine's thread pays for two
// thread hand-offs: the caller wakes the engine, the engine runs the cycle,
// then wakes the caller. Each wake-up is a system call and a trip through
// the scheduler, and on a machine whose cores are all busy (the usual case:
// one rank per core) the woken thread also waits for a core, taken from the
// rank's own caller. A 4 KiB allreduce then took 60-70 us where MPICH, whose
// caller does the work itself, took 3 us. A caller that waits for its op has
// nothing else to do, so it runs the cycles itself, on its own core, and
// the engine's thread stays asleep: one runnable thread per rank.
//
// The hand-over:
//   - a waiting caller announces itself (callers_driving_) and takes the
//     mutex, then steps the engine until its op is done or its time is up;
//   - the engine's thread parks on park_bell_ while callers drive, and for
//     kCallerLinger after the last one let go: a caller in a loop of
//     synchronous ops comes back within microseconds, and waking the thread
//     in between would cost what driving saves;
//   - with overlap (below), an enqueue that no caller is expected to wait
//     for rings park_bell_, so async ops (gradients during backward) are
//     taken at once; one that its thread will likely wait for (that thread
//     waited for its previous op right after enqueueing it) leaves the
//     thread parked. Guessed wrong, the op waits at most kCallerLinger;
//   - a caller that leaves work behind (another thread's op, a cycle a peer
//     asked for) rings park_bell_, so the thread takes over at once;
//   - an op another thread enqueues while a caller drives wakes that caller
//     (overlap or not), which takes it into its next cycle.
// A peer's request for a cycle reaches whoever listens on the backend: a
// driving caller, or the thread (parked at most kCallerLinger).
//
// Overlap (UNISON_OVERLAP). Starting an async op at once, on the engine's
// thread, overlaps its bytes with the caller's compute (gradients during
// backward) only if that thread has a core to run on. Where the host's ranks
// already fill every core, it runs in their stead, and the training loses
// more to the hand-offs than it gains: on the 2-core VM, 2 ranks trained an
// MLP at 0.69-0.77x the speed of 2 independent processes with overlap, and
// at 0.82-0.83x without (docs/design-notes.md). So by default async ops
// start at once only where this host has more usable cores than ranks;
// elsewhere they wait in the queue for a caller's wait, which drives them
// all in one cycle (and fuses them), for a peer's cycle, or, for ops nobody
// waits for, until their producer has been quiet for kUnclaimedSeconds
// (Engine::has_local_work).
//
// Only backends whose wait_for_activity() is safe beside the driver allow
// this (Backend::callers_may_drive: shared memory and the single process);
// elsewhere callers wait for the thread, as before.
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <new>

#include "caller_activity.h"
#include "engine.h"
#include "log.h"
#include "signals.h"

namespace unison {
namespace {

// How long an idle engine sleeps before it looks at its peers again.
constexpr double kIdleWakeSeconds = 0.25;
// How long the engine's thread stays parked after a caller stopped driving.
constexpr double kCallerLinger = 1e-3;
// Without overlap: how long an async op waits for a caller before the
// engine's thread takes it anyway.
constexpr double kUnclaimedSeconds = 0.01;

// The enqueuing thread's history, to guess whether it will wait for the op
// it enqueues: it did if it waited for its previous op before enqueuing
// another. Handles are unique in the process, engines or not.
thread_local int64_t last_enqueued = 0;
thread_local int64_t last_waited = -1;

}  // namespace

bool decide_overlap(const Config& config, const Backend& backend) {
  if (!backend.callers_may_drive()) return true;  // only the engine's thread drives
  if (config.overlap >= 0) return config.overlap == 1;
  return usable_cores() > config.local_size;
}

void Engine::start_thread() {
  {
    // Asynchronous signals must reach Python's main thread (signals.h).
    AsyncSignalsBlocked blocked;
    thread_ = std::thread([this] { loop(); });
  }
  pthread_setname_np(thread_.native_handle(), "unison-engine");  // as top -H and gdb show it
  if (config_.engine_core >= 0) {
    // Only this thread: a caller that drives the engine (below) stays
    // wherever the framework put it.
    cpu_set_t core;
    CPU_ZERO(&core);
    CPU_SET(config_.engine_core, &core);
    const int failed = pthread_setaffinity_np(thread_.native_handle(), sizeof(core), &core);
    if (failed != 0)
      log_message(LogLevel::warning, "unison: cannot pin the engine thread to core %d (%s): %s\n",
                  config_.engine_core, config_.thread_affinity_setting.c_str(), std::strerror(failed));
  }
}

Engine::~Engine() { stop(); }

void Engine::stop() {
  stop_requested_.store(true);
  backend_->wake();
  park_bell_.ring();
  if (thread_.joinable()) thread_.join();
}

bool Engine::callers_drive() const {
  return callers_driving_.load() > 0 || monotonic_seconds() < caller_left_at_.load() + kCallerLinger;
}

void Engine::wake_for(int64_t handle) {
  const bool caller_will_wait = last_enqueued != 0 && last_waited == last_enqueued;
  last_enqueued = handle;
  if (!overlap_) {
    // Left for a wait, a peer's cycle, or kUnclaimedSeconds; but a caller
    // of another thread already driving takes it into its next cycle. Its
    // own op may need this one first (a peer's threads reach their ops in
    // another order), and it sleeps until a peer or this ring wakes it,
    // else for up to kUnclaimedSeconds.
    if (callers_driving_.load() > 0) backend_->wake();
    return;
  }
  backend_->wake();  // a driving caller listens here
  if (!caller_will_wait) park_bell_.ring();
}

// A caller that polls rather than waits drives nothing. Without overlap,
// its op would sit in the queue until its producer had been quiet for
// kUnclaimedSeconds: a loop of allreduce_async_ and poll() took 10 ms an
// op. Polling says the caller wants the op now, so the engine's thread
// takes the queue at once, without the linger after a caller's wait; only
// the first poll since the last take rings. An empty queue claims nothing:
// the op is under way, and a claim left standing would take the next op
// (a gradient of the next backward) alone, out of its batch.
void Engine::claim_for_poll() {
  if (overlap_ || claimed_by_poll_.load()) return;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    if (queue_.empty() || claimed_by_poll_.exchange(true)) return;
  }
  caller_left_at_.store(-1.0);  // a poller comes back for nothing to drive: no linger
  backend_->wake();             // a driving caller of another thread takes it, or
  park_bell_.ring();            // the engine's thread does
}

void Engine::loop() {
  for (;;) {
    const uint32_t parked = park_bell_.token();
    if (!stop_requested_.load() && callers_drive()) {
      park_bell_.sleep(parked, kCallerLinger);
      continue;
    }
    std::unique_lock<std::mutex> lock(drive_mutex_);
    if (stopped_) {
      end_stuck_device_work(lock);
      return;
    }
    const uint32_t token = backend_->activity_token();
    const double idle = step(false);
    let_go(lock, false);
    if (idle > 0) backend_->wait_for_activity(token, idle);
  }
}

// A failure that stopped the engine can leave a plane's queued device work
// waiting for a peer's side that will never run: a peer whose communicator
// was aborted after a device failure, and which then shut down in order,
// looks like any peer that shut down. Nothing on the host waits for that
// work, but every stream ordered after it does, so the framework's next
// synchronize would hang. A peer that shut down in order ran its side
// first, so the work gets the peer timeout to finish, and is then aborted.
// (A lost rank's planes were aborted at once: fail_everything.)
void Engine::end_stuck_device_work(std::unique_lock<std::mutex>& drive_lock) {
  const double deadline = monotonic_seconds() + config_.peer_timeout_seconds;
  for (;;) {
    std::vector<DevicePlane*> busy;
    for (const auto& [id, set] : sets_)
      for (const auto& [device, plane] : set->device_planes)
        if (plane->busy()) busy.push_back(plane.get());
    if (busy.empty()) return;
    if (monotonic_seconds() > deadline) {
      // Said before it is done: the streams go on at once, and the process may end with them.
      log_message(LogLevel::warning, "unison: GPU collectives queued before this rank stopped had not finished "
                  "%.0f s later (UNISON_PEER_TIMEOUT_SECONDS); they are aborted. It stopped on: %s",
                  config_.peer_timeout_seconds, terminal_.message.c_str());
      for (DevicePlane* plane : busy) plane->abandon();
      return;
    }
    drive_lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    drive_lock.lock();
  }
}

double Engine::step(bool by_caller) {
  if (cycles_done_ < backend_->requested_cycles()) {
    last_cycle_start_ = monotonic_seconds();
    timeline_.cycle_marker();
    Status s;
    // Memory running out mid-cycle (a result as large as peers said, a
    // burst of requests) leaves this rank out of step with its peers, so
    // every op fails; but it fails with a status, not std::terminate.
    try {
      s = run_cycle();
    } catch (const std::bad_alloc&) {
      s = Status::Error(UNISON_ERR_OUT_OF_MEMORY, "unison: out of memory during a negotiation cycle");
    }
    ++cycles_done_;
    if (!s.ok()) fail_everything(s);
    return 0;
  }
  double claim_in = kIdleWakeSeconds;
  if (has_local_work(by_caller || overlap_ ? 0 : kUnclaimedSeconds, &claim_in)) {
    if (tuned_.cycle_time_ms > 0) {
      const double wait = last_cycle_start_ + tuned_.cycle_time_ms * 1e-3 - monotonic_seconds();
      if (wait > 0) return wait;
    }
    backend_->request_cycles(cycles_done_ + 1);
    return 0;
  }
  const double now = monotonic_seconds();
  if (!waiting_for_data_.empty()) warn_of_late_data(now);
  bool stall_due = false, anything_pending = false;
  Status device_failure;
  for (const auto& [id, set] : sets_) {
    stall_due |= stall_check_due(*set, now);
    anything_pending |= !set->pending.empty();
    // A GPU collective still running needs its peers as much as a pending
    // op does, and nobody waits on the host for it: look at them too, and
    // at what the device library says of it. Work it has given up on would
    // hold its stream, and every stream ordered after it, for good.
    for (const auto& [device, plane] : set->device_planes) {
      if (!plane->busy()) continue;
      anything_pending = true;
      if (Status s = plane->asynchronous_error(); !s.ok()) {
        plane->abandon();
        if (device_failure.ok()) device_failure = s;
      }
    }
  }
  if (!device_failure.ok()) {
    log_message(LogLevel::error, "%s", device_failure.message.c_str());
    fail_everything(device_failure);
    return 0;
  }
  if (stall_due) {
    backend_->request_cycles(cycles_done_ + 1);
    return 0;
  }
  if (anything_pending) {
    Status s = backend_->check_peers();
    if (!s.ok()) {
      fail_everything(s);
      return 0;
    }
  }
  // Without overlap, an op enqueued after this step rang no one: look again
  // within kUnclaimedSeconds. No one rings when an op's data comes either.
  const double look_again = std::min(overlap_ ? kIdleWakeSeconds : kUnclaimedSeconds, std::max(claim_in, 1e-4));
  return waiting_for_data_.empty() ? look_again : std::min(look_again, kDataPollSeconds);
}

void Engine::let_go(std::unique_lock<std::mutex>& drive_lock, bool by_caller) {
  drive_lock.unlock();
  // Only callers wait to drive (a caller letting go still counts itself).
  if (callers_driving_.load() > (by_caller ? 1 : 0)) handles_->wake_waiters();
}

Status Engine::wait(int64_t handle, double timeout_seconds, bool release_if_ok) {
  last_waited = handle;
  caller_activity::BlockedScope blocked;  // for the stall inspector's deadlock test
  bool done = false;
  Status s = handles_->poll(handle, &done);
  if (!s.ok() || done || !backend_->callers_may_drive()) return handles_->wait(handle, timeout_seconds, release_if_ok);
  const double deadline = timeout_seconds < 0 ? -1 : monotonic_seconds() + timeout_seconds;
  auto remaining = [&] { return deadline < 0 ? kIdleWakeSeconds : deadline - monotonic_seconds(); };

  callers_driving_.fetch_add(1);
  std::unique_lock<std::mutex> lock(drive_mutex_, std::defer_lock);
  // Another thread may be driving: the engine's, or a caller of another
  // thread waiting for its own op, which holds the mutex until that op is
  // done. Its cycles take this op too, so wait for this op or for the
  // driver to let go, never for the mutex alone. (Waiting on the mutex,
  // a caller whose op another thread had finished stayed blocked behind
  // that thread's wait; with the ranks' threads in different orders, each
  // rank's driver then waited for an op the other's blocked thread had yet
  // to enqueue, for 200 ms at a time.)
  constexpr double kDriverCheckSeconds = 0.01;  // in case a let-go went unsaid
  for (;;) {
    const uint64_t generation = handles_->wake_generation();
    if (lock.try_lock()) break;
    const double left = remaining();
    if (left <= 0) break;
    if (handles_->wait_done_or_woken(handle, generation, std::min(left, kDriverCheckSeconds))) break;
  }
  bool work_left = false;
  if (lock.owns_lock()) {
    while (!stopped_ && !stop_requested_.load()) {
      if (handles_->poll(handle, &done).ok() && done) break;
      const uint32_t token = backend_->activity_token();
      const double idle = step(true);
      if (idle <= 0) continue;
      const double left = remaining();
      if (left <= 0) break;
      backend_->wait_for_activity(token, std::min(idle, left));
    }
    work_left = !stopped_ && (has_local_work() || cycles_done_ < backend_->requested_cycles());
    let_go(lock, true);
  }
  caller_left_at_.store(monotonic_seconds());
  callers_driving_.fetch_sub(1);
  if (work_left || stop_requested_.load()) park_bell_.ring();
  return handles_->wait(handle, deadline < 0 ? -1.0 : std::max(remaining(), 0.0), release_if_ok);
}

}  // namespace unison
