// futex.h: sleeping on a 32-bit word, within a process or across processes
// that map the same memory. The engine and the shared-memory backend wait
// for each other through these words; sleeping in the kernel instead of
// spinning is what keeps an idle rank off the CPU.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

namespace unison {

// Sleeps while *word == expected, at most timeout_seconds. Spurious wake-ups
// are fine: callers re-check their condition in a loop.
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, double timeout_seconds) {
  struct timespec ts;
  ts.tv_sec = (time_t)timeout_seconds;
  ts.tv_nsec = (long)((timeout_seconds - (double)ts.tv_sec) * 1e9);
  // Not FUTEX_PRIVATE_FLAG: the word may live in memory shared with peers.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One step of a spinning wait. `yield_core` (Config::spin_yields_core):
// with more ranks on the host than cores, the rank being waited for may be
// queued for this very core, so the step hands the core over instead of
// holding it. A pause-only spin there made a 4 KiB allreduce at 3 ranks on 2
// cores take 150 us; spinning on sched_yield, 26-50 us; not spinning, 60 us.
inline void spin_step(bool yield_core) {
  if (yield_core)
    sched_yield();
  else
    cpu_relax();
}

inline double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A word that one side bumps and the other sleeps on, counting its sleepers
// so that the bumping side makes a system call only when someone sleeps.
struct Doorbell {
  std::atomic<uint32_t> word{0};
  std::atomic<uint32_t> sleepers{0};

  void ring() {
    word.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&word);
  }
  uint32_t token() const { return word.load(std::memory_order_seq_cst); }
  // Sleeps until ring() after token() returned `token`, or the timeout.
  void sleep(uint32_t token, double timeout_seconds) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (word.load(std::memory_order_seq_cst) == token) futex_wait(&word, token, timeout_seconds);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
};

// Waits until `arrived()` or `timeout_seconds`: spins for `spin_seconds`
// (spin_step), then calls `sleep(pause)` (which may end early) with pauses
// doubling to 1 ms. That bounds what a lone op pays when every other rank is idle, at a
// cost of a thousand wake-ups a second for an idle engine.
template <typename Arrived, typename Sleep>
void poll_with_backoff(Arrived arrived, Sleep sleep, double timeout_seconds, double spin_seconds, bool yield_core) {
  constexpr double kLongestPause = 1e-3;
  const double start = monotonic_seconds();
  double pause = 20e-6;
  for (;;) {
    if (arrived()) return;
    const double waited = monotonic_seconds() - start;
    if (waited >= timeout_seconds) return;
    if (waited < spin_seconds) {
      spin_step(yield_core);
      continue;
    }
    sleep(std::min(pause, timeout_seconds - waited));
    pause = std::min(pause * 2, kLongestPause);
  }
}

}  // namespace unison
