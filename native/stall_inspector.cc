#include "stall_inspector.h"

#include <algorithm>
#include <cstdio>

#include "dtype.h"
#include "log.h"

namespace unison {
namespace {

std::string ranks_where(const std::vector<bool>& submitted, bool value, const std::vector<int>& names) {
  std::string out;
  for (size_t r = 0; r < submitted.size(); ++r)
    if (submitted[r] == value) out += (out.empty() ? "" : ", ") + std::to_string(names.empty() ? (int)r : names[r]);
  return "[" + out + "]";
}

}  // namespace

void StallInspector::set_rank_names(const std::vector<int>& global_ranks, int process_set_id) {
  rank_names_ = global_ranks;
  set_label_ = process_set_id == 0 ? "" : " in process set " + std::to_string(process_set_id);
}

bool StallInspector::due(double oldest_since, double now) const {
  if (!config_.stall_check_enabled) return false;
  const double age = now - oldest_since;  // -infinity when nothing waits
  // Past the warning time, every second (one control exchange) asks the
  // ranks whether they are all blocked, so that a deadlock fails soon after
  // the last rank blocked, not a warning period later; inspect() prints the
  // warning once a warning period.
  if (age >= config_.stall_warning_seconds && now - last_inspected_ >= std::min(1.0, config_.stall_warning_seconds))
    return true;
  return config_.stall_shutdown_seconds > 0 && age >= config_.stall_shutdown_seconds;
}

std::vector<StallInspector::Failure> StallInspector::inspect(const std::vector<Waiting>& waiting, double now,
                                                             bool deadlocked) {
  std::vector<Failure> failures;
  if (!config_.stall_check_enabled) return failures;
  last_inspected_ = now;
  std::vector<std::string> lines;
  for (const Waiting& w : waiting)
    lines.push_back(std::string(op_name(w.op)) + " '" + w.name + "'" + set_label_ + " waited " +
                    std::to_string((int)(now - w.since)) + " s: submitted by ranks " +
                    ranks_where(w.submitted, true, rank_names_) + ", missing from ranks " +
                    ranks_where(w.submitted, false, rank_names_));
  if (deadlocked && !waiting.empty()) {
    // No rank can submit the missing tensors: each names all of them, since
    // the bug is usually where the ranks' paths parted, not in one tensor.
    std::string message = "unison: deadlock: every rank is blocked waiting on a collective that another rank "
                           "has not submitted, and none has started or finished one for " +
                           std::to_string((int)config_.stall_warning_seconds) + " s, so these can never run:";
    for (const std::string& line : lines) message += "\n  " + line;
    message += "\nA rank took a different code path, or submitted these in another order "
               "(UNISON_STALL_CHECK_DISABLE=1 waits instead).";
    for (const Waiting& w : waiting) failures.push_back({w.name, UNISON_ERR_DEADLOCK, message});
    return failures;
  }
  std::string report;
  for (size_t i = 0; i < waiting.size(); ++i) {
    const Waiting& w = waiting[i];
    const double age = now - w.since;
    const std::string& line = lines[i];
    if (config_.stall_shutdown_seconds > 0 && age >= config_.stall_shutdown_seconds) {
      failures.push_back({w.name, UNISON_ERR_STALLED,
                          "unison: stalled: " + line + " (failed after UNISON_STALL_SHUTDOWN_TIME_SECONDS=" +
                              std::to_string((int)config_.stall_shutdown_seconds) + ")"});
    } else if (age >= config_.stall_warning_seconds) {
      report += "  " + line + "\n";
    }
  }
  if (!report.empty() && now - last_report_ >= config_.stall_warning_seconds) {
    // Where the deadlock test cannot see (a rank busy outside unison, or
    // collectives on a framework's worker threads), say how not to wait forever.
    const char* remedy = config_.stall_shutdown_seconds > 0
                             ? ""
                             : "  (they wait for as long as it takes: UNISON_STALL_SHUTDOWN_TIME_SECONDS fails them "
                               "after that many seconds)\n";
    log_message(LogLevel::warning,
                "unison: warning: some ranks have waited more than %d s for others to submit "
                "these tensors; a rank may have taken a different code path:\n%s%s",
                (int)config_.stall_warning_seconds, report.c_str(), remedy);
    last_report_ = now;
  }
  return failures;
}

}  // namespace unison
