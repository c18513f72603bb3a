"""A worker's side of an elastic job: how init() learns this process's rank
for the next round, and how rank 0 asks whether the hosts changed.

unisonrun's elastic driver (runner/elastic_driver.py) starts each worker with
UNISON_ELASTIC_DRIVER (where it listens), UNISON_ELASTIC_WORKER (this
worker's name, host:slot) and the job's secret, and no rank. Each init()
then joins a round: the worker says where it could listen as rank 0, and
waits until the driver has heard from every worker of the next round; the
driver answers with the rank, size and rendezvous of the round, which
init() puts in the environment the core reads. One connection per worker
lasts for the worker's life, so the driver also learns at once when a
worker's process is gone. While a worker starts in a round, a second one
waits to hear that a member of that round died (watch_round).

The connection (keyed_listener.connect) proves the job's secret with an
HMAC-SHA256 challenge both ways before anything is unpickled.
"""
import os
import sys
import threading

from unison import keyed_listener, network

DRIVER = "UNISON_ELASTIC_DRIVER"
WORKER = "UNISON_ELASTIC_WORKER"

_connection = None
_round = None  # the driver's answer for the round this worker is in


def in_elastic_job():
    return bool(os.environ.get(DRIVER))


def _connect():
    host, _, port = os.environ[DRIVER].rpartition(":")
    return keyed_listener.connect((host, int(port)), os.environ.get("UNISON_SECRET_KEY", "").encode())


def _driver():
    global _connection
    if _connection is None:
        try:
            _connection = _connect()
        except (OSError, EOFError) as e:
            raise SystemExit("unison: cannot reach the elastic driver at %s=%s (%s); elastic workers are "
                             "started by unisonrun" % (DRIVER, os.environ[DRIVER], e))
    return _connection


def watch_round(on_lost):
    """Calls on_lost(round, reason), from a thread of its own, if the driver
    says a member of the round this worker last joined died; the thread
    ends when the next round forms. It has a connection of its own: the
    worker's is busy with its joins."""
    number = _round["round"]

    def watch():
        try:
            connection = _connect()
            connection.send({"op": "watch", "round": number})
            answer = connection.recv()
            connection.close()
        except (OSError, EOFError):
            return  # the driver is gone; the worker's own connection says so
        if answer.get("lost"):
            on_lost(number, answer["lost"])

    threading.Thread(target=watch, name="unison-round-watch", daemon=True).start()


def _ask(request):
    connection = _driver()
    try:
        connection.send(request)
        return connection.recv()
    except (OSError, EOFError):
        # The launcher is gone: nothing can form another round.
        raise SystemExit("unison: the elastic driver (unisonrun) is gone; worker %s stops" % os.environ.get(WORKER))


def _listen_address():
    """The address other hosts can reach this worker at, a port free on it,
    for the driver to hand out should this worker become rank 0, and the
    socket bound to that port. The socket holds the port until init() is
    about to listen on it: closed at once, the port went back to the
    kernel for the whole of the round's forming, and a connection another
    worker opened to the driver meanwhile could take it as its own
    (rank 0 then failed with "Address already in use")."""
    interface = os.environ.get("UNISON_NETWORK_INTERFACE")
    if interface and interface != "0.0.0.0":
        address = network.interface_address(interface)
    else:
        address = network.route_source(os.environ[DRIVER].rpartition(":")[0])
    probe = network.bind_a_port_nobody_takes_by_chance(address)
    return address, probe.getsockname()[1], probe


def join_round():
    """Blocks until the driver places this worker in the next round, and sets
    the environment init() reads; returns the socket holding the port this
    worker offered, for init() to close just before the core listens. A
    worker the next round has no place for (its host was removed or
    blacklisted) exits quietly with status 0; when the driver ends the job,
    the worker exits with its reason."""
    global _round
    address, port, held = _listen_address()
    try:
        answer = _ask({"op": "join", "worker": os.environ.get(WORKER), "address": address, "port": port,
                       "round": _round["round"] if _round else -1})
    except BaseException:
        held.close()
        raise
    if answer["kind"] != "assign":
        held.close()
    if answer["kind"] == "dismiss":
        print("unison: worker %s leaves the job: %s" % (os.environ.get(WORKER), answer["reason"]),
              file=sys.stderr, flush=True)
        raise SystemExit(0)
    if answer["kind"] == "end":
        raise SystemExit("unison: the job is ending: %s" % answer["reason"])
    for key in [k for k in os.environ if k.startswith("UNISON_RENDEZVOUS_")]:
        del os.environ[key]
    os.environ.update(answer["env"])
    _round = answer
    return held


def hosts_changed():
    """None while the hosts are those the current round began with; else
    whether hosts were only removed (no newcomer needs the state)."""
    if _round is None:
        return None
    answer = _ask({"op": "hosts", "since": _round["hosts_version"]})
    return answer["removed_only"] if answer["changed"] else None


def forget_the_driver():
    """Closes this worker's connection to the driver and forgets its round,
    for a process that runs one worker after another (engine_worker.py):
    each is a worker of its own to the driver."""
    global _connection, _round
    if _connection is not None:
        try:
            _connection.close()
        except OSError:
            pass
    _connection = None
    _round = None
