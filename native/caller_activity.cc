#include "caller_activity.h"

#include <atomic>

namespace unison {
namespace caller_activity {
namespace {

// Process-wide, not per engine: a thread stays a submitter across a
// shutdown and a new init.
std::atomic<int> submitters{0};
std::atomic<int> blocked_submitters{0};
std::atomic<double> last_progress{0.0};

// Registers its thread on first use and unregisters it when the thread exits.
struct Submitter {
  bool registered = false;
  void enroll() {
    if (registered) return;
    registered = true;
    submitters.fetch_add(1);
  }
  ~Submitter() {
    if (registered) submitters.fetch_sub(1);
  }
};

thread_local Submitter this_thread;

void progress(double now) {
  // Callers and the engine both write; any recent time will do.
  if (now > last_progress.load(std::memory_order_relaxed)) last_progress.store(now, std::memory_order_relaxed);
}

}  // namespace

void note_enqueue(double now) {
  this_thread.enroll();
  progress(now);
}

void note_completion(double now) { progress(now); }

BlockedScope::BlockedScope() : counted_(this_thread.registered) {
  if (counted_) blocked_submitters.fetch_add(1);
}

BlockedScope::~BlockedScope() {
  if (counted_) blocked_submitters.fetch_sub(1);
}

bool blocked_for(double quiet_seconds, double now) {
  const int all = submitters.load();
  return all > 0 && blocked_submitters.load() >= all && now - last_progress.load() >= quiet_seconds;
}

}  // namespace caller_activity
}  // namespace unison
