"""The launcher's processes: starting a rank's (or an elastic worker's)
process, forwarding its output with the rank's prefix, signalling it, and
the Job that waits on a set of them and stops the rest when one fails.
Every way of starting ranks (local.py, ssh.py, mpi.py, elastic_driver.py)
uses these."""
import ctypes
import glob
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent():
    # A rank must not outlive a launcher that was killed outright.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass



# How a rank's wrapper on another host says the rank failed (ssh.py,
# mpi.py): ssh's own exit status cannot tell a signal from a status.
FAILURE = re.compile(rb"unisonrun: rank (\d+) .*?((?:exited with status|was killed by signal) \d+.*)$")


def say(message):
    """Writes "unisonrun: <message>" to the launcher's standard error as one
    write. print() writes the text and its newline apart where Python is
    unbuffered (PYTHONUNBUFFERED, which tox sets), and a rank's line
    forwarded in between ran into the launcher's."""
    sys.stderr.write("unisonrun: %s\n" % message)
    sys.stderr.flush()


def _forward(stream, rank, kind, sink, log_file, report=None, timestamped=False):
    prefix = ("[%s]<%s>:" % (rank, kind)).encode()  # a rank, or an elastic worker host:slot
    for line in iter(stream.readline, b""):
        if report is not None:
            match = FAILURE.search(line.rstrip(b"\n"))
            if match:
                report.setdefault(rank, match.group(2).decode(errors="replace"))
        if not line.endswith(b"\n"):
            line += b"\n"
        # The time the line arrived (a rank's buffered output arrives late),
        # in the files too: they are what is read afterwards.
        stamp = _timestamp() if timestamped else b""
        if log_file is not None:
            log_file.write(stamp + line)
            log_file.flush()
        sink.buffer.write(stamp + prefix + line)
        sink.buffer.flush()
    stream.close()


def _timestamp():
    now = time.time()
    return (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + ".%06d " % int(now % 1 * 1e6)).encode()


def describe_exit(code):
    if code < 0:
        try:
            return "was killed by signal %d (%s)" % (-code, signal.Signals(-code).name)
        except ValueError:
            return "was killed by signal %d" % -code
    return "exited with status %d" % code


def start_process(command, env, stdin_text=None):
    """A rank's process (or an elastic worker's): a session of its own, so
    that signals reach it only through the launcher, and killed with the
    launcher. stdin_text goes first on its standard input, which stays open:
    a remote wrapper ends its rank when it closes (ssh.py)."""
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent)
    except OSError as e:
        # No such program, or not one this user may run: said as a shell
        # says it, with a shell's status (127, 126), not as a traceback of
        # the launcher's. The ranks started before it end with the launcher.
        missing = isinstance(e, FileNotFoundError) and os.sep not in command[0]
        say("%s: %s" % (command[0], "command not found" if missing else e.strerror))
        raise SystemExit(127 if isinstance(e, FileNotFoundError) else 126) from None
    if stdin_text is not None:
        try:
            proc.stdin.write(stdin_text.encode())
            proc.stdin.flush()
        except BrokenPipeError:
            # It ended without reading it: ssh could not reach the host, or
            # the remote command could not start. That is reported as any
            # rank's end is, with its status and what it printed; a traceback
            # from here would say neither.
            pass
    return proc


def forward_output(proc, label, folder, threads, logs, report=None, mode="wb", timestamped=False):
    """Copies the process's output to ours, each line prefixed with label
    (and the time, when timestamped), and to folder/stdout and folder/stderr
    when folder is given; `report` collects a remote wrapper's account of how
    its rank ended (stderr)."""
    for stream, kind, sink in ((proc.stdout, "stdout", sys.stdout), (proc.stderr, "stderr", sys.stderr)):
        log_file = None
        if folder:
            os.makedirs(folder, exist_ok=True)
            log_file = open(os.path.join(folder, kind), mode)
            logs.append(log_file)
        t = threading.Thread(target=_forward, args=(stream, label, kind, sink, log_file,
                                                    report if kind == "stderr" else None, timestamped),
                             daemon=True)
        t.start()
        threads.append(t)


class Launch:
    """How one rank starts: its command, its environment, and, for a rank on
    another host, the host (the command is then ssh) and what ssh's stdin
    carries first (the job's secret, which never goes on a command line)."""

    def __init__(self, rank, command, env, host=None, stdin_text=None):
        self.rank, self.command, self.env, self.host, self.stdin_text = rank, command, env, host, stdin_text


STOP_GRACE_SECONDS = 5
# How long after a rank's failure the launcher waits for others before it
# says which one the job failed by (Job._cause): long enough for a killed
# rank's end to come back from another host, short beside any grace period.
CAUSE_WINDOW_SECONDS = 0.5


def the_failure_to_report(failures):
    """Which of `failures`, (when seen, how the rank ended) pairs in the
    order seen, a job is reported as having failed by: of those seen within
    CAUSE_WINDOW_SECONDS of the first, the first a signal killed, else the
    first. A rank killed outright takes its peers down with it (they raise
    RankFailedError and exit with an error within milliseconds), and a
    survivor's end can be seen before the victim's, whose end comes back
    through another host's wrapper or mpirun: reporting the survivor would
    name the wrong rank. Returns an index into `failures`."""
    first = failures[0][0]
    for index, (when, how) in enumerate(failures):
        if when - first <= CAUSE_WINDOW_SECONDS and "killed by signal" in how:
            return index
    return 0


def exit_status_for(how):
    """The status unisonrun exits with for a rank that ended as `how` says
    (describe_exit's words): the rank's own status, or 128 + the signal, as
    a shell reports a killed command."""
    status = re.search(r"exited with status (\d+)", how)
    if status:
        return int(status.group(1))
    return 128 + int(re.search(r"killed by signal (\d+)", how).group(1))


class Job:
    def __init__(self, args):
        self.args = args
        self.job_id = new_job_id()
        self.procs = []
        self.hosts = {}  # rank -> host, for ranks started on hosts named with -H
        self.wrapped = set()  # ranks started on another host, under its wrapper (ssh.py)
        self.reported = {}  # rank -> how a remote rank's wrapper said it ended
        self.threads = []
        self.logs = []
        # (rank, exit code) in the order the ranks ended, appended by one
        # waiting thread per rank. Polling all ranks in turn cannot tell which
        # of two ranks that ended between two polls ended first, and the first
        # is the one to blame: the others usually ended because it did.
        self.exits = []
        self.exited = threading.Condition()
        # When the ranks still running are killed: set once the launcher
        # is told to stop (stop()) or a rank's failure's grace period ends.
        self.kill_at = None
        self.told_to_stop = None  # the signal that told the launcher to stop

    def log(self, message):
        if self.args.verbose:
            say(message)

    def describe(self, rank):
        return "rank %d (host %s)" % (rank, self.hosts[rank]) if rank in self.hosts else "rank %d" % rank

    def start(self, launches):
        for launch in launches:
            rank = launch.rank
            if launch.host is not None:
                self.hosts[rank] = launch.host
            if launch.stdin_text is not None:
                self.wrapped.add(rank)
            self.log("starting %s: %s" % (self.describe(rank), " ".join(launch.command)))
            proc = start_process(launch.command, launch.env, launch.stdin_text)
            self.procs.append(proc)
            waiter = threading.Thread(target=self._await_exit, args=(rank, proc), daemon=True)
            waiter.start()
            folder = os.path.join(self.args.output_filename, "rank.%d" % rank) if self.args.output_filename else None
            forward_output(proc, rank, folder, self.threads, self.logs,
                           report=self.reported if rank in self.wrapped else None,
                           timestamped=self.args.prefix_output_with_timestamp)

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
                if proc.stdin is not None:
                    try:  # ssh's end: the remote wrapper stops its rank
                        proc.stdin.close()
                    except OSError:
                        pass
                signal_process_group(proc.pid, signum)

    def stop(self, signum):
        """The launcher was told to stop (Ctrl-C, SIGTERM): every rank is
        told the same, and a rank still running STOP_GRACE_SECONDS later is
        killed. A rank may ignore the signal, block it in native code, or be
        stopped (SIGSTOP, a debugger): the launcher must end anyway, as
        horovodrun's does, rather than wait on it for ever."""
        self.log("forwarding signal %d to every rank" % signum)
        self.signal_all(signum)
        if self.kill_at is None:
            self.told_to_stop = signum
            self.kill_at = time.monotonic() + STOP_GRACE_SECONDS

    def kill_the_rest(self, why):
        with self.exited:
            ended = {rank for rank, _ in self.exits}
        running = [self.describe(rank) for rank in range(len(self.procs)) if rank not in ended]
        if running:
            say("%s still running %s; killing %s" % (", ".join(running), why, "it" if len(running) == 1 else "them"))
        self.signal_all(signal.SIGKILL)

    def wait(self):
        """Returns the launcher's exit status."""
        failed = None  # (rank, code) of the rank whose failure the job is reported as
        failures = []  # (when seen, rank, code) of every rank that ended with an error, in order
        first_failure_at = None
        deadline = None
        seen = 0
        while True:
            with self.exited:
                # Short waits, so that Ctrl-C and SIGTERM handlers run.
                self.exited.wait_for(lambda: len(self.exits) > seen, timeout=0.05)
                ended = list(self.exits)
            for rank, code in ended[seen:]:
                if code != 0:
                    failures.append((time.monotonic(), rank, code))
                    if first_failure_at is None:
                        first_failure_at = failures[-1][0]
            seen = len(ended)
            if failed is None and failures and (seen == len(self.procs)
                                                or time.monotonic() - first_failure_at >= CAUSE_WINDOW_SECONDS):
                failed = self._cause(failures)
                deadline = time.monotonic() + self.args.failure_grace_seconds
                say("%s %s; stopping the other ranks" % (self.describe(failed[0]), self._how(*failed)))
            if seen == len(self.procs):
                break
            if deadline is not None and time.monotonic() > deadline:
                self.log("grace period over: terminating the remaining ranks")
                self.signal_all(signal.SIGTERM)
                deadline = None
                if self.kill_at is None:
                    self.kill_at = time.monotonic() + STOP_GRACE_SECONDS
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                self.kill_the_rest("%d s after signal %d" % (STOP_GRACE_SECONDS, self.told_to_stop)
                                   if self.told_to_stop else "%d s after SIGTERM" % STOP_GRACE_SECONDS)
                self.kill_at = None
        for t in self.threads:
            t.join(timeout=5)
        for f in self.logs:
            f.close()
        self.cleanup()
        if failed is None:
            return 0
        rank, code = failed
        how = self._how(rank, code)
        say("job failed: %s %s" % (self.describe(rank), how))
        return exit_status_for(how)

    def _cause(self, failures):
        """The (rank, code) the job failed by, of `failures` ((when seen,
        rank, code) in order), as the_failure_to_report chooses it."""
        self._await_reports([rank for _, rank, _ in failures])
        chosen = the_failure_to_report([(when, self._how(rank, code)) for when, rank, code in failures])
        return failures[chosen][1:]

    def _await_reports(self, ranks, seconds=1.0):
        """Gives the wrappers of those of `ranks` that ran on other hosts up
        to `seconds` in all to say how their rank ended: the line may still
        be on its way when ssh's own end is seen. (Ranks on this machine
        have no wrapper, and nothing to wait for.)"""
        deadline = time.monotonic() + seconds
        while any(r in self.wrapped and r not in self.reported for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _how(self, rank, code):
        # A remote rank's own wrapper knows how it ended; ssh only passes on a status.
        self._await_reports([rank])
        return self.reported.get(rank, describe_exit(code))

    def cleanup(self):
        remove_shared_memory(self.job_id)


def signal_process_group(pid, signum):
    """Sends a rank's process group `signum`, and SIGCONT after it unless
    the signal kills outright: a rank stopped by SIGSTOP or SIGTSTP would
    otherwise see a SIGTERM only when something continued it, and be killed
    STOP_GRACE_SECONDS later without running its handlers. (A rank held by
    a debugger stays held: ptrace's stops ignore SIGCONT.)"""
    try:
        os.killpg(pid, signum)
        if signum != signal.SIGKILL:
            os.killpg(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def new_job_id():
    """The launcher's pid (which says whose a leftover segment was) and 128
    random bits: the job's shared memory is named after it, and a name
    nobody can guess is one nobody can take first."""
    return "%d-%s" % (os.getpid(), secrets.token_hex(16))


def remove_shared_memory(job_id):
    """Ranks unlink their shared memory once all have attached; a crash
    during start-up can still leave a segment of the job behind."""
    for path in glob.glob("/dev/shm/unison-%s-*" % job_id):
        try:
            os.unlink(path)
        except OSError:
            pass
