"""unisonrun: start N ranks of a command on this host, or across hosts.

    unisonrun -np 4 python train.py
    python -m unison.run -np 4 python train.py
    unisonrun -np 8 -H host1:4,host2:4 python train.py   (through mpirun: mpi_run.py)

Each rank gets its identity and the job's settings through UNISON_*
environment variables. Output lines are prefixed with the rank. Ctrl-C and
SIGTERM are forwarded to every rank. When a rank fails, the others get a
short grace period to report the failure themselves (their pending
collectives fail with an error naming the dead rank), then are stopped; the
launcher exits non-zero naming the rank and its exit status.
"""
import argparse
import ctypes
import glob
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

PR_SET_PDEATHSIG = 1


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="unisonrun", description="Run a command as N unison ranks, on this host or across hosts.",
        usage="unisonrun -np N [options] command [args...]")
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of ranks")
    p.add_argument("--fusion-threshold-mb", type=float,
                   help="pack ready allreduces into one collective up to this size (default 64)")
    p.add_argument("--cycle-time-ms", type=float,
                   help="minimum time between negotiation cycles; 0 (default) starts one as soon as work arrives")
    p.add_argument("--cache-capacity", type=int, help="response cache entries (default 1024, 0 disables)")
    p.add_argument("--stall-check-warning-time-seconds", type=float,
                   help="warn about tensors some ranks have waited on this long (default 60)")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float,
                   help="fail such tensors after this long (default: never)")
    p.add_argument("--no-stall-check", action="store_true", help="disable the stall inspector")
    p.add_argument("--peer-timeout-seconds", type=float,
                   help="declare a silent (frozen) rank failed after this long (default 10)")
    p.add_argument("--start-timeout", type=float,
                   help="seconds the ranks may take to start and meet (default 60)")
    p.add_argument("--failure-grace-seconds", type=float, default=3.0,
                   help="after a rank fails, how long the others may take to exit on their own (default 3)")
    p.add_argument("--output-filename",
                   help="also write each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--verbose", action="store_true", help="print what the launcher does")
    cluster = p.add_argument_group("across hosts (through mpirun)")
    cluster.add_argument("-H", "--hosts", help="hosts and their slots, e.g. host1:4,host2:4")
    cluster.add_argument("--hostfile", help="a file of `host slots=N` (or `host:N`) lines")
    cluster.add_argument("--mpi", action="store_true",
                         help="start the ranks through mpirun even on this host alone")
    cluster.add_argument("--simulate-hosts", type=int, metavar="K",
                         help="through mpirun, split the ranks of this machine into K hosts (each rank is told "
                              "its host in UNISON_HOSTNAME): the cross-host paths on one machine, for testing")
    cluster.add_argument("--mpi-args", help="more arguments for mpirun, in one string")
    hierarchy = cluster.add_mutually_exclusive_group()
    hierarchy.add_argument("--hierarchical-allreduce", dest="hierarchical", action="store_true", default=None,
                           help="shared memory within each host, MPI across hosts (the default)")
    hierarchy.add_argument("--no-hierarchical-allreduce", dest="hierarchical", action="store_false",
                           help="every byte between ranks over MPI (flat)")
    p.add_argument("--check-build", action="store_true",
                   help="show which frameworks and data planes this install supports, and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = p.parse_args(argv)
    if args.check_build:
        return args
    if args.np is None or args.np < 1:
        p.error("-np N (at least 1) is required")
    if not args.command:
        p.error("a command to run is required")
    return args


def check_build():
    from unison import basics

    def mark(present):
        return "[X]" if present else "[ ]"

    frameworks = [("NumPy", "numpy"), ("PyTorch", "torch"), ("TensorFlow", "tensorflow"), ("MXNet", "mxnet")]
    built = basics.built_backends()
    lines = ["unison v%s:" % __import__("unison").__version__, "", "Available Frameworks:"]
    for label, module in frameworks:
        lines.append("    %s %s" % (mark(importlib.util.find_spec(module) is not None), label))
    lines += ["", "Available Data Planes:",
              "    %s Shared memory (one host)" % mark("shm" in built),
              "    %s MPI (several hosts)" % mark("mpi" in built),
              "    %s NCCL (GPUs)" % mark("nccl" in built)]
    print("\n".join(lines))
    return 0


def _settings(args):
    """UNISON_* variables for the options that were given."""
    env = {}
    if args.fusion_threshold_mb is not None:
        env["UNISON_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["UNISON_CYCLE_TIME"] = str(args.cycle_time_ms)
    if args.cache_capacity is not None:
        env["UNISON_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.stall_check_warning_time_seconds is not None:
        env["UNISON_STALL_CHECK_TIME_SECONDS"] = str(args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env["UNISON_STALL_SHUTDOWN_TIME_SECONDS"] = str(args.stall_check_shutdown_time_seconds)
    if args.no_stall_check:
        env["UNISON_STALL_CHECK_DISABLE"] = "1"
    if args.peer_timeout_seconds is not None:
        env["UNISON_PEER_TIMEOUT_SECONDS"] = str(args.peer_timeout_seconds)
    if args.start_timeout is not None:
        env["UNISON_START_TIMEOUT"] = str(args.start_timeout)
    if args.verbose:
        env["UNISON_LOG_LEVEL"] = "1"
    if args.hierarchical is not None:
        env["UNISON_HIERARCHICAL_ALLREDUCE"] = "1" if args.hierarchical else "0"
    return env


def _through_mpirun(args):
    return bool(args.hosts or args.hostfile or args.mpi or args.simulate_hosts)


def _die_with_parent():
    # A rank must not outlive a launcher that was killed outright.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


def _forward(stream, rank, kind, sink, log_file):
    prefix = ("[%d]<%s>:" % (rank, kind)).encode()
    for line in iter(stream.readline, b""):
        if log_file is not None:
            log_file.write(line)
            log_file.flush()
        sink.buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
        sink.buffer.flush()
    stream.close()


def _describe(code):
    if code < 0:
        try:
            return "was killed by signal %d (%s)" % (-code, signal.Signals(-code).name)
        except ValueError:
            return "was killed by signal %d" % -code
    return "exited with status %d" % code


class Job:
    def __init__(self, args):
        self.args = args
        self.job_id = new_job_id()
        self.procs = []
        self.threads = []
        self.logs = []
        # (rank, exit code) in the order the ranks ended, appended by one
        # waiting thread per rank. Polling all ranks in turn cannot tell which
        # of two ranks that ended between two polls ended first, and the first
        # is the one to blame: the others usually ended because it did.
        self.exits = []
        self.exited = threading.Condition()

    def log(self, message):
        if self.args.verbose:
            print("unisonrun: " + message, file=sys.stderr, flush=True)

    def start(self):
        n = self.args.np
        base = dict(os.environ)
        base.update(_settings(self.args))
        base.setdefault("PYTHONUNBUFFERED", "1")
        # Like torchrun: one OpenMP thread per rank unless told otherwise, so
        # that N ranks do not each spawn a thread per core.
        if n > 1:
            base.setdefault("OMP_NUM_THREADS", "1")
        for rank in range(n):
            env = dict(base)
            env.update({
                "UNISON_RANK": str(rank), "UNISON_SIZE": str(n),
                "UNISON_LOCAL_RANK": str(rank), "UNISON_LOCAL_SIZE": str(n),
                "UNISON_CROSS_RANK": "0", "UNISON_CROSS_SIZE": "1",
                "UNISON_JOB_ID": self.job_id,
            })
            self.log("starting rank %d: %s" % (rank, " ".join(self.args.command)))
            proc = subprocess.Popen(self.args.command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
            self.procs.append(proc)
            waiter = threading.Thread(target=self._await_exit, args=(rank, proc), daemon=True)
            waiter.start()
            for stream, kind, sink in ((proc.stdout, "stdout", sys.stdout), (proc.stderr, "stderr", sys.stderr)):
                log_file = None
                if self.args.output_filename:
                    folder = os.path.join(self.args.output_filename, "rank.%d" % rank)
                    os.makedirs(folder, exist_ok=True)
                    log_file = open(os.path.join(folder, kind), "wb")
                    self.logs.append(log_file)
                t = threading.Thread(target=_forward, args=(stream, rank, kind, sink, log_file), daemon=True)
                t.start()
                self.threads.append(t)

    def _await_exit(self, rank, proc):
        code = proc.wait()
        with self.exited:
            self.exits.append((rank, code))
            self.exited.notify_all()

    def signal_all(self, signum):
        with self.exited:
            ended = {rank for rank, _ in self.exits}
        for rank, proc in enumerate(self.procs):
            if rank not in ended:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def wait(self):
        """Returns the launcher's exit status."""
        failed = None  # (rank, code) of the first rank that ended with an error
        deadline = None
        seen = 0
        while True:
            with self.exited:
                # Short waits, so that Ctrl-C and SIGTERM handlers run.
                self.exited.wait_for(lambda: len(self.exits) > seen, timeout=0.05)
                ended = list(self.exits)
            for rank, code in ended[seen:]:
                if code != 0 and failed is None:
                    failed = (rank, code)
                    deadline = time.monotonic() + self.args.failure_grace_seconds
                    print("unisonrun: rank %d %s; stopping the other ranks" % (rank, _describe(code)),
                          file=sys.stderr, flush=True)
            seen = len(ended)
            if seen == len(self.procs):
                break
            if deadline is not None and time.monotonic() > deadline:
                self.log("grace period over: terminating the remaining ranks")
                self.signal_all(signal.SIGTERM)
                end = time.monotonic() + 5
                while time.monotonic() < end and len(self.exits) < len(self.procs):
                    time.sleep(0.05)
                self.signal_all(signal.SIGKILL)
                deadline = None
        for t in self.threads:
            t.join(timeout=5)
        for f in self.logs:
            f.close()
        self.cleanup()
        if failed is None:
            return 0
        rank, code = failed
        print("unisonrun: job failed: rank %d %s" % (rank, _describe(code)), file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code

    def cleanup(self):
        remove_shared_memory(self.job_id)


def new_job_id():
    return "%d-%s" % (os.getpid(), uuid.uuid4().hex[:8])


def remove_shared_memory(job_id):
    """Ranks unlink their shared memory once all have attached; a crash
    during start-up can still leave a segment of the job behind."""
    for path in glob.glob("/dev/shm/unison-%s-*" % job_id):
        try:
            os.unlink(path)
        except OSError:
            pass


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.check_build:
        return check_build()
    if _through_mpirun(args):
        from unison import mpi_run
        return mpi_run.launch(args, _settings(args))
    job = Job(args)

    def forward(signum, _frame):
        job.log("forwarding signal %d to every rank" % signum)
        job.signal_all(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    job.start()
    return job.wait()


if __name__ == "__main__":
    sys.exit(main())
