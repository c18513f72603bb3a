"""Allreduce by dtype: float32, float16 and bfloat16, unison against
torch.distributed (gloo), side by side.

    unisonrun -np 2 python benchmarks/dtypes.py

The same element counts in each dtype, in place, Sum, timed in alternating
blocks like allreduce.py. Sending gradients as float16 (Horovod's
Compression.fp16) only pays where a 16-bit allreduce takes less time than
a 32-bit one of the same count: the table's last column says whether it
does, for unison and for gloo.
"""
import argparse

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

import unison
import unison.numpy as unp
from allreduce import compare, iterations_for, setup_gloo

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

COUNTS = [("256 Ki", 1 << 18), ("4 Mi", 1 << 22), ("16 Mi", 1 << 24)]
DTYPES = [("float32", np.float32, torch.float32), ("float16", np.float16, torch.float16),
          ("bfloat16", ml_dtypes.bfloat16, torch.bfloat16)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    unison.init()
    setup_gloo()
    rank = unison.rank()
    if rank == 0:
        print("allreduce by dtype, %d ranks, in place, Sum, median of %d alternating blocks"
              % (unison.size(), args.blocks))
        print()
        print("| elements | dtype | unison | gloo | unison / gloo speed | unison, time / float32's | "
              "gloo, time / float32's |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, count in COUNTS:
        float32 = None
        for name, np_dtype, torch_dtype in DTYPES:
            x = np.ones(count, dtype=np_dtype)
            t = torch.ones(count, dtype=torch_dtype)
            fns = [(lambda: unp.allreduce_(x, op=unison.Sum, name="bench.dtype.%s.%d" % (name, count)),
                    unp.barrier),
                   (lambda: dist.all_reduce(t), dist.barrier)]
            measured = compare(fns, iterations_for(count * x.itemsize), args.blocks)
            float32 = float32 or measured
            if rank == 0:
                print("| %s | %s | %.1f us | %.1f us | %.2fx | %.2f | %.2f |"
                      % (label, name, measured[0] * 1e6, measured[1] * 1e6, measured[1] / measured[0],
                         measured[0] / float32[0], measured[1] / float32[1]), flush=True)
    dist.destroy_process_group()
    unison.shutdown()


if __name__ == "__main__":
    main()
