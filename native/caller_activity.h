// caller_activity.h: whether this process can still submit a collective,
// which is how the stall inspector tells a deadlock from a slow rank.
//
// A tensor that some ranks submitted and others did not is usually a rank
// that is late (saving a checkpoint, reading data) and will get there. It is
// a deadlock when no rank can ever submit anything again: every thread that
// submits collectives in every rank is blocked waiting on an op, and nothing
// has been enqueued or has completed for a while. Then waiting longer only
// hides the bug (a rank took another branch), so the inspector fails the
// stalled ops with a report instead of warning forever.
//
// A thread counts as a submitter from its first enqueue until it exits, so a
// thread that submitted before and is busy elsewhere now (an evaluation loop
// beside a thread waiting on a gradient) keeps its process unblocked. Only a
// thread that has never submitted and starts later is unseen; the stall
// check's switch (UNISON_STALL_CHECK_DISABLE) covers that program.
#pragma once

namespace unison {
namespace caller_activity {

// On every enqueue: registers the calling thread as a submitter and counts
// as progress.
void note_enqueue(double now);
// An op of this process completed.
void note_completion(double now);

// Held by a thread for as long as it is blocked waiting on an op.
class BlockedScope {
 public:
  BlockedScope();
  ~BlockedScope();
  BlockedScope(const BlockedScope&) = delete;
  BlockedScope& operator=(const BlockedScope&) = delete;

 private:
  bool counted_;
};

// True when this process has submitters, all of them are blocked waiting,
// and nothing was enqueued or completed in the last quiet_seconds.
bool blocked_for(double quiet_seconds, double now);

}  // namespace caller_activity
}  // namespace unison
