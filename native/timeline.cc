#include "timeline.h"

#include <cerrno>
#include <chrono>
#include <cstring>

#include "private_file.h"
#include "unison.h"

namespace unison {
namespace {

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

thread_local Timeline* current_timeline = nullptr;
thread_local const std::string* current_row = nullptr;

}  // namespace

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += (char)c;
    } else if (c < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
      out += escaped;
    } else {
      out += (char)c;
    }
  }
  return out + "\"";
}

Status Timeline::start(const std::string& path, bool mark_cycles) {
  stop();
  std::string why;
  std::FILE* file = create_private_file(path, &why);
  if (file == nullptr)
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: cannot write the timeline to '" + path + "': " + why);
  std::lock_guard<std::mutex> lock(mutex_);
  file_ = file;
  std::fputs("[\n", file_);
  std::fflush(file_);
  mark_cycles_.store(mark_cycles, std::memory_order_relaxed);
  first_event_ = true;
  stopping_ = false;
  pending_.clear();
  rows_.clear();
  arrivals_.clear();
  origin_ns_.store(steady_ns(), std::memory_order_relaxed);
  writer_ = std::thread([this] { write_loop(); });
  active_.store(true);
  return Status::OK();
}

void Timeline::stop() {
  if (!active_.exchange(false)) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  writer_.join();
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

void Timeline::write_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stopping_; });
    std::string batch;
    batch.swap(pending_);
    const bool last = stopping_;
    lock.unlock();
    // Written outside the lock: recording never waits for the disk.
    if (!batch.empty()) {
      std::fwrite(batch.data(), 1, batch.size(), file_);
      std::fflush(file_);
    }
    lock.lock();
    if (last && pending_.empty()) return;
  }
}

int64_t Timeline::now_us() const { return (steady_ns() - origin_ns_.load(std::memory_order_relaxed)) / 1000; }

void Timeline::append(const std::string& event) {
  // Each event after the first starts with the comma that separates it from
  // the one before, so the file is valid JSON but for the closing bracket.
  if (!first_event_) pending_ += ",\n";
  first_event_ = false;
  pending_ += event;
}

int Timeline::row_of(const std::string& tensor) {
  auto [it, fresh] = rows_.try_emplace(tensor, (int)rows_.size() + 1);
  if (fresh)
    append("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" + std::to_string(it->second) +
           ",\"args\":{\"name\":" + json_string(tensor) + "}}");
  return it->second;
}

void Timeline::begin(const std::string& tensor, const std::string& phase, const std::string& args) {
  if (active()) edge(tensor, phase, 'B', args);
}

void Timeline::end(const std::string& tensor, const std::string& phase, const std::string& args) {
  if (active()) edge(tensor, phase, 'E', args);
}

void Timeline::edge(const std::string& tensor, const std::string& phase, char kind, const std::string& args) {
  const int64_t ts = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  const int row = row_of(tensor);
  append("{\"name\":" + json_string(phase) + ",\"ph\":\"" + kind + "\",\"ts\":" + std::to_string(ts) +
         ",\"pid\":0,\"tid\":" + std::to_string(row) + (args.empty() ? "" : ",\"args\":{" + args + "}") + "}");
}

void Timeline::cycle_marker() {
  if (!marking_cycles()) return;
  const int64_t ts = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  append("{\"name\":\"CYCLE_START\",\"ph\":\"i\",\"s\":\"t\",\"ts\":" + std::to_string(ts) + ",\"pid\":0,\"tid\":" +
         std::to_string(row_of("cycles")) + "}");
}

void Timeline::arrived(const std::string& tensor, int rank, uint64_t cycle) {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  arrivals_[tensor].try_emplace(rank, cycle);
}

std::string Timeline::waited_for(const std::string& tensor) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = arrivals_.find(tensor);
  if (it == arrivals_.end()) return "[]";
  uint64_t first = UINT64_MAX, last = 0;
  for (const auto& [rank, cycle] : it->second) first = std::min(first, cycle), last = std::max(last, cycle);
  std::string ranks;
  if (last > first)
    for (const auto& [rank, cycle] : it->second)
      if (cycle == last) ranks += (ranks.empty() ? "" : ",") + std::to_string(rank);
  arrivals_.erase(it);
  return "[" + ranks + "]";
}

void set_timeline_group(Timeline* timeline, const std::string* row) {
  current_timeline = timeline != nullptr && timeline->active() && row != nullptr ? timeline : nullptr;
  current_row = row;
}

TimelinePhase::TimelinePhase(const char* phase) : phase_(phase), recording_(current_timeline != nullptr) {
  if (recording_) current_timeline->begin(*current_row, phase_);
}

TimelinePhase::~TimelinePhase() {
  if (recording_) current_timeline->end(*current_row, phase_);
}

}  // namespace unison
