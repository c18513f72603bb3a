#include "autotune.h"

#include <algorithm>
#include <numeric>

#include "log.h"
#include "private_file.h"

namespace unison {
namespace {

enum Kind { kFusion, kCycle, kCache, kHierarchical };

// Candidates of each setting, tried in this order after the value in force.
const double kFusionMiB[] = {1, 4, 16, 64, 128};
const double kCycleMs[] = {0, 1, 2.5, 5};

double value_of(const TunedSettings& s, int kind) {
  switch (kind) {
    case kFusion: return (double)s.fusion_threshold_bytes;
    case kCycle: return s.cycle_time_ms;
    case kCache: return s.cache ? 1 : 0;
    default: return s.hierarchical ? 1 : 0;
  }
}

TunedSettings with(TunedSettings s, int kind, double value) {
  switch (kind) {
    case kFusion: s.fusion_threshold_bytes = (uint64_t)value; break;
    case kCycle: s.cycle_time_ms = value; break;
    case kCache: s.cache = value != 0; break;
    default: s.hierarchical = value != 0; break;
  }
  return s;
}

}  // namespace

Autotuner::Autotuner(const Config& config, const TunedSettings& start, bool can_tune_hierarchical)
    : best_(start),
      current_(start),
      warmup_samples_(config.autotune_warmup_samples),
      scored_samples_(std::max(1, config.autotune_samples)),
      steps_per_sample_(std::max(1, config.autotune_steps_per_sample)) {
  // Most settings are measured starting with the value in force. The cache
  // is measured off first, then on again: turning it back on empties it
  // (Engine::switch_cache), so "on" must be scored as it is reached, not as
  // it was before the search turned it off.
  auto add = [&](const char* name, int kind, bool fixed, std::vector<double> values, bool now_last = false) {
    if (fixed) return;
    const double now = value_of(start, kind);
    values.erase(std::remove(values.begin(), values.end(), now), values.end());
    if (now_last)
      values.push_back(now);
    else
      values.insert(values.begin(), now);
    dimensions_.push_back(Dimension{name, kind, values, !now_last});
  };
  std::vector<double> fusion;
  for (double mib : kFusionMiB) fusion.push_back(mib * (1 << 20));
  add("fusion threshold", kFusion, config.fusion_threshold_fixed, fusion);
  add("cycle time", kCycle, config.cycle_time_fixed, std::vector<double>(std::begin(kCycleMs), std::end(kCycleMs)));
  add("cache", kCache, config.cache_fixed || !config.autotune_cache, {1, 0}, /*now_last=*/true);
  add("hierarchical", kHierarchical, config.hierarchical_fixed || !can_tune_hierarchical, {1, 0});
  if (!config.autotune_log.empty()) {
    std::string why;
    log_ = create_private_file(config.autotune_log, &why);
    if (log_ == nullptr)
      log_message(LogLevel::warning,
                  "unison: cannot write the autotune log to '%s' (UNISON_AUTOTUNE_LOG): %s; tuning without it\n",
                  config.autotune_log.c_str(), why.c_str());
    else
      std::fputs("sample,fusion_threshold_bytes,cycle_time_ms,cache,hierarchical,bytes_per_second,note\n", log_);
  }
  warmup_left_ = warmup_samples_;
  if (dimensions_.empty()) {
    // Nothing left to tune: every setting was fixed.
    current_.settled = true;
    changed_ = true;
    log(current_, 0, "chosen (every setting fixed)");
  } else if (!dimensions_[0].first_in_force) {
    current_ = with(best_, dimensions_[0].kind, dimensions_[0].values[0]);
    changed_ = true;
  }
}

Autotuner::~Autotuner() {
  if (log_ != nullptr) std::fclose(log_);
}

void Autotuner::log(const TunedSettings& s, double score, const char* note) {
  if (log_ == nullptr) return;
  std::fprintf(log_, "%d,%llu,%g,%d,%d,%.0f,%s\n", sample_number_, (unsigned long long)s.fusion_threshold_bytes,
               s.cycle_time_ms, s.cache ? 1 : 0, s.hierarchical ? 1 : 0, score, note);
  std::fflush(log_);
}

void Autotuner::executed(const std::string& name, size_t bytes, double now) {
  if (current_.settled) return;
  if (sample_start_ < 0) {
    sample_start_ = now;  // the clock starts at the end of the first cycle
    seen_this_step_.insert(name);
    return;
  }
  if (!seen_this_step_.insert(name).second) {  // a name again: a new step
    seen_this_step_.clear();
    seen_this_step_.insert(name);
    if (++steps_ == steps_per_sample_) {
      const double seconds = now - sample_start_;
      const double score = seconds > 0 ? (double)bytes_ / seconds : 0;
      sample_start_ = now;
      bytes_ = 0;
      steps_ = 0;
      sample_done(score);
    }
  }
  bytes_ += bytes;
}

void Autotuner::sample_done(double score) {
  ++sample_number_;
  if (warmup_left_ > 0) {  // the change landed mid-sample: not a fair one
    --warmup_left_;
    return;
  }
  scores_.push_back(score);
  log(current_, score, "sample");
  if ((int)scores_.size() < scored_samples_) return;
  candidate_scores_.push_back(std::accumulate(scores_.begin(), scores_.end(), 0.0) / scores_.size());
  scores_.clear();
  Dimension& d = dimensions_[dimension_];
  if (++candidate_ < d.values.size()) {
    current_ = with(best_, d.kind, d.values[candidate_]);
    changed_ = true;
    warmup_left_ = warmup_samples_;
    return;
  }
  // Every candidate of this setting measured: keep the best.
  const size_t winner = std::max_element(candidate_scores_.begin(), candidate_scores_.end()) - candidate_scores_.begin();
  const double best_score = candidate_scores_[winner];
  best_ = with(best_, d.kind, d.values[winner]);
  candidate_scores_.clear();
  candidate_ = 0;
  if (++dimension_ < dimensions_.size()) {
    const Dimension& next = dimensions_[dimension_];
    if (next.first_in_force) {
      // Its first candidate is the value in force, just measured as this
      // setting's winner: the score carries over.
      candidate_scores_.push_back(best_score);
      candidate_ = 1;
    }
    current_ = with(best_, next.kind, next.values[candidate_]);
    changed_ = true;
    warmup_left_ = warmup_samples_;
    return;
  }
  current_ = best_;
  current_.settled = true;
  changed_ = true;
  log(current_, best_score, "chosen");
}

bool Autotuner::next(TunedSettings* out) {
  if (!changed_) return false;
  changed_ = false;
  *out = current_;
  return true;
}

}  // namespace unison
