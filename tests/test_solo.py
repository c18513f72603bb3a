"""A process started without the launcher is rank 0 of 1, and lifecycle
misuse gives clear errors."""
import subprocess
import sys

import numpy as np
import pytest

import unison
import unison.numpy as unp


@pytest.fixture
def solo():
    unison.init()
    yield
    unison.shutdown()


def test_size_one_without_launcher(solo):
    assert (unison.rank(), unison.size(), unison.local_rank(), unison.local_size()) == (0, 1, 0, 1)
    assert (unison.cross_rank(), unison.cross_size(), unison.is_homogeneous()) == (0, 1, True)
    assert unison.backend_name() == "solo"
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(unp.allreduce(x), x)
    np.testing.assert_array_equal(unp.allreduce(x, op=unison.Sum, prescale_factor=2, postscale_factor=0.5), x)
    np.testing.assert_array_equal(unp.allgather(x), x)
    np.testing.assert_array_equal(unp.broadcast(x, 0), x)
    out, received = unp.alltoall(x, splits=[2])
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(received, [2])
    np.testing.assert_array_equal(unp.reducescatter(x, op=unison.Sum), x)
    unp.barrier()
    assert unp.join() == 0


def test_use_before_init_and_after_shutdown():
    unison.shutdown()
    with pytest.raises(unison.NotInitializedError, match="init"):
        unison.rank()
    with pytest.raises(unison.NotInitializedError):
        unp.allreduce(np.ones(2))
    # Horovod's answers before init: MPI is not enabled, and whether it
    # supports threads is an error (a ValueError, as Horovod's is).
    assert unison.mpi_enabled() is False
    with pytest.raises(ValueError, match="not initialized"):
        unison.mpi_threads_supported()
    unison.init()
    assert unison.is_initialized()
    assert (unison.mpi_enabled(), unison.mpi_threads_supported()) == (False, False)  # one rank runs solo
    unison.shutdown()
    with pytest.raises(unison.NotInitializedError):
        unp.allgather(np.ones(2))


def test_a_job_of_ones_children_start_jobs_of_their_own(solo):
    """A rank of a job of several refuses init() in the processes it starts
    (tests/parallel/test_core_lifecycle.py); a job of one shares nothing, so
    its children, spawned with its environment, each start their own."""
    script = "import unison; unison.init(); print(unison.rank(), unison.size())"
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (child.returncode, child.stdout.split()) == (0, ["0", "1"]), child.stderr


def test_shutdown_fails_pending_work_cleanly(solo):
    assert unp.allreduce(np.ones(2), name="x")[0] == 1
    unison.shutdown()
    unison.init()
    assert unp.allreduce(np.ones(2), name="x")[0] == 1


def test_background_thread_leaves_signals_to_the_main_thread(solo):
    # A SIGTERM the kernel hands to the core's thread would not wake a main
    # thread sleeping in Python, so the thread must block it (see engine.cc).
    import os
    import signal
    ours = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/status" % tid) as f:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended since the listing (ENOENT or ESRCH)
            continue
        if fields["Name"] == "unison-engine":
            ours.append((tid, int(fields["SigBlk"], 16)))
    assert len(ours) == 1, "expected the core's background thread, found %r" % ours
    for tid, blocked in ours:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD):
            assert blocked & (1 << (sig - 1)), "thread %d does not block %s" % (tid, sig.name)


# ---- settings: understood or refused, never half-read -------------------------

@pytest.mark.parametrize("variable,value,expected", [
    ("UNISON_FUSION_THRESHOLD", "64XB", "a size in bytes"),
    ("UNISON_FUSION_THRESHOLD", "-1", "a size in bytes"),
    ("HOROVOD_FUSION_THRESHOLD", "lots", "a size in bytes"),
    ("UNISON_CACHE_CAPACITY", "abc", "an integer"),
    ("UNISON_CACHE_CAPACITY", "12.5", "an integer"),
    ("UNISON_CYCLE_TIME", "5ms", "a number from 0 to 10000"),
    ("UNISON_PEER_TIMEOUT_SECONDS", "-3", "a number from 0.1 to 86400"),
    ("UNISON_HIERARCHICAL_ALLREDUCE", "maybe", "a flag"),
    ("UNISON_OVERLAP", "sometimes", "auto or a flag"),
    ("UNISON_SPIN_YIELD", "often", "auto or a flag"),
    ("UNISON_SHM_SLOT_BYTES", "1KiB", "from 4096 to 1073741824"),
    # kB is 1000 bytes, so 4kB is under the 4096-byte minimum where 4KiB is not.
    ("UNISON_SHM_SLOT_BYTES", "4kB", "from 4096 to 1073741824"),
    ("UNISON_LOG_LEVEL", "loud", "one of trace, debug, info, warning, error, fatal"),
    ("HOROVOD_LOG_LEVEL", "1", "one of trace, debug, info, warning, error, fatal"),
    # Each of these was once accepted, then fatal: an abort at init
    # (bad_alloc), a hung job, every peer declared dead at once, 20 GiB of
    # /dev/shm.
    ("UNISON_CACHE_CAPACITY", "2147483647", "an integer from 0 to 1048576"),
    ("UNISON_CYCLE_TIME", "1e300", "a number from 0 to 10000"),
    ("UNISON_PEER_TIMEOUT_SECONDS", "0", "a number from 0.1 to 86400"),
    ("UNISON_CONTROL_MESSAGE_BYTES", "5G", "a size in bytes from 4096 to 67108864"),
    ("UNISON_RENDEZVOUS_PORT", "70000", "an integer from 1 to 65535"),
])
def test_bad_setting_is_refused_at_init_naming_variable_and_value(monkeypatch, variable, value, expected):
    unison.shutdown()
    monkeypatch.setenv(variable, value)
    with pytest.raises(unison.InvalidArgumentError) as info:
        unison.init()
    message = str(info.value)
    assert variable in message and repr(value) in message and expected in message, message
    assert not unison.is_initialized()
    # The process stays usable: with the setting fixed, init works.
    monkeypatch.delenv(variable)
    unison.init()
    np.testing.assert_array_equal(unp.allreduce(np.ones(3), name="after.bad.setting"), np.ones(3))
    unison.shutdown()


@pytest.mark.parametrize("variable,value", [("HOROVOD_LOG_LEVEL", "debug"), ("HOROVOD_LOG_LEVEL", "INFO"),
                                            ("UNISON_LOG_LEVEL", "Warning"), ("UNISON_LOG_LEVEL", "fatal")])
def test_horovods_log_level_names_are_understood(monkeypatch, variable, value):
    # A Horovod job's environment often carries HOROVOD_LOG_LEVEL=debug.
    unison.shutdown()
    monkeypatch.setenv(variable, value)
    unison.init()
    np.testing.assert_array_equal(unp.allreduce(np.ones(3), name="with.log.level"), np.ones(3))
    unison.shutdown()


@pytest.mark.parametrize("value", ["67108864", "64MiB", "64MB", "64 mib", "64M", "512kb", "1GiB", "4096B"])
def test_sizes_with_units_are_understood(monkeypatch, value):
    unison.shutdown()
    monkeypatch.setenv("UNISON_FUSION_THRESHOLD", value)
    monkeypatch.setenv("UNISON_SHM_SLOT_BYTES", "4KiB")   # exactly the minimum: KiB is 1024 bytes
    monkeypatch.setenv("UNISON_HIERARCHICAL_ALLREDUCE", "false")
    monkeypatch.setenv("UNISON_CACHE_CAPACITY", "0")
    unison.init()
    np.testing.assert_array_equal(unp.allreduce(np.ones(3), name="with.units"), np.ones(3))
    unison.shutdown()


def test_error_classes_where_horovod_users_import_them():
    # horovod.common.exceptions has both; unison.exceptions is its place.
    from unison import elastic
    from unison.exceptions import HorovodInternalError, HostsUpdatedInterrupt
    assert HorovodInternalError is unison.UnisonInternalError
    assert HostsUpdatedInterrupt is elastic.HostsUpdatedInterrupt
    assert issubclass(HostsUpdatedInterrupt, RuntimeError) and not issubclass(HostsUpdatedInterrupt, unison.UnisonError)
    assert HostsUpdatedInterrupt(skip_sync=True).skip_sync
    # A deadlock is a stall, and a Horovod-catchable failure of the op.
    assert issubclass(unison.DeadlockError, unison.StalledError)
    assert issubclass(unison.DeadlockError, HorovodInternalError)


def test_horovods_common_import_paths_with_unison_in_place_of_horovod():
    # Code that imports from horovod.common (elastic loops catching
    # HorovodInternalError, integrations asking nccl_built()) keeps working
    # with the package renamed.
    from unison.common.elastic import ObjectState, State, run_fn
    from unison.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
    from unison.common.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
    from unison.common import util
    from unison import elastic, process_sets
    assert (HorovodInternalError, HostsUpdatedInterrupt) == (unison.HorovodInternalError, elastic.HostsUpdatedInterrupt)
    assert (ObjectState, State, run_fn) == (elastic.ObjectState, elastic.State, elastic.run_fn)
    assert (ProcessSet, global_process_set, add_process_set, remove_process_set) == (
        process_sets.ProcessSet, process_sets.global_process_set, unison.add_process_set, unison.remove_process_set)
    # The build queries need no init(), take Horovod's verbose, and answer as unison's own.
    for name in ("mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"):
        assert getattr(util, name)(verbose=True) == getattr(unison, name)(), name
    import importlib.util as found
    for framework in ("torch", "tensorflow", "mxnet"):
        assert util.extension_available(framework) == (found.find_spec(framework) is not None)
        # unison.tensorflow and unison.mxnet refuse GPU tensors, so the answer for them is no.
        assert util.gpu_available(framework) == (framework == "torch" and util.extension_available(framework)
                                                 and unison.cuda_built())
    assert not util.extension_available("keras2") and not util.gpu_available("nonesuch")
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert util.split_list([1], 3) == [[1], [], []] and util.split_list([], 2) == [[], []]
    assert [util.num_rank_is_power_2(n) for n in (0, 1, 2, 3, 4, 6, 8)] == [False, True, True, False, True, False, True]


# ---- the settings table: every numeric setting's bounds ----------------------

def _spelled(kind, value):
    return str(int(value)) if kind in ("integer", "bytes", "core-list") else repr(float(value))


def _past(kind, value, direction):
    """The nearest value past a bound: the next integer, or a number a
    millionth beyond."""
    if kind in ("integer", "bytes", "core-list"):
        return value + direction
    return value + direction * max(abs(value) * 1e-6, 1e-9)


def test_every_numeric_setting_takes_its_bounds_and_refuses_past_them_naming_the_range():
    """Every number init() reads has both bounds, in the one table the core
    reads them through (native/config.cc): each bound itself is taken, and
    the nearest value past it is refused, naming the variable, the value
    and the range, under its Horovod name too. Nothing a user writes can
    then reach the core as a size that wraps, a wait that never ends or a
    timeout of nothing."""
    from unison.basics import setting_table, settings_problem
    table = setting_table()
    names = [row["name"] for row in table]
    assert len(names) == len(set(names)) and len(table) >= 39, names
    numeric = [row for row in table if row["kind"] in ("integer", "bytes", "number", "core-list")]
    assert len(numeric) >= 22, numeric
    for row in numeric:
        kind, low, high = row["kind"], row["minimum"], row["maximum"]
        assert low < high, row
        if row["default"]:
            assert low <= float(row["default"]) <= high, row
        # The rendezvous port is read only with its address and a secret.
        companions = ({"UNISON_RENDEZVOUS_ADDR": "127.0.0.1", "UNISON_SECRET_KEY": "sixteen-byte-key"}
                      if row["name"] == "UNISON_RENDEZVOUS_PORT" else {})
        for name in filter(None, (row["name"], row["horovod_name"])):
            for bound in (low, high):
                value = _spelled(kind, bound)
                assert settings_problem(dict(companions, **{name: value})) is None, (name, value)
            for value in (_past(kind, low, -1), _past(kind, high, +1)):
                written = _spelled(kind, value)
                if kind in ("bytes", "core-list") and value < 0:
                    written = "-1"
                problem = settings_problem(dict(companions, **{name: written}))
                assert problem is not None, (name, written)
                assert "%s='%s'" % (name, written) in problem, problem
                if kind != "core-list":
                    assert "from %s to %s" % ("%.15g" % low, "%.15g" % high) in problem, problem


def test_every_setting_has_a_kind_a_description_and_only_known_choices():
    from unison.basics import setting_table, settings_problem
    for row in setting_table():
        assert row["name"].startswith("UNISON_") and row["description"].endswith("."), row
        assert row["horovod_name"] is None or row["horovod_name"].startswith("HOROVOD_"), row
        assert row["kind"] in ("integer", "bytes", "number", "flag", "auto-or-flag", "choice", "text", "path",
                               "secret", "core-list"), row
        if row["kind"] == "choice":
            assert row["default"] in row["choices"], row
            for word in row["choices"]:
                assert settings_problem({row["name"]: word.upper()}) is None, (row, word)
            problem = settings_problem({row["name"]: "nonsense"})
            assert problem and "one of " + ", ".join(row["choices"]) in problem, problem


def test_a_secret_under_16_bytes_is_refused_without_repeating_it():
    from unison.basics import settings_problem
    problem = settings_problem({"UNISON_SECRET_KEY": "fifteen-bytes!!"})
    assert problem == ("unison: UNISON_SECRET_KEY is 15 bytes long; a secret must have at least 16 (unisonrun makes "
                       "one of 32 random bytes, in 64 hex digits)"), problem
    assert settings_problem({"UNISON_SECRET_KEY": "sixteen-bytes!!!"}) is None


# ---- files the job writes: the owner's only, never through a link -------------

def test_the_timeline_is_private_to_its_owner_and_never_written_through_a_link(tmp_path):
    """A timeline shows the model's tensors and timing: mode 0600, an
    existing file too. A link under its name (planted in a shared folder
    to make the job overwrite a file of its owner's) is refused, as is a
    FIFO (which would block the rank), and the process goes on."""
    import os
    import stat
    unison.init()
    try:
        fresh = tmp_path / "fresh.json"
        unison.start_timeline(str(fresh))
        unp.allreduce(np.ones(2), name="timeline.private")
        unison.stop_timeline()
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600
        shared = tmp_path / "shared.json"
        shared.write_text("old")
        os.chmod(shared, 0o644)
        unison.start_timeline(str(shared))
        unison.stop_timeline()
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o600
        victim = tmp_path / "victim"
        victim.write_text("keep me")
        (tmp_path / "link.json").symlink_to(victim)
        with pytest.raises(unison.InvalidArgumentError, match="link.json': it is a symbolic link, which is not followed"):
            unison.start_timeline(str(tmp_path / "link.json"))
        assert victim.read_text() == "keep me"
        os.mkfifo(tmp_path / "fifo.json")
        with pytest.raises(unison.InvalidArgumentError, match="fifo.json': it is not a regular file"):
            unison.start_timeline(str(tmp_path / "fifo.json"))
        np.testing.assert_array_equal(unp.allreduce(np.ones(2), name="timeline.after"), np.ones(2))
    finally:
        unison.shutdown()


def test_the_autotune_log_is_private_and_a_link_under_its_name_is_refused(tmp_path, monkeypatch, capfd):
    import os
    import stat
    monkeypatch.setenv("UNISON_AUTOTUNE", "1")
    log = tmp_path / "tune.csv"
    monkeypatch.setenv("UNISON_AUTOTUNE_LOG", str(log))
    unison.init()
    unison.shutdown()
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600 and log.read_text().startswith("sample,")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "link.csv").symlink_to(victim)
    monkeypatch.setenv("UNISON_AUTOTUNE_LOG", str(tmp_path / "link.csv"))
    unison.init()
    np.testing.assert_array_equal(unp.allreduce(np.ones(2), name="autotune.after"), np.ones(2))
    unison.shutdown()
    assert victim.read_text() == "keep me"
    assert ("cannot write the autotune log to '%s' (UNISON_AUTOTUNE_LOG): it is a symbolic link, which is not "
            "followed; tuning without it" % (tmp_path / "link.csv")) in capfd.readouterr().err


def test_every_variable_the_core_names_is_in_its_settings_table():
    """The core reads its settings only through the table (config.cc): any
    UNISON_* or HOROVOD_* name written as a string of its own anywhere in
    native/ is a row of the table, or that row's Horovod alias."""
    import glob
    import os
    import re
    from unison.basics import setting_table
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    named = set()
    for path in glob.glob(os.path.join(root, "native", "**", "*.[ch]*"), recursive=True):
        with open(path, errors="replace") as f:
            named |= set(re.findall(r'"((?:UNISON|HOROVOD)_[A-Z_]+)"', f.read()))
    table = {name for row in setting_table() for name in (row["name"], row["horovod_name"]) if name}
    assert named and named <= table, sorted(named - table)


def test_the_docs_settings_tables_are_the_core_table_and_the_launchers_parser():
    """The docs' tables of variables and of unisonrun's options are made
    from the core's table and the launcher's parser (python -m
    unison.settings_page), so they cannot drift from the parser, the
    launcher's options or the config file; this fails when docs/settings.md
    was not remade after a row or an option changed."""
    import os
    from unison import basics, settings_page
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "settings.md")) as f:
        page = f.read()
    for table, made in (("variables", settings_page.markdown()), ("options", settings_page.launcher_options())):
        begin = page.index("\n", page.index("<!-- %s: the output of `python -m unison.settings_page`" % table)) + 1
        end = page.index("<!-- end of %s -->" % table)
        assert page[begin:end] == made, (
            "docs/settings.md's table of %s differs from what unison makes of it; remake it with "
            "python -m unison.settings_page" % table)
    assert len(settings_page.markdown().splitlines()) == 2 + len(basics.setting_table())
    assert "`--failure-grace-seconds` *NUMBER*" in settings_page.launcher_options()
