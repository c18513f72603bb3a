"""RayExecutor: Horovod's Ray API, running unison's ranks as Ray actors.

    import ray
    from unison.ray import RayExecutor

    ray.init()
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=4, cpus_per_worker=1)
    executor.start()
    results = executor.run(train, kwargs={"lr": 0.01})   # [rank 0's return value, rank 1's, ...]
    executor.shutdown()

Ray places the actors (a placement group: packed with num_workers, or
num_workers_per_host on each of num_hosts nodes); workers.py makes them one
unison job. `fn` calls init() as under unisonrun. With min_workers or
max_workers the job is elastic (elastic.py): run(fn) starts it, and its
workers come and go with Ray's nodes.
"""
from dataclasses import dataclass
from typing import Optional

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from unison import exceptions, network
from unison.ray import workers as ray_workers


@dataclass
class RayExecutorSettings:
    """What RayExecutor.create_settings returns (Horovod's MiniSettings).

    timeout_s: how long the ranks wait for each other at init()
    (UNISON_START_TIMEOUT). placement_group_timeout_s: how long start()
    waits for Ray to find the resources asked for. nics: the network
    interface the ranks' TCP plane uses across nodes."""
    timeout_s: float = 30
    """Seconds the ranks wait for each other at init() (UNISON_START_TIMEOUT)."""
    placement_group_timeout_s: float = 100
    """Seconds start() waits for Ray to find the resources asked for."""
    nics: Optional[object] = None
    """The network interface the ranks' TCP plane uses across nodes (one name), or None for the one that reaches rank 0."""
    ssh_identity_file: Optional[str] = None
    """Horovod's; unused, since unison's ranks meet over TCP with no ssh between nodes."""
    ssh_str: Optional[str] = None
    """Horovod's; unused, as ssh_identity_file."""


class RayExecutor:
    """A unison job on a Ray cluster: num_workers actors packed where Ray
    finds room, or num_workers_per_host on each of num_hosts nodes.
    cpus_per_worker, use_gpu and gpus_per_worker are each actor's resources.
    A placement group the caller runs in (a Ray Tune trial's) is used when
    use_current_placement_group is True. min_workers/max_workers make the
    job elastic (see run())."""

    @classmethod
    def create_settings(cls, timeout_s=30, ssh_identity_file=None, ssh_str=None, placement_group_timeout_s=100,
                        nics=None):
        """Settings for RayExecutor. ssh_identity_file and ssh_str are
        accepted for Horovod's scripts and unused: unison's ranks meet over
        TCP, with no ssh between nodes."""
        if not timeout_s or timeout_s <= 0:
            raise ValueError("RayExecutor.create_settings: timeout_s=%r: give a number of seconds, more than 0"
                             % (timeout_s,))
        network.one_interface(nics, "RayExecutor.create_settings")  # refused here, not at start()
        return RayExecutorSettings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s,
                                   nics=nics, ssh_identity_file=ssh_identity_file, ssh_str=ssh_str)

    def __init__(self, settings=None, num_workers=None, num_hosts=None, num_workers_per_host=1, cpus_per_worker=1,
                 use_gpu=False, gpus_per_worker=None, use_current_placement_group=True, min_workers=None,
                 max_workers=None, reset_limit=None, cooldown_range=None, elastic_timeout=1200,
                 override_discovery=True):
        if gpus_per_worker and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker=%r needs use_gpu=True" % (gpus_per_worker,))
        self.settings = settings or RayExecutorSettings()
        self.elastic = min_workers is not None or max_workers is not None
        if self.elastic:
            if num_hosts is not None:
                raise ValueError("RayExecutor: an elastic job (min_workers/max_workers) places workers where Ray "
                                 "has room as nodes come and go; give num_workers, not num_hosts")
            num_workers = num_workers if num_workers is not None else (min_workers or max_workers)
        elif num_workers is None and num_hosts is None:
            raise ValueError("RayExecutor: give num_workers, or num_hosts with num_workers_per_host")
        elif num_workers is not None and num_hosts is not None:
            raise ValueError("RayExecutor: give num_workers or num_hosts, not both")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host), ("min_workers", min_workers),
                            ("max_workers", max_workers)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError("RayExecutor: %s=%r: give a whole number of at least 1" % (name, value))
        self.num_workers, self.num_hosts, self.num_workers_per_host = num_workers, num_hosts, num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.elastic_options = dict(min_workers=min_workers, max_workers=max_workers, reset_limit=reset_limit,
                                    cooldown_range=cooldown_range, elastic_timeout=elastic_timeout,
                                    override_discovery=override_discovery)
        self.workers = []  # actors in rank order
        self.job_id = None
        self._calls = 0  # the driver's calls into the actors so far: each is a job of its own
        self._placement_group = None  # the one start() made, removed by shutdown()
        self._started_elastic = None  # for an elastic job, once start() ran: extra_env_vars, for run()

    # ---- starting ------------------------------------------------------------------

    def _resources(self):
        return {"num_cpus": self.cpus_per_worker, "num_gpus": self.gpus_per_worker}

    def _placement(self):
        """(placement group, the bundle index of each actor)."""
        per_worker = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            per_worker["GPU"] = self.gpus_per_worker
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            # A Tune trial's group: the actors go in its bundles, in order.
            count = self.num_workers or self.num_hosts * self.num_workers_per_host
            return current, [i % len(current.bundle_specs) for i in range(count)]
        if self.num_workers is not None:
            group = placement_group([per_worker] * self.num_workers, strategy="PACK")
            bundles = list(range(self.num_workers))
        else:
            per_host = {k: v * self.num_workers_per_host for k, v in per_worker.items()}
            group = placement_group([per_host] * self.num_hosts, strategy="STRICT_SPREAD")
            bundles = [i // self.num_workers_per_host for i in range(self.num_hosts * self.num_workers_per_host)]
        self._placement_group = group
        ready = group.ready()
        done, _ = ray.wait([ready], timeout=self.settings.placement_group_timeout_s)
        if not done:
            remove_placement_group(group)
            self._placement_group = None
            raise TimeoutError(
                "RayExecutor.start: Ray found no room for %s within %g s (placement_group_timeout_s): the "
                "cluster has %s" % (self._asked(), self.settings.placement_group_timeout_s,
                                    ray.cluster_resources()))
        return group, bundles

    def _asked(self):
        each = "%g CPU%s" % (self.cpus_per_worker, " and %g GPU" % self.gpus_per_worker if self.gpus_per_worker else "")
        if self.num_workers is not None:
            return "%d workers of %s" % (self.num_workers, each)
        return "%d workers of %s on each of %d nodes" % (self.num_workers_per_host, each, self.num_hosts)

    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None, extra_env_vars=None):
        """Starts the actors and makes them one unison job; each then builds
        executable_cls(*executable_args, **executable_kwargs), the object
        execute() passes to its fn. extra_env_vars are set in every actor
        first."""
        if self.workers:
            raise RuntimeError("RayExecutor.start: already started; shutdown() first")
        if self.elastic:
            if executable_cls is not None:
                raise NotImplementedError(
                    "RayExecutor.start: an elastic job's workers change from round to round, so it has no "
                    "executable_cls objects to call: give run(fn) all it needs")
            # The actors of an elastic job come and go with its rounds: run() starts them.
            self._started_elastic = dict(extra_env_vars or {})  # the variables every worker gets
            return
        group, bundles = self._placement()
        actor = ray.remote(ray_workers.Worker)
        actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle),
                                **self._resources()).remote() for bundle in bundles]
        try:
            places = ray.get([a.place.remote() for a in actors])
            order = ray_workers.in_node_order(places)
            actors, places = [actors[i] for i in order], [places[i] for i in order]
            port = None
            if len({ray_workers.host_name(p) for p in places}) > 1:
                port = ray.get(actors[0].rendezvous_port.remote(places[0]["address"]))
            environments, self.job_id = ray_workers.job_environments(
                places, port, extra=extra_env_vars, timeout_s=self.settings.timeout_s,
                network_interface=network.one_interface(self.settings.nics, "unison.ray"))
            ray.get([a.update_env_vars.remote(env) for a, env in zip(actors, environments)])
            self.workers = actors
            job = self._next_job_id()
            ray.get([a.start_executable.remote(job, executable_cls, executable_args, executable_kwargs)
                     for a in actors])
        except BaseException:
            self.workers = []
            for a in actors:
                ray.kill(a)
            self._remove_placement_group()
            raise

    # ---- running ---------------------------------------------------------------------

    def _next_job_id(self):
        """The job id of the driver's next call into the actors. Each call
        the ranks make together is a job of its own, named alike on every
        rank, so that whatever an earlier call left (a rank that failed
        before its init(), or one that init()ed twice) cannot set the ranks'
        counts of their inits apart and keep them from meeting."""
        self._calls += 1
        return "%s-c%d" % (self.job_id, self._calls)

    def _started(self, method):
        if self.elastic:
            raise NotImplementedError(
                "RayExecutor.%s: an elastic job's workers change from round to round, so it runs one function "
                "from start to end: use run(fn, args, kwargs)" % method)
        if not self.workers:
            raise RuntimeError("RayExecutor.%s: call start() first" % method)

    def execute(self, fn):
        """fn(executable) on every rank; their return values in rank order."""
        self._started("execute")
        job = self._next_job_id()
        return _results([w.execute.remote(job, fn) for w in self.workers])

    def execute_single(self, fn):
        """fn(executable) on rank 0 only; its return value."""
        self._started("execute_single")
        return ray.get(self.workers[0].execute.remote(self._next_job_id(), fn))

    def run_remote(self, fn, args=None, kwargs=None):
        """fn(*args, **kwargs) on every rank; the Ray object refs of their
        return values, in rank order."""
        self._started("run_remote")
        args, kwargs = list(args or []), dict(kwargs or {})
        job = self._next_job_id()
        return [w.execute.remote(job, _Call(fn, args, kwargs)) for w in self.workers]

    def run(self, fn, args=None, kwargs=None):
        """fn(*args, **kwargs) on every rank; their return values in rank
        order. In an elastic job, the whole job: see elastic.py."""
        if self.elastic:
            if self._started_elastic is None:
                raise RuntimeError("RayExecutor.run: call start() first")
            from unison.ray import elastic
            return elastic.run(self, fn, list(args or []), dict(kwargs or {}))
        return _results(self.run_remote(fn, args, kwargs))

    # ---- ending ----------------------------------------------------------------------

    def _remove_placement_group(self):
        group, self._placement_group = self._placement_group, None
        if group is not None:
            remove_placement_group(group)

    def shutdown(self):
        """Ends unison in every actor, then the actors and their placement."""
        actors, self.workers = self.workers, []
        if actors:
            stopping = [a.stop.remote(self.job_id) for a in actors]
            ray.wait(stopping, num_returns=len(stopping), timeout=30)
            for a in actors:
                ray.kill(a)
        self._remove_placement_group()
        self._started_elastic = None


def _results(refs):
    """The values of `refs` (one per rank, in rank order), or the error of
    the rank whose failure is the cause. A rank that fails leaves the job
    (engine_worker.leaving_the_job_on_error), so the others' collectives
    then fail too, each naming it, and their errors can reach the driver
    before its own: once one call has failed, the others get a few seconds
    to end, and the error raised is the first that is not a peer's loss
    (ShutDownError, RankFailedError), with a note naming its rank."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayError:
            break
    else:
        return ray.get(refs)
    ray.wait(pending, num_returns=len(pending), timeout=_PEERS_GRACE_SECONDS)
    failures = []
    for rank, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            continue  # still running: not what failed
        except ray.exceptions.RayError as e:
            failures.append((isinstance(e, (exceptions.ShutDownError, exceptions.RankFailedError)), rank, e))
    _, rank, error = min(failures, key=lambda f: (f[0], f[1]))
    error.add_note("unison.ray: rank %d of %d failed%s" % (
        rank, len(refs), "" if len(failures) == 1 else "; ranks %s failed after losing it"
        % [r for _, r, _ in sorted(failures, key=lambda f: f[1]) if r != rank]))
    raise error


# How long the other ranks get to end once one has failed (their
# collectives fail at once, naming it) before run() raises.
_PEERS_GRACE_SECONDS = 10


class _Call:
    """fn(*args, **kwargs), as a function of the executable (which it
    ignores), for Worker.execute. A class, not a closure, so that it
    pickles by reference where fn does."""

    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __call__(self, _executable):
        return self.fn(*self.args, **self.kwargs)
