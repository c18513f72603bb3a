// log.h: the core's own messages on stderr, filtered by UNISON_LOG_LEVEL
// (or Horovod's HOROVOD_LOG_LEVEL): trace, debug, info, warning (the
// default), error or fatal, Horovod's names and order.
//
// The core says little: warnings (a stalled tensor, a refused connection,
// a setting it cannot honour) and the error that stops it. So trace, debug
// and info print what warning prints; error silences the warnings, and
// fatal the errors too. An op's failure is never only logged: it reaches
// the caller as an exception either way.
#pragma once

namespace unison {

enum class LogLevel { trace, debug, info, warning, error, fatal };

// The level in force for the process; set once, at init.
void set_log_level(LogLevel level);

// printf-style; a line of its own on stderr, flushed, when `level` is at or
// above the level in force.
void log_message(LogLevel level, const char* format, ...) __attribute__((format(printf, 2, 3)));

}  // namespace unison
