// autotune.h: choosing the fusion threshold, the cycle time, the response
// cache and the hierarchical allreduce during the first steps of training.
//
// Rank 0's engine owns the Autotuner. It counts training steps (a step ends
// when an allreduced tensor's name comes round again), scores each sample
// of a few steps by the bytes allreduced per second, and searches one
// setting at a time: every candidate of the fusion threshold, keeping the
// best, then of the cycle time, the cache, and the hierarchical layout.
// After each change one sample is thrown away (the change lands mid-step),
// then a few are scored. Settings the user fixed are not searched.
//
// Why not Bayesian optimisation, as Horovod does: the settings are few and
// mostly independent, and their candidates few (five thresholds, four cycle
// times, two and two), so a sweep of each in turn tries thirteen candidates at
// most, every one of them measured, and its choice can be read in the log.
// docs/design-notes.md ("The timeline and autotune") compares it with the other settings.
//
// The cache is searched unless UNISON_AUTOTUNE_CACHE=0. Switching it works:
// every rank switches at one cycle, and what waited as a cache bit is sent
// in full. For a while it was left out by default: before waiting callers
// drove the engine, about half the 2-rank torch jobs whose search had
// switched it trained ~40% slower afterwards. Since then, 10 of 10 such jobs
// showed nothing of the kind (docs/design-notes.md, "The timeline and autotune"), so it is
// searched as the other settings are, and the variable is there to leave it
// out should a job ever show it again.
//
// The engine puts each new setting in rank 0's next cycle message, and every
// rank applies it after that exchange: the same setting at the same cycle.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <unordered_set>
#include <vector>

#include "config.h"

namespace unison {

struct TunedSettings {
  uint64_t fusion_threshold_bytes = 0;
  double cycle_time_ms = 0;
  bool cache = true;
  bool hierarchical = true;
  bool settled = false;  // the search is over: this is the choice
};

class Autotuner {
 public:
  Autotuner(const Config& config, const TunedSettings& start, bool can_tune_hierarchical);
  ~Autotuner();

  // An allreduce of `bytes` ran for tensor `name`, as the cycle at `now` (s) ended.
  void executed(const std::string& name, size_t bytes, double now);
  // The setting every rank should switch to, when it is time for another.
  bool next(TunedSettings* out);

 private:
  struct Dimension {
    const char* name;
    int kind;
    std::vector<double> values;  // tried in turn, each with the best of the others
    bool first_in_force;         // values[0] is in force when the search gets here
  };
  void sample_done(double score);
  void log(const TunedSettings& s, double score, const char* note);

  std::vector<Dimension> dimensions_;
  size_t dimension_ = 0, candidate_ = 0;
  std::vector<double> scores_;            // scored samples of the current candidate
  std::vector<double> candidate_scores_;  // mean score of each candidate of the dimension
  TunedSettings best_, current_;
  bool changed_ = false;
  int warmup_left_ = 0;
  int warmup_samples_, scored_samples_, steps_per_sample_;
  // The sample under way.
  std::unordered_set<std::string> seen_this_step_;
  int steps_ = 0;
  uint64_t bytes_ = 0;
  double sample_start_ = -1;
  int sample_number_ = 0;
  std::FILE* log_ = nullptr;
};

}  // namespace unison
