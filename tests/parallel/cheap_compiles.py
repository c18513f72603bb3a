"""Dynamo's work at each compile that no test here reads, switched off for
the torch suites that compile (a grid test compiles each collective anew,
so the grid pays these some 550 times a rank). Measured on the 2-core VM,
the compiled grid on one rank went from 41 s to 26 s. What is traced,
guarded and checked is unchanged: these are Dynamo's reports about it.

- After building a frame's guards, Dynamo times one evaluation of them
  behind a flush of the CPU's caches, for a metric (21 ms a compile).
- Dynamo's structured trace (tlparse's input) is formatted at every step
  whenever its logger has a handler. The logger does not propagate, so
  pytest's log capture attaches its own handlers to it directly; letting
  it propagate instead leaves it none, and the records are never built.
- Each mutation of a Python object in a compiled region is formatted with
  its stack, for a debug log ("info" policy); "silent" still replays the
  mutation and skips the message.
- After each compile Dynamo collects the young generations (gc.collect(1))
  to free the trace's reference cycles at once; Python's own collector
  frees them soon after. The compiled grid on one rank: 20.2 s, 18.5 s
  without."""
import logging

import torch
import torch._dynamo
import torch._dynamo.guards


def make_compiles_cheaper():
    torch._dynamo.guards.profile_guard_manager = lambda *args: 0.0
    trace = logging.getLogger("torch.__trace")
    trace.handlers.clear()
    trace.propagate = True
    torch._dynamo.config.side_effect_replay_policy = "silent"
    torch._dynamo.config.run_gc_after_compile = False
