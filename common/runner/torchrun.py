"""Ranks that torchrun started, and so every engine that runs torchrun:
Kubeflow's PyTorchJob, TorchX, SageMaker, Spark's TorchDistributor.

torchrun tells each worker who it is in its own names: RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (its agent, one per node) and
GROUP_WORLD_SIZE, with MASTER_ADDR:MASTER_PORT, where the agent of the
first node serves torch's key-value store (TORCHELASTIC_USE_AGENT_STORE),
and TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT. init() turns them
into unison's identity (adopt) before the core starts, as unisonrun would
have set it:

- the ranks of one agent are one host, named after the machine and the
  agent: they share memory, and ranks of two agents on one machine (a
  test's, or two jobs' ranks) do not;
- across agents, the TCP plane: rank 0 picks the port it will listen on
  and a fresh secret, and puts both in the agent's store, where every
  other rank reads them. Whoever can reach that store can already join
  torch's own process groups, which trust it entirely: the secret is as
  safe as the job's torch.distributed is, and no ssh is needed;
- each restart (--max-restarts) is a job of its own: the job's id, and so
  its shared memory and its store keys, carry the restart count, so a
  restarted worker never meets what an earlier attempt left.

Only where unison's own launcher did not start the process (UNISON_RANK
unset), and outside an elastic unisonrun job.
"""
import datetime
import hashlib
import os
import secrets
import socket

from unison import exceptions, network
from unison.runner import rank_environment

# torchrun's variables that init() needs, each an integer.
_COUNTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def started_by_torchrun(env=None):
    """Whether this process is a torchrun worker that unison's launcher did
    not start."""
    env = os.environ if env is None else env
    return "TORCHELASTIC_RUN_ID" in env and "RANK" in env and "UNISON_RANK" not in env


def _count(env, name):
    value = env.get(name)
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise exceptions.UnsupportedError("unison: %s=%r: torchrun sets it to a whole number of at least 0, and "
                                          "unison.init() reads it to place this rank" % (name, value))
    return number


def identity(env):
    """unison's identity (UNISON_RANK and the rest, Horovod's names too) for
    the torchrun worker whose environment is `env`, without the rendezvous."""
    rank, size, local_rank, local_size, node = (_count(env, name) for name in _COUNTS)
    nodes = _count(env, "GROUP_WORLD_SIZE") if "GROUP_WORLD_SIZE" in env else max(1, size // max(local_size, 1))
    if not (rank < size and local_rank < local_size <= size and node < nodes):
        raise exceptions.UnsupportedError(
            "unison: torchrun's RANK=%d, WORLD_SIZE=%d, LOCAL_RANK=%d, LOCAL_WORLD_SIZE=%d, GROUP_RANK=%d and "
            "GROUP_WORLD_SIZE=%d do not describe one place in one job" % (rank, size, local_rank, local_size,
                                                                           node, nodes))
    attempt = "%s/%s" % (env["TORCHELASTIC_RUN_ID"], env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return rank_environment.with_horovods_names({
        "UNISON_RANK": str(rank), "UNISON_SIZE": str(size),
        "UNISON_LOCAL_RANK": str(local_rank), "UNISON_LOCAL_SIZE": str(local_size),
        # torchrun gives every node the same number of workers, so the n-th
        # worker of each node is on every node.
        "UNISON_CROSS_RANK": str(node), "UNISON_CROSS_SIZE": str(nodes),
        # A run id is the user's text (--rdzv-id): hashed, it names shared
        # memory safely, and the restart count makes each attempt a job.
        "UNISON_JOB_ID": "torchrun-" + hashlib.sha256(attempt.encode()).hexdigest()[:16],
        "UNISON_HOSTNAME": "%s-node%d" % (socket.gethostname(), node),
    })


def _agent_store(env, timeout_seconds):
    """The key-value store that torchrun's first agent serves."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        raise exceptions.UnsupportedError(
            "unison: TORCHELASTIC_USE_AGENT_STORE=%r: a job across torchrun's nodes agrees on its rendezvous "
            "through the store torchrun's agent serves, which this torchrun does not offer"
            % env.get("TORCHELASTIC_USE_AGENT_STORE"))
    from torch.distributed import TCPStore  # torchrun implies torch
    host, port = env.get("MASTER_ADDR"), _count(env, "MASTER_PORT")
    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_seconds))


def rendezvous(env, ids, timeout_seconds):
    """UNISON_RENDEZVOUS_ADDR, _PORT and UNISON_SECRET_KEY for a job across
    torchrun's nodes: rank 0 chooses them and puts them in the agent's
    store, the others read them there."""
    store = _agent_store(env, timeout_seconds)
    key = "unison/%s/rendezvous" % ids["UNISON_JOB_ID"]
    if ids["UNISON_RANK"] == "0":
        address = network.route_source(env["MASTER_ADDR"])
        port = network.a_port_nobody_takes_by_chance(address)
        store.set(key, "%s %d %s" % (address, port, secrets.token_hex(32)))
    address, port, secret = store.get(key).decode().split(" ")
    return {"UNISON_RENDEZVOUS_ADDR": address, "UNISON_RENDEZVOUS_PORT": port, "UNISON_SECRET_KEY": secret}


def adopt(env=None, timeout_seconds=None):
    """Sets this torchrun worker's unison identity in `env` (os.environ),
    for the core to read at init."""
    env = os.environ if env is None else env
    ids = identity(env)
    if int(ids["UNISON_CROSS_SIZE"]) > 1:
        if timeout_seconds is None:
            try:  # the core checks the setting itself, and names a bad one
                timeout_seconds = float(env.get("UNISON_START_TIMEOUT", env.get("HOROVOD_START_TIMEOUT", "")))
            except ValueError:
                timeout_seconds = 60.0  # the core's default
        ids.update(rendezvous(env, ids, timeout_seconds))
    env.update(ids)
