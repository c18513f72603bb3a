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
// A thread that enqueues counts as a submitter from its first enqueue until
// it exits, so a thread that submitted before and is busy elsewhere now (an
// evaluation loop beside a thread waiting on a gradient) keeps its process
// unblocked. Only a thread that has never submitted and starts later is
// unseen; the stall check's switch (UNISON_STALL_CHECK_DISABLE) covers that
// program.
//
// Frameworks that run a collective as a node of their own graph (a
// TensorFlow tf.function) submit from a worker thread of theirs while the
// thread that called the graph waits inside the framework. Counted like a
// caller, every worker that once ran a node would count as busy forever
// after, and the waiting caller (a submitter since an eager broadcast) as
// busy too: such a process could never look blocked. PyTorch is the same
// on GPUs, where backward (the gradient hooks that start allreduces, the
// backward of collectives) runs on its per-device threads while the caller
// waits in backward() or step(). So the front end brackets the node with
// graph_node_begin/end: the worker is a submitter only inside it, and the
// thread the front end names as waiting for the graph counts as a
// submitter, blocked while it waits itself or while the node is blocked.
#pragma once

#include <cstdint>

namespace unison {
namespace caller_activity {

struct ThreadRecord;

// On every enqueue: registers the calling thread as a submitter (for good,
// unless it is inside a graph node, or the op is awaited by another thread:
// awaited) and counts as progress.
void note_enqueue(double now, bool awaited = false);
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
  ThreadRecord* counted_;  // the record whose blocked count this holds; null: none
};

// A framework's graph node running on this thread (unison_graph_node_begin
// and _end). waiting_thread: the Linux thread id of the thread that called
// the graph and cannot go on before the node ends (it may be this one); 0
// when not known. It is a submitter from then on.
void graph_node_begin(int64_t waiting_thread);
void graph_node_end();

// Frameworks whose graph nodes start an op and return (TensorFlow's
// asynchronous kernels) leave no thread blocked in a wait: the thread that
// called the graph waits inside the framework until the op completes. Such
// an op carries a key for that thread (unison_op_options.awaited_by),
// counted from its enqueue to its completion. Which thread a key means is
// asked of the front end's finder only when the test below needs it (a
// stack walk, in TensorFlow's case, too slow for every op); that thread is
// then a submitter, blocked while any op awaited by it is pending.
void awaited_begin(int64_t key);
void awaited_end(int64_t key);
void set_waiter_finder(int64_t (*finder)(int64_t key));

// True when this process has submitters, all of them are blocked waiting,
// and nothing was enqueued or completed in the last quiet_seconds.
bool blocked_for(double quiet_seconds, double now);

}  // namespace caller_activity
}  // namespace unison
