"""unison.run(func, ...): Horovod's horovod.run, a launcher called from Python.

    import unison
    results = unison.run(train, args=(0.01,), num_proc=2)   # [rank 0's return value, rank 1's]
    results = unison.run(train, num_proc=4, hosts="node1:2,node2:2")

It starts the ranks as unisonrun would, with the same options under
horovod.run's names, calls `func(*args, **kwargs)` in each, and returns
what each rank returned, in rank order. A rank whose function raises fails
the call with a RuntimeError that names the rank and carries its traceback
(the rank's own exception is its __cause__ when it pickles).

How it gets there. The caller's process pickles the function and its
arguments, then runs `unisonrun ... python -m unison.runner.function_rank`. Each
rank fetches the pickle from a small service in the caller, runs it, and
sends back the result. A connection to the service must prove a key made
for this call (keyed_listener.py: the key never crosses the network), and
ranks on other hosts get the key on ssh's standard input with the job's
secret, never on a command line (ssh.SECRET_VARIABLES).

Functions of the caller's main script pickle by reference
(`__main__.train`). A rank therefore imports that script first, under the
name `__mp_main__`, as multiprocessing's spawn start method does, so that
its `if __name__ == "__main__":` block does not run again (a script that
calls unison.run() with no such block is imported up to that call). What
cannot go by reference (lambdas, closures, functions typed into a notebook)
goes by value through cloudpickle, Horovod's choice, where it is installed.
"""
import multiprocessing.spawn
import os
import pickle
import re
import secrets
import signal
import subprocess
import sys
import threading
import traceback
import types
import warnings

from unison import basics, keyed_listener, network
from unison.keyed_listener import KeyedListener
from unison.runner.hosts import parse_hosts
from unison.runner.processes import die_with_parent

ADDRESS, KEY = "UNISON_RUN_FUNCTION", "UNISON_RUN_FUNCTION_KEY"


def cloudpickle_or_none():
    """The cloudpickle module where it is installed (what pickles by value
    what pickle can only name), else None."""
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:
        return None


def run(func, args=(), kwargs=None, num_proc=None, min_num_proc=None, max_num_proc=None, slots=None,
        reset_limit=None, cooldown_range=None, hosts=None, hostfile=None, start_timeout=None, ssh_port=None,
        ssh_identity_file=None, disable_cache=None, output_filename=None, verbose=None, use_gloo=None,
        use_mpi=None, mpi_args=None, network_interface=None, executable=None, np=None, min_np=None, max_np=None):
    """Runs func(*args, **kwargs) on `num_proc` ranks and returns the list
    of their return values, in rank order (for an elastic job, that of the
    ranks it ended with). The options are horovod.run's and mean what
    unisonrun's options of the same names mean; `executable` is the Python
    each rank runs (this one's by default)."""
    if _importing_the_callers_script:
        raise _TheCallIsReached()  # in a rank, importing a script whose call has no main guard (_prepare)
    num_proc = _renamed("np", np, "num_proc", num_proc)
    min_num_proc = _renamed("min_np", min_np, "min_num_proc", min_num_proc)
    max_num_proc = _renamed("max_np", max_np, "max_num_proc", max_num_proc)
    if hosts is not None and hostfile is not None:
        raise ValueError("unison.run: give hosts or hostfile, not both")
    if use_gloo and use_mpi:
        raise ValueError("unison.run: give use_gloo or use_mpi, not both")
    num_proc = 1 if num_proc is None else num_proc
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ValueError("unison.run: num_proc=%r: give a number of ranks, at least 1" % (num_proc,))
    options = ["-np", str(num_proc)]
    named = {"-np": "num_proc"}  # unisonrun's option -> this function's argument, for its errors
    for flag, name, value in (("--min-np", "min_num_proc", min_num_proc), ("--max-np", "max_num_proc", max_num_proc),
                              ("--slots", "slots", slots), ("--reset-limit", "reset_limit", reset_limit),
                              ("-H", "hosts", hosts), ("--hostfile", "hostfile", hostfile),
                              ("--start-timeout", "start_timeout", start_timeout), ("--ssh-port", "ssh_port", ssh_port),
                              ("--ssh-identity-file", "ssh_identity_file", ssh_identity_file),
                              ("--output-filename", "output_filename", output_filename),
                              ("--mpi-args", "mpi_args", mpi_args),
                              ("--network-interface", "network_interface", network_interface)):
        if value is not None:
            options += [flag, str(value)]
            named[flag] = name
    if cooldown_range is not None:
        options += ["--blacklist-cooldown-range"] + [str(v) for v in cooldown_range]
        named["--blacklist-cooldown-range"] = "cooldown_range"
    for flag, value in (("--disable-cache", disable_cache), ("--verbose", verbose), ("--gloo", use_gloo),
                        ("--mpi", use_mpi)):
        if value:
            options.append(flag)
    elastic = min_num_proc is not None or max_num_proc is not None

    payload = _payload(func, () if args is None else tuple(args), {} if kwargs is None else dict(kwargs))
    try:
        addresses = _service_address(hosts, hostfile, network_interface)
    except SystemExit as e:  # the launcher's words for bad hosts or interfaces, not an exit of this process
        raise ValueError("unison.run: " + _as_given(re.sub(r"^unisonrun: ", "", str(e)), named)) from None
    service = _Service(addresses, payload)
    env = dict(os.environ)
    env.update({ADDRESS: "%s:%d" % service.address, KEY: service.key})
    command = [sys.executable, "-m", "unison.run"] + options + [
        executable or sys.executable, "-m", "unison.runner.function_rank"]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=die_with_parent)  # the ranks end with the launcher, and it with this process
    # Copied to sys.stdout and sys.stderr, not left on file descriptors 1
    # and 2: a notebook or a test runner shows what the ranks print.
    said = []  # the launcher's own lines
    copies = [threading.Thread(target=_copy, args=(launcher.stdout, sys.stdout, None), daemon=True),
              threading.Thread(target=_copy, args=(launcher.stderr, sys.stderr, said), daemon=True)]
    for t in copies:
        t.start()
    try:
        status = launcher.wait()
    except BaseException:  # Ctrl-C: unisonrun stops every rank, as on a terminal
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            launcher.kill()
        raise
    finally:
        for t in copies:
            t.join(timeout=5)
        service.close()
    return _outcome(service, status, said, named, num_proc, elastic)


def _renamed(old, old_value, new, new_value):
    if old_value is None:
        return new_value
    warnings.warn("unison.run: %s is deprecated, use %s" % (old, new), DeprecationWarning, stacklevel=3)
    return old_value if new_value is None else new_value


def _payload(func, args, kwargs):
    """The pickled call, and how a rank prepares to unpickle it.

    By reference wherever the ranks can import what it names: Python's
    pickle, with the caller's main script imported in each rank. Its code
    is then the script's own, so tracebacks name the script's lines and
    tf.function's AutoGraph finds the source (cloudpickle renames every
    function's file "<dynamic-code>"). By value, through cloudpickle, only
    where the ranks could not import it: lambdas, closures, and whatever an
    interactive session defined."""
    call = (func, args, kwargs)
    cloudpickle = cloudpickle_or_none()
    interactive = not getattr(sys.modules.get("__main__"), "__file__", None)
    if interactive and cloudpickle is None and getattr(func, "__module__", None) == "__main__":
        raise ValueError("unison.run: %s was defined in an interactive session, which the ranks cannot import; "
                         "define it in a module or a script, or install cloudpickle" % getattr(func, "__name__", func))
    pickled = None
    if not (interactive and cloudpickle is not None):
        try:
            pickled, pickler = pickle.dumps(call), "pickle"
        except Exception as e:
            if cloudpickle is None:
                raise ValueError("unison.run: the function and its arguments must pickle (%s: %s); install "
                                 "cloudpickle to send lambdas and closures" % (type(e).__name__, e)) from None
    if pickled is None:
        try:
            pickled, pickler = cloudpickle.dumps(call), "cloudpickle"
        except Exception as e:
            raise ValueError("unison.run: the function and its arguments must pickle: %s: %s"
                             % (type(e).__name__, e)) from None
    preparation = multiprocessing.spawn.get_preparation_data("unison-run")
    preparation.pop("authkey", None)  # this process's own; the ranks' is their own business
    return pickle.dumps((pickler, preparation, pickled))


def _service_address(hosts, hostfile, network_interface):
    """(address to bind, address the ranks reach it at)."""
    if network_interface == "0.0.0.0":
        network_interface = None
    if network_interface:
        address = network.interface_address(network_interface)
        return address, address
    if hosts is None and hostfile is None:
        return "127.0.0.1", "127.0.0.1"

    named = types.SimpleNamespace(hosts=hosts, hostfile=hostfile)
    remote = [h for h, _ in parse_hosts(named) if not network.is_this_machine(h)]
    if not remote:
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", network.route_source(remote[0])


def _copy(stream, sink, said):
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        if said is not None and text.startswith("unisonrun: "):
            said.append(text)
        sink.write(text)
        sink.flush()
    stream.close()


class _Service:
    """Hands the call to every rank that asks and keeps what they send back."""

    def __init__(self, addresses, payload):
        bind, reached = addresses
        self.key = secrets.token_hex(32)
        self.payload = payload
        self.results = {}  # rank -> pickled return value
        self.failures = []  # (rank, pickled exception or None, traceback text), in the order they came
        self.lock = threading.Lock()
        self.listener = KeyedListener(bind, self.key.encode(), self._serve)
        self.address = (reached, self.listener.address[1])

    def _serve(self, connection):
        with connection:
            try:
                request = connection.recv()
                if request[0] == "call":
                    connection.send_bytes(self.payload)
                    return
                with self.lock:
                    if request[0] == "returned":
                        self.results[request[1]] = request[2]
                    elif request[0] == "raised":
                        self.failures.append(request[1:])
                connection.send("ok")
            except (EOFError, OSError):
                pass

    def close(self):
        self.listener.close()


def _as_given(message, named):
    """The launcher's message about its options, naming this function's arguments."""
    for flag, name in named.items():
        message = re.sub(r"(?<!\S)%s (?=\S)" % re.escape(flag), name + "=", message)
    return message


def _outcome(service, status, said, named, num_proc, elastic):
    refused = [line.strip()[len("unisonrun: error: "):] for line in said if line.startswith("unisonrun: error: ")]
    if refused:  # an option unisonrun refused, named as it was given here
        raise ValueError("unison.run: " + _as_given(refused[-1], named))
    with service.lock:
        results, failures = dict(service.results), list(service.failures)
    if failures:
        rank, exception, text = failures[0]
        cause = None
        if exception is not None:
            try:
                cause = pickle.loads(exception)
            except Exception:
                cause = None
        raise RuntimeError("unison.run: rank %s raised an exception:\n%s" % (rank, text.rstrip())) from cause
    if status != 0:
        ended = [line.strip() for line in said if line.startswith("unisonrun: job failed")]
        raise RuntimeError("unison.run: the job failed (unisonrun exited with status %d)%s"
                           % (status, ": " + ended[-1][len("unisonrun: "):] if ended else ""))
    if elastic:  # a rank that shut unison down and had no rank from the launcher comes last
        return [pickle.loads(results[r]) for r in sorted(results, key=lambda r: (r is None, r or 0))]
    missing = [r for r in range(num_proc) if r not in results]
    if missing:
        raise RuntimeError("unison.run: ranks %s ended without returning from the function" % missing)
    return [pickle.loads(results[r]) for r in range(num_proc)]


# ---- in each rank ----------------------------------------------------------------


def _ask(request):
    host, _, port = os.environ[ADDRESS].rpartition(":")
    with keyed_listener.connect((host, int(port)), os.environ[KEY].encode()) as connection:
        connection.send(request)
        return connection.recv_bytes() if request[0] == "call" else connection.recv()


def _rank():
    """This rank's place: the job's, or for a job that shut unison down, the launcher's."""
    if basics.is_initialized():
        return basics.rank()
    for name in ("UNISON_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return None


# A rank imports its caller's main script (_prepare). In a script that
# calls unison.run() at its top level with no `if __name__ == "__main__":`
# around it, that import reaches the call again, which would start a job
# from every rank. multiprocessing's spawn refuses such a script; Horovod,
# which sends the function by value, runs it. Here the call ends the import:
# the script then holds what ran before the call, all that the caller had
# defined when it pickled the function.
_importing_the_callers_script = False


class _TheCallIsReached(BaseException):
    """Ends a rank's import of its caller's main script at unison.run()."""


def _prepare(preparation, import_main):
    """Takes the caller's sys.path, sys.argv and working directory, and
    imports its main script when functions of it pickled by reference, as
    multiprocessing's spawn does; what does not exist on this host is left
    out."""
    global _importing_the_callers_script
    if not import_main:
        preparation.pop("init_main_from_path", None)
        preparation.pop("init_main_from_name", None)
    if not os.path.isdir(preparation.get("dir", "")):
        preparation.pop("dir", None)
    if not os.path.exists(preparation.get("init_main_from_path", "")):
        preparation.pop("init_main_from_path", None)
    _importing_the_callers_script = True
    try:
        multiprocessing.spawn.prepare(preparation)  # the main script's import comes last
    except _TheCallIsReached as reached:
        _keep_the_script_up_to_the_call(reached.__traceback__)
    finally:
        _importing_the_callers_script = False


def _keep_the_script_up_to_the_call(trace):
    """Makes the main script's namespace, as it stood when the import
    reached unison.run(), this rank's __main__ (and __mp_main__), as spawn
    does with a whole one."""
    while trace is not None and trace.tb_frame.f_globals.get("__name__") != "__mp_main__":
        trace = trace.tb_next
    if trace is None:  # run() raised it from somewhere other than the script
        raise RuntimeError("unison.run: a rank's import of the caller's main script met a call of unison.run() "
                           "outside the script")
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(trace.tb_frame.f_globals)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def worker():
    if ADDRESS not in os.environ or KEY not in os.environ:
        raise SystemExit("unison.runner.function_rank is run by unison.run(); see help(unison.run)")
    pickler_name, preparation, call = pickle.loads(_ask(("call",)))
    # What comes back is pickled as the call was: the caller can load it.
    pickler = cloudpickle_or_none() if pickler_name == "cloudpickle" else pickle
    # A call that went by value names nothing of the main script.
    _prepare(preparation, import_main=pickler is pickle)
    try:
        func, args, kwargs = pickle.loads(call)
        value = func(*args, **kwargs)
        returned = pickler.dumps(value)
    except SystemExit as e:
        if e.code in (None, 0):  # a function that ends with sys.exit(0) returned nothing
            returned = pickle.dumps(None)
        else:
            _raised(e, pickler)
            raise
    except BaseException as e:
        _raised(e, pickler)
        return 1
    _ask(("returned", _rank(), returned))
    return 0


def _raised(exception, pickler):
    text = traceback.format_exc()
    try:
        pickled = pickler.dumps(exception)
    except Exception:
        pickled = None
    try:
        _ask(("raised", _rank(), pickled, text))
    except OSError:
        pass
    print(text, file=sys.stderr, end="", flush=True)

