"""A job in which one rank is killed, from outside, at a random moment of a
random stream of every collective: fused and ring allreduces, allgathers,
broadcasts, alltoalls, reducescatters and barriers. Each survivor ends on
its first error, as a training script does, and says which it was.

    python killed_at_random.py SEED VICTIM DELAY   (under unisonrun)

Used by test_tcp.py and benchmarks/fault_injection.py --any-moment.
"""
import os
import random
import subprocess
import sys
import time

import numpy as np

import unison
import unison.numpy as unp

seed, victim, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
unison.init()
me, n = unison.rank(), unison.size()
rng = random.Random(seed)  # the same stream of ops on every rank
if me == victim:  # from outside: the kill lands anywhere, the GIL held or not
    subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(%f); print('killed at %%.3f' %% time.time(), "
                      "flush=True); os.kill(%d, 9)" % (delay, os.getpid())])
start = time.monotonic()
try:
    while True:
        kind = rng.choice(["fused", "ring", "allgather", "broadcast", "alltoall", "reducescatter", "barrier"])
        if kind == "fused":
            handles = [unp.allreduce_async(np.ones(rng.choice([10, 1000, 50_000]), np.float32), name="f%d" % i)
                       for i in range(rng.randint(1, 8))]
            for h in handles:
                unp.synchronize(h)
        elif kind == "ring":
            unp.allreduce(np.ones(rng.choice([1 << 18, 1 << 21]), np.float32), name="ring", op=unison.Sum)
        elif kind == "allgather":
            unp.allgather(np.ones((me + 1, 100), np.float32), name="gather")
        elif kind == "broadcast":
            unp.broadcast(np.ones(rng.choice([10, 1 << 20]), np.float32), root_rank=rng.randrange(n), name="bcast")
        elif kind == "alltoall":
            unp.alltoall(np.ones(n * 1000, np.float32), name="a2a")
        elif kind == "reducescatter":
            unp.reducescatter(np.ones(n * 5000, np.float32), name="rs")
        else:
            unp.barrier()
except unison.UnisonError as e:
    print("survivor %d at %.3f, after %.2f s: %s: %s" % (me, time.time(), time.monotonic() - start, type(e).__name__, e),
          flush=True)
    sys.exit(17)
