"""The MPI backend and launching through mpirun.

The tox env `mpi` installs MPICH from PyPI and builds the core against it;
these tests run there (and in CI). Where unison was built without MPI they
are skipped, and test_without_mpi_the_error_says_how_to_get_it runs instead.

Layouts on this one machine (the rows mpi-* of tests/layouts.py, except
the namespaces):
  flat, 2 and 3 ranks        every byte over MPI (--no-hierarchical-allreduce)
  2 simulated hosts x 2      hierarchical: shared memory within, MPI across
  2 simulated hosts x 2      flat
  2 network namespaces x 2   hierarchical, with MPI's bytes crossing a veth pair
"""
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import layouts
from jobs import (CORE_SUITES, EXITS, HERE, IDENTITY, KILLED, assert_every_rank_passed, pytest_command, run_job,
                  unisonrun)
from unison import basics
from unison.runner import hosts, mpi as mpi_run

BUILT_WITH_MPI = "mpi" in basics.built_backends()
needs_mpi = pytest.mark.skipif(not BUILT_WITH_MPI, reason="unison was built without MPI; the tox env 'mpi' runs these")

# This file's rows of tests/layouts.py (whose identity test_layouts.py
# checks, the rows that need MPI in this file's tox envs).
UNDER_MPI = ["mpi-np2", "mpi-np3", "mpi-2x2", "mpi-2x2-flat"]


# The MPI libraries' own shared-memory files. Tests here kill ranks on
# purpose, and a killed MPICH or Open MPI process leaves its files in
# /dev/shm under names unison cannot know; each test removes the ones that
# appeared while it ran, so that repeated runs do not fill the machine.
MPI_SHM_PREFIXES = ("mpich_shm_", "sm_segment.", "vader_segment.")


def mpi_shm_files():
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith(MPI_SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def remove_mpi_shm_left_by_the_test():
    before = mpi_shm_files()
    yield
    for name in mpi_shm_files() - before:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


@needs_mpi
# Every core suite in one launch per layout (test_parallel.py says why).
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", UNDER_MPI)
def test_core_suites_under_mpi(layout):
    proc = unisonrun(layouts.options(layout), pytest_command(*CORE_SUITES),
                     env={"UNISON_TEST_EXPECT_BACKEND": layouts.LAYOUTS[layout].backend},
                     timeout=580 * len(CORE_SUITES))
    assert_every_rank_passed(proc, layouts.ranks(layout))


@needs_mpi
@pytest.mark.timeout(120)
def test_plain_mpirun_gives_every_rank_its_identity(tmp_path):
    script = tmp_path / "identity.py"
    script.write_text(IDENTITY)
    mpirun = mpi_run.find_mpirun()
    extra = []
    if mpi_run.mpirun_family(mpirun) == "openmpi":  # 3 ranks on fewer cores, perhaps as root
        extra = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    proc = run_job([mpirun, "-np", "3"] + extra + [sys.executable, str(script)], 100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    who = [[r, r, 3, 0, 1, 1] for r in range(3)]
    for r in range(3):
        assert "rank %d of 3: shm total 6 who %s" % (r, who) in output, output


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_unison_run_through_mpirun(tmp_path, np_):
    """unison.run(..., use_mpi=True): the ranks start through mpirun, and
    each returns what every rank sent it (test_run_function.py's TRAIN)."""
    import test_run_function
    script = tmp_path / "driver.py"
    script.write_text(test_run_function.TRAIN)
    proc = run_job([sys.executable, str(script), "{'num_proc': %d, 'use_mpi': True}" % np_], 100, cwd=str(tmp_path))
    total = np_ * (np_ + 1) / 2
    assert test_run_function.result(proc) == [{"rank": r, "size": np_, "value": total * 2 + 1} for r in range(np_)]


SETTINGS = """
import os, unison
unison.init()
print("rank %d of %d cycle time %s" % (unison.rank(), unison.size(), os.environ.get("UNISON_CYCLE_TIME")))
"""


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", ["-H", "--hostfile"])
def test_hosts_and_settings_reach_every_rank(tmp_path, hosts):
    script = tmp_path / "settings.py"
    script.write_text(SETTINGS)
    if hosts == "-H":
        options = ["-H", "localhost:2"]
    else:
        hostfile = tmp_path / "hosts"
        hostfile.write_text("localhost slots=2\n")
        options = ["--hostfile", str(hostfile)]
    proc = unisonrun(["-np", "2", "--cycle-time-ms", "3"] + options, [sys.executable, str(script)], timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    for r in range(2):
        assert "[%d]<stdout>:rank %d of 2 cycle time 3.0" % (r, r) in output, output


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flat", [False, True], ids=["hierarchical", "flat"])
def test_rank_killed_on_a_simulated_host_ends_the_job(tmp_path, flat):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    start = time.monotonic()
    options = ["-np", "4", "--simulate-hosts", "2"] + (["--no-hierarchical-allreduce"] if flat else [])
    proc = unisonrun(options, [sys.executable, str(script)], timeout=100)
    elapsed = time.monotonic() - start
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, output
    assert "unisonrun: job failed: rank 3 (host " in output and "killed by signal 9" in output, output
    assert elapsed < 30, "the job took %.1f s to end" % elapsed


@needs_mpi
@pytest.mark.timeout(120)
def test_failed_rank_status_is_the_launchers_and_the_others_are_stopped(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    start = time.monotonic()
    proc = unisonrun(["--mpi", "-np", "3"], [sys.executable, str(script)], timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 3, output
    assert "unisonrun: job failed: rank 1 (host " in output and "exited with status 3" in output, output
    assert time.monotonic() - start < 30, output


LEFTOVER = """
import os, sys
# What a rank that crashed while its host's ranks were attaching to shared
# memory leaves behind: a segment under the job's name.
path = "/dev/shm/unison-%s-2-g0" % os.environ["UNISON_JOB_ID"]
open(path, "w").close()
print("left", path, flush=True)
sys.exit(1)
"""


@needs_mpi
@pytest.mark.timeout(120)
def test_a_failed_job_leaves_no_shared_memory(tmp_path):
    script = tmp_path / "leftover.py"
    script.write_text(LEFTOVER)
    proc = unisonrun(["--mpi", "-np", "2"], [sys.executable, str(script)], timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 1, output
    left = re.findall(r"left (\S+)", output)
    assert len(left) == 2, output
    assert not any(os.path.exists(path) for path in left), left


@needs_mpi
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_rank(tmp_path):
    script = tmp_path / "waits.py"
    marker = tmp_path / "started"
    script.write_text("import time, unison, pathlib\nunison.init()\n"
                      "pathlib.Path(%r + str(unison.rank())).touch()\ntime.sleep(60)\n" % str(marker))
    proc = subprocess.Popen([sys.executable, "-m", "unison.run", "-np", "2", "--simulate-hosts", "2",
                             sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(str(marker) + str(r)) for r in range(2)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.1)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0, out.decode()
    assert time.monotonic() - start < 15
    left = subprocess.run(["pgrep", "-f", str(script)], stdout=subprocess.PIPE).stdout.decode().split()
    assert left == [], "ranks still running: %s" % left


LATE_RANK = """
import os, signal, sys, threading, time
import numpy as np
import unison, unison.numpy as unp
rank = int(os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
if rank == 1:
    time.sleep(float(sys.argv[1]))  # the rank that is slow to call init, or never does
    if sys.argv[2] == "never":
        sys.exit(0)
else:
    started = time.monotonic()
    if sys.argv[2] == "interrupted":  # Ctrl-C a second into the wait, long before the start timeout
        os.environ["UNISON_START_TIMEOUT"] = "60"
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job inherits it ignored
        threading.Timer(1, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        unison.init()
    except unison.HorovodInternalError as e:
        print("rank 0 gave up after %.1f s: %s" % (time.monotonic() - started, e), flush=True)
        if sys.argv[2] == "never":
            sys.exit(1)
    except KeyboardInterrupt:
        print("rank 0 interrupted after %.1f s" % (time.monotonic() - started), flush=True)
    os.environ["UNISON_START_TIMEOUT"] = "60"  # the next init waits for the same MPI_Init
unison.init()
print("rank %d sums %s" % (rank, unp.allreduce(np.full(2, rank + 1.0), op=unison.Sum, name="x").tolist()), flush=True)
"""


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank_1", ["never calls init", "calls init late", "calls init late, rank 0 is interrupted"])
def test_a_rank_that_does_not_call_init_is_given_up_at_the_start_timeout(tmp_path, rank_1):
    """MPI_Init waits for every rank inside the MPI library, where no
    timeout of unison's reached it: a rank that never called init() held
    the others there for ever. Now init() gives up after
    UNISON_START_TIMEOUT, or at a Ctrl-C, and a later init() still joins a
    late rank."""
    script = tmp_path / "late.py"
    script.write_text(LATE_RANK)
    never = rank_1 == "never calls init"
    interrupted = rank_1.endswith("interrupted")
    started = time.monotonic()
    proc = unisonrun(["--mpi", "-np", "2"], [sys.executable, str(script), "60" if never else "6",
                                             "never" if never else "interrupted" if interrupted else "late"],
                     env={"UNISON_START_TIMEOUT": "3"}, timeout=100)
    took = time.monotonic() - started
    output = proc.stdout.decode(errors="replace")
    if interrupted:
        stopped = re.search(r"rank 0 interrupted after ([0-9.]+) s\n", output)
        assert stopped and 1 <= float(stopped.group(1)) < 3, output
    else:
        gave_up = re.search(r"rank 0 gave up after ([0-9.]+) s: unison: MPI_Init did not return within 3 s "
                            r"\(UNISON_START_TIMEOUT\): not every rank of the job called init\(\)", output)
        assert gave_up and 3 <= float(gave_up.group(1)) < 6, output
    if never:
        assert proc.returncode == 1, output
        assert took < 40, (took, output)  # mpirun ended rank 1 when rank 0 failed, long before its 60 s
    else:
        assert proc.returncode == 0, output
        assert "rank 0 sums [3.0, 3.0]" in output and "rank 1 sums [3.0, 3.0]" in output, output


@needs_mpi
def test_check_build_lists_mpi():
    proc = unisonrun(["--check-build"], [])
    assert "[X] MPI" in proc.stdout.decode(), proc.stdout.decode()


@needs_mpi
@pytest.mark.timeout(60)
def test_srun_variables_with_an_mpi_that_does_not_know_them():
    # A srun job step whose MPI cannot read SLURM's PMI starts each process as
    # a singleton: the mismatch is named instead of running N separate jobs.
    env = dict(os.environ, SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_STEP_TASKS_PER_NODE="2")
    proc = subprocess.run([sys.executable, "-c", "import unison; unison.init()"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=50)
    assert proc.returncode != 0
    assert "SLURM says this job has 2 ranks but MPI says 1" in proc.stdout.decode(), proc.stdout.decode()


@pytest.mark.skipif(BUILT_WITH_MPI, reason="this unison has MPI; the tox env 'core' builds one without")
def test_without_mpi_the_error_says_how_to_get_it():
    env = dict(os.environ, PMI_RANK="1", PMI_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", "import unison; unison.init()"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=50)
    output = proc.stdout.decode()
    assert proc.returncode != 0
    assert "UnsupportedError" in output and "started by MPICH as rank 1 of 2" in output, output
    assert "built without MPI" in output and "pip install mpich" in output, output


# ---- mpirun command lines (no MPI needed) --------------------------------------------


def test_hostfile_formats(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nnode1 slots=4\nnode2:2\n\nnode3   # one slot\n")
    assert hosts.parse_hostfile(str(hostfile)) == "node1:4,node2:2,node3:1"
    assert hosts.slots("node1:4,node2:2,node3:1") == 7


def test_mpirun_command_for_each_family():
    wrapper = ["python", "-m", "unison.runner.mpi", "--rank-wrapper", "--", "python", "train.py"]
    hydra = mpi_run.mpirun_command("mpirun", "hydra", 8, "a:4,b:4", ["UNISON_CYCLE_TIME"], wrapper)
    assert hydra == ["mpirun", "-np", "8", "-hosts", "a:4,b:4"] + wrapper
    openmpi = mpi_run.mpirun_command("mpirun", "openmpi", 8, "a:4,b:4", ["PATH", "UNISON_CYCLE_TIME"], wrapper,
                                     mpi_args="--mca btl ^openib")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    assert openmpi == (["mpirun", "-np", "8", "-H", "a:4,b:4"] + root +
                       ["--bind-to", "none", "--map-by", "slot", "-x", "PATH", "-x", "UNISON_CYCLE_TIME",
                        "--mca", "btl", "^openib"] + wrapper)
    # --binding-args take the place of the default binding (Hydra has none).
    bound = mpi_run.mpirun_command("mpirun", "openmpi", 2, None, [], wrapper, binding_args="--bind-to core")
    assert bound == ["mpirun", "-np", "2", "--oversubscribe"] + root + ["--bind-to", "core"] + wrapper
    assert mpi_run.mpirun_command("mpirun", "hydra", 2, None, [], wrapper, binding_args="-bind-to core") == (
        ["mpirun", "-np", "2", "-bind-to", "core"] + wrapper)


FAKE_OPEN_MPI = """#!/bin/bash
if [ "$1" = "--version" ]; then echo "mpirun (Open MPI) 5.0.6"; exit 0; fi
printf '%%s\\n' "$@" > %s
"""


def test_open_mpi_passes_every_rank_the_launchers_environment_but_its_own(tmp_path):
    """Open MPI's ranks on other hosts get only the variables -x names:
    unisonrun names every one a horovodrun rank would get, and none that
    is the launcher's own (rank_environment.py)."""
    mpirun, arguments = tmp_path / "mpirun", tmp_path / "arguments"
    mpirun.write_text(FAKE_OPEN_MPI % arguments)
    mpirun.chmod(0o755)
    launcher = {"UNISON_MPIRUN": str(mpirun), "MY_SETTING": "x", "NCCL_SOCKET_IFNAME": "eth1",
                "CUDA_VISIBLE_DEVICES": "1", "SSH_AUTH_SOCK": "/tmp/agent", "PMI_RANK": "4",
                "OMPI_COMM_WORLD_RANK": "4", "SLURM_PROCID": "4", "SLURM_JOB_ID": "77", "BASH_FUNC_f%%": "() { :; }"}
    proc = run_job([sys.executable, "-m", "unison.run", "--mpi", "-np", "2", "-H", "a:1,b:1", "python", "train.py"],
                   60, env=dict(os.environ, **launcher))
    assert proc.returncode == 0, proc.stdout.decode()
    words = arguments.read_text().split("\n")
    passed = {words[i + 1] for i, word in enumerate(words) if word == "-x"}
    assert {"MY_SETTING", "NCCL_SOCKET_IFNAME", "SLURM_JOB_ID", "PATH", "UNISON_JOB_ID"} <= passed, passed
    own = {"CUDA_VISIBLE_DEVICES", "SSH_AUTH_SOCK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID",
           "BASH_FUNC_f%%", "HOME", "PWD"}
    assert not passed & own, passed & own


ENGINE_CORE = """
import glob
import numpy as np
import unison, unison.numpy as unp
unison.init()
def named(task):
    try:
        return open(task + "/comm").read().strip()
    except (FileNotFoundError, ProcessLookupError):  # a thread that ended since the glob (ENOENT or ESRCH)
        return None
engine = [t for t in glob.glob("/proc/self/task/*") if named(t) == "unison-engine"]
cores = [line.split()[1] for line in open(engine[0] + "/status") if line.startswith("Cpus_allowed_list:")]
total = unp.allreduce(np.full(2, unison.rank() + 1.0), op=unison.Sum, name="x")
print("rank %d local %d engine core %s sum %s" % (unison.rank(), unison.local_rank(), cores[0], total.tolist()),
      flush=True)
"""


@needs_mpi
@pytest.mark.timeout(120)
def test_thread_affinity_follows_the_local_rank_that_the_hosts_give(tmp_path):
    # 2 simulated hosts x 2: the local rank comes from the layout, not from
    # the launcher's numbering, and each host's ranks take the list afresh.
    script = tmp_path / "engine_core.py"
    script.write_text(ENGINE_CORE)
    usable = sorted(os.sched_getaffinity(0))
    cores = [usable[-1], usable[0]]
    proc = unisonrun(["-np", "4", "--simulate-hosts", "2", "--thread-affinity", "%d,%d" % tuple(cores)],
                     [sys.executable, str(script)], timeout=100)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out
    for rank in range(4):
        assert "rank %d local %d engine core %d sum [10.0, 10.0]" % (rank, rank % 2, cores[rank % 2]) in out, out


COMMUNICATOR = """
import numpy as np
from mpi4py import MPI
import unison, unison.numpy as unp
world = MPI.COMM_WORLD
unison.init(comm=world)
me, n = unison.rank(), unison.size()
total = unp.allreduce(np.full(2, me + 1.0), op=unison.Sum, name="x")
# mpi4py's own collectives work beside unison's.
print("rank %d of %d sum %s mpi4py %d" % (me, n, total.tolist(), world.allreduce(me + 1)), flush=True)
unison.shutdown()
halves = world.Split(me % 2, me)
try:
    unison.init(comm=halves)
except unison.UnsupportedError as e:
    print("rank %d refused: %s" % (me, e), flush=True)
unison.init()
print("rank %d again %s" % (me, unp.allreduce(np.ones(1), op=unison.Sum, name="y").tolist()), flush=True)
"""


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_init_takes_an_mpi4py_communicator_of_the_whole_job(tmp_path, np_):
    script = tmp_path / "communicator.py"
    script.write_text(COMMUNICATOR)
    proc = unisonrun(["--mpi", "-np", str(np_)], [sys.executable, str(script)], timeout=100)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out
    total = np_ * (np_ + 1) // 2
    for me in range(np_):
        assert "rank %d of %d sum %s mpi4py %d" % (me, np_, [float(total)] * 2, total) in out, out
        half = [r for r in range(np_) if r % 2 == me % 2]
        assert ("rank %d refused: unison: init(comm=...) names a communicator of MPI.COMM_WORLD's ranks %s, but this "
                "job is ranks 0 to %d" % (me, half, np_ - 1)) in out, out
        assert "rank %d again [%s]" % (me, float(np_)) in out, out


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_an_mpi4py_communicator_in_a_job_mpirun_did_not_start_is_refused(tmp_path, np_):
    # Under unisonrun without --mpi, each rank's MPI.COMM_WORLD is itself alone.
    script = tmp_path / "communicator.py"
    script.write_text(COMMUNICATOR)
    proc = unisonrun(["-np", str(np_)], [sys.executable, str(script)], timeout=100)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, out
    for me in range(np_):
        assert re.search(r"init\(comm=<mpi4py\.MPI\.Intracomm object at 0x[0-9a-f]+>\): this process is rank 0 of 1 "
                         r"in MPI\.COMM_WORLD but rank %d of %d in this job" % (me, np_), out), out


BOUND = """
import os, sys
import numpy as np
import unison, unison.numpy as unp
unison.init()
total = unp.allreduce(np.full(2, unison.rank() + 1.0), op=unison.Sum, name="x")
print("rank", unison.rank(), "cores", sorted(os.sched_getaffinity(0)), "sum", total.tolist(), flush=True)
"""


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_binding_args_bind_the_ranks_and_output_can_be_timestamped(tmp_path, np_):
    script = tmp_path / "bound.py"
    script.write_text(BOUND)
    if mpi_run.mpirun_family(mpi_run.find_mpirun()) == "openmpi":
        binding = "--bind-to core:overload-allowed --map-by core:OVERSUBSCRIBE"
    else:
        binding = "-bind-to core"
    logs = tmp_path / "logs"
    proc = unisonrun(["--mpi", "-np", str(np_), "--binding-args", binding, "--prefix-output-with-timestamp",
                      "--output-filename", str(logs)], [sys.executable, str(script)], timeout=100)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out
    usable = sorted(os.sched_getaffinity(0))
    found = {}
    for rank, cores, total in re.findall(r"(?m)^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6} \[\d+\]<stdout>:"
                                         r"rank (\d+) cores (\[[\d, ]*\]) sum (.*)$", out):
        found[int(rank)] = eval(cores)
        assert total == str([np_ * (np_ + 1) / 2] * 2), out
    assert sorted(found) == list(range(np_)), out
    for rank in range(np_):  # the rank wrapper's files are stamped too
        logged = (logs / ("rank.%d" % rank) / "stdout").read_text()
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6} rank %d cores .*\n" % rank, logged), logged
    # Each rank bound to one core, and the ranks spread over every core
    # (which rank shares a core when they outnumber the cores is mpirun's).
    assert all(len(cores) == 1 and cores[0] in usable for cores in found.values()), found
    assert len({cores[0] for cores in found.values()}) == min(np_, len(usable)), found


# ---- across a real network interface ---------------------------------------------------


NETWORK = """
import numpy as np, unison, unison.numpy as unp
def sent():
    return int(open("/sys/class/net/uveth/statistics/tx_bytes").read())
unison.init()
before = sent()
x = unp.allreduce(np.ones(1 << 20, dtype=np.float32) * (unison.rank() + 1), op=unison.Sum, name="big")
assert (x == 10).all(), x[:4]
g = unp.allgather(np.full((unison.rank() + 1, 3), unison.rank(), dtype=np.int32), name="rows")
assert g.tolist() == [[r] * 3 for r in range(4) for _ in range(r + 1)], g.tolist()
b = unp.broadcast(np.arange(5) * (unison.rank() + 1), root_rank=3, name="from3")
assert b.tolist() == [0, 4, 8, 12, 16], b.tolist()
print("rank %d %s sent %d bytes" % (unison.rank(), unison.basics.backend_name(), sent() - before))
"""


@needs_mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["hierarchical", "mpi"])
def test_across_network_namespaces(tmp_path, two_namespaces, backend):
    """Two ranks in each of two network namespaces: the collectives run in
    both layouts, and MPI's bytes between the hosts leave through the veth.
    MPICH is told to treat every peer as remote and to use TCP on the veth
    (MPIR_CVAR_NOLOCAL, libfabric's tcp provider); the job is started with
    Hydra's own syntax for per-rank settings."""
    mpirun = mpi_run.find_mpirun()
    if mpi_run.mpirun_family(mpirun) != "hydra":
        pytest.skip("this test drives MPICH's Hydra; the tox env 'mpi' installs MPICH")
    script = tmp_path / "network.py"
    script.write_text(NETWORK)
    command = [mpirun]
    for i, name in enumerate(two_namespaces):
        if i:
            command.append(":")
        command += ["-n", "2", "-env", "UNISON_HOSTNAME", "host%d" % i, "ip", "netns", "exec", name,
                    sys.executable, str(script)]
    env = dict(os.environ, MPIR_CVAR_NOLOCAL="1", MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp",
               FI_TCP_IFACE="uveth", UNISON_HIERARCHICAL_ALLREDUCE="1" if backend == "hierarchical" else "0")
    proc = run_job(command, 150, env=env)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    sent = dict(re.findall(r"rank (\d) %s sent (\d+) bytes" % backend, output))
    assert sorted(sent) == ["0", "1", "2", "3"], output
    # Each host sends the other at least half of the 4 MiB allreduce (the
    # counter is the namespace's, shared by its two ranks; traffic between
    # the two ranks of a namespace stays on its loopback).
    assert all(int(n) >= 2 << 20 for n in sent.values()), sent


@needs_mpi
@pytest.mark.timeout(600)
def test_build_with_mpi_after_a_build_without_it_rebuilds_the_core(tmp_path):
    # A checkout whose build/ holds an MPI-less core: UNISON_WITH_MPI=1 must
    # give a core with the MPI backend, not quietly reuse the old object.
    # What is checked does not depend on which MPI is found, and the test
    # is two full builds (a third of its env's time), so one env runs it.
    if mpi_run.mpirun_family(mpi_run.find_mpirun()) != "hydra":
        pytest.skip("which MPI is found does not matter here; the tox env 'mpi' (MPICH) runs this")
    root = os.path.dirname(HERE)
    files = subprocess.run(["git", "ls-files"], cwd=root, stdout=subprocess.PIPE, text=True, check=True)
    for relative in files.stdout.split():
        if relative.startswith(("native/", "common/")) or relative in ("setup.py", "pyproject.toml"):
            os.makedirs(os.path.dirname(os.path.join(tmp_path, relative)) or str(tmp_path), exist_ok=True)
            shutil.copy(os.path.join(root, relative), os.path.join(tmp_path, relative))
    for package in ("torch_adapter", "tf_adapter", "tf_adapter/keras", "mxnet_adapter", "common/keras"):
        os.makedirs(os.path.join(tmp_path, package), exist_ok=True)

    def build(**settings):
        env = dict(os.environ, **settings)
        env.pop("UNISON_WITH_MPI" if "UNISON_WITHOUT_MPI" in settings else "UNISON_WITHOUT_MPI", None)
        proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=500)
        assert proc.returncode == 0, proc.stdout[-5000:]
        with open(os.path.join(tmp_path, "common", next(f for f in os.listdir(os.path.join(tmp_path, "common"))
                                                          if f.startswith("_native") and f.endswith(".so"))),
                  "rb") as f:
            return b"MPI_Init_thread" in f.read()

    assert not build(UNISON_WITHOUT_MPI="1")
    assert build(UNISON_WITH_MPI="1")


@needs_mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [2, 3])
def test_rpc_suite_under_plain_mpirun(np_):
    """unison.torch.rpc in a job started by mpirun alone: init_rpc() needs no
    MASTER_ADDR or port, since rank 0 picks them and unison tells the rest.
    The `mpi` env installs torch for this; `openmpi` leaves it to `mpi`."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here; the tox env 'mpi' runs this")
    mpirun = mpi_run.find_mpirun()
    extra = []
    if mpi_run.mpirun_family(mpirun) == "openmpi":
        extra = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    proc = run_job([mpirun, "-np", str(np_)] + extra + pytest_command("test_torch_rpc.py"), 580,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert_every_rank_passed(proc, np_)
