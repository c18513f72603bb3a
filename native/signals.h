// signals.h: keeping the core's threads out of signal delivery.
//
// Python runs signal handlers on its main thread, but the kernel may hand a
// process-directed signal (SIGINT, SIGTERM, ...) to any thread that does not
// block it. If it lands on a thread the core started (the engine, or one an
// MPI library starts during MPI_Init), Python only sets a flag, and a main
// thread asleep in time.sleep() or a wait is not woken: a rank told to stop
// carries on until that call returns by itself. Threads inherit the signal
// mask of the thread that creates them, so the core creates its threads
// with every asynchronous signal blocked. The faults a bug raises (SIGSEGV,
// SIGBUS, ...) go to the thread that caused them and stay open.
#pragma once

#include <signal.h>

namespace unison {

// Blocks the asynchronous signals in this thread for its lifetime, then
// restores the previous mask.
class AsyncSignalsBlocked {
 public:
  AsyncSignalsBlocked() {
    sigset_t all;
    sigfillset(&all);
    for (int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT}) sigdelset(&all, fault);
    pthread_sigmask(SIG_BLOCK, &all, &previous_);
  }
  ~AsyncSignalsBlocked() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  AsyncSignalsBlocked(const AsyncSignalsBlocked&) = delete;
  AsyncSignalsBlocked& operator=(const AsyncSignalsBlocked&) = delete;

 private:
  sigset_t previous_;
};

}  // namespace unison
