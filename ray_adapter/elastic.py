"""An elastic unison job on Ray: RayExecutor(min_workers=..., max_workers=...).run(fn).

It is unisonrun's elastic driver (runner/elastic_driver.py), with Ray in the
place of the discovery script and of ssh:

- the hosts are Ray's alive nodes, each with as many slots as its CPUs (and
  GPUs, with use_gpu) hold workers of cpus_per_worker (gpus_per_worker),
  looked at every second: a node that joins the cluster grows the job, one
  that leaves it shrinks the job;
- each worker is an actor pinned to its node, running fn(*args, **kwargs)
  as a worker process runs its script. fn calls init() and trains under
  hvd.elastic.run, as under unisonrun: a round's ranks roll back to their
  last commit when a member is lost, and newcomers get the state from
  rank 0;
- an actor that dies (its process killed, its node lost) is a worker that
  failed: its node is blacklisted, for cooldown_range's time or for good,
  as unisonrun blacklists a failed worker's host;
- the job ends when a member of the last round returns, and run() returns
  what that round's ranks returned, in rank order; a job that fails raises
  RuntimeError with the driver's reason and the first failed worker's
  traceback.

Actors of an elastic job are started per run(), one per slot a round uses.
With GPUs each actor sees the GPU Ray gave it, as device 0: the actors of a
node change from round to round, so they cannot share one device list.
"""
import sys
import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from unison import network
from unison.ray import workers as ray_workers
from unison.runner import command_line
from unison.runner.elastic_driver import ElasticDriver
from unison.runner.processes import new_job_id


class ActorProcess:
    """A worker actor running its function, as the driver waits for and
    stops a worker's process (elastic_driver.WorkerProcess)."""

    def __init__(self, actor, finished, on_outcome):
        self.actor, self.finished, self.on_outcome = actor, finished, on_outcome

    def wait(self):
        try:
            outcome = ray.get(self.finished)
        except ray.exceptions.RayError as e:  # the actor's process or node is gone
            outcome = {"code": -9, "error": "its Ray actor died: %s" % str(e).strip().splitlines()[0]}
        self.on_outcome(outcome)
        return outcome["code"]

    def stop(self, signum):
        ray.kill(self.actor, no_restart=True)


class RayElasticDriver(ElasticDriver):
    def __init__(self, executor, fn, args, kwargs):
        options = executor.elastic_options
        min_workers = options["min_workers"] or 1
        max_workers = options["max_workers"] or max(executor.num_workers, min_workers)
        argv = ["-np", str(max(min_workers, min(executor.num_workers, max_workers))),
                "--min-np", str(min_workers), "--max-np", str(max_workers),
                "--elastic-timeout", str(options["elastic_timeout"]),
                "--host-discovery-script", "(Ray's nodes)"]
        if options["reset_limit"] is not None:
            argv += ["--reset-limit", str(options["reset_limit"])]
        if options["cooldown_range"] is not None:
            argv += ["--blacklist-cooldown-range"] + [str(s) for s in options["cooldown_range"]]
        argv.append("(fn)")
        super().__init__(command_line.parse(argv), "ray-" + new_job_id(), {})
        self.executor, self.call = executor, (fn, args, kwargs)
        self.nodes = {}  # host -> Ray node id
        self.outcomes = {}  # worker name -> its last run's outcome
        self.actors = []
        self.actors_lock = threading.Lock()

    def hosts_are_fixed(self):
        return False

    def say(self, message):
        sys.stderr.write("unison.ray: %s\n" % message)
        sys.stderr.flush()

    def discover(self):
        executor = self.executor
        hosts = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            slots = int(resources.get("CPU", 0) // executor.cpus_per_worker) if executor.cpus_per_worker else 1 << 20
            if executor.gpus_per_worker:
                slots = min(slots, int(resources.get("GPU", 0) // executor.gpus_per_worker))
            if slots > 0:
                host = ray_workers.host_name({"address": node["NodeManagerAddress"], "node": node["NodeID"]})
                hosts[host] = slots
                self.nodes[host] = node["NodeID"]
        return hosts

    def is_local(self, host):
        return super().is_local(host.partition("/")[0])

    def driver_address_for(self, host):
        return "127.0.0.1" if self.is_local(host) else network.route_source(host.partition("/")[0])

    def launch(self, name, host, identity):
        executor = self.executor
        extra = executor._started_elastic
        env = dict(extra, UNISON_START_TIMEOUT=str(executor.settings.timeout_s), **identity)
        interface = network.one_interface(executor.settings.nics, "unison.ray")
        if interface:
            env["UNISON_NETWORK_INTERFACE"] = interface
        actor = ray.remote(ray_workers.Worker).options(
            num_cpus=executor.cpus_per_worker, num_gpus=executor.gpus_per_worker,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.nodes[host], soft=False)).remote()
        with self.actors_lock:
            self.actors.append(actor)
        self.log("starting worker %s as a Ray actor" % name)
        actor.update_env_vars.remote(env)  # a Ray actor runs its calls in the order they were made
        fn, args, kwargs = self.call
        finished = actor.run_as_elastic_worker.remote(fn, args, kwargs)

        def keep(outcome):
            self.outcomes[name] = outcome
        return ActorProcess(actor, finished, keep)

    def kill_actors(self):
        with self.actors_lock:
            actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)


def run(executor, fn, args, kwargs):
    """Runs the elastic job to its end (see the module)."""
    driver = RayElasticDriver(executor, fn, args, kwargs)
    try:
        status = driver.run()
    finally:
        driver.kill_actors()
    if status != 0:
        failed = [(name, o) for name, o in driver.outcomes.items() if o["code"] != 0 and o.get("error")]
        detail = "" if not failed else "\nworker %s: %s" % (failed[0][0], failed[0][1]["error"])
        raise RuntimeError("unison.ray: the elastic job failed: %s%s" % (driver.failure[1], detail))
    return [driver.outcomes[name]["result"] for name in driver.members]
