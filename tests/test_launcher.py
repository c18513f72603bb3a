"""The launcher and failure handling, seen from outside the ranks."""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import jobs

pytestmark = pytest.mark.timeout(120)


def run(tmp_path, script, np_=2, extra=(), timeout=90, env=None, wrapper=()):
    """unisonrun -np np_ on `script`, started through `wrapper` (a command
    that ends by running its arguments) with `env` added to the environment."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    command = [*wrapper, sys.executable, "-m", "unison.run", "-np", str(np_), *extra, sys.executable, str(path)]
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                          cwd=str(tmp_path), env=dict(os.environ, **(env or {})))


def shm_segments():
    """The jobs' segments in /dev/shm whose launcher has ended. A job's
    segments are named after its launcher's pid (new_job_id); a running
    job's are not leftovers, and CI runs other envs' jobs beside this one
    (one's 3-rank segment, made mid-test, once failed a test here)."""
    left = set()
    for path in glob.glob("/dev/shm/unison-*"):
        launcher = os.path.basename(path).split("-")[1]
        if not (launcher.isdigit() and os.path.exists("/proc/" + launcher)):
            left.add(path)
    return left


@pytest.mark.parametrize("np_", [2, 3])
def test_output_is_prefixed_and_identity_is_set(tmp_path, np_):
    # The identity is under horovodrun's names too, which Horovod scripts
    # read before init() (HOROVOD_LOCAL_RANK, to pick a GPU).
    proc = run(tmp_path, """
        import os
        import unison
        unison.init()
        horovods = [os.environ.get("HOROVOD_" + n) for n in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE",
                                                             "CROSS_RANK", "CROSS_SIZE")]
        assert horovods == [str(v) for v in (unison.rank(), unison.size(), unison.local_rank(), unison.local_size(),
                                             unison.cross_rank(), unison.cross_size())], horovods
        print("hello from", unison.rank(), "of", unison.size(), unison.backend_name())
    """, np_=np_)
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()
    for r in range(np_):
        assert "[%d]<stdout>:hello from %d of %d shm" % (r, r, np_) in out


def test_a_launcher_started_inside_a_rank_starts_a_job_of_its_own(tmp_path, monkeypatch):
    """unisonrun (or unison.run(func)) started from inside a rank inherits
    that rank's wiring: its rendezvous, its elastic driver, the record of
    its init(). None of it may reach the new job's ranks: here the outer
    job's rendezvous and driver listen nowhere, and the new job must not
    notice them."""
    outer = {"UNISON_RANK": "5", "UNISON_SIZE": "8", "UNISON_LOCAL_RANK": "1", "UNISON_LOCAL_SIZE": "4",
             "UNISON_CROSS_RANK": "1", "UNISON_CROSS_SIZE": "2", "UNISON_JOB_ID": "outer",
             "UNISON_RENDEZVOUS_ADDR": "127.0.0.1", "UNISON_RENDEZVOUS_PORT": "9", "UNISON_SECRET_KEY": "outer-job-secret",
             "UNISON_ELASTIC_DRIVER": "127.0.0.1:9", "UNISON_ELASTIC_WORKER": "outer:1", "UNISON_ELASTIC_ROUND": "3",
             "UNISON_INITIALIZED_BY": "1:5", "HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_HOSTNAME": "outer"}
    for name, value in outer.items():
        monkeypatch.setenv(name, value)
    proc = run(tmp_path, """
        import os
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        total = unp.allreduce(np.full(2, unison.rank() + 1, np.int64), op=unison.Sum, name="inner")
        horovods = [os.environ.get("HOROVOD_" + n) for n in ("RANK", "SIZE", "HOSTNAME")]
        print("inner", unison.rank(), unison.size(), unison.backend_name(), total.tolist(), horovods)
    """, np_=3)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    for r in range(3):
        assert "[%d]<stdout>:inner %d 3 shm [6, 6] ['%d', '3', None]" % (r, r, r) in out, out


def run_with_small_dev_shm(tmp_path, megabytes, script, env=None, np_=2):
    """run() in a mount namespace of its own whose /dev/shm is a tmpfs of
    `megabytes`, as in a container (Docker's default is 64 MiB)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a /dev/shm of a chosen size needs root and unshare(1) to mount one in a namespace")
    return run(tmp_path, script, np_, env=env,
               wrapper=["unshare", "--mount", "sh", "-c",
                        'mount -t tmpfs -o size=%dM tmpfs /dev/shm && exec "$@"' % megabytes, "sh"])


def test_too_little_shared_memory_is_an_error_at_init_naming_the_numbers(tmp_path):
    """A job whose shared memory does not fit in /dev/shm fails at init with
    what it needs, what is free and how to change either, not with a SIGBUS
    when a collective first touches a page tmpfs has no room for; and the
    smaller settings it names make the same job run."""
    script = """
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        total = unp.allreduce(np.full(1 << 20, unison.rank() + 1, np.float32), op=unison.Sum, name="big")
        print("sum", unison.rank(), total.min(), total.max())
    """
    proc = run_with_small_dev_shm(tmp_path, 2, script)
    output = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode != 0
    assert ("unison: cannot reserve 8.0 MiB of shared memory for /unison-" in output
            and "(2 ranks of this host, 4.0 MiB each): No space left on device; /dev/shm has" in output
            and "UNISON_SHM_SLOT_BYTES plus twice UNISON_CONTROL_MESSAGE_BYTES" in output), output
    assert "SIGBUS" not in output, output
    proc = run_with_small_dev_shm(tmp_path, 2, script,
                                  {"UNISON_SHM_SLOT_BYTES": "256K", "UNISON_CONTROL_MESSAGE_BYTES": "64K"})
    assert proc.returncode == 0, proc.stderr.decode()
    for r in range(2):
        assert "[%d]<stdout>:sum %d 3.0 3.0" % (r, r) in proc.stdout.decode()


def test_shared_memory_filled_by_others_after_init_cannot_crash_a_collective(tmp_path):
    """/dev/shm is shared (DataLoader workers pass batches through it). Once
    init() has returned, the job's pages are its own: another process filling
    /dev/shm to the last byte leaves every collective working."""
    proc = run_with_small_dev_shm(tmp_path, 10, """
        import errno
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        if unison.rank() == 0:
            with open("/dev/shm/filler", "wb", buffering=0) as filler:
                try:
                    while True:
                        filler.write(b"x" * 65536)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
        unp.barrier()
        total = unp.allreduce(np.full(4 << 20, unison.rank() + 1, np.float32), op=unison.Sum, name="big")
        print("sum", unison.rank(), total.min(), total.max())
    """)
    assert proc.returncode == 0, proc.stderr.decode()
    for r in range(2):
        assert "[%d]<stdout>:sum %d 3.0 3.0" % (r, r) in proc.stdout.decode()


def test_a_process_set_without_room_in_dev_shm_fails_on_every_rank_at_once(tmp_path):
    """At 3 ranks the job's segment (12 MiB) fits in a /dev/shm of 16 MiB;
    a set of ranks 0 and 1 needs 8 MiB more, which it has not. Rank 0, the
    set's first member, cannot create it; every rank then fails
    add_process_set with rank 0's reason at once: rank 1 does not wait the
    start timeout for a segment that never comes, nor rank 2 hold a set that
    exists nowhere. As after any failed collective, the job is then over,
    and its later ops fail with the same reason."""
    proc = run_with_small_dev_shm(tmp_path, 16, """
        import time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        me = unison.rank()
        start = time.monotonic()
        try:
            unison.add_process_set([0, 1])
            print("added", me)
        except unison.UnisonError as e:
            print("refused", me, "after %.1f s:" % (time.monotonic() - start), type(e).__name__, e)  # for the log
        try:
            unp.allreduce(np.full(3, me + 1, np.int64), op=unison.Sum, name="after")
            print("after", me, "ran")
        except unison.UnisonError as e:
            print("after", me, "failed:", e)
    """, np_=3)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    reason = re.compile(r"cannot reserve 8\.0 MiB of shared memory for /unison-\S+-set1-2-g0 \(2 ranks of this "
                        r"host, 4\.0 MiB each\): No space left on device; /dev/shm has")
    for r in range(3):
        line = re.search(r"\[%d\]<stdout>:refused %d after ([0-9.]+) s: UnisonInternalError (.*)" % (r, r), out)
        assert line and reason.search(line.group(2)), out
        if r != 0:
            assert line.group(2).startswith("unison: process set 1: rank 0 (pid "), out
        after = re.search(r"\[%d\]<stdout>:after %d failed: (.*)" % (r, r), out)
        assert after and reason.search(after.group(1)), out


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("how", ["os._exit(3)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_rank_dies_mid_run_and_survivors_fail_fast(tmp_path, np_, how):
    before = shm_segments()
    proc = run(tmp_path, """
        import os, signal, sys, time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        for step in range(5):
            unp.allreduce(np.ones(1000), name="w")
        if unison.rank() == 1:
            %s
        start = time.monotonic()
        try:
            for step in range(100):
                unp.allreduce(np.ones(1000), name="w")
        except unison.RankFailedError as e:
            print("survivor %%d failed after %%.2f s: %%s" %% (unison.rank(), time.monotonic() - start, e))
            sys.exit(17)
    """ % how, np_=np_)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode != 0
    survivors = [line for line in out.splitlines() if "survivor" in line]
    assert len(survivors) == np_ - 1, out + err
    for line in survivors:
        seconds = float(line.split("after ")[1].split(" s")[0])
        assert seconds < 10, line
        assert "rank 1 (pid" in line and "exited" in line
    assert "unisonrun: job failed: rank 1" in err
    assert ("exited with status 3" in err) if "_exit" in how else ("killed by signal 9 (SIGKILL)" in err)
    assert shm_segments() - before == set()


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_rank_killed_at_a_random_moment_is_named_by_every_survivor(tmp_path, victim):
    """One of 3 ranks is killed at a random moment of a random stream of
    asynchronous allreduces, allgathers and broadcasts of up to 36 MB, so
    it dies anywhere: between ops, mid-negotiation, mid-round of the shared
    memory data plane. Each survivor ends on its first error, as a training
    script does. Every survivor fails within seconds with RankFailedError
    naming the rank that was killed, even one that hears of it from a
    survivor that went first, and nothing is left in /dev/shm."""
    before = shm_segments()
    proc = run(tmp_path, """
        import os, signal, sys, threading, time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        me, n = unison.rank(), unison.size()
        rng = np.random.default_rng(%d)   # the same stream on every rank
        delay = rng.uniform(0.05, 0.6)
        if me == %d:
            threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        sizes = [1, 1000, 40_000, 2_000_000, 9_000_000]
        start = time.monotonic()
        try:
            for step in range(100_000):
                handles = []
                for i in range(int(rng.integers(1, 8))):
                    x = np.ones(sizes[rng.integers(len(sizes))], np.float32)
                    kind = rng.integers(3)
                    if kind == 0:
                        handles.append(unp.allreduce_async_(x, op=unison.Sum, name="t%%d" %% i))
                    elif kind == 1:
                        handles.append(unp.allgather_async(x[: x.size // 2 + 1], name="t%%d" %% i))
                    else:
                        handles.append(unp.broadcast_async_(x, 0, name="t%%d" %% i))
                for h in handles:
                    unp.synchronize(h)
                if step %% 7 == 0:
                    unp.barrier()
        except unison.UnisonError as e:
            print("survivor %%d after %%.1f s: %%s: %%s" %% (me, time.monotonic() - start, type(e).__name__, e),
                  flush=True)
            sys.exit(17)
    """ % (victim, victim), np_=3)
    out = proc.stdout.decode()
    survivors = re.findall(r"survivor (\d) after ([0-9.]+) s: (\w+): (.*)", out)
    assert sorted(int(r) for r, _, _, _ in survivors) == sorted(set(range(3)) - {victim}), out
    for rank, seconds, kind, message in survivors:
        assert kind == "RankFailedError" and message.startswith("unison: rank %d (pid " % victim), out
        assert float(seconds) < 10, out
    assert "unisonrun: job failed: rank %d was killed by signal 9 (SIGKILL)" % victim in proc.stderr.decode()
    assert shm_segments() - before == set()


def test_pending_op_fails_when_peer_dies_while_waiting(tmp_path):
    # Rank 0 waits on a tensor rank 1 never submits; rank 1 dies instead.
    proc = run(tmp_path, """
        import os, sys, time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        if unison.rank() == 1:
            time.sleep(0.5)
            os._exit(5)
        start = time.monotonic()
        try:
            unp.allreduce(np.ones(3), name="never")
        except unison.RankFailedError as e:
            print("waited %.2f s: %s" % (time.monotonic() - start, e))
            sys.exit(0)
    """)
    out = proc.stdout.decode()
    assert "waited" in out and "rank 1" in out, out + proc.stderr.decode()
    waited = float(out.split("waited ")[1].split(" s")[0])
    assert waited < 10
    assert proc.returncode == 5


def test_failed_rank_exit_status_is_the_launchers(tmp_path):
    proc = run(tmp_path, """
        import sys, unison
        unison.init()
        sys.exit(4 if unison.rank() == 0 else 0)
    """)
    assert proc.returncode == 4
    assert "rank 0 exited with status 4" in proc.stderr.decode()


def two_ranks_ready(command):
    """unisonrun -np 2 of `command`, once both ranks have printed "ready"."""
    proc = subprocess.Popen([sys.executable, "-m", "unison.run", "-np", "2"] + command,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    ready = 0
    while ready < 2 and time.monotonic() < deadline:
        ready += proc.stdout.readline().endswith(b">:ready\n")
    assert ready == 2, "the ranks did not start within 30 s"
    return proc


def test_sigterm_is_forwarded_to_every_rank(tmp_path):
    script = tmp_path / "sleepy.py"
    script.write_text(textwrap.dedent("""
        import signal, sys, time, unison
        unison.init()
        def bye(signum, frame):
            print("rank", unison.rank(), "got", signum, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(60)
    """))
    proc = two_ranks_ready([sys.executable, str(script)])
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    out = out.decode()
    assert "rank 0 got 15" in out and "rank 1 got 15" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("rank_1", ["ignores it", "is stopped and ignores it", "is stopped"])
def test_a_rank_told_to_stop_ends_at_once_or_is_killed_after_the_grace_period(tmp_path, signum, rank_1):
    """The launcher told to stop forwards the signal; a rank that ignores
    it used to keep the launcher waiting for ever, and is killed 5 s later.
    A rank stopped by SIGSTOP is continued after the signal, so that it
    sees it: one that then ends ends the job at once, instead of waiting
    to be killed."""
    script = tmp_path / "stubborn.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time, unison
        unison.init()
        if unison.rank() == 1 and "ignore" in sys.argv[1]:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", flush=True)
        if unison.rank() == 1 and "stop" in sys.argv[1]:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    """))
    proc = two_ranks_ready([sys.executable, str(script), rank_1.replace(" ", "-")])
    time.sleep(0.5)  # rank 1 has stopped itself, or is asleep
    told = time.monotonic()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=40)
    took = time.monotonic() - told
    err = err.decode()
    if "ignores" in rank_1:
        # Rank 0 ends by the signal; the job's status is that, its first rank to end's.
        assert "unisonrun: rank 1 still running 5 s after signal %d; killing it\n" % signum in err, err
        assert "job failed: rank 0 was killed by signal %d" % signum in err, err
        assert proc.returncode == 128 + signum, err
        assert 5 <= took < 15, (took, err)
    else:
        assert "still running" not in err, err
        # Both end by the signal, and either may be seen to end first.
        assert re.search(r"job failed: rank [01] was killed by signal %d " % signum, err), err
        assert proc.returncode == 128 + signum, err
        assert took < 4, (took, err)


def test_check_build_lists_data_planes():
    proc = subprocess.run([sys.executable, "-m", "unison.run", "--check-build"], stdout=subprocess.PIPE, timeout=60)
    out = proc.stdout.decode()
    assert proc.returncode == 0
    assert "[X] Shared memory" in out and "[X] NumPy" in out
    # MPI is there exactly when the core was built against one (tox env mpi).
    from unison import basics
    assert ("[X] MPI" if "mpi" in basics.built_backends() else "[ ] MPI") in out
    # CUDA and NCCL are found at run time, and the line says which were.
    assert ("[X] NCCL" if basics.nccl_built() else "[ ] NCCL") in out
    assert "GPU support (found at run time): CUDA: " in out and "; NCCL: " in out


def test_output_files(tmp_path):
    proc = run(tmp_path, """
        import unison
        unison.init()
        print("line from", unison.rank())
    """, extra=("--output-filename", str(tmp_path / "logs")))
    assert proc.returncode == 0
    for r in range(2):
        assert (tmp_path / "logs" / ("rank.%d" % r) / "stdout").read_text() == "line from %d\n" % r


def test_shared_memory_is_private_and_gone_after_init(tmp_path):
    proc = run(tmp_path, """
        import glob, os, unison
        unison.init()
        job = os.environ["UNISON_JOB_ID"]
        print("segments", len(glob.glob("/dev/shm/unison-%s-*" % job)))
    """)
    assert proc.returncode == 0
    assert proc.stdout.decode().count("segments 0") == 2


MADE_FIRST = """
import sys, unison
try:
    unison.init()
    print("rank %s: init() returned" % sys.argv[1], flush=True)
except unison.UnisonError as e:
    print("rank %s: %s" % (sys.argv[1], e), flush=True)
"""


@pytest.mark.parametrize("mode", ["0600", "0666"])
def test_shared_memory_another_user_made_first_is_refused_naming_its_owner(tmp_path, mode):
    """Another local user (nobody, here) makes the job's segment first, as
    someone who read the job id off a command line could: private to them
    (0600) or open to all (0666), of the size the job would make. Neither
    rank may use it (rank 0 would create, rank 1 attach), each names the
    owner, and it is left where it is, for its owner to remove."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("making a file as another user needs root and util-linux's setpriv")
    job = "owner-test-%d-%s" % (os.getpid(), mode)
    path = "/dev/shm/unison-%s-2-g0" % job
    make = ("import os\nfd = os.open(%r, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)\n"
            "os.fchmod(fd, 0o%s)\nos.ftruncate(fd, 8 << 20)\n" % (path, mode))
    subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", make],
                   check=True)
    script = tmp_path / "made_first.py"
    script.write_text(MADE_FIRST)
    try:
        procs = [subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT,
                                  env=dict(os.environ, UNISON_RANK=str(r), UNISON_SIZE="2", UNISON_LOCAL_RANK=str(r),
                                           UNISON_LOCAL_SIZE="2", UNISON_JOB_ID=job, UNISON_START_TIMEOUT="20"))
                 for r in range(2)]
        outputs = [p.communicate(timeout=60)[0].decode(errors="replace") for p in procs]
        for r, output in enumerate(outputs):
            assert ("rank %d: unison: shared memory /unison-%s-2-g0 exists already and belongs to uid 65534 with "
                    "mode %s, not to this user (uid 0) alone" % (r, job, mode)) in output, output
        assert os.stat(path).st_uid == 65534
    finally:
        os.unlink(path)


def test_stall_inspector_warns_then_fails_naming_the_missing_rank(tmp_path):
    # Rank 1 never submits 'fresh' (a full request) nor 'w' (a cached one).
    proc = run(tmp_path, """
        import time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        for _ in range(2):
            unp.allreduce(np.ones(2), name="w")
        if unison.rank() == 0:
            for name in ["fresh", "w"]:
                try:
                    unp.allreduce(np.ones(2), name=name)
                except unison.StalledError as e:
                    print("stalled:", e, flush=True)
        else:
            time.sleep(7)
        unp.barrier()
        print("still usable", unison.rank(), flush=True)
    """, extra=("--stall-check-warning-time-seconds", "1", "--stall-check-shutdown-time-seconds", "2.5"))
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    for name in ("fresh", "w"):
        assert ("allreduce '%s' waited" % name) in out, out
    assert out.count("submitted by ranks [0], missing from ranks [1]") == 2, out
    assert "some ranks have waited more than 1 s" in err
    assert "UNISON_STALL_SHUTDOWN_TIME_SECONDS fails them" not in err  # it is set
    assert "still usable 0" in out and "still usable 1" in out


@pytest.mark.parametrize("submitted_by", ["caller", "graph-node", "hook"])
@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_blocked_on_different_tensors_fail_as_a_deadlock_then_go_on(tmp_path, np_, submitted_by):
    # Rank 0 took a branch the others did not: it waits on 'extra', they wait
    # on 'loss'. Horovod warns every minute and waits forever; here, once
    # every rank is blocked and nothing moved for the warning time, every
    # rank's op fails with the whole picture, and the job goes on.
    # submitted_by="graph-node" is the contract a graph framework's front end
    # relies on (GraphNode, as in a tf.function): a worker thread runs each
    # collective while the main thread waits for it outside unison. Another
    # worker that ran a node and idles since is no submitter; the main
    # thread, a submitter since its own 'w', counts as blocked while the
    # node it waits for is. submitted_by="hook" is PyTorch on a GPU: the
    # autograd thread's hook starts each collective inside GraphNode and
    # the main thread, which never enqueues, waits for it itself.
    proc = run(tmp_path, """
        import concurrent.futures, os, threading
        import numpy as np
        import unison, unison.numpy as unp
        from unison.handles import GraphNode
        unison.init()
        r = unison.rank()
        allreduce = unp.allreduce
        if os.environ["SUBMITTED_BY"] == "graph-node":
            caller = threading.get_native_id()
            def on(worker, *args, **kwargs):
                def node():
                    with GraphNode(caller):
                        return unp.allreduce(*args, **kwargs)
                return worker.submit(node).result()
            idle, worker = concurrent.futures.ThreadPoolExecutor(1), concurrent.futures.ThreadPoolExecutor(1)
            on(idle, np.ones(2), name="idle")
            allreduce = lambda *args, **kwargs: on(worker, *args, **kwargs)
            unp.allreduce(np.ones(2), name="w")
        elif os.environ["SUBMITTED_BY"] == "hook":
            caller, hooks = threading.get_native_id(), concurrent.futures.ThreadPoolExecutor(1)
            def hook(*args, **kwargs):
                with GraphNode(caller):
                    return unp.allreduce_async(*args, **kwargs)
            allreduce = lambda *args, **kwargs: unp.synchronize(hooks.submit(hook, *args, **kwargs).result())
        else:
            unp.allreduce(np.ones(2), name="w")
        try:
            if r == 0:
                allreduce(np.ones(2), name="extra")
            allreduce(np.ones(2), name="loss")
        except unison.DeadlockError as e:
            print("rank %d: %s" % (r, e), flush=True)
        total = allreduce(np.full(2, r + 1.0), op=unison.Sum, name="after")
        print("after", r, total.tolist(), flush=True)
    """, np_=np_, extra=("--stall-check-warning-time-seconds", "1.5"), env={"SUBMITTED_BY": submitted_by})
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    others = "[%s]" % ", ".join(str(r) for r in range(1, np_))
    for r in range(np_):
        mine = "\n".join(line for line in out.splitlines() if line.startswith("[%d]<stdout>:" % r))
        assert ("rank %d: unison: deadlock: every rank is blocked" % r) in mine, out
        # The ages depend on when each rank last moved: any will do.
        assert re.search(r"allreduce 'extra' waited \d+ s: submitted by ranks \[0\], missing from ranks "
                         + re.escape(others), mine), out
        assert re.search(r"allreduce 'loss' waited \d+ s: submitted by ranks " + re.escape(others)
                         + r", missing from ranks \[0\]", mine), out
        assert "UNISON_STALL_CHECK_DISABLE=1 waits instead" in mine, out
        assert ("after %d %s" % (r, [np_ * (np_ + 1) / 2] * 2)) in out, out


@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_whose_other_thread_is_busy_is_not_a_deadlock(tmp_path, np_):
    # Rank 0's helper thread waits on 'a', which the others submit only after
    # 'b'; rank 0's main thread, which has submitted before, is busy past the
    # warning time and then submits 'b'. Every thread that waits is blocked,
    # but rank 0's main thread is not: a slow job, which must finish.
    proc = run(tmp_path, """
        import threading, time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        r = unison.rank()
        unp.allreduce(np.ones(2), name="w")
        if r == 0:
            got = []
            helper = threading.Thread(target=lambda: got.append(unp.allreduce(np.ones(2), op=unison.Sum, name="a")))
            helper.start()
            time.sleep(3.5)
            print("b", unp.allreduce(np.ones(2), op=unison.Sum, name="b"), flush=True)
            helper.join()
            print("a", got[0], flush=True)
        else:
            print("b", unp.allreduce(np.ones(2), op=unison.Sum, name="b"), flush=True)
            print("a", unp.allreduce(np.ones(2), op=unison.Sum, name="a"), flush=True)
    """, np_=np_, extra=("--stall-check-warning-time-seconds", "1"))
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    assert "deadlock" not in out + err, out + err
    assert "some ranks have waited more than 1 s" in err, err
    assert "UNISON_STALL_SHUTDOWN_TIME_SECONDS fails them after that many seconds" in err, err
    for r in range(np_):
        for name in "ab":
            assert ("[%d]<stdout>:%s [%d. %d.]" % (r, name, np_, np_)) in out, out


def test_a_set_whose_members_are_blocked_waits_for_a_busy_rank_outside_it(tmp_path):
    # Set {0, 1}: rank 0 has started the global 'x' and waits on the set's
    # 'z'; rank 1 waits on 'x' before it submits 'z'; rank 2 is busy, then
    # submits 'x'. Both of the set's members are blocked, but the job is not
    # deadlocked: 'x' runs once rank 2 comes, and then 'z'.
    proc = run(tmp_path, """
        import time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        r = unison.rank()
        pair = unison.add_process_set([0, 1])
        if r == 0:
            x = unp.allreduce_async(np.ones(2), op=unison.Sum, name="x")
            print("z", unp.allreduce(np.ones(2), op=unison.Sum, name="z", process_set=pair), flush=True)
            print("x", unp.synchronize(x), flush=True)
        elif r == 1:
            print("x", unp.allreduce(np.ones(2), op=unison.Sum, name="x"), flush=True)
            print("z", unp.allreduce(np.ones(2), op=unison.Sum, name="z", process_set=pair), flush=True)
        else:
            time.sleep(3.5)
            print("x", unp.allreduce(np.ones(2), op=unison.Sum, name="x"), flush=True)
        unp.barrier()  # rank 2 stays until the set is done: a rank that shuts down ends every collective
    """, np_=3, extra=("--stall-check-warning-time-seconds", "1"))
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    assert "deadlock" not in out + err, out + err
    assert "[0]<stdout>:z [2. 2.]" in out and "[1]<stdout>:z [2. 2.]" in out, out
    for r in range(3):
        assert ("[%d]<stdout>:x [3. 3.]" % r) in out, out


@pytest.mark.parametrize("np_", [3, 4])
def test_a_set_member_quiet_in_its_set_for_the_peer_timeout_is_alive_and_a_dead_one_is_named(tmp_path, np_):
    # Sets {0, 1} and {1, ..., n-1}, both older than the peer timeout. Each
    # cycle rank 1 runs a large allreduce in the pair before the small one
    # in the rest, so the rest's other members wait for it in the rest's
    # segment long enough to look at their peers. Rank 1 had never waited
    # there: a set's own heartbeats called it dead after the peer timeout.
    # Then rank n-1 dies, and every survivor names it.
    proc = run(tmp_path, """
        import os, time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        r, n = unison.rank(), unison.size()
        pair = unison.add_process_set([0, 1])
        rest = unison.add_process_set(list(range(1, n)))
        big = np.full(1 << 24, float(r + 1), dtype=np.float32)
        time.sleep(2.5)
        for step in range(3):
            handles = []
            if pair.included():
                handles.append(unp.allreduce_async(big, op=unison.Sum, name="big.%d" % step, process_set=pair))
            if rest.included():
                handles.append(unp.allreduce_async(np.array([r + 1]), op=unison.Sum, name="small.%d" % step,
                                                   process_set=rest))
            results = [unp.synchronize(h) for h in handles]
            if pair.included():
                assert (results[0] == 3.0).all(), results[0][:4]
            if rest.included():
                assert results[-1].tolist() == [n * (n + 1) // 2 - 1], results[-1]
        print("rank %d: alive" % r, flush=True)
        unp.barrier()
        if r == n - 1:
            os._exit(3)
        try:
            if rest.included():
                unp.allreduce(np.ones(1), name="after", process_set=rest)
            else:
                unp.barrier()
        except unison.HorovodInternalError as e:
            print("rank %d: %s" % (r, e), flush=True)
    """, np_=np_, extra=("--peer-timeout-seconds", "1"))
    out, err = proc.stdout.decode(), proc.stderr.decode()
    for r in range(np_):
        assert "[%d]<stdout>:rank %d: alive" % (r, r) in out, out + err
    assert "no sign of life" not in out + err, out + err
    # A survivor names every peer it finds gone: a slow one may also see
    # another survivor that has already exited. The dead rank is among them.
    for r in range(np_ - 1):
        assert re.search(r"\[%d\]<stdout>:rank %d: unison: (rank \d+ \(pid \d+\), )*rank %d \(pid \d+\)"
                         r"(, rank \d+ \(pid \d+\))* exited" % (r, r, np_ - 1), out), out + err
    assert "unisonrun: job failed: rank %d exited with status 3" % (np_ - 1) in err, out + err


def test_log_level_error_silences_the_stall_warning_not_the_failure(tmp_path):
    proc = run(tmp_path, """
        import time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        if unison.rank() == 0:
            try:
                unp.allreduce(np.ones(2), name="alone")
            except unison.StalledError as e:
                print("stalled:", e, flush=True)
        else:
            time.sleep(5)
        unp.barrier()
    """, extra=("--log-level", "ERROR", "--stall-check-warning-time-seconds", "1",
                "--stall-check-shutdown-time-seconds", "2.5"))
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    assert "stalled: " in out and "submitted by ranks [0], missing from ranks [1]" in out, out
    assert "some ranks have waited" not in err, err


def test_horovodrun_flags(tmp_path):
    # A horovodrun command line with its controller and cache flags runs
    # as it is, with unisonrun in place of horovodrun.
    proc = run(tmp_path, """
        import unison
        unison.init()
        print("rank", unison.rank(), "of", unison.size(), flush=True)
    """, extra=("--gloo", "--disable-cache", "--log-level", "debug"))
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    assert "rank 0 of 2" in out and "rank 1 of 2" in out, out
    version = subprocess.run([sys.executable, "-m", "unison.run", "-v"], stdout=subprocess.PIPE, timeout=60)
    assert version.returncode == 0 and version.stdout.decode().startswith("unisonrun (unison) "), version.stdout
    both = subprocess.run([sys.executable, "-m", "unison.run", "--gloo", "--mpi", "-np", "2", "true"],
                          stderr=subprocess.PIPE, timeout=60)
    assert both.returncode == 2 and b"not allowed with argument --gloo" in both.stderr, both.stderr
    from unison.runner.command_line import parse as _parse
    args = _parse(["-np", "2", "--min-num-proc", "1", "--max-num-proc", "3", "--slots-per-host", "2",
                   "--host-discovery-script", "./hosts.sh", "-cb", "python", "train.py"])
    assert (args.min_np, args.max_np, args.slots, args.check_build) == (1, 3, 2, True)
    assert _parse(["-np", "2", "-hostfile", "hosts.txt", "true"]).hostfile == "hosts.txt"
    # `--` ends the options, and only the first is the launcher's.
    assert _parse(["-np", "2", "--", "python", "train.py", "--", "x"]).command == ["python", "train.py", "--", "x"]
    assert _parse(["-np", "2", "--", "--verbose"]).command == ["--verbose"]
    assert _parse(["-np", "2", "python", "--", "x"]).command == ["python", "--", "x"]


def test_the_rest_of_horovodruns_flags(tmp_path, monkeypatch):
    from unison.runner.command_line import parse as _parse, settings as _settings

    def refused(*argv):
        proc = subprocess.run([sys.executable, "-m", "unison.run", "-np", "2", *argv, "true"],
                              stderr=subprocess.PIPE, timeout=60)
        assert proc.returncode == 2, proc.stderr
        return proc.stderr.decode()

    # horovodrun's list form of the interface, and its hidden negations;
    # the log timestamp flags change nothing.
    assert _parse(["-np", "2", "--network-interfaces", "eth0", "true"]).network_interface == "eth0"
    assert _parse(["-np", "2", "--network-interface", "eth0", "--network-interface", "eth0", "true"]
                  ).network_interface == "eth0"
    assert _parse(["-np", "2", "true"]).network_interface is None
    for flags in (["--log-without-timestamp"], ["--log-hide-timestamp"], ["--no-log-hide-timestamp"],
                  ["--no-mpi-threads-disable"], ["--stall-check"], ["--no-autotune"], ["--no-timeline-mark-cycles"]):
        assert _settings(_parse(["-np", "2", *flags, "true"])) == {}, flags
    # Gloo's timeout is the ranks' meeting here.
    assert _settings(_parse(["-np", "2", "--gloo-timeout-seconds", "45", "true"])) == {"UNISON_START_TIMEOUT": "45.0"}
    assert _settings(_parse(["-np", "2", "--thread-affinity", "3, 1", "true"])) == {"UNISON_THREAD_AFFINITY": "3,1"}
    # A negation on the command line wins over the file's setting.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "on.json").write_text('{"autotune": {"enabled": true}, "stall_check": {"enabled": false}, '
                                      '"timeline": {"filename": "t.json", "mark_cycles": true}}')
    assert set(_settings(_parse(["-np", "2", "--config-file", "on.json", "true"]))) == {
        "UNISON_AUTOTUNE", "UNISON_STALL_CHECK_DISABLE", "UNISON_TIMELINE", "UNISON_TIMELINE_MARK_CYCLES"}
    assert set(_settings(_parse(["-np", "2", "--no-autotune", "--stall-check", "--no-timeline-mark-cycles",
                                 "--config-file", "on.json", "true"]))) == {"UNISON_TIMELINE"}
    # What cannot be honoured is refused, naming the flag and its value.
    assert ("--network-interface(s) eth0,eth1: the ranks listen on one interface or address; give one"
            in refused("--network-interfaces", "eth0,eth1"))
    assert "--network-interface(s) eth0,eth1: " in refused("--network-interface", "eth0", "--network-interface", "eth1")
    assert "--jsrun: unisonrun does not start ranks through LSF's jsrun" in refused("--jsrun")
    assert ("--binding-args --bind-to core: binding is mpirun's, and this job does not start through mpirun: add "
            "--mpi" in refused("--binding-args=--bind-to core"))
    assert "--thread-affinity 0,x: give core numbers separated by commas" in refused("--thread-affinity", "0,x")
    assert "not allowed with argument" in refused("--start-timeout", "5", "--gloo-timeout-seconds", "6")


def test_every_setting_in_the_core_table_with_an_option_is_set_by_it_and_by_its_config_key(tmp_path, monkeypatch):
    """The core's settings table (native/config.cc) is the one place a
    setting's launcher option and config-file key are written: each row
    with an option is an option of unisonrun, shown in --help with its
    variable; a value given to it reaches the ranks' environment as that
    variable, in a form the core's own parser takes; and its key in
    horovodrun's config file sets the same."""
    import json
    from unison.basics import setting_table, settings_problem
    from unison.runner.command_line import parse, settings
    monkeypatch.chdir(tmp_path)
    rows = [row for row in setting_table() if row["flag"]]
    assert len(rows) >= 17 and len({row["flag"] for row in rows}) == len(rows), rows
    shown = subprocess.run([sys.executable, "-m", "unison.runner", "--help"], stdout=subprocess.PIPE,
                           timeout=60).stdout.decode()
    shown = " ".join(shown.split())
    keys = 0
    for row in rows:
        assert row["flag"] in shown and row["name"] in shown, row
        # A value the option takes, the variable it must come out as, and the same in the config file.
        kind, flag = row["kind"], row["flag"]
        if kind == "flag":
            argv, expected, in_file = [flag], "1", not flag.startswith("--no-")
        elif kind == "integer":
            value = int(min(max(row["minimum"], 2), row["maximum"]))
            argv, expected, in_file = [flag, str(value)], str(value), value
        elif kind == "bytes":
            argv, expected, in_file = [flag, "2"], str(2 * 1024 * 1024), 2
        elif kind == "number":
            argv, expected, in_file = [flag, "2.5"], "2.5", 2.5
        elif kind == "choice":
            argv, expected, in_file = [flag, row["choices"][-1].upper()], row["choices"][-1], row["choices"][-1]
        elif kind == "path":
            argv, expected, in_file = [flag, "out.file"], str(tmp_path / "out.file"), "out.file"
        elif kind == "core-list":
            argv, expected, in_file = [flag, "0"], "0", None
        else:
            raise AssertionError("no option is expected for a setting of kind %s: %s" % (kind, row))
        needs = ["--autotune"] if flag.startswith("--autotune-") else []
        env = settings(parse(["-np", "2"] + needs + argv + ["true"]))
        assert env.get(row["name"]) == expected, (row, env)
        assert settings_problem({row["name"]: expected}) is None, row
        if row["config_key"]:
            keys += 1
            section, _, key = row["config_key"].partition(".")
            (tmp_path / "c.json").write_text(json.dumps({section: {key: in_file}}))
            env = settings(parse(["-np", "2"] + needs + ["--config-file", "c.json", "true"]))
            assert env.get(row["name"]) == (expected if kind != "number" else "2.5"), (row, env)
    assert keys >= 15


@pytest.mark.parametrize("np_", [2, 3])
def test_a_network_interface_is_nccls_too_as_with_horovodrun(tmp_path, monkeypatch, np_):
    """horovodrun points NCCL's sockets (NCCL_SOCKET_IFNAME) at the interface
    it is given; a NCCL_SOCKET_IFNAME of the user's own wins, and an address
    or 0.0.0.0 names no interface."""
    from unison.runner.command_line import parse as _parse, settings as _settings

    def what_every_rank_sees(env):
        proc = run(tmp_path, """
            import os, unison
            unison.init()
            print("rank %d: %s" % (unison.rank(), os.environ.get("NCCL_SOCKET_IFNAME")), flush=True)
        """, np_=np_, extra=("--network-interface", "lo"), env=env)
        out = proc.stdout.decode()
        assert proc.returncode == 0, out + proc.stderr.decode()
        seen = sorted(re.findall(r"rank (\d+): (.*)", out))
        assert [int(r) for r, _ in seen] == list(range(np_)), out
        return {value for _, value in seen}

    assert what_every_rank_sees({"NCCL_SOCKET_IFNAME": "ib0"}) == {"ib0"}
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert what_every_rank_sees({}) == {"lo"}
    for given, nccls in (("lo", "lo"), ("127.0.0.1", None), ("0.0.0.0", None)):
        assert _settings(_parse(["-np", "2", "--network-interface", given, "true"])).get("NCCL_SOCKET_IFNAME") == nccls


def test_prefix_output_with_timestamp(tmp_path):
    proc = run(tmp_path, """
        import sys
        import unison
        unison.init()
        print("out of", unison.rank(), flush=True)
        print("err of", unison.rank(), file=sys.stderr, flush=True)
    """, extra=("-prefix-timestamp", "--output-filename", "logs"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6} "
    for rank in range(2):
        assert re.search(r"(?m)^%s\[%d\]<stdout>:out of %d$" % (stamp, rank, rank), proc.stdout.decode()), proc.stdout
        assert re.search(r"(?m)^%s\[%d\]<stderr>:err of %d$" % (stamp, rank, rank), proc.stderr.decode()), proc.stderr
        logged = (tmp_path / "logs" / ("rank.%d" % rank) / "stdout").read_text()
        assert re.fullmatch(r"%sout of %d\n" % (stamp, rank), logged), logged
    # Without the flag, the lines are as before.
    plain = run(tmp_path, "print('plain', flush=True)\n", np_=1)
    assert plain.stdout.decode() == "[0]<stdout>:plain\n", plain.stdout


ENGINE_THREAD_CORES = """
    import glob, os
    import numpy as np
    import unison, unison.numpy as unp

    def read(task, name):
        # A thread can end between the glob and the open (init's Ctrl-C
        # watcher, say): Linux then answers ENOENT or ESRCH, depending on
        # how far the thread's exit had got.
        try:
            return open(task + "/" + name).read()
        except (FileNotFoundError, ProcessLookupError):
            return ""

    def cores(task):
        for line in read(task, "status").splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split()[1]

    # Set here, past the launcher, which refuses a setting that no rank's
    # init() could read before any rank starts.
    if "AFFINITY_TO_TRY" in os.environ:
        os.environ["UNISON_THREAD_AFFINITY"] = os.environ["AFFINITY_TO_TRY"]
    try:
        unison.init()
    except unison.InvalidArgumentError as e:
        print("refused:", e, flush=True)
        # The process stays usable: with the setting put right, init works.
        os.environ["UNISON_THREAD_AFFINITY"] = ",".join(["0"] * unison_size_here)
        unison.init()
    def named(task):
        return read(task, "comm").strip()

    engine = [cores(t) for t in glob.glob("/proc/self/task/*") if named(t) == "unison-engine"]
    total = unp.allreduce(np.full(3, unison.rank() + 1.0), op=unison.Sum, name="x")
    print("engine", ",".join(engine), "main", cores("/proc/self/task/%d" % os.getpid()), "sum", total.tolist(),
          flush=True)
"""


def own_cores():
    for line in open("/proc/self/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]


@pytest.mark.parametrize("np_,how", [(2, "flag"), (3, "flag"), (2, "HOROVOD_THREAD_AFFINITY")])
def test_thread_affinity_pins_each_local_ranks_engine_thread_and_nothing_else(tmp_path, np_, how):
    usable = sorted(os.sched_getaffinity(0))
    # Local rank r takes the core after the r-th, so rank 0 is not on the first core by chance.
    cores = [usable[(r + 1) % len(usable)] for r in range(np_)]
    listed = ",".join(map(str, cores))
    extra, env = (("--thread-affinity", listed), None) if how == "flag" else ((), {how: listed})
    proc = run(tmp_path, ENGINE_THREAD_CORES.replace("unison_size_here", str(np_)), np_=np_, extra=extra, env=env)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    total = [np_ * (np_ + 1) / 2] * 3
    for r in range(np_):
        assert "[%d]<stdout>:engine %d main %s sum %s\n" % (r, cores[r], own_cores(), total) in out, out
    assert "refused" not in out, out


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("setting,message", [
    ("0", "UNISON_THREAD_AFFINITY='0' names 1 core(s), but this host runs {np} ranks: give one core for each"),
    ("1000,1001,1002", "UNISON_THREAD_AFFINITY='1000,1001,1002' gives local rank {rank} core 100{rank}, which this "
                       "process may not run on (it may use {usable})"),
    ("0,x", "UNISON_THREAD_AFFINITY='0,x' is not a comma-separated list of core numbers, one for each rank on the host"),
])
def test_a_thread_affinity_that_cannot_be_honoured_fails_init_naming_it(tmp_path, np_, setting, message):
    proc = run(tmp_path, ENGINE_THREAD_CORES.replace("unison_size_here", str(np_)), np_=np_,
               env={"AFFINITY_TO_TRY": setting})
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    usable = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    for r in range(np_):
        assert "[%d]<stdout>:refused: unison: %s\n" % (r, message.format(np=np_, rank=r, usable=usable)) in out, out
        # and then, with the setting put right, the job runs.
        assert "[%d]<stdout>:engine %s main %s sum %s\n" % (r, "0", own_cores(), [np_ * (np_ + 1) / 2] * 3) in out, out


HOROVOD_CONFIG = """
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 2.5
  cache_capacity: 512
  hierarchical_allreduce: false
  hierarchical_allgather: false
autotune:
  enabled: true
  warmup_samples: 2
  steps_per_sample: 3
  bayes_opt_max_samples: 20
  gaussian_process_noise: 0.8
timeline:
  filename: trace.json
  mark_cycles: true
stall_check:
  enabled: true
  warning_time_seconds: 30
  shutdown_time_seconds: 120
library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  ccl_bgt_affinity: 0
  gloo_timeout_seconds: 45
logging:
  level: ERROR
  with_timestamp: true
"""


def test_horovodrun_config_file_sets_what_the_command_line_leaves(tmp_path, monkeypatch):
    # Horovod's own file, every section and key; -cycle-time-ms on the
    # command line wins over the file's 2.5.
    import json
    import yaml
    from unison.runner.command_line import parse as _parse, settings as _settings
    monkeypatch.chdir(tmp_path)
    (tmp_path / "horovod.yaml").write_text(HOROVOD_CONFIG)
    args = _parse(["-np", "2", "--config-file", "horovod.yaml", "--cycle-time-ms", "1", "python", "train.py"])
    expected = {"UNISON_FUSION_THRESHOLD": str(32 * 1024 * 1024), "UNISON_CYCLE_TIME": "1.0",
                "UNISON_CACHE_CAPACITY": "512", "UNISON_HIERARCHICAL_ALLREDUCE": "0", "UNISON_AUTOTUNE": "1",
                "UNISON_AUTOTUNE_WARMUP_SAMPLES": "2", "UNISON_AUTOTUNE_STEPS_PER_SAMPLE": "3",
                "UNISON_TIMELINE": str(tmp_path / "trace.json"), "UNISON_TIMELINE_MARK_CYCLES": "1",
                "UNISON_STALL_CHECK_TIME_SECONDS": "30", "UNISON_STALL_SHUTDOWN_TIME_SECONDS": "120",
                "UNISON_START_TIMEOUT": "45", "UNISON_LOG_LEVEL": "error"}
    assert _settings(args) == expected
    assert args.gloo and not args.mpi
    # The same settings as JSON need no PyYAML.
    (tmp_path / "horovod.json").write_text(json.dumps(yaml.safe_load(HOROVOD_CONFIG)))
    monkeypatch.setitem(sys.modules, "yaml", None)
    args = _parse(["-np", "2", "--config-file", "horovod.json", "--cycle-time-ms", "1", "python", "train.py"])
    assert _settings(args) == expected
    from unison.runner import config_file as run_config
    with pytest.raises(ValueError, match=r"it is not JSON, and reading YAML needs PyYAML \(pip install pyyaml\)"):
        run_config.apply(args, "horovod.yaml", set())
    # A flag the command line gives either way wins, off as well as on.
    (tmp_path / "flat.json").write_text('{"params": {"hierarchical_allreduce": true}}')
    assert _parse(["-np", "2", "--no-hierarchical-allreduce", "--config-file", "flat.json", "true"]).hierarchical_allreduce is False
    assert _parse(["-np", "2", "--config-file", "flat.json", "true"]).hierarchical_allreduce is True
    # A section switched off sets nothing, unless the command line switches it on.
    (tmp_path / "off.json").write_text('{"autotune": {"enabled": false, "warmup_samples": 3}}')
    assert _settings(_parse(["-np", "2", "--config-file", "off.json", "true"])) == {}
    assert _settings(_parse(["-np", "2", "--autotune", "--config-file", "off.json", "true"])) == {
        "UNISON_AUTOTUNE": "1", "UNISON_AUTOTUNE_WARMUP_SAMPLES": "3"}


@pytest.mark.parametrize("content,message", [
    ("params:\n  fusion_treshold_mb: 32\n", "unknown key params.fusion_treshold_mb (known: cache_capacity, cycle_time_ms, fusion_threshold_mb,"),
    ("parameters:\n  cycle_time_ms: 1\n", "unknown section 'parameters'"),
    ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms: 'fast' is not a number"),
    ("params:\n  cache_capacity: -1\n", "params.cache_capacity: -1 must be 0 or more"),
    ("stall_check:\n  enabled: 1\n", "stall_check.enabled: 1 is not a boolean"),
    ("controller: nccl\n", "controller: 'nccl' is not 'gloo' or 'mpi'"),
    ("logging:\n  level: LOUD\n", "logging.level: 'LOUD' is not one of trace, debug"),
])
def test_a_bad_config_file_is_refused_naming_the_key(tmp_path, content, message):
    (tmp_path / "bad.yaml").write_text(content)
    proc = subprocess.run([sys.executable, "-m", "unison.run", "-np", "1", "--config-file", str(tmp_path / "bad.yaml"),
                           "true"], stderr=subprocess.PIPE, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and ("--config-file %s: %s" % (tmp_path / "bad.yaml", message)) in err, err


@pytest.mark.parametrize("options,status,message", [
    (["--failure-grace-seconds", "-1"], 2, "error: --failure-grace-seconds -1: a number of at least 0"),
    (["--failure-grace-seconds", "nan"], 2, "error: --failure-grace-seconds nan: a number of at least 0"),
    # The core's settings: each would fail every rank's init().
    (["--cycle-time-ms", "-1"], 2, "error: --cycle-time-ms -1: a number of at least 0"),
    (["--fusion-threshold-mb", "-64"], 2, "error: --fusion-threshold-mb -64: a number of at least 0"),
    (["--cache-capacity", "-2"], 2, "error: --cache-capacity -2: a number of at least 0"),
    (["--stall-check-warning-time-seconds", "inf"], 2,
     "error: --stall-check-warning-time-seconds inf: a number of at least 0"),
    (["--stall-check-shutdown-time-seconds", "-5"], 2,
     "error: --stall-check-shutdown-time-seconds -5: a number of at least 0"),
    (["--peer-timeout-seconds", "nan"], 2, "error: --peer-timeout-seconds nan: a number of at least 0"),
    (["--start-timeout", "-5"], 2, "error: --start-timeout -5: a number of at least 0"),
    (["--gloo-timeout-seconds", "-5"], 2, "error: --gloo-timeout-seconds -5: a number of at least 0"),
    # Past the option's own check, the core's parser names the variable.
    (["--thread-affinity", "0,5000"], 2, "error: UNISON_THREAD_AFFINITY='0,5000' is not a comma-separated list "
                                         "of core numbers, one for each rank on the host"),
    (["--rendezvous-port", "70000"], 2, "error: --rendezvous-port 70000: a TCP port, 1 to 65535"),
    (["--ssh-port", "0"], 2, "error: --ssh-port 0: a TCP port, 1 to 65535"),
    (["--simulate-hosts", "0"], 2, "error: --simulate-hosts 0: at least 1"),
    (["--output-filename", "/proc/no-folder-here"], 2,
     "error: --output-filename /proc/no-folder-here: cannot make the folder: No such file or directory"),
    (["--hostfile", "/no-such-hostfile"], 1, "--hostfile /no-such-hostfile: cannot read it: No such file or directory"),
    (["--mpi", "--hostfile", "/no-such-hostfile"], 1,
     "--hostfile /no-such-hostfile: cannot read it: No such file or directory"),
])
def test_a_launcher_setting_that_cannot_be_used_is_refused_naming_it(options, status, message):
    proc = subprocess.run([sys.executable, "-m", "unison.run", "-np", "2"] + options + ["true"],
                          stderr=subprocess.PIPE, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == status and err.endswith("unisonrun: %s\n" % message), err


@pytest.mark.parametrize("job", [["-np", "2"], ["-np", "3", "--min-np", "2"], ["-np", "2", "--mpi"],
                                 ["-np", "2", "-H", "localhost:1,127.0.0.1:1"]],
                         ids=["fixed", "elastic", "mpi", "hosts"])
@pytest.mark.parametrize("variable,value,message", [
    ("HOROVOD_CYCLE_TIME", "fast", "HOROVOD_CYCLE_TIME='fast' is not a number from 0 to 10000"),
    ("UNISON_FUSION_THRESHOLD", "64 MB please", "UNISON_FUSION_THRESHOLD='64 MB please' is not a size in bytes from 0 "
                                                "to 17179869184 (such as 67108864, 64MiB or 64MB)"),
    ("HOROVOD_LOG_LEVEL", "loud", "HOROVOD_LOG_LEVEL='loud' is not one of trace, debug, info, warning, error, fatal"),
    ("UNISON_OVERLAP", "sometimes", "UNISON_OVERLAP='sometimes' is not auto or a flag (1, 0, true, false, yes, no, "
                                    "on or off)"),
])
def test_a_variable_no_rank_could_start_with_stops_the_job_before_any_rank_starts(tmp_path, job, variable, value,
                                                                                 message):
    """A setting in the environment that every rank would inherit, and every
    rank's init() would refuse: the launcher reads it with the same parser
    and stops once, naming it, instead of starting ranks that each fail
    with a traceback. (init()'s own refusal is test_solo.py's.)"""
    proc = subprocess.run([sys.executable, "-m", "unison.run"] + job + ["touch", "ran"], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
                          env=dict(os.environ, **{variable: value}))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.endswith("unisonrun: error: %s\n" % message), err
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("job", [["-np", "2"], ["-np", "3", "--min-np", "2"]], ids=["fixed", "elastic"])
@pytest.mark.parametrize("program,status,message", [
    ("no-such-program-anywhere", 127, "no-such-program-anywhere: command not found"),
    ("./no-such-file", 127, "./no-such-file: No such file or directory"),
    ("./not-executable", 126, "./not-executable: Permission denied"),
])
def test_a_command_that_cannot_start_is_said_as_a_shell_says_it(tmp_path, job, program, status, message):
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    proc = subprocess.run([sys.executable, "-m", "unison.run"] + job + [program], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == status and err == "unisonrun: %s\n" % message, err


def test_a_config_file_configures_the_job(tmp_path):
    # End to end: the file's timeline and stall settings reach the ranks.
    (tmp_path / "job.yaml").write_text("timeline:\n  filename: trace.json\nstall_check:\n"
                                       "  warning_time_seconds: 1.5\n")
    proc = run(tmp_path, """
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        try:
            if unison.rank() == 0:
                unp.allreduce(np.ones(2), name="extra")
            unp.allreduce(np.ones(2), name="loss")
        except unison.DeadlockError as e:
            print("rank %d: deadlock" % unison.rank(), flush=True)
    """, extra=("--config-file", str(tmp_path / "job.yaml")))
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    assert "rank 0: deadlock" in out and "rank 1: deadlock" in out, out
    assert (tmp_path / "trace.json").exists()


@pytest.mark.parametrize("np_", [2, 3])
def test_requests_and_responses_that_overflow_one_control_message(np_):
    # 4 KiB control messages: a thousand requests go out over several cycles,
    # and rank 0 holds back the responses that do not fit, cycle after cycle.
    proc = jobs.unisonrun(["-np", str(np_)], jobs.pytest_command("test_core_ops.py"),
                          env={"UNISON_CONTROL_MESSAGE_BYTES": "4096"}, timeout=110)
    jobs.assert_every_rank_passed(proc, np_)


def test_after_a_stall_warning_idle_engines_sleep(tmp_path):
    # Rank 0's request for the cycle that reports a stall once set it asking
    # for another cycle every cycle after: both engines spun a core each for
    # the rest of the job. An idle second afterwards now costs next to no CPU.
    proc = run(tmp_path, """
        import time
        import numpy as np
        import unison, unison.numpy as unp
        unison.init()
        if unison.rank() == 1:
            time.sleep(1.5)
        unp.allreduce(np.ones(2), name="x")
        started = time.process_time()
        time.sleep(1)
        print("cpu %.2f" % (time.process_time() - started), flush=True)
    """, extra=("--stall-check-warning-time-seconds", "1"))
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    assert "allreduce 'x' waited 1 s" in err, err
    cpu = [float(line.split("cpu ")[1]) for line in out.splitlines() if "cpu " in line]
    assert len(cpu) == 2 and max(cpu) < 0.5, out  # spinning: about 1.0


def test_data_that_never_comes_is_a_stall_naming_the_rank_and_fails_at_shutdown(tmp_path):
    # Rank 1's input for 'late' is never marked ready (a device stream that
    # never gets there): rank 0's stall inspector names rank 1 and fails the
    # op there; rank 1's op waits outside negotiation until its shutdown
    # fails it. Nobody hangs.
    proc = run(tmp_path, """
        import time
        import numpy as np
        import unison, unison.numpy as unp
        from unison import collective, handles
        from unison._native import ffi, lib
        unison.init()
        values, flag = np.ones(2, np.float32), np.zeros(1, np.int32)
        pointer = ffi.cast("void*", values.ctypes.data)
        ready = ffi.cast("int32_t*", flag.ctypes.data) if unison.rank() == 1 else ffi.NULL
        handle_id = collective.enqueue(lib.UNISON_ALLREDUCE, "late", lib.UNISON_FLOAT32, values.shape, pointer,
                                       pointer, reduce_op=lib.UNISON_SUM, input_ready=ready)
        handle = handles.Handle(handle_id, "late", (values, flag), lambda _: None)
        if unison.rank() == 0:
            try:
                handles.synchronize(handle)
            except unison.StalledError as e:
                print("stalled:", e, flush=True)
        else:
            time.sleep(1.5)  # past the warning; rank 0 fails 'late' at 2 s, then meets this barrier
            print("still waiting", unison.rank(), not handles.poll(handle), flush=True)
        unp.barrier()
        print("still usable", unison.rank(), flush=True)
        rank = unison.rank()
        unison.shutdown()
        if rank == 1:
            try:
                handles.synchronize(handle)
            except unison.ShutDownError as e:
                print("at shutdown:", e, flush=True)
    """, extra=("--stall-check-warning-time-seconds", "1", "--stall-check-shutdown-time-seconds", "2"))
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    assert "allreduce 'late' waited" in out and "submitted by ranks [0], missing from ranks [1]" in out, out
    assert "still waiting 1 True" in out, out
    assert "rank 1: allreduce 'late' has waited 1 s for its input" in err, out + err
    assert "still usable 0" in out and "still usable 1" in out, out
    assert "at shutdown:" in out, out


def test_the_keyed_listener_serves_only_the_key_and_no_silent_peer_holds_it_up(monkeypatch):
    """The elastic driver's and unison.run()'s listener (keyed_listener.py):
    a wrong key is refused on both sides, and a stranger that connects and
    says nothing holds up no one and is dropped after the handshake's time."""
    import socket
    import threading
    from multiprocessing import AuthenticationError
    from unison import keyed_listener

    monkeypatch.setattr(keyed_listener, "HANDSHAKE_SECONDS", 1.0)
    served, refused = [], []
    done = threading.Event()

    def serve(connection):
        with connection:
            served.append(connection.recv())
            connection.send("ok")
        done.set()

    listener = keyed_listener.KeyedListener("127.0.0.1", b"the key", serve, refused.append)
    try:
        silent = socket.create_connection(listener.address)   # connects, and never says a word
        with pytest.raises(AuthenticationError, match="refused this key"):
            keyed_listener.connect(listener.address, b"another key")
        with keyed_listener.connect(listener.address, b"the key") as client:
            client.send("hello")
            assert client.recv() == "ok"
        assert done.wait(10) and served == ["hello"]
        deadline = time.monotonic() + 10   # told on the refused connection's own thread
        while not refused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(refused) == 1 and isinstance(refused[0], AuthenticationError)
        # The silent stranger is dropped once its handshake time is up.
        silent.settimeout(5)
        start = time.monotonic()
        assert len(silent.recv(64)) == 32 and silent.recv(64) == b""   # the challenge, then the hang-up
        assert time.monotonic() - start < 3
        silent.close()
    finally:
        listener.close()


def test_a_client_is_refused_by_a_listener_that_does_not_prove_the_key():
    """The proof goes both ways: a listener that answers the challenge
    without the key (an impostor on the driver's port) is refused."""
    import socket
    import threading
    from multiprocessing import AuthenticationError
    from unison import keyed_listener

    impostor = socket.create_server(("127.0.0.1", 0))

    def pretend():
        peer, _ = impostor.accept()
        with peer:
            peer.sendall(b"n" * 32)
            peer.recv(64)
            peer.sendall(b"p" * 32)   # a proof made without the key
    threading.Thread(target=pretend, daemon=True).start()
    try:
        with pytest.raises(AuthenticationError, match="did not prove the job's key"):
            keyed_listener.connect(impostor.getsockname(), b"the key")
    finally:
        impostor.close()


STRANGERS = """
import resource, socket, sys, time
from unison import keyed_listener
keyed_listener.HANDSHAKE_SECONDS = float(sys.argv[1])
listener = keyed_listener.KeyedListener("127.0.0.1", b"the key", lambda c: (c.send(c.recv() * 2), c.close()))
strangers = []
if sys.argv[2] == "exhaust":
    # Descriptors run out: the listener cannot accept, and must wait, not spin.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        while True:
            strangers.append(socket.create_connection(listener.address))
    except OSError:
        pass
    start = time.process_time()
    time.sleep(1.0)
    print("cpu %.3f with %d strangers" % (time.process_time() - start, len(strangers)), flush=True)
    for s in strangers[:8]:
        s.close()
    strangers = strangers[8:]
else:
    for _ in range(int(sys.argv[2])):   # silent strangers, more than are ever proven at once
        strangers.append(socket.create_connection(listener.address))
start = time.monotonic()
with keyed_listener.connect(listener.address, b"the key", timeout=30) as c:
    c.send(21)
    print("served %s after %.1f s" % (c.recv(), time.monotonic() - start), flush=True)
"""


@pytest.mark.parametrize("strangers", ["200", "exhaust"])
def test_the_keyed_listener_serves_a_client_behind_a_crowd_of_silent_strangers(tmp_path, strangers):
    """Strangers that connect and say nothing: more than MAX_PENDING are
    each dropped after the handshake time, and a client behind them is
    served; strangers that take every file descriptor leave the accept loop
    waiting, not spinning, and a client is served once some have gone."""
    script = tmp_path / "strangers.py"
    script.write_text(STRANGERS)
    proc = subprocess.run([sys.executable, str(script), "1.0", strangers], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=100)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    served = re.search(r"served 42 after ([0-9.]+) s", output)
    assert served and float(served.group(1)) < 10, output
    if strangers == "exhaust":
        cpu = re.search(r"cpu ([0-9.]+) with (\d+) strangers", output)
        assert cpu and float(cpu.group(1)) < 0.3 and int(cpu.group(2)) > 10, output


@pytest.mark.timeout(120)
def test_the_keyed_listener_serves_every_client_that_connects_at_the_same_moment():
    """Every worker of an elastic job connects to the driver at once. With
    multiprocessing's backlog of 1, 64 clients at once left some connected
    in their own eyes only, waiting for good for a challenge that never came."""
    import threading
    from unison import keyed_listener

    def serve(connection):
        with connection:
            connection.send(connection.recv() * 2)

    listener = keyed_listener.KeyedListener("127.0.0.1", b"the key", serve)
    answers = {}

    def client(i):
        with keyed_listener.connect(listener.address, b"the key") as c:
            c.send(i)
            answers[i] = c.recv()

    try:
        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(256)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        for c in clients:
            c.join(max(0.0, deadline - time.monotonic()))
        assert answers == {i: 2 * i for i in range(256)}, "%d of 256 answered" % len(answers)
    finally:
        listener.close()


def test_a_cache_too_large_for_the_control_messages_is_refused_at_init_naming_both_settings(tmp_path):
    """Each bound alone is not enough: every control message carries the
    response cache's bits, so a large cache with small messages would leave
    no room for requests (the budget once wrapped below zero). Every rank
    refuses at init, naming both settings, and the process stays usable:
    with a cache that fits, init works."""
    proc = run(tmp_path, """
        import unison, numpy as np, unison.numpy as unp
        try:
            unison.init()
        except unison.InvalidArgumentError as e:
            print("refused:", e, flush=True)
        import os
        os.environ["UNISON_CACHE_CAPACITY"] = "1024"
        unison.init()
        print("then", unp.allreduce(np.ones(2), op=unison.Sum, name="after").tolist(), flush=True)
        """, np_=3, env={"UNISON_CACHE_CAPACITY": "1048576", "UNISON_CONTROL_MESSAGE_BYTES": "64KiB"})
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    for rank in range(3):
        assert ("[%d]<stdout>:refused: unison: UNISON_CACHE_CAPACITY=1048576 needs 262208 bytes of every control "
                "message, but with UNISON_CONTROL_MESSAGE_BYTES=65536 on 3 ranks a message holds 65536: lower the "
                "first or raise the second (at most half a message goes to the cache)" % rank) in out, out
        assert "[%d]<stdout>:then [3.0, 3.0]" % rank in out, out
