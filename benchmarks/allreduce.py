"""Allreduce: unison against torch.distributed (gloo) and MPICH, side by side.

    unisonrun -np 2 python benchmarks/allreduce.py      (unison and gloo)
    mpirun -np 2 python benchmarks/allreduce.py         (and MPICH: `pip install mpich`, then `pip install mpi4py`)
    unisonrun -np 4 --simulate-hosts 2 python benchmarks/allreduce.py --mpi-layouts
    sudo python benchmarks/two_hosts.py            (--tcp-and-mpi, in two network namespaces)

Every rank joins both a unison job and a gloo process group, and the two
are timed in alternating blocks in the same processes, so both see the same
machine noise; each figure is the median over blocks. Rank 0 prints the
table, the ratios and whether the targets of the core's issue are met.

Started by MPICH's mpirun (`pip install mpich mpi4py` puts both in the
environment), the script adds an MPICH column: `MPI_Allreduce` through
mpi4py, in place, in the same alternating blocks. unison is then told its
identity in UNISON_* variables, so it runs the same shared-memory data
plane as under unisonrun rather than starting through MPI.

With --mpi-layouts (a job started through mpirun, e.g. on simulated hosts)
the unison columns are the two MPI layouts, hierarchical (shared memory
within hosts, MPI across) and flat (MPI between every pair): the processes
shut unison down and start it again in the other layout before every block,
so the two layouts and gloo alternate as well.

With --tcp-and-mpi (started by benchmarks/two_hosts.py: mpirun across two
network namespaces, so every byte between hosts crosses a veth pair) the
columns are TCP and MPI, each hierarchical (shared memory within hosts) and
flat, and gloo, alternating the same way: a TCP block hides mpirun's
identity from unison and names the rendezvous instead.
"""
import argparse
import hashlib
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import unison
import unison.numpy as unp
from timing import agree, core_allreduces, timed

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

SIZES = [("4 KiB", 4 << 10), ("64 KiB", 64 << 10), ("256 KiB", 256 << 10), ("1 MiB", 1 << 20), ("4 MiB", 4 << 20),
         ("16 MiB", 16 << 20), ("64 MiB", 64 << 20)]


def mpich_communicator():
    """MPICH's COMM_WORLD when this job was started by MPICH's mpirun, with
    unison's identity set from it (see the top of the file); else None."""
    if "PMI_RANK" not in os.environ or "--mpi-layouts" in sys.argv or "--tcp-and-mpi" in sys.argv:
        return None
    from mpi4py import MPI  # initialises MPI, from the PMI variables

    comm = MPI.COMM_WORLD
    os.environ.update(UNISON_RANK=str(comm.Get_rank()), UNISON_SIZE=str(comm.Get_size()),
                      UNISON_LOCAL_RANK=str(comm.Get_rank()), UNISON_LOCAL_SIZE=str(comm.Get_size()),
                      UNISON_JOB_ID="bench-%d" % comm.bcast(os.getpid(), root=0))
    return comm


def setup_gloo():
    job = os.environ.get("UNISON_JOB_ID")
    if job is None:  # started by mpirun: rank 0 picks the port
        job = str(int(unp.broadcast(np.array([os.getpid()]), root_rank=0, name="bench.port")[0]))
    port = os.environ.get("BENCH_GLOO_PORT") or str(20000 + int(hashlib.md5(job.encode()).hexdigest(), 16) % 20000)
    address = os.environ.get("BENCH_GLOO_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method="tcp://%s:%s" % (address, port), rank=unison.rank(),
                            world_size=unison.size())


def compare(fns, iterations, blocks):
    """fns: (function, barrier) per library. Each library's median time a
    call, timed in blocks that take turns."""
    for fn, _ in fns:
        fn()  # warm-up: buffers, caches, negotiation cache
    times = [[] for _ in fns]
    for _ in range(blocks):
        for (fn, barrier), samples in zip(fns, times):
            # One untimed call first in every block: the block before was
            # another library's, and the first call after it pays for
            # caches it evicted and threads the host descheduled.
            barrier()
            fn()
            samples.append(agree(timed(fn, iterations)))
    return [statistics.median(t) for t in times]


def alternate(fns, iterations, blocks):
    """Times unison functions in alternating blocks, each block starting with
    one untimed call, like compare() but without gloo in between: a ratio
    of two unison figures then compares like with like. Timed in rotations
    with gloo, each would follow a different gloo workload, and whichever
    followed gloo's 200 tensors ran up to twice as slowly. (Alternating call
    by call would be unfair the other way: the large allreduce would always
    find its buffer evicted by the 200 small ones.)"""
    times = [[] for _ in fns]
    for _ in range(blocks):
        for fn, samples in zip(fns, times):
            unp.barrier()
            fn()
            samples.append(agree(timed(fn, iterations)))
    return [statistics.median(t) for t in times]


def torch_paths(tensors, one_large, blocks, say):
    """The 200 small tensors from unison.torch, each started by
    allreduce_async_ as a gradient's hook starts it, and all in one
    grouped_allreduce_async_, through the compiled path
    (torch_adapter/fast_path.cc) and through the Python path, in
    alternating blocks with one large allreduce of the same bytes. Prints
    both and returns the compiled path's start per tensor and its grouped
    200 against the one large (None where it is not in use)."""
    import unison.torch as hvd
    from unison import adapter_extension, handles
    from unison.torch import ops
    count = len(tensors)
    # The compiled path: its starter (ops._fast, the front end's fast) and
    # its waiter of grouped handles (handles._group_waiter).
    compiled = (ops._fast, ops._front.fast, handles._group_waiter)
    paths = {"compiled": compiled, "Python": (None, None, None),
             "members": (ops._fast, _MemberByMember(ops._front.fast), None)}

    def take(label):
        ops._fast, ops._front.fast, handles._group_waiter = paths[label]
    starts = {"compiled": [], "Python": []}   # the start per tensor, of the two paths that start singles

    def many(label):
        names = ["bench.torch.%s.%d" % (label, i) for i in range(count)]

        def run():
            take(label)
            started = time.perf_counter()
            handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(tensors, names)]
            starts[label].append(time.perf_counter() - started)
            for h in handles:
                hvd.synchronize(h)
        return run

    def grouped(label):
        def run():
            take(label)
            hvd.synchronize(hvd.grouped_allreduce_async_(tensors, name="bench.torch.group." + label, op=hvd.Sum))
        return run

    say()
    if compiled[0] is None:
        say("unison.torch's compiled path is not in use: %s" % adapter_extension.ACTIVE.get("PyTorch"))
        return None
    try:
        fast, python, fast_grouped, python_grouped, members_grouped, one = alternate(
            [many("compiled"), many("Python"), grouped("compiled"), grouped("Python"), grouped("members"), one_large],
            10, blocks)
    finally:
        take("compiled")
    start = {label: statistics.median(samples) / count for label, samples in starts.items()}
    say("200 x 40 KB from unison.torch, against one 8 MB allreduce (%.2f ms): allreduce_async_ a tensor (a "
        "gradient hook's call), and grouped_allreduce_async_ of the 200:" % (one * 1e3))
    say("| path | 200 x allreduce_async_ | / one 8 MB | starting one tensor's allreduce | grouped | / one 8 MB |")
    say("| --- | --- | --- | --- | --- | --- |")
    for label, total, group in (("compiled (fast_path.cc)", fast, fast_grouped), ("Python", python, python_grouped)):
        say("| %s | %.2f ms | %.2fx | %.2f us | %.2f ms | %.2fx |" % (
            label, total * 1e3, total / one, start[label.split()[0]] * 1e6, group * 1e3, group / one))
    say("compiled / Python: %.2fx the time for the 200, %.2fx the start of one, %.2fx grouped"
        % (fast / python, start["compiled"] / start["Python"], fast_grouped / python_grouped))
    say("200 x 40 KB grouped through the compiled starter one call a member, without its group calls "
        "(allreduce_many_, synchronize_many): %.2f ms, %.2fx one 8 MB; with them %.2fx the time"
        % (members_grouped * 1e3, members_grouped / one, fast_grouped / members_grouped))
    return start["compiled"], fast_grouped / one


class _MemberByMember:
    """The torch front end's compiled starter without its grouped call
    (allreduce_many_): a group's members then start one Python call each,
    as they did before it."""

    def __init__(self, fast):
        # Its functions as plain attributes: a lookup costs what the module's does.
        for name in dir(fast):
            if not name.startswith("__") and name != "allreduce_many_":
                setattr(self, name, getattr(fast, name))


def gloo_only(fn, iterations, blocks):
    fn()
    samples = []
    for _ in range(blocks):
        dist.barrier()
        samples.append(agree(timed(fn, iterations)))
    return statistics.median(samples)


def memcpy_bandwidth(nbytes=64 << 20):
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    return nbytes / min(timed(lambda: np.copyto(b, a), 10) for _ in range(5))


def iterations_for(nbytes):
    # At least 10 calls a block: with 3, one slow wake-up of a sleeping
    # thread moved a 16 MiB block's figure by half.
    return max(10, min(2000, int(2e8 // max(nbytes, 1) // 50)))


LAYOUTS = [("hierarchical", "1"), ("flat", "0")]
# Columns: (name, data plane, layout).
MPI_LAYOUTS = [("hierarchical", "mpi", "hierarchical"), ("flat MPI", "mpi", "flat")]
TCP_AND_MPI = [("TCP hierarchical", "tcp", "hierarchical"), ("MPI hierarchical", "mpi", "hierarchical"),
               ("TCP flat", "tcp", "flat"), ("MPI flat", "mpi", "flat")]
TCP_IDENTITY = {"UNISON_RANK": "PMI_RANK", "UNISON_SIZE": "PMI_SIZE"}


def in_layout(layout, fn, plane="mpi"):
    """Runs fn() with unison started in a layout, then stops unison. A TCP
    layout gives unison its identity and rendezvous in UNISON_* variables,
    which take precedence over mpirun's; an MPI layout takes them away."""
    os.environ["UNISON_HIERARCHICAL_ALLREDUCE"] = dict(LAYOUTS)[layout]
    for name, source in TCP_IDENTITY.items():
        if plane == "tcp":
            os.environ[name] = os.environ[source]
        else:
            os.environ.pop(name, None)
    for name in ("UNISON_RENDEZVOUS_ADDR", "UNISON_RENDEZVOUS_PORT"):
        if plane == "tcp":
            os.environ[name] = os.environ["BENCH_" + name[len("UNISON_"):]]
        else:
            os.environ.pop(name, None)
    unison.init()
    try:
        return fn()
    finally:
        unison.shutdown()


def layouts_against_gloo(args, planes):
    """Every layout of `planes` and gloo, every block in each in turn (see
    the top of the file). A job started by mpirun; TCP layouts also need
    BENCH_RENDEZVOUS_ADDR and BENCH_RENDEZVOUS_PORT."""
    torch.set_num_threads(1)
    in_layout("hierarchical", setup_gloo)
    rank, size = dist.get_rank(), dist.get_world_size()
    hosts = in_layout("hierarchical", unison.cross_size)

    def say(line=""):
        if rank == 0:
            print(line, flush=True)

    say("allreduce of float32, %d ranks on %d hosts, median of %d blocks; each block runs every layout and gloo"
        % (size, hosts, args.blocks))
    say()
    say("| size | " + " | ".join(name for name, _, _ in planes) + " | gloo | "
        + " | ".join("%s / gloo speed" % name for name, _, _ in planes) + " |")
    say("|" + " --- |" * (2 + 2 * len(planes)))
    for label, nbytes in SIZES:
        n = nbytes // 4
        x = np.ones(n, dtype=np.float32)
        t = torch.ones(n, dtype=torch.float32)
        iterations = iterations_for(nbytes)
        times = {"gloo": []}

        def unison_block():
            fn = lambda: unp.allreduce_(x, op=unison.Sum, name="bench.%d" % nbytes)  # noqa: E731
            fn()  # warm-up and negotiation cache
            unp.barrier()
            return agree(timed(fn, iterations))

        for _ in range(args.blocks):
            for name, plane, layout in planes:
                times.setdefault(name, []).append(in_layout(layout, unison_block, plane))
            dist.all_reduce(t)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iterations):
                dist.all_reduce(t)
            elapsed = (time.perf_counter() - start) / iterations
            times["gloo"].append(in_layout("hierarchical", lambda: agree(elapsed)))
        medians = {k: statistics.median(v) for k, v in times.items()}
        g = medians["gloo"]
        say("| %s | " % label + " | ".join("%.1f us" % (medians[name] * 1e6) for name, _, _ in planes)
            + " | %.1f us | " % (g * 1e6) + " | ".join("%.2fx" % (g / medians[name]) for name, _, _ in planes)
            + " |")
    dist.destroy_process_group()


def plot_latency(results, libraries, ranks, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [nbytes for _, nbytes in SIZES]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, marker in zip(libraries, "osd"):
        ax.plot(sizes, [results[label][name] * 1e6 for label, _ in SIZES], marker=marker, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [label for label, _ in SIZES])
    ax.set_xlabel("allreduce size (float32, in place, Sum)")
    ax.set_ylabel("latency per allreduce (us)")
    ax.set_title("allreduce latency, %d ranks on one host" % ranks)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path, flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--mpi-layouts", action="store_true",
                        help="compare the hierarchical and flat MPI layouts with gloo (start through mpirun)")
    parser.add_argument("--tcp-and-mpi", action="store_true",
                        help="compare TCP, MPI and gloo across hosts (started by benchmarks/two_hosts.py)")
    parser.add_argument("--plot", metavar="PNG", help="rank 0 renders latency against size to this file (matplotlib)")
    args = parser.parse_args()
    if args.mpi_layouts or args.tcp_and_mpi:
        return layouts_against_gloo(args, TCP_AND_MPI if args.tcp_and_mpi else MPI_LAYOUTS)
    torch.set_num_threads(1)
    comm = mpich_communicator()
    unison.init()
    setup_gloo()
    rank, size = unison.rank(), unison.size()
    report = []

    def say(line=""):
        if rank == 0:
            print(line, flush=True)
            report.append(line)

    copy_bw = memcpy_bandwidth() if rank == 0 else 0.0
    unp.barrier()
    say("allreduce of float32, %d ranks, median of %d alternating blocks" % (size, args.blocks))
    say("single-core memcpy bandwidth (the ceiling): %.2f GB/s" % (copy_bw / 1e9))
    say()
    libraries = ["unison", "gloo"] + (["MPICH"] if comm is not None else [])
    say("| size | " + " | ".join("%s latency" % name for name in libraries) + " | "
        + " | ".join("%s algbw" % name for name in libraries) + " | unison / gloo speed"
        + (" | unison / MPICH speed |" if comm else " |"))
    say("|" + " --- |" * (2 + 2 * len(libraries)))
    results = {}
    for label, nbytes in SIZES:
        n = nbytes // 4
        x = np.ones(n, dtype=np.float32)
        t = torch.ones(n, dtype=torch.float32)
        m = np.ones(n, dtype=np.float32)
        fns = [(lambda: unp.allreduce_(x, op=unison.Sum, name="bench.%d" % nbytes), unp.barrier),
               (lambda: dist.all_reduce(t), dist.barrier)]
        if comm is not None:
            from mpi4py import MPI
            fns.append((lambda: comm.Allreduce(MPI.IN_PLACE, m, op=MPI.SUM), comm.Barrier))
        measured = compare(fns, iterations_for(nbytes), args.blocks)
        results[label] = dict(zip(libraries, measured))
        say("| %s | " % label + " | ".join("%.1f us" % (s * 1e6) for s in measured) + " | "
            + " | ".join("%.2f GB/s" % (nbytes / s / 1e9) for s in measured)
            + " | " + " | ".join("%.2fx" % (s / measured[0]) for s in measured[1:]) + " |")

    # 200 tensors of 40 KB allreduced asynchronously against one allreduce of
    # the same 8 MB: what fusion and negotiation cost per tensor.
    count, each = 200, 40_000 // 4
    small = [np.ones(each, dtype=np.float32) for _ in range(count)]
    names = ["bench.small.%d" % i for i in range(count)]
    big = np.ones(count * each, dtype=np.float32)
    small_t = [torch.ones(each) for _ in range(count)]

    enqueue_seconds = []   # the Python loop that starts the 200, per call of unison_many

    def unison_many():
        started = time.perf_counter()
        handles = [unp.allreduce_async_(a, op=unison.Sum, name=nm) for a, nm in zip(small, names)]
        enqueue_seconds.append(time.perf_counter() - started)
        for h in handles:
            unp.synchronize(h)

    def gloo_many():
        for w in [dist.all_reduce(a, async_op=True) for a in small_t]:
            w.wait()

    # The same 200 through the core's C API alone, with their options filled
    # beforehand: a Python loop of two cffi calls a tensor, unison.h's
    # unison_enqueue and unison_wait_release. The core's share of the case,
    # apart from the front end's per-tensor Python.
    core_run = core_allreduces(small, ["bench.core.%d" % i for i in range(count)])
    core_enqueue_seconds = []   # its loop of enqueues alone, per call

    def core_many():
        core_enqueue_seconds.append(core_run())

    many, core, one = alternate([unison_many, core_many,
                                 lambda: unp.allreduce_(big, op=unison.Sum, name="bench.one")], 10, args.blocks)
    gloo_many_t = gloo_only(gloo_many, 10, args.blocks)
    say()
    say("200 x 40 KB async: unison %.2f ms, gloo %.2f ms; one 8 MB allreduce: unison %.2f ms; "
        "200 small / one large = %.2fx" % (many * 1e3, gloo_many_t * 1e3, one * 1e3, many / one))
    starting = statistics.median(enqueue_seconds)
    say("  of which starting them (allreduce_async_ in a Python loop): %.2f us a tensor" % (starting / count * 1e6))
    say("  the same 200 through the C API alone (the core's share): %.2f ms, %.2fx one large"
        % (core * 1e3, core / one))
    say("  of which the core's enqueue (unison_enqueue from a cffi loop, its options filled beforehand): "
        "%.2f us a tensor, the floor under any front end's start" % (statistics.median(core_enqueue_seconds) / count * 1e6))
    # The 1.5x target leaves half of one large allreduce for everything the
    # 200 cost beyond it; the Python loop that starts them is part of that.
    budget = 0.5 * one
    say("  starting the 200 from Python alone takes %.2f ms, %.2fx the %.2f ms that 1.5x one large leaves "
        "for all their per-tensor work%s" % (starting * 1e3, starting / budget, budget * 1e3,
                                             " (out of reach with a call per tensor)" if starting > budget else ""))

    torch_starts = torch_paths(small_t, lambda: unp.allreduce_(big, op=unison.Sum, name="bench.one"), args.blocks,
                               say)

    say()
    say("targets: 16 and 64 MiB >= 3x gloo bandwidth; 4 KiB <= 1/4 of gloo latency; 200 small within 1.5x "
        "of one large" + ("; 4 and 64 KiB within 2x of MPICH's latency, 1-16 MiB at least level with MPICH, "
                          "64 MiB at least 2x MPICH" if comm else ""))
    speed = lambda label, other: results[label][other] / results[label]["unison"]  # noqa: E731
    checks = [("16 MiB bandwidth", speed("16 MiB", "gloo"), 3.0, "x gloo"),
              ("64 MiB bandwidth", speed("64 MiB", "gloo"), 3.0, "x gloo"),
              ("4 KiB latency", speed("4 KiB", "gloo"), 4.0, "x faster than gloo")]
    if comm is not None:
        checks += [("4 KiB latency", speed("4 KiB", "MPICH"), 0.5, "x MPICH's speed"),
                   ("64 KiB latency", speed("64 KiB", "MPICH"), 0.5, "x MPICH's speed")]
        checks += [("%s bandwidth" % label, speed(label, "MPICH"), 1.0, "x MPICH")
                   for label in ("1 MiB", "4 MiB", "16 MiB")]
        checks += [("64 MiB bandwidth", speed("64 MiB", "MPICH"), 2.0, "x MPICH")]
    for what, value, target, unit in checks:
        verdict = "met" if value >= target else "MISSED by %.0f%%" % (100 * (1 - value / target))
        say("  %s: %.2f%s (target %.1f): %s" % (what, value, unit, target, verdict))
    ratio = many / one
    say("  200 small vs one large: %.2fx (target <= 1.5): %s"
        % (ratio, "met" if ratio <= 1.5 else "MISSED by %.0f%%" % (100 * (ratio / 1.5 - 1))))
    if torch_starts is not None:
        start, grouped_ratio = torch_starts
        say("  starting a torch tensor's in-place allreduce: %.2f us (target <= 1.0): %s"
            % (start * 1e6, "met" if start <= 1e-6 else "MISSED by %.0f%%" % (100 * (start / 1e-6 - 1))))
        say("  200 torch tensors grouped vs one large: %.2fx (target <= 1.5): %s"
            % (grouped_ratio, "met" if grouped_ratio <= 1.5 else
               "MISSED by %.0f%%" % (100 * (grouped_ratio / 1.5 - 1))))
    if args.plot and rank == 0:
        plot_latency(results, libraries, size, args.plot)
    dist.destroy_process_group()
    unison.shutdown()


if __name__ == "__main__":
    main()
