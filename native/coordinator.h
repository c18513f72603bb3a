// coordinator.h: rank 0's table of requests, which decides one execution
// order for everyone.
//
// A tensor is ready when every rank has requested it (a rank that has
// joined counts as having requested everything). Its requests are then
// checked against each other; any disagreement becomes an error response
// that names the tensor and each rank's value, delivered to every rank.
#pragma once

#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "message.h"

namespace unison {

// Whether a request received from a peer is one its own enqueue checks
// (enqueue.cc) could have let through: a known op and dtype, a shape of
// non-negative dimensions, splits of the right count that add up to its
// rows without wrapping, roots and ranks within the set of `size`. The
// coordinator indexes its tables by all of these.
Status well_formed(const Request& request, int size);

// A tensor some ranks wait on, for the stall inspector.
struct Waiting {
  std::string name;
  int op;
  std::vector<bool> submitted;  // by rank
  double since;
};

class Coordinator {
 public:
  explicit Coordinator(int size) : size_(size), joined_(size, false) {}

  void add(const Request& request, double now);
  // Responses ready to run, in the order they became ready, up to about
  // budget_bytes of encoded size; *more is set when some were held back.
  std::vector<Response> take_ready(size_t budget_bytes, bool* more);
  // Tensors submitted by some ranks but not all.
  std::vector<Waiting> waiting() const;
  // When the oldest of them arrived; +infinity when none waits.
  double oldest_since() const;
  // Fails a waiting tensor on the ranks that submitted it.
  void fail(const std::string& name, int code, const std::string& message);
  bool any_joined() const { return joined_count_ > 0; }
  // For error messages: the global rank of each of this coordinator's
  // ranks, and the process set they form (0: the global set).
  void set_rank_names(const std::vector<int>& global_ranks, int process_set_id);

 private:
  struct Pending {
    std::vector<Request> requests;  // by rank
    std::vector<bool> submitted;
    int count = 0;
    double since = 0;
  };
  bool complete(const Pending& p) const;
  void finish(const std::string& name);
  Response build(const Pending& p) const;

  int size_;
  std::unordered_map<std::string, Pending> table_;
  std::vector<std::string> arrival_order_;  // names in table_, oldest first
  std::deque<Response> ready_;
  std::vector<bool> joined_;
  int joined_count_ = 0;
  int last_joined_ = -1;
  std::vector<int> rank_names_;  // empty: the ranks are global ranks
  std::string set_label_;        // "" or " (process set 3)"
};

}  // namespace unison
