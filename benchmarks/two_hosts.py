"""Allreduce across two hosts on one machine: TCP, MPI and gloo side by side.

    sudo python benchmarks/two_hosts.py [--ranks-per-host 2] [--blocks 5]

Makes two network namespaces joined by a veth pair (as tests/conftest.py's
two_namespaces does), so that every byte between the two hosts crosses a
real interface, and starts benchmarks/allreduce.py --tcp-and-mpi on both
through MPICH's mpirun (Hydra). Needs root, iproute2, an MPICH mpirun (the
`mpich` wheel), unison built with MPI, and torch, all in this Python.
MPICH is told to use TCP on the veth (MPIR_CVAR_NOLOCAL and libfabric's tcp
provider), gloo to use the veth (GLOO_SOCKET_IFNAME), and unison's TCP
backend finds it by itself (the interface that reaches rank 0).
"""
import argparse
import os
import random
import subprocess
import sys
import uuid

from unison.runner import mpi as mpi_run

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    tag = uuid.uuid4().hex[:6]
    names = ["ub%sa" % tag, "ub%sb" % tag]
    subnet = 10 + int(tag[:2], 16) % 200
    addresses = ["10.78.%d.%d" % (subnet, i + 1) for i in range(2)]
    steps = [["netns", "add", names[0]], ["netns", "add", names[1]],
             ["link", "add", "w%sa" % tag, "type", "veth", "peer", "name", "w%sb" % tag]]
    for i, name in enumerate(names):
        end = "w%s%s" % (tag, "ab"[i])
        steps += [["link", "set", end, "netns", name], ["-n", name, "link", "set", end, "name", "uveth"],
                  ["-n", name, "addr", "add", addresses[i] + "/24", "dev", "uveth"],
                  ["-n", name, "link", "set", "uveth", "up"], ["-n", name, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(["ip"] + step, check=True)
        mpirun = mpi_run.find_mpirun()
        command = [mpirun]
        for i, name in enumerate(names):
            if i:
                command.append(":")
            command += ["-n", str(args.ranks_per_host), "-env", "UNISON_HOSTNAME", "host%d" % i, "ip", "netns",
                        "exec", name, sys.executable, os.path.join(HERE, "allreduce.py"), "--tcp-and-mpi",
                        "--blocks", str(args.blocks)]
        env = dict(os.environ, MPIR_CVAR_NOLOCAL="1", MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp",
                   FI_TCP_IFACE="uveth", GLOO_SOCKET_IFNAME="uveth", OMP_NUM_THREADS="1",
                   BENCH_GLOO_ADDR=addresses[0], BENCH_GLOO_PORT=str(random.randint(20000, 30000)),
                   BENCH_RENDEZVOUS_ADDR=addresses[0], BENCH_RENDEZVOUS_PORT=str(random.randint(30000, 40000)),
                   UNISON_SECRET_KEY=uuid.uuid4().hex, UNISON_JOB_ID="bench" + tag)
        return subprocess.run(command, env=env).returncode
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


if __name__ == "__main__":
    sys.exit(main())
