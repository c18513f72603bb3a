"""Every way the suite lays a job's ranks out, in one table: the backend x
ranks axis of the multi-rank tests.

A row is how unisonrun is told to start the ranks (the launcher's options
beside -np, perhaps a hostfile and variables), which hosts that makes (ranks per host,
in order; several hosts are simulated on this machine as localhost,
127.0.0.1, 127.0.0.2 or with --simulate-hosts) and the backend the ranks
must then report. The suites pick rows from it by name: test_tcp.py and
test_mpi.py run every core suite on theirs, sanitized_suites.py runs the
numpy suites on some under the sanitizers, and test_parallel.py's device
layouts put a GPU plane on top of a row. test_layouts.py runs one identity
test over every row, so a row that starts its ranks wrongly fails there
first, whatever suite would have used it.
"""
import collections
import os

Layout = collections.namedtuple("Layout", "launcher hosts backend env hostfile")


def _row(launcher, hosts, backend, env=None, hostfile=None):
    return Layout(launcher, hosts, backend, env or {}, hostfile)


LAYOUTS = {
    # One process: the null backend.
    "solo-np1": _row([], [1], "solo"),
    # One host: shared memory.
    "shm-np2": _row([], [2], "shm"),
    "shm-np3": _row([], [3], "shm"),
    "shm-np4": _row([], [4], "shm"),
    # Across hosts without MPI (unisonrun -H): TCP between them, shared
    # memory within a host and TCP across it when hosts have several ranks
    # (hierarchical) unless flat is asked for.
    "tcp-1+1": _row(["-H", "localhost:1,127.0.0.1:1"], [1, 1], "tcp"),
    "tcp-1+1+1": _row(["-H", "localhost:1,127.0.0.1:1,127.0.0.2:1"], [1, 1, 1], "tcp"),
    "tcp-2+1": _row(["-H", "localhost:2,127.0.0.1:1"], [2, 1], "tcp"),
    "tcp-2x2": _row(["-H", "localhost:2,127.0.0.1:2"], [2, 2], "hierarchical"),
    "tcp-2x2-flat": _row(["-H", "localhost:2,127.0.0.1:2", "--no-hierarchical-allreduce"], [2, 2], "tcp"),
    # The same hosts from a hostfile, in both of its spellings.
    "tcp-2x2-hostfile": _row(["--hostfile", "{hostfile}"], [2, 2], "hierarchical",
                             hostfile="localhost slots=2\n127.0.0.1:2\n"),
    # Under MPI: flat MPI on one host, and across hosts that --simulate-hosts
    # makes, hierarchical (shared memory within a host) by default; flat and
    # hierarchical as the launcher's options and Horovod's variable ask.
    "mpi-np2": _row(["--mpi", "--no-hierarchical-allreduce"], [2], "mpi"),
    "mpi-np3": _row(["--mpi", "--no-hierarchical-allreduce"], [3], "mpi"),
    "mpi-2x2": _row(["--simulate-hosts", "2"], [2, 2], "hierarchical"),
    "mpi-2x2-flat": _row(["--simulate-hosts", "2", "--no-hierarchical-allreduce"], [2, 2], "mpi"),
    "mpi-2x2-hierarchical": _row(["--simulate-hosts", "2", "--hierarchical-allreduce"], [2, 2], "hierarchical"),
    "mpi-2x2-horovod-flat": _row(["--simulate-hosts", "2"], [2, 2], "mpi",
                                 env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}),
}


def needs_mpi(name):
    return name.startswith("mpi-")


def ranks(name):
    return sum(LAYOUTS[name].hosts)


def identity(name):
    """What each rank of the row must report, by rank: rank, local rank,
    local size, cross rank, cross size, homogeneous. Ranks fill hosts in
    order; cross group l holds local rank l of every host that has one."""
    hosts = LAYOUTS[name].hosts
    homogeneous = int(len(set(hosts)) == 1)
    who = []
    for host, count in enumerate(hosts):
        for local in range(count):
            peers = [h for h, c in enumerate(hosts) if c > local]  # hosts with a local rank `local`
            who.append([len(who), local, count, peers.index(host), len(peers), homogeneous])
    return who


def without_mpi(env):
    """`env` with every directory that holds an mpirun off PATH: a job
    started with -H must need no MPI."""
    path = [d for d in env.get("PATH", "").split(os.pathsep) if not os.path.exists(os.path.join(d, "mpirun"))]
    return dict(env, PATH=os.pathsep.join(path))


def options(name):
    """unisonrun's options for the row, -np first."""
    return ["-np", str(ranks(name))] + LAYOUTS[name].launcher


def launch(name, directory):
    """The row's launcher options and base environment, its hostfile
    written into `directory` where it has one."""
    layout = LAYOUTS[name]
    command_line = options(name)
    if layout.hostfile is not None:
        path = os.path.join(str(directory), "hostfile")
        with open(path, "w") as f:
            f.write(layout.hostfile)
        command_line = [path if o == "{hostfile}" else o for o in command_line]
    base = dict(os.environ, **layout.env)
    return command_line, base if needs_mpi(name) else without_mpi(base)
