"""Across hosts without MPI: the TCP backend and `unisonrun -H`.

Layouts on this one machine, with no MPI on PATH (the rows tcp-* of
tests/layouts.py; test_layouts.py checks each rank's identity on them):
  localhost:2,127.0.0.1:2   two hosts of two ranks: hierarchical (shared
                            memory within each, TCP across), and flat TCP
  localhost:1,127.0.0.1:1   two hosts of one rank
  localhost:2,127.0.0.1:1   hosts of different sizes: flat TCP, 3 ranks
  two network namespaces    hierarchical, with TCP's bytes crossing a veth
                            pair, and ranks started through an ssh stand-in
"""
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

import jobs
import layouts
from jobs import CORE_SUITES, EXITS, HERE, KILLED, assert_every_rank_passed, pytest_command
from layouts import LAYOUTS
from unison import network

# This file's rows of tests/layouts.py, by their names there less "tcp-".
ACROSS_HOSTS = ["1+1", "2+1", "2x2", "2x2-flat"]


def row(short):
    return LAYOUTS["tcp-" + short]


def options(short):
    return layouts.options("tcp-" + short)


def without_mpi():
    """The environment with every directory that holds an mpirun off PATH."""
    return layouts.without_mpi(os.environ)


def unisonrun(options, command, env=None, timeout=300):
    return jobs.unisonrun(options, command, env, timeout, base=without_mpi())


# Every core suite in one launch per layout (test_parallel.py says why).
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", sorted(ACROSS_HOSTS))
def test_core_suites_across_hosts(layout):
    proc = unisonrun(options(layout), pytest_command(*CORE_SUITES),
                     env={"UNISON_TEST_EXPECT_BACKEND": row(layout).backend}, timeout=580 * len(CORE_SUITES))
    assert_every_rank_passed(proc, layouts.ranks("tcp-" + layout))


STRANGER = """
import os, socket, time, numpy as np, unison, unison.numpy as unp
if os.environ["UNISON_RANK"] == "1":
    # Before joining, knock on rank 0's door without the secret.
    address = (os.environ["UNISON_RENDEZVOUS_ADDR"], int(os.environ["UNISON_RENDEZVOUS_PORT"]))
    deadline = time.monotonic() + 30
    while True:
        try:
            stranger = socket.create_connection(address)
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    challenge = stranger.recv(16)
    stranger.sendall(b"\\0" * 48 + b"then a great deal more" * 1000)
    stranger.settimeout(20)
    try:
        answer = stranger.recv(1000)
    except ConnectionResetError:
        answer = b""
    print("stranger got %d bytes of challenge and %r" % (len(challenge), answer), flush=True)
unison.init()
total = unp.allreduce(np.array([unison.rank() + 1.0]), op=unison.Sum, name="total")
print("rank %d total %d" % (unison.rank(), total[0]), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_connection_without_the_secret_is_refused_and_the_job_goes_on(tmp_path):
    script = tmp_path / "stranger.py"
    script.write_text(STRANGER)
    proc = unisonrun(["-np", "3", "-H", "localhost:2,127.0.0.1:1"], [sys.executable, str(script)], timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    assert "stranger got 16 bytes of challenge and b''" in output, output
    assert re.search(r"\[0\]<stderr>:unison: rank 0 refused a connection from 127\.0\.0\.1:\d+: unison: a "
                     r"connection without the job's secret was refused", output), output
    for r in range(3):
        assert "[%d]<stdout>:rank %d total 6" % (r, r) in output, output


CROWD = """
import os, socket, time, numpy as np, unison, unison.numpy as unp
crowd = []
if os.environ["UNISON_RANK"] == "1":
    # Before joining, 200 connections to rank 0's door that never say a word.
    address = (os.environ["UNISON_RENDEZVOUS_ADDR"], int(os.environ["UNISON_RENDEZVOUS_PORT"]))
    deadline = time.monotonic() + 30
    while len(crowd) < 200:
        try:
            crowd.append(socket.create_connection(address))
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
unison.init()
total = unp.allreduce(np.array([unison.rank() + 1.0]), op=unison.Sum, name="total")
print("rank %d total %d with %d silent" % (unison.rank(), total[0], len(crowd)), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_,hosts", [(2, "localhost:1,127.0.0.1:1"), (3, "localhost:2,127.0.0.1:1")])
def test_a_crowd_of_silent_strangers_at_the_rendezvous_does_not_stop_the_job_starting(tmp_path, np_, hosts):
    """Rank 0 proves every connection on a thread of its own, each for at
    most 5 s, and past the most it takes at once ends the oldest for each
    new one: 200 silent connections made just before the ranks arrive cost
    the job nothing like 200 x 5 s, and it starts within a 10 s start
    timeout (three such connections once stopped it: rank 0 took them one
    at a time)."""
    script = tmp_path / "crowd.py"
    script.write_text(CROWD)
    proc = unisonrun(["-np", str(np_), "-H", hosts, "--start-timeout", "10"], [sys.executable, str(script)],
                     timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    for r in range(np_):
        assert "[%d]<stdout>:rank %d total %d with %d silent" % (r, r, np_ * (np_ + 1) // 2, 200 if r == 1 else 0) \
            in output, output


SILENT = """
import os, signal, numpy as np, unison, unison.numpy as unp
unison.init()
unp.allreduce(np.ones(3), name="first")
if unison.rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    unp.allreduce(np.ones(3), name="second")
except unison.HorovodInternalError as e:
    print("rank %d: %s" % (unison.rank(), e), flush=True)
    raise SystemExit(1)
"""


@pytest.mark.timeout(120)
def test_a_silent_peer_on_another_host_is_named_within_the_peer_timeout(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text(SILENT)
    start = time.monotonic()
    proc = unisonrun(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--peer-timeout-seconds", "2"],
                     [sys.executable, str(script)], timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, output
    assert re.search(r"\[0\]<stdout>:rank 0: unison: rank 1 \(host 127\.0\.0\.1, pid \d+\) has shown no sign of "
                     r"life for [23] s", output), output
    assert "unisonrun: job failed: rank 0 (host localhost) exited with status 1" in output, output
    assert time.monotonic() - start < 30, output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting,expected", [
    ({"UNISON_NETWORK_INTERFACE": "nosuch0"}, "UNISON_NETWORK_INTERFACE='nosuch0' is neither an IPv4 address nor an "
                                              "interface of this host"),
    ({"UNISON_RENDEZVOUS_ADDR": "127.0.0.1"}, "UNISON_RENDEZVOUS_ADDR and UNISON_RENDEZVOUS_PORT go together"),
    ({"UNISON_RENDEZVOUS_ADDR": "127.0.0.1", "UNISON_RENDEZVOUS_PORT": "http"},
     "UNISON_RENDEZVOUS_PORT='http' is not an integer from 1 to 65535"),
])
def test_bad_network_settings_are_named(setting, expected):
    env = dict(without_mpi(), UNISON_RANK="0", UNISON_SIZE="2", UNISON_LOCAL_SIZE="1",
               UNISON_SECRET_KEY="sixteen-byte-key", UNISON_RENDEZVOUS_ADDR="127.0.0.1", UNISON_RENDEZVOUS_PORT="1",
               UNISON_START_TIMEOUT="5")
    env.update(setting)
    if "UNISON_RENDEZVOUS_PORT" not in setting and setting.get("UNISON_RENDEZVOUS_ADDR"):
        env.pop("UNISON_RENDEZVOUS_PORT")
    proc = subprocess.run([sys.executable, "-c", "import unison; unison.init()"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=50)
    assert proc.returncode != 0
    assert expected in proc.stdout.decode(), proc.stdout.decode()


@pytest.mark.timeout(60)
def test_a_rendezvous_without_a_secret_is_refused():
    env = dict(without_mpi(), UNISON_RANK="0", UNISON_SIZE="2", UNISON_LOCAL_SIZE="1",
               UNISON_RENDEZVOUS_ADDR="127.0.0.1", UNISON_RENDEZVOUS_PORT="29999")
    env.pop("UNISON_SECRET_KEY", None)
    proc = subprocess.run([sys.executable, "-c", "import unison; unison.init()"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=50)
    assert proc.returncode != 0
    assert "UNISON_SECRET_KEY is not" in proc.stdout.decode(), proc.stdout.decode()


@pytest.mark.timeout(120)
def test_the_rendezvous_port_is_one_the_kernel_never_hands_out_by_itself():
    # Nobody holds the rendezvous port between a shutdown() and the next
    # init(). One from the kernel's ephemeral range could meanwhile become
    # any connection's own port, and rank 0's listen then failed with
    # "Address already in use" (seen once in CI, in a re-init test).
    from unison import network
    low, high = network.ephemeral_ports()
    show = [sys.executable, "-c", "import os; print('port', os.environ['UNISON_RENDEZVOUS_PORT'])"]
    for _ in range(3):
        proc = unisonrun(["-np", "2", "-H", "localhost:1,127.0.0.1:1"], show, timeout=60)
        output = proc.stdout.decode(errors="replace")
        assert proc.returncode == 0, output
        ports = set(int(p) for p in re.findall(r"port (\d+)", output))
        assert len(ports) == 1, output
        assert not low <= ports.pop() <= high, (output, low, high)


def test_launcher_rejects_an_unknown_interface():
    proc = unisonrun(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--network-interface", "nosuch0"],
                     [sys.executable, "-c", "pass"], timeout=60)
    assert proc.returncode != 0
    assert "--network-interface nosuch0: this host has no interface of that name" in proc.stdout.decode()


def test_placement_and_slots():
    from unison import network
    from unison.runner.hosts import place
    assert place([("a", 2), ("b", 2)], 3) == ["a", "a", "b"]
    with pytest.raises(SystemExit, match="-np 5 but the hosts have 4 slots"):
        place([("a", 2), ("b", 2)], 5)
    assert network.is_this_machine("localhost") and network.is_this_machine("127.0.0.1")
    assert network.is_this_machine(socket.gethostname())


# ---- ranks started over ssh ------------------------------------------------------------


# unisonrun's ssh stand-in for a host that is not this machine: it runs the
# command here, in a session of its own, so that only the end of its standard
# input (not a signal to ssh's process group) can stop the rank, and with the
# environment a login there would give (another home, a short PATH, nothing
# of the launcher's), as on a real remote host. Its arguments, each on a
# line, go to the file ssh.log beside it.
FAKE_SSH = """#!/bin/bash
printf '%%s\\n' "$@" >> %(log)s
while [ $# -gt 2 ]; do shift; done
exec env -i HOME=/home/on-another-host PATH=/usr/bin:/bin setsid -w bash -c "$2"
"""


def fake_ssh(tmp_path):
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH % {"log": shlex.quote(str(tmp_path / "ssh.log"))})
    ssh.chmod(0o755)
    return str(ssh)


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_rank_on_every_host(tmp_path):
    ssh = fake_ssh(tmp_path)
    script = tmp_path / "waits.py"
    marker = tmp_path / "started"
    script.write_text("import time, unison, pathlib\nunison.init()\n"
                      "pathlib.Path(%r + str(unison.rank())).touch()\ntime.sleep(60)\n" % str(marker))
    proc = subprocess.Popen([sys.executable, "-m", "unison.run", "-np", "3", "-H", "localhost:1,elsewhere.invalid:2",
                             "--network-interface", "lo", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(without_mpi(), UNISON_SSH=ssh))
    deadline = time.monotonic() + 60
    while not all(os.path.exists(str(marker) + str(r)) for r in range(3)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.1)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0, out.decode()
    assert time.monotonic() - start < 15
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = subprocess.run(["pgrep", "-f", str(script)], stdout=subprocess.PIPE).stdout.decode().split()
        if not left:
            break
        time.sleep(0.2)
    assert left == [], "ranks still running: %s" % left


@pytest.mark.timeout(120)
def test_a_failed_remote_rank_is_named_with_its_status(tmp_path):
    ssh = fake_ssh(tmp_path)
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    start = time.monotonic()
    proc = unisonrun(["-np", "3", "-H", "localhost:1,elsewhere.invalid:2", "--network-interface", "lo"],
                     [sys.executable, str(script)],
                     env={"UNISON_SSH": ssh}, timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 3, output
    assert "unisonrun: job failed: rank 1 (host elsewhere.invalid) exited with status 3" in output, output
    assert time.monotonic() - start < 30, output


UNREACHABLE_SSH = """#!/bin/bash
echo "ssh: connect to host elsewhere.invalid port 22: Connection refused" >&2
exit 255
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_host_ssh_cannot_reach_is_named_with_what_ssh_said(tmp_path, np_):
    """ssh exits at once, without reading the environment the launcher
    writes to it. The environment is larger than a pipe holds, so the
    launcher's write finds the pipe closed; the job still fails naming the
    host, ssh's status and its message, not with the launcher's traceback."""
    ssh = tmp_path / "ssh"
    ssh.write_text(UNREACHABLE_SSH)
    ssh.chmod(0o755)
    large = {"LARGE_SETTING_%d" % i: "x" * 60000 for i in range(4)}  # 240 KB; a pipe holds 64 KiB
    hosts = "localhost:1,elsewhere.invalid:%d" % (np_ - 1)
    proc = unisonrun(["-np", str(np_), "-H", hosts, "--network-interface", "lo"],
                     [sys.executable, "-c", "import time; time.sleep(60)"],
                     env=dict(large, UNISON_SSH=str(ssh)), timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 255, output
    assert re.search(r"unisonrun: job failed: rank [12] \(host elsewhere.invalid\) exited with status 255", output), \
        output
    assert "Connection refused" in output, output
    assert "Traceback" not in output, output


SEES = """
import json, os, unison
unison.init()
seen = {name: os.environ.get(name) for name in ("MY_SETTING", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES",
                                                "SSH_AUTH_SOCK", "HOME")}
identity = [unison.rank(), unison.size(), unison.local_rank(), unison.local_size(), unison.cross_rank(),
            unison.cross_size(), os.environ["UNISON_HOSTNAME"]]
horovods = [os.environ.get("HOROVOD_" + n) for n in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK",
                                                     "CROSS_SIZE", "HOSTNAME")]
assert horovods == [str(v) for v in identity], (horovods, identity)
print("rank %d sees %s" % (unison.rank(), json.dumps(seen, sort_keys=True)), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_every_rank_on_every_host_gets_the_launchers_environment(tmp_path, np_):
    """As under horovodrun, a rank started over ssh gets the launcher's
    environment (a script's settings, NCCL's), on standard input rather than
    on a command line that ps shows, but not what is the launcher's own:
    its GPUs, its ssh session, its home. Every rank's identity is under
    horovodrun's names too (HOROVOD_RANK...)."""
    ssh = fake_ssh(tmp_path)
    script = tmp_path / "sees.py"
    script.write_text(SEES)
    setting = "two words\nand a 'quoted' line with $HOME; `true` \\ \u00e9"
    launcher = {"MY_SETTING": setting, "NCCL_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "3",
                "SSH_AUTH_SOCK": "/tmp/the-launchers-agent", "HOME": "/home/of-the-launcher"}
    proc = unisonrun(["-np", str(np_), "-H", "localhost:1,elsewhere.invalid:%d" % (np_ - 1),
                      "--network-interface", "lo"], [sys.executable, str(script)],
                     env=dict(launcher, UNISON_SSH=ssh), timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    seen = {int(r): json.loads(j) for r, j in re.findall(r"rank (\d+) sees (.*)", output)}
    assert seen[0] == launcher, output  # this machine's rank inherits everything
    remote = {"MY_SETTING": setting, "NCCL_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": None,
              "SSH_AUTH_SOCK": None, "HOME": "/home/on-another-host"}
    expected = {0: launcher}
    expected.update({r: remote for r in range(1, np_)})
    assert seen == expected, output
    command_lines = (tmp_path / "ssh.log").read_text()
    assert "UNISON_RANK=1" in command_lines and "two words" not in command_lines, command_lines
    # Nor the secret, nor the job id, which names the job's shared memory.
    assert "UNISON_SECRET_KEY" not in command_lines and "UNISON_JOB_ID" not in command_lines, command_lines


# Rank 3 dies mid-training; each survivor ends on its first error, as a
# training script does, so the survivors that notice last find others
# gone too.
DIES_MID_TRAINING = """
import os, signal, sys, numpy as np, unison, unison.numpy as unp
unison.init()
for step in range(20):
    unp.allreduce(np.ones(1000), name="warm")
if unison.rank() == 3:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    while True:
        handles = [unp.allreduce_async(np.ones(200_000, np.float32), name="grad.%d" % i) for i in range(4)]
        unp.allreduce(np.ones(300_000, np.float32), name="grad.last")
        for handle in handles:
            unp.synchronize(handle)
except unison.UnisonError as e:
    print("survivor %d: %s: %s" % (unison.rank(), type(e).__name__, e), flush=True)
    sys.exit(17)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["2x2", "2x2-flat"])
def test_every_survivor_names_the_rank_that_died_not_one_that_left_after_it(tmp_path, layout):
    """A survivor that stops on a failure tells its peers why before it
    exits (Backend::stopped_on), so one that learns of the failure from its
    departure names the rank that died. Without it, survivors on the other
    host named the first survivor to exit (ShutDownError "rank 2 has shut
    down", or "rank 0 exited") in most runs."""
    script = tmp_path / "dies.py"
    script.write_text(DIES_MID_TRAINING)
    for attempt in range(3):
        proc = unisonrun(options(layout), [sys.executable, str(script)], timeout=100)
        output = proc.stdout.decode(errors="replace")
        survivors = dict(re.findall(r"survivor (\d): (.*)", output))
        assert sorted(survivors) == ["0", "1", "2"], output
        for rank, error in survivors.items():
            assert error.startswith("RankFailedError: unison: rank 3 ("), (attempt, rank, output)
            if "stopped on that" in error:   # heard from a survivor: it says which
                assert re.search(r"; rank [012] \(.*\) stopped on that$", error), (attempt, rank, output)


HALF_SENT = """
import os, subprocess, sys, numpy as np, unison, unison.numpy as unp
unison.init()
# 256 MB: the ring outlasts the 0.1 s before rank 0 stops. Filled before
# the allgather, so that every rank starts the ring as soon as it returns;
# filled after, rank 0 of a slow machine could still be filling when it
# stopped, with nothing half sent.
x = np.ones(64 << 20, np.float32)
pids = unp.allgather(np.array([os.getpid()]), name="pids").tolist()
if unison.rank() == 2:
    # Mid-ring, rank 0 stops reading, so this rank's frame to it stays half
    # sent; then rank 1, which this rank receives from, dies; then rank 0
    # reads on.
    subprocess.Popen(["sh", "-c", "sleep 0.1; kill -STOP %d; sleep 0.5; kill -9 %d; sleep 1; kill -CONT %d"
                      % (pids[0], pids[1], pids[0])])
try:
    unp.allreduce_(x, op=unison.Max, name="big")
except unison.UnisonError as e:
    print("survivor %d: %s: %s" % (unison.rank(), type(e).__name__, e), flush=True)
    sys.exit(17)
print("rank %d finished the allreduce" % unison.rank(), flush=True)
"""


@pytest.mark.timeout(300)
def test_a_survivor_with_a_frame_half_sent_still_tells_the_others_which_rank_died(tmp_path):
    """Rank 2 hears first that rank 1 died, with a data frame to rank 0 half
    sent. It finishes that frame (keep_half_sent_frames), then sends its
    stop notice, so rank 0 names rank 1. Before, the notice could not
    follow a half-sent frame, and rank 0 named rank 2, which had only
    stopped on rank 1's death, in every run."""
    script = tmp_path / "half_sent.py"
    script.write_text(HALF_SENT)
    mid_ring = 0
    for attempt in range(5):
        proc = unisonrun(options("2+1") + ["--failure-grace-seconds", "60"], [sys.executable, str(script)],
                         timeout=100)
        output = proc.stdout.decode(errors="replace")
        if "rank 2 finished the allreduce" in output:
            # Rank 2 had received everything before rank 0 stopped (a fast
            # machine): its result is whole and right, and only its
            # shutdown meets rank 1's death. Nothing to check: another try.
            continue
        survivors = dict(re.findall(r"survivor (\d): (.*)", output))
        assert sorted(survivors) == ["0", "2"], output
        for rank, error in survivors.items():
            assert error.startswith("RankFailedError: unison: rank 1 ("), (attempt, rank, output)
            if "stopped on that" in error:  # heard from the other survivor: it says which
                assert re.search(r"; rank [02] \(.*\) stopped on that$", error), (attempt, rank, output)
        # Rank 0 may also name rank 1 itself: its own sends to rank 1 fail.
        # Rank 0 stopped before the ring began (a loaded machine) leaves
        # nothing half sent: then another try.
        mid_ring += "during an allreduce" in survivors["2"]
        if mid_ring:
            break
    assert mid_ring, "in five tries rank 0 never stopped mid-ring: " + output


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout,seed", [(layout, seed) for layout in ("1+1", "2+1", "2x2", "2x2-flat")
                                         for seed in (1, 2)])
def test_a_rank_killed_at_a_random_moment_is_named_by_every_survivor_across_hosts(tmp_path, layout, seed):
    """Any rank, killed at any moment of a random stream of every collective
    (killed_at_random.py). With the launcher's grace period long, each
    survivor must end by itself, within seconds, naming the killed rank
    (test_launcher has the same on one host)."""
    launcher, n = options(layout), layouts.ranks("tcp-" + layout)
    rng = random.Random("%s/%d" % (layout, seed))
    victim, delay = rng.randrange(n), rng.uniform(0.3, 2.0)
    script = os.path.join(HERE, "killed_at_random.py")
    proc = unisonrun(launcher + ["--failure-grace-seconds", "60"],
                     [sys.executable, script, str(seed), str(victim), "%.3f" % delay], timeout=150)
    output = proc.stdout.decode(errors="replace")
    survivors = re.findall(r"survivor (\d) at [0-9.]+, after ([0-9.]+) s: (\w+): (.*)", output)
    assert sorted(int(r) for r, _, _, _ in survivors) == [r for r in range(n) if r != victim], output
    for rank, seconds, kind, message in survivors:
        assert kind == "RankFailedError" and message.startswith("unison: rank %d (" % victim), (rank, output)
        assert float(seconds) < delay + 5, (rank, output)  # not a wait for the peer timeout (10 s)
    assert "unisonrun: job failed: rank %d (host " % victim in output, output


FROZEN = """
import os, subprocess, sys, numpy as np, unison, unison.numpy as unp
victim = int(sys.argv[1])
unison.init()
if unison.rank() == victim:
    subprocess.Popen(["sh", "-c", "sleep 0.5; kill -STOP %d" % os.getpid()])
try:
    while True:
        unp.allreduce(np.ones(1 << 18, np.float32), name="grad")
except unison.UnisonError as e:
    print("survivor %d: %s: %s" % (unison.rank(), type(e).__name__, e), flush=True)
    sys.exit(17)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 2])
def test_a_frozen_rank_is_named_by_every_survivor_not_the_leader_waiting_on_it(tmp_path, victim):
    """Two hosts of two ranks, hierarchical. A frozen rank (SIGSTOP) is
    found by the peer timeout. Its host's leader, or the other host's,
    waits on it (in shared memory, or over TCP) for all of that time, and
    its own host's other rank waits on the leader in shared memory. Before,
    that rank read only the leader's shared-memory heartbeat, stale for as
    long, and named the leader, alive, about half the time (liveness.h)."""
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN)
    for attempt in range(3):
        proc = unisonrun(options("2x2") + ["--peer-timeout-seconds", "2", "--failure-grace-seconds", "4"],
                         [sys.executable, str(script), str(victim)], timeout=100)
        output = proc.stdout.decode(errors="replace")
        survivors = dict(re.findall(r"survivor (\d): (.*)", output))
        assert sorted(survivors) == sorted({"0", "1", "2", "3"} - {str(victim)}), output
        for rank, error in survivors.items():
            assert error.startswith("RankFailedError: unison: rank %d (" % victim), (attempt, rank, output)


STARTS = """
import sys, time, numpy as np, unison, unison.numpy as unp
start = time.monotonic()
try:
    unison.init()
    unp.allreduce(np.ones(3), name="first")
except unison.HorovodInternalError as e:
    print("rank %s after %.1f s: %s" % (sys.argv[1], time.monotonic() - start, e), flush=True)
    sys.exit(1)
"""


class FakeRank:
    """A rank of a TCP job played by the test: it proves the job's
    secret to rank 0 and says where it listens, as a real rank does, then
    does only what the test tells it. That holds a real rank's start-up at
    a chosen step, which no timing of a real process could."""

    def __init__(self, port, secret, rank, size, host, listen_port):
        import hmac

        self.rank = rank
        deadline = time.monotonic() + 30
        while True:  # rank 0 may not listen yet
            try:
                self.socket = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        theirs = self.read(16)
        mine = os.urandom(16)
        self.socket.sendall(mine + hmac.new(secret.encode(), b"unison connects" + theirs + mine, "sha256").digest())
        assert hmac.compare_digest(self.read(32), hmac.new(secret.encode(), b"unison accepts" + theirs + mine,
                                                           "sha256").digest())
        hello = ("%d %d %d 127.0.0.1:%d %s\n" % (size, rank, os.getpid(), listen_port, host)).encode()
        self.socket.sendall(len(hello).to_bytes(4, sys.byteorder) + hello)

    def read(self, n):
        data = b""
        while len(data) < n:
            more = self.socket.recv(n - len(data))
            assert more, "rank 0 closed the connection"
            data += more
        return data

    def read_table(self):
        return self.read(int.from_bytes(self.read(4), sys.byteorder)).decode()


def free_port():
    return network.a_port_nobody_takes_by_chance("127.0.0.1")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["rank 0 waits for the rest", "a rank connects to one that died",
                                  "a rank waits for one that died", "2x2: its host waits in shared memory"])
def test_a_rank_that_dies_during_start_up_ends_the_others_start_up_at_once_naming_it(tmp_path, case):
    """A rank that dies after it reached rank 0 (an elastic round re-forming
    as one more worker dies) used to leave the others waiting for it until
    UNISON_START_TIMEOUT; the elastic driver then took them for hung and
    blacklisted their hosts too. Now each waiting rank learns of it at once,
    whether it waits on a socket or, across hosts of two ranks, for a local
    rank in shared memory."""
    script = tmp_path / "starts.py"
    script.write_text(STARTS)
    port, secret = free_port(), "sixteen-byte-key"
    base = {k: v for k, v in without_mpi().items() if not k.startswith(("UNISON_", "HOROVOD_"))}
    procs, outputs = {}, {}
    hosts = ["hostA", "hostA", "hostB", "hostB"] if case.startswith("2x2") else ["host0", "host1", "host2"]
    size = len(hosts)

    def fake(rank):
        return FakeRank(port, secret, rank, size, hosts[rank], free_port())

    def start(rank):
        mine = [r for r in range(size) if hosts[r] == hosts[rank]]
        env = dict(base, UNISON_RANK=str(rank), UNISON_SIZE=str(size), UNISON_LOCAL_RANK=str(mine.index(rank)),
                   UNISON_LOCAL_SIZE=str(len(mine)), UNISON_CROSS_RANK=str(sorted(set(hosts)).index(hosts[rank])),
                   UNISON_CROSS_SIZE=str(len(set(hosts))), UNISON_HOSTNAME=hosts[rank], UNISON_JOB_ID="dies",
                   UNISON_RENDEZVOUS_ADDR="127.0.0.1", UNISON_RENDEZVOUS_PORT=str(port), UNISON_SECRET_KEY=secret,
                   UNISON_START_TIMEOUT="100", UNISON_PEER_TIMEOUT_SECONDS="100")
        procs[rank] = subprocess.Popen([sys.executable, str(script), str(rank)], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT)

    def output(rank):
        if rank not in outputs:
            outputs[rank] = procs[rank].communicate(timeout=60)[0].decode(errors="replace")
        return outputs[rank]

    start(0)
    if case == "rank 0 waits for the rest":
        # Rank 1 reaches rank 0 and dies; rank 2 never comes.
        fake(1).socket.close()
        assert re.search(r"rank 0 after [0-9.]+ s: unison: rank 1 \(host host1, pid \d+\) closed its connection "
                         r"before every rank had reached rank 0: it exited, was killed or gave up while the job "
                         r"started", output(0)), output(0)
    elif case == "a rank connects to one that died":
        # Rank 1 reached rank 0 saying where it listens, and has stopped
        # listening there: rank 2, connecting to it, is refused.
        rank1 = fake(1)
        start(2)
        rank1.read_table()
        rank1.socket.close()
        assert re.search(r"rank 2 after [0-9.]+ s: unison: cannot connect to rank 1 \(host host1, pid \d+\) at "
                         r"127\.0\.0\.1:\d+: Connection refused; it was listening when it reached rank 0, so it "
                         r"exited, was killed or gave up since", output(2)), output(2)
    elif case == "a rank waits for one that died":
        # Rank 2 reaches rank 0, gets the table and dies without connecting
        # to rank 1. Rank 0, started, fails on that; rank 1, still waiting
        # for rank 2, sees rank 0 go.
        start(1)
        time.sleep(1)  # rank 1 reaches rank 0 first; were it later, the table would wait for it
        rank2 = fake(2)
        rank2.read_table()
        rank2.socket.close()
        assert re.search(r"rank 0 after [0-9.]+ s: unison: rank 2 \(host host2, pid \d+\) closed its connection",
                         output(0)), output(0)
        assert re.search(r"rank 1 after [0-9.]+ s: unison: rank 0 \(host host0, pid \d+\) closed its connection "
                         r"while rank 1 waited for rank\(s\) 2 to connect", output(1)), output(1)
    else:
        # Hierarchical: rank 0 has every connection it needs and waits in
        # shared memory for rank 1, which waits for rank 3 to connect. Rank
        # 3 reached rank 0 and dies: rank 0 sees its connection close.
        start(1)
        start(2)
        time.sleep(1)
        rank3 = fake(3)
        rank3.read_table()
        rank3.socket.close()
        assert re.search(r"rank 0 after [0-9.]+ s: unison: rank 3 \(host hostB, pid \d+\) closed its connection "
                         r"while the ranks of a host set up shared memory: it exited, was killed or gave up while "
                         r"the job started", output(0)), output(0)
    for rank, proc in procs.items():
        assert proc.wait(timeout=60) == 1, rank
    for seconds in re.findall(r"after ([0-9.]+) s", "".join(output(r) for r in procs)):
        assert float(seconds) < 30, "a wait for UNISON_START_TIMEOUT (100 s), not for the failure"


ABORTED = """
import os, threading, time, numpy as np, unison, unison.numpy as unp
from unison._native import lib
lib.unison_abort_start(b"nothing is starting")  # does nothing, and is not kept for the init below
returned = threading.Event()
def abort():  # until it takes: an abort before init begins is dropped, as above
    while not returned.wait(0.2):
        lib.unison_abort_start(b"the driver says so")
threading.Thread(target=abort, daemon=True).start()
start = time.monotonic()
try:
    unison.init()  # one rank of 2: the other never comes
except unison.HorovodInternalError as e:
    print("aborted after %.1f s: %s" % (time.monotonic() - start, e), flush=True)
returned.set()
for name in [k for k in os.environ if k.startswith(("UNISON_", "HOROVOD_"))]:
    del os.environ[name]
unison.init()
print("then alone:", unp.allreduce(np.ones(2), name="x").tolist(), flush=True)
"""


class DeafHost:
    """A port whose connections are never answered, as a powered-off host's
    are: a listener that never accepts, its accept queue full, so that
    Linux drops every further SYN. A blocking connect() to it waits out the
    kernel's SYN retries, about two minutes."""

    def __enter__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", free_port()))
        self.listener.listen(0)
        self.filler = socket.create_connection(self.listener.getsockname())
        return self.listener.getsockname()[1]

    def __exit__(self, *exc):
        self.filler.close()
        self.listener.close()


def lone_rank_env(rank, port, **settings):
    """The environment of one rank of two across hosts, rank 0 at 127.0.0.1:port."""
    return dict({k: v for k, v in without_mpi().items() if not k.startswith(("UNISON_", "HOROVOD_"))},
                UNISON_RANK=str(rank), UNISON_SIZE="2", UNISON_LOCAL_RANK="0", UNISON_LOCAL_SIZE="1",
                UNISON_CROSS_RANK=str(rank), UNISON_CROSS_SIZE="2", UNISON_HOSTNAME="host%d" % rank,
                UNISON_JOB_ID="lone", UNISON_RENDEZVOUS_ADDR="127.0.0.1", UNISON_RENDEZVOUS_PORT=str(port),
                UNISON_SECRET_KEY="sixteen-byte-key", **settings)


@pytest.mark.timeout(60)
def test_a_rank_0_that_answers_nothing_is_given_up_at_the_start_timeout():
    with DeafHost() as port:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", "import unison; unison.init()"],
                              env=lone_rank_env(1, port, UNISON_START_TIMEOUT="3"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=50)
        took = time.monotonic() - start
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0
    assert "cannot connect to rank 0 at 127.0.0.1:%d: Connection timed out" % port in output, output
    assert took < 15, (took, output)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("waiting", ["rank 0 for rank 1", "rank 1 on a rank 0 that answers nothing"])
def test_a_start_up_aborted_from_another_thread_fails_with_the_reason_and_the_process_stays_usable(
        tmp_path, waiting):
    """unison_abort_start, which an elastic worker calls when its driver
    says a member of the round died (test_elastic_launcher has that whole)."""
    script = tmp_path / "aborted.py"
    script.write_text(ABORTED)
    with DeafHost() as deaf:
        rank, port = (0, free_port()) if waiting.startswith("rank 0") else (1, deaf)
        proc = subprocess.run([sys.executable, str(script)], env=lone_rank_env(rank, port, UNISON_START_TIMEOUT="100"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=50)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    found = re.search(r"aborted after ([0-9.]+) s: unison: start-up ended: the driver says so\n", output)
    assert found and float(found.group(1)) < 5, output
    assert "then alone: [1.0, 1.0]" in output, output


INTERRUPTED = """
import os, signal, socket, sys, threading, time, numpy as np, unison, unison.numpy as unp
handled = []
if sys.argv[1] == "its own":
    signal.signal(signal.SIGINT, lambda number, frame: handled.append(number))
else:  # as at a terminal: a job a shell started in the background inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
earlier, earlier_reader = socket.socketpair()  # a wakeup fd set before init (asyncio's, say)
earlier.setblocking(False)
signal.set_wakeup_fd(earlier.fileno())
threading.Timer(1, os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.monotonic()
try:
    unison.init()  # one rank of 2: the other never comes
except KeyboardInterrupt:
    print("interrupted after %.1f s" % (time.monotonic() - start), flush=True)
except unison.HorovodInternalError as e:
    print("failed after %.1f s, the handler having seen %s: %s" % (time.monotonic() - start, handled, e), flush=True)
print("the earlier wakeup fd got %s and is set again: %s" % (
    list(earlier_reader.recv(16)), signal.set_wakeup_fd(-1) == earlier.fileno()), flush=True)
for name in [k for k in os.environ if k.startswith(("UNISON_", "HOROVOD_"))]:
    del os.environ[name]
unison.init()
print("then alone:", unp.allreduce(np.ones(2), name="x").tolist(), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("handler", ["Python's", "its own"])
@pytest.mark.parametrize("waiting", ["rank 0 for rank 1 on its host", "rank 0 for rank 1 on another host",
                                     "rank 1 on a rank 0 that answers nothing"])
def test_ctrl_c_ends_a_start_up_that_waits_for_its_peers(tmp_path, waiting, handler):
    """init() waits for its peers in one call into the core, where Python
    ran no signal handler: Ctrl-C there waited for UNISON_START_TIMEOUT.
    Now it ends the wait at once with the KeyboardInterrupt. A SIGINT
    handler of the program's own is left to decide, and whatever wakeup fd
    was set before init still hears of the signal."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    with DeafHost() as deaf:
        rank, port = (1, deaf) if waiting.endswith("answers nothing") else (0, free_port())
        env = lone_rank_env(rank, port, UNISON_START_TIMEOUT="100" if handler == "Python's" else "3")
        if waiting.endswith("on its host"):
            env.update(UNISON_LOCAL_SIZE="2", UNISON_CROSS_SIZE="1", UNISON_CROSS_RANK="0",
                       UNISON_JOB_ID="interrupted-%d" % os.getpid())
        proc = subprocess.run([sys.executable, str(script), handler], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=50)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    if handler == "Python's":
        found = re.search(r"interrupted after ([0-9.]+) s\n", output)
        assert found and 1 <= float(found.group(1)) < 4, output
    else:
        found = re.search(r"failed after ([0-9.]+) s, the handler having seen \[2\]: ", output)
        assert found and 3 <= float(found.group(1)) < 10, output
    assert "the earlier wakeup fd got [2] and is set again: True\n" in output, output
    assert "then alone: [1.0, 1.0]" in output, output


def namespace_ssh(tmp_path, namespaces):
    """An ssh stand-in that runs the command in the namespace of its host."""
    ssh = tmp_path / "ssh"
    cases = "".join("  %s) ns=%s;;\n" % (a, n) for a, n in zip(namespaces.addresses, namespaces))
    ssh.write_text("#!/bin/bash\nwhile [ $# -gt 2 ]; do shift; done\ncase $1 in\n%sesac\n"
                   "exec ip netns exec $ns setsid -w bash -c \"$2\"\n" % cases)
    ssh.chmod(0o755)
    return str(ssh)


NETWORK = """
import numpy as np, unison, unison.numpy as unp
def sent():
    return int(open("/sys/class/net/uveth/statistics/tx_bytes").read())
unison.init()
before = sent()
x = unp.allreduce(np.ones(1 << 20, dtype=np.float32) * (unison.rank() + 1), op=unison.Sum, name="big")
assert (x == 10).all(), x[:4]
print("rank %d %s sent %d bytes" % (unison.rank(), unison.basics.backend_name(), sent() - before))
"""


@pytest.mark.timeout(600)
def test_across_network_namespaces(tmp_path, two_namespaces):
    """Two ranks in each of two network namespaces, started through ssh: the
    core grid passes, and TCP's bytes between the hosts leave through the veth."""
    ssh = namespace_ssh(tmp_path, two_namespaces)
    hosts = ["-np", "4", "-H", "%s:2,%s:2" % tuple(two_namespaces.addresses)]
    script = tmp_path / "network.py"
    script.write_text(NETWORK)
    proc = unisonrun(hosts, [sys.executable, str(script)], env={"UNISON_SSH": ssh}, timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    sent = dict(re.findall(r"rank (\d) hierarchical sent (\d+) bytes", output))
    assert sorted(sent) == ["0", "1", "2", "3"], output
    # Each host sends the other at least half of the 4 MiB allreduce.
    assert all(int(n) >= 2 << 20 for n in sent.values()), sent
    proc = unisonrun(hosts, pytest_command("test_core_grid.py"),
                     env={"UNISON_SSH": ssh, "UNISON_TEST_EXPECT_BACKEND": "hierarchical"}, timeout=500)
    assert_every_rank_passed(proc, 4)


@pytest.mark.timeout(120)
def test_rank_killed_in_another_namespace_ends_the_job(tmp_path, two_namespaces):
    ssh = namespace_ssh(tmp_path, two_namespaces)
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    start = time.monotonic()
    proc = unisonrun(["-np", "4", "-H", "%s:2,%s:2" % tuple(two_namespaces.addresses)],
                     [sys.executable, str(script)], env={"UNISON_SSH": ssh}, timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, output
    assert ("unisonrun: job failed: rank 3 (host %s) was killed by signal 9" % two_namespaces.addresses[1]) in output, \
        output
    assert time.monotonic() - start < 30, output


def test_check_build_lists_tcp():
    proc = unisonrun(["--check-build"], [])
    assert "[X] TCP (several hosts, no MPI)" in proc.stdout.decode(), proc.stdout.decode()
