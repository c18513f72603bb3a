"""Adasum in the core (vector halving, distance doubling) against the way
unison.torch did it before: allgather every rank's whole gradient and
combine the parts on every rank. A Sum allreduce of the same tensor is the
floor. The three run in alternating blocks in the same processes, so they
see the same machine noise; each figure is the median over blocks, and
rank 0 prints the table and the ratios.

    unisonrun -np 2 python benchmarks/adasum.py
    unisonrun -np 4 python benchmarks/adasum.py
"""
import argparse
import statistics

import numpy as np

import unison
import unison.numpy as unp
from timing import agree, timed

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

SIZES = [("64 KiB", 64 << 10), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20)]


def adasum_pair(a, b):
    dot, aa, bb = a @ b, a @ a, b @ b
    return (1 - dot / (2 * aa) if aa > 0 else 1.0) * a + (1 - dot / (2 * bb) if bb > 0 else 1.0) * b


def gathered_adasum(x, name):
    """The old way: every rank receives (size - 1) whole gradients."""
    parts = list(unp.allgather(x.reshape(1, -1), name=name).astype(np.float64))
    p = 1
    while p * 2 <= len(parts):
        p *= 2
    for r in range(p, len(parts)):
        parts[r - p] = adasum_pair(parts[r - p], parts[r])
    level = parts[:p]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0].astype(x.dtype)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=7)
    args = parser.parse_args()
    unison.init()
    rng = np.random.default_rng(unison.rank())
    rows = []
    for label, nbytes in SIZES:
        x = rng.standard_normal(nbytes // 4).astype(np.float32)
        # The two Adasums agree before either is timed.
        ours = unp.allreduce(x, op=unison.Adasum, name="bench.check.core")
        theirs = gathered_adasum(x, "bench.check.gathered")
        np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-4)
        iterations = max(3, (8 << 20) // nbytes)
        variants = {
            "sum": lambda: unp.allreduce(x, op=unison.Sum, name="bench.sum"),
            "core": lambda: unp.allreduce(x, op=unison.Adasum, name="bench.core"),
            "gathered": lambda: gathered_adasum(x, "bench.gathered"),
        }
        times = {k: [] for k in variants}
        for _ in range(args.blocks):
            for key, fn in variants.items():
                fn()
                times[key].append(agree(timed(fn, iterations)))
        rows.append((label, {k: statistics.median(v) for k, v in times.items()}))
    if unison.rank() == 0:
        print("Adasum, float32, %d ranks (median of %d blocks)" % (unison.size(), args.blocks))
        print("| size | Sum allreduce | Adasum in the core | allgather + combine | core / Sum | gathered / core |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, t in rows:
            print("| %s | %.2f ms | %.2f ms | %.2f ms | %.2fx | %.2fx |" % (
                label, t["sum"] * 1e3, t["core"] * 1e3, t["gathered"] * 1e3, t["core"] / t["sum"],
                t["gathered"] / t["core"]))
    unison.shutdown()


if __name__ == "__main__":
    main()
