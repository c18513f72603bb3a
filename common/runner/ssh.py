"""unisonrun across hosts without MPI: ranks on this machine start directly,
ranks on other hosts through ssh, and they meet over TCP.

    unisonrun -np 8 -H host1:4,host2:4 python train.py
    unisonrun -np 8 --hostfile hosts python train.py

Ranks fill the hosts in order (ranks 0-3 on host1 above). Each rank is told
the job's rendezvous (rank 0's host and a port) and a fresh per-job secret
that every connection between ranks must prove (native/tcp/). The secret
reaches a remote rank on ssh's standard input, never on a command line
that `ps` on the host would show, and so does the rest of the launcher's
environment, which every rank gets as under horovodrun
(rank_environment.py).

A remote rank runs under a small wrapper (`python -m unison.runner.ssh
--remote-rank`): it reads the secret and the environment, runs the command,
ends it when ssh's standard input closes (the launcher stopped the job, or
was killed), and says how the command ended, which ssh's exit status alone
cannot tell.

Hosts that are this machine (localhost, 127.0.0.1, its name, any of its
addresses) start their ranks directly; a different name for this machine
still counts as a host of its own, which is how two hosts are tested on one.
"""
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from unison.network import a_port_nobody_takes_by_chance, interface_address, is_this_machine, route_source
from unison.runner import rank_environment
from unison.runner.hosts import parse_hosts, place
from unison.runner.processes import (Launch, describe_exit, die_with_parent, remove_shared_memory, say,
                                     signal_process_group)

# Variables that hold secrets: the job's, the key of unison.run()'s service
# (function.py), and the job id, which names the job's shared memory
# (a name known to another user of the host is one they can take first).
# A remote rank gets them on ssh's standard input, with the rest of the
# launcher's environment (remote_launch), never on a command line that ps
# shows to every user.
SECRET_VARIABLES = ("UNISON_SECRET_KEY", "UNISON_RUN_FUNCTION_KEY", "UNISON_JOB_ID")


def rendezvous(args, placed, local):
    """(address, port) where rank 0 listens for the others."""
    first = placed[0]
    # Resolved here, as the other hosts would: on its own host a name often
    # resolves to a loopback address (Debian's 127.0.1.1), useless to them.
    try:
        address = socket.gethostbyname(first)
    except OSError:
        address = first
    if local[first]:
        remote = [h for h in placed if not local[h]]
        interface = args.network_interface if args.network_interface not in (None, "0.0.0.0") else None
        if interface:
            address = interface_address(interface)
        elif remote and address.startswith("127."):
            # "localhost" means nothing to the other hosts: give them the
            # address this machine reaches them from.
            address = route_source(remote[0])
    port = args.rendezvous_port
    if port is None:
        # A port free here now; on another host, most likely free there too
        # (rank 0 names it if not, with --rendezvous-port as the way out).
        port = a_port_nobody_takes_by_chance(socket.gethostbyname(address) if local[first] else "")
    return address, port


def ssh_command(args, host, remote_command):
    # $UNISON_SSH replaces ssh itself (a wrapper, or a test's stand-in).
    command = shlex.split(os.environ.get("UNISON_SSH", "ssh")) + ["-o", "BatchMode=yes"]
    if args.ssh_port:
        command += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        command += ["-i", args.ssh_identity_file]
    return command + [host, remote_command]


def launches(args, job_id, base):
    """Every rank's Launch (processes.py) for a job on the hosts of -H/--hostfile."""

    placed = place(parse_hosts(args), args.np)
    names = list(dict.fromkeys(placed))  # hosts in order of their first rank
    local = {h: is_this_machine(h) for h in names}
    secret = secrets.token_hex(32)
    job = {"UNISON_JOB_ID": job_id}
    if len(names) > 1:
        address, port = rendezvous(args, placed, local)
        job.update({"UNISON_RENDEZVOUS_ADDR": address, "UNISON_RENDEZVOUS_PORT": str(port)})
        if args.network_interface:
            job["UNISON_NETWORK_INTERFACE"] = args.network_interface
    result = []
    # The hosts as the user named them: two names for this machine are two
    # hosts, with shared memory of their own.
    for rank, (host, place_of_rank) in enumerate(zip(placed, rank_environment.placed_identities(placed))):
        identity = dict(job, **place_of_rank)
        if local[host]:
            env = dict(base)
            env.update(identity)
            if len(names) > 1:
                env["UNISON_SECRET_KEY"] = secret
            result.append(Launch(rank, args.command, env, host=host))
            continue
        env = dict(base, UNISON_SECRET_KEY=secret)
        env.update(identity)
        command, stdin_text = remote_launch(args, host, env, args.command)
        result.append(Launch(rank, command, dict(base), host=host, stdin_text=stdin_text))
    return result


def remote_launch(args, host, env, command):
    """(ssh command line, what goes on its standard input) that run
    `command` on `host` under the remote wrapper with `env`, less what is
    the launcher's own (rank_environment.py): unison's settings and what
    the wrapper needs to start on the command line, the rest (the secrets
    among it) on standard input as one JSON object after its length."""
    env = rank_environment.forwarded(env)
    settings = {k: v for k, v in env.items()
                if (k.startswith(("UNISON_", "HOROVOD_")) or k in rank_environment.BEFORE_THE_WRAPPER)
                and k not in SECRET_VARIABLES}
    remote = "cd %s 2>/dev/null; exec env %s %s -m unison.runner.ssh --remote-rank -- %s" % (
        shlex.quote(os.getcwd()), " ".join("%s=%s" % (k, shlex.quote(v)) for k, v in sorted(settings.items())),
        shlex.quote(sys.executable), " ".join(shlex.quote(c) for c in command))
    given = json.dumps({k: v for k, v in env.items() if k not in settings}).encode()
    return ssh_command(args, host, remote), "%d\n" % len(given) + given.decode()


# ---- on the remote host ----------------------------------------------------------


def _read_given_environment():
    """The variables remote_launch() sent on standard input ({} if none).
    Unbuffered reads of fd 0, never past them: after them comes nothing
    but its end, which says that the launcher is gone."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte or len(line) > 20:
            return {}
        line += byte
    if not line.strip().isdigit():
        return {}
    length, data = int(line), b""
    while len(data) < length:
        chunk = os.read(0, length - len(data))
        if not chunk:
            return {}
        data += chunk
    return json.loads(data.decode())


def remote_rank(argv):
    """Runs one rank on a remote host: see the module's docstring."""

    command = argv[1:] if argv[:1] == ["--"] else argv
    given = _read_given_environment()
    if not given.get("UNISON_SECRET_KEY"):
        raise SystemExit("unison.runner.ssh: no secret on standard input; this wrapper is started by unisonrun")
    env = dict(os.environ)
    env.update(given)
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)

    def stop(_signum=None, _frame=None):
        if proc.poll() is None:
            signal_process_group(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    def watch_stdin():
        # ssh closes it when the launcher stops the job, or dies.
        while os.read(0, 4096):
            pass
        stop()

    threading.Thread(target=watch_stdin, daemon=True).start()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    signal.signal(signal.SIGINT, stop)
    code = proc.wait()
    if code != 0:
        if "UNISON_JOB_ID" in env:
            remove_shared_memory(env["UNISON_JOB_ID"])
        if env.get("UNISON_ELASTIC_WORKER"):  # an elastic worker's rank changes between rounds
            who = "worker %s" % env["UNISON_ELASTIC_WORKER"]
        else:
            who = "rank %s (host %s)" % (env.get("UNISON_RANK", "?"), env.get("UNISON_HOSTNAME", "?"))
        say("%s %s" % (who, describe_exit(code)))
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--remote-rank"]:
        sys.exit(remote_rank(sys.argv[2:]))
    raise SystemExit("unison.runner.ssh is run by unisonrun; see unisonrun --help")
