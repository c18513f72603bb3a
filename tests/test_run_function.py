"""unison.run(func, ...): Horovod's horovod.run, the launcher called from Python.

Each test runs a driver script (the caller's process) as its own process,
as a user's script would be run, and checks what unison.run returned or
raised there.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from jobs import run_job
from test_tcp import fake_ssh, without_mpi

# Every rank sums (rank + 1) over the job and returns what it saw, so each
# rank's value says which rank it ran as and what every other rank sent.
TRAIN = """
import sys
import numpy as np
import unison
import unison.numpy as unp

def train(scale, offset=0):
    unison.init()
    total = unp.allreduce(np.array([unison.rank() + 1.0]), op=unison.Sum, name="total")
    return {"rank": unison.rank(), "size": unison.size(), "value": float(total[0]) * scale + offset}

if __name__ == "__main__":
    options = eval(sys.argv[1]) if len(sys.argv) > 1 else {}
    print("RESULT", unison.run(train, args=(2,), kwargs={"offset": 1}, **options))
"""


# The main script's functions go by reference, and each rank imports the
# script first; what cannot (lambdas, closures, an interactive session's
# definitions) goes by value through cloudpickle where it is installed
# (runner/function.py). Tests run with it and as if it were not.
PICKLERS = ["cloudpickle", "pickle"]
WITHOUT_CLOUDPICKLE = "import sys\nsys.modules['cloudpickle'] = None   # as if not installed\n"


def driver(tmp_path, text, *argv, env=None, timeout=100, pickler="cloudpickle"):
    script = tmp_path / "driver.py"
    script.write_text((WITHOUT_CLOUDPICKLE if pickler == "pickle" else "") + text)
    return run_job([sys.executable, str(script)] + list(argv), timeout,
                   env=dict(without_mpi(), **(env or {})), cwd=str(tmp_path))


def result(proc):
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    # Ranks once ran `python -m unison.runner.function`, which `import unison`
    # had already imported: every rank printed runpy's RuntimeWarning.
    assert "RuntimeWarning" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output
    return eval(lines[0][len("RESULT "):])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pickler", PICKLERS)
@pytest.mark.parametrize("np_", [2, 3])
def test_every_rank_returns_its_value_in_rank_order(tmp_path, np_, pickler):
    total = np_ * (np_ + 1) / 2
    got = result(driver(tmp_path, TRAIN, "{'num_proc': %d}" % np_, pickler=pickler))
    assert got == [{"rank": r, "size": np_, "value": total * 2 + 1} for r in range(np_)]


@pytest.mark.timeout(120)
def test_horovods_deprecated_np_still_counts_the_ranks(tmp_path):
    got = result(driver(tmp_path, TRAIN, "{'np': 3}"))
    assert [g["rank"] for g in got] == [0, 1, 2] and all(g["value"] == 13.0 for g in got)


@pytest.mark.timeout(120)
def test_two_hosts_one_started_over_ssh(tmp_path):
    """Ranks 1 and 2 start through an ssh stand-in, so the service's key
    reaches them on standard input; the service listens on lo."""
    ssh = fake_ssh(tmp_path)
    got = result(driver(tmp_path, TRAIN, "{'num_proc': 3, 'hosts': 'localhost:1,elsewhere.invalid:2', "
                                         "'network_interface': 'lo'}", env={"UNISON_SSH": ssh}))
    assert got == [{"rank": r, "size": 3, "value": 13.0} for r in range(3)]


LOGGED_SSH = """#!/bin/bash
while [ $# -gt 2 ]; do shift; done
echo "$2" >> %s
exec setsid -w bash -c "$2"
"""


@pytest.mark.timeout(120)
def test_the_key_travels_on_no_command_line(tmp_path):
    log = tmp_path / "ssh.log"
    ssh = tmp_path / "ssh"
    ssh.write_text(LOGGED_SSH % log)
    ssh.chmod(0o755)
    got = result(driver(tmp_path, TRAIN, "{'num_proc': 2, 'hosts': 'localhost:1,elsewhere.invalid:1', "
                                         "'network_interface': 'lo'}", env={"UNISON_SSH": str(ssh)}))
    assert [g["value"] for g in got] == [7.0, 7.0]
    ran = log.read_text()
    assert "UNISON_RUN_FUNCTION=" in ran and "UNISON_RUN_FUNCTION_KEY" not in ran, ran
    assert "UNISON_SECRET_KEY" not in ran, ran


RAISES = """
import numpy as np
import unison
import unison.numpy as unp

def train():
    unison.init()
    if unison.rank() == 1:
        raise ValueError("rank one refuses")
    unp.allreduce(np.ones(1), name="after")     # the others wait for rank 1, which is gone
    return unison.rank()

if __name__ == "__main__":
    try:
        unison.run(train, num_proc=%d)
    except RuntimeError as e:
        print("RAISED", type(e.__cause__).__name__, repr(str(e)))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pickler", PICKLERS)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_that_raises_is_named_with_its_traceback(tmp_path, np_, pickler):
    proc = driver(tmp_path, RAISES % np_, pickler=pickler)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    raised = [line for line in output.splitlines() if line.startswith("RAISED ")]
    assert len(raised) == 1, output
    assert raised[0].startswith("RAISED ValueError 'unison.run: rank 1 raised an exception:"), output
    assert "rank one refuses" in raised[0] and "Traceback" in raised[0], output
    # The script's own code ran: the traceback names its file and line.
    line = (tmp_path / "driver.py").read_text().splitlines().index('        raise ValueError("rank one refuses")') + 1
    assert 'driver.py", line %d, in train' % line in raised[0], output


DIES = """
import os, unison

def train():
    unison.init()
    if unison.rank() == 1:
        os._exit(7)
    return unison.rank()

if __name__ == "__main__":
    try:
        unison.run(train, num_proc=2)
    except RuntimeError as e:
        print("RAISED", repr(str(e)))
"""


@pytest.mark.timeout(120)
def test_a_rank_that_dies_fails_the_call_naming_it(tmp_path):
    proc = driver(tmp_path, DIES)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output
    assert ("RAISED 'unison.run: the job failed (unisonrun exited with status 7): job failed: rank 1 exited with "
            "status 7'") in output, output


ANYTHING = """
import sys, unison

def no_unison(x):
    return x * 10          # a function that never initializes unison

def exits():
    sys.exit(0)            # ends like a script: returns None

class Point:               # a class of the main script, pickled both ways
    def __init__(self, x):
        self.x = x

def point(p):
    return Point(p.x + 1)

if __name__ == "__main__":
    print("RESULT", [unison.run(no_unison, args=(4,), num_proc=2), unison.run(exits, num_proc=2),
                     [p.x for p in unison.run(point, args=(Point(5),), num_proc=3)]])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pickler", PICKLERS)
def test_functions_of_the_main_script_and_what_they_return(tmp_path, pickler):
    assert result(driver(tmp_path, ANYTHING, pickler=pickler)) == [[40, 40], [None, None], [6, 6, 6]]


# No `if __name__ == "__main__":` around the call, as many a horovod.run
# script has: Horovod sends the function by value and never imports the
# script. The ranks here import it up to the call: TOP prints in the caller
# and in every rank, AFTER in the caller alone.
NO_MAIN_GUARD = """
import sys
import numpy as np
import unison
import unison.numpy as unp

print("TOP", flush=True)

class Scale:
    def __init__(self, k):
        self.k = k

def train(scale):
    unison.init()
    total = unp.allreduce(np.array([unison.rank() + 1.0]), op=unison.Sum, name="total")
    return Scale(float(total[0]) * scale.k)

def main():
    print("RESULT", [s.k for s in unison.run(train, args=(Scale(2),), num_proc=int(sys.argv[1]))], flush=True)

main()
print("AFTER", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pickler", PICKLERS)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_script_that_calls_it_with_no_main_guard(tmp_path, np_, pickler):
    proc = driver(tmp_path, NO_MAIN_GUARD, str(np_), pickler=pickler)
    output = proc.stdout.decode(errors="replace")
    assert result(proc) == [2.0 * np_ * (np_ + 1) / 2] * np_, output
    lines = output.splitlines()
    assert sorted(line for line in lines if line.endswith("TOP")) == sorted(
        ["TOP"] + ["[%d]<stdout>:TOP" % r for r in range(np_)]), output
    assert [line for line in lines if line.endswith("AFTER")] == ["AFTER"], output


LAMBDAS = """
import unison

def scaled(k):
    def times(x):          # a closure: no name the ranks could import
        return x * k
    return times

if __name__ == "__main__":
    try:
        print("RESULT", [unison.run(lambda a: a + 1, args=(1,), num_proc=2),
                         unison.run(scaled(3), args=(2,), num_proc=3)])
    except ValueError as e:
        print("REFUSED", e)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pickler", PICKLERS)
def test_lambdas_and_closures_go_by_value_through_cloudpickle(tmp_path, pickler):
    proc = driver(tmp_path, LAMBDAS, pickler=pickler)
    if pickler == "pickle":
        output = proc.stdout.decode(errors="replace")
        assert "REFUSED unison.run: the function and its arguments must pickle (" in output, output
        assert "install cloudpickle to send lambdas and closures" in output, output
    else:
        assert result(proc) == [[2, 2], [6, 6, 6]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pickler", PICKLERS)
def test_a_function_typed_into_an_interactive_session(tmp_path, pickler):
    """cloudpickle takes it by value; without it, the ranks could not
    import it, and the call says so before starting any."""
    code = ("import unison\nexec('def f(x):\\n    return x + 1')\n"
            "try:\n    print('RESULT', unison.run(f, args=(1,), num_proc=2))\n"
            "except ValueError as e:\n    print('REFUSED', e)\n")
    if pickler == "pickle":
        code = WITHOUT_CLOUDPICKLE + code
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=50, env=without_mpi(), cwd=str(tmp_path))
    output = proc.stdout.decode()
    if pickler == "pickle":
        assert ("REFUSED unison.run: f was defined in an interactive session, which the ranks cannot import; "
                "define it in a module or a script, or install cloudpickle") in output, output
    else:
        assert "RESULT [2, 2]" in output, output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options,message", [
    ({"num_proc": 0}, "num_proc=0: give a number of ranks, at least 1"),
    ({"hosts": "a:1", "hostfile": "h"}, "give hosts or hostfile, not both"),
    ({"use_gloo": True, "use_mpi": True}, "give use_gloo or use_mpi, not both"),
    # Refused by unisonrun's checks, and named as they were given here.
    ({"num_proc": 2, "hosts": "node1:x"}, "hosts=node1:x: write each host as host:slots"),
    ({"num_proc": 2, "network_interface": "nosuch0"}, "network_interface=nosuch0: this host has no interface"),
    ({"num_proc": 2, "min_num_proc": 0}, "min_num_proc=0: at least 1"),
    ({"num_proc": 2, "min_num_proc": 3, "max_num_proc": 2}, "min_num_proc=3 is more than max_num_proc=2"),
])
def test_bad_options_are_refused_naming_them(options, message):
    import unison
    with pytest.raises(ValueError, match="unison.run: " + message):
        unison.run(len, **options)


@pytest.mark.timeout(60)
def test_unison_run_is_a_plain_function_whatever_was_imported_and_the_launcher_runs_by_both_names():
    # A function, after every module of the launcher's package was imported
    # (none of them replaces it), that pickles by name (cloudpickle reaches
    # it through `unison.elastic.run`); `import unison.run`, which would
    # replace it with a module, is refused; and the launcher's command line
    # runs as `python -m unison.run`, its old name, and `python -m unison.runner`.
    code = ("import pickle, types, unison, unison.runner.launch, unison.runner.ssh, unison.runner.mpi\n"
            "import unison.runner.elastic_driver, unison.runner.function\n"
            "assert type(unison.run) is types.FunctionType, unison.run\n"
            "assert pickle.loads(pickle.dumps(unison.run)) is unison.run\n"
            "try:\n    import unison.run\nexcept ImportError as e:\n    print('REFUSED', e)\n"
            "assert type(unison.run) is types.FunctionType, unison.run\n"
            "print('CALLED', unison.run(len, args=([1, 2],), num_proc=2))\n")
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=50, env=without_mpi())
    out = proc.stdout.decode()
    assert "REFUSED unison.run is a function (unison.run(func, num_proc=2)); the launcher's package is unison.runner" \
        in out, out
    assert out.strip().endswith("CALLED [2, 2]"), out
    for module in ("unison.run", "unison.runner"):
        version = subprocess.run([sys.executable, "-m", module, "--version"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, timeout=30, env=without_mpi())
        assert version.returncode == 0 and version.stdout.decode().startswith("unisonrun (unison) "), version


@pytest.mark.timeout(60)
def test_a_connection_without_the_key_gets_nothing(tmp_path):
    """A stranger who knows the service's address but not its key is
    refused, and one that connects and says nothing holds up nobody: the
    call still completes."""
    code = TRAIN.replace('if __name__ == "__main__":', '''
if __name__ == "__main__":
    import unison.runner.function as rf, threading
    from unison import keyed_listener
    real = rf._Service.__init__
    def spy(self, *a):
        real(self, *a)
        import socket
        self.silent = socket.create_connection(self.address)   # connects, and never says a word
        def knock():
            try:
                keyed_listener.connect(self.address, b"wrong").send(("call",))
                print("STRANGER SERVED")
            except Exception as e:
                print("STRANGER REFUSED", type(e).__name__)
        threading.Thread(target=knock).start()
    rf._Service.__init__ = spy''')
    proc = driver(tmp_path, code, "{'num_proc': 2}")
    output = proc.stdout.decode(errors="replace")
    assert "STRANGER REFUSED AuthenticationError" in output, output
    assert result(proc) == [{"rank": r, "size": 2, "value": 7.0} for r in range(2)]


ELASTIC = """
import os, sys, time
import numpy as np
sys.path.insert(0, %r)
from faults import fault_at
import unison, unison.elastic, unison.numpy as unp

STEPS = 20

def train():
    unison.init()
    state = unison.elastic.ObjectState(step=0, total=np.zeros(3))

    @unison.elastic.run
    def steps(state):
        while state.step < STEPS:
            n = unison.size()
            share = (state.step + 1) * (unison.rank() + 1) / (n * (n + 1) / 2)
            fault_at(state.step)
            state.total += unp.allreduce(np.full(3, share), op=unison.Sum, name="share")
            state.step += 1
            time.sleep(0.02)
            state.commit()

    steps(state)
    return unison.rank(), unison.size(), state.step, state.total.tolist()

if __name__ == "__main__":
    print("RESULT", unison.run(train, num_proc=%d, min_num_proc=1, hosts=%r))
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hosts", ["localhost:1,127.0.0.1:1", "localhost:2,127.0.0.1:1"], ids=["np2", "np3"])
def test_an_elastic_call_returns_what_the_ranks_it_ended_with_returned(tmp_path, hosts):
    """A worker killed at step 7: the call returns the survivors' values, in
    their final rank order, each with the exact sum of the committed steps."""
    np_ = sum(int(h.split(":")[1]) for h in hosts.split(","))
    elastic = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic")
    got = result(driver(tmp_path, ELASTIC % (elastic, np_, hosts), env={"ELASTIC_FAULT": "127.0.0.1:0@7:sigkill"},
                        timeout=180))
    survivors = np_ - 1
    total = float(sum(range(1, 21)))
    assert got == [(r, survivors, 20, [total] * 3) for r in range(survivors)], got


SLEEPS = """
import pathlib, time, unison

def sleeps(folder):
    unison.init()
    pathlib.Path(folder, "started.%%d" %% unison.rank()).touch()
    time.sleep(60)

if __name__ == "__main__":
    try:
        unison.run(sleeps, args=(%r,), num_proc=2)
    except KeyboardInterrupt:
        print("INTERRUPTED")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_a_caller_interrupted_or_killed_leaves_no_rank_running(tmp_path, signum):
    script = tmp_path / "driver.py"
    script.write_text(SLEEPS % str(tmp_path))
    # A test run started in the background (as CI may be) ignores SIGINT,
    # and Python keeps an ignored SIGINT ignored: the caller gets the
    # default back, as a terminal's foreground process has it.
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=without_mpi(), cwd=str(tmp_path),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not all((tmp_path / ("started.%d" % r)).exists() for r in range(2)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.1)
    start = time.monotonic()
    proc.send_signal(signum)   # the caller alone, as a notebook's interrupt, or the OOM killer, would
    out, _ = proc.communicate(timeout=60)
    if signum == signal.SIGINT:  # KeyboardInterrupt reaches the caller once the ranks are stopped
        assert "INTERRUPTED" in out.decode(), out.decode()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = subprocess.run(["pgrep", "-f", "unison.runner.function"], stdout=subprocess.PIPE).stdout.decode().split()
        if not left:
            break
        time.sleep(0.2)
    assert left == [], "ranks still running: %s" % left
    assert time.monotonic() - start < 20
