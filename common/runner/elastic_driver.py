"""unisonrun's elastic driver: a job that outlives its workers and hosts.

    unisonrun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py
    unisonrun -np 4 --min-np 2 -H node1:2,node2:2 python train.py

The job runs in rounds. A round is a set of workers (processes, each named
host:slot) with ranks 0..size-1; within it the ranks meet and train as in
any unison job (shared memory within a host, TCP across hosts). A worker
learns its rank for a round from this driver when its init() joins the
round (elastic_worker.py), so a worker's process lives through many rounds.

- Hosts come from the discovery script (re-run every second; it prints
  `host:slots` or `host` lines, `host` taking --slots) or from -H.
- A worker that fails puts its host on the blacklist: permanently, or for a
  cooldown with --blacklist-cooldown-range LOW HIGH (LOW seconds the first
  time, doubling each time after, never more than HIGH).
- The survivors' collectives fail, they roll back to their last commit and
  join the next round. A member that does not rejoin soon after the first
  one did (2 x --peer-timeout-seconds, at least 5 s) is presumed hung, is
  killed, and its host blacklisted too.
- When hosts appear, their workers start at once and wait in init(); the
  running workers learn of the change at their next commit and rejoin.
- A round's ranks follow the order in which hosts were first seen, then
  slots, so survivors always hold the lowest ranks and rank 0, from which a
  newcomer receives the state, has it.
- Each round has min(available slots, --max-np) workers. Below --min-np
  for longer than --elastic-timeout, or past --reset-limit re-formations,
  the job ends with the reason.
- The job ends with status 0 when a member of the current round finishes
  with status 0 and the rest of that round do too.

-np is where --min-np and --max-np start from when they are not given: a
job never grows beyond what was asked without --max-np saying so.
"""
import os
import secrets
import signal
import subprocess
import threading
import time

from unison import network
from unison.keyed_listener import KeyedListener
from unison.runner import hosts, processes, rank_environment, ssh

DISCOVERY_INTERVAL_SECONDS = 1.0


def parse_discovered(text, default_slots, source):
    """{host: slots}, in the order listed, from `host:slots` or `host` lines."""
    hosts = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, slots = line.rpartition(":") if ":" in line else (line, "", str(default_slots))
        if not name or not slots.isdigit():
            raise ValueError("%s printed %r: write each host as host:slots or host" % (source, line))
        if int(slots) > 0:
            hosts[name] = int(slots)
    return hosts


class WorkerProcess:
    """A worker's process, started here or over ssh: what the driver waits
    for and stops. Another engine's workers (unison.ray's actors) offer the
    same two methods."""

    def __init__(self, proc):
        self.proc = proc

    def wait(self):
        """Blocks until the worker ends; its exit status (-N: signal N)."""
        return self.proc.wait()

    def stop(self, signum):
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        processes.signal_process_group(self.proc.pid, signum)


class Worker:
    def __init__(self, name, host, slot, process):
        self.name, self.host, self.slot, self.process = name, host, slot, process
        self.started = time.monotonic()
        self.connection = None
        self.pending = None  # its join request while it waits for a round
        self.joined = False  # it asked to join a round at least once (it called init())
        self.stopping = False  # the driver stopped it: its exit is no failure
        self.code = None
        self.seen = False  # the driver has dealt with its exit


class ElasticDriver:
    def __init__(self, args, job_id, base):
        self.args, self.job_id, self.base = args, job_id, base
        self.min_np = args.min_np if args.min_np is not None else args.np
        self.max_np = args.max_np if args.max_np is not None else max(args.np, self.min_np)
        peer_timeout = args.peer_timeout_seconds or float(base.get("UNISON_PEER_TIMEOUT_SECONDS", 10) or 10)
        self.rejoin_grace = max(5.0, 2 * peer_timeout)
        self.secret = secrets.token_hex(32)
        self.lock = threading.Condition()
        self.workers = {}  # name -> Worker, every process this job started
        self.order = []  # hosts in the order first seen
        self.discovered = {}  # host -> slots, as last discovered
        self.blacklist = {}  # host -> [until (monotonic), times blacklisted]
        self.available = {}  # discovered minus blacklisted
        self.hosts_version = 0
        self.changes = []  # (version, a host or slot was added)
        self.round = -1
        self.members = []  # worker names of the current round, in rank order
        self.watchers = []  # connections of the current round's workers waiting to hear it lost a member
        self.round_lost = None  # why the current round lost a member, once it has
        self.round_hosts_version = 0
        self.first_rejoin = None  # when a member of this round first asked for the next
        self.short_since = None  # since when fewer than --min-np slots are available
        self.finishing = False
        self.failure = None  # (status, message) that ends the job
        self.threads = []
        self.logs = []
        self.local = {}
        self.listener = None

    def log(self, message):
        if self.args.verbose:
            self.say(message)

    def say(self, message):
        processes.say(message)

    # ---- hosts -------------------------------------------------------------------

    def discover(self):
        if self.args.host_discovery_script:
            try:
                done = subprocess.run(self.args.host_discovery_script, shell=True, capture_output=True, text=True,
                                      timeout=30)
                if done.returncode != 0:
                    raise ValueError("exited with status %d: %s" % (done.returncode, done.stderr.strip()[-300:]))
                return parse_discovered(done.stdout, self.args.slots or 1, "--host-discovery-script")
            except (ValueError, OSError, subprocess.TimeoutExpired) as e:
                # Keep the hosts we knew: one failed discovery is not a lost cluster.
                self.say("--host-discovery-script %s failed (%s); keeping the hosts found before"
                         % (self.args.host_discovery_script, e))
                return None
        if self.args.hosts or self.args.hostfile:
            return dict(hosts.parse_hosts(self.args))
        return {"localhost": self.max_np}

    def hosts_are_fixed(self):
        """Whether discover() always finds the same hosts (-H), so that it
        runs once."""
        return not self.args.host_discovery_script

    def blacklist_host(self, host, why):
        until, times = self.blacklist.get(host, (0, 0))
        if until > time.monotonic():
            return  # already: its other workers fail with it
        times += 1
        if self.args.blacklist_cooldown_range:
            low, high = self.args.blacklist_cooldown_range
            cooldown = min(high, low * 2 ** (times - 1))
            self.say("blacklisting host %s for %g s: %s" % (host, cooldown, why))
        else:
            cooldown = float("inf")
            self.say("blacklisting host %s: %s" % (host, why))
        self.blacklist[host] = [time.monotonic() + cooldown, times]
        self.update_available()

    def update_available(self):
        now = time.monotonic()
        available = {h: s for h, s in self.discovered.items()
                     if h not in self.blacklist or self.blacklist[h][0] <= now}
        for host in available:
            if host not in self.order:
                self.order.append(host)
        if available != self.available:
            added = any(available.get(h, 0) > self.available.get(h, 0) for h in available)
            self.hosts_version += 1
            self.changes.append((self.hosts_version, added))
            self.log("hosts now %s" % (",".join("%s:%d" % (h, available[h]) for h in self.ordered(available))
                                       or "none"))
            self.available = available

    def ordered(self, hosts):
        return [h for h in self.order if h in hosts]

    def wanted(self):
        """The workers the next round should have, in rank order."""
        names = []
        for host in self.ordered(self.available):
            for slot in range(self.available[host]):
                if len(names) < self.max_np:
                    names.append("%s:%d" % (host, slot))
        return names

    # ---- workers -----------------------------------------------------------------

    def is_local(self, host):
        if host not in self.local:
            self.local[host] = network.is_this_machine(host)
        return self.local[host]

    def driver_address_for(self, host):
        if self.args.network_interface and self.args.network_interface != "0.0.0.0":
            return network.interface_address(self.args.network_interface)
        return "127.0.0.1" if self.is_local(host) else network.route_source(host)

    def start_worker(self, name):
        host, _, slot = name.rpartition(":")
        identity = {"UNISON_ELASTIC_DRIVER": "%s:%d" % (self.driver_address_for(host), self.listener.address[1]),
                    "UNISON_ELASTIC_WORKER": name, "UNISON_HOSTNAME": host, "UNISON_SECRET_KEY": self.secret}
        if self.args.network_interface:
            identity["UNISON_NETWORK_INTERFACE"] = self.args.network_interface
        worker = Worker(name, host, int(slot), self.launch(name, host, identity))
        self.workers[name] = worker
        threading.Thread(target=self.await_exit, args=(worker,), daemon=True).start()

    def launch(self, name, host, identity):
        """Starts worker `name` on `host`, its environment the job's with
        `identity` (how it reaches this driver, and the secret) added; returns
        its WorkerProcess."""
        stdin_text = None
        if self.is_local(host):
            env = dict(self.base, **identity)
            command = self.args.command
        else:
            command, stdin_text = ssh.remote_launch(self.args, host, dict(self.base, **identity), self.args.command)
            env = dict(self.base)
        self.log("starting worker %s: %s" % (name, " ".join(command)))
        proc = processes.start_process(command, env, stdin_text)
        # Appended to: a worker restarted on a host that came back keeps its name.
        folder = os.path.join(self.args.output_filename, "worker.%s" % name) if self.args.output_filename else None
        processes.forward_output(proc, name, folder, self.threads, self.logs, mode="ab",
                                 timestamped=self.args.prefix_output_with_timestamp)
        return WorkerProcess(proc)

    def await_exit(self, worker):
        code = worker.process.wait()
        with self.lock:
            worker.code = code
            self.lock.notify_all()

    def stop_worker(self, worker, signum=signal.SIGTERM):
        worker.stopping = True
        if worker.code is None:
            worker.process.stop(signum)

    def running(self):
        return [w for w in self.workers.values() if w.code is None]

    # ---- the workers' connections --------------------------------------------------

    def serve(self, connection):
        while True:
            try:
                request = connection.recv()
            except (EOFError, OSError):
                return
            with self.lock:
                if request.get("op") == "join":
                    worker = self.workers.get(request.get("worker"))
                    if worker is None:
                        connection.send({"kind": "dismiss", "reason": "this job started no worker of that name"})
                        continue
                    worker.connection = connection
                    worker.pending = request
                    worker.joined = True
                    if worker.name in self.members and self.first_rejoin is None:
                        self.first_rejoin = time.monotonic()
                    self.lock.notify_all()
                elif request.get("op") == "watch":
                    # Answered when a member of the round dies (step(), where
                    # a worker's failed exit is seen), or when the next round
                    # forms; a worker still starting in the round then ends
                    # its start-up (basics.init), since the dead one may
                    # never have reached it.
                    if request.get("round") == self.round and self.round_lost is None:
                        self.watchers.append(connection)
                    else:
                        connection.send({"lost": self.round_lost if request.get("round") == self.round else None})
                elif request.get("op") == "hosts":
                    since = request.get("since", 0)
                    news = [added for version, added in self.changes if version > since]
                    connection.send({"changed": bool(news), "removed_only": not any(news)})

    def answer(self, worker, message):
        try:
            worker.connection.send(message)
        except (OSError, ValueError):
            pass  # it is gone; its exit says the rest
        worker.pending = None

    # ---- rounds --------------------------------------------------------------------

    def form_round(self, names):
        self.round += 1
        members = [self.workers[n] for n in names]
        hosts = list(dict.fromkeys(w.host for w in members))
        on_host = {h: [w for w in members if w.host == h] for h in hosts}
        job = {"UNISON_JOB_ID": "%s-r%d" % (self.job_id, self.round), "UNISON_ELASTIC_ROUND": str(self.round)}
        if len(hosts) > 1:
            job["UNISON_RENDEZVOUS_ADDR"] = members[0].pending["address"]
            job["UNISON_RENDEZVOUS_PORT"] = str(members[0].pending["port"])
        identities = rank_environment.placed_identities([w.host for w in members])
        for worker, identity in zip(members, identities):
            env = dict(job, **identity)
            self.answer(worker, {"kind": "assign", "env": env, "round": self.round,
                                 "hosts_version": self.hosts_version})
        self.tell_watchers(None)
        self.round_lost = None
        self.members = names
        self.round_hosts_version = self.hosts_version
        self.first_rejoin = None
        self.say("round %d: %d workers (%s)" % (self.round, len(names), ", ".join(
            "%s:%d" % (h, len(on_host[h])) for h in hosts)))
        for worker in self.running():
            if worker.name not in names:
                if worker.pending is not None:
                    self.answer(worker, {"kind": "dismiss", "reason": "round %d has no place for it" % self.round})
                else:
                    self.stop_worker(worker)

    def tell_watchers(self, lost):
        for connection in self.watchers:
            try:
                connection.send({"lost": lost})
            except (OSError, ValueError):
                pass
        self.watchers = []

    def end(self, status, message):
        if self.failure is None:
            self.failure = (status, message)

    def step(self):
        """One look at everything; called with the lock held."""
        now = time.monotonic()
        if self.blacklist and any(until <= now for until, _ in self.blacklist.values()):
            self.update_available()

        # Workers that ended.
        for worker in list(self.workers.values()):
            if worker.code is None or worker.seen:
                continue
            worker.seen = True
            if worker.stopping:
                continue
            member = worker.name in self.members
            if worker.code == 0:
                # A member that ends with success says training is over. So
                # does one that never asked to join: its command ran to the
                # end without init(). Started again, it would only end again,
                # as often as the driver could start it.
                if member or not worker.joined:
                    self.finishing = True
                continue
            how = processes.describe_exit(worker.code)
            if self.finishing:
                self.end(1, "worker %s %s after the job had finished training" % (worker.name, how))
                continue
            self.say("worker %s %s" % (worker.name, how))
            if member and self.round_lost is None:
                self.round_lost = "worker %s of round %d %s" % (worker.name, self.round, how)
                self.tell_watchers(self.round_lost)
            self.blacklist_host(worker.host, "worker %s %s" % (worker.name, how))

        if self.finishing:
            # Every member ends on its own first; so does every worker of a
            # job that never formed a round (its command does not call
            # init()). Those waiting to join a round are ended with the job.
            outside = [] if self.round >= 0 else [w for w in self.workers.values() if not w.joined and not w.stopping]
            if not any(self.workers[n].code is None for n in self.members) and \
                    not any(w.code is None for w in outside):
                failed = [n for n in self.members if self.workers[n].code != 0]
                if failed:
                    self.end(1, "worker %s %s" % (failed[0], processes.describe_exit(self.workers[failed[0]].code)))
                else:
                    self.end(0, None)
            return

        wanted = self.wanted()
        # Fewer slots than --min-np: wait, but not for ever.
        if len(wanted) < self.min_np:
            if self.hosts_are_fixed() and not self.args.blacklist_cooldown_range:
                # Fixed hosts that never come off the blacklist: waiting cannot help.
                self.end(1, "only %d slots are left, fewer than --min-np %d, and the hosts are fixed (-H) with "
                         "no --blacklist-cooldown-range" % (len(wanted), self.min_np))
                return
            if self.short_since is None:
                self.short_since = now
                self.say("%d slots available, fewer than --min-np %d: waiting up to %g s (--elastic-timeout) "
                         "for more" % (len(wanted), self.min_np, self.args.elastic_timeout))
            elif now - self.short_since > self.args.elastic_timeout:
                self.end(1, "only %d slots were available, fewer than --min-np %d, for %g s (--elastic-timeout)"
                         % (len(wanted), self.min_np, self.args.elastic_timeout))
            return
        self.short_since = None

        for name in wanted:
            # A wanted worker that ended was stopped or dismissed: a failure
            # would have blacklisted its host, above, and made it unwanted.
            if name not in self.workers or self.workers[name].code is not None:
                self.start_worker(name)

        # Members that do not rejoin while the others wait are presumed hung.
        if self.first_rejoin is not None and now - self.first_rejoin > self.rejoin_grace:
            for name in self.members:
                worker = self.workers[name]
                if worker.code is None and worker.pending is None and not worker.stopping:
                    why = "worker %s did not rejoin within %g s of the others; presumed hung" % (
                        name, self.rejoin_grace)
                    self.say(why + ": killing it")
                    self.stop_worker(worker, signal.SIGKILL)
                    self.blacklist_host(worker.host, why)
            self.first_rejoin = now
            return
        # Newcomers that never join.
        for name in wanted:
            worker = self.workers[name]
            if name not in self.members and worker.pending is None and worker.code is None \
                    and now - worker.started > self.args.elastic_timeout:
                why = "worker %s did not join within %g s (--elastic-timeout)" % (name, self.args.elastic_timeout)
                self.say(why + ": killing it")
                self.stop_worker(worker, signal.SIGKILL)
                self.blacklist_host(worker.host, why)
                return

        if all(self.workers[n].pending is not None for n in wanted):
            if self.round >= 0 and self.args.reset_limit is not None and self.round >= self.args.reset_limit:
                self.end(1, "the job has re-formed %d times (--reset-limit %d) and would have to again"
                         % (self.round, self.args.reset_limit))
                return
            self.form_round(wanted)

    def discovery_loop(self):
        while self.failure is None:
            hosts = self.discover()
            with self.lock:
                if hosts is not None and hosts != self.discovered:
                    self.discovered = hosts
                    self.update_available()
                    self.lock.notify_all()
            if self.hosts_are_fixed():
                return
            time.sleep(DISCOVERY_INTERVAL_SECONDS)

    def run(self):
        hosts = self.discover()
        if hosts is None:
            self.say("job failed: no hosts to start on")
            return 1
        self.discovered = hosts
        self.update_available()
        self.listener = KeyedListener(self.listen_address(hosts), self.secret.encode(), self.serve,
                                      lambda e: self.say("refused a connection to the elastic driver: %s" % e))
        threading.Thread(target=self.discovery_loop, daemon=True).start()
        with self.lock:
            while self.failure is None:
                self.step()
                self.lock.wait(timeout=0.1)
        status, message = self.failure
        self.shut_down(message)
        return status

    def listen_address(self, hosts):
        """Where the driver listens for its workers: loopback for a job on
        this host, --network-interface's address when one is given (not every
        interface of the machine), and every address only where hosts reach
        this one over routes no flag names."""
        if self.args.network_interface and self.args.network_interface != "0.0.0.0":
            return network.interface_address(self.args.network_interface)
        if all(self.is_local(h) for h in hosts):
            return "127.0.0.1"
        return "0.0.0.0"

    def stop_all(self, signum):
        with self.lock:
            for worker in self.running():
                self.stop_worker(worker, signum)

    def shut_down(self, message):
        with self.lock:
            for worker in self.running():
                if worker.pending is not None:
                    self.answer(worker, {"kind": "end", "reason": message})
        if message is not None:
            self.say("job failed: " + message)
        self.stop_all(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop_all(signal.SIGKILL)
        for t in self.threads:
            t.join(timeout=5)
        for f in self.logs:
            f.close()
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()
        processes.remove_shared_memory(self.job_id)


def launch(args, job_id, base):
    driver = ElasticDriver(args, job_id, base)

    def forward(signum, _frame):
        driver.log("forwarding signal %d to every worker" % signum)
        with driver.lock:
            driver.end(128 + signum, "stopped by signal %d" % signum)
            driver.lock.notify_all()

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return driver.run()
