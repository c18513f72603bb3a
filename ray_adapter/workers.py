"""unison's ranks as Ray actors: the actor, where Ray placed each one, and
the environment that makes a set of actors one unison job.

A rank's identity is what unisonrun would have given it (UNISON_RANK and
the rest, Horovod's names too), computed from the node Ray placed each
actor on:

- each Ray node is one host (named by its address and node id, so that
  two raylets on one machine, as in a test cluster, are two hosts): the
  ranks of a node share memory, and ranks are numbered node by node;
- across nodes, unison's TCP plane. Rank 0's actor picks the rendezvous
  port on its node, and the driver makes a fresh secret for the job, which
  reaches the actors through Ray's own calls: whoever can send those can
  already run any code on the cluster, so the secret is as safe as the Ray
  cluster is, and no ssh or MPI is needed;
- with GPUs, every actor of a node sees the GPUs Ray gave that node's
  actors, in local-rank order, as Horovod's Ray executor did, so that
  `torch.cuda.set_device(hvd.local_rank())` picks the rank's own GPU and
  NCCL can see its neighbours'.
"""
import os
import secrets

import ray

from unison import engine_worker, network
from unison.runner import rank_environment
from unison.runner.processes import new_job_id, remove_shared_memory


def this_place():
    """Where Ray put this process: its node's id and address, and the GPUs
    Ray gave it."""
    context = ray.get_runtime_context()
    return {"node": context.get_node_id(), "address": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}


def stop_here(job_id):
    """Ends this rank's unison (if a call left it running) and removes any
    shared memory of the job left on this node."""
    from unison import basics
    if basics.is_initialized():
        basics.shutdown()
    remove_shared_memory(job_id)


class Worker:
    """One rank: a Ray actor that runs what the driver sends it. A process
    of its own, so it holds unison as any rank does, for as many calls as
    the driver makes."""

    def __init__(self):
        self.executable = None

    def place(self):
        return this_place()

    def rendezvous_port(self, address):
        """A port free on this node, for rank 0's rendezvous."""
        return network.a_port_nobody_takes_by_chance(address)

    def update_env_vars(self, env):
        os.environ.update(env)

    def start_executable(self, job_id, executable_cls=None, executable_args=None, executable_kwargs=None):
        os.environ["UNISON_JOB_ID"] = job_id
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, job_id, fn):
        """fn(the executable object, or None), as a job named job_id: each
        call the driver makes is a job of its own (see RayExecutor), which
        an init() in fn joins."""
        os.environ["UNISON_JOB_ID"] = job_id
        with engine_worker.leaving_the_job_on_error():
            return fn(self.executable)

    def run_as_elastic_worker(self, fn, args, kwargs):
        return engine_worker.run_as_elastic_worker(fn, args, kwargs)

    def stop(self, job_id):
        stop_here(job_id)


def host_name(place):
    """The unison host of an actor at `place` (Worker.place): its Ray node."""
    return "%s/%s" % (place["address"], place["node"][:12])


def in_node_order(places):
    """The indexes of `places`, reordered so that the actors of each node
    are together, nodes in the order of their first actor: unison's rank
    order, with each host's ranks consecutive, as unisonrun numbers them."""
    hosts = [host_name(p) for p in places]
    nodes = list(dict.fromkeys(hosts))
    return [i for node in nodes for i, host in enumerate(hosts) if host == node]


def job_environments(places, rendezvous_port=None, extra=None, timeout_s=None, network_interface=None,
                     job_id=None):
    """Each rank's environment for a job whose rank r is the actor at
    places[r] (rank order: in_node_order), and the job's id.
    rendezvous_port: a port free on rank 0's node, needed when the ranks
    span nodes."""
    hosts = [host_name(p) for p in places]
    job_id = job_id or "ray-" + new_job_id()
    job = dict(extra or {})
    job["UNISON_JOB_ID"] = job_id
    if timeout_s is not None:
        job["UNISON_START_TIMEOUT"] = str(timeout_s)
    if network_interface:
        job["UNISON_NETWORK_INTERFACE"] = network_interface
    if len(set(hosts)) > 1:
        if rendezvous_port is None:
            raise ValueError("a job across Ray nodes needs a rendezvous port on rank 0's node")
        job.update({"UNISON_RENDEZVOUS_ADDR": places[0]["address"], "UNISON_RENDEZVOUS_PORT": str(rendezvous_port),
                    "UNISON_SECRET_KEY": secrets.token_hex(32)})
    environments = []
    for place, identity in zip(places, rank_environment.placed_identities(hosts)):
        env = dict(job, **identity)
        gpus = [g for p in places if host_name(p) == host_name(place) for g in p["gpus"]]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        environments.append(env)
    return environments, job_id
