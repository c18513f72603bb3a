#include "liveness.h"

#include <map>
#include <mutex>

namespace unison {
namespace {

// Planes come and go on the engine's thread and init's; waits beat a few
// times a second, so a mutex costs nothing here.
std::mutex mutex;
std::map<int, std::function<void()>> beats;
int next_id = 1;

}  // namespace

int add_beat(std::function<void()> beat) {
  std::lock_guard<std::mutex> lock(mutex);
  beats.emplace(next_id, std::move(beat));
  return next_id++;
}

void remove_beat(int id) {
  std::lock_guard<std::mutex> lock(mutex);
  beats.erase(id);
}

void beat_everywhere() {
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& [id, beat] : beats) beat();
}

}  // namespace unison
