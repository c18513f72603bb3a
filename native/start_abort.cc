#include "start_abort.h"

#include <atomic>
#include <mutex>

#include "unison.h"

namespace unison {
namespace {

// The mutex makes "is a start-up in progress?" and "abort it" one step, so
// that an abort arriving as a start-up ends cannot outlive it and fail the
// next one; the flag lets the waits look without taking the mutex.
std::mutex mutex;
bool starting = false;
std::string abort_reason;
std::atomic<bool> aborted{false};

}  // namespace

void start_up_begins() {
  std::lock_guard<std::mutex> lock(mutex);
  starting = true;
  abort_reason.clear();
  aborted.store(false);
}

void start_up_ends() {
  std::lock_guard<std::mutex> lock(mutex);
  starting = false;
  abort_reason.clear();
  aborted.store(false);
}

void abort_start_up(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!starting) return;
  abort_reason = reason;
  aborted.store(true);
}

Status start_up_aborted() {
  if (!aborted.load(std::memory_order_relaxed)) return Status::OK();
  std::lock_guard<std::mutex> lock(mutex);
  return Status::Error(UNISON_ERR_RANK_FAILED, "unison: start-up ended: " + abort_reason);
}

}  // namespace unison
