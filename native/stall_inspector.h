// stall_inspector.h: rank 0 watches for tensors that some ranks submitted
// and others never did, the usual cause of a hung job (a rank took another
// branch, or skipped a step). It reports which tensors wait for which ranks,
// fails them when every rank is blocked (a deadlock, caller_activity.h), and,
// when told to, fails them after a time limit instead of waiting forever.
#pragma once

#include <string>
#include <vector>

#include "config.h"
#include "coordinator.h"

namespace unison {

class StallInspector {
 public:
  explicit StallInspector(const Config& config) : config_(config) {}
  // Whether a tensor waiting since `oldest_since` is old enough to look at
  // now. Asked on every engine wake-up, so it takes one number.
  bool due(double oldest_since, double now) const;
  struct Failure {
    std::string name;
    int code;  // UNISON_ERR_DEADLOCK or UNISON_ERR_STALLED
    std::string message;
  };
  // Prints a warning for what waited past the warning time; returns the
  // tensors to fail: all of them when `deadlocked` (every rank reported
  // itself blocked), else those waiting past the shutdown time (when that
  // is set).
  std::vector<Failure> inspect(const std::vector<Waiting>& waiting, double now, bool deadlocked);
  // For its reports: the global rank of each rank it watches, and the
  // process set they form (0: the global set).
  void set_rank_names(const std::vector<int>& global_ranks, int process_set_id);

 private:
  Config config_;
  std::vector<int> rank_names_;  // empty: the ranks are global ranks
  std::string set_label_;
  double last_report_ = 0;
  double last_inspected_ = 0;
};

}  // namespace unison
