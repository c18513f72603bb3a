#include "log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>

namespace unison {
namespace {

std::atomic<int> level_in_force{(int)LogLevel::warning};

}  // namespace

void set_log_level(LogLevel level) { level_in_force.store((int)level); }

void log_message(LogLevel level, const char* format, ...) {
  if ((int)level < level_in_force.load()) return;
  va_list arguments;
  va_start(arguments, format);
  std::vfprintf(stderr, format, arguments);
  va_end(arguments);
  std::fflush(stderr);
}

}  // namespace unison
